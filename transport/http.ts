import type { IncomingMessage, ServerResponse } from 'node:http';
import type { Supervisor } from '../actors/supervisor.js';
import { decodeWav, resample } from '../runtime/audio.js';
import type { ServerConfig } from '../runtime/config.js';
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

/** Parses a JSON object body. @throws VoxError `invalid_request_error`. */
export function parseJsonObject(body: Buffer): Record<string, unknown> {
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
  if (typeof n !== 'number' || !Number.isInteger(n) || n < 0) throw invalid(`busy_timeout_ms: must be a non-negative integer, got ${JSON.stringify(v)}`);
  return n;
}

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
export async function handleRun(supervisor: Supervisor, config: ServerConfig, req: IncomingMessage, res: ServerResponse, url: URL): Promise<void> {
  const t0 = performance.now();
  const m = { model: undefined as string | undefined, queueMs: 0, inferenceMs: 0 };
  let outcome = 'ok';
  try {
    await runTask(supervisor, config, req, res, url, t0, m);
  } catch (e) {
    outcome = e instanceof DOMException && e.name === 'AbortError' ? 'cancelled' : toVoxError(e).type;
    throw e;
  } finally {
    if (m.model) supervisor.metrics.requests.inc({ model: m.model, outcome });
    supervisor.log.info({ route: 'run', model: m.model, outcome, queue_ms: round(m.queueMs), inference_ms: round(m.inferenceMs), wall_ms: round(performance.now() - t0) }, 'request');
  }
}

async function runTask(
  supervisor: Supervisor,
  config: ServerConfig,
  req: IncomingMessage,
  res: ServerResponse,
  url: URL,
  t0: number,
  m: { model?: string; queueMs: number; inferenceMs: number },
): Promise<void> {
  const body = await readBody(req, config.limits.max_body_bytes, config.limits.idle_ms);
  const run = parseRunRequest(req, url, body);
  const entry = supervisor.require(run.model);
  m.model = entry.id;
  const gone = new AbortController();
  let revoked: Error | null = null;
  res.on('close', () => {
    if (!res.writableFinished) gone.abort();
  });
  const lease = await entry.admit({
    requestTimeoutMs: run.busyTimeoutMs,
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
  if (res.closed) return done();
  res.on('close', done);
  let session;
  try {
    const audio = decodeWav(run.wav);
    const samples = await resample(audio.samples, audio.sampleRate);
    const { pool } = await entry.ensureReady(gone.signal);
    session = createTaskSession(entry.config, pool.info, run.options);
    session.push(samples);
    session.end();
    const runJob = async (job: Job): Promise<JobResult> => {
      if (gone.signal.aborted) throw gone.signal.reason;
      const r = await pool.run(job, gone.signal);
      if (r.ran) m.inferenceMs += r.ran[1] - r.ran[0];
      return r;
    };
    await drain(session, runJob, () => {}, FILE_JOB_STEPS);
  } catch (e) {
    if (revoked) throw revoked;
    throw e;
  }
  const audioMs = (session.receivedSamples * 1000) / 16_000;
  const wallMs = performance.now() - t0;
  sendJson(res, 200, {
    model: entry.id,
    ...taskResult(session),
    timing: { wall_ms: round(wallMs), queue_ms: round(m.queueMs), audio_duration_ms: round(audioMs), rtf: Math.round((wallMs / audioMs) * 10_000) / 10_000 },
  });
}

const round = (ms: number): number => Math.round(ms * 10) / 10;
