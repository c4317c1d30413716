import { describe, expect, it, vi } from 'vitest';
import { until } from '../helpers.js';
import { ModelEntry } from '../../actors/model.js';
import { ModelConfig } from '../../runtime/config.js';
import type { LoadedModel, ModelLoader } from '../../runtime/loader.js';
import type { Job, JobResult, LoadSpec } from '../../runtime/slots/slot-protocol.js';
import { SlotPool, type SlotHost } from '../../runtime/slots/slots.js';

const config: ModelConfig = ModelConfig.parse({ id: 'm', task: 'vad', path: '/nowhere.onnx', max_streams: 4 });

/** A loader over fake slots; `exits` lets a test kill slot 0 of the latest load. */
function fakeLoader(opts: { fail?: () => string | null; delayMs?: number } = {}) {
  const calls: ModelConfig[] = [];
  const kills: ((e: Error) => void)[] = [];
  const loader: ModelLoader = async (c) => {
    calls.push(c);
    await new Promise((r) => setTimeout(r, opts.delayMs ?? 5));
    const err = opts.fail?.();
    if (err) throw new Error(err);
    const factory = async (_s: LoadSpec): Promise<SlotHost> => ({
      info: {},
      run: async (job: Job) =>
        ({
          kind: 'vad',
          probs: new Float32Array(0),
          state: (job as { state: Float32Array }).state,
          context: new Float32Array(64),
        }) as JobResult,
      close: async () => {},
      onExit: (cb) => kills.push(cb),
      residentBytes: () => 0,
    });
    const pool = await SlotPool.start({ kind: 'vad', model: '/fake.onnx' }, c.slots, factory);
    return { pool, residentBytes: 100 * c.slots, close: () => pool.close() } satisfies LoadedModel;
  };
  return { loader, calls, kills };
}

describe('ModelEntry', () => {
  it('shares one load between concurrent first requests (single flight)', async () => {
    const f = fakeLoader({ delayMs: 20 });
    const e = new ModelEntry(config, { loader: f.loader });
    const results = await Promise.all([e.ensureReady(), e.ensureReady(), e.ensureReady()]);
    expect(f.calls).toHaveLength(1);
    expect(new Set(results).size).toBe(1);
    expect(e.state).toBe('ready');
    expect(e.status()).toMatchObject({ loaded: true, resident_bytes: 100, last_error: null });
  });

  it('leaves a failed load unloaded with last_error, and a retry loads it', async () => {
    let failures = 1;
    const f = fakeLoader({ fail: () => (failures-- > 0 ? 'bad weights' : null) });
    const e = new ModelEntry(config, { loader: f.loader });
    await expect(e.ensureReady()).rejects.toThrow(/failed to load: bad weights/);
    expect(e.status()).toMatchObject({
      state: 'unloaded',
      loaded: false,
      last_error: 'bad weights',
      resident_bytes: 0,
    });
    await e.ensureReady();
    expect(e.status()).toMatchObject({ state: 'ready', last_error: null });
    expect(f.calls).toHaveLength(2);
  });

  it('a dying slot is respawned; three crashes within a minute unload the model with last_error; the next request loads it again', async () => {
    const f = fakeLoader();
    const e = new ModelEntry(config, { loader: f.loader });
    await e.ensureReady();
    f.kills[0](new Error('worker exited with code 1'));
    await until(() => f.kills.length === 2); // respawned (after 100 ms)
    expect(e.status()).toMatchObject({ state: 'ready', last_error: null });
    f.kills[1](new Error('worker exited with code 1'));
    await until(() => f.kills.length === 3); // respawned again (after 200 ms)
    f.kills[2](new Error('worker exited with code 1'));
    await until(() => e.state === 'unloaded');
    expect(e.status().last_error).toMatch(/^3 slot crashes within a minute; the last: worker exited with code 1/);
    await e.ensureReady();
    expect(e.state).toBe('ready');
  });

  it('issue 25 item 9: with crash_cooldown_ms, a crash-looping model is held back: the next request is refused 503 model_cooling_down with Retry-After, not reloaded; /v1/models shows cool_down', async () => {
    const f = fakeLoader();
    const e = new ModelEntry(config, { loader: f.loader, serverCrashCooldownMs: 10_000 });
    await e.ensureReady();
    for (let i = 0; i < 3; i++) {
      f.kills[i](new Error('slot host was killed by SIGABRT'));
      if (i < 2) await until(() => f.kills.length === i + 2); // respawned
    }
    await until(() => e.status().cool_down !== null);
    const t = Date.now();
    expect(e.status()).toMatchObject({
      state: 'unloaded',
      cool_down: { failures: 1, reason: expect.stringMatching(/3 slot crashes within a minute/) },
    });
    expect(e.status().cool_down!.until).toBeGreaterThan(t + 9_000);
    const refused = await e.ensureReady().catch((err) => err);
    expect(refused).toMatchObject({ code: 'model_cooling_down', status: 503 });
    expect(refused.retryAfterS).toBeGreaterThanOrEqual(9);
    expect(refused.retryAfterS).toBeLessThanOrEqual(10);
    expect(f.calls).toHaveLength(1); // not reloaded
  });

  it('residency (holdsSlots): a pool loaded here counts from its load until it has closed; a cluster placement on other nodes does not', async () => {
    const f = fakeLoader();
    const e = new ModelEntry(config, { loader: f.loader });
    expect(e.holdsSlots).toBe(false);
    await e.ensureReady();
    expect(e.holdsSlots).toBe(true);
    await e.unload(1000);
    expect(e.holdsSlots).toBe(false);
    // A placement that loads here (`local`) holds slots here; one that returns another pool does not.
    const here = new ModelEntry(config, { loader: f.loader, place: (_c, _s, local) => local() });
    await here.ensureReady();
    expect(here.holdsSlots).toBe(true);
    const remote = fakeLoader();
    const away = new ModelEntry(config, { loader: f.loader, place: (c, s) => remote.loader(c, s) });
    await away.ensureReady();
    expect(away.state).toBe('ready');
    expect(away.holdsSlots).toBe(false);
  });

  it('configure: an identical config does nothing; a changed one reloads with the merged config', async () => {
    const f = fakeLoader();
    const e = new ModelEntry(config, { loader: f.loader });
    await e.ensureReady();
    expect(await e.configure({}, 1000)).toEqual({ reconfigured: false });
    expect(f.calls).toHaveLength(1);
    expect(await e.configure({ slots: 2 }, 1000)).toEqual({ reconfigured: true });
    expect(f.calls).toHaveLength(2);
    expect(e.config).toMatchObject({ slots: 2, max_streams: 4 }); // max_streams kept
    expect(e.status()).toMatchObject({ state: 'ready', slots: 2, resident_bytes: 200 });
  });

  it('configure: an invalid config is refused with the field named and leaves the model untouched', async () => {
    const f = fakeLoader();
    const e = new ModelEntry(config, { loader: f.loader });
    const before = await e.ensureReady();
    await expect(e.configure({ slots: 17 }, 1000)).rejects.toThrow(/slots/);
    await expect(e.configure({ options: { threshold: 2 } }, 1000)).rejects.toThrow(/options\.threshold/);
    expect(e.state).toBe('ready');
    expect(await e.ensureReady()).toBe(before);
  });

  it('requests one after another (a new lease within 25 ms of the last release: the jobs of a holder, a batch every 10-20 ms) cost the chart no event each; it turns idle 25 ms after the last, and at once when asked', async () => {
    const f = fakeLoader();
    let changes = 0;
    const e = new ModelEntry(config, { loader: f.loader, onChange: () => changes++ });
    await e.ensureReady();
    let events = 0;
    const sub = e.actor.subscribe(() => events++);
    let afterFirst = 0;
    // The 25 ms on a fake clock (a slow turn of this machine's event loop must not count as a gap).
    vi.useFakeTimers({ toFake: ['setTimeout', 'clearTimeout'] });
    try {
      for (let i = 0; i < 20; i++) {
        const lease = await e.admission.acquire();
        lease.release();
        await new Promise((r) => setImmediate(r));
        vi.advanceTimersByTime(24);
        if (i === 0) afterFirst = changes;
      }
      // One turn to busy (the first lease); the idle turn after each release waits for more.
      expect(events).toBe(1);
      expect(changes).toBe(afterFirst);
      expect(e.actor.getSnapshot().matches({ resident: { ready: { leases: 'busy' } } })).toBe(true);
      vi.advanceTimersByTime(1);
      expect(e.actor.getSnapshot().matches({ resident: { ready: { leases: 'idle' } } })).toBe(true);
      expect(changes).toBeGreaterThan(afterFirst);
    } finally {
      vi.useRealTimers();
    }
    // Read at once after a release (the ad hoc groups' eviction does): idle now, not 25 ms later.
    const lease = await e.admission.acquire();
    lease.release();
    expect(e.idle).toBe(true);
    sub.unsubscribe();
  });

  it('a lease taken right after an exclusive one (a management load, then a request) turns the chart busy: its keep-alive does not run under the request', async () => {
    // A breaker's case: the HOLDER event let the chart turn idle at once (keep-alive started), and the request's lease
    // within the idle delay told it nothing: the model was evicted for idle 1 s after the load, under a stream.
    const f = fakeLoader();
    const e = new ModelEntry(ModelConfig.parse({ ...config, keep_alive_ms: 1000 }), { loader: f.loader });
    await e.ensureReady();
    const busy = (): boolean => e.actor.getSnapshot().matches({ resident: { ready: { leases: 'busy' } } });
    for (let i = 0; i < 5; i++) {
      const manager = await e.admission.acquire({ exclusive: true });
      manager.release();
      const request = await e.admission.acquire();
      expect(busy()).toBe(true);
      expect(e.idle).toBe(false);
      request.release();
      await until(() => !busy());
    }
  });

  it("figures (what a node's heartbeat reports) are status's fields, read without the processing lag's percentiles", async () => {
    const f = fakeLoader();
    const e = new ModelEntry(config, { loader: f.loader });
    const pick = (s: ReturnType<ModelEntry['status']>) => ({
      id: s.id,
      task: s.task,
      state: s.state,
      slots: s.slots,
      active_slots: s.active_slots,
      active_leases: s.active_leases,
      queued_requests: s.queued_requests,
      resident_bytes: s.resident_bytes,
    });
    expect(e.figures()).toEqual(pick(e.status()));
    await e.ensureReady();
    const lease = await e.admission.acquire();
    const queued = e.admission.acquire({ exclusive: true });
    expect(e.figures()).toEqual(pick(e.status()));
    expect(e.figures()).toMatchObject({ state: 'ready', active_leases: 1, queued_requests: 1 });
    lease.release();
    (await queued).release();
  });

  it('unload waits for running requests (exclusive lease) and is idempotent', async () => {
    const f = fakeLoader();
    const e = new ModelEntry(config, { loader: f.loader });
    const lease = await e.admission.acquire();
    await e.ensureReady();
    const unloading = e.unload(1000);
    await new Promise((r) => setTimeout(r, 10));
    expect(e.state).toBe('ready');
    lease.release();
    await unloading;
    expect(e.status()).toMatchObject({ state: 'unloaded', loaded: false, resident_bytes: 0, active_leases: 0 });
    await e.unload(1000);
    expect(e.state).toBe('unloaded');
  });

  it('C4: a manager holding the exclusive lease past the busy timeout makes new requests 503 model_stuck at once (the chart hears HOLDER); once it lets go they are admitted', async () => {
    const e = new ModelEntry(ModelConfig.parse({ ...config, busy_timeout_ms: 60 }), { loader: fakeLoader().loader });
    const manager = await e.admission.acquire({ exclusive: true });
    // Within the busy timeout: a request queues behind the manager (and times out like any waiter).
    const early = e.admit({}).catch((err: { code?: string }) => err.code);
    await new Promise((r) => setTimeout(r, 80));
    expect(await early).toBe('busy_timeout');
    // Past it: refused at once.
    const t0 = performance.now();
    await expect(e.admit({})).rejects.toMatchObject({ code: 'model_stuck' });
    expect(performance.now() - t0).toBeLessThan(20);
    manager.release();
    const lease = await e.admit({});
    expect(e.admission.activeLeases).toBe(1);
    lease.release();
  });

  it('a load still building after load_timeout_ms is abandoned: its signal aborts, the model is unloaded with last_error naming the timeout, and a later load can succeed', async () => {
    let signal: AbortSignal | undefined;
    let hang = true;
    const good = fakeLoader();
    const loader: ModelLoader = (c, s) => {
      signal = s;
      return hang ? new Promise<never>(() => {}) : good.loader(c, s);
    };
    const e = new ModelEntry(ModelConfig.parse({ ...config, load_timeout_ms: 100 }), { loader });
    const t0 = performance.now();
    await expect(e.ensureReady()).rejects.toThrow(/loading took longer than load_timeout_ms \(100 ms\)/);
    expect(performance.now() - t0).toBeLessThan(1000);
    expect(signal?.aborted).toBe(true);
    expect(e.status()).toMatchObject({ state: 'unloaded', last_error: expect.stringMatching(/load_timeout_ms/) });
    hang = false;
    await e.ensureReady();
    expect(e.state).toBe('ready');
    expect(signal?.aborted).toBe(false);
  });
});
