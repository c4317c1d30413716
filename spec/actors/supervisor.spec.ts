/** Supervisor regression tests (C11-C14) on the real server, with synthetic models of known size and run time. */
import { mkdtempSync, statSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import WebSocket from 'ws';
import { ServerConfig } from '../../runtime/config.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { calibrate, syntheticModel } from '../../tools/synth-model.js';
import { toneWav, until } from '../helpers.js';

const dir = mkdtempSync(join(tmpdir(), 'voxserve-sup-'));
let msPerMatmul = 1;
/** Writes a synthetic VAD-shaped model: `sizeMiB` of weights, about `runMs` per 512-sample window. */
function model(name: string, sizeMiB: number, runMs: number): string {
  const path = join(dir, `${name}.onnx`);
  writeFileSync(path, syntheticModel(sizeMiB, Math.max(1, Math.round(runMs / msPerMatmul))));
  return path;
}
const wav = (seconds: number): Buffer =>
  toneWav({ rate: 16000, channels: 1, bitDepth: '16', frames: Math.round(16000 * seconds) });
const paths: Record<string, string> = {};

beforeAll(async () => {
  msPerMatmul = await calibrate();
  for (const id of ['A', 'B', 'C', 'D']) paths[id] = model(id, 4, 5);
  paths.slow = model('slow', 4, 60);
  paths.big = model('big', 20, 1);
});

const servers: VoxServer[] = [];
afterAll(async () => {
  await Promise.all(servers.map((s) => s.close()));
});

async function serve(extra: Record<string, unknown>, ids: string[], options = {}): Promise<VoxServer> {
  const models = ids.map((id) => ({ id, task: 'vad', path: paths[id] }));
  const s = await startServer(
    ServerConfig.parse({ log_level: 'silent', port: 0, management: { enabled: true }, models, ...extra }),
    options,
  );
  servers.push(s);
  return s;
}
const run = async (s: VoxServer, id: string, seconds = 0.25): Promise<number> =>
  (
    await fetch(`${s.url}/v1/tasks/run?model=${id}`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: new Uint8Array(wav(seconds)),
    })
  ).status;
const status = async (s: VoxServer, id: string) => (await fetch(`${s.url}/v1/models/${id}`)).json();
const loaded = async (s: VoxServer) =>
  ((await (await fetch(`${s.url}/v1/models`)).json()).models as { id: string; loaded: boolean }[])
    .filter((m) => m.loaded)
    .map((m) => m.id)
    .sort();
/** Fails the test instead of hanging. */
const within = <T>(ms: number, p: Promise<T>): Promise<T> =>
  Promise.race([p, new Promise<T>((_, reject) => setTimeout(() => reject(new Error(`hung for ${ms} ms`)), ms))]);

describe('supervisor on the real server', () => {
  it('(1) limit 1: a cold load during a steady stream of requests for the victim -> loads after it drains or 503; nothing hangs', async () => {
    const s = await serve({ max_loaded_models: 1, busy_timeout_ms: 1500 }, ['A', 'B', 'C']);
    expect(await run(s, 'A')).toBe(200);
    let streaming = true;
    const steady = async (): Promise<number[]> => {
      const out: number[] = [];
      while (streaming) out.push(await run(s, 'A', 0.1));
      return out;
    };
    const loops = [steady(), steady()];
    await new Promise((r) => setTimeout(r, 100));
    const b = await within(10_000, run(s, 'B'));
    streaming = false;
    const a = (await within(10_000, Promise.all(loops))).flat();
    expect([200, 503]).toContain(b);
    expect(a.every((code) => code === 200 || code === 503)).toBe(true);
    expect((await loaded(s)).length).toBeLessThanOrEqual(1);
    // A later cold load still works.
    expect(await within(10_000, run(s, 'C'))).toBe(200);
    expect(await loaded(s)).toEqual(['C']);
  });

  it('(2) limit 1: requests for B and C at the same moment are served in turn, or the later one gets 503 at its busy timeout', async () => {
    const s = await serve({ max_loaded_models: 1, busy_timeout_ms: 3000 }, ['A', 'B', 'C']);
    const codes = await within(15_000, Promise.all([run(s, 'B', 0.5), run(s, 'C', 0.5)]));
    expect(codes.filter((c) => c === 200).length).toBeGreaterThanOrEqual(1);
    expect(codes.every((c) => c === 200 || c === 503)).toBe(true);
    expect((await loaded(s)).length).toBe(1);
  });

  it('(3) limit 3 full, one model mid-unload, one new load -> only the retiring model goes', async () => {
    const s = await serve({ max_loaded_models: 3 }, ['A', 'B', 'slow', 'D']);
    for (const id of ['A', 'B', 'slow']) expect(await run(s, id, 0.05)).toBe(200);
    const evictionsBefore = s.supervisor.evictions;
    const long = run(s, 'slow', 1); // ~31 windows x 60 ms in one slot job
    await until(async () => (await status(s, 'slow')).active_slots === 1);
    const unload = fetch(`${s.url}/v1/models/unload`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ id: 'slow', force: true }),
    });
    await until(async () => (await status(s, 'slow')).retiring === true);
    expect(await within(10_000, run(s, 'D'))).toBe(200);
    await unload;
    await long;
    expect(await loaded(s)).toEqual(['A', 'B', 'D']);
    expect(s.supervisor.evictions - evictionsBefore).toBe(0); // no idle model was evicted for D
  });

  it('(3b) limit 3 full, none retiring -> exactly one eviction, the least recently used', async () => {
    const s = await serve({ max_loaded_models: 3 }, ['A', 'B', 'C', 'D']);
    for (const id of ['A', 'B', 'C']) expect(await run(s, id, 0.05)).toBe(200);
    expect(await run(s, 'A', 0.05)).toBe(200); // B is now the least recently used
    const before = s.supervisor.evictions;
    expect(await run(s, 'D', 0.05)).toBe(200);
    expect(s.supervisor.evictions - before).toBe(1);
    expect(await loaded(s)).toEqual(['A', 'C', 'D']);
  });

  it("(4) a cold request 100 ms after another model's cold load: the fresh model is not evicted before its first request runs", async () => {
    const s = await serve({ max_loaded_models: 1, busy_timeout_ms: 5000 }, ['A', 'B']);
    let aDone = 0;
    const a = run(s, 'A', 1).then((code) => ((aDone = Date.now()), code));
    await new Promise((r) => setTimeout(r, 100));
    const b = run(s, 'B', 0.1);
    const [ca, cb] = await within(15_000, Promise.all([a, b]));
    // A's request ran on A; B waited at the gate until A was idle, then evicted it (lru) and ran.
    expect(ca).toBe(200);
    expect(cb).toBe(200);
    const evicted = (await status(s, 'A')).last_eviction;
    expect(evicted).toMatchObject({ reason: 'lru' });
    // Evicted only once its first request had run: at most the time A's answer took to arrive before it (the eviction's
    // `at` is taken on the server).
    expect(evicted.at).toBeGreaterThanOrEqual(aDone - 50);
    expect(await loaded(s)).toEqual(['B']);
  });

  it('(5) memory guard: estimate over the headroom -> 503 with the figures; a model loaded before uses its measured size', async () => {
    let available = 150 * 1024 * 1024;
    const s = await serve({ min_free_memory_mb: 100 }, ['big'], { memoryProbe: () => available });
    const config = s.supervisor.getOrRegister('big')!.config;
    // The documented estimate (README, memory guard): slots x (32 MiB + 1.5 x the file's bytes).
    const estimate = config.slots * (32 * 1024 * 1024 + 1.5 * statSync(paths.big).size);
    expect(await s.supervisor.footprint(config)).toBe(estimate);
    const refused = await fetch(`${s.url}/v1/tasks/run?model=big`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: new Uint8Array(wav(0.1)),
    });
    expect(refused.status).toBe(503);
    const body = await refused.json();
    expect(body.error.type).toBe('insufficient_memory');
    expect(body.error.message).toContain(
      `needs about ${Math.round(estimate / 2 ** 20)} MiB plus 100 MiB of headroom (min_free_memory_mb), but only 150 MiB is available`,
    );
    expect(refused.headers.get('retry-after')).toBeTruthy();
    expect(await status(s, 'big')).toMatchObject({ state: 'unloaded', last_error: null });

    available = 64 * 1024 ** 3;
    expect(await run(s, 'big', 0.1)).toBe(200);
    const measured = (await status(s, 'big')).resident_bytes;
    expect(measured).toBeGreaterThan(20 * 1024 * 1024); // 20 MiB of weights at least
    expect(Math.round(measured / 2 ** 20)).not.toBe(Math.round(estimate / 2 ** 20)); // so that the message below tells which was used
    await fetch(`${s.url}/v1/models/unload`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ id: 'big' }),
    });
    available = 50 * 1024 * 1024;
    const again = await (
      await fetch(`${s.url}/v1/tasks/run?model=big`, {
        method: 'POST',
        headers: { 'content-type': 'audio/wav' },
        body: new Uint8Array(wav(0.1)),
      })
    ).json();
    expect(again.error.message).toContain(`needs about ${Math.round(measured / 2 ** 20)} MiB plus 100 MiB`);
  });

  it('(6) idle unload: a model streaming for longer than idle_unload_ms stays loaded, and unloads once idle', async () => {
    const s = await serve({ idle_unload_ms: 300 }, ['A']);
    const ws = new WebSocket(`${s.url.replace('http', 'ws')}/v1/stream?model=A`);
    await new Promise<void>((resolve, reject) => {
      ws.on('error', reject);
      ws.on('message', (d) => {
        if (JSON.parse(d.toString()).type === 'ready') resolve();
      });
    });
    const frame = Buffer.alloc(3200); // 100 ms of s16le silence
    for (let i = 0; i < 10; i++) {
      ws.send(frame);
      await new Promise((r) => setTimeout(r, 100));
      expect((await status(s, 'A')).loaded).toBe(true);
    }
    ws.send(JSON.stringify({ type: 'end' }));
    await new Promise((r) => ws.on('close', r));
    await until(async () => (await status(s, 'A')).state === 'unloaded', 3000);
  });
});
