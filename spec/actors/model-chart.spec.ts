/**
 * The model entry chart on its own (no ModelEntry class): created with `createActor`, its live
 * dependencies given as input (a fake loader and admission, XState's SimulatedClock), every
 * transition of DESIGN.md section 2's chart.
 */
import { describe, expect, it } from 'vitest';
import { createActor, fromCallback, SimulatedClock, type AnyActorRef } from 'xstate';
import {
  busyTimeoutOf,
  isStuck,
  modelMachine,
  stateName,
  type EvictReason,
  type EvictReply,
  type ModelDeps,
} from '../../actors/model.js';
import { ModelConfig } from '../../runtime/config.js';
import { VoxError } from '../../runtime/errors.js';
import type { LoadedModel } from '../../runtime/loader.js';

const flush = (): Promise<void> => new Promise((r) => setImmediate(r));

function chart(
  fields: Record<string, unknown> = {},
  server: { idle?: number; loadTimeout?: number; crashCooldown?: number; busy?: number } = {},
) {
  const clock = new SimulatedClock();
  const loads: {
    config: ModelConfig;
    signal: AbortSignal;
    resolve: (m: LoadedModel) => void;
    reject: (e: unknown) => void;
  }[] = [];
  const closed: string[] = [];
  let failSlot: ((e: Error) => void) | null = null;
  /** The latest pool's `onStuck`, set by the residency actor. */
  let latest: { onStuck?: ((stuck: boolean) => void) | null } = {};
  const pool = (id: string, closeError?: Error): LoadedModel =>
    ({
      pool: (latest = { slots: [{}], info: {}, onFailure: (cb: (e: Error) => void) => (failSlot = cb) } as never),
      residentBytes: 1234,
      close: async () => {
        closed.push(id);
        if (closeError) throw closeError;
      },
    }) as unknown as LoadedModel;
  const leases: { exclusive: boolean; released: boolean }[] = [];
  const evictions: EvictReason[] = [];
  const resident: (LoadedModel | null)[] = [];
  /**
   * The fake admission queue's leases held and waiters (the chart reads them); `exclusive` a holder's lease or null.
   */
  const admission = {
    activeLeases: 0,
    queued: 0,
    exclusive: null as { exclusive: boolean; grantedAt: number; release: () => void } | null,
    tryAcquire: (exclusive = false) => {
      const l = { exclusive, released: false };
      leases.push(l);
      return { exclusive, grantedAt: 0, release: () => void (l.released = true) };
    },
  };
  const deps: ModelDeps = {
    loader: (config, signal) =>
      new Promise((resolve, reject) => loads.push({ config: config as ModelConfig, signal: signal!, resolve, reject })),
    footprint: async () => 0,
    admission,
    resident: (m) => void resident.push(m),
    evicted: (reason) => void evictions.push(reason),
    now: () => clock.now(),
  };
  const config = ModelConfig.parse({ id: 'm', task: 'vad', path: '/m.onnx', ...fields });
  const actor = createActor(modelMachine, {
    clock,
    input: {
      config,
      deps,
      serverIdleUnloadMs: server.idle ?? 0,
      serverLoadTimeoutMs: server.loadTimeout ?? 0,
      serverCrashCooldownMs: server.crashCooldown ?? 0,
      serverBusyTimeoutMs: server.busy ?? 0,
    },
  });
  actor.start();
  const emitted: string[] = [];
  actor.on('*', (e) => void emitted.push(e.type));
  const replies: EvictReply[] = [];
  const inbox = createActor(fromCallback(({ receive }) => receive((e: EvictReply) => void replies.push(e))));
  inbox.start();
  const value = (): unknown => actor.getSnapshot().value;
  /** Loads and answers the load with a pool (after the residency actor asked for it). */
  const load = async (id = 'm'): Promise<void> => {
    actor.send({ type: 'LOAD' });
    await flush();
    loads.at(-1)!.resolve(pool(id));
    await flush();
  };
  /**
   * The admission queue changes to `active` leases held, `queued` waiters, an exclusive holder or not, and says so
   * (`LEASES`).
   */
  const setLeases = (active: number, queued: number, exclusive: boolean): void => {
    Object.assign(admission, {
      activeLeases: active,
      queued,
      exclusive: exclusive ? { exclusive: true, grantedAt: 0, release: () => {} } : null,
    });
    actor.send({ type: 'LEASES' });
  };
  return {
    actor,
    setLeases,
    clock,
    loads,
    closed,
    leases,
    evictions,
    resident,
    emitted,
    replies,
    inbox: inbox as AnyActorRef,
    value,
    load,
    pool,
    failSlot: (e: Error) => failSlot!(e),
    /** The pool's slot-wait timer says the slots turned stuck (true) or move again (false). */
    stuckSlots: (stuck: boolean) => latest.onStuck!(stuck),
  };
}

describe('model chart (createActor, SimulatedClock, no ModelEntry class)', () => {
  it('unloaded -LOAD-> loading.building (no gate) -LOADED-> ready.idle; the pool is resident and `ready` is emitted', async () => {
    const c = chart();
    expect(c.value()).toBe('unloaded');
    c.actor.send({ type: 'LOAD' });
    await flush();
    expect(c.value()).toEqual({ resident: { loading: 'building' } });
    expect(c.loads).toHaveLength(1);
    c.loads[0].resolve(c.pool('m'));
    await flush();
    expect(c.value()).toEqual({ resident: { ready: { leases: { idle: 'keepAliveOff' }, work: 'flowing' } } });
    expect(c.actor.getSnapshot().context.residentBytes).toBe(1234);
    expect(c.resident).toHaveLength(1);
    expect(c.emitted).toEqual(['ready']);
  });

  it('LOAD outside unloaded is ignored: concurrent loads share one', async () => {
    const c = chart();
    c.actor.send({ type: 'LOAD' });
    c.actor.send({ type: 'LOAD' });
    await flush();
    expect(c.loads).toHaveLength(1);
  });

  it("LOAD_FAILED -> unloaded with lastError; a 503 refusal is not the model's fault (lastError kept)", async () => {
    const c = chart();
    c.actor.send({ type: 'LOAD' });
    await flush();
    c.loads[0].reject(new Error('bad weights'));
    await flush();
    expect(c.value()).toBe('unloaded');
    expect(c.actor.getSnapshot().context.lastError).toBe('bad weights');
    expect(c.emitted).toEqual(['unloaded']);
    c.actor.send({ type: 'LOAD' });
    await flush();
    c.loads[1].reject(new VoxError('insufficient_memory', 'no room'));
    await flush();
    expect(c.actor.getSnapshot().context).toMatchObject({
      lastError: 'bad weights',
      failure: expect.objectContaining({ type: 'insufficient_memory' }),
    });
  });

  it('a loader that yields no session fails the load', async () => {
    const c = chart();
    c.actor.send({ type: 'LOAD' });
    await flush();
    c.loads[0].resolve({ pool: { slots: [] }, residentBytes: 0, close: async () => {} } as unknown as LoadedModel);
    await flush();
    expect(c.actor.getSnapshot().context.lastError).toBe('the loader yielded no session');
  });

  it('past load_timeout_ms the load is abandoned (its signal aborts): unloaded with lastError naming it; not before', async () => {
    const c = chart({ load_timeout_ms: 100 });
    c.actor.send({ type: 'LOAD' });
    await flush();
    c.clock.increment(99);
    expect(stateName(c.value())).toBe('loading');
    c.clock.increment(1);
    expect(c.value()).toBe('unloaded');
    expect(c.loads[0].signal.aborted).toBe(true);
    expect(c.actor.getSnapshot().context.lastError).toMatch(/load_timeout_ms \(100 ms\)/);
  });

  it('the server load timeout applies when the model sets none; 0 = none', async () => {
    const on = chart({}, { loadTimeout: 50 });
    on.actor.send({ type: 'LOAD' });
    on.clock.increment(50);
    expect(on.value()).toBe('unloaded');
    const off = chart();
    off.actor.send({ type: 'LOAD' });
    off.clock.increment(3_600_000);
    expect(stateName(off.value())).toBe('loading');
  });

  it('ready.idle <-LEASES-> ready.busy follows the admission queue (held or queued)', async () => {
    const c = chart();
    await c.load();
    c.setLeases(1, 0, false);
    expect(c.value()).toEqual({ resident: { ready: { leases: 'busy', work: 'flowing' } } });
    c.setLeases(0, 1, false);
    expect(c.value()).toEqual({ resident: { ready: { leases: 'busy', work: 'flowing' } } });
    c.setLeases(0, 0, false);
    expect(stateName(c.value())).toBe('ready');
    expect((c.value() as { resident: { ready: unknown } }).resident.ready).toEqual({
      leases: { idle: 'keepAliveOff' },
      work: 'flowing',
    });
  });

  it('EVICT in ready.idle: the exclusive lease is held until the pool closed, EVICTED answered, counted; -> unloaded', async () => {
    const c = chart();
    await c.load();
    c.actor.send({ type: 'EVICT', reason: 'lru', replyTo: c.inbox });
    expect(stateName(c.value())).toBe('unloading');
    expect(c.replies).toEqual([{ type: 'EVICTED', id: 'm', reason: 'lru' }]);
    expect(c.evictions).toEqual(['lru']);
    expect(c.actor.getSnapshot().context.evictions).toBe(1);
    expect(c.leases).toEqual([{ exclusive: true, released: false }]);
    expect(c.actor.getSnapshot().context.evicted).toEqual({ reason: 'lru', at: c.clock.now() });
    await flush();
    expect(c.closed).toEqual(['m']);
    expect(c.value()).toBe('unloaded');
    expect(c.resident.at(-1)).toBeNull();
    await flush();
    expect(c.leases[0].released).toBe(true);
  });

  it('EVICT anywhere else (busy, an exclusive holder, unloaded, loading) is refused with the state', async () => {
    const c = chart();
    c.actor.send({ type: 'EVICT', reason: 'memory', replyTo: c.inbox });
    await c.load();
    c.setLeases(1, 0, false);
    c.actor.send({ type: 'EVICT', reason: 'lru', replyTo: c.inbox });
    c.setLeases(0, 0, true);
    c.actor.send({ type: 'EVICT', reason: 'lru', replyTo: c.inbox });
    expect(c.replies).toEqual([
      { type: 'EVICT_REFUSED', id: 'm', reason: 'memory', state: 'unloaded' },
      { type: 'EVICT_REFUSED', id: 'm', reason: 'lru', state: 'ready' },
      { type: 'EVICT_REFUSED', id: 'm', reason: 'lru', state: 'ready' },
    ]);
    expect(c.evictions).toEqual([]);
    expect(c.actor.getSnapshot().context.evictions).toBe(0);
    expect(stateName(c.value())).toBe('ready');
  });

  it('keep-alive: idle for keep_alive_ms raises EVICT idle (not before); busy time does not count; 0 = off', async () => {
    const c = chart({ keep_alive_ms: 1000 });
    await c.load();
    c.clock.increment(600);
    c.setLeases(1, 0, false);
    c.clock.increment(5000);
    c.setLeases(0, 0, false);
    c.clock.increment(999);
    expect(stateName(c.value())).toBe('ready');
    c.clock.increment(1);
    expect(c.evictions).toEqual(['idle']);
    expect(stateName(c.value())).toBe('unloading');
    // The server's idle_unload_ms when the model sets none.
    const s = chart({}, { idle: 300 });
    await s.load();
    s.clock.increment(300);
    expect(s.evictions).toEqual(['idle']);
    const off = chart({ keep_alive_ms: 0 }, { idle: 300 });
    await off.load();
    off.clock.increment(3_600_000);
    expect(off.evictions).toEqual([]);
  });

  it('UNLOAD in ready -> unloading -> CLOSED -> unloaded (`unloaded` emitted); a close error is kept as lastError', async () => {
    const c = chart();
    await c.load();
    c.actor.send({ type: 'UNLOAD' });
    expect(stateName(c.value())).toBe('unloading');
    await flush();
    expect(c.value()).toBe('unloaded');
    expect(c.emitted).toEqual(['ready', 'unloaded']);
    expect(c.actor.getSnapshot().context.residentBytes).toBe(0);
    const e = chart();
    e.actor.send({ type: 'LOAD' });
    await flush();
    e.loads[0].resolve(e.pool('m', new Error('close failed')));
    await flush();
    e.actor.send({ type: 'UNLOAD' });
    await flush();
    expect(e.actor.getSnapshot().context.lastError).toBe('close failed');
  });

  it("UNLOAD while loading is the chart's to keep: `ready` is reached (and emitted), then unloaded; once done (or the load failed) the next load stays ready", async () => {
    const c = chart();
    c.actor.send({ type: 'LOAD' });
    await flush();
    c.actor.send({ type: 'UNLOAD' });
    expect(c.value()).toEqual({ resident: { loading: 'building' } });
    expect(c.actor.getSnapshot().context.unloadAsked).toBe(true);
    c.loads[0].resolve(c.pool('m'));
    await flush();
    expect(c.value()).toBe('unloaded');
    expect(c.emitted).toEqual(['ready', 'unloaded']);
    expect(c.closed).toEqual(['m']);
    expect(c.actor.getSnapshot().context.unloadAsked).toBe(false);
    await c.load();
    expect(stateName(c.value())).toBe('ready');
    // Asked while loading, and the load fails: unloaded, nothing left asked.
    const f = chart();
    f.actor.send({ type: 'LOAD' });
    await flush();
    f.actor.send({ type: 'UNLOAD' });
    f.loads[0].reject(new Error('bad weights'));
    await flush();
    expect(f.value()).toBe('unloaded');
    await f.load();
    expect(stateName(f.value())).toBe('ready');
  });

  it('residency (the `slots` tag): from LOADED until the pool has closed, retiring included; not while loading or unloaded', async () => {
    const c = chart();
    const slots = (): boolean => c.actor.getSnapshot().hasTag('slots');
    expect(slots()).toBe(false);
    c.actor.send({ type: 'LOAD' });
    await flush();
    expect(slots()).toBe(false); // loading: no pool yet
    c.loads[0].resolve(c.pool('m'));
    await flush();
    expect(slots()).toBe(true);
    c.setLeases(1, 0, false);
    expect(slots()).toBe(true); // ready.busy
    c.setLeases(0, 0, false);
    c.actor.send({ type: 'UNLOAD' });
    expect(stateName(c.value())).toBe('unloading');
    expect(slots()).toBe(true); // retiring: its memory counts until its workers are gone
    await flush();
    expect(c.value()).toBe('unloaded');
    expect(slots()).toBe(false);
    await c.load('old');
    c.actor.send({ type: 'RECONFIGURE', config: ModelConfig.parse({ id: 'm', task: 'vad', path: '/b.onnx' }) });
    expect(slots()).toBe(true); // reconfiguring: the old pool is closing
    await flush();
    expect(c.value()).toEqual({ resident: { loading: 'building' } });
    expect(slots()).toBe(false);
  });

  it('ready.work: the pool saying its slots are stuck -> stuck (C4), moving again -> flowing; beside idle/busy, which it leaves alone', async () => {
    const c = chart({ keep_alive_ms: 1000 });
    await c.load();
    const ready = () => (c.value() as { resident: { ready: { leases: unknown; work: string } } }).resident.ready;
    expect(ready().work).toBe('flowing');
    c.stuckSlots(true);
    expect(ready()).toEqual({ leases: { idle: 'waiting' }, work: 'stuck' });
    c.setLeases(1, 0, false);
    expect(ready()).toEqual({ leases: 'busy', work: 'stuck' });
    c.stuckSlots(false);
    expect(ready()).toEqual({ leases: 'busy', work: 'flowing' });
    // Stuck and idle (its requests went away): keep-alive still unloads it.
    c.setLeases(0, 0, false);
    c.stuckSlots(true);
    c.clock.increment(1000);
    expect(c.evictions).toEqual(['idle']);
    expect(stateName(c.value())).toBe('unloading');
  });

  it("stuck (C4) is the chart's: its exclusive holder overdue past the busy timeout (its own timer, restarted per holder), or ready.work.stuck", async () => {
    const c = chart({ busy_timeout_ms: 500 }, { busy: 800 });
    const stuck = () => isStuck(c.actor.getSnapshot());
    expect(busyTimeoutOf(c.actor.getSnapshot().context)).toBe(500);
    // A manager holds the exclusive lease (the model unloaded: a load under it, say).
    c.actor.send({ type: 'HOLDER', held: true });
    c.clock.increment(499);
    expect(stuck()).toBe(false);
    c.clock.increment(1);
    expect(stuck()).toBe(true);
    expect(c.value()).toBe('unloaded'); // a flag, not a state: whatever the holder does meanwhile
    c.actor.send({ type: 'HOLDER', held: false });
    expect(stuck()).toBe(false);
    c.clock.increment(1000);
    expect(stuck()).toBe(false);
    // A new holder starts the timer again: one after another, each has its own busy timeout.
    c.actor.send({ type: 'HOLDER', held: true });
    c.clock.increment(300);
    c.actor.send({ type: 'HOLDER', held: true });
    c.clock.increment(300);
    expect(stuck()).toBe(false);
    c.clock.increment(200);
    expect(stuck()).toBe(true);
    c.actor.send({ type: 'HOLDER', held: false });
    // The slots stuck (the pool's timer): stuck too, until they move.
    await c.load();
    c.stuckSlots(true);
    expect(stuck()).toBe(true);
    c.stuckSlots(false);
    expect(stuck()).toBe(false);
  });

  it('the busy timeout is min(model, server), 0 = unbounded: no holder is ever overdue then', () => {
    expect(busyTimeoutOf(chart({}, { busy: 400 }).actor.getSnapshot().context)).toBe(400);
    expect(busyTimeoutOf(chart({ busy_timeout_ms: 900 }, { busy: 400 }).actor.getSnapshot().context)).toBe(400);
    const c = chart();
    expect(busyTimeoutOf(c.actor.getSnapshot().context)).toBe(0);
    c.actor.send({ type: 'HOLDER', held: true });
    c.clock.increment(3_600_000);
    expect(isStuck(c.actor.getSnapshot())).toBe(false);
  });

  it('SLOT_FAILED in ready unloads the model with lastError', async () => {
    const c = chart();
    await c.load();
    c.failSlot(new Error('slot host exited (SIGKILL)'));
    expect(stateName(c.value())).toBe('unloading');
    await flush();
    expect(c.value()).toBe('unloaded');
    expect(c.actor.getSnapshot().context.lastError).toBe('slot host exited (SIGKILL)');
  });

  it('RECONFIGURE in unloaded commits at once; in ready closes the old pool, commits, loads the new config', async () => {
    const c = chart();
    c.actor.send({ type: 'RECONFIGURE', config: ModelConfig.parse({ id: 'm', task: 'vad', path: '/a.onnx' }) });
    expect(c.actor.getSnapshot().context.config.path).toBe('/a.onnx');
    await c.load('old');
    const next = ModelConfig.parse({ id: 'm', task: 'vad', path: '/b.onnx', slots: 2 });
    c.actor.send({ type: 'RECONFIGURE', config: next });
    expect(stateName(c.value())).toBe('reconfiguring');
    expect(c.actor.getSnapshot().context.config.path).toBe('/a.onnx');
    await flush();
    expect(c.closed).toEqual(['old']);
    expect(c.value()).toEqual({ resident: { loading: 'building' } });
    expect(c.actor.getSnapshot().context).toMatchObject({ config: next, next: null });
    expect(c.loads.at(-1)!.config).toBe(next);
  });

  it('RECONFIGURE while loading or unloading is kept: applied once ready (old pool closed, new config loaded), committed if the chart ends unloaded', async () => {
    const b = ModelConfig.parse({ id: 'm', task: 'vad', path: '/b.onnx' });
    // While loading, the load then succeeds: ready (emitted), then reconfiguring, then the new config loads.
    const c = chart();
    c.actor.send({ type: 'LOAD' });
    await flush();
    c.actor.send({ type: 'RECONFIGURE', config: b });
    expect(c.value()).toEqual({ resident: { loading: 'building' } });
    c.loads[0].resolve(c.pool('old'));
    await flush();
    expect(c.closed).toEqual(['old']);
    expect(c.emitted).toEqual(['ready']);
    expect(c.value()).toEqual({ resident: { loading: 'building' } });
    expect(c.loads.at(-1)!.config).toBe(b);
    expect(c.actor.getSnapshot().context).toMatchObject({ config: b, next: null });
    // While loading, the load fails: unloaded with the new config committed.
    const f = chart();
    f.actor.send({ type: 'LOAD' });
    await flush();
    f.actor.send({ type: 'RECONFIGURE', config: b });
    f.loads[0].reject(new Error('bad weights'));
    await flush();
    expect(f.value()).toBe('unloaded');
    expect(f.actor.getSnapshot().context).toMatchObject({ config: b, next: null });
    // While unloading (a slot died), with cool-downs on: committed, not held back.
    const u = chart({}, { crashCooldown: 10_000 });
    await u.load();
    u.failSlot(new Error('slot died'));
    expect(stateName(u.value())).toBe('unloading');
    u.actor.send({ type: 'RECONFIGURE', config: b });
    await flush();
    expect(u.value()).toBe('unloaded');
    expect(u.actor.getSnapshot().context).toMatchObject({ config: b, next: null, coolDown: null });
  });

  it('RECONFIGURE whose old pool fails to close: the new config is committed, unloaded, with the error', async () => {
    const c = chart();
    c.actor.send({ type: 'LOAD' });
    await flush();
    c.loads[0].resolve(c.pool('old', new Error('close failed')));
    await flush();
    const next = ModelConfig.parse({ id: 'm', task: 'vad', path: '/b.onnx' });
    c.actor.send({ type: 'RECONFIGURE', config: next });
    await flush();
    expect(c.value()).toBe('unloaded');
    expect(c.actor.getSnapshot().context).toMatchObject({ config: next, lastError: 'close failed' });
  });

  it('under a supervisor gate the load waits in loading.queued (asking with its footprint and busy timeout) until LOAD_GRANTED', async () => {
    const { setup } = await import('xstate');
    const requests: { replyTo: AnyActorRef; timeout_ms: number }[] = [];
    const clock = new SimulatedClock();
    const gate = fromCallback(({ receive }) =>
      receive(
        (e: { type: string; replyTo: AnyActorRef; timeout_ms: number }) =>
          void (e.type === 'LOAD_REQUESTED' && requests.push(e)),
      ),
    );
    const parent = setup({ actors: { gate, model: modelMachine } }).createMachine({
      invoke: [
        { src: 'gate', systemId: 'supervisor' },
        {
          id: 'model',
          src: 'model',
          input: () => ({
            config: ModelConfig.parse({ id: 'm', task: 'vad', path: '/m.onnx', busy_timeout_ms: 700 }),
            deps: chartDeps(),
          }),
        },
      ],
    });
    const loads: unknown[] = [];
    const chartDeps = (): ModelDeps => ({
      loader: () => new Promise(() => void loads.push(1)),
      footprint: async () => 5,
      admission: { tryAcquire: () => null, activeLeases: 0, queued: 0, exclusive: null },
      resident: () => {},
      evicted: () => {},
    });
    const root = createActor(parent, { clock });
    root.start();
    const model = root.getSnapshot().children.model as unknown as ReturnType<typeof createActor<typeof modelMachine>>;
    model.send({ type: 'LOAD' });
    await flush();
    expect(model.getSnapshot().value).toEqual({ resident: { loading: 'queued' } });
    expect(requests).toHaveLength(1);
    expect(requests[0].timeout_ms).toBe(700);
    expect(loads).toHaveLength(0);
    requests[0].replyTo.send({ type: 'LOAD_GRANTED' });
    await flush();
    expect(model.getSnapshot().value).toEqual({ resident: { loading: 'building' } });
    expect(loads).toHaveLength(1);
    model.send({ type: 'UNLOAD' }); // ignored while loading
    expect(stateName(model.getSnapshot().value)).toBe('loading');
  });
});

describe('model chart: crash-loop cool-down and shutdown (issue 25)', () => {
  it('issue 25 item 9: a pool that fails (crash loop) holds the model back for crash_cooldown_ms, doubled per failure in a row; LOAD meanwhile is refused 503 model_cooling_down with Retry-After', async () => {
    const c = chart({}, { crashCooldown: 10_000 });
    const refusal = (): VoxError => {
      c.actor.send({ type: 'LOAD' });
      return c.actor.getSnapshot().context.failure as VoxError;
    };
    await c.load();
    c.failSlot(new Error('3 slot crashes within a minute'));
    await flush();
    expect(c.value()).toBe('coolingDown');
    expect(stateName(c.value())).toBe('unloaded');
    expect(c.actor.getSnapshot().context.coolDown).toMatchObject({ failures: 1, until: c.clock.now() + 10_000 });
    c.clock.increment(4_000);
    const e = refusal();
    expect(e).toMatchObject({ code: 'model_cooling_down', status: 503, retryAfterS: 6 });
    expect(e.message).toMatch(/held back for another 6 s .*crash_cooldown_ms.*3 slot crashes within a minute/);
    expect(c.loads).toHaveLength(1); // not reloaded
    expect(c.emitted.at(-1)).toBe('unloaded'); // the waiter hears the refusal
    c.clock.increment(6_000);
    expect(c.value()).toBe('unloaded');
    // The second failure in a row: 20 s.
    c.actor.send({ type: 'LOAD' });
    await flush();
    c.loads[1].resolve(c.pool('m'));
    await flush();
    c.failSlot(new Error('again'));
    await flush();
    expect(c.actor.getSnapshot().context.coolDown).toMatchObject({ failures: 2, until: c.clock.now() + 20_000 });
    c.clock.increment(19_999);
    expect(refusal().code).toBe('model_cooling_down');
    c.clock.increment(1);
    expect(c.value()).toBe('unloaded');
  });

  it('issue 25 item 9: a host that crashes while loading (slot_failed) is held back too; a changed config ends the cool-down; 0 = off', async () => {
    const c = chart({}, { crashCooldown: 10_000 });
    c.actor.send({ type: 'LOAD' });
    await flush();
    c.loads[0].reject(new VoxError('slot_failed', 'slot failed: slot host was killed by SIGABRT'));
    await flush();
    expect(c.value()).toBe('coolingDown');
    c.actor.send({ type: 'RECONFIGURE', config: ModelConfig.parse({ id: 'm', task: 'vad', path: '/fixed.onnx' }) });
    expect(c.value()).toBe('unloaded');
    expect(c.actor.getSnapshot().context.config.path).toBe('/fixed.onnx');

    const off = chart();
    await off.load();
    off.failSlot(new Error('crash loop'));
    await flush();
    expect(off.value()).toBe('unloaded');
    off.actor.send({ type: 'LOAD' });
    await flush();
    expect(off.loads).toHaveLength(2); // reloaded at once, as before
  });

  it('issue 25 item 10: DRAIN during a cold load abandons it at once (its signal aborts: the hosts still loading are killed) and refuses later loads 503 shutting_down', async () => {
    const c = chart();
    c.actor.send({ type: 'LOAD' });
    await flush();
    expect(stateName(c.value())).toBe('loading');
    c.actor.send({ type: 'DRAIN' });
    expect(c.value()).toBe('unloaded');
    expect(c.loads[0].signal.aborted).toBe(true);
    expect(c.actor.getSnapshot().context.failure).toMatchObject({ code: 'shutting_down' });
    // The load finishing late changes nothing: it is closed, never resident.
    c.loads[0].resolve(c.pool('late'));
    await flush();
    expect(c.value()).toBe('unloaded');
    expect(c.resident.filter(Boolean)).toEqual([]); // never marked resident
    c.actor.send({ type: 'LOAD' });
    await flush();
    expect(c.loads).toHaveLength(1);
    expect(c.emitted.at(-1)).toBe('unloaded');
  });
});
