import { stat } from 'node:fs/promises';
import { assign, createActor, setup, type Actor, type InspectionEvent } from 'xstate';
import type { Lease } from '../runtime/admission.js';
import { defaultCatalog, OWW_EMBEDDING, OWW_MELSPECTROGRAM } from '../runtime/catalog.js';
import type { ModelConfig, ServerConfig } from '../runtime/config.js';
import { VoxError } from '../runtime/errors.js';
import { createLoader, WeightBundles, type LoadedModel, type ModelLoader } from '../runtime/loader.js';
import { availableMemory, estimateFootprint, mib, type MemoryProbe } from '../runtime/memory.js';
import { createLogger, Metrics } from '../runtime/telemetry.js';
import type { Logger } from 'pino';
import { ModelEntry, validateModelConfig, type ModelStatus } from './model.js';

/**
 * The supervisor's state chart: `starting` (eager models loading) -> `running` (accepting work)
 * -> `draining` (shutdown: no new work) -> `stopped`. Its context is the registry of model ids.
 */
export const supervisorMachine = setup({
  types: {
    context: {} as { models: string[] },
    events: {} as { type: 'REGISTERED'; id: string } | { type: 'STARTED' } | { type: 'SHUTDOWN' } | { type: 'STOPPED' },
  },
}).createMachine({
  id: 'supervisor',
  context: { models: [] },
  initial: 'starting',
  on: { REGISTERED: { actions: assign({ models: ({ context, event }) => [...context.models, event.id] }) } },
  states: {
    starting: { on: { STARTED: 'running', SHUTDOWN: 'draining' } },
    running: { on: { SHUTDOWN: 'draining' } },
    draining: { on: { STOPPED: 'stopped' } },
    stopped: { type: 'final' },
  },
});

/**
 * Holds the registry (id -> model entry) and the catalog of models that may be registered
 * lazily: the embedded defaults and the config file's `models`. An entry, once published,
 * is never erased while the server runs.
 */
export class Supervisor {
  readonly actor: Actor<typeof supervisorMachine>;
  private readonly entries = new Map<string, ModelEntry>();
  private readonly catalog = new Map<string, ModelConfig>();
  private readonly baseLoader: ModelLoader;
  private readonly loader: ModelLoader;
  private readonly probe: MemoryProbe;
  private readonly gate = new Gate();
  /** Models whose slots exist: from the end of their load until their pool has closed (retiring included). */
  private readonly resident = new Set<string>();
  /** Measured footprint per slot, bytes, by model id: replaces the estimate once a model has loaded. */
  private readonly measuredPerSlot = new Map<string, number>();
  private idleTimer: NodeJS.Timeout | null = null;
  private changeWaiters: (() => void)[] = [];
  /** Models unloaded to make room (LRU eviction) or for being idle, since start. */
  evictions = 0;

  readonly metrics: Metrics;
  readonly log: Logger;
  private readonly inspect?: (e: InspectionEvent) => void;

  constructor(
    readonly config: ServerConfig,
    options: { loader?: ModelLoader; inspect?: (e: InspectionEvent) => void; catalog?: ModelConfig[]; memoryProbe?: MemoryProbe; metrics?: Metrics; log?: Logger } = {},
  ) {
    this.metrics = options.metrics ?? new Metrics();
    this.log = options.log ?? createLogger('silent');
    this.baseLoader = options.loader ?? createLoader(new WeightBundles());
    this.loader = (c) => this.coldLoad(c);
    this.probe = options.memoryProbe ?? availableMemory;
    this.inspect = options.inspect;
    for (const m of [...(options.catalog ?? defaultCatalog()), ...config.models]) this.catalog.set(m.id, m);
    this.actor = createActor(supervisorMachine, { inspect: options.inspect, id: 'supervisor' });
    this.actor.subscribe({ error: () => {} });
    this.actor.start();
  }

  /** Loads the config's non-lazy models, then accepts work. Load failures are kept in `last_error`. */
  async start(): Promise<void> {
    const eager = this.config.models.filter((m) => !m.lazy);
    await Promise.allSettled(
      eager.map(async (m) => {
        const entry = this.get(m.id)!;
        const lease = await entry.admission.acquire({ exclusive: true });
        try {
          await entry.ensureReady();
        } finally {
          lease.release();
        }
      }),
    );
    this.actor.send({ type: 'STARTED' });
    // Checks a few times per idle period (at least every second, for per-model keep_alive_ms).
    const idle = this.config.idle_unload_ms;
    this.idleTimer = setInterval(() => this.unloadIdle(), idle > 0 ? Math.max(10, Math.min(1000, idle / 4)) : 1000);
    this.idleTimer.unref();
  }

  /** True when cold loads pass through the supervisor one at a time (C11). */
  get guarded(): boolean {
    return this.config.max_loaded_models > 0 || this.config.min_free_memory_mb > 0;
  }

  /**
   * Every load of every model comes here (the model entries' loader). With a limit on, loads run
   * one at a time, each first making room; warm inference never passes here. The footprint is
   * measured as the growth of process RSS over the load (noisy when unguarded loads overlap).
   */
  private async coldLoad(config: ModelConfig): Promise<LoadedModel> {
    const load = async (): Promise<LoadedModel> => {
      if (this.guarded) await this.makeRoom(config);
      const before = process.memoryUsage().rss;
      const t0 = performance.now();
      let loaded: LoadedModel;
      try {
        loaded = await this.baseLoader(config);
      } catch (e) {
        this.metrics.loads.inc({ model: config.id, outcome: 'error' });
        throw e;
      }
      this.metrics.loads.inc({ model: config.id, outcome: loaded?.pool ? 'ok' : 'error' });
      this.metrics.loadDuration.observe({ model: config.id }, (performance.now() - t0) / 1000);
      if (loaded?.pool) {
        loaded.residentBytes = Math.max(0, process.memoryUsage().rss - before);
        if (loaded.residentBytes > 0) this.measuredPerSlot.set(config.id, loaded.residentBytes / config.slots);
        this.entries.get(config.id)?.touch();
        this.resident.add(config.id);
        const close = loaded.close;
        loaded.close = async () => {
          try {
            await close();
          } finally {
            this.resident.delete(config.id);
            this.changed();
          }
        };
      }
      return loaded;
    };
    return this.guarded ? this.gate.run(load) : load();
  }

  /** Footprint of `config`: measured per slot if it has loaded before, else estimated from its files. */
  async footprint(config: ModelConfig): Promise<number> {
    const perSlot = this.measuredPerSlot.get(config.id);
    if (perSlot !== undefined) return perSlot * config.slots;
    const files = [config.path, ...(config.task === 'wakeword' ? [config.melspectrogram_path ?? OWW_MELSPECTROGRAM, config.embedding_path ?? OWW_EMBEDDING] : [])];
    let bytes = 0;
    for (const f of files) bytes += await stat(f).then((st) => st.size, () => 0);
    return estimateFootprint(config, bytes);
  }

  /**
   * Makes room for `target` (C12, C13), holding the load gate. Retiring models (being unloaded)
   * are not counted as resident but are waited for; victims are the least recently used ready
   * models whose exclusive lease can be taken at once (never busy, queued, loading or held):
   * exactly as many as needed. While too few are idle, it waits for a lease release or state
   * change, up to the model's busy timeout. Memory is then checked against the probe (never a
   * status flag), evicting more idle models while it is short.
   * @throws VoxError `server_busy` when no model became evictable in time; `insufficient_memory`
   *   when the estimate plus headroom exceeds the available memory, with the figures.
   */
  private async makeRoom(target: ModelConfig): Promise<void> {
    const max = this.config.max_loaded_models;
    const timeout = this.entries.get(target.id)?.busyTimeoutMs ?? this.config.busy_timeout_ms;
    const deadline = timeout > 0 ? Date.now() + timeout : Infinity;
    /** Waits for the next release or state change; false once the deadline has passed. */
    const wait = (): Promise<boolean> => this.nextChange(deadline);
    const others = (): ModelEntry[] => [...this.resident].filter((id) => id !== target.id).map((id) => this.entries.get(id)!);
    const isRetiring = (e: ModelEntry): boolean => e.state === 'unloading' || e.state === 'reconfiguring' || e.state === 'unloaded';
    for (;;) {
      const live = others();
      const need = max > 0 ? live.length + 1 - max : 0;
      if (need <= 0) break;
      const retiring = live.filter(isRetiring).length;
      if (retiring < need) {
        const victims = this.takeVictims(live, need - retiring);
        if (victims) {
          await this.evict(victims);
          continue;
        }
      }
      // Wait for retiring models' workers to exit, or for a busy model to become idle.
      if (!(await wait())) {
        throw new VoxError('server_busy', `cannot load ${target.id}: max_loaded_models (${max}) reached and no model became idle to evict within the busy timeout`, {
          retryAfterS: 1,
        });
      }
    }
    const headroom = this.config.min_free_memory_mb * 1024 * 1024;
    if (headroom <= 0) return;
    const estimate = await this.footprint(target);
    for (;;) {
      const available = this.probe();
      if (estimate + headroom <= available) return;
      const live = others();
      if (!live.some(isRetiring)) {
        const victims = this.takeVictims(live, 1);
        if (victims) {
          await this.evict(victims);
          continue;
        }
      }
      if (!live.length || !(await wait())) {
        throw new VoxError(
          'insufficient_memory',
          `cannot load ${target.id}: needs about ${mib(estimate)} plus ${mib(headroom)} of headroom (min_free_memory_mb), but only ${mib(available)} is available`,
          { retryAfterS: 5 },
        );
      }
    }
  }

  /** Try-acquires `count` least recently used ready models; null (and nothing held) if fewer are free. */
  private takeVictims(candidates: ModelEntry[], count: number): { entry: ModelEntry; lease: Lease }[] | null {
    const lru = candidates.filter((e) => e.state === 'ready').sort((a, b) => (a.lastUsed ?? 0) - (b.lastUsed ?? 0));
    const taken: { entry: ModelEntry; lease: Lease }[] = [];
    for (const entry of lru) {
      if (taken.length === count) break;
      const lease = entry.admission.tryAcquire(true);
      if (lease) taken.push({ entry, lease });
    }
    if (taken.length === count) return taken;
    for (const t of taken) t.lease.release();
    return null;
  }

  private async evict(victims: { entry: ModelEntry; lease: Lease }[]): Promise<void> {
    this.evictions += victims.length;
    for (const v of victims) {
      this.metrics.evictions.inc({ model: v.entry.id });
      v.entry.log.info({ reason: 'make room' }, 'evict');
    }
    await Promise.all(victims.map((v) => v.entry.unloadUnder(Promise.resolve(v.lease))));
  }

  private changed(): void {
    const waiters = this.changeWaiters;
    this.changeWaiters = [];
    for (const w of waiters) w();
  }

  /** Resolves true at the next lease release or model state change, false at `deadline` (ms since the epoch). */
  private nextChange(deadline: number): Promise<boolean> {
    if (Date.now() >= deadline) return Promise.resolve(false);
    return new Promise((resolve) => {
      const timer = deadline === Infinity ? null : setTimeout(() => resolve(false), deadline - Date.now());
      this.changeWaiters.push(() => {
        if (timer) clearTimeout(timer);
        resolve(true);
      });
    });
  }

  /** Idle unload (C14): a ready model unused for longer than its keep-alive is try-acquired and unloaded; a busy one is skipped. */
  private unloadIdle(now = Date.now()): void {
    for (const e of this.entries.values()) {
      const keepAlive = e.config.keep_alive_ms ?? this.config.idle_unload_ms;
      if (e.state !== 'ready' || keepAlive <= 0 || now - (e.lastUsed ?? 0) <= keepAlive) continue;
      const lease = e.admission.tryAcquire(true);
      if (!lease) continue;
      this.evictions++;
      this.metrics.evictions.inc({ model: e.id });
      e.log.info({ reason: 'idle', idle_ms: now - (e.lastUsed ?? 0) }, 'evict');
      void e.unloadUnder(Promise.resolve(lease));
    }
  }

  /** True while accepting work (`/ready`). */
  get accepting(): boolean {
    return this.actor.getSnapshot().value === 'running';
  }

  /** The entry for `id`, registering it from the catalog on first use; undefined if unknown. */
  get(id: string): ModelEntry | undefined {
    const found = this.entries.get(id);
    if (found) return found;
    const config = this.catalog.get(id);
    return config ? this.publish(config) : undefined;
  }

  /**
   * The entry for `id` or a 404.
   * @throws VoxError `not_found`.
   */
  require(id: string): ModelEntry {
    const e = this.get(id);
    if (!e) throw new VoxError('not_found', `model '${id.length > 128 ? `${id.slice(0, 128)}...` : id}' does not exist; GET /v1/models lists the models`);
    return e;
  }

  private publish(config: ModelConfig, before?: (entry: ModelEntry) => void): ModelEntry {
    const entry = new ModelEntry(config, this.loader, this.config.busy_timeout_ms, {
      onChange: () => this.changed(),
      inspect: this.inspect,
      log: this.log.child({ model: config.id }),
      metrics: this.metrics,
    });
    before?.(entry);
    this.entries.set(config.id, entry);
    this.actor.send({ type: 'REGISTERED', id: config.id });
    return entry;
  }

  /**
   * `POST /v1/models/load`: registers a new model (validated first) and loads it, or
   * reconfigures / loads an existing one.
   * @throws VoxError `invalid_request_error`, `server_busy`, `server_error` (load failed).
   */
  async load(body: Record<string, unknown>, timeoutMs: number, signal?: AbortSignal): Promise<{ id: string; loaded: true; reconfigured: boolean }> {
    const id = typeof body.id === 'string' ? body.id : undefined;
    const existing = id !== undefined ? this.get(id) : undefined;
    if (existing) {
      const { reconfigured } = await existing.configure(body, timeoutMs, signal);
      return { id: existing.id, loaded: true, reconfigured };
    }
    const config = validateModelConfig(body);
    // C7: the new entry's exclusive lease is taken before it is published, so a concurrent
    // registration of the same id finds the entry and queues behind this load.
    let lease!: Lease;
    const entry = this.publish(config, (e) => (lease = e.admission.tryAcquire(true)!));
    try {
      await entry.ensureReady();
    } finally {
      lease.release();
    }
    return { id: entry.id, loaded: true, reconfigured: false };
  }

  /**
   * Bulk unload (C10): de-duplicates `ids`, places every model's unload barrier in one
   * synchronous step (so two bulk unloads never wait on each other in a cycle), then waits;
   * idle models are freed at once, busy ones once their running requests finish.
   * @param timeoutMs how long each barrier may wait (0 = unbounded).
   * @param signal aborting it takes the barriers not yet granted out of their queues.
   * @returns ids unloaded (including known models that were never loaded) and ids unknown, each once.
   * @throws VoxError `server_busy` naming the models whose barrier timed out (the others are unloaded).
   */
  async unloadMany(ids: string[], timeoutMs: number, signal?: AbortSignal): Promise<{ unloaded: string[]; not_found: string[] }> {
    const unique = [...new Set(ids)];
    const not_found = unique.filter((id) => !this.entries.has(id) && !this.catalog.has(id));
    const entries = unique.filter((id) => this.entries.has(id)).map((id) => this.entries.get(id)!);
    const barriers = entries.map((e) => e.unloadUnder(e.admission.acquire({ exclusive: true, timeoutMs, signal })));
    const results = await Promise.allSettled(barriers);
    signal?.throwIfAborted();
    const busy = entries.filter((_, i) => results[i].status === 'rejected').map((e) => e.id);
    const unloaded = unique.filter((id) => !not_found.includes(id) && !busy.includes(id));
    if (busy.length) {
      throw new VoxError('server_busy', `could not unload ${busy.join(', ')} within the busy timeout; unloaded: ${unloaded.join(', ') || 'none'}`, { retryAfterS: 1 });
    }
    return { unloaded, not_found };
  }

  /** Every registered model's id. */
  get registeredIds(): string[] {
    return [...this.entries.keys()];
  }

  /** Status of every known model: registered entries, then catalog models not yet registered. */
  statuses(): ModelStatus[] {
    const out = [...this.entries.values()].map((e) => e.status());
    for (const c of this.catalog.values()) {
      if (!this.entries.has(c.id)) out.push(unregisteredStatus(c));
    }
    return out;
  }

  /** Status of one model, or undefined. Does not register it. */
  status(id: string): ModelStatus | undefined {
    const e = this.entries.get(id);
    if (e) return e.status();
    const c = this.catalog.get(id);
    return c ? unregisteredStatus(c) : undefined;
  }

  /** Stops accepting work (`/ready` answers 503). */
  beginShutdown(): void {
    this.actor.send({ type: 'SHUTDOWN' });
  }

  /** Shutdown past the drain deadline: every queued request gets `err`, every lease holder is revoked. */
  revokeAll(err: VoxError): void {
    for (const e of this.entries.values()) e.admission.revokeAll(err);
  }

  /** Unloads every model (each waits at most `timeoutMs` for its running requests), then stops. */
  async stop(timeoutMs: number): Promise<void> {
    this.beginShutdown();
    if (this.idleTimer) clearInterval(this.idleTimer);
    await Promise.all([...this.entries.values()].map((e) => e.stop(timeoutMs)));
    this.actor.send({ type: 'STOPPED' });
  }
}

function unregisteredStatus(c: ModelConfig): ModelStatus {
  return {
    id: c.id,
    task: c.task,
    state: 'unloaded',
    loaded: false,
    slots: c.slots,
    active_slots: 0,
    active_leases: 0,
    max_streams: c.max_streams,
    queued_requests: 0,
    oldest_wait_ms: 0,
    resident_bytes: 0,
    last_used_at: null,
    last_error: null,
    retiring: false,
    processing_lag_ms: null,
  };
}

/** A FIFO mutex: `run` calls run one at a time, in call order. */
class Gate {
  private tail: Promise<unknown> = Promise.resolve();
  run<T>(fn: () => Promise<T>): Promise<T> {
    const result = this.tail.then(fn);
    this.tail = result.catch(() => {});
    return result;
  }
}
