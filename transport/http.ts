import type { IncomingMessage, ServerResponse } from 'node:http';
import { pack, unpack } from 'msgpackr';
import type { AudioFile, HttpInput, HttpOutput, HttpSocket, TaskRequest } from '../actors/http.js';
import { MAX_TIMEOUT_MS, queryOptions } from '../runtime/config.js';
import { MAX_SAMPLE_RATE, MIN_SAMPLE_RATE } from '../runtime/audio/audio.js';
import { isAudioContentType, parseJsonObject } from '../runtime/audio/decode.js';

export { parseJsonObject };
import { errorBody, invalid, toVoxError, voxError, type VoxError, type WireError } from '../runtime/errors.js';

/** Writes a JSON response. */
export function sendJson(
  res: ServerResponse,
  status: number,
  body: unknown,
  headers: Record<string, string> = {},
): void {
  const text = JSON.stringify(body);
  res.writeHead(status, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(text), ...headers });
  res.end(text);
}

/** Writes a msgpack response (a `tensor` answer with binary data). */
export function sendMsgpack(res: ServerResponse, status: number, body: unknown): void {
  const bytes = pack(body);
  res.writeHead(status, { 'content-type': 'application/msgpack', 'content-length': bytes.length });
  res.end(bytes);
}

/** Writes a WAV file (a denoise answer). */
function sendWav(res: ServerResponse, status: number, bytes: Buffer): void {
  res.writeHead(status, { 'content-type': 'audio/wav', 'content-length': bytes.length });
  res.end(bytes);
}

/**
 * Writes an Open Inference Protocol answer with binary tensor data: `body` is the JSON answer
 * (`headerLength` bytes, given in `Inference-Header-Content-Length`) then the tensors' bytes.
 */
function sendInferenceBinary(res: ServerResponse, status: number, body: Buffer, headerLength: number): void {
  res.writeHead(status, {
    'content-type': 'application/octet-stream',
    'inference-header-content-length': headerLength,
    'content-length': body.length,
  });
  res.end(body);
}

/**
 * An error's body in the protocol of the request's path: under `/v2` the Open Inference Protocol's
 * `$inference_error_response`, `{"error": "<message>"}`; elsewhere voxserve's `{"error": {type, code, message}}`.
 */
export function errorBodyFor(res: ServerResponse, body: { error: Pick<WireError, 'message'> }): unknown {
  return /^\/v2(?:[/?]|$)/.test(res.req?.url ?? '') ? { error: body.error.message } : body;
}

/** Media types of a msgpack body (a `tensor` request): the IANA one and the two in common use. */
export const MSGPACK_TYPES = ['application/msgpack', 'application/vnd.msgpack', 'application/x-msgpack'];

/** Writes a VoxError (or any error, as `server_error`) in the wire format, with Retry-After on 503s. */
export function sendError(res: ServerResponse, err: unknown): void {
  const e = toVoxError(err);
  if (res.headersSent) {
    res.destroy();
    return;
  }
  sendJson(res, e.status, errorBodyFor(res, errorBody(e)), errorHeaders(e));
}

/** Headers an error answer carries: `Retry-After` on 503s, `WWW-Authenticate` on 401s. */
export function errorHeaders(e: VoxError): Record<string, string> {
  if (e.status === 503) return { 'retry-after': String(e.retryAfterS ?? 1) };
  if (e.status === 401) return { 'www-authenticate': 'Bearer realm="voxserve"' };
  return {};
}

/**
 * The request target as a URL (path and query; the host is not read from it).
 * @throws VoxError `malformed_request` (400) for a target that is not a valid path, such as `//`.
 */
export function requestUrl(req: IncomingMessage): URL {
  try {
    return new URL(req.url ?? '/', 'http://localhost');
  } catch {
    throw voxError('malformed_request', {
      reason: `the request target is not a valid path: ${JSON.stringify((req.url ?? '').slice(0, 64))}`,
    });
  }
}

/** The request's media type: `Content-Type` without parameters, lower case ('' without one). */
export const mediaType = (req: IncomingMessage): string =>
  (req.headers['content-type'] ?? '').split(';')[0].trim().toLowerCase();

/**
 * Refuses a request whose `Content-Type` is not one of `accepted`, before its body is read. The
 * JSON and management routes take `application/json` only, which a browser cannot send across
 * sites without a CORS preflight.
 * @throws VoxError `unsupported_media_type` (415).
 */
export function requireMediaType(req: IncomingMessage, accepted: string[]): void {
  const type = mediaType(req);
  if (!accepted.includes(type))
    throw voxError('unsupported_media_type', { expected: accepted.join(' or '), got: type });
}

/**
 * `POST /v1/tasks/run` takes JSON (base64 audio, or a tensor model's inputs), msgpack (a tensor model's inputs) or a
 * raw audio body (an `audio/...` type,
 * `application/octet-stream`, ...: {@link isAudioContentType}); checked before the body is read.
 * @throws VoxError `unsupported_media_type` (415).
 */
export function requireRunMediaType(req: IncomingMessage): void {
  const type = mediaType(req);
  if (
    type !== 'application/json' &&
    type !== 'multipart/form-data' &&
    !MSGPACK_TYPES.includes(type) &&
    !isAudioContentType(type)
  ) {
    throw voxError('unsupported_media_type', {
      expected:
        'application/json, application/msgpack (tensors), multipart/form-data (curl -F file=@x.wav) or an audio type (audio/wav, audio/mpeg, audio/ogg, audio/flac, audio/webm, application/octet-stream; with ?model=ID)',
      got: type,
    });
  }
}

/**
 * Reads a request body of at most `limit` bytes, with no gap between chunks over `idleMs`. A
 * client that sent `Expect: 100-continue` is told to send its body (`100 Continue` on `res`)
 * only here, once the declared length fits: an answer given before (403, 401, 415, 413) reaches
 * it before it uploads anything.
 * @throws VoxError `payload_too_large` past the limit; `invalid_request_error` when the body
 *   stalls (the rest is not read either way).
 */
export function readBody(req: IncomingMessage, res: ServerResponse, limit: number, idleMs: number): Promise<Buffer> {
  const declared = Number(req.headers['content-length']);
  if (declared > limit) return Promise.reject(voxError('body_too_large', { bytes: declared, limit }));
  if (/^100-continue$/i.test(req.headers.expect ?? '')) res.writeContinue();
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = [];
    let size = 0;
    let timer: NodeJS.Timeout | null = null;
    const arm = (): void => {
      if (timer) clearTimeout(timer);
      if (idleMs > 0) timer = setTimeout(() => fail(voxError('body_stalled', { idleMs })), idleMs);
    };
    const cleanup = (): void => {
      if (timer) clearTimeout(timer);
      req.off('data', onData).off('end', onEnd).off('error', fail).off('close', onClose);
      res.off('close', onClose);
    };
    const fail = (e: Error): void => {
      cleanup();
      reject(e);
    };
    const onData = (chunk: Buffer): void => {
      size += chunk.length;
      if (size > limit) return fail(voxError('body_too_large', { limit }));
      chunks.push(chunk);
      arm();
    };
    const onEnd = (): void => {
      cleanup();
      resolve(Buffer.concat(chunks));
    };
    const onClose = (): void => fail(new DOMException('the client went away', 'AbortError'));
    req.on('data', onData).on('end', onEnd).on('error', fail).on('close', onClose);
    // Answered already (limits.request_timeout_ms) or the connection is gone: the rest is not awaited.
    res.on('close', onClose);
    arm();
  });
}

function parseTimeout(v: unknown): number | undefined {
  if (v === undefined || v === null || v === '') return undefined;
  const n = typeof v === 'string' ? Number(v) : v;
  if (
    typeof n !== 'number' ||
    !Number.isInteger(n) ||
    n < 0 ||
    n > MAX_TIMEOUT_MS ||
    (typeof v === 'string' && !/^\d+$/.test(v))
  ) {
    throw invalid('busy_timeout_ms', `must be an integer from 0 to ${MAX_TIMEOUT_MS}, got ${JSON.stringify(v)}`);
  }
  return n;
}

const RUN_FIELDS = ['model', 'audio', 'busy_timeout_ms', 'options', 'sample_rate', 'denoise'];
/** Fields of a `tensor` request (JSON or msgpack). */
const TENSOR_FIELDS = ['model', 'inputs', 'outputs', 'busy_timeout_ms'];

/** Query parameters of `/v1/tasks/run` with a raw audio body, besides task options. */
const RUN_QUERY = ['model', 'busy_timeout_ms', 'sample_rate', 'denoise'];
/** Fields of a `POST /v1/tasks/batch` body (a chain's `denoise` too; a denoise model answers one file at a time). */
const BATCH_FIELDS = ['model', 'files', 'busy_timeout_ms', 'options', 'denoise'];

/**
 * A chain's `denoise` (query string or JSON): the id of the denoise model the audio goes through first.
 * @throws VoxError `invalid_request_error` naming `denoise` when it is not a model id string.
 */
function parseDenoise(v: unknown): string | undefined {
  if (v === undefined || v === null) return undefined;
  if (typeof v !== 'string' || !v)
    throw invalid('denoise', `must be a denoise model id (rnnoise), got ${JSON.stringify(v)}`);
  return v;
}

/**
 * A denoise answer's `sample_rate` (query string or JSON), Hz.
 * @throws VoxError `invalid_request_error` naming `sample_rate` when it is not an integer in range.
 */
function parseSampleRate(v: unknown): number | undefined {
  if (v === undefined) return undefined;
  const n = typeof v === 'string' && /^\d+$/.test(v) ? Number(v) : v;
  if (typeof n !== 'number' || !Number.isInteger(n) || n < MIN_SAMPLE_RATE || n > MAX_SAMPLE_RATE)
    throw invalid(
      'sample_rate',
      `must be an integer from ${MIN_SAMPLE_RATE} to ${MAX_SAMPLE_RATE} (Hz), got ${JSON.stringify(v)}`,
    );
  return n;
}

/** Whether a request's `Accept` names JSON (a denoise answer is then JSON, not audio). */
const acceptsJson = (req: IncomingMessage): boolean =>
  /(^|,)\s*application\/json\s*(;|,|$)/i.test(req.headers.accept ?? '');

const BASE64 = /^[A-Za-z0-9+/]*={0,2}$/;
/** An RFC 2397 `data:` URL prefix: `data:audio/mpeg;base64,` (parameters allowed). */
const DATA_URL = /^data:([^;,]*)((?:;[^;,]*)*?);base64,/i;

/**
 * Decodes one base64 audio file, with or without a `data:<type>;base64,` prefix (the type then
 * tells the format, as a Content-Type does).
 * @throws VoxError `invalid_request_error` naming `field`.
 */
export function parseBase64Audio(value: unknown, field: string): AudioFile {
  if (typeof value !== 'string' || !value) throw invalid(field, `required, a base64-encoded audio file`);
  const prefix = DATA_URL.exec(value.slice(0, 256));
  if (!prefix && value.startsWith('data:')) throw invalid(field, `a data: URL must be base64 (data:<type>;base64,...)`);
  const b64 = prefix ? value.slice(prefix[0].length) : value;
  if (!BASE64.test(b64.replace(/\s/g, ''))) throw invalid(field, `not valid base64`);
  const type = prefix?.[1].trim().toLowerCase() || undefined;
  return { bytes: Buffer.from(b64, 'base64'), type };
}

/** A JSON task request takes no query parameters. @throws VoxError naming the first. */
function noQuery(url: URL): void {
  const first = [...url.searchParams.keys()][0];
  if (first !== undefined)
    throw voxError('unknown_field', {
      field: first,
      problem: 'unknown query parameter; with a JSON body every field goes in the body',
    });
}

/**
 * Parses `POST /v1/tasks/run`: a raw audio body (WAV, MP3, Ogg, FLAC, WebM; `Content-Type:
 * audio/...` or `application/octet-stream`) with `?model=ID`, `busy_timeout_ms` and task options
 * as query parameters, or JSON `{model, audio: <base64>, busy_timeout_ms?, options?}`. With
 * `Accept: text/event-stream` the answer is server-sent events (`progress {processed_ms,
 * audio_duration_ms}` at most every 100 ms, then `result`, or `error {error}`).
 *
 * A `tensor` model's request is JSON `{model, inputs: {name: {dtype, shape, data}}, outputs?,
 * busy_timeout_ms?}`, or the same as a msgpack map (`Content-Type: application/msgpack`, `data` as
 * raw little-endian bytes); the answer is msgpack when the request was, or when `Accept` names
 * msgpack. Its tensors are read by the exchange (actors/http.ts), not here.
 * @throws VoxError `invalid_request_error` naming the field or query parameter;
 *   `unsupported_media_type` for a `Content-Type` that is neither JSON, msgpack nor audio.
 */
export function parseRunRequest(req: IncomingMessage, url: URL, body: Buffer, t0: number): TaskRequest {
  const request = parseRunBody(req, url, body, t0);
  // Opt-in progress: a client that accepts server-sent events gets `progress` events, then `result`.
  return !request.tensor && /(^|,)\s*text\/event-stream\s*(;|,|$)/i.test(req.headers.accept ?? '')
    ? { ...request, progress: true }
    : request;
}

/**
 * Parses `POST /v1/tasks/run` as a multipart form (`curl -F file=@x.wav -F model=silero-vad`, or
 * `?model=` in the query): one file part (any field name) is the audio, the text parts are the
 * fields a raw-body run takes in its query (`model`, `busy_timeout_ms`, task options). The form is
 * read by Node's own parser (undici's `Response.formData()`), from the body already read under
 * `limits.max_body_bytes`.
 * @throws VoxError `invalid_multipart` for a body that is not a readable form, `invalid_field`
 *   `file` for a form without exactly one file, and what {@link parseRunRequest} throws.
 */
export async function parseMultipartRun(
  req: IncomingMessage,
  url: URL,
  body: Buffer,
  t0: number,
): Promise<TaskRequest> {
  let form: FormData;
  try {
    form = await new Response(new Uint8Array(body.buffer, body.byteOffset, body.length) as Uint8Array<ArrayBuffer>, {
      headers: { 'content-type': req.headers['content-type'] ?? '' },
    }).formData();
  } catch (e) {
    throw voxError('invalid_multipart', { problem: (e as Error).message });
  }
  const entries = [...form.entries()];
  const files = entries.filter((e): e is [string, File] => typeof e[1] !== 'string');
  if (files.length !== 1)
    throw invalid(
      'file',
      files.length
        ? `one file per request, got ${files.length}; several files go to POST /v1/tasks/batch`
        : 'a multipart upload needs one file part (curl -F file=@x.wav)',
    );
  const query = new URLSearchParams(url.searchParams);
  for (const [name, value] of entries) {
    if (typeof value !== 'string') continue;
    if (query.has(name)) throw invalid(name, 'given twice (in the query string and in the form)');
    query.append(name, value);
  }
  const file = files[0][1];
  const options = queryOptions(query, RUN_QUERY);
  const model = query.get('model');
  if (!model) throw invalid('model', 'required: a form field (-F model=ID) or a query parameter (?model=ID)');
  const request: TaskRequest = {
    kind: 'run',
    model,
    files: [
      { bytes: Buffer.from(await file.arrayBuffer()), type: (file.type || 'application/octet-stream').toLowerCase() },
    ],
    busyTimeoutMs: parseTimeout(query.get('busy_timeout_ms') ?? undefined),
    options,
    sampleRate: parseSampleRate(query.get('sample_rate') ?? undefined),
    denoise: parseDenoise(query.get('denoise') ?? undefined),
    json: acceptsJson(req),
    t0,
  };
  return /(^|,)\s*text\/event-stream\s*(;|,|$)/i.test(req.headers.accept ?? '')
    ? { ...request, progress: true }
    : request;
}

/** Whether a request's `Accept` asks for msgpack. */
const acceptsMsgpack = (req: IncomingMessage): boolean =>
  MSGPACK_TYPES.some((t) => (req.headers.accept ?? '').toLowerCase().includes(t));

/**
 * A `tensor` request's body (JSON or msgpack, decoded): its fields checked; its tensors are carried
 * as decoded, for the exchange to read (actors/http.ts).
 */
function parseTensorBody(fields: Record<string, unknown>, binary: boolean, t0: number): TaskRequest {
  const unknown = Object.keys(fields).filter((k) => !TENSOR_FIELDS.includes(k));
  if (unknown.length)
    throw voxError('unknown_field', {
      field: unknown[0],
      problem: `unknown field; a tensor request takes ${TENSOR_FIELDS.join(', ')}`,
    });
  if (typeof fields.model !== 'string' || !fields.model) throw invalid('model', 'required, a model id string');
  return {
    kind: 'run',
    model: fields.model,
    files: [],
    busyTimeoutMs: parseTimeout(fields.busy_timeout_ms),
    tensor: { fields: { inputs: fields.inputs, outputs: fields.outputs }, binary },
    t0,
  };
}

function parseRunBody(req: IncomingMessage, url: URL, body: Buffer, t0: number): TaskRequest {
  requireRunMediaType(req);
  const type = mediaType(req);
  if (MSGPACK_TYPES.includes(type)) {
    noQuery(url);
    let value: unknown;
    try {
      value = unpack(body);
    } catch (e) {
      throw voxError('invalid_msgpack', { problem: `is not valid msgpack: ${(e as Error).message}` });
    }
    if (!value || typeof value !== 'object' || Array.isArray(value) || ArrayBuffer.isView(value))
      throw voxError('invalid_msgpack', { problem: 'must be a msgpack map {model, inputs, outputs?}' });
    return parseTensorBody(value as Record<string, unknown>, true, t0);
  }
  if (type === 'application/json') {
    noQuery(url);
    const json = parseJsonObject(body);
    if ('inputs' in json && !('audio' in json)) return parseTensorBody(json, acceptsMsgpack(req), t0);
    const unknown = Object.keys(json).filter((k) => !RUN_FIELDS.includes(k));
    if (unknown.length)
      throw voxError('unknown_field', {
        field: unknown[0],
        problem: `unknown field; expected ${RUN_FIELDS.join(', ')}`,
      });
    if (typeof json.model !== 'string' || !json.model) throw invalid('model', 'required, a model id string');
    return {
      kind: 'run',
      model: json.model,
      files: [parseBase64Audio(json.audio, 'audio')],
      busyTimeoutMs: parseTimeout(json.busy_timeout_ms),
      options: json.options,
      sampleRate: parseSampleRate(json.sample_rate),
      denoise: parseDenoise(json.denoise),
      json: acceptsJson(req),
      t0,
    };
  }
  const options = queryOptions(url.searchParams, RUN_QUERY);
  const model = url.searchParams.get('model');
  if (!model) throw invalid('model', 'required as a query parameter (?model=ID) with an audio body');
  return {
    kind: 'run',
    model,
    files: [{ bytes: body, type }],
    busyTimeoutMs: parseTimeout(url.searchParams.get('busy_timeout_ms') ?? undefined),
    options,
    sampleRate: parseSampleRate(url.searchParams.get('sample_rate') ?? undefined),
    denoise: parseDenoise(url.searchParams.get('denoise') ?? undefined),
    json: acceptsJson(req),
    t0,
  };
}

/** Files in one `POST /v1/tasks/batch`. */
export const MAX_BATCH_FILES = 256;

/**
 * Parses `POST /v1/tasks/batch`: JSON `{model, files: [<base64 audio>...], options?, busy_timeout_ms?}`.
 * One lease for the whole batch; each result is streamed as a server-sent event as soon as it is
 * ready (`event: result`, data `{index, model, task, ..., timing}`; a bad file gives `event: error`,
 * data `{index, error}`), then `event: done` with `{files, failed, wall_ms}`.
 * @throws VoxError `invalid_request_error` naming the field.
 */
export function parseBatchRequest(url: URL, body: Buffer, t0: number): TaskRequest {
  noQuery(url);
  const json = parseJsonObject(body);
  const unknown = Object.keys(json).filter((k) => !BATCH_FIELDS.includes(k));
  if (unknown.length)
    throw voxError('unknown_field', {
      field: unknown[0],
      problem: `unknown field; expected ${BATCH_FIELDS.join(', ')}`,
    });
  if (typeof json.model !== 'string' || !json.model) throw invalid('model', 'required, a model id string');
  const files = json.files;
  if (!Array.isArray(files) || files.length === 0 || files.length > MAX_BATCH_FILES)
    throw invalid('files', `required, an array of 1-${MAX_BATCH_FILES} base64-encoded audio files`);
  return {
    kind: 'batch',
    model: json.model,
    files: files.map((f, i) => parseBase64Audio(f, `files.${i}`)),
    busyTimeoutMs: parseTimeout(json.busy_timeout_ms),
    options: json.options,
    denoise: parseDenoise(json.denoise),
    t0,
  };
}

/** One connection's HTTP socket actor and the responses it writes to, by request number. */
export interface HttpLink {
  readonly actor: HttpSocket;
  /**
   * Registers a request's response with the actor (`safe`: a GET, HEAD, OPTIONS or TRACE).
   * @returns its number, and `started`: true once the actor lets it be handled (its turn among the
   *   connection's pipelined requests), false if its response closed first (the peer went away).
   */
  begin(res: ServerResponse, safe: boolean): { rid: number; started: Promise<boolean> };
  /** Sends the actor an event if it still runs. */
  tell(e: HttpInput): void;
}

/**
 * Binds a TCP connection to its HTTP socket actor: each request is announced (`REQUEST_STARTED`)
 * and its response's close reported (`RESPONSE_CLOSED`); what the actor emits is written to the
 * response it names (JSON, server-sent events, errors with Retry-After on 503s), and `close` ends
 * the connection. Starts the actor.
 */
export function bindHttp(socket: { end(): void; destroyed: boolean }, actor: HttpSocket): HttpLink {
  const responses = new Map<number, ServerResponse>();
  /** Requests waiting for their `start`, by number. */
  const starts = new Map<number, (started: boolean) => void>();
  let seq = 0;
  const tell = (e: HttpInput): void => {
    if (actor.getSnapshot().status === 'active') actor.send(e);
  };
  actor.on('*', (o: HttpOutput) => {
    if (o.type === 'close') return void (socket.destroyed || socket.end());
    if (o.type === 'start') {
      starts.get(o.rid)?.(true);
      return void starts.delete(o.rid);
    }
    const res = responses.get(o.rid);
    if (!res || res.writableEnded) return;
    // The last response of a draining connection says so: the peer opens a new connection next time.
    if (!res.headersSent && actor.getSnapshot().matches('draining')) res.shouldKeepAlive = false;
    switch (o.type) {
      case 'respond':
        if (o.wav) return sendWav(res, o.status, o.body as Buffer);
        if (o.inferenceHeaderLength !== undefined)
          return sendInferenceBinary(res, o.status, o.body as Buffer, o.inferenceHeaderLength);
        return o.msgpack ? sendMsgpack(res, o.status, o.body) : sendJson(res, o.status, o.body);
      case 'fail':
        if (res.headersSent) return void res.destroy();
        return sendJson(
          res,
          o.error.status,
          errorBodyFor(res, o.error.body),
          o.error.retryAfterS !== undefined ? { 'retry-after': String(o.error.retryAfterS) } : {},
        );
      case 'sse-start':
        return void res.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-store' });
      case 'sse-event':
        return void res.write(`event: ${o.name}\ndata: ${JSON.stringify(o.data)}\n\n`);
      case 'sse-end':
        return void res.end(o.error ? `event: error\ndata: ${JSON.stringify(o.error)}\n\n` : undefined);
    }
  });
  actor.subscribe({ error: () => {} });
  actor.start();
  return {
    actor,
    tell,
    begin(res, safe) {
      const rid = ++seq;
      responses.set(rid, res);
      const started = new Promise<boolean>((resolve) => starts.set(rid, resolve));
      tell({ type: 'REQUEST_STARTED', rid, safe });
      res.on('close', () => {
        responses.delete(rid);
        starts.get(rid)?.(false);
        starts.delete(rid);
        tell({ type: 'RESPONSE_CLOSED', rid });
      });
      return { rid, started };
    },
  };
}
