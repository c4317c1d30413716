/**
 * `close()` (finish what runs, accept nothing new) against `destroy()` (cut what runs now), in process with fake slots.
 */
import { describe, expect, it, onTestFinished } from 'vitest';
import WebSocket from 'ws';
import { ServerConfig } from '../../runtime/config.js';
import type { ModelLoader } from '../../runtime/loader.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { fakeLoader } from '../fuzz/fakes.js';
import { fixture, until } from '../helpers.js';

const DRAIN_MS = 20_000;

/**
 * A server whose model `held` runs every job only once `release()` is called (a job in flight for
 * as long as the test wants; `heldJobs()` counts them), and whose model `quick` answers at once.
 */
async function serve(drainMs = DRAIN_MS): Promise<{ server: VoxServer; release: () => void; heldJobs: () => number }> {
  let release!: () => void;
  let heldJobs = 0;
  const gate = new Promise<void>((resolve) => (release = resolve));
  const loader: ModelLoader = async (config, signal) => {
    const loaded = await fakeLoader(config, signal);
    if (config.id !== 'held') return loaded;
    const run = loaded.pool.run.bind(loaded.pool);
    loaded.pool.run = (async (...args: Parameters<typeof run>) => {
      heldJobs++;
      await gate;
      return run(...args);
    }) as typeof run;
    return loaded;
  };
  const config = ServerConfig.parse({
    log_level: 'silent',
    port: 0,
    drain_timeout_ms: drainMs,
    limits: { idle_ms: 0, heartbeat_ms: 0 },
    models: [
      { id: 'held', task: 'vad', path: 'held.onnx', lazy: false },
      { id: 'quick', task: 'vad', path: 'quick.onnx', lazy: false },
    ],
  });
  const server = await startServer(config, { loader });
  onTestFinished(async () => {
    release();
    await server.destroy();
  });
  await until(() => server.supervisor.phase === 'running');
  return { server, release, heldJobs: () => heldJobs };
}

/** A stream of `model` that has sent audio and not `end`. */
function openStream(
  server: VoxServer,
  model = 'quick',
): Promise<{ events: { type: string }[]; closed: Promise<{ code: number; reason: string }> }> {
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(`${server.url.replace('http', 'ws')}/v1/stream?model=${model}`);
    const events: { type: string }[] = [];
    const closed = new Promise<{ code: number; reason: string }>((r) =>
      ws.on('close', (code, why) => r({ code, reason: why.toString() })),
    );
    ws.on('error', reject);
    ws.on('message', (d) => {
      const e = JSON.parse(d.toString());
      events.push(e);
      if (e.type === 'ready') {
        ws.send(fixture('espeak_sentence_16k.wav').subarray(44, 44 + 32_000));
        resolve({ events, closed });
      }
    });
  });
}

/** A run of `held`: its job waits for the gate. */
const runHeld = (server: VoxServer): Promise<{ status: number; body: { error?: { code: string } } }> =>
  fetch(`${server.url}/v1/tasks/run?model=held`, {
    method: 'POST',
    headers: { 'content-type': 'audio/wav' },
    body: new Uint8Array(fixture('Front_Left.wav')),
  }).then(async (r) => ({
    status: r.status,
    body: await r.json(),
  }));

describe('close() and destroy()', () => {
  it('close(): the running request finishes with its result, the stream with done and 1001; nothing new is accepted meanwhile', async () => {
    const { server, release } = await serve();
    const stream = await openStream(server);
    const running = runHeld(server);
    await until(() => server.supervisor.getOrRegister('held')!.status().active_leases === 1);
    let closed = false;
    const closing = server.close().then(() => (closed = true));
    expect(server.close()).toBe(server.close()); // one shutdown, however often asked
    const { code, reason } = await stream.closed;
    expect([code, reason]).toEqual([1001, 'server shutting down']);
    expect(stream.events.map((e) => e.type).at(-1)).toBe('done');
    // The request still runs (its job waits): the server waits for it, and refuses new work.
    await new Promise((r) => setTimeout(r, 300));
    expect(closed).toBe(false);
    expect(server.supervisor.phase).toBe('draining');
    const late = await fetch(`${server.url}/v1/tasks/run?model=quick`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: new Uint8Array(fixture('Front_Left.wav')),
    });
    expect(late.status).toBe(503);
    expect((await late.json()).error.code).toBe('shutting_down');
    release();
    expect((await running).status).toBe(200);
    await closing;
    expect(server.supervisor.phase).toBe('stopped');
  });

  it('destroy(): the running request gets 503 shutting_down and the stream 1001 with no done, at once, long before the drain deadline', async () => {
    const { server } = await serve();
    const stream = await openStream(server);
    const running = runHeld(server);
    await until(() => server.supervisor.getOrRegister('held')!.status().active_leases === 1);
    const t0 = performance.now();
    await server.destroy();
    expect(performance.now() - t0).toBeLessThan(DRAIN_MS / 2);
    expect(await running).toMatchObject({ status: 503, body: { error: { code: 'shutting_down' } } });
    const { code, reason } = await stream.closed;
    expect([code, reason]).toEqual([1001, 'server shutting down: drain cut short']);
    expect(stream.events.map((e) => e.type)).not.toContain('done');
    expect(server.supervisor.phase).toBe('stopped');
  });

  it('close() past the drain deadline: a stream whose audio still runs closes 1001 "server shutting down: drain deadline passed", no done', async () => {
    const { server, heldJobs } = await serve(300);
    const stream = await openStream(server, 'held');
    await until(() => heldJobs() > 0);
    await server.close();
    expect(await stream.closed).toEqual({ code: 1001, reason: 'server shutting down: drain deadline passed' });
    expect(stream.events.map((e) => e.type)).not.toContain('done');
  });

  it('destroy() during a close() cuts the drain short', async () => {
    const { server } = await serve();
    const running = runHeld(server);
    await until(() => server.supervisor.getOrRegister('held')!.status().active_leases === 1);
    const closing = server.close();
    await new Promise((r) => setTimeout(r, 200));
    expect(server.supervisor.phase).toBe('draining');
    const t0 = performance.now();
    expect(server.destroy()).toBe(closing);
    await closing;
    expect(performance.now() - t0).toBeLessThan(DRAIN_MS / 2);
    expect((await running).status).toBe(503);
  });
});
