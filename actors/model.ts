import {
  and,
  assign,
  createActor,
  emit,
  enqueueActions,
  fromCallback,
  not,
  raise,
  sendTo,
  setup,
  type ActorRefFrom,
  type AnyActorRef,
  type InspectionEvent,
  type SnapshotFrom,
} from 'xstate';
import { Admission, effectiveTimeout, type Lease } from '../runtime/admission.js';
import { Batcher, denoisePacking, vadPacking, wakewordPacking, type Packing } from '../runtime/batcher.js';
import { ModelConfig, parseTaskOptions, parseWith } from '../runtime/config.js';
import { fromWire, voxError, VoxError, type WireError } from '../runtime/errors.js';
import type { LoadedModel, ModelLoader } from '../runtime/loader.js';
import { createLogger, type Metrics } from '../runtime/telemetry.js';
import type { Logger } from 'pino';
import type { Job, JobResult } from '../runtime/slots/slot-protocol.js';

/** Why a model entry is asked to give up its slots without a manager asking (DESIGN.md C12-C14). */
export type EvictReason = 'lru' | 'idle' | 'memory';

/**
 * A model entry's context: the committed config and serialisable figures. The slot pool itself is
 * held by the invoked `residency` actor, never here.
 */
export interface ModelContext {
  config: ModelConfig;
  /** The live dependencies it was created with. */
  deps: ModelDeps;
  /** The exclusive lease an accepted eviction holds until the pool is closed. */
  evictionLease: Lease | null;
  /** The config a reconfiguration commits once the old pool is gone. */
  next: ModelConfig | null;
  lastError: string | null;
  /** Why the last load ended without a pool (also capacity refusals, which are not `lastError`). */
  failure: unknown;
  /** The server's `idle_unload_ms`, ms (0 = off); the model's `keep_alive_ms` overrides it. */
  serverIdleUnloadMs: number;
  /** The server's `load_timeout_ms`, ms (0 = none); the model's own overrides it. */
  serverLoadTimeoutMs: number;
  /** The last eviction: why and when (ms since the epoch). */
  evicted: { reason: EvictReason; at: number } | null;
  /** Measured footprint of the current pool, bytes (0 when nothing is resident). */
  residentBytes: number;
  /** The current pool runs its jobs on other nodes (a cluster placement): its slots are not here. */
  remote: boolean;
  /** The server's `crash_cooldown_ms`, ms (0 = off). */
  serverCrashCooldownMs: number;
  /** Why the pool is failing now (a `SLOT_FAILED` in `ready`), until it has closed. */
  slotFailure: string | null;
  /**
   * The last crash-loop failure: how many in a row, when, until when the model is held back, ms since the epoch, and
   * why.
   */
  coolDown: CoolDown | null;
  /** The server drains (shutdown): a load in progress is abandoned and no new one starts. */
  draining: boolean;
  /** The server's busy-timeout ceiling, ms (0 = unbounded); the model's `busy_timeout_ms` lowers it ({@link busyTimeoutOf}). */
  serverBusyTimeoutMs: number;
  /**
   * The exclusive holder (a manager, or an accepted eviction) has held its lease longer than the busy timeout (C4): set by
   * the delayed `HOLDER_OVERDUE` the chart raises at `HOLDER {held: true}`, cleared by the next `HOLDER`.
   */
  holderOverdue: boolean;
  /** Evictions accepted since start (LRU, memory or idle). */
  evictions: number;
  /** An `UNLOAD` came while the pool was loading (or being replaced): the model unloads once it is ready. */
  unloadAsked: boolean;
}

/** A model's busy-timeout ceiling, ms: min(model, server), 0 = unbounded. Also the overdue limit of C4. */
export function busyTimeoutOf(context: Pick<ModelContext, 'config' | 'serverBusyTimeoutMs'>): number {
  return effectiveTimeout(undefined, context.config.busy_timeout_ms, context.serverBusyTimeoutMs);
}

/**
 * True while the model is stuck (DESIGN.md C4), the one home of that question: its chart is `ready.work.stuck` (every
 * slot has been running one inference for longer than the busy timeout: the pool's slot-wait timer says so), or its
 * exclusive holder is overdue (`context.holderOverdue`, the chart's own timer). A new request is refused 503 at once.
 */
export function isStuck(snapshot: ModelSnapshot): boolean {
  return snapshot.context.holderOverdue || snapshot.matches({ resident: { ready: { work: 'stuck' } } });
}

/** A crash-looping model's cool-down (issue 25 item 9), ms since the epoch. */
export interface CoolDown {
  /** Crash-loop failures in a row (each within {@link COOL_DOWN_STREAK_MS} of the previous). */
  failures: number;
  at: number;
  until: number;
  reason: string;
}

/** A crash-loop failure within this long of the previous one doubles the cool-down, ms. */
export const COOL_DOWN_STREAK_MS = 600_000;
/** The longest cool-down, ms (unless `crash_cooldown_ms` itself is longer). */
export const COOL_DOWN_MAX_MS = 300_000;

/**
 * The cool-down after a crash-loop failure at `now`: `base` x 2^(failures in a row - 1), at most
 * {@link COOL_DOWN_MAX_MS} (or `base`). The usual exponential back-off of restart loops
 * (Kubernetes' CrashLoopBackOff: 10 s doubling to 5 min).
 */
export function nextCoolDown(previous: CoolDown | null, base: number, now: number, reason: string): CoolDown {
  const failures = previous && now - previous.at < COOL_DOWN_STREAK_MS ? previous.failures + 1 : 1;
  const ms = Math.min(Math.max(base, COOL_DOWN_MAX_MS), base * 2 ** Math.min(failures - 1, 30));
  return { failures, at: now, until: now + ms, reason };
}

export type ModelEvent =
  | { type: 'LOAD' }
  | { type: 'RECONFIGURE'; config: ModelConfig }
  | { type: 'UNLOAD' }
  /** Give up the slots for the supervisor; refused (`EVICT_REFUSED` to `replyTo`) unless idle. */
  | { type: 'EVICT'; reason: EvictReason; replyTo?: AnyActorRef }
  | { type: 'SLOT_FAILED'; message: string }
  /**
   * From the `residency` actor: every slot has run its job longer than the busy timeout (C4; the pool's timer decides).
   */
  | { type: 'SLOTS_STUCK' }
  /** From the `residency` actor: the stuck slots move again (a job ended, a slot freed). */
  | { type: 'SLOTS_FLOWING' }
  /**
   * The server drains (shutdown): a load in progress is abandoned (its slot hosts killed), a `LOAD` is refused
   * `shutting_down`.
   */
  | { type: 'DRAIN' }
  /**
   * The model turned in use or idle (its first lease or waiter came, or its last one left): `ready.idle` /
   * `ready.busy` look again.
   */
  | { type: 'LEASES' }
  /**
   * The exclusive lease changed hands (a manager or an accepted eviction took it, or gave it back): the holder's busy
   * timeout starts again (`held`) or stops. Sent only when the holder changes, never per request.
   */
  | { type: 'HOLDER'; held: boolean }
  /** Raised by the chart itself, busy-timeout ms after `HOLDER {held: true}`: the holder is overdue (C4). */
  | { type: 'HOLDER_OVERDUE' }
  /** From the `residency` actor: the cold-load gate let the load through. */
  | { type: 'LOAD_GRANTED' }
  /**
   * From the `residency` actor: the pool is complete (`residentBytes` measured; `remote`: its slots are on other
   * nodes).
   */
  | { type: 'LOADED'; residentBytes: number; remote: boolean }
  | { type: 'LOAD_FAILED'; error: unknown }
  /** From the `residency` actor: the pool is closed (`error` if closing failed). */
  | { type: 'CLOSED'; error?: string };

/**
 * A model chart's live dependencies, given as input (the chart closes over nothing else). Tests
 * give fakes; {@link ModelEntry} gives the real ones.
 */
export interface ModelDeps {
  /** Builds the pool for a config (aborted when the entry leaves `resident` while loading). */
  loader: ModelLoader;
  /**
   * Estimated footprint of a config, bytes, sent to the supervisor's cold-load gate (0 when the memory guard is off).
   */
  footprint: (config: ModelConfig) => Promise<number>;
  /**
   * The model's admission queue, the one home of its leases: the guards read what it holds and
   * who waits (the entry sends `LEASES` when the model turns in use or idle); an accepted eviction
   * holds its exclusive lease until the pool is closed.
   */
  admission: Pick<Admission, 'tryAcquire' | 'activeLeases' | 'queued' | 'exclusive'>;
  /** The pool is live (`model`), or is being closed (null): not resident from that moment (C9). */
  resident: (model: LoadedModel | null) => void;
  /** An eviction was accepted (the chart counts it; the entry logs it and tells the metrics). */
  evicted: (reason: EvictReason) => void;
  /** The clock, ms since the epoch (default `Date.now`). */
  now?: () => number;
  /** Cluster placement (cluster/node.ts): decides where a cold load goes; absent, every load is local. */
  place?: PlaceHook;
}

/**
 * Where a model's cold load goes (cluster mode): `local()` loads it on this node (through the
 * cold-load gate and the loader); else the hook returns a pool whose jobs run on the nodes
 * holding the model. An aborted `signal` abandons the placement.
 */
export type PlaceHook = (
  config: ModelConfig,
  signal: AbortSignal,
  local: () => Promise<LoadedModel>,
) => Promise<LoadedModel>;

/** A model chart's input: its config, its live dependencies and the server-wide defaults it falls back on, ms. */
export interface ModelInput {
  config: ModelConfig;
  deps: ModelDeps;
  /** `idle_unload_ms` (0 = off). */
  serverIdleUnloadMs?: number;
  /** `load_timeout_ms` (0 = none). */
  serverLoadTimeoutMs?: number;
  /** `crash_cooldown_ms` (0 = off). */
  serverCrashCooldownMs?: number;
  /** The server's `busy_timeout_ms` ceiling (0 = unbounded). */
  serverBusyTimeoutMs?: number;
  /** The server drains already (registered during shutdown): no load starts. */
  draining?: boolean;
}

/**
 * What a model chart emits: it has settled `ready` (the pool is live) or `unloaded` (after a failed load, `failure`
 * says why).
 */
export type ModelEmitted = { type: 'ready' } | { type: 'unloaded' };

/** Replies to `EVICT`, sent to its `replyTo`. */
export type EvictReply =
  | { type: 'EVICTED'; id: string; reason: EvictReason }
  | { type: 'EVICT_REFUSED'; id: string; reason: EvictReason; state: string };

const errorMessage = (e: unknown): string => (e instanceof Error ? e.message : String(e));
/** A load refused for capacity (503: busy, insufficient memory) is not a fault of the model. */
const refused = (e: unknown): boolean => e instanceof VoxError && e.status === 503;

/** What the `residency` actor receives: `CLOSE` from the chart, the gate's answer from the supervisor. */
export type ResidencyEvent = { type: 'CLOSE' } | { type: 'LOAD_GRANTED' } | { type: 'LOAD_REFUSED'; error: WireError };

/** Input of the `residency` actor: the config to load and the chart's dependencies. */
export interface ResidencyInput {
  config: ModelConfig;
  deps: ModelDeps;
  /** The busy timeout a cold load may wait at the gate, ms (0 = unbounded). */
  busyTimeoutMs: number;
}

/**
 * The `residency` actor, invoked for as long as the entry is `resident`: it asks the supervisor's
 * cold-load gate (when the entry runs under one), loads the pool, holds it, and closes it on
 * `CLOSE` or when stopped. It answers `LOAD_GRANTED`, `LOADED`, `LOAD_FAILED`, `CLOSED` and, when
 * a slot dies, `SLOT_FAILED`.
 */
const residency = fromCallback<ResidencyEvent, ResidencyInput>(
  ({ input: { config, deps, busyTimeoutMs }, sendBack, receive, self, system }) => {
    let model: LoadedModel | null = null;
    let stopped = false;
    /** Aborted when the entry leaves `resident` (an unload, or the load timeout) while loading. */
    const abandon = new AbortController();
    let closing: Promise<void> | null = null;
    /** The supervisor's cold-load gate, when the entry runs under one. */
    const gate = system.get('supervisor') as AnyActorRef | undefined;
    let atGate = false;
    let answer: { granted: () => void; refused: (e: VoxError) => void } | null = null;
    const leaveGate = (): void => {
      if (atGate) gate?.send({ type: 'LOAD_FINISHED', id: config.id });
      atGate = false;
    };
    const close = (): Promise<void> =>
      (closing ??= (async () => {
        // Marked not resident first (C9), then the slots close.
        deps.resident(null);
        await model?.close();
      })());
    /** The pool `local` loaded here (a placement may return another, whose slots are on other nodes). */
    let here: LoadedModel | null = null;
    /** Loads here: through the cold-load gate, then the loader. */
    const local = async (): Promise<LoadedModel> => {
      if (gate) {
        const needed_bytes = await deps.footprint(config);
        if (stopped) throw voxError('model_stopped', {});
        const granted = new Promise<void>((resolve, reject) => (answer = { granted: resolve, refused: reject }));
        atGate = true;
        gate.send({
          type: 'LOAD_REQUESTED',
          id: config.id,
          needed_bytes,
          timeout_ms: busyTimeoutMs,
          replyTo: self,
        });
        await granted;
      }
      sendBack({ type: 'LOAD_GRANTED' });
      here = await deps.loader(config, abandon.signal);
      return here;
    };
    void (async () => {
      try {
        // In a cluster, placement decides: here (`local`), or a pool whose jobs go to the holders.
        const m = deps.place ? await deps.place(config, abandon.signal, local) : await local();
        if (!m?.pool?.slots.length) {
          await m?.close?.();
          throw new Error('the loader yielded no session');
        }
        if (stopped) return void (await m.close());
        model = m;
        m.pool.onFailure((err) => sendBack({ type: 'SLOT_FAILED', message: err.message }));
        m.pool.onStuck = (stuck) => sendBack({ type: stuck ? 'SLOTS_STUCK' : 'SLOTS_FLOWING' });
        deps.resident(m);
        sendBack({ type: 'LOADED', residentBytes: m.residentBytes, remote: m !== here });
        // The gate opens for the next load once this one holds its slots (`slots` tag): it counts them.
        leaveGate();
      } catch (error) {
        leaveGate();
        if (!stopped) sendBack({ type: 'LOAD_FAILED', error });
      }
    })();
    receive((e) => {
      if (e.type === 'LOAD_GRANTED') return answer?.granted();
      if (e.type === 'LOAD_REFUSED') {
        atGate = false;
        return answer?.refused(fromWire(e.error));
      }
      close().then(
        () => sendBack({ type: 'CLOSED' }),
        (err) => sendBack({ type: 'CLOSED', error: errorMessage(err) }),
      );
    });
    return () => {
      stopped = true;
      abandon.abort();
      leaveGate();
      answer?.refused(voxError('model_stopped', {}));
      void close().catch(() => {});
    };
  },
);

/**
 * The model entry state chart (DESIGN.md section 2):
 * `unloaded -> resident.loading -> resident.ready.{idle,busy} -> resident.unloading -> unloaded`,
 * and `resident.reconfiguring` (close the old pool, commit the new config, load again).
 *
 * - The `residency` actor, invoked for as long as the entry is `resident`, loads the pool (through
 *   the supervisor's cold-load gate), holds it, and closes it on `CLOSE` or when stopped. It
 *   answers `LOADED`, `LOAD_FAILED`, `CLOSED` and, when a slot dies, `SLOT_FAILED`.
 * - `ready.idle` / `ready.busy` follow the admission queue (its guards read it; it sends `LEASES` when the model turns in use or idle).
 * - `EVICT {reason}` is taken only in `ready.idle` through the guard `evictable` (no lease held, no
 *   waiter, no exclusive holder); anywhere else it is answered `EVICT_REFUSED`: that refusal is
 *   the try-acquire of eviction (C12). An accepted eviction takes the exclusive lease
 *   (`holdForEviction`), so requests arriving meanwhile queue and load the model again.
 * - Keep-alive (C14): `ready.idle` raises `EVICT {reason: "idle"}` after `keepAlive` ms
 *   (`keep_alive_ms`, else the server's `idle_unload_ms`; never when 0).
 * - The tag `slots` marks the states whose pool exists (`ready`, and `unloading` / `reconfiguring`
 *   until it has closed): residency as the supervisor counts it (C12).
 * - A failed load returns to `unloaded` with `lastError` (not for a 503 refusal) and can be
 *   retried; so does a load still building after `loadTimeout` ms (`load_timeout_ms`); a slot that dies in `ready`
 * unloads the model with `lastError` set.
 * Live resources come as input ({@link ModelDeps}); {@link ModelEntry} gives the real ones.
 */
export const modelMachine = setup({
  types: {
    context: {} as ModelContext,
    events: {} as ModelEvent,
    input: {} as ModelInput,
    emitted: {} as ModelEmitted,
    tags: {} as 'slots',
  },
  actors: { residency },
  actions: {
    /** Takes the exclusive lease for an accepted eviction (released once closed). */
    holdForEviction: assign({ evictionLease: ({ context }) => context.deps.admission.tryAcquire(true) }),
    /**
     * Gives the eviction's exclusive lease back, after the chart has settled in `unloaded` (requests queued behind it
     * load again).
     */
    releaseEviction: enqueueActions(({ context, enqueue }) => {
      const lease = context.evictionLease;
      if (!lease) return;
      enqueue.assign({ evictionLease: null });
      enqueue(() => queueMicrotask(() => lease.release()));
    }),
    /** A `RECONFIGURE` that comes while the pool is loading or closing: kept, the last one wins (applied once settled). */
    keepReconfiguration: assign({
      next: ({ context, event }) => (event.type === 'RECONFIGURE' ? event.config : context.next),
    }),
    /** An `UNLOAD` that comes while the pool is loading or being replaced: kept, done once ready. */
    keepUnload: assign({ unloadAsked: true }),
    /** Counts an accepted eviction (and tells the entry, which logs it and tells the metrics). */
    recordEviction: enqueueActions(({ context, enqueue }, params: { reason: EvictReason }) => {
      enqueue.assign({ evictions: context.evictions + 1 });
      enqueue(() => context.deps.evicted(params.reason));
    }),
    /**
     * The exclusive holder changed: its overdue flag clears and, for a new holder under a busy timeout, the chart's own
     * timer starts (`HOLDER_OVERDUE` after the busy timeout, C4).
     */
    watchHolder: enqueueActions(({ context, event, enqueue }) => {
      enqueue.cancel('holderOverdue');
      if (context.holderOverdue) enqueue.assign({ holderOverdue: false });
      const limit = busyTimeoutOf(context);
      if ((event as { held?: boolean }).held && limit > 0)
        enqueue.raise({ type: 'HOLDER_OVERDUE' }, { id: 'holderOverdue', delay: limit });
    }),
  },
  guards: {
    /** Leases held or waiting (read from the admission queue): the model is in use. */
    inUse: ({ context: { deps } }) => deps.admission.activeLeases > 0 || deps.admission.queued > 0,
    /** Idle: no lease, no waiter, no exclusive holder. */
    evictable: ({ context: { deps } }) =>
      deps.admission.activeLeases === 0 && deps.admission.queued === 0 && !deps.admission.exclusive,
    keepAliveOn: ({ context }) => (context.config.keep_alive_ms ?? context.serverIdleUnloadMs) > 0,
    hasNext: ({ context }) => context.next !== null,
    unloadAsked: ({ context }) => context.unloadAsked,
    draining: ({ context }) => context.draining,
    /** The pool closed because it failed (a crash loop), and cool-downs are on. */
    crashLooped: ({ context }) => context.slotFailure !== null && context.serverCrashCooldownMs > 0,
    /** A slot host crashed while the pool was being built (`slot_failed`), and cool-downs are on. */
    crashedLoading: ({ context, event }) =>
      context.serverCrashCooldownMs > 0 &&
      (event as { error?: unknown }).error instanceof VoxError &&
      ((event as { error: VoxError }).error.code === 'slot_failed' ||
        (event as { error: VoxError }).error.code === 'slot_crash_loop'),
    loadTimeoutOn: ({ context }) => (context.config.load_timeout_ms ?? context.serverLoadTimeoutMs) > 0,
  },
  delays: {
    /** Keep-alive, ms: `keep_alive_ms`, else the server's `idle_unload_ms` (guarded off at 0). */
    keepAlive: ({ context }) => Math.max(1, context.config.keep_alive_ms ?? context.serverIdleUnloadMs),
    /** Load timeout, ms: `load_timeout_ms`, else the server's (guarded off at 0). */
    loadTimeout: ({ context }) => Math.max(1, context.config.load_timeout_ms ?? context.serverLoadTimeoutMs),
    /** The rest of the cool-down, ms. */
    coolDown: ({ context }) => Math.max(1, (context.coolDown?.until ?? 0) - (context.deps.now ?? Date.now)()),
  },
}).createMachine({
  id: 'model',
  context: ({ input }) => ({
    config: input.config,
    deps: input.deps,
    evictionLease: null,
    next: null,
    lastError: null,
    failure: null,
    serverIdleUnloadMs: input.serverIdleUnloadMs ?? 0,
    serverLoadTimeoutMs: input.serverLoadTimeoutMs ?? 0,
    evicted: null,
    residentBytes: 0,
    remote: false,
    serverCrashCooldownMs: input.serverCrashCooldownMs ?? 0,
    slotFailure: null,
    coolDown: null,
    draining: input.draining ?? false,
    serverBusyTimeoutMs: input.serverBusyTimeoutMs ?? 0,
    holderOverdue: false,
    evictions: 0,
    unloadAsked: false,
  }),
  initial: 'unloaded',
  on: {
    DRAIN: { actions: assign({ draining: true }) },
    // No action: taking the event is enough for `ready.idle` / `ready.busy` to look at the queue again.
    LEASES: {},
    HOLDER: { actions: 'watchHolder' },
    HOLDER_OVERDUE: { actions: assign({ holderOverdue: true }) },
    // Taken only where a state does not take it first (ready.idle, through `evictable`).
    EVICT: {
      actions: enqueueActions(({ enqueue, event, context, self }) => {
        const snapshot = self.getSnapshot() as { value: unknown } | undefined;
        if (event.replyTo) {
          enqueue.sendTo(event.replyTo, {
            type: 'EVICT_REFUSED',
            id: context.config.id,
            reason: event.reason,
            state: stateName(snapshot?.value),
          } satisfies EvictReply);
        }
      }),
    },
  },
  states: {
    unloaded: {
      // A reconfiguration kept while loading or unloading is committed here, whichever way the chart came.
      entry: [
        assign({ unloadAsked: false, config: ({ context }) => context.next ?? context.config, next: null }),
        emit({ type: 'unloaded' }),
      ],
      on: {
        LOAD: [
          // While the server drains, nothing loads (the waiter hears `unloaded` with the refusal).
          {
            guard: 'draining',
            actions: [assign({ failure: () => voxError('shutting_down') }), emit({ type: 'unloaded' })],
          },
          { target: 'resident' },
        ],
        RECONFIGURE: { actions: assign({ config: ({ event }) => event.config }) },
      },
    },
    /**
     * Unloaded and held back after a crash loop (issue 25 item 9; reported `unloaded` with
     * `cool_down`): a `LOAD` is refused 503 `model_cooling_down` (Retry-After: the rest) until
     * `coolDown` ms have passed; a changed config (a manager's reconfiguration) ends it at once.
     */
    coolingDown: {
      entry: [emit({ type: 'unloaded' }), assign({ unloadAsked: false })],
      // A reconfiguration kept while loading or unloading ends the cool-down, as one sent now does.
      always: { guard: 'hasNext', target: 'unloaded', actions: assign({ coolDown: null }) },
      after: { coolDown: 'unloaded' },
      on: {
        LOAD: {
          actions: [
            assign({
              failure: ({ context }) => {
                const c = context.coolDown!;
                const restS = Math.max(1, Math.ceil((c.until - (context.deps.now ?? Date.now)()) / 1000));
                return voxError('model_cooling_down', {
                  id: context.config.id,
                  failures: c.failures,
                  restS,
                  reason: c.reason,
                  retryAfterS: restS,
                });
              },
            }),
            emit({ type: 'unloaded' }),
          ],
        },
        RECONFIGURE: { target: 'unloaded', actions: assign({ config: ({ event }) => event.config, coolDown: null }) },
      },
    },
    resident: {
      invoke: {
        id: 'residency',
        src: 'residency',
        input: ({ context }) => ({ config: context.config, deps: context.deps, busyTimeoutMs: busyTimeoutOf(context) }),
      },
      initial: 'loading',
      states: {
        loading: {
          initial: 'queued',
          // Shutdown: the load is abandoned (leaving `resident` stops the `residency` actor, which kills the hosts
          // still loading).
          always: {
            guard: 'draining',
            target: '#model.unloaded',
            actions: assign({ failure: () => voxError('shutting_down') }),
          },
          states: {
            /** Waiting at the supervisor's cold-load gate (at once past it when no limit is set). */
            queued: { on: { LOAD_GRANTED: 'building' } },
            /**
             * Building the pool: the primary session, then its clones. Past the load timeout the
             * load is abandoned: leaving `resident` stops the `residency` actor, which kills the
             * process hosts still loading.
             */
            building: {
              after: {
                loadTimeout: {
                  guard: 'loadTimeoutOn',
                  target: '#model.unloaded',
                  actions: assign(({ context }) => {
                    const error = voxError('load_timeout', {
                      ms: context.config.load_timeout_ms ?? context.serverLoadTimeoutMs,
                    });
                    return { failure: error, lastError: error.message };
                  }),
                },
              },
            },
          },
          on: {
            // Unloaded once ready (the manager's exclusive lease keeps requests out meanwhile).
            UNLOAD: { actions: 'keepUnload' },
            // Kept: applied once ready (closed, committed, loaded again), or committed if the load ends unloaded.
            RECONFIGURE: { actions: 'keepReconfiguration' },
            LOADED: {
              target: 'ready',
              actions: assign({
                residentBytes: ({ event }) => event.residentBytes,
                remote: ({ event }) => event.remote,
                lastError: null,
                failure: null,
              }),
            },
            LOAD_FAILED: [
              {
                // A host that crashes while loading crashes again on the next request's load: held back too.
                guard: 'crashedLoading',
                target: '#model.coolingDown',
                actions: assign(({ context, event }) => ({
                  failure: event.error,
                  lastError: errorMessage(event.error),
                  coolDown: nextCoolDown(
                    context.coolDown,
                    context.serverCrashCooldownMs,
                    (context.deps.now ?? Date.now)(),
                    errorMessage(event.error),
                  ),
                })),
              },
              {
                target: '#model.unloaded',
                actions: assign({
                  failure: ({ event }) => event.error,
                  lastError: ({ context, event }) =>
                    refused(event.error) ? context.lastError : errorMessage(event.error),
                }),
              },
            ],
          },
        },
        /**
         * Two regions: `leases` (`idle` / `busy`, from the admission queue) and `work` (`flowing` /
         * `stuck`, from the pool's slot-wait timer: every slot has run its job longer than the busy
         * timeout, C4).
         */
        ready: {
          tags: ['slots'],
          entry: emit({ type: 'ready' }),
          type: 'parallel',
          // An UNLOAD that came while loading: `ready` is reached (and emitted), then left.
          always: [
            { guard: 'unloadAsked', target: 'unloading' },
            { guard: 'hasNext', target: 'reconfiguring' },
          ],
          on: {
            UNLOAD: 'unloading',
            SLOT_FAILED: {
              target: 'unloading',
              actions: assign({ lastError: ({ event }) => event.message, slotFailure: ({ event }) => event.message }),
            },
            RECONFIGURE: { target: 'reconfiguring', actions: assign({ next: ({ event }) => event.config }) },
          },
          states: {
            leases: {
              initial: 'idle',
              states: {
                idle: {
                  always: { guard: 'inUse', target: 'busy' },
                  // Keep-alive: with it on, `idle.waiting` raises EVICT idle after the delay; `keepAliveOff`: no timer
                  // at all.
                  initial: 'init',
                  states: {
                    init: { always: [{ guard: 'keepAliveOn', target: 'waiting' }, { target: 'keepAliveOff' }] },
                    waiting: { after: { keepAlive: { actions: raise({ type: 'EVICT', reason: 'idle' }) } } },
                    keepAliveOff: {},
                  },
                  on: {
                    EVICT: {
                      guard: 'evictable',
                      target: '#model.resident.unloading',
                      actions: [
                        'holdForEviction',
                        assign({
                          evicted: ({ context, event }) => ({
                            reason: event.reason,
                            at: (context.deps.now ?? Date.now)(),
                          }),
                        }),
                        { type: 'recordEviction', params: ({ event }) => ({ reason: event.reason }) },
                        enqueueActions(({ enqueue, event, context }) => {
                          if (event.replyTo)
                            enqueue.sendTo(event.replyTo, {
                              type: 'EVICTED',
                              id: context.config.id,
                              reason: event.reason,
                            } satisfies EvictReply);
                        }),
                      ],
                    },
                  },
                },
                busy: { always: { guard: not('inUse'), target: 'idle' } },
              },
            },
            work: {
              initial: 'flowing',
              states: {
                flowing: { on: { SLOTS_STUCK: 'stuck' } },
                /** New requests are refused 503 `model_stuck` at once (C4) until a job ends or a slot frees. */
                stuck: { on: { SLOTS_FLOWING: 'flowing' } },
              },
            },
          },
        },
        unloading: {
          tags: ['slots'],
          entry: [sendTo('residency', { type: 'CLOSE' }), assign({ unloadAsked: false })],
          on: {
            // Kept: committed once the pool has closed (in `unloaded`).
            RECONFIGURE: { actions: 'keepReconfiguration' },
            CLOSED: [
              {
                // The pool failed (a crash loop): held back instead of reloaded by the next request.
                guard: 'crashLooped',
                target: '#model.coolingDown',
                actions: [
                  'releaseEviction',
                  assign(({ context, event }) => ({
                    residentBytes: 0,
                    lastError: event.error ?? context.lastError,
                    coolDown: nextCoolDown(
                      context.coolDown,
                      context.serverCrashCooldownMs,
                      (context.deps.now ?? Date.now)(),
                      context.slotFailure!,
                    ),
                    slotFailure: null,
                  })),
                ],
              },
              {
                target: '#model.unloaded',
                actions: [
                  'releaseEviction',
                  assign({
                    residentBytes: 0,
                    lastError: ({ context, event }) => event.error ?? context.lastError,
                    slotFailure: null,
                  }),
                ],
              },
            ],
          },
        },
        reconfiguring: {
          tags: ['slots'],
          entry: sendTo('residency', { type: 'CLOSE' }),
          on: {
            // Unloaded once the new config has loaded (committed, as a reconfiguration does).
            UNLOAD: { actions: 'keepUnload' },
            // The last reconfiguration wins.
            RECONFIGURE: { actions: 'keepReconfiguration' },
            CLOSED: [
              {
                guard: and(['hasNext', ({ event }) => !event.error]),
                target: '#model.resident',
                reenter: true,
                actions: assign({ residentBytes: 0, config: ({ context }) => context.next!, next: null }),
              },
              {
                target: '#model.unloaded',
                actions: assign({
                  residentBytes: 0,
                  config: ({ context }) => context.next ?? context.config,
                  next: null,
                  lastError: ({ context, event }) => event.error ?? context.lastError,
                }),
              },
            ],
          },
        },
      },
    },
  },
});

export type ModelActor = ActorRefFrom<typeof modelMachine>;
export type ModelSnapshot = SnapshotFrom<typeof modelMachine>;
/** A model entry's state as `/v1/models` reports it. */
export type ModelState = 'unloaded' | 'loading' | 'ready' | 'unloading' | 'reconfiguring';

/**
 * The reported state of a model chart's value (`{resident: {ready: 'idle'}}` -> `ready`, `{resident: {loading:
 * 'queued'}}` -> `loading`).
 */
export function stateName(value: unknown): ModelState {
  if (value === 'coolingDown') return 'unloaded';
  if (typeof value === 'string') return value as ModelState;
  const inner = (value as { resident?: unknown } | undefined)?.resident;
  if (typeof inner === 'string') return inner as ModelState;
  return (inner && typeof inner === 'object' ? Object.keys(inner)[0] : 'unloaded') as ModelState;
}

/** `GET /v1/models/{id}` (DESIGN.md section 4). Times in ms since the epoch; bytes. */
export interface ModelStatus {
  id: string;
  task: string;
  state: ModelState;
  loaded: boolean;
  slots: number;
  active_slots: number;
  active_leases: number;
  max_streams: number;
  queued_requests: number;
  oldest_wait_ms: number;
  resident_bytes: number;
  last_used_at: number | null;
  last_error: string | null;
  /** True while the model is being unloaded: not counted as resident, its memory still is. */
  retiring: boolean;
  /** The last eviction (`lru`, `idle` or `memory`) and when, ms since the epoch; null if never evicted. */
  last_eviction: { reason: EvictReason; at: number } | null;
  /** Streams: last sample arrival to result, over the last 4,096 windows, ms; null before any. */
  processing_lag_ms: { p50: number; p99: number; windows: number } | null;
  /**
   * While the model is held back after a crash loop (`crash_cooldown_ms`): until when (ms since
   * the epoch), the failures in a row and the last one's reason; null otherwise.
   */
  cool_down: { until: number; failures: number; reason: string } | null;
  /** The model's licence in plain words (config `licence`); null when not given. */
  licence: string | null;
}

/** What a node's heartbeat reports of a registered model ({@link ModelEntry.figures}): fields of {@link ModelStatus}. */
export type ModelFigures = Pick<
  ModelStatus,
  'id' | 'task' | 'state' | 'slots' | 'active_slots' | 'active_leases' | 'queued_requests' | 'resident_bytes'
>;

/** Key order-independent JSON, to compare configs. */
function stable(v: unknown): string {
  if (Array.isArray(v)) return `[${v.map(stable).join(',')}]`;
  if (v && typeof v === 'object') {
    return `{${Object.keys(v)
      .sort()
      .filter((k) => (v as Record<string, unknown>)[k] !== undefined)
      .map((k) => `${JSON.stringify(k)}:${stable((v as Record<string, unknown>)[k])}`)
      .join(',')}}`;
  }
  return JSON.stringify(v);
}

/**
 * Validates a model config, including its task options.
 * @throws VoxError `invalid_request_error` naming the field.
 */
export function validateModelConfig(raw: unknown): ModelConfig {
  const config = parseWith(ModelConfig, raw);
  parseTaskOptions(config.task, config.options);
  return config;
}

/** What a model entry needs from its supervisor. */
export interface EntryOptions {
  /** Builds the pool (the supervisor's loader measures and tracks residency around the real one). */
  loader: ModelLoader;
  /** Estimated footprint of a config, bytes, sent to the cold-load gate (0 when the memory guard is off). */
  footprint?: (config: ModelConfig) => Promise<number>;
  /** The server's busy-timeout ceiling, ms (0 = unbounded). */
  serverBusyTimeoutMs?: number;
  /** The server's `idle_unload_ms`, ms (0 = off). */
  serverIdleUnloadMs?: number;
  /** The server's `load_timeout_ms`, ms (0 = none). */
  serverLoadTimeoutMs?: number;
  /** The server's `crash_cooldown_ms`, ms (0 = off). */
  serverCrashCooldownMs?: number;
  /** The server's `max_queued`, the default of the model's (0 = unbounded). */
  serverMaxQueued?: number;
  /** Called after every change of state and of the admission queue. */
  onChange?: () => void;
  /** XState inspection observer, when inspection is on. */
  inspect?: (e: InspectionEvent) => void;
  /** The model's logger (one line per state change and eviction). */
  log?: Logger;
  /** Slot job durations, batch sizes, lags and evictions go here. */
  metrics?: Metrics;
  /** Completes a validated config (a wake-word group's heads get their files); may throw VoxError 400. */
  resolve?: (config: ModelConfig) => ModelConfig;
  /** Creates the chart's actor from its input; the supervisor spawns it as its child with `systemId` `model:<id>`. */
  spawn?: (input: ModelInput, entry: ModelEntry) => ModelActor;
  /** Cluster placement (cluster/node.ts): decides where a cold load goes; `local` loads on this node. */
  place?: PlaceHook;
}

/**
 * The pool's settings that belong to its model entry, set once per pool, local or remote (a
 * cluster's): slot waits bounded by the entry's busy timeout, host exits logged, run times and
 * batch sizes measured, and a batcher when `max_batch_size` > 1 (a tensor request is one job of its
 * own: never batched).
 */
function poolSettings(
  entry: { readonly id: string; readonly log: Logger; readonly busyTimeoutMs: number },
  metrics: Metrics | undefined,
): (m: LoadedModel, c: ModelConfig) => LoadedModel {
  const inference = metrics?.inference.labels({ model: entry.id });
  const batchSize = metrics?.batchSize.labels({ model: entry.id });
  const settled = new WeakSet<LoadedModel>();
  return (m, c) => {
    if (!m?.pool || settled.has(m)) return m;
    settled.add(m);
    m.pool.waitTimeoutMs = entry.busyTimeoutMs;
    m.pool.onHostExit = (why, respawn) => entry.log.warn({ why, respawn }, 'slot host exited');
    if (inference) m.pool.onRun = (ms) => inference.observe(ms / 1000);
    if (c.max_batch_size > 1 && c.task !== 'tensor') {
      const packing = (
        c.task === 'vad' ? vadPacking : c.task === 'denoise' ? denoisePacking : wakewordPacking
      ) as Packing<Job, JobResult>;
      m.batcher = new Batcher(m.pool, packing, c.max_batch_size, c.max_batch_delay_ms, (n) => batchSize?.observe(n));
    }
    return m;
  };
}

/**
 * Logs each change of a model chart's state (`model state`, from and to) and tells `onChange`.
 * Only a change of state counts: an event that changes nothing (a refused EVICT) must not wake the
 * supervisor, which would ask again.
 */
function reportStateChanges(actor: ModelActor, log: Logger, onChange: () => void): void {
  let previous: ModelState = 'unloaded';
  let previousValue = '';
  actor.subscribe({
    next: (s) => {
      const value = JSON.stringify(s.value);
      if (value === previousValue) return;
      previousValue = value;
      const now = stateName(s.value);
      if (now !== previous) {
        log.info({ from: previous, to: now, last_error: s.context.lastError ?? undefined }, 'model state');
        previous = now;
      }
      onChange();
    },
    // The machine handles every error itself; the error observer keeps one from crashing the process.
    error: () => {},
  });
}

/** Sends `event` to a model chart that still runs (a stopped one, unregistered or shut down, hears nothing). */
function tell(actor: ModelActor, event: ModelEvent): void {
  if (actor.getSnapshot().status === 'active') actor.send(event);
}

/**
 * How long after its last lease ends a model is told idle (its chart's keep-alive starts, the
 * supervisor may evict it), ms: a request arriving meanwhile keeps it in use without an event.
 * 25, not 5: a holder's peer jobs come a batch apart (an ingress's batch every `max_batch_delay_ms`,
 * each job leased while its slot runs it), and at 5 ms nearly every gap turned the chart idle and
 * busy again (~0.5 ms of the holder's CPU per job, `bench-cluster --parts 2`). An eviction does
 * not wait for it ({@link ModelEntry.settle}, the `idle` getter).
 */
const IDLE_TOLD_AFTER_MS = 25;

/**
 * One registered model: its state-chart actor plus its admission queue (the FIFO of leases).
 * Requests hold a lease (see {@link Admission}) from before their input is prepared until their
 * response is written; management (load, reconfigure, unload) holds the exclusive lease.
 */
export class ModelEntry {
  readonly id: string;
  readonly actor: ModelActor;
  readonly admission: Admission;
  readonly log: Logger;
  /** The live pool, held by the chart's `residency` actor while it is resident; null otherwise. */
  private loaded: LoadedModel | null = null;
  /** The last 4,096 stream windows' processing lag, ms (a ring). */
  private readonly lags = new Float64Array(4096);
  /** When each lag of {@link lags} was recorded, ms since the epoch. */
  private readonly lagTimes = new Float64Array(4096);
  private lagNext = 0;
  private lagCount = 0;
  private readonly lagMetric?: { observe(v: number): void };
  private lastUsedAt: number | null = null;
  /** Tells the chart and the supervisor now of an idle turn told later ({@link IDLE_TOLD_AFTER_MS}), if one waits. */
  private readonly tellIdle: () => void;
  private readonly resolve: (config: ModelConfig) => ModelConfig;
  private readonly maxQueuedOf: (config: ModelConfig) => number;

  constructor(config: ModelConfig, options: EntryOptions) {
    this.id = config.id;
    const onChange = options.onChange ?? (() => {});
    this.log = options.log ?? createLogger('silent');
    this.resolve = options.resolve ?? ((c) => c);
    const metrics = options.metrics;
    this.lagMetric = metrics?.processingLag.labels({ model: config.id });
    // The chart and the supervisor hear only when the model turns in use or idle (what `inUse` and `evictable` read),
    // and the chart when the exclusive holder changes (`HOLDER`, its overdue timer): an event per grant and release
    // cost a remote job's holder ~150 µs. Turning idle is told IDLE_TOLD_AFTER_MS later, and not at all when a lease
    // comes back meanwhile: requests one after another (a peer's jobs, each on a lease of its own) cost the chart no
    // event each (a turn of its chart ~25 µs each way, in process). Its guards read the admission itself, so an event
    // meanwhile sees it idle.
    let inUse = false;
    let holder: Lease | null = null;
    let idleSoon: NodeJS.Timeout | null = null;
    const told = (now: boolean): void => {
      inUse = now;
      if (this.actor) tell(this.actor, { type: 'LEASES' });
      onChange();
    };
    this.admission = new Admission(config.max_streams, () => {
      const ex = this.admission.exclusive;
      if (ex !== holder) {
        holder = ex;
        if (this.actor) tell(this.actor, { type: 'HOLDER', held: ex !== null });
      }
      const now = this.admission.activeLeases > 0 || this.admission.queued > 0;
      if (now) {
        const pending = idleSoon !== null;
        if (idleSoon) clearTimeout(idleSoon);
        idleSoon = null;
        // Another event meanwhile (HOLDER, a refused EVICT) may have let the chart see the admission idle and turn
        // idle itself (its keep-alive started): then it is told in use again.
        if (!inUse || (pending && this.actor?.getSnapshot().matches({ resident: { ready: { leases: 'idle' } } })))
          told(true);
        return;
      }
      if (!inUse || idleSoon) return;
      idleSoon = setTimeout(() => this.tellIdle(), IDLE_TOLD_AFTER_MS);
    });
    this.tellIdle = () => {
      if (!idleSoon) return;
      clearTimeout(idleSoon);
      idleSoon = null;
      if (this.admission.activeLeases === 0 && this.admission.queued === 0) told(false);
    };
    const maxQueued = (c: ModelConfig): number => c.max_queued ?? options.serverMaxQueued ?? 0;
    this.admission.maxQueued = maxQueued(config);
    this.maxQueuedOf = maxQueued;
    const settle = poolSettings(this, metrics);
    const place = options.place;
    const deps: ModelDeps = {
      loader: async (c, signal) => settle(await options.loader(c, signal), c),
      place: place && (async (c, signal, local) => settle(await place(c, signal, local), c)),
      footprint: async (c) => (await options.footprint?.(c)) ?? 0,
      admission: this.admission,
      resident: (m) => {
        this.loaded = m;
        if (m) this.touch();
      },
      evicted: (reason) => {
        metrics?.evictions.inc({ model: config.id, reason });
        this.log.info({ reason, idle_ms: this.lastUsedAt ? Date.now() - this.lastUsedAt : undefined }, 'evict');
      },
    };
    const input: ModelInput = {
      config,
      deps,
      serverIdleUnloadMs: options.serverIdleUnloadMs,
      serverLoadTimeoutMs: options.serverLoadTimeoutMs,
      serverCrashCooldownMs: options.serverCrashCooldownMs,
      serverBusyTimeoutMs: options.serverBusyTimeoutMs,
    };
    this.actor = options.spawn
      ? options.spawn(input, this)
      : createActor(modelMachine, {
          input,
          inspect: options.inspect,
          id: `model:${config.id}`,
          systemId: `model:${config.id}`,
        });
    reportStateChanges(this.actor, this.log, onChange);
    if (!options.spawn) this.actor.start();
  }

  /** The committed config. */
  get config(): ModelConfig {
    return this.actor.getSnapshot().context.config;
  }

  get state(): ModelState {
    return stateName(this.actor.getSnapshot().value);
  }

  /**
   * True while the model's slots exist on this node (DESIGN.md C12, the one home of residency):
   * the chart's `slots` tag (`ready`, and `unloading` / `reconfiguring` until the pool has closed:
   * a retiring model's memory counts until its workers are gone), for a pool loaded here (not a
   * cluster placement's remote one).
   */
  get holdsSlots(): boolean {
    const s = this.actor.getSnapshot();
    return s.hasTag('slots') && !s.context.remote;
  }

  /**
   * True while the model's pool is a cluster placement's remote one (its slots on other nodes):
   * the chart's `slots` tag with `context.remote`, the one home of "held remotely".
   */
  get runsRemotely(): boolean {
    const s = this.actor.getSnapshot();
    return s.hasTag('slots') && s.context.remote;
  }

  /**
   * Tells the chart and the supervisor now of an idle turn told later ({@link IDLE_TOLD_AFTER_MS}), if one waits: the
   * load gate calls it before it asks this model to `EVICT`, which a chart still `busy` refuses.
   */
  settle(): void {
    this.tellIdle();
  }

  /** True in `ready.idle`: resident, no lease held, nobody waiting (an idle turn not yet told is told first). */
  get idle(): boolean {
    this.tellIdle();
    return (
      this.actor.getSnapshot().matches({ resident: { ready: { leases: 'idle' } } }) &&
      this.admission.activeLeases === 0 &&
      this.admission.queued === 0
    );
  }

  /** Its slots' busy time since its pool started, ms (SlotPool `busyMs`); 0 when not resident. */
  busyMs(): number {
    return this.loaded?.pool.busyMs() ?? 0;
  }

  /** Marks use (request start and end, load), for `last_used_at` and LRU eviction. */
  touch(): void {
    this.lastUsedAt = Date.now();
  }

  /** Records one stream window's processing lag (last sample arrival to result), ms. */
  recordLag(ms: number): void {
    this.lagTimes[this.lagNext % this.lags.length] = Date.now();
    this.lags[this.lagNext++ % this.lags.length] = ms;
    this.lagCount++;
    this.lagMetric?.observe(ms / 1000);
  }

  private lagPercentiles(): { p50: number; p99: number; windows: number } | null {
    const n = Math.min(this.lagCount, this.lags.length);
    if (!n) return null;
    const sorted = Array.from(this.lags.subarray(0, n)).sort((a, b) => a - b);
    const at = (q: number): number => Math.round(sorted[Math.min(n - 1, Math.floor(q * n))] * 10) / 10;
    return { p50: at(0.5), p99: at(0.99), windows: this.lagCount };
  }

  /**
   * How long this model's work waits now, ms: the higher of the oldest queued request's wait and the
   * p95 of the stream windows' processing lag recorded in the last `windowMs` (0 without any). What
   * an autoscaled model's replicas follow (cluster/autoscale.ts).
   */
  recentWaitMs(windowMs: number, now = Date.now()): number {
    const recent: number[] = [];
    for (let i = 0; i < Math.min(this.lagCount, this.lags.length); i++)
      if (now - this.lagTimes[i] <= windowMs) recent.push(this.lags[i]);
    recent.sort((a, b) => a - b);
    const p95 = recent.length ? recent[Math.min(recent.length - 1, Math.floor(0.95 * recent.length))] : 0;
    return Math.max(this.admission.oldestWaitMs(now), p95);
  }

  /** `last_used_at`, ms since the epoch (null if never used). */
  get lastUsed(): number | null {
    return this.lastUsedAt;
  }

  /** The model's busy-timeout ceiling (the chart's {@link busyTimeoutOf}): min(model, server), 0 = unbounded. */
  get busyTimeoutMs(): number {
    return busyTimeoutOf(this.actor.getSnapshot().context);
  }

  /**
   * Admits one request (a file, or a whole stream): takes a lease in FIFO order within the
   * effective busy timeout min(request, model, server).
   * @param requestTimeoutMs the request's own `busy_timeout_ms`, if it gave one.
   * @throws VoxError `invalid_request_error` (negative timeout), `server_busy` with Retry-After
   *   (stuck work, at once; or no lease within the timeout); an `AbortError` if `signal` aborts
   *   while queued.
   */
  async admit(opts: {
    requestTimeoutMs?: number;
    signal?: AbortSignal;
    onRevoke?: (reason: Error) => void;
  }): Promise<Lease> {
    const s = this.actor.getSnapshot();
    const ceiling = busyTimeoutOf(s.context);
    const timeoutMs = effectiveTimeout(opts.requestTimeoutMs, ceiling, 0);
    if (isStuck(s)) throw voxError('model_stuck', { id: this.id, ms: ceiling });
    const lease = await this.admission.acquire({ timeoutMs, signal: opts.signal, onRevoke: opts.onRevoke });
    this.touch();
    return lease;
  }

  /**
   * Has the model made ready, sending `LOAD` if it is unloaded (concurrent callers share one load:
   * the chart ignores `LOAD` outside `unloaded`), and answers when the chart emits `ready` (or
   * `unloaded` after the load this caller asked for failed). Call it holding a lease, with the
   * signal that aborts when the lease ends or the client goes away: an aborted caller never starts a load.
   * @returns the live pool (and batcher) to run jobs on.
   * @throws VoxError `server_error` with the load error if loading fails; the 503 the supervisor
   *   answered if it refused the load; the signal's reason (an `AbortError`) once it aborts.
   */
  ensureReady(signal?: AbortSignal): Promise<LoadedModel> {
    // Ready now (every warm request): answered at once, without a subscription to the chart.
    if (this.loaded && !signal?.aborted && stateName(this.actor.getSnapshot().value) === 'ready')
      return Promise.resolve(this.loaded);
    return new Promise<LoadedModel>((resolve, reject) => {
      let asked = false;
      const step = (): void => {
        const s = this.actor.getSnapshot();
        const state = stateName(s.value);
        if (state === 'ready' && this.loaded) return finish(() => resolve(this.loaded!));
        if (state !== 'unloaded') return; // loading, unloading or reconfiguring: the next `ready` / `unloaded` answers
        if (asked) {
          const f = s.context.failure;
          return finish(() =>
            reject(refused(f) ? f : voxError('load_failed', { id: this.id, reason: errorMessage(f) })),
          );
        }
        asked = true;
        this.actor.send({ type: 'LOAD' });
      };
      const onAbort = (): void => finish(() => reject(signal!.reason));
      const stop = this.listen(step, (e) => finish(() => reject(e)));
      const finish = (answer: () => void): void => {
        signal?.removeEventListener('abort', onAbort);
        stop(answer);
      };
      if (signal?.aborted) return onAbort();
      signal?.addEventListener('abort', onAbort, { once: true });
      step();
    });
  }

  /**
   * Resolves once the chart has settled in one of `states` (now, or at its next `ready` / `unloaded`); rejects if the
   * chart stops first.
   */
  settledIn(...states: ('ready' | 'unloaded')[]): Promise<void> {
    return new Promise<void>((resolve, reject) => {
      const step = (): void => {
        if ((states as ModelState[]).includes(this.state)) done(resolve);
      };
      const done = this.listen(step, (e) => done(() => reject(e)));
      step();
    });
  }

  /**
   * Calls `step` at each `ready` and `unloaded` the chart emits, and `stopped` (with a 503
   * `shutting_down`) if the chart stops. Returns `done(answer)`: stops listening, then answers (once).
   */
  private listen(step: () => void, stopped: (e: VoxError) => void): (answer: () => void) => void {
    let over = false;
    const subs = [this.actor.on('ready', step), this.actor.on('unloaded', step)];
    const done = (answer: () => void): void => {
      if (over) return;
      over = true;
      for (const s of subs) s.unsubscribe();
      answer();
    };
    const gone = (): void => stopped(voxError('model_stopped', { id: this.id }));
    if (this.actor.getSnapshot().status !== 'active') queueMicrotask(gone);
    else subs.push(this.actor.subscribe({ complete: gone, error: gone }));
    return done;
  }

  /**
   * `POST /v1/models/load` on this entry: fields given replace the committed ones, the rest are
   * kept. The new config is validated before any lease is taken; then, under the exclusive lease,
   * an identical config on a loaded model does nothing, a different one is sent as `RECONFIGURE`
   * (the chart closes the old pool, commits the whole new config and loads it).
   * @param signal aborts the wait for the lease (the client went away).
   * @returns whether the config changed (`reconfigured`).
   * @throws VoxError `invalid_request_error` (invalid config, nothing touched), `server_busy`
   *   (no exclusive lease within `timeoutMs`), `server_error` (the load failed; the new config
   *   stays committed, unloaded, retryable).
   */
  async configure(
    fields: Record<string, unknown>,
    timeoutMs: number,
    signal?: AbortSignal,
  ): Promise<{ reconfigured: boolean }> {
    const committed = this.config;
    const next = this.resolve(validateModelConfig({ ...committed, ...fields, id: this.id }));
    const changed = stable(next) !== stable(committed);
    const lease = await this.admission.acquire({ exclusive: true, timeoutMs, signal });
    try {
      if (changed) {
        // Committed at once when unloaded, else once the old pool has closed (before the new load); a load or a
        // slot failure under way first ends as it would (the chart keeps the new config until then).
        tell(this.actor, { type: 'RECONFIGURE', config: next });
        this.admission.maxQueued = this.maxQueuedOf(next);
        this.admission.setPlaces(next.max_streams);
      }
      await this.ensureReady();
      return { reconfigured: changed };
    } finally {
      lease.release();
    }
  }

  /**
   * Unloads under the exclusive lease (waits for running requests). Idempotent.
   * @param signal aborts the wait for the lease (the client went away).
   * @throws VoxError `server_busy` if the lease is not granted within `timeoutMs`.
   */
  async unload(timeoutMs: number, signal?: AbortSignal): Promise<void> {
    await this.unloadUnder(this.admission.acquire({ exclusive: true, timeoutMs, signal }));
  }

  /**
   * Places an unload barrier now (the exclusive lease's place in the FIFO) and sends `UNLOAD` once
   * it is granted. Bulk unloads place every barrier in one synchronous step, then wait.
   */
  unloadUnder(barrier: Promise<Lease>): Promise<void> {
    return barrier.then(async (lease) => {
      try {
        // The chart unloads now, or once a load under way is ready; unloaded, it has nothing to do.
        tell(this.actor, { type: 'UNLOAD' });
        await this.settledIn('unloaded');
      } finally {
        lease.release();
      }
    });
  }

  /**
   * Forced unload (C9 `force`): does not wait. Queued requests get 503, every lease holder is
   * revoked (HTTP requests answer 503, streams get an `error` event and close 1012), then the
   * model unloads; running inferences are abandoned with their slots.
   */
  async forceUnload(): Promise<void> {
    this.admission.revokeAll(voxError('model_unloaded', { id: this.id }));
    await this.unload(0);
  }

  /**
   * The part of {@link status} a node's heartbeat reports (cluster/held.ts), without what costs
   * more to read (the processing lag's percentiles sort up to 4,096 windows: each heartbeat of an
   * ingress sorted them twice). Never waits on the model's work.
   */
  figures(): ModelFigures {
    const s = this.actor.getSnapshot();
    const loaded = this.loaded;
    return {
      id: this.id,
      task: s.context.config.task,
      state: stateName(s.value),
      slots: s.context.config.slots,
      active_slots: loaded?.pool.activeSlots ?? 0,
      active_leases: this.admission.activeLeases,
      queued_requests: this.admission.queued,
      resident_bytes: loaded?.residentBytes ?? 0,
    };
  }

  /** An observation of the entry; never waits on the model's work (C17). */
  status(): ModelStatus {
    const s = this.actor.getSnapshot();
    const f = this.figures();
    return {
      id: f.id,
      task: f.task,
      state: f.state,
      loaded: f.state === 'ready',
      slots: f.slots,
      active_slots: f.active_slots,
      active_leases: f.active_leases,
      max_streams: s.context.config.max_streams,
      queued_requests: f.queued_requests,
      oldest_wait_ms: this.admission.oldestWaitMs(),
      resident_bytes: f.resident_bytes,
      last_used_at: this.lastUsedAt,
      last_error: s.context.lastError,
      retiring: f.state === 'unloading',
      last_eviction: s.context.evicted,
      processing_lag_ms: this.lagPercentiles(),
      cool_down:
        s.matches('coolingDown') && s.context.coolDown
          ? {
              until: s.context.coolDown.until,
              failures: s.context.coolDown.failures,
              reason: s.context.coolDown.reason,
            }
          : null,
      licence: s.context.config.licence ?? null,
    };
  }

  /**
   * Unloads (waiting at most `timeoutMs` for running requests). Past the timeout the slots are
   * closed anyway: their pending inferences fail.
   */
  async stop(timeoutMs: number): Promise<void> {
    try {
      await this.unload(timeoutMs);
    } catch {
      await this.loaded?.close();
    }
  }
}
