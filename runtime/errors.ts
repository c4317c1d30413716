import { CLOSE, ERROR_STATUS, type ErrorType } from './wire.js';

export { ERROR_STATUS, type ErrorType } from './wire.js';

/**
 * The error catalogue: every error a client can see has a stable `code` (snake_case; never
 * renamed or reused), a wire `type` (the coarse class clients already switch on), an HTTP
 * status (the type's, unless the entry says otherwise), `Retry-After` seconds for 503s, and a
 * message template. docs/errors.md lists every code (a test keeps the two in step).
 *
 * To add an error: an entry here, a row in docs/errors.md, then `throw voxError('my_code', {...})`.
 * This module imports nothing from Node: the browser client bundles its types.
 */
interface ErrorSpec {
  readonly type: ErrorType;
  /** HTTP status when it is not the type's. */
  readonly status?: number;
  /** `Retry-After` of a 503, s (default 1). */
  readonly retryAfterS?: number;
  /** Renders the message from the entry's parameters. */
  readonly message: (params: never) => string;
}

/** How the command line sends a key (named in 401s). */
const CLI_KEY = 'voxserve run/stream: --api-key KEY or VOXSERVE_API_KEY';

/** Shortens a client-supplied string quoted back in a message. */
const clip = (s: string, n = 128): string => (s.length > n ? `${s.slice(0, n)}...` : s);

export const ERRORS = {
  // 400 invalid_request_error: the request is wrong; fix it, do not retry as is.
  invalid_field: {
    type: 'invalid_request_error',
    message: (p: { field: string; problem: string }) => `${p.field}: ${p.problem}`,
  },
  invalid_fields: { type: 'invalid_request_error', message: (p: { issues: string }) => p.issues },
  unknown_field: {
    type: 'invalid_request_error',
    message: (p: { field: string; problem: string }) => `${clip(p.field, 64)}: ${p.problem}`,
  },
  invalid_json: { type: 'invalid_request_error', message: (p: { problem: string }) => `body ${p.problem}` },
  invalid_multipart: {
    type: 'invalid_request_error',
    message: (p: { problem: string }) => `body is not a readable multipart/form-data form (${p.problem})`,
  },
  invalid_msgpack: { type: 'invalid_request_error', message: (p: { problem: string }) => `body ${p.problem}` },
  invalid_tensor: {
    type: 'invalid_request_error',
    message: (p: { field: string; problem: string }) => `${clip(p.field, 100)}: ${p.problem}`,
  },
  unknown_output: {
    type: 'invalid_request_error',
    message: (p: { name: string; id: string; outputs: string }) =>
      `outputs: '${clip(p.name, 64)}' is not an output of model ${p.id}; its outputs: ${p.outputs}`,
  },
  wrong_task: {
    type: 'invalid_request_error',
    message: (p: { id: string; task: string; problem: string }) => `model ${p.id} is a ${p.task} model: ${p.problem}`,
  },
  invalid_audio: { type: 'invalid_request_error', message: (p: { problem: string }) => `audio: ${p.problem}` },
  unsupported_audio: { type: 'invalid_request_error', message: (p: { problem: string }) => `audio: ${p.problem}` },
  audio_too_long: { type: 'invalid_request_error', message: (p: { problem: string }) => `audio: ${p.problem}` },
  invalid_model_file: {
    type: 'invalid_request_error',
    message: (p: { field: string; path: string; problem: string }) => `${p.field}: '${p.path}' ${p.problem}`,
  },
  invalid_config: {
    type: 'invalid_request_error',
    message: (p: { file: string; problem: string }) => `config file ${p.file} ${p.problem}`,
  },
  invalid_framing: { type: 'invalid_request_error', message: (p: { reason: string }) => p.reason },
  invalid_control_message: {
    type: 'invalid_request_error',
    message: (p: { json: false } | { json: true; type: unknown }) =>
      p.json
        ? `unknown control message type ${JSON.stringify(p.type)}; expected "end"`
        : 'control frame is not valid JSON; expected {"type":"end"}',
  },
  body_stalled: {
    type: 'invalid_request_error',
    message: (p: { idleMs: number }) => `request body stalled: no data for limits.idle_ms (${p.idleMs} ms)`,
  },
  stream_idle: {
    type: 'invalid_request_error',
    message: (p: { idleMs: number; setting: string }) => `no message for ${p.setting} (${p.idleMs} ms)`,
  },
  stream_too_long: {
    type: 'invalid_request_error',
    message: (p: { totalMs: number }) => `stream exceeded limits.total_ms (${p.totalMs} ms)`,
  },
  stream_flooded: {
    type: 'invalid_request_error',
    message: (p: { perS: number }) => `too many messages: over limits.ws_max_messages_per_s (${p.perS})`,
  },
  method_not_allowed: {
    type: 'invalid_request_error',
    status: 405,
    message: (p: { method: string; path: string }) => `method ${clip(p.method, 32)} is not allowed on ${clip(p.path)}`,
  },
  websocket_required: {
    type: 'invalid_request_error',
    status: 426,
    message: (p: { path: string }) => `${p.path} is a WebSocket route: open a WebSocket (Upgrade: websocket)`,
  },
  upgrade_not_supported: {
    type: 'invalid_request_error',
    message: (p: { upgrade: string }) => `Upgrade: ${clip(p.upgrade, 64)} is not supported`,
  },
  malformed_request: {
    type: 'invalid_request_error',
    message: (p: { reason: string }) => `malformed request: ${p.reason}`,
  },
  headers_too_large: {
    type: 'invalid_request_error',
    status: 431,
    message: (p: { reason: string }) => `malformed request: ${p.reason}`,
  },
  headers_timeout: {
    type: 'invalid_request_error',
    status: 408,
    message: (p: { ms: number }) => `the request headers did not arrive within limits.headers_timeout_ms (${p.ms} ms)`,
  },
  request_timeout: {
    type: 'invalid_request_error',
    status: 408,
    message: (p: { ms: number }) =>
      `the request was not received in full within limits.request_timeout_ms (${p.ms} ms)`,
  },
  // 401, 403: who may call.
  api_key_required: {
    type: 'unauthorized',
    message: (p: { keyProtocol: string }) =>
      `this server needs an API key: Authorization: Bearer <key>, or on a stream the subprotocol ${p.keyProtocol}<key> (${CLI_KEY})`,
  },
  api_key_invalid: {
    type: 'unauthorized',
    message: () => `the API key is not valid: it is not one of the server's auth.api_keys (${CLI_KEY})`,
  },
  host_not_allowed: {
    type: 'forbidden',
    message: (p: { host: string }) =>
      `Host '${clip(p.host, 200)}' is not served here: add it to allowed_hosts (requests may only name loopback, the configured host or allowed_hosts, against DNS rebinding)`,
  },
  origin_not_allowed: {
    type: 'forbidden',
    message: (p: { origin: string }) =>
      `Origin '${clip(p.origin, 200)}' may not call this server: add it to allowed_origins`,
  },
  management_disabled: {
    type: 'forbidden',
    message: () => 'management and debug routes are disabled; start the server with --management',
  },
  management_token_required: {
    type: 'forbidden',
    message: () => 'management routes need Authorization: Bearer <token>',
  },
  // 404
  model_not_found: {
    type: 'not_found',
    message: (p: { id: string; field?: string; kind?: string; similar?: readonly string[]; hint?: string }) =>
      `${p.field ? `${p.field}: ` : ''}${p.kind ? `${p.kind} ` : ''}model '${clip(p.id)}' does not exist${p.similar?.length ? ` (did you mean ${p.similar.map((s) => `'${s}'`).join(' or ')}?)` : ''}; ${p.hint ?? 'GET /v1/models lists the models'}`,
  },
  route_not_found: {
    type: 'not_found',
    message: (p: { route: string; hint?: string }) => `no route ${clip(p.route)}${p.hint ? `; ${p.hint}` : ''}`,
  },
  not_clustered: {
    type: 'not_found',
    message: () => 'this server is not part of a cluster (start it with --cluster <nats-url>)',
  },
  demo_disabled: {
    type: 'not_found',
    message: () => 'the demo is off: set demo.enabled in the config (it is on by default on a loopback address)',
  },
  demo_not_built: { type: 'not_found', message: () => 'the demo is not built: run npm run build' },
  // 413, 415
  body_too_large: {
    type: 'payload_too_large',
    message: (p: { bytes?: number; limit: number }) =>
      `body ${p.bytes === undefined ? '' : `of ${p.bytes} bytes `}exceeds limits.max_body_bytes (${p.limit})`,
  },
  tensor_too_large: {
    type: 'payload_too_large',
    message: (p: { bytes?: number; limit: number }) =>
      `tensor inputs ${p.bytes === undefined ? '' : `(a body of ${p.bytes} bytes) `}exceed limits.max_tensor_bytes (${p.limit})`,
  },
  unsupported_media_type: {
    type: 'unsupported_media_type',
    message: (p: { expected: string; got: string }) =>
      `content-type: expected ${p.expected}, got '${clip(p.got || 'none', 64)}'`,
  },
  // 503: retry later (after Retry-After).
  server_starting: {
    type: 'server_busy',
    retryAfterS: 1,
    message: () => 'the server is starting: its models are loading; GET /ready answers 200 once it accepts work',
  },
  shutting_down: { type: 'shutting_down', retryAfterS: 5, message: () => 'the server is shutting down' },
  model_stopped: {
    type: 'shutting_down',
    retryAfterS: 5,
    message: (p: { id?: string }) => (p.id ? `model ${p.id} stopped` : 'the model entry stopped'),
  },
  model_cooling_down: {
    type: 'server_busy',
    retryAfterS: 10,
    message: (p: { id: string; failures: number; restS: number; reason: string }) =>
      `model ${p.id} is held back for another ${p.restS} s (crash_cooldown_ms): its slot hosts kept crashing (${p.failures} time${p.failures === 1 ? '' : 's'} in a row; the last: ${p.reason}); it is not reloaded until then`,
  },
  queue_full: {
    type: 'server_busy',
    retryAfterS: 1,
    message: (p: { max: number }) =>
      `the queue is full: ${p.max} requests already wait for this model (max_queued); retry later`,
  },
  busy_timeout: {
    type: 'server_busy',
    retryAfterS: 1,
    message: (p: { what: 'lease' | 'slot'; ms: number }) =>
      p.what === 'lease'
        ? `no lease free within the busy timeout of ${p.ms} ms`
        : `waited for a slot longer than the busy timeout (${p.ms} ms)`,
  },
  model_stuck: {
    type: 'server_busy',
    retryAfterS: 5,
    message: (p: { id?: string; ms: number }) =>
      p.id
        ? `model ${p.id} is stuck: its work has run longer than the busy timeout of ${p.ms} ms`
        : `every slot of the model has run one job longer than the busy timeout (${p.ms} ms): it is stuck`,
  },
  job_timeout: {
    type: 'server_busy',
    retryAfterS: 1,
    message: (p: { ms: number }) =>
      `the job ran longer than job_timeout_ms (${p.ms} ms): its slot host was killed and is being restarted`,
  },
  model_unloaded: {
    type: 'server_busy',
    retryAfterS: 1,
    message: (p: { id: string }) => `model ${p.id} was unloaded (force)`,
  },
  unload_timeout: {
    type: 'server_busy',
    retryAfterS: 1,
    message: (p: { busy: string[]; unloaded: string[] }) =>
      `could not unload ${p.busy.join(', ')} within the busy timeout; unloaded: ${p.unloaded.join(', ') || 'none'}`,
  },
  no_room: {
    type: 'server_busy',
    retryAfterS: 1,
    message: (p: { id: string; maxLoaded?: number; timeoutMs: number; resident: string[]; unloading?: string }) =>
      p.unloading
        ? `cannot load ${p.id}: max_loaded_models (${p.maxLoaded}) reached, and ${p.unloading}, evicted for it, had not finished unloading within the busy timeout (${p.timeoutMs} ms); resident: ${p.resident.join(', ') || 'none'}`
        : `cannot load ${p.id}: max_loaded_models (${p.maxLoaded}) reached and no model became idle to evict within the busy timeout (${p.timeoutMs} ms); resident: ${p.resident.join(', ') || 'none'}`,
  },
  insufficient_memory: {
    type: 'insufficient_memory',
    retryAfterS: 5,
    message: (p: { id: string; needed: string; headroom: string; free: string }) =>
      `cannot load ${p.id}: needs about ${p.needed} plus ${p.headroom} of headroom (min_free_memory_mb), but only ${p.free} is available`,
  },
  too_many_groups: {
    type: 'server_busy',
    retryAfterS: 5,
    message: (p: { max: number; id: string }) =>
      `cannot load wake-word group '${clip(p.id)}': ${p.max} ad hoc groups are loaded and in use (max_ad_hoc_groups); retry later, or configure the group in models[]`,
  },
  too_many_streams: {
    type: 'server_busy',
    retryAfterS: 1,
    message: (p: { max: number }) => `limits.max_ws_connections (${p.max}) reached`,
  },
  client_not_reading: {
    type: 'server_busy',
    retryAfterS: 1,
    message: (p: { detail: string }) => `client is not reading: ${p.detail}`,
  },
  server_behind: {
    type: 'server_busy',
    retryAfterS: 1,
    message: (p: { maxBytes: number }) =>
      `server is behind: events unsent over limits.ws_max_buffered_bytes (${p.maxBytes}) while it paused reading`,
  },
  // Cluster (docs/cluster.md).
  cluster_load_timeout: {
    type: 'server_busy',
    retryAfterS: 1,
    message: (p: { id: string; ms: number }) =>
      `model ${p.id} is being loaded by another node of the cluster and was not ready within the busy timeout (${p.ms} ms)`,
  },
  cluster_full: {
    type: 'server_busy',
    retryAfterS: 5,
    message: (p: { id: string; why: string }) => `no node of the cluster could load ${p.id}${p.why}`,
  },
  cluster_insufficient_memory: {
    type: 'insufficient_memory',
    retryAfterS: 5,
    message: (p: { id: string; why: string }) => `no node of the cluster could load ${p.id}${p.why}`,
  },
  no_holder: { type: 'server_busy', retryAfterS: 1, message: (p: { message: string }) => p.message },
  node_unreachable: {
    type: 'server_busy',
    retryAfterS: 1,
    message: (p: { node: string; reason: string }) => `node ${p.node} did not answer (${p.reason})`,
  },
  node_not_found: {
    type: 'not_found',
    message: (p: { node: string }) => `node '${p.node}' is not in the cluster; GET /v1/cluster lists the nodes`,
  },
  node_failed: { type: 'server_error', message: (p: { message: string }) => p.message },
  node_name_taken: {
    type: 'invalid_request_error',
    message: (p: { node: string; url: string }) =>
      `cluster.node: another live process already runs as node '${p.node}' (${p.url}); give each process its own name (--node, or cluster.node)`,
  },
  // 500: the server failed; report it if it repeats.
  model_unavailable: {
    type: 'server_error',
    status: 503,
    retryAfterS: 30,
    message: (p: { id: string; entry: string; path: string; problem: string }) =>
      `model ${p.id} is unavailable: its config entry ${p.entry} (path '${p.path}') cannot load: ${p.problem}; fix ${p.entry} in the config file and restart, or load it with POST /v1/models/load`,
  },
  load_failed: {
    type: 'server_error',
    message: (p: { id: string; reason: string }) => `model ${p.id} failed to load: ${p.reason}`,
  },
  load_timeout: {
    type: 'server_error',
    message: (p: { ms: number }) => `loading took longer than load_timeout_ms (${p.ms} ms); the load was abandoned`,
  },
  inference_failed: { type: 'server_error', message: (p: { reason: string }) => `inference failed: ${p.reason}` },
  slot_failed: { type: 'server_error', message: (p: { reason: string }) => `slot failed: ${p.reason}` },
  input_crashed_model: {
    type: 'invalid_request_error',
    status: 422,
    message: (p: { reason: string }) =>
      `this input crashed the model's slot host twice (the second time on a fresh host), so it is refused; the model serves other requests (${p.reason})`,
  },
  slot_crash_loop: {
    type: 'server_error',
    message: (p: { crashes: number; last: string }) => `${p.crashes} slot crashes within a minute; the last: ${p.last}`,
  },
  slot_restart_failed: {
    type: 'server_error',
    message: (p: { reason: string }) => `a slot could not be restarted: ${p.reason}`,
  },
  slot_closed: { type: 'server_error', message: () => 'slot is closed' },
  slots_unloaded: { type: 'server_error', message: () => 'model unloaded' },
  decoder_failed: {
    type: 'server_error',
    message: (p: { reason: string }) => `audio decoder worker died: ${p.reason}`,
  },
  internal_error: { type: 'server_error', message: (p: { message: string }) => p.message },
} as const satisfies Record<string, ErrorSpec>;

/** A stable error code (docs/errors.md). */
export type ErrorCode = keyof typeof ERRORS;

/** The parameters of a code's message template (`undefined` when it takes none). */
export type ErrorParams<C extends ErrorCode> = Parameters<(typeof ERRORS)[C]['message']>[0];

/**
 * What every code takes besides its template's parameters: a cause, and the `Retry-After` of this answer when it is
 * known (s; a cool-down's rest).
 */
type Extra = { cause?: unknown; retryAfterS?: number };
type ErrorArgs<C extends ErrorCode> =
  ErrorParams<C> extends undefined ? [params?: Extra] : [params: ErrorParams<C> & Extra];

/** The wire body of an error: `{"error":{"type","code","message"}}` (HTTP bodies, SSE and stream `error` events). */
export interface WireError {
  type: ErrorType;
  code: ErrorCode;
  message: string;
}

/**
 * An error a client can see. Create one with {@link voxError} (which renders the code's message
 * template); the constructor takes a message already rendered (an error rebuilt from a worker).
 */
export class VoxError extends Error {
  readonly code: ErrorCode;
  /** This answer's own `Retry-After`, s, when it knows better than its code's. */
  private readonly retryAfter?: number;
  constructor(code: ErrorCode, message: string, options: Extra = {}) {
    super(message, { cause: options.cause });
    this.name = 'VoxError';
    this.code = code;
    this.retryAfter = options.retryAfterS;
  }
  /** The wire type of this error's code. */
  get type(): ErrorType {
    return ERRORS[this.code].type;
  }
  /** HTTP status code. */
  get status(): number {
    const spec: ErrorSpec = ERRORS[this.code];
    return spec.status ?? ERROR_STATUS[spec.type];
  }
  /** `Retry-After` of a 503, s. */
  get retryAfterS(): number | undefined {
    const spec: ErrorSpec = ERRORS[this.code];
    return this.retryAfter ?? spec.retryAfterS;
  }
  /**
   * The WebSocket close code of a stream that fails with this error: the client's mistake 1008,
   * too large 1009, busy (any 503) 1013, else 1011. (A stream whose lease is revoked later closes
   * 1012, or 1001 at shutdown.)
   */
  get closeCode(): number {
    if (this.type === 'payload_too_large') return CLOSE.TOO_LARGE;
    if (this.status < 500) return CLOSE.POLICY;
    return this.status === 503 ? CLOSE.BUSY : CLOSE.INTERNAL;
  }
  /** The wire form, `{type, code, message}`. */
  toWire(): WireError {
    return { type: this.type, code: this.code, message: this.message };
  }
}

/**
 * Creates the error `code` with its message rendered from `params` (`cause` is kept as the
 * error's cause, not rendered). `voxError('model_not_found', { id })`.
 */
export function voxError<C extends ErrorCode>(code: C, ...args: ErrorArgs<C>): VoxError {
  const params = args[0] as Extra | undefined;
  const render = ERRORS[code].message as (p: unknown) => string;
  return new VoxError(code, render(params), { cause: params?.cause, retryAfterS: params?.retryAfterS });
}

/** Shorthand for `voxError('invalid_field', { field, problem })`: a 400 naming the field. */
export function invalid(field: string, problem: string): VoxError {
  return voxError('invalid_field', { field, problem });
}

/** Rebuilds an error from its wire form (a worker's message); an unknown code becomes `internal_error`. */
export function fromWire(e: { code?: string; message: string }): VoxError {
  return new VoxError(e.code !== undefined && e.code in ERRORS ? (e.code as ErrorCode) : 'internal_error', e.message);
}

/** Wraps anything thrown into a VoxError (unknown errors become `internal_error`, a `server_error`, message kept). */
export function toVoxError(err: unknown): VoxError {
  if (err instanceof VoxError) return err;
  return voxError('internal_error', { message: err instanceof Error ? err.message : String(err), cause: err });
}

/** The wire body of an error: `{"error":{"type","code","message"}}`. */
export function errorBody(err: VoxError): { error: WireError } {
  return { error: err.toWire() };
}
