import { stat } from 'node:fs/promises';
import {
  assign,
  createActor,
  enqueueActions,
  sendTo,
  setup,
  stopChild,
  type Actor,
  type ActorRefFrom,
  type AnyActorLogic,
  type AnyActorRef,
  type InspectionEvent,
} from 'xstate';
import type { Lease } from '../runtime/admission.js';
import { OWW_EMBEDDING, OWW_MELSPECTROGRAM } from '../runtime/catalog.js';
import { defaultCatalog, ModelConfig, modelFiles, type ServerConfig } from '../runtime/config.js';
import { invalid, voxError, type VoxError, type WireError } from '../runtime/errors.js';
import {
  createLoader,
  modelFileProblem,
  WeightBundles,
  type LoadedModel,
  type ModelLoader,
} from '../runtime/loader.js';
import { availableMemory, estimateFootprint, mib, type MemoryProbe } from '../runtime/memory.js';
import { createLogger, Metrics } from '../runtime/telemetry.js';
import { similarIds } from '../runtime/names.js';
import { confinePath } from '../runtime/paths.js';
import { WakewordFolder, type FolderProblem, type FolderScan } from '../runtime/wakeword/wakeword-dir.js';

/** Config fields that name model files. */
const PATH_FIELDS = ['path', 'melspectrogram_path', 'embedding_path'] as const;
import type { Logger } from 'pino';
import {
  ModelEntry,
  modelMachine,
  type ModelActor,
  type ModelInput,
  validateModelConfig,
  type EvictReason,
  type EvictReply,
  type ModelStatus,
  type PlaceHook,
} from './model.js';
import { systemMachine } from './system.js';

/** A model's footprint estimated from the sizes of its files (C13). */
async function estimateFromFiles(config: ModelConfig): Promise<number> {
  const files = [
    ...modelFiles(config),
    ...(config.task === 'wakeword'
      ? [config.melspectrogram_path ?? OWW_MELSPECTROGRAM, config.embedding_path ?? OWW_EMBEDDING]
      : []),
  ];
  let bytes = 0;
  for (const f of files)
    bytes += await stat(f).then(
      (st) => st.size,
      () => 0,
    );
  return estimateFootprint(config, bytes);
}

/** A cold load waiting at the gate (DESIGN.md C11). */
export interface PendingLoad {
  id: string;
  /** Estimated footprint, bytes (0 when the memory guard is off). */
  needed_bytes: number;
  /** How long it may wait for room, ms (0 = unbounded): the model's busy timeout. */
  timeout_ms: number;
  /** When it reached the gate, ms since the epoch. */
  since: number;
  /** The model's `residency` actor: answered `LOAD_GRANTED` or `LOAD_REFUSED`. */
  replyTo: AnyActorRef;
}

/** What the supervisor measured when it last looked for room: the figures an inspector shows. */
export interface RoomFigures {
  /** The model to load. */
  target: string;
  needed_bytes: number;
  /** `min_free_memory_mb` in bytes (0 = memory guard off). */
  headroom_bytes: number;
  /** Available memory from the probe (cgroup limit and MemAvailable, the lower), bytes; null when the guard is off. */
  free_bytes: number | null;
  /** `max_loaded_models` (0 = no limit). */
  max_loaded: number;
  /** Other models with slots, retiring ones included. */
  resident: string[];
  /** Of those, the ones being unloaded. */
  retiring: string[];
  /** Ready models, least recently used first, minus those that refused `EVICT` since the last change. */
  candidates: string[];
}

/** Events of the supervisor chart. */
export type SupervisorEvent =
  /** A model joins the registry: its chart is spawned as `model:<id>`, its handle kept in `models` (tests may omit it). */
  | { type: 'REGISTER'; id: string; logic: typeof modelMachine; input: ModelInput; entry?: ModelEntry }
  /** An unused, unloaded ad hoc wake-word group leaves the registry (its chart stops, its handle goes). */
  | { type: 'UNREGISTER'; id: string }
  | ({ type: 'LOAD_REQUESTED' } & Omit<PendingLoad, 'since'>)
  /** The load granted to `id` ended (loaded or failed), or its requester went away. */
  | { type: 'LOAD_FINISHED'; id: string }
  /** A model's leases, state or residency changed: room may have been freed. */
  | { type: 'MODEL_CHANGED' }
  /**
   * The server drains (shutdown phase 1): every model chart hears `DRAIN` (a cold load in progress is abandoned, no new
   * one starts), and so does every model registered from now on (its chart starts draining).
   */
  | { type: 'DRAIN' }
  | EvictReply;

/** Replies of the gate to a `LOAD_REQUESTED`. */
export type GateReply = { type: 'LOAD_GRANTED' } | { type: 'LOAD_REFUSED'; error: WireError };

export interface SupervisorContext {
  /** The live dependencies it was created with. */
  deps: Required<SupervisorInput>;
  /**
   * The registry: each registered model's handle by id, set and deleted in the same transitions that spawn and stop
   * its chart `model:<id>` (one home: the registry and the chart's children cannot disagree).
   */
  models: ReadonlyMap<string, ModelEntry>;
  /** Cold loads waiting for the gate, FIFO. */
  pending: PendingLoad[];
  /** The cold load the gate is working for (making room, then loading). */
  current: PendingLoad | null;
  /** Victims that refused `EVICT` since room was last measured after a change. */
  refused: string[];
  room: RoomFigures | null;
  /** The victim last asked to `EVICT`, and why. */
  victim: { id: string; reason: EvictReason } | null;
  /** What the current load waits for, while it waits. */
  waitingFor: 'release' | 'memory' | null;
  /** The server drains (`DRAIN`): a model registered now starts draining. */
  draining: boolean;
}

/** A supervisor chart's input: its live dependencies (the chart closes over nothing else). */
export interface SupervisorInput {
  /** True when cold loads pass the gate one at a time (`max_loaded_models` or `min_free_memory_mb` set). */
  guarded: boolean;
  /**
   * Measures room for `target`: what is resident, retiring and evictable now (least recently used
   * first, minus `refused`), and the free memory from the memory probe.
   */
  measure: (target: PendingLoad, refused: string[]) => RoomFigures;
  /**
   * Tells model `id`'s chart now of an idle turn it is told later (ModelEntry's `IDLE_TOLD_AFTER_MS`), before it is
   * asked to `EVICT`: a chart whose last lease ended within that delay would refuse, and the load wait the delay out
   * (a breaker's `no_room` 503s with a 45 ms busy timeout). Default: nothing.
   */
  settle?: (id: string) => void;
  /** The clock, ms since the epoch (default `Date.now`). */
  now?: () => number;
}

const need = (r: RoomFigures): number => (r.max_loaded > 0 ? r.resident.length + 1 - r.max_loaded : 0);
const roomFree = (r: RoomFigures): boolean => need(r) <= 0;
const memoryFree = (r: RoomFigures): boolean =>
  r.headroom_bytes <= 0 || r.needed_bytes + r.headroom_bytes <= (r.free_bytes ?? Infinity);

/**
 * The supervisor chart (DESIGN.md section 2, C10-C14). It registers model entries as children
 * (`REGISTER`, `systemId` `model:<id>`) and runs the cold-load gate: with `max_loaded_models` or
 * `min_free_memory_mb` set, cold loads (`LOAD_REQUESTED` from a model's `residency` actor) pass
 * one at a time, in FIFO order:
 * - `admitting` measures room (figures in `context.room`) and decides by named guards:
 *   `hasRoom` -> `loading` (`LOAD_GRANTED`); `victimForRoom` / `victimForMemory` -> `evicting`;
 *   `nothingToFree` -> refused at once (`insufficient_memory`); otherwise it waits.
 * - `evicting` asks the least recently used idle model to `EVICT {reason: lru | memory}`; `EVICTED`
 *   -> wait for its release; `EVICT_REFUSED` (it turned busy: the try-acquire failed) -> measure
 *   again without it.
 * - `waitingForRelease` / `waitingForMemory` go back to `admitting` on `MODEL_CHANGED` (and, for
 *   memory, every `memoryPoll` ms), up to the load's busy timeout (`untilDeadline`), then answer
 *   `LOAD_REFUSED` (`server_busy` or `insufficient_memory`, with the figures).
 * - `loading` holds the gate until `LOAD_FINISHED`.
 * With both limits off, `LOAD_REQUESTED` is granted at once and loads run in parallel.
 */
export const supervisorMachine = setup({
  types: {
    context: {} as SupervisorContext,
    events: {} as SupervisorEvent,
    input: {} as SupervisorInput,
  },
  actions: {
    /** Measures room for `current` into `context.room`. */
    measureRoom: assign({ room: ({ context }) => context.deps.measure(context.current!, context.refused) }),
    /**
     * Answers the current load `LOAD_REFUSED` with the figures: no room (`server_busy`) or no memory
     * (`insufficient_memory`).
     */
    refuse: sendTo(
      ({ context }) => context.current!.replyTo,
      ({ context }, params: { why: 'room' | 'memory' }): GateReply => {
        const { current, room } = context;
        return {
          type: 'LOAD_REFUSED',
          error: (params.why === 'room'
            ? voxError('no_room', {
                id: current!.id,
                maxLoaded: room?.max_loaded,
                timeoutMs: current!.timeout_ms,
                resident: room?.resident ?? [],
                unloading: context.victim?.id,
              })
            : voxError('insufficient_memory', {
                id: current!.id,
                needed: mib(room!.needed_bytes),
                headroom: mib(room!.headroom_bytes),
                free: mib(room!.free_bytes ?? 0),
              })
          ).toWire(),
        };
      },
    ),
  },
  guards: {
    guarded: ({ context }) => context.deps.guarded,
    hasPending: ({ context }) => context.pending.length > 0,
    hasRoom: ({ context }) => roomFree(context.room!) && memoryFree(context.room!),
    /** Over `max_loaded_models`, fewer models retiring than needed, and an idle one to ask. */
    victimForRoom: ({ context }) => {
      const r = context.room!;
      return !roomFree(r) && r.retiring.length < need(r) && r.candidates.length > 0;
    },
    /** Room enough, memory short, nothing already retiring, and an idle one to ask. */
    victimForMemory: ({ context }) => {
      const r = context.room!;
      return roomFree(r) && !memoryFree(r) && r.retiring.length === 0 && r.candidates.length > 0;
    },
    /** Memory short and no other model resident: waiting cannot help. */
    nothingToFree: ({ context }) => {
      const r = context.room!;
      return roomFree(r) && !memoryFree(r) && r.resident.length === 0;
    },
    shortOfMemory: ({ context }) => roomFree(context.room!) && !memoryFree(context.room!),
    hasDeadline: ({ context }) => (context.current?.timeout_ms ?? 0) > 0,
    isCurrent: ({ context, event }) => event.type === 'LOAD_FINISHED' && context.current?.id === event.id,
  },
  delays: {
    untilDeadline: ({ context }) =>
      Math.max(0, Math.min(2 ** 31 - 1, context.current!.since + context.current!.timeout_ms - context.deps.now())),
    memoryPoll: 250,
  },
}).createMachine({
  id: 'supervisor',
  context: ({ input }) => ({
    deps: { now: Date.now, settle: () => {}, ...input },
    models: new Map(),
    pending: [],
    current: null,
    refused: [],
    room: null,
    victim: null,
    waitingFor: null,
    draining: false,
  }),
  on: {
    // A model entry is the chart's child `model:<id>` (its ref: `snapshot.children['model:<id>']`,
    // or `system.get('model:<id>')`): the logic comes with the event (the model chart; a test gives
    // fakes), its live dependencies with its input.
    REGISTER: {
      actions: enqueueActions(({ enqueue, event, context }) => {
        (enqueue.spawnChild as (logic: AnyActorLogic, options: object) => void)(event.logic, {
          id: `model:${event.id}`,
          systemId: `model:${event.id}`,
          input: context.draining ? { ...event.input, draining: true } : event.input,
        });
        const { entry } = event;
        if (entry) enqueue.assign({ models: new Map(context.models).set(event.id, entry) });
      }),
    },
    DRAIN: {
      actions: enqueueActions(({ enqueue, self }) => {
        enqueue.assign({ draining: true });
        for (const [id, child] of Object.entries(self.getSnapshot().children as Record<string, AnyActorRef>))
          if (id.startsWith('model:')) enqueue.sendTo(child, { type: 'DRAIN' });
      }),
    },
    UNREGISTER: {
      actions: [
        stopChild(({ event }) => `model:${event.id}`),
        assign({
          models: ({ context, event }) => {
            const models = new Map(context.models);
            models.delete(event.id);
            return models;
          },
        }),
      ],
    },
    LOAD_REQUESTED: [
      {
        guard: 'guarded',
        actions: assign({
          pending: ({ context, event }) => [
            ...context.pending,
            {
              id: event.id,
              needed_bytes: event.needed_bytes,
              timeout_ms: event.timeout_ms,
              replyTo: event.replyTo,
              since: context.deps.now(),
            },
          ],
        }),
      },
      {
        actions: sendTo(({ event }) => (event as { replyTo: AnyActorRef }).replyTo, {
          type: 'LOAD_GRANTED',
        } satisfies GateReply),
      },
    ],
    LOAD_FINISHED: [
      // The load ended (or its requester stopped while the gate made room for it): next one.
      { guard: 'isCurrent', target: '.idle' },
      // A load that left before its turn (its model stopped) leaves the queue.
      { actions: assign({ pending: ({ context, event }) => context.pending.filter((p) => p.id !== event.id) }) },
    ],
  },
  initial: 'idle',
  states: {
    idle: {
      entry: assign({ current: null, room: null, victim: null, waitingFor: null, refused: [] }),
      always: {
        guard: 'hasPending',
        target: 'admitting',
        actions: assign({
          current: ({ context }) => context.pending[0],
          pending: ({ context }) => context.pending.slice(1),
        }),
      },
    },
    admitting: {
      entry: ['measureRoom', assign({ waitingFor: null })],
      always: [
        {
          guard: 'hasRoom',
          target: 'loading',
          actions: sendTo(({ context }) => context.current!.replyTo, { type: 'LOAD_GRANTED' } satisfies GateReply),
        },
        {
          guard: 'victimForRoom',
          target: 'evicting',
          actions: assign({ victim: ({ context }) => ({ id: context.room!.candidates[0], reason: 'lru' as const }) }),
        },
        {
          guard: 'victimForMemory',
          target: 'evicting',
          actions: assign({
            victim: ({ context }) => ({ id: context.room!.candidates[0], reason: 'memory' as const }),
          }),
        },
        { guard: 'nothingToFree', target: 'idle', actions: { type: 'refuse', params: { why: 'memory' } } },
        { guard: 'shortOfMemory', target: 'waitingForMemory' },
        { target: 'waitingForRelease' },
      ],
    },
    evicting: {
      entry: [
        ({ context }) => context.deps.settle(context.victim!.id),
        sendTo(
          ({ context, system }) => system.get(`model:${context.victim!.id}`),
          ({ context, self }) => ({ type: 'EVICT', reason: context.victim!.reason, replyTo: self }),
        ),
      ],
      on: {
        EVICTED: 'waitingForRelease',
        EVICT_REFUSED: {
          target: 'admitting',
          // The victim is the one evicted (and unloading) only once it says EVICTED.
          actions: assign({ refused: ({ context, event }) => [...context.refused, event.id], victim: null }),
        },
      },
    },
    waitingForRelease: {
      entry: assign({ waitingFor: 'release' }),
      on: { MODEL_CHANGED: { target: 'admitting', actions: assign({ refused: [] }) } },
      after: {
        // Past the deadline while a victim unloads: refused for what it was evicted for (room, or memory).
        untilDeadline: {
          guard: 'hasDeadline',
          target: 'idle',
          actions: {
            type: 'refuse',
            params: ({ context }) => ({
              why: context.victim?.reason === 'memory' ? ('memory' as const) : ('room' as const),
            }),
          },
        },
      },
    },
    waitingForMemory: {
      entry: assign({ waitingFor: 'memory' }),
      on: { MODEL_CHANGED: { target: 'admitting', actions: assign({ refused: [] }) } },
      after: {
        untilDeadline: { guard: 'hasDeadline', target: 'idle', actions: { type: 'refuse', params: { why: 'memory' } } },
        memoryPoll: { target: 'admitting', actions: assign({ refused: [] }) },
      },
    },
    /** The granted load runs; the gate stays closed until its `LOAD_FINISHED`. */
    loading: {},
  },
});

/** What a supervisor may be given instead of its defaults (tests give fakes). */
export interface SupervisorOptions {
  /** Builds a model's slots; default: worker-thread slots over onnxruntime-node. */
  loader?: ModelLoader;
  /** The shared XState inspection observer. */
  inspect?: (e: InspectionEvent) => void;
  /** Models that may be registered lazily; default: the embedded catalog. */
  catalog?: ModelConfig[];
  /** Available memory, bytes; default: cgroup limit and MemAvailable, the lower. */
  memoryProbe?: MemoryProbe;
  /**
   * A model's footprint before it has loaded, bytes; default: its files' sizes x a factor ({@link estimateFootprint}).
   */
  footprint?: (config: ModelConfig) => Promise<number>;
  metrics?: Metrics;
  /** Default: a pino logger at the config's `log_level`. */
  log?: Logger;
  /** Cluster placement of cold loads (cluster/node.ts); absent: every load is local. */
  place?: PlaceHook;
  /**
   * A model another node of the cluster registered (a load naming that node): its config, so a
   * request for it here registers it on first use (its cold load then finds its holder); absent
   * or undefined: unknown.
   */
  elsewhere?: (id: string) => Record<string, unknown> | undefined;
}

/**
 * The server's actor system and its registry: the root (`system`), the supervisor chart, and the
 * model entries, plus the catalog of models that may be registered lazily (the embedded defaults
 * and the config file's `models`). An entry, once published, is never erased while the server
 * runs. Its methods send events to the charts and wait for their answers.
 */
export class Supervisor {
  /** The system root: `starting -> running -> draining -> closing -> stopped`; emits `drain`, `linger`, `cut`. */
  readonly root: Actor<typeof systemMachine>;
  /** The supervisor chart (the root's child, `systemId` `supervisor`). */
  readonly actor: ActorRefFrom<typeof supervisorMachine>;
  /** The registry: the supervisor chart's `models` (its one home; empty while the constructor runs). */
  private get entries(): ReadonlyMap<string, ModelEntry> {
    return this.actor?.getSnapshot().context.models ?? new Map();
  }
  private readonly catalog = new Map<string, ModelConfig>();
  private readonly baseLoader: ModelLoader;
  private readonly probe: MemoryProbe;
  private readonly estimate: (config: ModelConfig) => Promise<number>;
  private readonly place?: PlaceHook;
  private readonly elsewhere?: (id: string) => Record<string, unknown> | undefined;
  /** Measured footprint per slot, bytes, by model id: replaces the estimate once a model has loaded. */
  private readonly measuredPerSlot = new Map<string, number>();
  /** Lazy config models whose files failed the check at start (see {@link start}), with the problem. */
  private readonly fileProblems = new Map<string, string>();
  /** `wakeword_dir`, watched from {@link start} (null without one). */
  private folder: WakewordFolder | null = null;
  /** The ids of `wakeword_dir`'s heads (in the catalog while their file is there). */
  private folderIds = new Set<string>();
  /** The file a folder head's reconfiguration under way asks for, by id (see {@link syncFolder}). */
  private readonly folderPaths = new Map<string, string>();
  /** `wakeword_dir`'s files that are not heads, from its last scan. */
  private folderProblems: FolderProblem[] = [];
  /** Folder models whose file is gone: they leave the registry once idle ({@link syncFolder}). */
  private readonly leaving = new Set<string>();

  readonly metrics: Metrics;
  readonly log: Logger;

  constructor(
    readonly config: ServerConfig,
    options: SupervisorOptions = {},
  ) {
    this.metrics = options.metrics ?? new Metrics();
    this.log = options.log ?? createLogger(config.log_level);
    this.baseLoader =
      options.loader ??
      createLoader(new WeightBundles(), {
        isolation: config.isolation,
        jobTimeoutMs: config.job_timeout_ms,
        loadTimeoutMs: config.load_timeout_ms,
      });
    this.probe = options.memoryProbe ?? availableMemory;
    this.estimate = options.footprint ?? estimateFromFiles;
    this.place = options.place;
    this.elsewhere = options.elsewhere;
    for (const m of [...(options.catalog ?? defaultCatalog()), ...config.models]) this.catalog.set(m.id, m);
    // A configured group naming an unknown head stops the server at start, not at first use.
    // Said before the server listens: the error names the config field and the wake words it knows, not a route.
    for (const [i, m] of config.models.entries()) this.resolveHeads(m, `models.${i}.`);
    const supervisor: SupervisorInput = {
      // Cold loads pass the gate one at a time (C11): the chart's `guarded`.
      guarded: config.max_loaded_models > 0 || config.min_free_memory_mb > 0,
      measure: (target, refused) => this.measureRoom(target, refused),
      settle: (id) => this.entries.get(id)?.settle(),
    };
    this.root = createActor(
      systemMachine.provide({
        actors: { supervisor: supervisorMachine },
        delays: { drainTimeout: config.drain_timeout_ms },
      }),
      { input: { supervisor }, inspect: options.inspect, id: 'system' },
    );
    // Every chart handles its own errors; the error observer keeps one from crashing the process.
    this.root.subscribe({ error: (e) => this.log.error({ err: e }, 'actor system error') });
    this.root.start();
    this.actor = this.root.system.get('supervisor') as ActorRefFrom<typeof supervisorMachine>;
  }

  /**
   * Loads the config's non-lazy models, then accepts work (`STARTED`). A load failure is logged at
   * error level and kept in the model's `last_error` (see {@link failedModels}).
   */
  async start(): Promise<void> {
    // A lazy model's files are checked now (not found as a failed first request): a problem is a
    // warning and a `failed_models` entry until the model loads. Synchronous: work waits for it.
    for (const m of this.config.models.filter((c) => c.lazy)) {
      const problem = modelFileProblem(this.resolveHeads(m));
      if (!problem) continue;
      this.fileProblems.set(m.id, problem);
      this.log.warn({ model: m.id, err: problem }, 'model file problem: the model will fail to load');
    }
    const dir = this.config.wakeword_dir;
    if (dir) {
      const logged = new Set<string>();
      this.folder = new WakewordFolder(
        dir,
        (scan) => {
          this.syncFolder(scan);
          for (const p of this.folderProblems)
            if (!logged.has(`${p.path}\n${p.error}`)) {
              logged.add(`${p.path}\n${p.error}`);
              this.log.warn({ path: p.path, err: p.error }, 'wakeword_dir: a file that is not a wake word');
            }
        },
        (e) => this.log.warn({ dir, err: e.message }, 'wakeword_dir cannot be read'),
      );
      try {
        await this.folder.start();
      } catch (e) {
        throw invalid('wakeword_dir', `'${dir}' cannot be read: ${(e as NodeJS.ErrnoException).code ?? e}`);
      }
    }
    const eager = this.config.models.filter((m) => !m.lazy);
    await Promise.allSettled(
      eager.map(async (m) => {
        const entry = this.getOrRegister(m.id)!;
        const lease = await entry.admission.acquire({ exclusive: true });
        try {
          await entry.ensureReady();
        } catch (e) {
          this.log.error({ model: m.id, path: m.path, err: (e as Error).message }, 'model failed to load at start');
        } finally {
          lease.release();
        }
      }),
    );
    this.root.send({ type: 'STARTED' });
  }

  /**
   * The config's eager (`lazy: false`) models that are not loaded because their last load
   * failed, with that error: `/ready` and `GET /v1/models` list them. A later successful load
   * (on first use or `POST /v1/models/load`) takes a model off the list. Also `wakeword_dir`'s
   * files that are not heads (`wakeword_dir file <path>: <why>`) and its heads that failed to load.
   */
  failedModels(): { id: string; error: string }[] {
    const failed: { id: string; error: string }[] = [];
    for (const m of this.config.models) {
      const st = this.entries.get(m.id)?.status();
      const problem = this.fileProblems.get(m.id);
      if (st && st.state === 'unloaded' && st.last_error) failed.push({ id: m.id, error: st.last_error });
      // A lazy model whose files failed the start check: listed until it has been used without error.
      else if (problem && (!st || (st.state === 'unloaded' && st.last_used_at === null)))
        failed.push({ id: m.id, error: problem });
    }
    // wakeword_dir: its files that are not heads, and its heads whose last load failed.
    for (const p of this.folderProblems) failed.push({ id: p.id, error: `wakeword_dir file ${p.path}: ${p.error}` });
    for (const id of this.folderIds) {
      const st = this.entries.get(id)?.status();
      if (st && st.state === 'unloaded' && st.last_error) failed.push({ id, error: st.last_error });
    }
    return failed;
  }

  /**
   * Applies a scan of `wakeword_dir` (runtime/wakeword/wakeword-dir.ts): a new head joins the catalog (a
   * model registered lazily, listed by `GET /v1/models` and Wyoming `describe`); a head whose file
   * is gone leaves the catalog at once and the registry once idle (unloaded by an `EVICT` when it
   * is loaded and idle, then dropped when unloaded and unused: a stream on it finishes first). A
   * head whose id another model already has is a problem, as are the files that are not heads.
   */
  syncFolder(scan: FolderScan): void {
    const now = new Set<string>();
    const problems = [...scan.problems];
    for (const h of scan.heads) {
      const ours = this.folderIds.has(h.id) || this.leaving.has(h.id);
      if (!ours && (this.catalog.has(h.id) || this.entries.has(h.id))) {
        problems.push({ ...h, error: `its id '${h.id}' is already a model of this server: rename the file` });
        continue;
      }
      now.add(h.id);
      this.leaving.delete(h.id);
      if (this.catalog.get(h.id)?.path !== h.path) {
        this.catalog.set(h.id, ModelConfig.parse({ id: h.id, task: 'wakeword', path: h.path }));
        this.log.info({ model: h.id, path: h.path }, 'wakeword_dir: wake word added');
      }
      // Another file (a new version) for a registered id: an unloaded, unused entry is dropped (the
      // next request registers the new file); a loaded one is reconfigured to it (C8: requests
      // already running finish on the old head, the next ones run on the new). Its file is the one
      // its last reconfiguration asked for: a version that changes back while one waits for the
      // model's requests is asked for after it (in FIFO order), so the folder's file wins.
      const e = this.entries.get(h.id);
      if (!e || (this.folderPaths.get(h.id) ?? e.config.path) === h.path) continue;
      const a = e.admission;
      if (e.state === 'unloaded' && a.activeLeases === 0 && a.queued === 0 && !a.exclusive) {
        this.unregister(h.id);
        continue;
      }
      this.folderPaths.set(h.id, h.path);
      e.configure({ path: h.path }, 0)
        .catch((err: Error) =>
          this.log.warn(
            { model: h.id, path: h.path, err: err.message },
            'wakeword_dir: the new version failed to load',
          ),
        )
        .finally(() => {
          if (this.folderPaths.get(h.id) === h.path) this.folderPaths.delete(h.id);
        });
    }
    for (const id of this.folderIds)
      if (!now.has(id)) {
        this.catalog.delete(id);
        this.leaving.add(id);
        this.log.info({ model: id }, 'wakeword_dir: file removed; the model leaves once idle');
      }
    this.folderIds = now;
    this.folderProblems = problems;
    for (const id of [...this.leaving]) {
      const e = this.entries.get(id);
      const a = e?.admission;
      if (e && a && (e.state !== 'unloaded' || a.activeLeases > 0 || a.queued > 0 || a.exclusive)) {
        if (e.idle) e.actor.send({ type: 'EVICT', reason: 'idle' });
        continue;
      }
      this.leaving.delete(id);
      if (e) this.unregister(id);
    }
  }

  /**
   * Takes the ad hoc groups that are unloaded and unused (no lease, no waiter; not cooling down
   * after a crash loop) out of the registry: at once when one unloads (from {@link changed}, a
   * tick later), and before a new group registers.
   */
  private dropUnusedGroups(keep?: string): void {
    for (const g of [...this.adHoc]) {
      if (g === keep) continue;
      const e = this.entries.get(g)!;
      const a = e.admission;
      if (e.state !== 'unloaded' || a.activeLeases > 0 || a.queued > 0 || a.exclusive || e.status().cool_down) continue;
      this.unregister(g);
    }
  }

  /** Takes an unloaded, unused entry out of the registry, with its metric series. */
  private unregister(id: string): void {
    this.adHoc.delete(id);
    this.measuredPerSlot.delete(id);
    this.actor.send({ type: 'UNREGISTER', id });
    void this.metrics.forget(id);
  }

  /** The chart's `measureRoom`: what is resident, retiring and evictable now, and the free memory. */
  private measureRoom(target: PendingLoad, refused: string[]): RoomFigures {
    // Resident: models whose slots exist here, retiring ones included (the charts' `slots` tag).
    const others = [...this.entries.values()].filter((e) => e.id !== target.id && e.holdsSlots);
    const headroom = this.config.min_free_memory_mb * 1024 * 1024;
    return {
      target: target.id,
      needed_bytes: target.needed_bytes,
      headroom_bytes: headroom,
      free_bytes: headroom > 0 ? this.probe() : null,
      max_loaded: this.config.max_loaded_models,
      resident: others.map((e) => e.id),
      retiring: others.filter((e) => e.state !== 'ready').map((e) => e.id),
      // Every ready model is asked in LRU order; a busy one refuses (the try-acquire), and is asked again after a
      // change.
      candidates: others
        .filter((e) => e.state === 'ready' && !refused.includes(e.id))
        .sort((a, b) => (a.lastUsed ?? 0) - (b.lastUsed ?? 0))
        .map((e) => e.id),
    };
  }

  /**
   * The loader every model entry's `residency` actor calls once the gate granted its load. The
   * footprint is measured as the growth of process RSS over the load (noisy when unguarded loads
   * overlap). Public for the cluster, which loads a pool behind a remote one when a model's
   * holders are gone (cluster/node.ts).
   */
  readonly loadPool = async (config: ModelConfig, signal?: AbortSignal): Promise<LoadedModel> => {
    const before = process.memoryUsage().rss;
    const t0 = performance.now();
    let loaded: LoadedModel;
    try {
      loaded = await this.baseLoader(config, signal);
    } catch (e) {
      this.metrics.loads.inc({ model: config.id, outcome: 'error' });
      throw e;
    }
    this.metrics.loads.inc({ model: config.id, outcome: loaded?.pool ? 'ok' : 'error' });
    this.metrics.loadDuration.observe({ model: config.id }, (performance.now() - t0) / 1000);
    if (loaded?.pool) {
      // The server's own growth plus the slot hosts' processes (0 for threads: they are in the first).
      loaded.residentBytes = Math.max(0, process.memoryUsage().rss - before) + loaded.pool.residentBytes();
      if (loaded.residentBytes > 0) this.measuredPerSlot.set(config.id, loaded.residentBytes / config.slots);
    }
    return loaded;
  };

  /** Footprint of `config`, bytes: measured per slot if it has loaded before, else estimated. */
  async footprint(config: ModelConfig): Promise<number> {
    const perSlot = this.measuredPerSlot.get(config.id);
    return perSlot !== undefined ? perSlot * config.slots : this.estimate(config);
  }

  /** Tells the gate that room may have changed, when it is waiting for that. */
  private changed(): void {
    if (this.adHoc.size && !this.sweep)
      this.sweep = setImmediate(() => {
        this.sweep = null;
        if (this.actor.getSnapshot().status === 'active') this.dropUnusedGroups();
      });
    const s = this.actor.getSnapshot();
    if (s.status === 'active' && (s.matches('waitingForRelease') || s.matches('waitingForMemory')))
      this.actor.send({ type: 'MODEL_CHANGED' });
  }

  /** Models evicted (LRU, memory or idle) since start. */
  get evictions(): number {
    let n = 0;
    for (const e of this.entries.values()) n += e.actor.getSnapshot().context.evictions;
    return n;
  }

  /** True while accepting work (`/ready`). */
  get accepting(): boolean {
    return this.root.getSnapshot().value === 'running';
  }

  /** The root's state: `starting`, `running`, `draining`, `closing` or `stopped`. */
  get phase(): string {
    const value = this.root.getSnapshot().value;
    return typeof value === 'string' ? value : Object.keys(value)[0];
  }

  /**
   * The refusal of new work while not {@link accepting} (HTTP routes, stream upgrades, Wyoming
   * connections): `server_busy` (503, Retry-After 1 s) while `starting` (the eager models
   * load), else `shutting_down` (503, Retry-After 5 s).
   */
  notAccepting(): VoxError {
    return this.phase === 'starting' ? voxError('server_starting') : voxError('shutting_down');
  }

  /**
   * The entry for `id`, registering it from the catalog on first use; undefined if unknown. An id
   * of several wake-word model ids joined by commas (`alexa,hey-jarvis`) is a group of those heads
   * on one stream, registered on first use under its ids sorted (so any order shares one entry).
   * @throws VoxError `not_found` / `invalid_request_error` for a group naming an unknown or unfit model;
   *   `shutting_down` for a model not registered yet once the supervisor has stopped.
   */
  getOrRegister(id: string): ModelEntry | undefined {
    const found = this.entries.get(id);
    if (found) return found;
    if (id.includes(',')) return this.group(id);
    const config = this.catalog.get(id) ?? this.registeredElsewhere(id);
    return config ? this.publish(this.resolveHeads(config)) : undefined;
  }

  /**
   * The config another node of the cluster registered `id` with ({@link SupervisorOptions.elsewhere}), if valid here.
   */
  private registeredElsewhere(id: string): ModelConfig | undefined {
    const body = this.elsewhere?.(id);
    if (!body) return undefined;
    try {
      return validateModelConfig({ ...body, id });
    } catch (e) {
      this.log.warn({ model: id, err: (e as Error).message }, 'a model registered on another node is not valid here');
      return undefined;
    }
  }

  /** Ad hoc groups registered by requests (not configured), by id. */
  private readonly adHoc = new Set<string>();
  /** A pending {@link dropUnusedGroups} (after a model's change). */
  private sweep: NodeJS.Immediate | null = null;

  /**
   * The entry of an ad-hoc group `a,b,...` (see {@link getOrRegister}). What any client can make
   * the server load is bounded (issue 25 item 11): an ad hoc group idle for
   * `ad_hoc_keep_alive_ms` unloads, unloaded unused ones leave the registry, and at most
   * `max_ad_hoc_groups` are loaded: a new one past it unloads the least recently used idle one.
   * A list naming one model only (`alexa,alexa`) is that model's entry (undefined if unknown).
   * @throws VoxError `too_many_groups` (503) when that many are loaded and none is idle; as
   *   {@link headModel} for a head that is unknown or not a single wake-word model.
   */
  private group(id: string): ModelEntry | undefined {
    const names = [...new Set(id.split(',').map((s) => s.trim()))].sort();
    // `alexa,alexa` names one model: that model's own entry, never a group registered under its id
    // (which would take the id from every request naming it in a group, on this node and others).
    if (names.length === 1) return this.getOrRegister(names[0]);
    const canonical = names.join(',');
    if (canonical !== id) return this.entries.get(canonical) ?? this.group(canonical);
    const refs = names.map((n) => this.headModel(n, 'model'));
    this.makeRoomForGroup(canonical);
    const keepAlive = this.config.ad_hoc_keep_alive_ms;
    const config = ModelConfig.parse({
      id: 'group',
      task: 'wakeword',
      heads: names,
      slots: Math.max(...refs.map((r) => r.slots)),
      ...(keepAlive > 0 ? { keep_alive_ms: keepAlive } : {}),
    });
    const entry = this.publish(this.resolveHeads({ ...config, id: canonical }));
    this.adHoc.add(canonical);
    return entry;
  }

  /**
   * Before a new ad hoc group registers: drops from the registry the ones that are unloaded and
   * unused (no lease, no waiter; not cooling down after a crash loop); the rest are loaded,
   * loading, unloading or about to load (a request that registers a group takes its lease at
   * once). With `max_ad_hoc_groups` of those, it asks the least recently used idle ones to
   * `EVICT` (they unload while the new one loads; the ones already unloading count as freed).
   * Also before a registered group that has unloaded (or is unloading) loads again for a request
   * ({@link require}): it counts as a new one.
   * @throws VoxError `too_many_groups` when too few of them are idle.
   */
  private makeRoomForGroup(id: string): void {
    this.dropUnusedGroups(id);
    const max = this.config.max_ad_hoc_groups;
    if (max === 0) return;
    const held = [...this.adHoc].filter((g) => g !== id).map((g) => this.entries.get(g)!);
    const needed = held.length + 1 - max - held.filter((e) => e.state === 'unloading').length;
    if (needed <= 0) return;
    const idle = held.filter((e) => e.idle).sort((a, b) => (a.lastUsed ?? 0) - (b.lastUsed ?? 0));
    if (idle.length < needed) throw voxError('too_many_groups', { max, id });
    for (const e of idle.slice(0, needed)) e.actor.send({ type: 'EVICT', reason: 'lru' });
  }

  /**
   * The config of a single wake-word model that a group names as a head.
   * @throws VoxError `not_found` (unknown), `invalid_request_error` (not a wake-word model, or itself a group).
   */
  private headModel(name: string, field: string, atStart = false): ModelConfig {
    const ref = this.entries.get(name)?.config ?? this.catalog.get(name);
    if (!ref) {
      // At start (a config file's model) there is no server to ask yet: the wake words are named instead of the route.
      const hint = atStart
        ? `the wake-word models this server knows: ${this.knownIds('wakeword').join(', ')}`
        : undefined;
      throw voxError('model_not_found', {
        id: name,
        field,
        kind: 'wake-word',
        similar: this.similarModels(name, 'wakeword'),
        hint,
      });
    }
    if (ref.task !== 'wakeword' || ref.heads)
      throw invalid(
        field,
        `'${name}' is not a single wake-word model (task ${ref.task}${ref.heads ? ', a group' : ''})`,
      );
    return ref;
  }

  /**
   * Fills in a wake-word group's heads from the models they name: each head's file, and its
   * threshold and refractory period where the head does not set them (the named model's own
   * options, else the group's). Paths given by a client are replaced.
   * @param at prefix of the field named in errors: `models.<i>.` for a config file's model, checked at start.
   * @throws VoxError as {@link headModel}, naming `<at>heads.<i>`.
   */
  private readonly resolveHeads = (config: ModelConfig, at = ''): ModelConfig => {
    if (!config.heads) return config;
    const heads = config.heads.map((h, i) => {
      const head = typeof h === 'string' ? { model: h } : h;
      const ref = this.headModel(head.model, `${at}heads.${i}`, at !== '');
      const own = ref.options as { threshold?: unknown; refractory_ms?: unknown };
      return {
        model: head.model,
        path: ref.path!,
        threshold: head.threshold ?? (typeof own.threshold === 'number' ? own.threshold : undefined),
        refractory_ms: head.refractory_ms ?? (typeof own.refractory_ms === 'number' ? own.refractory_ms : undefined),
      };
    });
    if (new Set(heads.map((h) => h.model)).size !== heads.length) throw invalid(`${at}heads`, 'a model is named twice');
    const licences = [...new Set(heads.map((h) => this.headModel(h.model, `${at}heads`).licence ?? 'not given'))];
    return { ...config, heads, licence: config.licence ?? licences.join('; ') };
  };

  /**
   * The entry for `id` or a 404.
   * @throws VoxError `not_found`; `too_many_groups` (503) for an ad hoc group that would load past `max_ad_hoc_groups`.
   */
  require(id: string): ModelEntry {
    const e = this.getOrRegister(id);
    if (!e) throw this.unknownModel(id);
    // An ad hoc group evicted (unloading, or unloaded and kept for a request) loads again: within max_ad_hoc_groups, as a
    // new group (a breaker had two loaded at max 1: the evicted group's next request reloaded it with no check).
    if (this.adHoc.has(e.id) && (e.state === 'unloaded' || e.state === 'unloading')) this.makeRoomForGroup(e.id);
    return e;
  }

  /**
   * The entry for `id`, for work (a file, a stream, a Wyoming detection): as {@link require}, but a
   * config model whose files failed the start check (and still do) is answered at once.
   * @throws VoxError `model_not_found`; `model_unavailable` (503) naming the config entry and its path.
   */
  requireForWork(id: string): ModelEntry {
    const entry = this.require(id);
    if (!this.fileProblems.has(entry.id)) return entry;
    const problem = modelFileProblem(this.resolveHeads(entry.config));
    if (!problem) {
      // Fixed since (the file is there now, or the model was loaded with another path).
      this.fileProblems.delete(entry.id);
      return entry;
    }
    const index = this.config.models.findIndex((m) => m.id === entry.id);
    throw voxError('model_unavailable', {
      id: entry.id,
      entry: index >= 0 ? `models[${index}]` : `model ${entry.id}`,
      path: entry.config.path ?? '',
      problem,
    });
  }

  /**
   * The 404 (`model_not_found`) for a model id this server does not know, with the ids it probably meant ({@link
   * similarIds}).
   */
  unknownModel(id: string): VoxError {
    return voxError('model_not_found', { id, similar: this.similarModels(id) });
  }

  /** The known model ids close to `id` ({@link similarIds}); only single wake-word models for `task` 'wakeword'. */
  private similarModels(id: string, task?: 'wakeword'): string[] {
    const configs = [...this.catalog.values(), ...[...this.entries.values()].map((e) => e.config)];
    return similarIds(id, this.knownIds(task), new Map(configs.map((c) => [c.id, c.task])));
  }

  /** Every model id this server knows (catalog and registered); only single wake-word models for `task` 'wakeword'. */
  private knownIds(task?: 'wakeword'): string[] {
    const configs = [...this.catalog.values(), ...[...this.entries.values()].map((e) => e.config)];
    return [...new Set(configs.filter((c) => !task || (c.task === task && !c.heads)).map((c) => c.id))];
  }

  /**
   * Registers `config` (`REGISTER`: the supervisor spawns its chart as `model:<id>`) and publishes the entry.
   * @throws VoxError `shutting_down` once the supervisor has stopped (its chart spawns nothing any more).
   */
  private publish(config: ModelConfig, before?: (entry: ModelEntry) => void): ModelEntry {
    if (this.actor.getSnapshot().status !== 'active') throw voxError('shutting_down');
    const headroom = this.config.min_free_memory_mb > 0;
    const entry = new ModelEntry(config, {
      loader: this.loadPool,
      footprint: (c) => (headroom ? this.footprint(c) : Promise.resolve(0)),
      place: this.place,
      serverBusyTimeoutMs: this.config.busy_timeout_ms,
      serverIdleUnloadMs: this.config.idle_unload_ms,
      serverLoadTimeoutMs: this.config.load_timeout_ms,
      serverCrashCooldownMs: this.config.crash_cooldown_ms,
      serverMaxQueued: this.config.max_queued,
      onChange: () => this.changed(),
      resolve: this.resolveHeads,
      log: this.log.child({ model: config.id }),
      metrics: this.metrics,
      spawn: (input, self) => {
        this.actor.send({ type: 'REGISTER', id: config.id, logic: modelMachine, input, entry: self });
        return (this.actor.getSnapshot().children as Record<string, ModelActor>)[`model:${config.id}`];
      },
    });
    before?.(entry);
    return entry;
  }
  /**
   * `POST /v1/models/load`: registers a new model (validated first) and loads it, or
   * reconfigures / loads an existing one. Model paths are confined to `models_root` first.
   * @throws VoxError `invalid_request_error` (also a path outside `models_root`), `server_busy`,
   *   `server_error` (load failed).
   */
  async load(
    body: Record<string, unknown>,
    timeoutMs: number,
    signal?: AbortSignal,
  ): Promise<{ id: string; loaded: true; reconfigured: boolean }> {
    for (const f of PATH_FIELDS)
      if (typeof body[f] === 'string') body[f] = await confinePath(this.config.models_root, body[f] as string, f);
    const id = typeof body.id === 'string' ? body.id : undefined;
    const existing = id !== undefined ? this.getOrRegister(id) : undefined;
    if (existing) {
      const { reconfigured } = await existing.configure(body, timeoutMs, signal);
      return { id: existing.id, loaded: true, reconfigured };
    }
    const config = this.resolveHeads(validateModelConfig(body));
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
  async unloadMany(
    ids: string[],
    timeoutMs: number,
    signal?: AbortSignal,
  ): Promise<{ unloaded: string[]; not_found: string[] }> {
    const unique = [...new Set(ids)];
    const not_found = unique.filter((id) => !this.entries.has(id) && !this.catalog.has(id));
    const entries = unique.filter((id) => this.entries.has(id)).map((id) => this.entries.get(id)!);
    const barriers = entries.map((e) => e.unloadUnder(e.admission.acquire({ exclusive: true, timeoutMs, signal })));
    const results = await Promise.allSettled(barriers);
    signal?.throwIfAborted();
    const busy = entries.filter((_, i) => results[i].status === 'rejected').map((e) => e.id);
    const unloaded = unique.filter((id) => !not_found.includes(id) && !busy.includes(id));
    if (busy.length) {
      throw voxError('unload_timeout', { busy, unloaded });
    }
    return { unloaded, not_found };
  }

  /**
   * A registered model's chart state value (`{resident: {ready: 'idle'}}`), for `/debug`; undefined if not registered.
   */
  chartValue(id: string): unknown {
    return this.entries.get(id)?.actor.getSnapshot().value;
  }

  /** A registered model's entry, without registering it; undefined if not registered. */
  registered(id: string): ModelEntry | undefined {
    return this.entries.get(id);
  }

  /** Every registered model's id. */
  get registeredIds(): string[] {
    return [...this.entries.keys()];
  }

  /** The config of a known model (registered, else in the catalog) without registering it; undefined if unknown. */
  configOf(id: string): ModelConfig | undefined {
    return this.entries.get(id)?.config ?? this.catalog.get(id);
  }

  /** Every known single wake-word model (not groups), registered or in the catalog, in catalog order. */
  wakeModels(): ModelConfig[] {
    const byId = new Map<string, ModelConfig>(this.catalog);
    for (const e of this.entries.values()) byId.set(e.id, e.config);
    return [...byId.values()].filter((c) => c.task === 'wakeword' && !c.heads);
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

  /**
   * Stops accepting work (`/ready` answers 503): the root goes `draining` and emits `drain`; every
   * model entry drains (a cold load in progress is abandoned, its slot hosts killed, its waiters
   * answered 503 `shutting_down`; no new load starts), so the drain never waits for a load.
   */
  beginShutdown(): void {
    this.folder?.stop();
    this.root.send({ type: 'SHUTDOWN' });
    this.actor.send({ type: 'DRAIN' });
  }

  /** Shutdown past the drain deadline: every queued request gets `err`, every lease holder is revoked. */
  revokeAll(err: VoxError): void {
    for (const e of this.entries.values()) e.admission.revokeAll(err);
  }

  /** Unloads every model (each waits at most `timeoutMs` for its running requests), then stops. */
  async stop(timeoutMs: number): Promise<void> {
    this.beginShutdown();
    await Promise.all([...this.entries.values()].map((e) => e.stop(timeoutMs)));
    this.root.send({ type: 'STOPPED' });
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
    last_eviction: null,
    processing_lag_ms: null,
    cool_down: null,
    licence: c.licence ?? null,
  };
}
