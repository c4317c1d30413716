import {
  and,
  assign,
  createActor,
  emit,
  enqueueActions,
  fromCallback,
  setup,
  stopChild,
  type Actor,
  type InspectionEvent,
} from 'xstate';
import { effectiveTimeout } from '../runtime/admission.js';
import { resample } from '../runtime/audio/audio.js';
import { decodeAudio, decodeAudioAt } from '../runtime/audio/decode.js';
import { RNNOISE } from '../runtime/slots/rnnoise.js';
import type { Limits } from '../runtime/config.js';
import { errorBody, invalid, toVoxError, type VoxError } from '../runtime/errors.js';
import { type BinaryOutputs, v2InferResponse } from '../runtime/oip.js';
import type { Job, JobResult, TensorResult } from '../runtime/slots/slot-protocol.js';
import {
  createTaskSession,
  type DenoiseSession,
  drain,
  wavBytes,
  taskResult,
  readTensorRequest,
  tensorJob,
  tensorOutputs,
  type TensorRequest,
} from '../runtime/tasks/index.js';
import { leaseGranted, type Granted, type LeaseHandle } from './lease.js';
import type { Supervisor } from './supervisor.js';

/** Windows (VAD, 32 ms) or steps (wake word, 80 ms) per slot job for a file: ~2-5 s of audio, so streams interleave. */
const FILE_JOB_STEPS = 64;
/** Frames (denoise, 10 ms) per slot job for a file: 2 s of audio. */
const FILE_JOB_FRAMES = 200;

/** One audio file of a task request, with its declared media type (Content-Type or `data:` prefix) if any. */
export interface AudioFile {
  bytes: Buffer;
  type?: string;
}

/** One task request on HTTP, parsed by the transport: `POST /v1/tasks/run` (one file) or `/v1/tasks/batch`. */
export interface TaskRequest {
  kind: 'run' | 'batch';
  model: string;
  /** Audio files (one for `run`). */
  files: AudioFile[];
  /** The request's own busy timeout, ms. */
  busyTimeoutMs?: number;
  /** Task options (`threshold`, ...), validated against the model's task. */
  options?: unknown;
  /**
   * `run` to a `tensor` model (then `files` is empty): its body's `inputs` and `outputs` as decoded
   * (JSON or msgpack), read into tensors by the exchange; `binary`: answer in msgpack.
   */
  tensor?: { fields: { inputs?: unknown; outputs?: unknown }; binary: boolean };
  /**
   * A tensor `run` that came by the Open Inference Protocol (`POST /v2/models/{id}/infer`): its
   * answer is the protocol's `$inference_response` (runtime/oip.ts), `id` echoed, the outputs in
   * `binary` as binary tensor data after the JSON.
   */
  v2?: { id?: string; binary: BinaryOutputs };
  /**
   * `run` only: answer with server-sent events, `progress` while the file is processed, then `result` (the client sent
   * `Accept: text/event-stream`).
   */
  progress?: boolean;
  /** When the request arrived, `performance.now()` ms. */
  t0: number;
  /** A chain (`denoise=rnnoise` on a VAD or wake-word request): the denoise model the audio goes through first. */
  denoise?: string;
  /** A denoise answer's sample rate, Hz (`sample_rate=`); absent: the input's. */
  sampleRate?: number;
  /**
   * The client asked for JSON (`Accept: application/json`): a denoise answer is then its per-frame speech probabilities
   * and timing, not audio.
   */
  json?: boolean;
}

/** A response error as the transport writes it. */
export interface ResponseError {
  status: number;
  body: { error: { type: string; message: string } };
  retryAfterS?: number;
}

/** What an exchange (one request) tells its socket actor; the socket actor emits it as {@link HttpOutput}. */
type ExchangeEvent =
  /** The whole response (`run`): JSON, or msgpack (a tensor request that asked for it). */
  /**
   * `wav`: the body is a WAV file (a denoise answer), a Buffer. `inferenceHeaderLength`: the body is
   * a Buffer, an Open Inference Protocol answer with binary tensor data: JSON of this many bytes, then the data.
   */
  | {
      type: 'RESPONSE';
      rid: number;
      status: number;
      body: unknown;
      msgpack?: boolean;
      wav?: boolean;
      inferenceHeaderLength?: number;
    }
  /** Server-sent events (`batch`): headers, then each event, then the end. */
  | { type: 'SSE_START'; rid: number }
  | { type: 'SSE_EVENT'; rid: number; name: string; data: unknown }
  | { type: 'SSE_END'; rid: number; error?: ResponseError['body'] }
  | { type: 'FAILED'; rid: number; error: ResponseError };

/** Events the transport sends an HTTP socket actor. */
export type HttpInput =
  /**
   * A request arrived (`rid` numbers the requests of the connection, in order): the connection is
   * busy until its response closes. `safe`: its method is GET, HEAD, OPTIONS or TRACE. It may be
   * handled once the actor emits `start` for it (pipelining, {@link httpSocketMachine}).
   */
  | { type: 'REQUEST_STARTED'; rid: number; safe: boolean }
  /** A started request is a task request, parsed: an exchange runs it. */
  | { type: 'TASK'; rid: number; request: TaskRequest }
  /** The response to `rid` is fully written, or its client went away: its lease is released. */
  | { type: 'RESPONSE_CLOSED'; rid: number }
  | { type: 'PEER_CLOSED' }
  /** The connection was upgraded to a WebSocket: a stream socket actor owns it now. */
  | { type: 'UPGRADED' }
  /** Shutdown phase 2 (the root's `drain`). */
  | { type: 'DRAIN' };

/** What an HTTP socket actor emits for the transport to write. */
export type HttpOutput =
  /** Request `rid` may be handled now (its turn among the pipelined requests of the connection). */
  | { type: 'start'; rid: number }
  | {
      type: 'respond';
      rid: number;
      status: number;
      body: unknown;
      msgpack?: boolean;
      wav?: boolean;
      inferenceHeaderLength?: number;
    }
  | { type: 'sse-start'; rid: number }
  | { type: 'sse-event'; rid: number; name: string; data: unknown }
  | { type: 'sse-end'; rid: number; error?: ResponseError['body'] }
  | { type: 'fail'; rid: number; error: ResponseError }
  /** Close the connection once what is in flight is written (keep-alive deadline, drain). */
  | { type: 'close' };

const round = (ms: number): number => Math.round(ms * 10) / 10;

function responseError(e: unknown): ResponseError {
  const err: VoxError = toVoxError(e);
  return {
    status: err.status,
    body: errorBody(err),
    retryAfterS: err.status === 503 ? (err.retryAfterS ?? 1) : undefined,
  };
}

/** `work`, or the signal's reason as soon as it aborts. */
function untilAborted<T>(work: Promise<T>, signal: AbortSignal): Promise<T> {
  return new Promise<T>((resolve, reject) => {
    const onAbort = (): void => reject(signal.reason);
    signal.addEventListener('abort', onAbort, { once: true });
    work.then(resolve, reject).finally(() => signal.removeEventListener('abort', onAbort));
  });
}

/** Least time between two `progress` events of one request, ms. */
const PROGRESS_INTERVAL_MS = 100;

/**
 * Decodes one audio file (in a decode worker) and runs it through the model's slots, in jobs of
 * {@link FILE_JOB_STEPS}. `progress` is called with the audio processed so far and the file's
 * duration (ms of 16 kHz audio): once decoded (0), after each job, and at the end.
 * @returns the task result (segments or detections) and the audio duration, ms.
 * @throws VoxError `invalid_request_error` for bad audio or options; the signal's reason once it aborts.
 */
async function processFile(
  granted: Granted,
  file: AudioFile,
  options: unknown,
  signal: AbortSignal,
  m: { queueMs: number; inferenceMs: number },
  waitMs: number,
  progress: (processedMs: number, audioMs: number) => void = () => {},
  denoise?: Granted,
): Promise<{ body: Record<string, unknown>; audioMs: number }> {
  const session = createTaskSession(granted.config, granted.info, options, true);
  session.push(
    denoise
      ? await denoisedAt16k(denoise, file, signal, m, waitMs)
      : await untilAborted(decodeAudio(file.bytes, file.type), signal),
  );
  session.end();
  const audioMs = (session.receivedSamples * 1000) / 16_000;
  const processedMs = (): number => Math.min(audioMs, (session.processedSamples * 1000) / 16_000);
  progress(0, audioMs);
  const runJob = async (job: Job): Promise<JobResult> => {
    signal.throwIfAborted();
    // A revoked or abandoned request answers at once; a job already running finishes (or is killed) without it.
    const r = await untilAborted(granted.run(job, waitMs), signal);
    if (r.ran) m.inferenceMs += r.ran[1] - r.ran[0];
    m.queueMs += r.waitedMs ?? 0;
    return r;
  };
  await drain(
    session,
    runJob,
    () => {},
    FILE_JOB_STEPS,
    () => progress(processedMs(), audioMs),
  );
  return { body: taskResult(session), audioMs };
}

/**
 * `run` of one file on a denoise model: decoded to 48 kHz mono (in a decode worker), denoised in
 * the slots in jobs of {@link FILE_JOB_FRAMES}, and answered as a 16-bit mono WAV at the input's
 * rate (or `sample_rate`), or, with `Accept: application/json`, as RNNoise's per-frame speech
 * probabilities and timing.
 */
async function answerDenoise(x: ExchangeRun, w: Work): Promise<void> {
  const { request } = x;
  const { granted, signal } = w;
  const session = createTaskSession(granted.config, granted.info, request.options, true) as DenoiseSession;
  const file = request.files[0];
  const decoded = await untilAborted(decodeAudioAt(file.bytes, file.type, RNNOISE.RATE), signal);
  session.push(decoded.samples);
  session.end();
  const runJob = async (job: Job): Promise<JobResult> => {
    signal.throwIfAborted();
    const r = await untilAborted(granted.run(job, w.waitMs), signal);
    if (r.ran) x.figures.inferenceMs += r.ran[1] - r.ran[0];
    x.figures.queueMs += r.waitedMs ?? 0;
    return r;
  };
  await drain(session, runJob, () => {}, FILE_JOB_FRAMES);
  const audioMs = (session.receivedSamples * 1000) / RNNOISE.RATE;
  if (request.json)
    return x.send({
      type: 'RESPONSE',
      rid: x.rid,
      status: 200,
      body: { model: granted.model, ...taskResult(session), timing: fileTiming(x, request.t0, audioMs) },
    });
  const rate = request.sampleRate ?? decoded.sourceRate;
  const out = await resample(session.takeOutput(), RNNOISE.RATE, rate);
  signal.throwIfAborted();
  x.send({ type: 'RESPONSE', rid: x.rid, status: 200, body: wavBytes(out, rate), wav: true });
}

/**
 * The first link of a chain: `file` decoded to 48 kHz, denoised on the denoise model's slots
 * (its own lease, `denoise`), and resampled to the 16 kHz the next model takes.
 */
async function denoisedAt16k(
  denoise: Granted,
  file: AudioFile,
  signal: AbortSignal,
  m: { queueMs: number; inferenceMs: number },
  waitMs: number,
): Promise<Float32Array> {
  const session = createTaskSession(denoise.config, denoise.info, undefined, false) as DenoiseSession;
  const decoded = await untilAborted(decodeAudioAt(file.bytes, file.type, RNNOISE.RATE), signal);
  session.push(decoded.samples);
  session.end();
  const parts: Float32Array[] = [];
  await drain(
    session,
    async (job) => {
      signal.throwIfAborted();
      const r = await untilAborted(denoise.run(job, waitMs), signal);
      if (r.ran) m.inferenceMs += r.ran[1] - r.ran[0];
      m.queueMs += r.waitedMs ?? 0;
      return r;
    },
    () => {},
    FILE_JOB_FRAMES,
    () => parts.push(session.takeOutput()),
  );
  const all = new Float32Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) {
    all.set(p, at);
    at += p.length;
  }
  return resample(all, RNNOISE.RATE, 16_000);
}

/** One exchange in progress: what its pieces share, and what its log line reports. */
interface ExchangeRun {
  readonly rid: number;
  readonly request: TaskRequest;
  readonly send: (e: ExchangeEvent) => void;
  /** Time in queues (the lease, then slots) and in inference so far, ms. */
  readonly figures: { queueMs: number; inferenceMs: number };
  /** The model's id, once the request named a registered one. */
  model?: string;
  /** Why the lease was revoked (forced unload, shutdown), once it was. */
  revoked: Error | null;
  /** Server-sent events have started: an error is then the stream's last event. */
  sseStarted: boolean;
  /** `ok`, `cancelled` or the error type, for `voxserve_requests_total` and the log. */
  outcome: string;
}

/**
 * What a granted exchange runs its jobs with: the lease's grant and signal, and how long a job may wait for a slot, ms.
 */
interface Work {
  readonly granted: Granted;
  /** A chain's first link (`denoise=`): the denoise model's grant, under its own lease. */
  readonly denoise?: Granted;
  readonly signal: AbortSignal;
  readonly waitMs: number;
}

/** A file result's `timing`: wall time since `t0`, time queued, the audio's duration and the real-time factor. */
function fileTiming(x: ExchangeRun, t0: number, audioMs: number): Record<string, number> {
  const wallMs = performance.now() - t0;
  return {
    wall_ms: round(wallMs),
    queue_ms: round(x.figures.queueMs),
    audio_duration_ms: round(audioMs),
    rtf: Math.round((wallMs / audioMs) * 10_000) / 10_000,
  };
}

/** A tensor model's run: one job, checked against the model's own inputs first; answered as one response. */
async function answerTensor(x: ExchangeRun, w: Work, tensors: TensorRequest): Promise<void> {
  const { granted, signal } = w;
  const job = tensorJob(granted.config, granted.info, tensors);
  signal.throwIfAborted();
  const r = await untilAborted(granted.run(job, w.waitMs), signal);
  if (r.ran) x.figures.inferenceMs += r.ran[1] - r.ran[0];
  x.figures.queueMs += r.waitedMs ?? 0;
  if (x.request.v2) {
    const answer = v2InferResponse(
      granted.model,
      x.request.v2.id,
      (r as TensorResult).outputs,
      x.request.v2.binary,
      (outputs) => tensorOutputs({ kind: 'tensor', outputs }, false) as Record<string, { data: unknown }>,
    );
    return x.send(
      'json' in answer
        ? { type: 'RESPONSE', rid: x.rid, status: 200, body: answer.json }
        : { type: 'RESPONSE', rid: x.rid, status: 200, body: answer.body, inferenceHeaderLength: answer.headerLength },
    );
  }
  x.send({
    type: 'RESPONSE',
    rid: x.rid,
    status: 200,
    msgpack: tensors.binary,
    body: {
      model: granted.model,
      task: 'tensor',
      outputs: tensorOutputs(r as TensorResult, tensors.binary),
      timing: {
        wall_ms: round(performance.now() - x.request.t0),
        queue_ms: round(x.figures.queueMs),
        inference_ms: round(x.figures.inferenceMs),
      },
    },
  });
}

/** `run` of one file: its result as one response. */
async function answerFile(x: ExchangeRun, w: Work): Promise<void> {
  const { request } = x;
  const r = await processFile(
    w.granted,
    request.files[0],
    request.options,
    w.signal,
    x.figures,
    w.waitMs,
    undefined,
    w.denoise,
  );
  x.send({
    type: 'RESPONSE',
    rid: x.rid,
    status: 200,
    body: { model: w.granted.model, ...r.body, timing: fileTiming(x, request.t0, r.audioMs) },
  });
}

/**
 * `run` of one file with `Accept: text/event-stream`: server-sent events start once the file is
 * decoded (a bad file still gets its 400), then `progress` at most every {@link PROGRESS_INTERVAL_MS},
 * then `result`.
 */
async function streamFile(x: ExchangeRun, w: Work): Promise<void> {
  const { rid, request } = x;
  let last = -Infinity;
  const r = await processFile(
    w.granted,
    request.files[0],
    request.options,
    w.signal,
    x.figures,
    w.waitMs,
    (processed, total) => {
      if (!x.sseStarted) x.send({ type: 'SSE_START', rid });
      x.sseStarted = true;
      const now = performance.now();
      if (now - last < PROGRESS_INTERVAL_MS && processed < total) return;
      last = now;
      x.send({
        type: 'SSE_EVENT',
        rid,
        name: 'progress',
        data: { processed_ms: round(processed), audio_duration_ms: round(total) },
      });
    },
    w.denoise,
  );
  x.send({
    type: 'SSE_EVENT',
    rid,
    name: 'result',
    data: { model: w.granted.model, ...r.body, timing: fileTiming(x, request.t0, r.audioMs) },
  });
  x.send({ type: 'SSE_END', rid });
}

/**
 * `batch`: every file at once under the one lease, each result (or error) a server-sent event as
 * soon as it is ready, then `done`; a revoked or abandoned batch ends with the revocation's error.
 */
async function streamBatch(x: ExchangeRun, w: Work): Promise<void> {
  const { rid, request } = x;
  const { granted, signal } = w;
  x.send({ type: 'SSE_START', rid });
  x.sseStarted = true;
  let failed = 0;
  await Promise.all(
    request.files.map(async (file, index) => {
      const f0 = performance.now();
      try {
        const r = await processFile(granted, file, request.options, signal, x.figures, w.waitMs, undefined, w.denoise);
        x.send({
          type: 'SSE_EVENT',
          rid,
          name: 'result',
          data: { index, model: granted.model, ...r.body, timing: fileTiming(x, f0, r.audioMs) },
        });
      } catch (e) {
        failed++;
        if (!signal.aborted)
          x.send({ type: 'SSE_EVENT', rid, name: 'error', data: { index, ...errorBody(toVoxError(e)) } });
      }
    }),
  );
  if (signal.aborted) {
    x.outcome = x.revoked ? toVoxError(x.revoked).type : 'cancelled';
    return x.send({ type: 'SSE_END', rid, error: x.revoked ? errorBody(toVoxError(x.revoked)) : undefined });
  }
  x.send({
    type: 'SSE_EVENT',
    rid,
    name: 'done',
    data: {
      files: request.files.length,
      failed,
      wall_ms: round(performance.now() - request.t0),
      queue_ms: round(x.figures.queueMs),
      inference_ms: round(x.figures.inferenceMs),
    },
  });
  x.send({ type: 'SSE_END', rid });
}

/**
 * An exchange that failed: the error (the revocation's, if revoked) as its response, or as the last event once events
 * have started.
 */
function failExchange(x: ExchangeRun, e: unknown): void {
  const why = x.revoked ?? e;
  x.outcome = why instanceof DOMException && why.name === 'AbortError' ? 'cancelled' : toVoxError(why).type;
  x.send(
    x.sseStarted
      ? { type: 'SSE_END', rid: x.rid, error: responseError(why).body }
      : { type: 'FAILED', rid: x.rid, error: responseError(why) },
  );
}

/** Counts a finished exchange in `voxserve_requests_total` and logs its line. */
function logExchange(x: ExchangeRun, registry: Supervisor): void {
  const { model, outcome, figures } = x;
  if (model) registry.metrics.requests.inc({ model, outcome });
  registry.log.info(
    {
      route: x.request.kind,
      model,
      outcome,
      queue_ms: round(figures.queueMs),
      inference_ms: round(figures.inferenceMs),
      wall_ms: round(performance.now() - x.request.t0),
    },
    'request',
  );
}

/**
 * One task request's work (an exchange): it takes the lease before the audio is decoded (C1),
 * loads the model if needed, runs every file and reports the response as events. It holds the
 * lease until it is stopped (the socket actor stops it once the response is written or the
 * client went away, or when the connection closes): then pending inference is dropped and the
 * lease released. A lease revoked (forced unload, shutdown) answers with the revocation's error.
 * A tensor request's tensors are read here (400 before its model is looked up).
 * Logs one line per request and counts it in `voxserve_requests_total` by outcome.
 */
const exchange = fromCallback<
  { type: 'noop' },
  { rid: number; request: TaskRequest; registry: Supervisor; maxTensorBytes: number }
>(({ input: { rid, request, registry, maxTensorBytes }, sendBack }) => {
  const x: ExchangeRun = {
    rid,
    request,
    send: (e) => sendBack(e),
    figures: { queueMs: 0, inferenceMs: 0 },
    revoked: null,
    sseStarted: false,
    outcome: 'ok',
  };
  let lease: LeaseHandle | null = null;
  /** A chain's first link's lease (`denoise=`). */
  let denoiseLease: LeaseHandle | null = null;
  void (async () => {
    const tensors = request.tensor && readTensorRequest(request.tensor.fields, request.tensor.binary, maxTensorBytes);
    const entry = registry.requireForWork(request.model);
    x.model = entry.id;
    const asked = leaseGranted(
      entry,
      { requestTimeoutMs: request.busyTimeoutMs, metrics: registry.metrics, ordered: true },
      (e) => (x.revoked = e.error),
    );
    lease = asked.handle;
    const granted = await asked.granted;
    x.figures.queueMs = granted.queueMs;
    let denoise: Granted | undefined;
    if (request.denoise !== undefined) {
      if (granted.config.task !== 'vad' && granted.config.task !== 'wakeword')
        throw invalid(
          'denoise',
          `a chain starts a VAD or wake-word request; '${granted.model}' is a ${granted.config.task} model`,
        );
      // The chain's first link: an entry with its own lease, taken after the last link's (C1: before any input is
      // prepared).
      let link: ReturnType<typeof registry.require>;
      try {
        link = registry.require(request.denoise);
      } catch (e) {
        const v = toVoxError(e);
        if (v.status === 404) throw invalid('denoise', v.message);
        throw e;
      }
      const first = leaseGranted(
        link,
        { requestTimeoutMs: request.busyTimeoutMs, metrics: registry.metrics, ordered: true },
        (e) => (x.revoked = e.error),
      );
      denoiseLease = first.handle;
      denoise = await first.granted;
      if (denoise.config.task !== 'denoise')
        throw invalid('denoise', `'${denoise.model}' is a ${denoise.config.task} model, not a denoise model (rnnoise)`);
      x.figures.queueMs += denoise.queueMs;
    }
    // A job waits for a slot at most the request's busy timeout too (min of request, model, server).
    const w: Work = {
      granted,
      denoise,
      signal: denoiseLease ? AbortSignal.any([lease.signal, denoiseLease.signal]) : lease.signal,
      waitMs: effectiveTimeout(request.busyTimeoutMs, granted.busyTimeoutMs, 0),
    };
    if (tensors) return answerTensor(x, w, tensors);
    if (granted.config.task === 'denoise' && request.kind === 'run') return answerDenoise(x, w);
    if (granted.config.task === 'denoise')
      throw invalid(
        'model',
        `'${granted.model}' is a denoise model: it answers one file at a time (POST /v1/tasks/run)`,
      );
    if (request.sampleRate !== undefined)
      throw invalid(
        'sample_rate',
        `only a denoise model answers audio; '${granted.model}' is a ${granted.config.task} model`,
      );
    if (request.kind === 'batch') return streamBatch(x, w);
    return request.progress ? streamFile(x, w) : answerFile(x, w);
  })()
    .catch((e) => failExchange(x, e))
    .finally(() => logExchange(x, registry));
  return () => {
    denoiseLease?.release();
    lease?.release();
  };
});

/** What an HTTP socket actor is created with. */
export interface HttpSocketInput {
  limits: Limits;
  registry: Supervisor;
  /**
   * Bytes read from the connection so far (a request's headers still arriving count as activity); default: never
   * changes.
   */
  bytesRead?: () => number;
}

interface HttpContext {
  limits: Limits;
  registry: Supervisor;
  bytesRead: () => number;
  /**
   * Requests handled now on this connection (task exchanges and other routes), oldest first, and which of them are
   * unsafe.
   */
  active: number[];
  unsafe: number[];
  /** Requests that arrived (pipelined) and wait for their turn, oldest first. */
  waiting: { rid: number; safe: boolean }[];
  /** {@link HttpSocketInput.bytesRead} when the connection last went idle. */
  readMark: number;
}

/**
 * An HTTP socket actor (DESIGN.md section 2): one per accepted TCP connection, each its own root
 * actor sharing the server's inspector. `open` (keep-alive, no request in flight) <-> `streaming`
 * (requests in flight; each task request runs in an `exchange` child that holds its lease) ->
 * `draining` (the root's `drain`: in-flight responses finish, then the connection closes; an idle
 * connection lingers until the drain ends, answering what arrives) ->
 * `closed`. When the peer goes, every exchange is stopped: pending inference dropped, leases released.
 *
 * Pipelining (RFC 9112 section 9.3.2): requests of one connection are started (`start`) in
 * arrival order by `startWaiting`; safe ones (GET, HEAD, OPTIONS, TRACE) run together, an unsafe
 * one (POST: loads, unloads, tasks) starts only once every earlier one has finished, and nothing
 * after it starts before it has finished. So `load` then `unload` pipelined run in that order.
 *
 * Keep-alive: an idle connection is closed after `limits.idle_ms` (`after`) with no byte from the
 * peer; a next request whose headers are still arriving is not idle (`bytesArrived`): its
 * deadline is node's headers timeout (`limits.headers_timeout_ms`, answered 408).
 */
export const httpSocketMachine = setup({
  types: {
    context: {} as HttpContext,
    events: {} as HttpInput | ExchangeEvent,
    input: {} as HttpSocketInput,
    emitted: {} as HttpOutput,
  },
  actors: { exchange },
  guards: {
    busy: ({ context }) => context.active.length > 0 || context.waiting.length > 0,
    quiet: ({ context }) => context.active.length === 0 && context.waiting.length === 0,
    keepAliveOn: ({ context }) => context.limits.idle_ms > 0,
    /** Bytes came from the peer since the connection went idle: a request is on its way. */
    bytesArrived: ({ context }) => context.bytesRead() > context.readMark,
  },
  delays: { keepAlive: ({ context }) => context.limits.idle_ms },
  actions: {
    markRead: assign({ readMark: ({ context }) => context.bytesRead() }),
    /**
     * Starts waiting requests from the oldest while the pipelining rule allows: a safe one when no unsafe one runs, an
     * unsafe one when nothing runs.
     */
    startWaiting: enqueueActions(({ enqueue, context }) => {
      const active = [...context.active];
      const unsafe = [...context.unsafe];
      let n = 0;
      for (const w of context.waiting) {
        if (w.safe ? unsafe.length > 0 : active.length > 0) break;
        active.push(w.rid);
        if (!w.safe) unsafe.push(w.rid);
        enqueue.emit({ type: 'start', rid: w.rid } as HttpOutput);
        n++;
      }
      if (n) enqueue.assign({ active, unsafe, waiting: context.waiting.slice(n) });
    }),
    finished: enqueueActions(({ enqueue, context, event }) => {
      const rid = (event as { rid: number }).rid;
      if (context.waiting.some((w) => w.rid === rid))
        return void enqueue.assign({ waiting: context.waiting.filter((w) => w.rid !== rid) });
      if (!context.active.includes(rid)) return;
      enqueue(stopChild(`exchange:${rid}`));
      enqueue.assign({
        active: context.active.filter((r) => r !== rid),
        unsafe: context.unsafe.filter((r) => r !== rid),
      });
    }),
  },
}).createMachine({
  id: 'http',
  context: ({ input }) => ({
    limits: input.limits,
    registry: input.registry,
    bytesRead: input.bytesRead ?? (() => 0),
    active: [],
    unsafe: [],
    waiting: [],
    readMark: input.bytesRead?.() ?? 0,
  }),
  initial: 'open',
  on: {
    TASK: {
      actions: enqueueActions(({ enqueue, event, context }) => {
        if (context.active.includes(event.rid))
          enqueue.spawnChild('exchange', {
            id: `exchange:${event.rid}`,
            input: {
              rid: event.rid,
              request: event.request,
              registry: context.registry,
              maxTensorBytes: context.limits.max_tensor_bytes,
            },
          });
      }),
    },
    REQUEST_STARTED: {
      actions: [
        assign({ waiting: ({ context, event }) => [...context.waiting, { rid: event.rid, safe: event.safe }] }),
        'startWaiting',
      ],
    },
    RESPONSE_CLOSED: { actions: ['finished', 'startWaiting'] },
    RESPONSE: {
      actions: emit(
        ({ event }) =>
          ({
            type: 'respond',
            rid: event.rid,
            status: event.status,
            body: event.body,
            msgpack: event.msgpack,
            wav: event.wav,
            inferenceHeaderLength: event.inferenceHeaderLength,
          }) as HttpOutput,
      ),
    },
    SSE_START: { actions: emit(({ event }) => ({ type: 'sse-start', rid: event.rid }) as HttpOutput) },
    SSE_EVENT: {
      actions: emit(
        ({ event }) => ({ type: 'sse-event', rid: event.rid, name: event.name, data: event.data }) as HttpOutput,
      ),
    },
    SSE_END: { actions: emit(({ event }) => ({ type: 'sse-end', rid: event.rid, error: event.error }) as HttpOutput) },
    FAILED: { actions: emit(({ event }) => ({ type: 'fail', rid: event.rid, error: event.error }) as HttpOutput) },
    PEER_CLOSED: '.closed',
    UPGRADED: '.closed',
  },
  states: {
    open: {
      entry: 'markRead',
      always: { guard: 'busy', target: 'streaming' },
      on: { DRAIN: 'lingering' },
      after: {
        keepAlive: [
          // Bytes arrived: a request's headers are on their way (node's headers timeout bounds them).
          { guard: and(['keepAliveOn', 'bytesArrived']), target: 'open', reenter: true },
          { guard: 'keepAliveOn', target: 'closed', actions: emit({ type: 'close' }) },
        ],
      },
    },
    // Idle while the server drains. Closing now could cut a request the peer has already sent
    // (its bytes unread while the server handles SIGTERM): the peer would see a reset, not an
    // answer. So a request that arrives is answered (503 shutting_down, `Connection: close`),
    // and the connection otherwise stays until the drain ends (the server closes idle ones).
    lingering: {
      entry: 'markRead',
      always: { guard: 'busy', target: 'draining' },
      after: {
        keepAlive: [
          { guard: and(['keepAliveOn', 'bytesArrived']), target: 'lingering', reenter: true },
          { guard: 'keepAliveOn', target: 'closed', actions: emit({ type: 'close' }) },
        ],
      },
    },
    streaming: {
      always: { guard: 'quiet', target: 'open' },
      on: { DRAIN: 'draining' },
    },
    draining: {
      always: { guard: 'quiet', target: 'closed', actions: emit({ type: 'close' }) },
    },
    // Final: its exchanges are stopped with it (leases released).
    closed: { type: 'final' },
  },
});

export type HttpSocket = Actor<typeof httpSocketMachine>;

let httpSeq = 0;

/**
 * Creates an HTTP socket actor as its own root actor (`socket:http:<n>`), sharing the server's
 * inspector; unstarted, so the transport can listen to what it emits first.
 */
export function createHttpSocket(input: HttpSocketInput, inspect?: (e: InspectionEvent) => void): HttpSocket {
  return createActor(httpSocketMachine, { input, inspect, id: `socket:http:${++httpSeq}` });
}
