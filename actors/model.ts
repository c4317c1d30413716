import { assign, createActor, fromPromise, setup, waitFor, type Actor, type InspectionEvent } from 'xstate';
import { Admission, effectiveTimeout, type Lease } from '../runtime/admission.js';
import { VadBatcher } from '../runtime/batcher.js';
import { ModelConfig, parseTaskOptions, parseWith } from '../runtime/config.js';
import { VoxError } from '../runtime/errors.js';
import type { LoadedModel, ModelLoader } from '../runtime/loader.js';
import { createLogger, type Metrics } from '../runtime/telemetry.js';
import type { Logger } from 'pino';

/** A model entry's context: the committed config and what the current load holds. */
export interface ModelContext {
  config: ModelConfig;
  /** The config a reconfiguration commits once the old pool is gone. */
  next: ModelConfig | null;
  loaded: LoadedModel | null;
  lastError: string | null;
  /** Why the last load ended without a pool (also capacity refusals, which are not `lastError`). */
  failure: unknown;
}

export type ModelEvent =
  | { type: 'LOAD' }
  | { type: 'UNLOAD' }
  | { type: 'RECONFIGURE'; config: ModelConfig }
  | { type: 'SLOT_FAILED'; message: string };

const errorMessage = (e: unknown): string => (e instanceof Error ? e.message : String(e));
/** A load refused for capacity (503: busy, insufficient memory) is not a fault of the model. */
const refused = (e: unknown): boolean => e instanceof VoxError && e.status === 503;

/**
 * The model entry state chart (DESIGN.md section 2): `unloaded -> loading -> ready ->
 * unloading -> unloaded`, plus `reconfiguring` (close the old pool, commit the new config, load).
 * A load publishes only a complete pool (`loadModel` resolves with every slot built); a failed
 * load returns to `unloaded` with `lastError` and can be retried. A slot that dies in `ready`
 * unloads the model with `lastError` set; the next request loads it again.
 * The `loadModel` actor is provided by {@link ModelEntry} (its loader).
 */
export const modelMachine = setup({
  types: {
    context: {} as ModelContext,
    events: {} as ModelEvent,
    input: {} as { config: ModelConfig },
  },
  actors: {
    loadModel: fromPromise<LoadedModel, ModelConfig>(async () => {
      throw new Error('no loader provided');
    }),
    closeModel: fromPromise<void, LoadedModel | null>(async ({ input }) => {
      await input?.close();
    }),
  },
}).createMachine({
  id: 'model',
  context: ({ input }) => ({ config: input.config, next: null, loaded: null, lastError: null, failure: null }),
  initial: 'unloaded',
  states: {
    unloaded: {
      on: {
        LOAD: 'loading',
        RECONFIGURE: { actions: assign({ config: ({ event }) => event.config }) },
      },
    },
    loading: {
      invoke: {
        src: 'loadModel',
        input: ({ context }) => context.config,
        onDone: { target: 'ready', actions: assign({ loaded: ({ event }) => event.output, lastError: null, failure: null }) },
        onError: {
          target: 'unloaded',
          actions: assign({
            failure: ({ event }) => event.error,
            lastError: ({ context, event }) => (refused(event.error) ? context.lastError : errorMessage(event.error)),
          }),
        },
      },
    },
    ready: {
      on: {
        UNLOAD: 'unloading',
        SLOT_FAILED: { target: 'unloading', actions: assign({ lastError: ({ event }) => event.message }) },
        RECONFIGURE: { target: 'reconfiguring', actions: assign({ next: ({ event }) => event.config }) },
      },
    },
    unloading: {
      invoke: {
        src: 'closeModel',
        input: ({ context }) => context.loaded,
        onDone: { target: 'unloaded', actions: assign({ loaded: null }) },
        onError: { target: 'unloaded', actions: assign({ loaded: null, lastError: ({ event }) => errorMessage(event.error) }) },
      },
    },
    reconfiguring: {
      invoke: {
        src: 'closeModel',
        input: ({ context }) => context.loaded,
        onDone: { target: 'loading', actions: assign({ loaded: null, config: ({ context }) => context.next!, next: null }) },
        onError: {
          target: 'unloaded',
          actions: assign({ loaded: null, config: ({ context }) => context.next!, next: null, lastError: ({ event }) => errorMessage(event.error) }),
        },
      },
    },
  },
});

export type ModelActor = Actor<typeof modelMachine>;
export type ModelState = 'unloaded' | 'loading' | 'ready' | 'unloading' | 'reconfiguring';

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
  /** Streams: last sample arrival to result, over the last 4,096 windows, ms; null before any. */
  processing_lag_ms: { p50: number; p99: number; windows: number } | null;
}

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

/**
 * One registered model: its state-chart actor, its admission queue and its bookkeeping.
 * Requests hold a lease (see {@link Admission}) from before their input is prepared until their
 * response is written; management (load, reconfigure, unload) holds the exclusive lease.
 */
export class ModelEntry {
  readonly id: string;
  readonly actor: ModelActor;
  readonly admission: Admission;
  readonly log: Logger;
  /** The last 4,096 stream windows' processing lag, ms (a ring). */
  private readonly lags = new Float64Array(4096);
  private lagNext = 0;
  private lagCount = 0;
  private readonly lagMetric?: { observe(v: number): void };
  private lastUsedAt: number | null = null;

  /**
   * @param serverBusyTimeoutMs the server's busy-timeout ceiling, ms (0 = unbounded).
   * @param options `onChange`: called after every state change and lease release;
   *   `inspect`: XState inspection observer, when inspection is on; `log`: the model's logger
   *   (one line per state change); `metrics`: slot job durations go to its histogram.
   */
  constructor(
    config: ModelConfig,
    loader: ModelLoader,
    private readonly serverBusyTimeoutMs = 0,
    options: { onChange?: () => void; inspect?: (e: InspectionEvent) => void; log?: Logger; metrics?: Metrics } = {},
  ) {
    this.id = config.id;
    const onChange = options.onChange ?? (() => {});
    const inspect = options.inspect;
    this.log = options.log ?? createLogger('silent');
    const inference = options.metrics?.inference.labels({ model: config.id });
    const batchSize = options.metrics?.batchSize.labels({ model: config.id });
    this.lagMetric = options.metrics?.processingLag.labels({ model: config.id });
    this.admission = new Admission(config.max_streams, onChange);
    const machine = modelMachine.provide({
      actors: {
        loadModel: fromPromise<LoadedModel, ModelConfig>(async ({ input }) => {
          const loaded = await loader(input);
          if (!loaded?.pool?.slots.length) {
            await loaded?.close?.();
            throw new Error('the loader yielded no session');
          }
          loaded.pool.onFailure((err) => this.actor.send({ type: 'SLOT_FAILED', message: err.message }));
          if (inference) loaded.pool.onRun = (ms) => inference.observe(ms / 1000);
          if (input.task === 'vad' && input.max_batch_size > 1) {
            loaded.batcher = new VadBatcher(loaded.pool, input.max_batch_size, input.max_batch_delay_ms, (n) => batchSize?.observe(n));
          }
          return loaded;
        }),
      },
    });
    this.actor = createActor(machine, { input: { config }, inspect, id: `model:${config.id}` });
    // The machine handles every error itself; the error observer keeps one from crashing the process.
    let previous = 'unloaded';
    this.actor.subscribe({
      next: (s) => {
        if (s.value !== previous) {
          this.log.info({ from: previous, to: s.value, last_error: s.context.lastError ?? undefined }, 'model state');
          previous = s.value as string;
        }
        onChange();
      },
      error: () => {},
    });
    this.actor.start();
  }

  /** The committed config. */
  get config(): ModelConfig {
    return this.actor.getSnapshot().context.config;
  }

  get state(): ModelState {
    return this.actor.getSnapshot().value as ModelState;
  }

  /** Marks use (request start and end, load), for `last_used_at` and LRU eviction. */
  touch(): void {
    this.lastUsedAt = Date.now();
  }

  /** Records one stream window's processing lag (last sample arrival to result), ms. */
  recordLag(ms: number): void {
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

  /** `last_used_at`, ms since the epoch (null if never used). */
  get lastUsed(): number | null {
    return this.lastUsedAt;
  }

  /** The model's busy-timeout ceiling: min(model, server), 0 = unbounded. Also the overdue limit of C4. */
  get busyTimeoutMs(): number {
    return effectiveTimeout(undefined, this.config.busy_timeout_ms, this.serverBusyTimeoutMs);
  }

  /**
   * True while the model is stuck (DESIGN.md C4): every slot has been running one inference
   * for longer than the busy timeout, or the exclusive holder has held its lease that long.
   */
  stuck(now = Date.now()): boolean {
    const limit = this.busyTimeoutMs;
    if (limit <= 0) return false;
    const ex = this.admission.exclusive;
    if (ex && now - ex.grantedAt > limit) return true;
    return this.actor.getSnapshot().context.loaded?.pool.allOverdue(limit, now) ?? false;
  }

  /**
   * Admits one request (a file, or a whole stream): takes a lease in FIFO order within the
   * effective busy timeout min(request, model, server).
   * @param requestTimeoutMs the request's own `busy_timeout_ms`, if it gave one.
   * @throws VoxError `invalid_request_error` (negative timeout), `server_busy` with Retry-After
   *   (stuck work, at once; or no lease within the timeout); an `AbortError` if `signal` aborts
   *   while queued.
   */
  async admit(opts: { requestTimeoutMs?: number; signal?: AbortSignal; onRevoke?: (reason: Error) => void }): Promise<Lease> {
    const timeoutMs = effectiveTimeout(opts.requestTimeoutMs, this.config.busy_timeout_ms, this.serverBusyTimeoutMs);
    if (this.stuck()) {
      throw new VoxError('server_busy', `model ${this.id} is stuck: its work has run longer than the busy timeout of ${this.busyTimeoutMs} ms`, { retryAfterS: 5 });
    }
    const lease = await this.admission.acquire({ timeoutMs, signal: opts.signal, onRevoke: opts.onRevoke });
    this.touch();
    return lease;
  }

  /**
   * Waits until the model is ready, starting a load if it is unloaded (concurrent callers share
   * one load). Call it holding a lease, with the signal that aborts when the lease is revoked or
   * the client goes away: an aborted caller never starts a load.
   * @throws VoxError `server_error` with the load error if loading fails; the signal's reason
   *   (an `AbortError`) once it aborts.
   */
  async ensureReady(signal?: AbortSignal): Promise<LoadedModel> {
    let asked = false;
    for (;;) {
      signal?.throwIfAborted();
      const s = this.actor.getSnapshot();
      if (s.value === 'ready') return s.context.loaded!;
      if (s.value === 'unloaded') {
        if (asked) {
          const f = s.context.failure;
          throw refused(f) ? f : new VoxError('server_error', `model ${this.id} failed to load: ${errorMessage(f)}`);
        }
        asked = true;
        this.actor.send({ type: 'LOAD' });
        continue;
      }
      await waitFor(this.actor, (n) => n.value !== s.value);
    }
  }

  /**
   * `POST /v1/models/load` on this entry: fields given replace the committed ones, the rest are
   * kept. The new config is validated before any lease is taken; then, under the exclusive lease,
   * an identical config on a loaded model does nothing, a different one unloads the old pool,
   * commits the whole new config and loads it.
   * @param signal aborts the wait for the lease (the client went away).
   * @returns whether the config changed (`reconfigured`).
   * @throws VoxError `invalid_request_error` (invalid config, nothing touched), `server_busy`
   *   (no exclusive lease within `timeoutMs`), `server_error` (the load failed; the new config
   *   stays committed, unloaded, retryable).
   */
  async configure(fields: Record<string, unknown>, timeoutMs: number, signal?: AbortSignal): Promise<{ reconfigured: boolean }> {
    const committed = this.config;
    const next = validateModelConfig({ ...committed, ...fields, id: this.id });
    const changed = stable(next) !== stable(committed);
    const lease = await this.admission.acquire({ exclusive: true, timeoutMs, signal });
    try {
      if (changed) {
        this.actor.send({ type: 'RECONFIGURE', config: next });
        await waitFor(this.actor, (s) => s.value === 'unloaded' || s.value === 'loading');
        this.admission.setPlaces(next.max_streams); // committed
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
   * Places an unload barrier now (the exclusive lease's place in the FIFO) and unloads once it
   * is granted. Bulk unloads place every barrier in one synchronous step, then wait.
   */
  unloadUnder(barrier: Promise<Lease>): Promise<void> {
    return barrier.then(async (lease) => {
      try {
        await waitFor(this.actor, (s) => s.value === 'ready' || s.value === 'unloaded');
        if (this.state === 'ready') this.actor.send({ type: 'UNLOAD' });
        await waitFor(this.actor, (s) => s.value !== 'unloading');
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
    this.admission.revokeAll(new VoxError('server_busy', `model ${this.id} was unloaded (force)`, { retryAfterS: 1 }));
    await this.unload(0);
  }

  /** An observation of the entry; never waits on the model's work (C17). */
  status(): ModelStatus {
    const s = this.actor.getSnapshot();
    const loaded = s.context.loaded;
    return {
      id: this.id,
      task: s.context.config.task,
      state: s.value as ModelState,
      loaded: s.value === 'ready',
      slots: s.context.config.slots,
      active_slots: loaded?.pool.activeSlots ?? 0,
      active_leases: this.admission.activeLeases,
      max_streams: s.context.config.max_streams,
      queued_requests: this.admission.queued,
      oldest_wait_ms: this.admission.oldestWaitMs(),
      resident_bytes: loaded?.residentBytes ?? 0,
      last_used_at: this.lastUsedAt,
      last_error: s.context.lastError,
      retiring: s.value === 'unloading',
      processing_lag_ms: this.lagPercentiles(),
    };
  }

  /**
   * Unloads (waiting at most `timeoutMs` for running requests) and stops the actor. Past the
   * timeout the slots are closed anyway: their pending inferences fail.
   */
  async stop(timeoutMs: number): Promise<void> {
    try {
      await this.unload(timeoutMs);
    } catch {
      await this.actor.getSnapshot().context.loaded?.close();
    } finally {
      this.actor.stop();
    }
  }
}
