import type { IncomingMessage, ServerResponse } from 'node:http';
import type { ModelEntry } from '../actors/model.js';
import type { Supervisor } from '../actors/supervisor.js';
import { decodeWav, resample } from '../runtime/audio.js';
import { MAX_TIMEOUT_MS, type ModelConfig, type ServerConfig } from '../runtime/config.js';
import type { SlotPool } from '../runtime/slots.js';
import { errorBody, invalid, toVoxError, VoxError } from '../runtime/errors.js';
import type { Job, JobResult } from '../runtime/slot-protocol.js';
import { createTaskSession, drain, taskResult } from '../runtime/tasks/index.js';

/** Windows (VAD, 32 ms) or steps (wake word, 80 ms) per slot job for a file: ~2-5 s of audio, so streams interleave. */
const FILE_JOB_STEPS = 64;

/** Writes a JSON response. */
export function sendJson(res: ServerResponse, status: number, body: unknown, headers: Record<string, string> = {}): void {
  const text = JSON.stringify(body);
  res.writeHead(status, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(text), ...headers });
  res.end(text);
}

/** Writes a VoxError (or any error, as `server_error`) in the wire format, with Retry-After on 503s. */
export function sendError(res: ServerResponse, err: unknown): void {
  const e = toVoxError(err);
  if (res.headersSent) {
    res.destroy();
    return;
  }
  const headers: Record<string, string> = e.status === 503 ? { 'retry-after': String(e.retryAfterS ?? 1) } : {};
  sendJson(res, e.status, errorBody(e), headers);
}

/**
 * Reads a request body of at most `limit` bytes, with no gap between chunks over `idleMs`.
 * @throws VoxError `payload_too_large` past the limit; `invalid_request_error` when the body
 *   stalls (the rest is not read either way).
 */
export function readBody(req: IncomingMessage, limit: number, idleMs: number): Promise<Buffer> {
  const declared = Number(req.headers['content-length']);
  if (declared > limit) return Promise.reject(new VoxError('payload_too_large', `body of ${declared} bytes exceeds limits.max_body_bytes (${limit})`));
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = [];
    let size = 0;
    let timer: NodeJS.Timeout | null = null;
    const arm = (): void => {
      if (timer) clearTimeout(timer);
      if (idleMs > 0) timer = setTimeout(() => fail(new VoxError('invalid_request_error', `request body stalled: no data for limits.idle_ms (${idleMs} ms)`)), idleMs);
    };
    const cleanup = (): void => {
      if (timer) clearTimeout(timer);
      req.off('data', onData).off('end', onEnd).off('error', fail).off('close', onClose);
    };
    const fail = (e: Error): void => {
      cleanup();
      reject(e);
    };
    const onData = (chunk: Buffer): void => {
      size += chunk.length;
      if (size > limit) return fail(new VoxError('payload_too_large', `body exceeds limits.max_body_bytes (${limit})`));
      chunks.push(chunk);
      arm();
    };
    const onEnd = (): void => {
      cleanup();
      resolve(Buffer.concat(chunks));
    };
    const onClose = (): void => fail(new DOMException('the client went away', 'AbortError'));
    req.on('data', onData).on('end', onEnd).on('error', fail).on('close', onClose);
    arm();
  });
}

/** Parses a JSON object body; an empty body is `{}`. @throws VoxError `invalid_request_error`. */
export function parseJsonObject(body: Buffer): Record<string, unknown> {
  if (body.length === 0) return {};
  let v: unknown;
  try {
    v = JSON.parse(body.toString('utf8'));
  } catch (e) {
    throw invalid(`body is not valid JSON: ${(e as Error).message}`);
  }
  if (!v || typeof v !== 'object' || Array.isArray(v)) throw invalid('body must be a JSON object');
  return v as Record<string, unknown>;
}

function parseTimeout(v: unknown): number | undefined {
  if (v === undefined || v === null || v === '') return undefined;
  const n = typeof v === 'string' ? Number(v) : v;
  if (typeof n !== 'number' || !Number.isInteger(n) || n < 0 || n > MAX_TIMEOUT_MS || (typeof v === 'string' && !/^\d+$/.test(v))) {
    throw invalid(`busy_timeout_ms: must be an integer from 0 to ${MAX_TIMEOUT_MS}, got ${JSON.stringify(v)}`);
  }
  return n;
}

const RUN_FIELDS = ['model', 'audio', 'busy_timeout_ms', 'options'];

interface RunRequest {
  model: string;
  wav: Buffer;
  busyTimeoutMs?: number;
  options?: unknown;
}

function parseRunRequest(req: IncomingMessage, url: URL, body: Buffer): RunRequest {
  const type = (req.headers['content-type'] ?? '').split(';')[0].trim().toLowerCase();
  if (type === 'application/json') {
    const json = parseJsonObject(body);
    const unknown = Object.keys(json).filter((k) => !RUN_FIELDS.includes(k));
    if (unknown.length) throw invalid(`${unknown[0]}: unknown field; expected ${RUN_FIELDS.join(', ')}`);
    if (typeof json.model !== 'string' || !json.model) throw invalid('model: required, a model id string');
    if (typeof json.audio !== 'string' || !json.audio) throw invalid('audio: required, a base64-encoded WAV file');
    if (!/^[A-Za-z0-9+/]*={0,2}$/.test(json.audio.replace(/\s/g, ''))) throw invalid('audio: not valid base64');
    return { model: json.model, wav: Buffer.from(json.audio, 'base64'), busyTimeoutMs: parseTimeout(json.busy_timeout_ms), options: json.options };
  }
  if (type === 'audio/wav' || type === 'audio/x-wav' || type === 'audio/wave' || type === 'application/octet-stream') {
    const model = url.searchParams.get('model');
    if (!model) throw invalid('model: required as a query parameter (?model=ID) with a WAV body');
    return { model, wav: body, busyTimeoutMs: parseTimeout(url.searchParams.get('busy_timeout_ms') ?? undefined) };
  }
  throw invalid(`content-type: expected audio/wav (with ?model=ID) or application/json, got '${type || 'none'}'`);
}

/**
 * `POST /v1/tasks/run`: one WAV in, one result out. The lease is taken before the audio is
 * decoded and released once the response is written, or when the client goes away (then
 * pending inference is dropped and the result discarded). Logs one line per request and
 * counts it in `voxserve_requests_total` by outcome.
 */
export function handleRun(supervisor: Supervisor, config: ServerConfig, req: IncomingMessage, res: ServerResponse, url: URL): Promise<void> {
  return tracked(supervisor, 'run', (t0, m) => runTask(supervisor, config, req, res, url, t0, m));
}

interface RequestFigures {
  model?: string;
  queueMs: number;
  inferenceMs: number;
}

/** Runs a task request, then logs one line and counts it in `voxserve_requests_total` by outcome. */
async function tracked(supervisor: Supervisor, route: string, fn: (t0: number, m: RequestFigures) => Promise<void>): Promise<void> {
  const t0 = performance.now();
  const m: RequestFigures = { queueMs: 0, inferenceMs: 0 };
  let outcome = 'ok';
  try {
    await fn(t0, m);
  } catch (e) {
    outcome = e instanceof DOMException && e.name === 'AbortError' ? 'cancelled' : toVoxError(e).type;
    throw e;
  } finally {
    if (m.model) supervisor.metrics.requests.inc({ model: m.model, outcome });
    supervisor.log.info({ route, model: m.model, outcome, queue_ms: round(m.queueMs), inference_ms: round(m.inferenceMs), wall_ms: round(performance.now() - t0) }, 'request');
  }
}

async function runTask(
  supervisor: Supervisor,
  config: ServerConfig,
  req: IncomingMessage,
  res: ServerResponse,
  url: URL,
  t0: number,
  m: RequestFigures,
): Promise<void> {
  const body = await readBody(req, config.limits.max_body_bytes, config.limits.idle_ms);
  const run = parseRunRequest(req, url, body);
  const entry = supervisor.require(run.model);
  m.model = entry.id;
  const admitted = await admitResponse(supervisor, entry, res, run.busyTimeoutMs, t0, m);
  if (!admitted) return;
  const { signal: gone, revoked } = admitted;
  let result;
  try {
    const { pool } = await entry.ensureReady(gone);
    result = await processFile(entry.config, pool, run.wav, run.options, gone, m);
  } catch (e) {
    throw revoked() ?? e;
  }
  const wallMs = performance.now() - t0;
  sendJson(res, 200, {
    model: entry.id,
    ...result.body,
    timing: { wall_ms: round(wallMs), queue_ms: round(m.queueMs), audio_duration_ms: round(result.audioMs), rtf: Math.round((wallMs / result.audioMs) * 10_000) / 10_000 },
  });
}

/**
 * Admits an HTTP request to `entry` (FIFO, busy timeout) and ties the lease to the response:
 * it is released when the response has closed. The returned signal aborts when the client goes
 * away or the lease is revoked (forced unload, shutdown); `revoked()` then gives the reason.
 * @returns null when the client went away before the lease was granted.
 * @throws what {@link ModelEntry.admit} throws.
 */
async function admitResponse(
  supervisor: Supervisor,
  entry: ModelEntry,
  res: ServerResponse,
  requestTimeoutMs: number | undefined,
  t0: number,
  m: RequestFigures,
): Promise<{ signal: AbortSignal; revoked: () => Error | null } | null> {
  const gone = new AbortController();
  let revoked: Error | null = null;
  res.on('close', () => {
    if (!res.writableFinished) gone.abort();
  });
  const lease = await entry.admit({
    requestTimeoutMs,
    signal: gone.signal,
    onRevoke: (reason) => {
      revoked = reason;
      gone.abort();
    },
  });
  m.queueMs = performance.now() - t0;
  supervisor.metrics.queueWait.observe({ model: entry.id }, m.queueMs / 1000);
  const done = (): void => {
    entry.touch();
    lease.release();
  };
  if (res.closed) {
    done();
    return null;
  }
  res.on('close', done);
  return { signal: gone.signal, revoked: () => revoked };
}

/**
 * Decodes one WAV file and runs it through the model's slots, in jobs of {@link FILE_JOB_STEPS}.
 * @returns the task result (segments or detections) and the audio duration, ms.
 * @throws VoxError `invalid_request_error` for bad audio or options; the signal's reason once it aborts.
 */
async function processFile(
  config: ModelConfig,
  pool: SlotPool,
  wav: Buffer,
  options: unknown,
  signal: AbortSignal,
  m: { inferenceMs: number },
): Promise<{ body: Record<string, unknown>; audioMs: number }> {
  const session = createTaskSession(config, pool.info, options);
  const audio = decodeWav(wav);
  session.push(await resample(audio.samples, audio.sampleRate));
  session.end();
  const runJob = async (job: Job): Promise<JobResult> => {
    signal.throwIfAborted();
    const r = await pool.run(job, signal);
    if (r.ran) m.inferenceMs += r.ran[1] - r.ran[0];
    return r;
  };
  await drain(session, runJob, () => {}, FILE_JOB_STEPS);
  return { body: taskResult(session), audioMs: (session.receivedSamples * 1000) / 16_000 };
}

/** Files in one `POST /v1/tasks/batch`. */
export const MAX_BATCH_FILES = 256;

/**
 * `POST /v1/tasks/batch`: JSON `{model, files: [<base64 WAV>...], options?, busy_timeout_ms?}`.
 * One lease for the whole batch; the files run concurrently through the model's slots and each
 * result is streamed as a server-sent event as soon as it is ready (`event: result`, data
 * `{index, model, task, ..., timing}`; a bad file gives `event: error`, data `{index, error}`),
 * then `event: done` with `{files, failed, wall_ms}`.
 */
export function handleBatch(supervisor: Supervisor, config: ServerConfig, req: IncomingMessage, res: ServerResponse): Promise<void> {
  return tracked(supervisor, 'batch', (t0, m) => runBatch(supervisor, config, req, res, t0, m));
}

async function runBatch(supervisor: Supervisor, config: ServerConfig, req: IncomingMessage, res: ServerResponse, t0: number, m: RequestFigures): Promise<void> {
  const json = parseJsonObject(await readBody(req, config.limits.max_body_bytes, config.limits.idle_ms));
  if (typeof json.model !== 'string' || !json.model) throw invalid('model: required, a model id string');
  const files = json.files;
  if (!Array.isArray(files) || files.length === 0 || files.length > MAX_BATCH_FILES) throw invalid(`files: required, an array of 1-${MAX_BATCH_FILES} base64-encoded WAV files`);
  const bad = files.findIndex((f) => typeof f !== 'string' || !/^[A-Za-z0-9+/]*={0,2}$/.test(f.replace(/\s/g, '')));
  if (bad >= 0) throw invalid(`files.${bad}: not a base64 string`);
  const entry = supervisor.require(json.model);
  m.model = entry.id;
  const admitted = await admitResponse(supervisor, entry, res, parseTimeout(json.busy_timeout_ms), t0, m);
  if (!admitted) return;
  const { signal: gone, revoked } = admitted;
  const { pool } = await entry.ensureReady(gone).catch((e) => {
    throw revoked() ?? e;
  });
  res.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-store' });
  const event = (name: string, data: unknown): void => void res.write(`event: ${name}\ndata: ${JSON.stringify(data)}\n\n`);
  let failed = 0;
  await Promise.all(
    (files as string[]).map(async (b64, index) => {
      const f0 = performance.now();
      try {
        const r = await processFile(entry.config, pool, Buffer.from(b64, 'base64'), json.options, gone, m);
        const wallMs = performance.now() - f0;
        const timing = { wall_ms: round(wallMs), queue_ms: round(m.queueMs), audio_duration_ms: round(r.audioMs), rtf: Math.round((wallMs / r.audioMs) * 10_000) / 10_000 };
        event('result', { index, model: entry.id, ...r.body, timing });
      } catch (e) {
        failed++;
        if (!gone.aborted) event('error', { index, ...errorBody(toVoxError(e)) });
      }
    }),
  );
  const why = revoked();
  if (gone.aborted) return void res.end(why ? `event: error\ndata: ${JSON.stringify(errorBody(toVoxError(why)))}\n\n` : undefined);
  event('done', { files: files.length, failed, wall_ms: round(performance.now() - t0), queue_ms: round(m.queueMs), inference_ms: round(m.inferenceMs) });
  res.end();
}

const round = (ms: number): number => Math.round(ms * 10) / 10;
