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
import { defaultCatalog } from '../../runtime/config.js';
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
function streamAll(
  url: string,
  model: string,
  pcm: Buffer,
  frameBytes: number,
): Promise<{ code: number; reason: string; done: any }> {
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
  it('2-byte frames cost linear server CPU: 16 s of audio costs under 8x 4 s (linear 4x, quadratic 16x)', async () => {
    const { url, pid } = await serve({ limits: { idle_ms: 0, heartbeat_ms: 0, ws_max_messages_per_s: 0 } });
    const cpu = async (seconds: number): Promise<number> => {
      const before = treeCpuSeconds(pid);
      const r = await streamAll(url, 'silero-vad', speech(seconds), 2);
      expect(r.code).toBe(1000);
      expect(r.done.processed_ms).toBe(seconds * 1000);
      return treeCpuSeconds(pid) - before;
    };
    await cpu(1); // load the model, warm up the JIT
    const short = await cpu(4);
    const long = await cpu(16);
    console.log(
      `server CPU for 2-byte frames: 4 s of audio ${short.toFixed(2)} s, 16 s ${long.toFixed(2)} s, ratio ${(long / short).toFixed(2)}`,
    );
    // The geometric middle of 4x and 16x: a factor of 2 of noise either way (8 s against 16 s,
    // with 3 between 2x and 4x, failed once in a clean CI run at 3.19 where another read 1.43).
    expect(long / short).toBeLessThan(8);
  });
});

/** Streams `pcm` in 100 ms frames in real time, then `end`; resolves with the close code. */
function streamRealtime(url: string, model: string, pcm: Buffer): Promise<number> {
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(`${url.replace('http', 'ws')}/v1/stream?model=${model}`);
    ws.on('error', reject);
    ws.on('message', async (d) => {
      if (JSON.parse(d.toString()).type !== 'ready') return;
      const t0 = performance.now();
      for (let i = 0; i * 3200 < pcm.length; i++) {
        await new Promise((r) => setTimeout(r, Math.max(0, t0 + i * 100 - performance.now())));
        ws.send(pcm.subarray(i * 3200, (i + 1) * 3200));
      }
      ws.send(JSON.stringify({ type: 'end' }));
    });
    ws.on('close', (code) => resolve(code));
  });
}

/**
 * One client that sends `ms` of audio (16 kHz s16) in 1-byte frames in real time (32,000 frames a
 * second), then `end`. Its frames are built once and written to the
 * socket raw (7 bytes each: a masked binary frame with mask key 0), so that the client itself
 * costs next to no CPU on this shared machine and the server's cost is what shows. Resolves with
 * its close code and reason.
 */
function tinyFrames(url: string, ms: number): Promise<{ code: number; reason: string }> {
  const second = Buffer.alloc(32_000 * 7);
  for (let o = 0; o < second.length; o += 7) second.set([0x82, 0x81, 0, 0, 0, 0, 1], o);
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(`${url.replace('http', 'ws')}/v1/stream?model=silero-vad`);
    ws.on('error', reject);
    ws.on('close', (code, reason) => resolve({ code, reason: reason.toString() }));
    ws.on('message', async (d) => {
      if (JSON.parse(d.toString()).type !== 'ready') return;
      const socket = (ws as unknown as { _socket: { write(b: Buffer): boolean } })._socket;
      const t0 = performance.now();
      let sent = 0;
      while (ws.readyState === WebSocket.OPEN && sent < ms * 32) {
        const due = Math.floor(Math.min(ms, performance.now() - t0) * 32);
        while (sent < due) {
          const at = sent % 32_000;
          const n = Math.min(due - sent, 32_000 - at);
          socket.write(second.subarray(at * 7, (at + n) * 7));
          sent += n;
        }
        await new Promise((r) => setTimeout(r, 10));
      }
      if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: 'end' }));
    });
  });
}

describe('fairness', () => {
  it('one client sending 1-byte frames raises the processing-lag p99 of 20 real-time streams by at most 20 ms', async () => {
    // Rounds alternate without and with the tiny-frame client, each on a model of its own (its
    // own lag ring); the least disturbed round of each kind is compared, so that other load on
    // the machine (it is shared) does not decide the outcome. No message-rate limit: the client
    // sends 32,000 frames a second beside the streams throughout; the per-frame cost is measured.
    const ROUNDS = 3;
    const ids = Array.from({ length: ROUNDS }, (_, i) => [`alone-${i}`, `beside-${i}`]).flat();
    const { url } = await serve({
      limits: { ws_max_messages_per_s: 0 },
      models: [...ids, 'silero-vad'].map((id) => ({ id, task: 'vad', path: silero, lazy: false })),
    });
    const p99 = async (model: string): Promise<number> =>
      (await (await fetch(`${url}/v1/models/${model}`)).json()).processing_lag_ms.p99;
    const twenty = async (model: string, seconds: number) =>
      expect(await Promise.all(Array.from({ length: 20 }, () => streamRealtime(url, model, speech(seconds))))).toEqual(
        Array(20).fill(1000),
      );
    for (const id of ids) await streamRealtime(url, id, speech(1)); // first runs are slow: warm up
    const alone: number[] = [];
    const beside: number[] = [];
    for (let i = 0; i < ROUNDS; i++) {
      await twenty(`alone-${i}`, 3);
      alone.push(await p99(`alone-${i}`));
      const [, tiny] = await Promise.all([twenty(`beside-${i}`, 3), tinyFrames(url, 3000)]);
      expect(tiny).toEqual({ code: 1000, reason: 'done' });
      beside.push(await p99(`beside-${i}`));
    }
    const [a, b] = [Math.min(...alone), Math.min(...beside)];
    console.log(
      `processing-lag p99 of 20 real-time streams, best of ${ROUNDS} rounds: ${a.toFixed(1)} ms alone (${alone.map((x) => x.toFixed(1)).join(', ')}), ` +
        `${b.toFixed(1)} ms beside one client sending 1-byte frames (${beside.map((x) => x.toFixed(1)).join(', ')})`,
    );
    expect(b - a).toBeLessThanOrEqual(20);
  }, 180_000);

  it('limits.ws_max_messages_per_s: a client flooding 1-byte frames is closed 1008 naming the limit; another stream is served meanwhile', async () => {
    const { url } = await serve({});
    const flooded = new Promise<{ code: number; reason: string; events: any[] }>((resolve) => {
      const ws = new WebSocket(`${url.replace('http', 'ws')}/v1/stream?model=silero-vad`);
      const one = Buffer.alloc(1, 1);
      const events: any[] = [];
      ws.on('close', (code, reason) => resolve({ code, reason: reason.toString(), events }));
      ws.on('message', async (d) => {
        events.push(JSON.parse(d.toString()));
        if (events.length > 1) return;
        while (ws.readyState === WebSocket.OPEN) {
          if (ws.bufferedAmount < 65536) for (let i = 0; i < 500; i++) ws.send(one);
          await new Promise((r) => setTimeout(r, 1));
        }
      });
    });
    const [normal, f] = await Promise.all([streamRealtime(url, 'silero-vad', speech(2)), flooded]);
    expect(f.code).toBe(1008);
    expect(f.reason).toBe('too many messages: over limits.ws_max_messages_per_s (1000)');
    expect(f.events.at(-1)).toMatchObject({
      type: 'error',
      error: { type: 'invalid_request_error', code: 'stream_flooded', message: f.reason },
    });
    expect(normal).toBe(1000);
  });
});
