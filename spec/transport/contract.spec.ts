/** Named regression tests of the lifecycle contract on the real server with real models. */
import { Worker } from 'node:worker_threads';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { defaultCatalog, ServerConfig } from '../../runtime/config.js';
import { createLoader, WeightBundles, type ModelLoader } from '../../runtime/loader.js';
import { slotHostFile, slotOnWorker, type SlotFactory } from '../../runtime/slots/slots.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { expectSegments, fixture, loopWav, reference, streamPcm, until } from '../helpers.js';

let server: VoxServer;
const loads: string[] = [];
const slots: { worker: Worker; dying: boolean }[] = [];
/** How many of the next slots started are threads that exit during their first run. */
let dying = 0;
/** A slot thread that loads, then exits (as a crashing worker does) 50 ms into its first run. */
const DYING_SLOT = `
const { parentPort } = require('node:worker_threads');
parentPort.on('message', (m) => {
  if (m.type === 'load') parentPort.postMessage({ type: 'loaded', info: {} });
  if (m.type === 'run') setTimeout(() => process.exit(3), 50);
});`;
const silero = defaultCatalog().find((m) => m.id === 'silero-vad')!.path;
/** 30 s of speech: a VAD request that keeps a slot busy for a while. */
const long = loopWav('espeak_sentence_16k.wav', 30);
const sentence = fixture('espeak_sentence_16k.wav');

beforeAll(async () => {
  const factory: SlotFactory = async (spec) => {
    // Slot threads started here, so the test can see them exit.
    const dies = dying > 0;
    if (dies) dying--;
    const worker = dies ? new Worker(DYING_SLOT, { eval: true }) : new Worker(slotHostFile());
    slots.push({ worker, dying: dies });
    return slotOnWorker(worker, spec);
  };
  const real = createLoader(new WeightBundles(), undefined, factory);
  const loader: ModelLoader = (config) => {
    loads.push(config.id);
    return real(config);
  };
  server = await startServer(ServerConfig.parse({ log_level: 'silent', port: 0, management: { enabled: true } }), {
    loader,
  });
});
afterAll(async () => {
  await server?.close();
});

const post = async (path: string, body: unknown, signal?: AbortSignal) => {
  const res = await fetch(`${server.url}${path}`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify(body),
    signal,
  });
  return { status: res.status, body: await res.json() };
};
const run = async (model: string, wav: Buffer, signal?: AbortSignal) => {
  const res = await fetch(`${server.url}/v1/tasks/run?model=${model}`, {
    method: 'POST',
    headers: { 'content-type': 'audio/wav' },
    body: new Uint8Array(wav),
    signal,
  });
  return { status: res.status, body: await res.json() };
};
const status = async (id: string) => (await fetch(`${server.url}/v1/models/${id}`)).json();

describe('lifecycle contract on the real server', () => {
  it('concurrent identical loads -> one load', async () => {
    const body = { id: 'vad-x', task: 'vad', path: silero, slots: 2 };
    const before = loads.length;
    const rs = await Promise.all([
      post('/v1/models/load', body),
      post('/v1/models/load', body),
      post('/v1/models/load', body),
    ]);
    expect(rs.map((r) => r.status)).toEqual([200, 200, 200]);
    expect(rs.map((r) => r.body.reconfigured)).toEqual([false, false, false]);
    expect(loads.slice(before)).toEqual(['vad-x']);
  });

  it('requests arriving while a reconfiguration waits queue behind it and run on the new config', async () => {
    await post('/v1/models/load', { id: 'vad-r', task: 'vad', path: silero });
    const old = run('vad-r', long); // holds a lease while the manager waits
    await until(async () => (await status('vad-r')).active_leases === 1);
    const reconf = post('/v1/models/load', { id: 'vad-r', options: { min_speech_duration_ms: 5000 } });
    await until(async () => (await status('vad-r')).queued_requests === 1);
    const later = run('vad-r', sentence);
    const [o, r, l] = await Promise.all([old, reconf, later]);
    expect(o.status).toBe(200);
    expect(o.body.segments.length).toBeGreaterThan(0); // old config
    expect(r.body).toEqual({ id: 'vad-r', loaded: true, reconfigured: true });
    expect(l.status).toBe(200);
    expect(l.body.segments).toEqual([]); // new config: ~3 s of speech is under 5 s
  });

  it('unload immediately after inference, 200 times: no crash, no leak', async () => {
    await post('/v1/models/load', { id: 'vad-u', task: 'vad', path: silero });
    const small = fixture('Front_Left.wav');
    for (let i = 0; i < 200; i++) {
      const [r, u] = await Promise.all([run('vad-u', small), post('/v1/models/unload', { id: 'vad-u' })]);
      expect([200, 503]).toContain(r.status);
      expect(u.status).toBe(200);
    }
    expect(await status('vad-u')).toMatchObject({
      state: 'unloaded',
      active_leases: 0,
      queued_requests: 0,
      active_slots: 0,
    });
    // Every slot thread that was started and is not part of a loaded model has exited.
    const loadedSlots = server.supervisor.statuses().reduce((n, m) => n + (m.loaded ? m.slots : 0), 0);
    await until(async () => slots.filter((s) => s.worker.threadId !== -1).length <= loadedSlots);
    expect((await run('vad-u', small)).status).toBe(200);
  }, 180_000); // 200 loads and unloads took ~100 s on a loaded 2-core machine, past the 60 s default

  it('a client that disconnects while queued leaves the queue; one that disconnects while running frees its slot', async () => {
    await post('/v1/models/load', { id: 'vad-d', task: 'vad', path: silero, max_streams: 1 });
    const running = new AbortController();
    const queued = new AbortController();
    const a = run('vad-d', long, running.signal).catch((e) => e);
    await until(async () => (await status('vad-d')).active_leases === 1);
    const b = run('vad-d', long, queued.signal).catch((e) => e);
    await until(async () => (await status('vad-d')).queued_requests === 1);
    queued.abort();
    expect((await b).name).toBe('AbortError');
    await until(async () => (await status('vad-d')).queued_requests === 0);
    running.abort();
    expect((await a).name).toBe('AbortError');
    await until(async () => {
      const s = await status('vad-d');
      return s.active_leases === 0 && s.active_slots === 0;
    });
    expect((await run('vad-d', sentence)).status).toBe(200);
  });

  it('a slot host that dies mid-run: the job runs again on the respawned slot, and the response is what it is without a crash', async () => {
    dying = 1; // the model's one slot exits during its first run; its respawn is a real host
    await post('/v1/models/load', { id: 'vad-j', task: 'vad', path: silero });
    const r = await run('vad-j', long);
    expect(dying).toBe(0);
    expect(r.status).toBe(200);
    // The same file on a model whose slots never crashed.
    const plain = await run('silero-vad', long);
    expect(plain.status).toBe(200);
    expect(r.body.segments.length).toBeGreaterThan(0);
    expect(r.body.segments).toEqual(plain.body.segments);
    expect(await status('vad-j')).toMatchObject({ state: 'ready', last_error: null, active_leases: 0 });
  });

  it('a live stream whose slot host dies mid-run goes on: its job runs again on the respawned slot, and its segments are those of REFERENCE.jsonl (v6)', async () => {
    dying = 1;
    await post('/v1/models/load', { id: 'vad-s', task: 'vad', path: silero });
    const pcm = fixture('silero_test.wav').subarray(44);
    const { events, code } = await streamPcm(`${server.url.replace('http', 'ws')}/v1/stream?model=vad-s`, pcm);
    expect(dying).toBe(0);
    expect(events.filter((e) => e.type === 'error')).toEqual([]);
    expect(code).toBe(1000);
    expect(events.at(-1)).toMatchObject({ type: 'done' });
    const segments = events
      .filter((e) => e.type === 'speech_end')
      .map((e) => ({ start_ms: e.start_ms as number, end_ms: e.end_ms as number }));
    expectSegments(segments, reference('silero_test.wav').segments_v6, 32); // silero-vad's file is v6
  });

  it('a slot host that dies mid-run twice under one job -> 422 input_crashed_model naming the exit for that job; the slot is respawned and serves the next request; other models keep serving', async () => {
    dying = 2; // the slot and its first respawn each exit during their first run
    await post('/v1/models/load', { id: 'vad-k', task: 'vad', path: silero });
    const before = slots.filter((s) => s.dying).length;
    const r = await run('vad-k', long);
    expect(r.status).toBe(422);
    expect(r.body.error).toMatchObject({
      type: 'invalid_request_error',
      code: 'input_crashed_model',
      message: expect.stringMatching(/exited with code 3/),
    });
    expect(dying).toBe(0);
    expect((await run('silero-vad', sentence)).status).toBe(200);
    const again = await run('vad-k', sentence);
    expect(again.status).toBe(200);
    expect(again.body.segments).toHaveLength(1);
    expect(await status('vad-k')).toMatchObject({ state: 'ready', last_error: null });
    expect(slots.filter((s) => s.dying).length - before).toBe(1);
  });

  it('a forced unload does not wait: the running request gets 503, a live stream gets error and 1012', async () => {
    await post('/v1/models/load', { id: 'vad-f', task: 'vad', path: silero });
    const pending = run('vad-f', long);
    await until(async () => (await status('vad-f')).active_leases === 1);
    const u = await post('/v1/models/unload', { id: 'vad-f', force: true });
    expect(u).toEqual({ status: 200, body: { id: 'vad-f', loaded: false } });
    const r = await pending;
    expect(r.status).toBe(503);
    expect(r.body.error).toMatchObject({
      code: 'model_unloaded',
      message: expect.stringMatching(/unloaded \(force\)/),
    });
    expect(await status('vad-f')).toMatchObject({ state: 'unloaded', active_leases: 0 });
  });

  it('unload_many de-duplicates and reports each model once; unload_all unloads everything', async () => {
    await post('/v1/models/load', { id: 'vad-m', task: 'vad', path: silero });
    const r = await post('/v1/models/unload_many', { ids: ['vad-m', 'nope', 'vad-m', 'silero-vad', 'nope'] });
    expect(r.status).toBe(200);
    expect(r.body.unloaded.sort()).toEqual(['silero-vad', 'vad-m']);
    expect(r.body.not_found).toEqual(['nope']);
    const [x, y] = await Promise.all([
      post('/v1/models/unload_many', { ids: ['vad-x', 'vad-r'] }),
      post('/v1/models/unload_many', { ids: ['vad-r', 'vad-x'] }),
    ]);
    expect([x.status, y.status]).toEqual([200, 200]);
    const all = await post('/v1/models/unload_all', {});
    expect(all.status).toBe(200);
    const models = (await (await fetch(`${server.url}/v1/models`)).json()).models;
    expect(models.every((m: { loaded: boolean; resident_bytes: number }) => !m.loaded && m.resident_bytes === 0)).toBe(
      true,
    );
  });

  it('a manager whose client goes away leaves the queue', async () => {
    await post('/v1/models/load', { id: 'vad-g', task: 'vad', path: silero });
    const pending = run('vad-g', long);
    await until(async () => (await status('vad-g')).active_leases === 1);
    const ac = new AbortController();
    const unload = post('/v1/models/unload', { id: 'vad-g' }, ac.signal).catch((e) => e);
    await until(async () => (await status('vad-g')).queued_requests === 1);
    ac.abort();
    expect((await unload).name).toBe('AbortError');
    await until(async () => (await status('vad-g')).queued_requests === 0);
    // The same for a bulk unload.
    const bulk = new AbortController();
    const many = post('/v1/models/unload_many', { ids: ['vad-g'] }, bulk.signal).catch((e) => e);
    await until(async () => (await status('vad-g')).queued_requests === 1);
    bulk.abort();
    expect((await many).name).toBe('AbortError');
    await until(async () => (await status('vad-g')).queued_requests === 0);
    expect((await pending).status).toBe(200);
    expect((await status('vad-g')).state).toBe('ready');
  });

  it('unload_all takes an empty body (declared as JSON, which a browser cannot send across sites without a preflight)', async () => {
    const res = await fetch(`${server.url}/v1/models/unload_all`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
    });
    expect(res.status).toBe(200);
    expect((await res.json()).unloaded).toEqual(expect.any(Array));
  });

  it('status answers while a model is busy with a long inference', async () => {
    await post('/v1/models/load', { id: 'vad-s', task: 'vad', path: silero });
    const pending = run('vad-s', long);
    await until(async () => (await status('vad-s')).active_slots === 1);
    const t = performance.now();
    const s = await status('vad-s');
    expect(s).toMatchObject({ state: 'ready', active_slots: 1, active_leases: 1 });
    expect(performance.now() - t).toBeLessThan(1000);
    await pending;
  });
});
