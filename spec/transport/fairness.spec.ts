/**
 * Fair, linear per-connection cost (issue 12): tiny frames cost linear CPU, one client flooding
 * 1-byte frames does not delay other streams, the message-rate limit closes 1008. Real servers
 * spawned as processes, real sockets.
 */
import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it, onTestFinished } from 'vitest';
import WebSocket from 'ws';
import { defaultCatalog } from '../../runtime/catalog.js';
import { treeCpuSeconds } from '../../tools/proc.js';
import { spawnServer } from '../../tools/spawn-server.js';
import { fixture } from '../helpers.js';

const silero = defaultCatalog().find((m) => m.id === 'silero-vad')!.path;

/** Spawns `voxserve serve` with this config (JSON); killed when the test ends. */
async function serve(config: Record<string, unknown>): Promise<{ url: string; pid: number }> {
  const file = join(mkdtempSync(join(tmpdir(), 'voxserve-fair-')), 'config.json');
  writeFileSync(file, JSON.stringify({ port: 0, log_level: 'silent', ...config }));
  const { child, url } = await spawnServer(['--config', file]);
  onTestFinished(() => void child.kill('SIGKILL'));
  return { url, pid: child.pid! };
}

/** 16 kHz mono s16 PCM of `seconds` of the spoken sentence, looped. */
function speech(seconds: number): Buffer {
  const one = fixture('espeak_sentence_16k.wav').subarray(44);
  const out = Buffer.alloc(32_000 * seconds);
  for (let o = 0; o < out.length; o += one.length) one.copy(out, o, 0, Math.min(one.length, out.length - o));
  return out;
}

/** Streams `pcm` at once in frames of `frameBytes`, then `end`; resolves with the close code and `done`. */
function streamAll(url: string, model: string, pcm: Buffer, frameBytes: number): Promise<{ code: number; reason: string; done: any }> {
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(`${url.replace('http', 'ws')}/v1/stream?model=${model}`);
    let done: any = null;
    ws.on('error', reject);
    ws.on('message', (d) => {
      const e = JSON.parse(d.toString());
      if (e.type === 'done') done = e;
      if (e.type !== 'ready') return;
      for (let o = 0; o < pcm.length; o += frameBytes) ws.send(pcm.subarray(o, o + frameBytes));
      ws.send(JSON.stringify({ type: 'end' }));
    });
    ws.on('close', (code, reason) => resolve({ code, reason: reason.toString(), done }));
  });
}

describe('tiny frames', () => {
  it('2-byte frames cost linear server CPU: 16 s of audio costs well under 4x 8 s (quadratic would be 4x)', async () => {
    const { url, pid } = await serve({ limits: { idle_ms: 0, heartbeat_ms: 0, ws_max_messages_per_s: 0 } });
    const cpu = async (seconds: number): Promise<number> => {
      const before = treeCpuSeconds(pid);
      const r = await streamAll(url, 'silero-vad', speech(seconds), 2);
      expect(r.code).toBe(1000);
      expect(r.done.processed_ms).toBe(seconds * 1000);
      return treeCpuSeconds(pid) - before;
    };
    await cpu(1); // load the model, warm up the JIT
    const short = await cpu(8);
    const long = await cpu(16);
    console.log(`server CPU for 2-byte frames: 8 s of audio ${short.toFixed(2)} s, 16 s ${long.toFixed(2)} s, ratio ${(long / short).toFixed(2)}`);
    expect(long / short).toBeLessThan(3);
  });
});
