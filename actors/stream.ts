import { randomUUID } from 'node:crypto';
import {
  assign,
  createActor,
  emit,
  enqueueActions,
  fromCallback,
  raise,
  sendTo,
  setup,
  stateIn,
  type Actor,
  type InspectionEvent,
} from 'xstate';
import {
  MAX_CHANNELS,
  MAX_SAMPLE_RATE,
  MIN_SAMPLE_RATE,
  PCM_ENCODINGS,
  PcmStreamDecoder,
  encodePcm,
  Resampler,
  WavStreamSniffer,
  type PcmEncoding,
  type WavStreamFormat,
} from '../runtime/audio/audio.js';
import { decodeAudioAt } from '../runtime/audio/decode.js';
import { RNNOISE } from '../runtime/slots/rnnoise.js';
import { MAX_TIMEOUT_MS, queryOptions, type Limits } from '../runtime/config.js';
import { invalid, toVoxError, voxError, type VoxError, type WireError } from '../runtime/errors.js';
import { createTaskSession, DenoiseSession, type ProbabilityStream, type TaskEvent } from '../runtime/tasks/index.js';
import { parseCheckpoint, VadSession, type VadCheckpoint } from '../runtime/tasks/vad.js';
import type { Supervisor } from './supervisor.js';
import { ChainLink, CLOSE, JobPump, requestLease, type Granted, type LeaseHandle } from './lease.js';

export { CLOSE } from './lease.js';

/** What a stream asks for in its query string. */
export interface StreamParams {
  model: string;
  /** Hz of the audio the client sends. */
  sampleRate: number;
  encoding: PcmEncoding;
  channels: number;
  /**
   * The format parameters the query gave (the others are defaults). A WAV header at the start of
   * the audio sets the format; one that contradicts a parameter given here fails the stream.
   */
  declared: { sample_rate?: number; encoding?: PcmEncoding; channels?: number };
  /** The request's own busy timeout, ms. */
  busyTimeoutMs?: number;
  /** Task options given as query parameters (`threshold=0.7`), validated against the model's task. */
  options?: Record<string, unknown>;
  /** `probabilities=true` / `probability_interval_ms=N` (VAD): stream speech probabilities (docs/vad.md). */
  probabilities?: ProbabilityStream;
  /**
   * `offset_ms=N`: where the stream's clock starts, ms (a resumed stream: docs/websocket-api.md).
   * Every time the stream reports (`at_ms`, `start_ms`, `end_ms`, `done.processed_ms`) is N more.
   */
  offsetMs: number;
  /** `progress=true`: a `progress {processed_ms}` event after each job's events (docs/websocket-api.md). */
  progress: boolean;
  /** `checkpoints=true` (with `progress=true`): a VAD stream's `progress` carries a `checkpoint` to resume from. */
  checkpoints: boolean;
  /**
   * `resume_from=<checkpoint>` (VAD): the stream goes on from a checkpoint an earlier stream gave: its clock, Silero's
   * state and the segmenter's; the audio sent is the audio from the checkpoint's `processed_ms` on.
   */
  resumeFrom?: VadCheckpoint;
  /** `denoise=rnnoise` (a chain, VAD or wake word): the denoise model the audio goes through first. */
  denoise?: string;
}

/** The largest `offset_ms`: a week of audio. */
export const MAX_OFFSET_MS = 7 * 24 * 3600 * 1000;

/** Query parameters of `/v1/stream` besides task options. */
export const STREAM_QUERY = [
  'model',
  'sample_rate',
  'encoding',
  'channels',
  'busy_timeout_ms',
  'probabilities',
  'probability_interval_ms',
  'offset_ms',
  'progress',
  'checkpoints',
  'resume_from',
  'denoise',
] as const;

/**
 * An integer query parameter, or `dflt` when absent (an empty value is a bad value, as for task options).
 * @param min the smallest accepted value.
 * @param max the largest accepted value.
 * @throws VoxError `invalid_request_error` naming the parameter and its range.
 */
function intParam(url: URL, name: string, dflt: number | undefined, min: number, max: number): number | undefined {
  const raw = url.searchParams.get(name);
  if (raw === null) return dflt;
  const n = Number(raw);
  if (!/^\d{1,10}$/.test(raw) || n < min || n > max)
    throw invalid(name, `must be an integer from ${min} to ${max}, got '${raw.slice(0, 32)}'`);
  return n;
}

/**
 * Parses `/v1/stream?model=&sample_rate=&encoding=&channels=&busy_timeout_ms=&offset_ms=&progress=`
 * and task options.
 * @throws VoxError `invalid_request_error` naming the bad (or unknown) query parameter.
 */
export function parseStreamParams(url: URL): StreamParams {
  const options = queryOptions(url.searchParams, STREAM_QUERY);
  const model = url.searchParams.get('model');
  if (!model) throw invalid('model', 'required query parameter');
  const encoding = url.searchParams.get('encoding') ?? 's16le';
  if (!(PCM_ENCODINGS as readonly string[]).includes(encoding))
    throw invalid('encoding', `must be one of ${PCM_ENCODINGS.join(', ')}, got '${encoding}'`);
  const probabilities = url.searchParams.get('probabilities');
  if (probabilities !== null && probabilities !== 'true' && probabilities !== 'false')
    throw invalid('probabilities', `must be true or false, got '${probabilities.slice(0, 32)}'`);
  const progress = url.searchParams.get('progress');
  if (progress !== null && progress !== 'true' && progress !== 'false')
    throw invalid('progress', `must be true or false, got '${progress.slice(0, 32)}'`);
  const checkpoints = url.searchParams.get('checkpoints');
  if (checkpoints !== null && checkpoints !== 'true' && checkpoints !== 'false')
    throw invalid('checkpoints', `must be true or false, got '${checkpoints.slice(0, 32)}'`);
  if (checkpoints === 'true' && progress !== 'true')
    throw invalid('checkpoints', 'a checkpoint comes in a progress event: give progress=true too');
  const from = url.searchParams.get('resume_from');
  const resumeFrom = from === null ? undefined : parseCheckpoint(from);
  for (const other of ['offset_ms', 'probabilities', 'probability_interval_ms', 'denoise'])
    if (resumeFrom && url.searchParams.has(other))
      throw invalid('resume_from', `a checkpoint sets the stream's clock and state: not with ${other}`);
  // An interval asks for probabilities by itself; under one window (32 ms) each span would hold at most one.
  const intervalMs = intParam(url, 'probability_interval_ms', undefined, 32, 60_000);
  const sampleRate = intParam(url, 'sample_rate', 16_000, MIN_SAMPLE_RATE, MAX_SAMPLE_RATE)!;
  const channels = intParam(url, 'channels', 1, 1, MAX_CHANNELS)!;
  const declared: StreamParams['declared'] = {};
  if (url.searchParams.has('sample_rate')) declared.sample_rate = sampleRate;
  if (url.searchParams.has('encoding')) declared.encoding = encoding as PcmEncoding;
  if (url.searchParams.has('channels')) declared.channels = channels;
  return {
    model,
    encoding: encoding as PcmEncoding,
    sampleRate,
    channels,
    declared,
    busyTimeoutMs: intParam(url, 'busy_timeout_ms', undefined, 0, MAX_TIMEOUT_MS),
    options,
    probabilities: intervalMs !== undefined ? { intervalMs } : probabilities === 'true' ? { intervalMs: 0 } : undefined,
    offsetMs: intParam(url, 'offset_ms', 0, 0, MAX_OFFSET_MS)!,
    progress: progress === 'true',
    checkpoints: checkpoints === 'true',
    resumeFrom,
    denoise: denoiseParam(url),
  };
}

/** `denoise=` (a chain's first link), or undefined. @throws VoxError naming `denoise` when it is empty. */
function denoiseParam(url: URL): string | undefined {
  const v = url.searchParams.get('denoise');
  if (v === null) return undefined;
  if (!v) throw invalid('denoise', 'must be a denoise model id (rnnoise)');
  return v;
}

/**
 * Checks a WAV header received on a stream against the format its query declared.
 * @throws VoxError `invalid_field` naming the first parameter the header contradicts, the two
 *   formats, and what to do.
 */
export function checkDeclaredFormat(declared: StreamParams['declared'], header: WavStreamFormat): void {
  const wire = header.encoding === 's16le' || header.encoding === 'f32le' ? header.encoding : null;
  const clash =
    declared.sample_rate !== undefined && declared.sample_rate !== header.sampleRate
      ? `sample_rate=${declared.sample_rate}`
      : declared.channels !== undefined && declared.channels !== header.channels
        ? `channels=${declared.channels}`
        : declared.encoding !== undefined && declared.encoding !== wire
          ? `encoding=${declared.encoding}`
          : null;
  if (!clash) return;
  throw invalid(
    clash.split('=')[0],
    `the stream was opened with ${clash}, but the WAV header it received says ${header.description}; ` +
      'open the stream without sample_rate, encoding and channels (the header sets them), or send the samples without the header',
  );
}

/** Bytes a stream keeps from its client before `ready` (while queued or loading) before it stops reading. */
const MAX_EARLY_BYTES = 4 * 1024 * 1024;
/**
 * While the server has paused reading a stream's socket (backpressure), it pings at least this often,
 * ms, though no pong is awaited: the client's heartbeat (`heartbeatMs`, 10 s by default) counts a
 * ping from the server as a sign of life, so a server that is only behind is not taken for frozen.
 */
export const PAUSED_PING_MS = 5000;

/** Unprocessed audio (16 kHz samples) above which a stream stops reading its socket: 10 s. */
export const MAX_PENDING_SAMPLES = 160_000;

/** A server event as it goes on the wire (before encoding). */
export type WireEvent = Record<string, unknown> & { type: string };

/**
 * A token bucket over a client's messages (`limits.ws_max_messages_per_s`): up to a second's
 * worth at once, refilled at the limit. The server's own pauses (backpressure) are not the
 * client's: the few messages ws still delivers while reading is paused are not counted, and the
 * paused time is credited on top of the bucket, so the backlog the client sent meanwhile does not
 * count as a burst; the credit lapses once the bucket is full again.
 */
class MessageBudget {
  private tokens: number;
  private credit = 0;
  private at = performance.now();
  private pausedAt: number | null = null;

  /** @param perS messages per second. */
  constructor(private readonly perS: number) {
    this.tokens = perS;
  }

  /** One message at `now` (`performance.now()` ms); false past the limit. */
  take(now: number): boolean {
    if (this.pausedAt !== null) return true;
    this.refill(now);
    if (this.tokens >= 1) this.tokens--;
    else if (this.credit >= 1) this.credit--;
    else return false;
    return true;
  }

  /** The server stopped (`paused` true) or started again (false) reading the socket. */
  readingPaused(paused: boolean, now: number): void {
    if (paused && this.pausedAt === null) {
      this.refill(now);
      this.pausedAt = now;
    } else if (!paused && this.pausedAt !== null) {
      this.credit += ((now - this.pausedAt) * this.perS) / 1000;
      this.pausedAt = null;
      this.at = now;
    }
  }

  private refill(now: number): void {
    const was = this.tokens;
    this.tokens += ((now - this.at) * this.perS) / 1000;
    this.at = now;
    if (this.tokens >= this.perS) {
      this.tokens = this.perS;
      // Full again after the backlog drew on it: the credit has served. (A bucket that was full
      // already, as when reading resumes, keeps it: lapsing then lost the credit at once.)
      if (was < this.perS) this.credit = 0;
    }
  }
}

/**
 * Channels with frames of this turn, flushed by one immediate at the turn's end, in the order
 * their first frame came: one immediate per stream and turn (and its frame list) was ~0.3 KB of
 * the ~3 KB the main thread allocated per 20 ms frame (V8's sampling heap profiler).
 */
let due: StreamChannel[] = [];
/** The list being flushed (kept for the next turn's `due`). */
let flushing: StreamChannel[] = [];
/** What a flushed frame's place in a channel's list holds (the buffer itself is let go). */
const NO_FRAME = Buffer.alloc(0);

function flushDue(): void {
  // A channel that gets frames while these flush starts the next list (and its immediate).
  const now = due;
  due = flushing;
  flushing = now;
  try {
    for (const channel of now) channel.flush();
  } finally {
    now.length = 0;
  }
}

/**
 * A stream's data plane, between the transport and the stream's `work` actor, beside the chart:
 * binary frames in, task events (`speech_start`, `detection`, ...) out. They do not pass through
 * the chart: a chart event costs about 10 µs, a third of a stream's whole main-thread budget at
 * 100 ms frames. Frames are coalesced: those that arrive in one turn of the event loop reach
 * `work` as one chunk (flushed at the turn's end, or at once before a control message so that
 * order holds), so the cost per frame is a copy, whatever the frame size. The channel counts
 * every message against `limits.ws_max_messages_per_s`, keeps when the client last sent anything
 * (the chart's idle deadline asks `work` for it), and keeps the send deadline
 * (`limits.send_timeout_ms`) itself: a plain timer, armed only while a write waits to flush,
 * tells the chart `SEND_EXPIRED` once a write has waited that long. Polled from the chart, the
 * deadline cost three chart events per stream every period (~0.4 ms of the main thread each
 * time, measured at 300 streams), whether or not anything was written.
 */
export class StreamChannel {
  /** When the client last sent a message, `performance.now()` ms. */
  heardAt = performance.now();
  /**
   * Since when writes have been waiting to flush (the backlog began, or reading resumed after a
   * pause: a full period again), `performance.now()` ms; null when all are flushed.
   */
  private unflushedSince: number | null = null;
  /**
   * The `work` actor's handler of coalesced audio while it runs: the turn's frames in order (not
   * concatenated: a copy and a new buffer per turn), and when the last of them arrived
   * (`performance.now()` ms). The frames are the first `count` of a list the channel reuses:
   * copy what you keep.
   */
  sink: ((frames: readonly Buffer[], count: number, arrivedAt: number) => void) | null = null;
  /** The transport's writer (set by it). */
  write: (event: WireEvent) => void = () => {};
  /**
   * Called once when the client goes over `limits.ws_max_messages_per_s` (set by the transport); later messages are
   * dropped.
   */
  onFlood: () => void = () => {};
  /** Called when a write has waited `limits.send_timeout_ms` to flush, with how long, ms (set by the transport). */
  onSendExpired: (waitingMs: number) => void = () => {};
  private readonly budget: MessageBudget | null;
  private flooded = false;
  /** Writes not flushed yet. */
  private unflushed = 0;
  private paused = false;
  private sendTimer: NodeJS.Timeout | null = null;
  /**
   * Frames of this turn, not yet flushed: the first `frameCount` (the list is kept: emptying it gave its storage up).
   */
  private readonly frames: Buffer[] = [];
  private frameCount = 0;
  private frameBytes = 0;
  /** In {@link due}: flushed at this turn's end. */
  private queued = false;

  /**
   * @param maxMessagesPerS `limits.ws_max_messages_per_s` (0: no limit).
   * @param sendTimeoutMs `limits.send_timeout_ms` (0: no send deadline).
   */
  constructor(
    maxMessagesPerS = 0,
    private readonly sendTimeoutMs = 0,
  ) {
    this.budget = maxMessagesPerS > 0 ? new MessageBudget(maxMessagesPerS) : null;
  }

  /**
   * The transport starts a write to the client; call the returned function once it is flushed.
   * The first write of a backlog starts the send deadline's clock (and its timer, if none runs).
   */
  writing(): () => void {
    if (this.unflushed++ === 0) {
      this.unflushedSince = performance.now();
      if (this.sendTimeoutMs > 0) this.sendTimer ??= setTimeout(this.checkSend, this.sendTimeoutMs).unref();
    }
    return this.flushed;
  }

  private readonly flushed = (): void => {
    if (--this.unflushed === 0) this.unflushedSince = null;
  };

  /**
   * The send deadline's timer: nothing waits (disarmed), the server is not reading (a client
   * blocked sending to it may not read either: the deadline waits for reading to resume), the
   * oldest waiting write is over the deadline (judged one event-loop turn later, so that writes
   * flushed meanwhile count: timers run before I/O), or not yet (armed again for the rest).
   */
  private readonly checkSend = (): void => {
    this.sendTimer = null;
    if (this.unflushedSince === null) return;
    const waited = performance.now() - this.unflushedSince;
    if (this.paused) this.sendTimer = setTimeout(this.checkSend, this.sendTimeoutMs).unref();
    else if (waited < this.sendTimeoutMs)
      this.sendTimer = setTimeout(this.checkSend, Math.max(1, this.sendTimeoutMs - waited)).unref();
    else
      setImmediate(() => {
        if (this.unflushedSince === null) return;
        if (this.paused || performance.now() - this.unflushedSince < this.sendTimeoutMs) return this.checkSend();
        this.onSendExpired(performance.now() - this.unflushedSince);
      });
  };

  /** The stream is over: the send deadline's timer stops. */
  close(): void {
    if (this.sendTimer) clearTimeout(this.sendTimer);
    this.sendTimer = null;
  }

  /** A binary frame of PCM in the stream's declared format. */
  push(data: Buffer): void {
    if (!this.count(true)) return;
    this.frames[this.frameCount++] = data;
    this.frameBytes += data.length;
    if (this.queued) return;
    this.queued = true;
    if (due.push(this) === 1) setImmediate(flushDue);
  }

  /** A text frame (a control message): audio before it is flushed first. */
  heard(): boolean {
    if (!this.count(true)) return false;
    this.flush();
    return true;
  }

  /** A ping or pong from the client: counted, not heard (it does not end the idle deadline). */
  control(): void {
    this.count(false);
  }

  /**
   * The server stopped (`paused` true) or started again (false) reading the socket (backpressure).
   * The message budget does not count the pause; a write waiting to flush gets a full send period
   * again once reading resumes.
   */
  readingPaused(paused: boolean): void {
    const now = performance.now();
    this.budget?.readingPaused(paused, now);
    if (this.paused && !paused && this.unflushedSince !== null) this.unflushedSince = now;
    this.paused = paused;
  }

  /** Hands this turn's frames to `work` as one chunk. */
  flush(): void {
    this.queued = false;
    if (this.frameBytes === 0) return;
    const count = this.frameCount;
    this.frameBytes = 0;
    this.frameCount = 0;
    try {
      this.sink?.(this.frames, count, this.heardAt);
    } finally {
      this.frames.fill(NO_FRAME, 0, count);
    }
  }

  /** Counts one message; false (and `onFlood` once) past the limit. */
  private count(heard: boolean): boolean {
    if (this.flooded) return false;
    const now = performance.now();
    if (heard) this.heardAt = now;
    if (!this.budget || this.budget.take(now)) return true;
    this.flooded = true;
    this.frames.fill(NO_FRAME, 0, this.frameCount);
    this.frameCount = 0;
    this.frameBytes = 0;
    this.onFlood();
    return false;
  }
}

/**
 * Events the transport sends a stream socket actor: bytes turned into events (frames go by its {@link StreamChannel}).
 */
export type StreamInput =
  /**
   * The client's `end`; `handOver` (the root's drain): a VAD stream with checkpoints stops at its last whole window
   * and its `done` carries the checkpoint there, for the client to go on on another node.
   */
  | { type: 'END'; handOver?: boolean }
  /** A text frame that is not `{"type":"end"}`: answered with an `error` event, the stream goes on. */
  | { type: 'BAD_CONTROL'; error: WireError }
  | { type: 'PONG' }
  /** The client leaves more than `ws_max_buffered_bytes` unread. */
  | { type: 'SEND_BLOCKED' }
  /** A write has waited `limits.send_timeout_ms` to flush (the channel's send deadline). */
  | { type: 'SEND_EXPIRED'; waitingMs: number }
  /** The client sent more than `limits.ws_max_messages_per_s` (its channel counts them). */
  | { type: 'FLOODED' }
  /** The peer closed (or the socket failed: 1006). */
  | { type: 'PEER_CLOSED'; code: number }
  /** Shutdown phase 2 (the root's `drain`): finish as if the client had sent `end`, close 1001. */
  | { type: 'DRAIN' }
  /** Shutdown phase 3: close 1001 now. */
  | { type: 'GO_AWAY'; reason: string };

/** Events the `work` actor sends its socket actor. */
export type WorkEvent =
  /**
   * `sampleRate`: the rate the model runs at (16 kHz; a denoise stream: the rate its audio comes back at, the
   * stream's). `windowMs`: the model's window (VAD, 32 ms), step (wake word, 80 ms) or frame (denoise, 10 ms),
   * ms: the grid from the session's start on which it runs the model.
   */
  | { type: 'READY'; model: string; task: string; sampleRate?: number; windowMs?: number }
  /** Answer to `CHECK_IDLE`: ms since the client last sent a message. */
  | { type: 'IDLE_REPORT'; silentMs: number }
  | { type: 'PAUSE' }
  | { type: 'RESUME' }
  | { type: 'DONE'; processed_ms: number; timing: Record<string, number>; checkpoint?: string }
  | { type: 'FAILED'; error: WireError; code: number };

/** Closes the stream with `code` and `reason`; with `error`, an `error` event first tells the client why. */
type CutEvent = { type: 'CUT'; code: number; reason: string; error?: WireError };

/** A cut that tells the client why: the error's event, then its close code. */
const cutFor = (e: VoxError): CutEvent => ({ type: 'CUT', code: e.closeCode, reason: e.message, error: e.toWire() });

/** What a stream socket actor emits for the transport to write: events into bytes. */
export type StreamOutput =
  | { type: 'send'; event: WireEvent }
  | { type: 'close'; code: number; reason: string }
  | { type: 'pause' }
  | { type: 'resume' }
  | { type: 'ping' }
  /** Destroy the socket: the peer did not complete the close handshake within a second. */
  | { type: 'terminate' }
  /** The stream is over for the server: its lease is released (the socket may still be closing). */
  | { type: 'released' };

/** Figures the `work` actor keeps for the closing log line. */
interface StreamStats {
  model?: string;
  /** Audio received, in samples at {@link StreamStats.rate}. */
  receivedSamples: number;
  /** The rate `receivedSamples` counts at, Hz: 16 kHz, or 48 kHz where the audio goes into RNNoise first. */
  rate: number;
}

/** What a stream socket actor is created with. */
export interface StreamSocketInput {
  /** The request target (`/v1/stream?model=...`), parsed by {@link parseStreamParams}. */
  url: string;
  limits: Limits;
  registry: Supervisor;
  /** The `route` of its closing log line; default `stream`. */
  route?: string;
}

/** A stream's live resources, kept out of its chart's context, by session id. */
export interface StreamResources extends StreamSocketInput {
  channel: StreamChannel;
  stats: StreamStats;
}
const live = new Map<string, StreamResources>();

/** A live stream's resources by session id (for another protocol's `work` actor), or undefined once it is closed. */
export function streamResources(id: string): StreamResources | undefined {
  return live.get(id);
}

interface StreamContext {
  /** The stream's `session_id`. */
  id: string;
  limits: Limits;
  /** The close code once known (sent or received). */
  code: number | null;
  /** Why the server cut the connection off, if it did. */
  cutReason: string | null;
  /** Close code for `done`: 1000, or 1001 when drained for shutdown. */
  doneCode: number;
  /** The next idle check, ms from now. */
  idleLeftMs: number;
  /** Answered the last ping. */
  alive: boolean;
  /** The client sent `end`. */
  ended: boolean;
  openedAt: number;
}

/** Close reasons are limited to 123 bytes by the WebSocket protocol. */
function closeReason(text: string): string {
  if (Buffer.byteLength(text) <= 123) return text;
  // Cut by characters, not bytes: a cut inside a multi-byte character would decode as U+FFFD (3 bytes) and overflow.
  let cut = text.slice(0, 120);
  while (Buffer.byteLength(cut) > 120) cut = cut.slice(0, -1);
  return `${cut}...`;
}

const errorEvent = (error: WireError): WireEvent => ({ type: 'error', error });

/** A task event with its times moved `ms` later (a stream whose clock starts at `offset_ms`). */
function shifted(e: TaskEvent, ms: number): WireEvent {
  if (e.type === 'speech_end') return { ...e, start_ms: e.start_ms + ms, end_ms: e.end_ms + ms };
  return { ...e, at_ms: e.at_ms + ms };
}

/**
 * Work run a slice at a time: each turn of the event loop (an immediate) runs the queued tasks in
 * order until `sliceMs` of the main thread have passed (at least one task), and leaves the rest to
 * the next turn, so that the I/O of the turns between (other streams' frames and results) is not
 * held back by a burst of it.
 */
export class TurnSlices {
  private readonly tasks: (() => void)[] = [];

  /** @param sliceMs main-thread time per turn, ms. @param now the clock, ms. */
  constructor(
    private readonly sliceMs: number,
    private readonly now: () => number = () => performance.now(),
  ) {}

  /** Queues `task`, run a turn of the event loop later or more. */
  run(task: () => void): void {
    if (this.tasks.push(task) === 1) setImmediate(this.slice);
  }

  /** Runs every queued task now, in order (the slices already scheduled then find nothing). */
  drain(): void {
    while (this.tasks.length) this.tasks.shift()!();
  }

  private readonly slice = (): void => {
    const until = this.now() + this.sliceMs;
    let n = 0;
    try {
      while (n < this.tasks.length && (n === 0 || this.now() < until)) this.tasks[n++]();
    } finally {
      this.tasks.splice(0, n);
      if (this.tasks.length) setImmediate(this.slice);
    }
  };
}

/**
 * Streams whose last result is in, saying `done` and closing (~0.6 ms of the main thread each, in
 * their charts): 2 ms of them per turn, so that streams ending together do not hold back the
 * others' last results (650 VAD streams ending at once: the end's lag p99 470 -> 250 ms, and the
 * share of windows under 100 ms 98.8 -> 99.2-99.6 %).
 */
const finishing = new TurnSlices(2);

/**
 * Every stream whose last result is in says `done` now: the shutdown's last phase calls it before
 * it cuts the streams off, so that a finished stream waiting for its slice is not cut (1001
 * without `done`; the breaker saw 15 of 600 with a 300 ms drain).
 */
export function finishWaiting(): void {
  finishing.drain();
}

/**
 * The `work` actor of a stream: it owns the live resources (the lease, the PCM decoder, the task
 * session) from the stream's first moment to its last. It asks for the lease before preparing
 * anything ({@link requestLease}: the model is loaded if needed), then sends `READY`; coalesced
 * audio from the {@link StreamChannel} is decoded, windowed and pumped to the model's slots as it
 * arrives ({@link JobPump}), and task events go straight to the transport by the channel. `END`
 * flushes; `DONE` follows the last result. Stopping it (the socket actor leaving `live`) drops
 * pending inference and releases the lease, on every path.
 */
const streamWork = fromCallback<StreamInput | { type: 'CHECK_IDLE' }, { id: string }>(
  ({ input: { id }, sendBack, receive }) => {
    const input = live.get(id)!;
    const { stats, channel } = input;
    const send = (e: WorkEvent): void => sendBack(e);
    const t0 = performance.now();
    let lease: LeaseHandle | null = null;
    let stopped = false;
    let decoder: PcmStreamDecoder | null = null;
    let pump: JobPump | null = null;
    /**
     * A chain (`denoise=`): its first link, the denoise model under a lease of its own. The audio
     * goes through `pump` there; its 48 kHz output, at 16 kHz (`toMain`), into the last model's session.
     */
    let front: ChainLink | null = null;
    let frontLease: LeaseHandle | null = null;
    /** A denoise stream: RNNoise's 48 kHz output back to the stream's rate, and its encoding. */
    let back: { resampler: Resampler; rate: number; encoding: PcmEncoding } | null = null;
    /**
     * Unprocessed audio past which reading pauses: {@link MAX_PENDING_SAMPLES} at 16 kHz (10 s), as long at the
     * session's rate.
     */
    let pendingLimit = MAX_PENDING_SAMPLES;
    /** Samples per ms at the session's rate. */
    let perMs = 16;
    let queueMs = 0;
    let early: { frames: Buffer[]; at: number }[] = [];
    let earlyBytes = 0;
    let paused = false;
    let ended = false;
    /**
     * Drained with checkpoints (a VAD stream, `checkpoints=true`): the stream stops at its last whole window, not
     * padded, and `done` there carries the checkpoint (the client re-sends the rest to another node).
     */
    let handOver = false;
    /** A VAD stream with `checkpoints=true`: its checkpoint now (null when it cannot give one); else null. */
    let checkpoint: (() => string | null) | null = null;
    /** When the server last had nothing of the client's left to do (see `behind`), performance.now() ms. */
    let caughtUpAt = performance.now();
    /**
     * The server holds audio of the client it has not processed: not ready yet, a job in flight, or a whole window
     * waiting.
     */
    const behind = (): boolean =>
      !pump ||
      pump.running ||
      early.length > 0 ||
      held !== null ||
      pump.session.pendingSamples >= pump.session.step ||
      (front?.busy ?? false);
    const gone = (): boolean => stopped || (lease?.signal.aborted ?? false) || (frontLease?.signal.aborted ?? false);

    const fail = (e: unknown): void => {
      if (gone()) return;
      const err = toVoxError(e);
      send({ type: 'FAILED', error: err.toWire(), code: err.closeCode });
    };
    const pause = (): void => {
      if (!paused) send({ type: 'PAUSE' });
      paused = true;
    };
    const resume = (): void => {
      if (paused) send({ type: 'RESUME' });
      paused = false;
    };
    /** The stream's clock starts here, ms (`offset_ms`); 0 but for a resumed stream. */
    let offsetMs = 0;
    const emitTask = (e: TaskEvent): void => channel.write(offsetMs ? shifted(e, offsetMs) : { ...e });

    /** Finds a WAV header at the start of the audio (see {@link WavStreamSniffer}). */
    const sniffer = new WavStreamSniffer();
    /** Frames that came while the decoder takes a WAV header's format (a new converter rate): pushed once it has. */
    let held: Buffer[] | null = null;
    let streamParams: StreamParams | null = null;
    /**
     * A compressed file the stream started with (Ogg, FLAC, WebM, MP3 with ID3): its bytes so far,
     * kept until `end` (at most `limits.max_body_bytes`), then decoded whole ({@link decodeFile}).
     */
    let file: { parts: Buffer[]; bytes: number } | null = null;
    /** The rate a compressed file is decoded to: the first session's (16 kHz, or RNNoise's 48 kHz). */
    let fileRate = 16_000;

    /** The header's format for the decoder, then what was held meanwhile. */
    const reformat = (format: WavStreamFormat, first: Buffer, at: number): void => {
      checkDeclaredFormat(streamParams!.declared, format);
      held = [];
      decoder!
        .reformat(format.sampleRate, format.channels, format.encoding)
        // A denoise stream's audio goes back at the header's rate (the rate the client now sends at).
        .then(() =>
          back && back.rate !== format.sampleRate ? Resampler.create(RNNOISE.RATE, format.sampleRate) : null,
        )
        .then((resampler) => {
          if (gone()) return resampler?.close();
          if (resampler && back) {
            back.resampler.close();
            back = { ...back, resampler, rate: format.sampleRate };
          }
          const frames = held!;
          held = null;
          // `first` has passed the sniffer already (the samples after the header); the held frames not yet.
          if (first.length) (front?.session ?? pump!.session).push(decoder!.push(first));
          push(frames, frames.length, at);
          if (ended) finishAudio();
        })
        .catch(fail);
    };

    /** Coalesced audio (see {@link StreamChannel}) that arrived at `at`, into the session. */
    const push = (frames: readonly Buffer[], count: number, at: number): void => {
      const first = front?.pump ?? pump!;
      const session = first.session;
      for (let i = 0; i < count; i++) {
        if (held) {
          held.push(frames[i]);
          continue;
        }
        const { bytes, format, file: starts } = sniffer.feed(frames[i]);
        if (starts) file = { parts: [], bytes: 0 };
        if (file) {
          file.bytes += bytes.length;
          if (file.bytes > input.limits.max_body_bytes)
            throw voxError('body_too_large', { bytes: file.bytes, limit: input.limits.max_body_bytes });
          file.parts.push(Buffer.from(bytes));
        } else if (format) reformat(format, bytes, at);
        else if (bytes.length) session.push(decoder!.push(bytes));
      }
      stats.receivedSamples = session.receivedSamples;
      first.arrived(at);
      if (session.pendingSamples > pendingLimit) pause();
      first.pump();
    };

    /**
     * No job left: the server has caught up; after `END`, `DONE`, a turn of the event loop later
     * or more ({@link finishing}): it runs the stream's close in its chart (~0.6 ms of the main
     * thread), and here it would run inside the delivery of a batch's results, so a batch of
     * ending streams held the other rows' results and the slot's next batch back until every one
     * had closed.
     */
    const idle = (): void => {
      const session = pump!.session;
      caughtUpAt = performance.now();
      resume();
      if (!ended || gone()) return;
      if (handOver) {
        const given = checkpoint!();
        if (given) return finishing.run(() => done(given));
        // No checkpoint to hand over (a segment too long for one): the stream finishes as at `end`.
        handOver = false;
        return finishAudio();
      }
      if (session.finished) finishing.run(done);
    };
    /**
     * A denoise stream's audio so far (with `last`, what its resampler still holds) to the client, as binary frames.
     */
    const sendAudio = (last = false): void => {
      const session = pump!.session;
      if (!back || !(session instanceof DenoiseSession)) return;
      const out = back.resampler.push(session.takeOutput());
      const tail = last ? back.resampler.flush() : null;
      if (out.length) channel.write({ type: 'audio', data: encodePcm(out, back.encoding) });
      if (tail?.length) channel.write({ type: 'audio', data: encodePcm(tail, back.encoding) });
    };
    /** `done`; handed over (a drain), at the audio processed, with the checkpoint there. */
    const done = (handedOver?: string): void => {
      if (gone()) return;
      sendAudio(true);
      const wallMs = performance.now() - t0;
      const audioMs = (handedOver ? pump!.session.processedSamples : pump!.session.receivedSamples) / perMs;
      send({
        type: 'DONE',
        ...(handedOver ? { checkpoint: handedOver } : {}),
        processed_ms: offsetMs + Math.round(audioMs),
        timing: {
          wall_ms: Math.round(wallMs),
          queue_ms: Math.round(queueMs),
          audio_duration_ms: Math.round(audioMs),
          rtf: audioMs ? Math.round((wallMs / audioMs) * 10_000) / 10_000 : 0,
        },
      });
    };

    /**
     * At `end`, a compressed file the stream received: decoded whole in a decode worker (as `POST
     * /v1/tasks/run` decodes it: mono, at {@link fileRate}), its samples into the first session, then
     * the stream finishes as it does after PCM. The format parameters of the query do not apply.
     */
    const decodeFile = (): void => {
      const bytes = Buffer.concat(file!.parts);
      file = null;
      held = [];
      // (decodeAudioAt throws at once for a format it does not take: a rejection here too.)
      Promise.resolve()
        .then(() => decodeAudioAt(bytes, undefined, fileRate))
        .then(({ samples }) => {
          if (gone()) return;
          held = null;
          const first = front?.pump ?? pump!;
          first.session.push(samples);
          first.arrived(performance.now());
          finishAudio();
        })
        .catch(fail);
    };

    const finishAudio = (): void => {
      // After the decoder has taken a WAV header's format, or decoded a file (they call it again then).
      if (held) return;
      // Handed over: the whole windows run, the rest is left to the next node (idle then says done).
      if (handOver) return pump!.pump();
      if (file) return decodeFile();
      const rest = sniffer.flush();
      if (rest.length) (front?.session ?? pump!.session).push(decoder!.push(rest));
      if (front) {
        // The chain's first link finishes first (its audio all handed on), then the last model's session.
        front.session.push(decoder!.end());
        stats.receivedSamples = front.session.receivedSamples;
        const last = pump!;
        void front.end().then(() => {
          if (gone()) return;
          for (const e of last.session.end()) emitTask(e);
          last.pump();
        });
        return;
      }
      const session = pump!.session;
      // The resampler's held-back tail first, so a stream gives the samples a file would.
      session.push(decoder!.end());
      stats.receivedSamples = session.receivedSamples;
      for (const e of session.end()) emitTask(e);
      pump!.pump();
    };

    /** The lease is granted and the model ready: decode, make the session, say `READY`, take what came early. */
    const start = async (params: StreamParams, granted: Granted, first?: Granted): Promise<void> => {
      queueMs = granted.queueMs + (first?.queueMs ?? 0);
      offsetMs = params.resumeFrom?.baseMs ?? params.offsetMs;
      streamParams = params;
      const denoise = granted.config.task === 'denoise';
      if (first && granted.config.task !== 'vad' && granted.config.task !== 'wakeword')
        throw invalid(
          'denoise',
          `a chain starts a VAD or wake-word stream; '${granted.model}' is a ${granted.config.task} model`,
        );
      decoder = await PcmStreamDecoder.create(
        params.encoding,
        params.sampleRate,
        params.channels,
        denoise || first ? RNNOISE.RATE : undefined,
      );
      fileRate = denoise || first ? RNNOISE.RATE : 16_000;
      if (denoise)
        back = {
          resampler: await Resampler.create(RNNOISE.RATE, params.sampleRate),
          rate: params.sampleRate,
          encoding: params.encoding,
        };
      // Made before the sessions: nothing awaits between the pumps' creation and the first audio.
      const link = first
        ? await ChainLink.create(first, 'denoise', {
            out: (samples) => {
              pump!.session.push(samples);
              pump!.arrived(performance.now());
              pump!.pump();
            },
            accepted: () => {
              if (paused && link!.session.pendingSamples < pendingLimit / 2) resume();
            },
            idle: () => {
              caughtUpAt = performance.now();
              resume();
            },
            fail,
          })
        : null;
      if (gone()) return link?.close();
      front = link;
      // The audio the stream counts is what the decoder gives: 48 kHz into RNNoise (a chain or a denoise stream).
      stats.rate = denoise || first ? RNNOISE.RATE : 16_000;
      const session = createTaskSession(granted.config, granted.info, params.options, false, params.probabilities);
      if (params.resumeFrom) {
        if (!(session instanceof VadSession))
          throw invalid(
            'resume_from',
            `a checkpoint is a VAD stream's; '${granted.model}' is a ${granted.config.task} model`,
          );
        session.restore(params.resumeFrom, granted.model);
      }
      // A chain's VAD session is not all of the stream's state (RNNoise's is not in the checkpoint): none.
      if (params.checkpoints && !first && session instanceof VadSession)
        checkpoint = () => session.checkpoint(granted.model, offsetMs);
      perMs = (session.rate ?? 16_000) / 1000;
      pendingLimit = MAX_PENDING_SAMPLES * ((first ? RNNOISE.RATE / 1000 : perMs) / 16);
      pump = new JobPump(session, granted, {
        emit: emitTask,
        accepted: () => {
          sendAudio();
          // After the job's events, so a client that saw this has seen every event of the audio before it.
          if (params.progress) {
            const processed_ms = offsetMs + Math.round(session.processedSamples / perMs);
            const given = checkpoint?.();
            channel.write({ type: 'progress', processed_ms, ...(given ? { checkpoint: given } : {}) });
          }
          if (paused && session.pendingSamples < pendingLimit / 2) resume();
        },
        idle,
        fail,
      });
      send({
        type: 'READY',
        model: granted.model,
        task: granted.config.task,
        sampleRate: denoise ? params.sampleRate : 16_000,
        windowMs: session.step / perMs,
      });
      caughtUpAt = performance.now();
      const buffered = early;
      early = [];
      earlyBytes = 0;
      for (const { frames, at } of buffered) push(frames, frames.length, at);
      if (session.pendingSamples <= pendingLimit) resume();
      if (ended) finishAudio();
    };

    try {
      const params = parseStreamParams(new URL(input.url, 'http://localhost'));
      const entry = input.registry.requireForWork(params.model);
      stats.model = entry.id;
      lease = requestLease(entry, { requestTimeoutMs: params.busyTimeoutMs, metrics: input.registry.metrics }, (e) => {
        if (e.type === 'LEASE_GRANTED') {
          if (!params.denoise) return void start(params, e.granted).catch(fail);
          // A chain: the first link's lease, an entry of its own, asked once the last model's is held.
          const granted = e.granted;
          try {
            frontLease = requestLease(
              input.registry.require(params.denoise),
              { requestTimeoutMs: params.busyTimeoutMs, metrics: input.registry.metrics },
              (f) => {
                if (f.type === 'LEASE_GRANTED') start(params, granted, f.granted).catch(fail);
                else if (f.type === 'LEASE_REFUSED') fail(f.error);
                else if (!stopped) send({ type: 'FAILED', error: f.error.toWire(), code: f.code });
              },
            );
          } catch (err) {
            fail(err);
          }
        } else if (e.type === 'LEASE_REFUSED') fail(e.error);
        else if (!stopped) send({ type: 'FAILED', error: e.error.toWire(), code: e.code });
      });
    } catch (e) {
      // Answered after the chart has started (a bad query or an unknown model).
      queueMicrotask(() => fail(e));
    }

    channel.sink = (frames, count, at) => {
      // Audio after `end` is dropped: the stream is finishing what it had.
      if (ended) return;
      if (pump) {
        // A frame the decoder cannot take fails this stream alone (it runs in the turn's shared flush).
        try {
          return push(frames, count, at);
        } catch (e) {
          return fail(e);
        }
      }
      // Waiting for a lease or a load: keep what was sent, but stop reading past a cap.
      const kept = frames.slice(0, count);
      early.push({ frames: kept, at });
      for (const data of kept) earlyBytes += data.length;
      if (earlyBytes > MAX_EARLY_BYTES) pause();
    };
    receive((e) => {
      if (e.type === 'CHECK_IDLE') {
        // The client's silence counts only from when the server had caught up with what it sent.
        send({
          type: 'IDLE_REPORT',
          silentMs: behind() ? 0 : performance.now() - Math.max(channel.heardAt, caughtUpAt),
        });
      } else if (e.type === 'END' && !ended) {
        ended = true;
        handOver = (e.handOver ?? false) && checkpoint !== null && file === null;
        if (pump) finishAudio();
      }
    });
    return () => {
      stopped = true;
      channel.sink = null;
      channel.close();
      decoder?.close();
      back?.resampler.close();
      front?.close();
      frontLease?.release();
      lease?.release();
    };
  },
);

/**
 * A stream socket actor (DESIGN.md section 2): one per WebSocket on `/v1/stream`, each its own
 * root actor sharing the server's inspector. `live` runs four regions side by side:
 * - `phase`: `open` (waiting for the lease and the model) -> `streaming` -> `draining` (after
 *   `end` or the root's `drain`: last events, `done`);
 * - `intake`: `reading` or `paused` (`work` holds too much unprocessed audio: backpressure);
 * - `idle`: no message for `limits.idle_ms` while open or streaming cuts it off (1008);
 * - `heartbeat`: a ping every `limits.heartbeat_ms`; a ping still unanswered at the next one
 *   cuts it off (1001 "no pong: peer is gone");
 * A write not flushed within `limits.send_timeout_ms` cuts it off (1013, `SEND_EXPIRED` from the
 * channel, whose timer runs only while a write waits).
 * Deadlines count only the peer's time: while `intake` is `paused` the two deadline regions
 * are `suspended` (pings go on as a beacon, none awaited) and start a full period when reading
 * resumes (so does the channel's send deadline); `work` counts the
 * client's silence only from when the server caught up with what it sent; and a deadline that
 * falls due is judged in `due`, one event-loop turn later (`settle`), so input not yet read
 * counts. Events the server cannot send while it is not reading close 1013 "server is behind".
 * The idle deadline is an `after` delay that asks `work` for the figure (`CHECK_IDLE`) and
 * decides by a named guard on the answer: frames and task events themselves go
 * by the {@link StreamChannel}, not through the chart. A client over
 * `limits.ws_max_messages_per_s` (`FLOODED`, counted by the channel) is closed 1008 and no longer read.
 * `limits.total_ms` bounds the whole of `live` (1008). Leaving `live` stops the `work` actor, which
 * releases the lease; `closing` waits a second for the peer's close frame, then `terminate`s;
 * `closed` is final. Everything the transport must write comes out as emitted {@link StreamOutput}.
 */
export const streamSocketMachine = setup({
  types: {
    context: {} as StreamContext,
    events: {} as StreamInput | WorkEvent | CutEvent,
    input: {} as { id: string; limits: Limits },
    emitted: {} as StreamOutput,
  },
  actors: { work: streamWork },
  actions: {
    sendReady: enqueueActions(({ enqueue, context, event }) => {
      const ready = event as Extract<WorkEvent, { type: 'READY' }>;
      enqueue.emit({
        type: 'send',
        event: {
          type: 'ready',
          session_id: context.id,
          model: ready.model,
          task: ready.task,
          sample_rate: ready.sampleRate ?? 16_000,
          window_ms: ready.windowMs,
        },
      });
    }),
    /** The closing log line and metrics, once per stream. */
    log: ({ context, event }) => {
      const { registry, stats, route } = live.get(context.id)!;
      // Exit actions run before the transition's own: the code comes from the event that ends `live`.
      const code =
        event.type === 'DONE'
          ? context.doneCode
          : event.type === 'CUT' || event.type === 'FAILED' || event.type === 'PEER_CLOSED'
            ? event.code
            : (context.code ?? 1006);
      const cutReason = event.type === 'CUT' ? event.reason : context.cutReason;
      const model = stats.model;
      const outcome = code === CLOSE.NORMAL || code === CLOSE.GOING_AWAY ? 'ok' : `close_${code}`;
      registry.metrics.wsClosed.inc({ code: String(code) });
      if (model) registry.metrics.requests.inc({ model, outcome });
      registry.log.info(
        {
          route: route ?? 'stream',
          session_id: context.id,
          model,
          code,
          reason: cutReason ?? undefined,
          processed_ms: Math.round((stats.receivedSamples * 1000) / stats.rate),
          duration_ms: Math.round(performance.now() - context.openedAt),
        },
        'stream closed',
      );
    },
  },
  guards: {
    heartbeatOff: ({ context }) => context.limits.heartbeat_ms <= 0,
    idleOff: ({ context }) => context.limits.idle_ms <= 0,
    /** The client has been silent for `limits.idle_ms` (the figure comes with `IDLE_REPORT`). */
    idleExpired: ({ context, event }) => (event as { silentMs: number }).silentMs >= context.limits.idle_ms,
    alive: ({ context }) => context.alive,
    /** `work` has paused reading the socket (backpressure). */
    readingPaused: stateIn('#stream.live.intake.paused'),
    endedEarly: ({ context }) => context.ended,
    totalOn: ({ context }) => context.limits.total_ms > 0,
  },
  delays: {
    /** What is left of the idle deadline since the last message, ms (from the last `IDLE_REPORT`). */
    idleLeft: ({ context }) => context.idleLeftMs,
    heartbeat: ({ context }) => context.limits.heartbeat_ms,
    /**
     * The beacon ping's interval while the server has paused reading, ms: `heartbeat_ms`, at most {@link
     * PAUSED_PING_MS}.
     */
    pausedPing: ({ context }) => Math.min(context.limits.heartbeat_ms, PAUSED_PING_MS),
    total: ({ context }) => context.limits.total_ms,
    /** How long `closing` waits for the peer's close frame. */
    closeGrace: 1000,
    /** A deadline that fell due is judged one turn of the event loop later (a timer turn after an I/O poll). */
    settle: 1,
  },
}).createMachine({
  id: 'stream',
  context: ({ input }) => ({
    id: input.id,
    limits: input.limits,
    code: null,
    cutReason: null,
    doneCode: CLOSE.NORMAL,
    idleLeftMs: input.limits.idle_ms,
    alive: true,
    ended: false,
    openedAt: performance.now(),
  }),
  initial: 'live',
  states: {
    live: {
      type: 'parallel',
      invoke: { id: 'work', src: 'work', input: ({ context }) => ({ id: context.id }) },
      // The lease is released as `work` stops; the transport hears `released`.
      exit: ['log', emit({ type: 'released' })],
      after: {
        total: {
          guard: 'totalOn',
          actions: raise(({ context }) => cutFor(voxError('stream_too_long', { totalMs: context.limits.total_ms }))),
        },
      },
      on: {
        BAD_CONTROL: {
          actions: emit(({ event }) => ({ type: 'send', event: errorEvent(event.error) }) as StreamOutput),
        },
        PONG: { actions: assign({ alive: true }) },
        SEND_BLOCKED: [
          // The client may be blocked sending what the server does not read: the server gives up, and says so.
          {
            guard: 'readingPaused',
            actions: raise(({ context }) =>
              cutFor(voxError('server_behind', { maxBytes: context.limits.ws_max_buffered_bytes })),
            ),
          },
          {
            actions: raise(({ context }) =>
              cutFor(
                voxError('client_not_reading', {
                  detail: `over limits.ws_max_buffered_bytes (${context.limits.ws_max_buffered_bytes})`,
                }),
              ),
            ),
          },
        ],
        SEND_EXPIRED: {
          actions: raise(
            ({ context }) =>
              ({
                type: 'CUT',
                code: CLOSE.BUSY,
                reason: `client is not reading: a send waited over limits.send_timeout_ms (${context.limits.send_timeout_ms} ms)`,
              }) as CutEvent,
          ),
        },
        // Stop reading a flooding client at once: the rest of its flood is not parsed (nor its close frame: `closing`
        // ends at closeGrace).
        FLOODED: {
          actions: [
            raise(({ context }) => cutFor(voxError('stream_flooded', { perS: context.limits.ws_max_messages_per_s }))),
            emit({ type: 'pause' }),
          ],
        },
        GO_AWAY: {
          actions: raise(({ event }) => ({ type: 'CUT', code: CLOSE.GOING_AWAY, reason: event.reason }) as CutEvent),
        },
        CUT: {
          target: 'closing',
          actions: [
            assign({ code: ({ event }) => event.code, cutReason: ({ event }) => event.reason }),
            enqueueActions(({ enqueue, event }) => {
              if (event.error) enqueue.emit({ type: 'send', event: errorEvent(event.error) });
              enqueue.emit({ type: 'close', code: event.code, reason: closeReason(event.reason) });
            }),
          ],
        },
        FAILED: {
          target: 'closing',
          actions: [
            assign({ code: ({ event }) => event.code }),
            emit(({ event }) => ({ type: 'send', event: errorEvent(event.error) }) as StreamOutput),
            emit(
              ({ event }) =>
                ({ type: 'close', code: event.code, reason: closeReason(event.error.message) }) as StreamOutput,
            ),
          ],
        },
        PEER_CLOSED: {
          target: 'closed',
          actions: assign({ code: ({ context, event }) => context.code ?? event.code }),
        },
      },
      states: {
        phase: {
          initial: 'open',
          states: {
            open: {
              on: {
                READY: [
                  { guard: 'endedEarly', target: 'draining', actions: 'sendReady' },
                  { target: 'streaming', actions: 'sendReady' },
                ],
                // The client may end before it is ready; `work` keeps it for later.
                END: { actions: [assign({ ended: true }), sendTo('work', { type: 'END' })] },
                DRAIN: {
                  actions: raise({ type: 'CUT', code: CLOSE.GOING_AWAY, reason: 'server shutting down' } as CutEvent),
                },
              },
            },
            streaming: {
              on: {
                END: { target: 'draining', actions: [assign({ ended: true }), sendTo('work', { type: 'END' })] },
                DRAIN: {
                  target: 'draining',
                  actions: [
                    assign({ doneCode: CLOSE.GOING_AWAY, ended: true }),
                    sendTo('work', { type: 'END', handOver: true }),
                  ],
                },
              },
            },
            draining: {
              on: {
                DRAIN: { actions: assign({ doneCode: CLOSE.GOING_AWAY }) },
                DONE: {
                  target: '#stream.closing',
                  actions: [
                    assign({ code: ({ context }) => context.doneCode }),
                    emit(
                      ({ event }) =>
                        ({
                          type: 'send',
                          event: {
                            type: 'done',
                            processed_ms: event.processed_ms,
                            timing: event.timing,
                            ...(event.checkpoint ? { checkpoint: event.checkpoint } : {}),
                          },
                        }) as StreamOutput,
                    ),
                    emit(
                      ({ context }) =>
                        ({
                          type: 'close',
                          code: context.doneCode,
                          reason: context.doneCode === CLOSE.NORMAL ? 'done' : 'server shutting down',
                        }) as StreamOutput,
                    ),
                  ],
                },
              },
            },
          },
        },
        // Whether the server reads the socket: `work` pauses it while it holds too much unprocessed audio.
        intake: {
          initial: 'reading',
          states: {
            reading: { on: { PAUSE: { target: 'paused', actions: emit({ type: 'pause' }) } } },
            paused: { on: { RESUME: { target: 'reading', actions: emit({ type: 'resume' }) } } },
          },
        },
        idle: {
          initial: 'init',
          states: {
            // Transient: off when limits.idle_ms is 0 (no eventless check on every later event).
            init: { always: [{ guard: 'idleOff', target: 'off' }, { target: 'watching' }] },
            watching: {
              after: { idleLeft: 'due' },
              on: { PAUSE: 'suspended' },
            },
            // One turn of the event loop, so that input the server had not read yet counts.
            due: {
              after: { settle: { target: 'checking', actions: sendTo('work', { type: 'CHECK_IDLE' }) } },
              on: { PAUSE: 'suspended' },
            },
            // The server is not reading: the client's silence is not the client's. A full period again once it reads.
            suspended: {
              on: {
                RESUME: {
                  target: 'watching',
                  actions: assign({ idleLeftMs: ({ context }) => context.limits.idle_ms }),
                },
              },
            },
            checking: {
              on: {
                PAUSE: 'suspended',
                IDLE_REPORT: [
                  // After `end` the stream waits for the model, not the client: no idle deadline then.
                  { guard: 'endedEarly', target: 'off' },
                  {
                    guard: 'idleExpired',
                    actions: raise(({ context }) =>
                      cutFor(
                        voxError('stream_idle', {
                          idleMs: context.limits.idle_ms,
                          // A Wyoming connection's idle deadline is its own setting.
                          setting: live.get(context.id)?.route === 'wyoming' ? 'wyoming.idle_ms' : 'limits.idle_ms',
                        }),
                      ),
                    ),
                  },
                  {
                    target: 'watching',
                    actions: assign({
                      idleLeftMs: ({ context, event }) => Math.max(1, context.limits.idle_ms - event.silentMs),
                    }),
                  },
                ],
              },
            },
            off: {},
          },
        },
        heartbeat: {
          initial: 'init',
          states: {
            init: { always: [{ guard: 'heartbeatOff', target: 'off' }, { target: 'waiting' }] },
            waiting: {
              after: { heartbeat: 'due' },
              on: { PAUSE: 'suspended' },
            },
            // One turn of the event loop, so that a pong the server had not read yet counts.
            due: {
              after: {
                settle: [
                  { guard: 'alive', target: 'waiting', actions: [assign({ alive: false }), emit({ type: 'ping' })] },
                  {
                    actions: raise({
                      type: 'CUT',
                      code: CLOSE.GOING_AWAY,
                      reason: 'no pong: peer is gone',
                    } as CutEvent),
                  },
                ],
              },
              on: { PAUSE: 'suspended' },
            },
            // The server is not reading: pongs cannot be heard, so none is awaited; a full period again once
            // it reads. It still pings, as a beacon (every `pausedPing`), so that the client's own heartbeat
            // (voxserve/client `heartbeatMs`, 10 s by default) hears a server that is only behind.
            suspended: {
              after: { pausedPing: { target: 'suspended', reenter: true, actions: emit({ type: 'ping' }) } },
              on: { RESUME: { target: 'waiting', actions: assign({ alive: true }) } },
            },
            off: {},
          },
        },
      },
    },
    closing: {
      on: { PEER_CLOSED: 'closed' },
      after: { closeGrace: { target: 'closed', actions: emit({ type: 'terminate' }) } },
    },
    closed: { type: 'final' },
  },
});

export type StreamSocket = Actor<typeof streamSocketMachine>;

let socketSeq = 0;

/** A stream socket actor and its data plane. */
export interface StreamSocketHandle {
  actor: StreamSocket;
  /** Where the transport pushes binary frames (and notes control frames). */
  channel: StreamChannel;
}

/** The `work` actor logic a stream socket runs (another protocol brings its own, with the same events). */
export type StreamWorkLogic = typeof streamWork;

/**
 * The stream socket chart with another protocol's `work` actor, made once per logic: `provide`
 * builds a whole new machine (its state nodes), ~0.15 ms of the main thread per connection.
 */
const provided = new WeakMap<StreamWorkLogic, typeof streamSocketMachine>();
function providedFor(work: StreamWorkLogic): typeof streamSocketMachine {
  let machine = provided.get(work);
  if (!machine) provided.set(work, (machine = streamSocketMachine.provide({ actors: { work } })));
  return machine;
}

/**
 * Creates a stream socket actor as its own root actor (`socket:<n>`), sharing the server's
 * inspector. It is returned unstarted: the transport subscribes to what it emits
 * (`actor.on('*', ...)`), then starts it. Its live resources are dropped once it is final.
 * @param protocol another protocol's `work` actor and channel (the Wyoming endpoint): the chart,
 *   its deadlines, limits and drain stay the same.
 */
export function createStreamSocket(
  input: StreamSocketInput,
  inspect?: (e: InspectionEvent) => void,
  protocol?: { work: StreamWorkLogic; channel: StreamChannel },
): StreamSocketHandle {
  const id = randomUUID();
  const channel =
    protocol?.channel ?? new StreamChannel(input.limits.ws_max_messages_per_s, input.limits.send_timeout_ms);
  live.set(id, { ...input, channel, stats: { receivedSamples: 0, rate: 16_000 } });
  const machine = protocol ? providedFor(protocol.work) : streamSocketMachine;
  const actor = createActor(machine, { input: { id, limits: input.limits }, inspect, id: `socket:${++socketSeq}` });
  const drop = (): void => void live.delete(id);
  actor.subscribe({ complete: drop, error: drop });
  return { actor, channel };
}

/** The phase of a stream socket, for `/debug` counts: `open`, `streaming`, `draining`, `closing` or `closed`. */
export function streamPhase(actor: StreamSocket): string {
  const s = actor.getSnapshot();
  if (s.status !== 'active') return 'closed';
  if (s.matches('closing')) return 'closing';
  const phase = (s.value as { live?: { phase?: string } }).live?.phase;
  return phase ?? 'closed';
}
