import { assign, createActor, setup, type Actor, type InspectionEvent } from 'xstate';
import { defaultCatalog } from '../runtime/catalog.js';
import type { ModelConfig, ServerConfig } from '../runtime/config.js';
import type { Lease } from '../runtime/admission.js';
import { VoxError } from '../runtime/errors.js';
import { createLoader, WeightBundles, type ModelLoader } from '../runtime/loader.js';
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
  private readonly loader: ModelLoader;

  constructor(
    readonly config: ServerConfig,
    options: { loader?: ModelLoader; inspect?: (e: InspectionEvent) => void; catalog?: ModelConfig[] } = {},
  ) {
    this.loader = options.loader ?? createLoader(new WeightBundles());
    this.inspect = options.inspect;
    for (const m of [...(options.catalog ?? defaultCatalog()), ...config.models]) this.catalog.set(m.id, m);
    this.actor = createActor(supervisorMachine, { inspect: options.inspect, systemId: 'supervisor' });
    this.actor.subscribe({ error: () => {} });
    this.actor.start();
  }

  private readonly inspect?: (e: InspectionEvent) => void;

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
    if (!e) throw new VoxError('not_found', `model '${id}' does not exist; GET /v1/models lists the models`);
    return e;
  }

  private publish(config: ModelConfig, before?: (entry: ModelEntry) => void): ModelEntry {
    const entry = new ModelEntry(config, this.loader, this.config.busy_timeout_ms, this.inspect);
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
  async load(body: Record<string, unknown>, timeoutMs: number): Promise<{ id: string; loaded: true; reconfigured: boolean }> {
    const id = typeof body.id === 'string' ? body.id : undefined;
    const existing = id !== undefined ? this.get(id) : undefined;
    if (existing) {
      const { reconfigured } = await existing.configure(body, timeoutMs);
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
   * @returns ids unloaded (including known models that were never loaded) and ids unknown, each once.
   * @throws VoxError `server_busy` naming the models whose barrier timed out (the others are unloaded).
   */
  async unloadMany(ids: string[], timeoutMs: number): Promise<{ unloaded: string[]; not_found: string[] }> {
    const unique = [...new Set(ids)];
    const not_found = unique.filter((id) => !this.entries.has(id) && !this.catalog.has(id));
    const entries = unique.filter((id) => this.entries.has(id)).map((id) => this.entries.get(id)!);
    const barriers = entries.map((e) => e.unloadUnder(e.admission.acquire({ exclusive: true, timeoutMs })));
    const results = await Promise.allSettled(barriers);
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

  /** Unloads every model (each waits at most `timeoutMs` for its running requests), then stops. */
  async stop(timeoutMs: number): Promise<void> {
    this.beginShutdown();
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
  };
}
