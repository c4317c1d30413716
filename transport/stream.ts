import { randomUUID } from 'node:crypto';
import type { IncomingMessage } from 'node:http';
import type { WebSocket } from 'ws';
import type { Supervisor } from '../actors/supervisor.js';
import type { Lease } from '../runtime/admission.js';
import { checkFormat, PCM_ENCODINGS, PcmStreamDecoder, type PcmEncoding } from '../runtime/audio.js';
import { MAX_TIMEOUT_MS, type ServerConfig } from '../runtime/config.js';
import { invalid, toVoxError, VoxError } from '../runtime/errors.js';
import { createTaskSession, drain, type TaskEvent, type TaskSession } from '../runtime/tasks/index.js';
import type { LoadedModel } from '../runtime/loader.js';
import type { Job, VadJob } from '../runtime/slot-protocol.js';
import type { ModelEntry } from '../actors/model.js';
import { encodeEvent, type Subprotocol } from './codec.js';

/** WebSocket close codes (DESIGN.md section 4). */
export const CLOSE = { NORMAL: 1000, GOING_AWAY: 1001, POLICY: 1008, TOO_LARGE: 1009, INTERNAL: 1011, FORCE_UNLOAD: 1012, BUSY: 1013 } as const;

interface StreamParams {
  model: string;
  sampleRate: number;
  encoding: PcmEncoding;
  channels: number;
  busyTimeoutMs?: number;
}

function intParam(url: URL, name: string, dflt: number | undefined): number | undefined {
  const raw = url.searchParams.get(name);
  if (raw === null || raw === '') return dflt;
  if (!/^\d{1,10}$/.test(raw) || Number(raw) > MAX_TIMEOUT_MS) throw invalid(`${name}: must be an integer from 0 to ${MAX_TIMEOUT_MS}, got '${raw.slice(0, 32)}'`);
  return Number(raw);
}

/** @throws VoxError `invalid_request_error` naming the bad query parameter. */
export function parseStreamParams(url: URL): StreamParams {
  const model = url.searchParams.get('model');
  if (!model) throw invalid('model: required query parameter');
  const encoding = url.searchParams.get('encoding') ?? 's16le';
  if (!(PCM_ENCODINGS as readonly string[]).includes(encoding)) throw invalid(`encoding: must be one of ${PCM_ENCODINGS.join(', ')}, got '${encoding}'`);
  const params = {
    model,
    encoding: encoding as PcmEncoding,
    sampleRate: intParam(url, 'sample_rate', 16_000)!,
    channels: intParam(url, 'channels', 1)!,
    busyTimeoutMs: intParam(url, 'busy_timeout_ms', undefined),
  };
  checkFormat(params.sampleRate, params.channels);
  return params;
}

/** Windows (or steps) per slot job of a stream: bounds one stream's share of a batched run. */
const MAX_JOB_WINDOWS = 64;

/** Bytes a stream keeps from its client before `ready` (while queued or loading) before it stops reading. */
const MAX_EARLY_BYTES = 4 * 1024 * 1024;

/** Unprocessed audio (16 kHz samples) above which a stream stops reading its socket: 10 s. */
export const MAX_PENDING_SAMPLES = 160_000;

/** Close reasons are limited to 123 bytes by the WebSocket protocol. */
function reason(text: string): string {
  return Buffer.byteLength(text) <= 123 ? text : Buffer.from(text).subarray(0, 120).toString('utf8') + '...';
}

/**
 * One live stream on `/v1/stream` (a socket actor as a plain object): open -> streaming ->
 * draining -> closed. It takes its lease before preparing anything and holds it until the socket
 * has closed or it is cut off; audio is decoded, windowed and sent to the model's slots as it
 * arrives, and events go out as soon as they exist. Every wait has a deadline (limits.*): no
 * message for `idle_ms`, the whole stream past `total_ms`, a send not flushed within
 * `send_timeout_ms`, a heartbeat ping not answered; outbound bytes over
 * `ws_max_buffered_bytes` close it with 1013. Reading pauses while more than
 * {@link MAX_PENDING_SAMPLES} of audio wait for the model.
 */
export class StreamConnection {
  readonly id = randomUUID();
  state: 'open' | 'streaming' | 'draining' | 'closed' = 'open';
  private lease: Lease | null = null;
  private session: TaskSession | null = null;
  private decoder: PcmStreamDecoder | null = null;
  private loaded: LoadedModel | null = null;
  private readonly early: { data: Buffer; binary: boolean }[] = [];
  private earlyBytes = 0;
  private readonly gone = new AbortController();
  private pumping = false;
  private repump = false;
  private paused = false;
  private readonly t0 = performance.now();
  private queueMs = 0;
  /** Close code once the stream is done: 1000, or 1001 when the server drains it for shutdown. */
  private doneCode: number = CLOSE.NORMAL;
  private readonly timers: NodeJS.Timeout[] = [];
  private idleTimer: NodeJS.Timeout | null = null;
  private sendTimer: NodeJS.Timeout | null = null;
  private unflushed = 0;
  private alive = true;
  private entry: ModelEntry | undefined;
  /** Per received frame: samples received after it (16 kHz) and when it arrived (performance.now()). */
  private readonly arrivals: { end: number; at: number }[] = [];
  private lagWindows = 0;
  /** Why the server cut the connection off, if it did (for logs and tests). */
  cutReason: string | null = null;
  private readonly closedPromise: Promise<void>;
  private resolveClosed!: () => void;

  constructor(
    private readonly ws: WebSocket,
    private readonly protocol: Subprotocol,
    private readonly supervisor: Supervisor,
    private readonly config: ServerConfig,
    private readonly onClosed: (c: StreamConnection) => void,
  ) {
    this.closedPromise = new Promise((r) => (this.resolveClosed = r));
    const limits = config.limits;
    ws.on('error', () => this.finish(1006));
    ws.on('close', (code) => this.finish(code));
    ws.on('pong', () => (this.alive = true));
    ws.on('message', (data: Buffer, binary: boolean) => {
      this.touchIdle();
      if (this.state === 'open') {
        // Waiting for a lease or a load: keep what was sent, but stop reading past a cap.
        this.early.push({ data, binary });
        this.earlyBytes += data.length;
        if (this.earlyBytes > MAX_EARLY_BYTES && !this.paused) {
          this.paused = true;
          ws.pause();
        }
      } else if (this.state === 'streaming') {
        this.onMessage(data, binary);
      }
    });
    this.touchIdle();
    if (limits.total_ms > 0) {
      this.timers.push(setTimeout(() => this.cutOff(CLOSE.POLICY, `stream exceeded limits.total_ms (${limits.total_ms} ms)`), limits.total_ms));
    }
    if (limits.heartbeat_ms > 0) {
      this.timers.push(
        setInterval(() => {
          if (!this.alive) return this.cutOff(CLOSE.GOING_AWAY, 'no pong: peer is gone', false);
          this.alive = false;
          ws.ping();
        }, limits.heartbeat_ms),
      );
    }
  }

  /** Outbound bytes queued on the socket. */
  get bufferedBytes(): number {
    return this.ws.bufferedAmount;
  }

  /** Resolves once the connection is closed and its lease released. */
  get closedSignal(): Promise<void> {
    return this.closedPromise;
  }

  /** Validates the request, takes the lease, loads the model if needed, then sends `ready`. */
  async start(req: IncomingMessage): Promise<void> {
    let params: StreamParams;
    try {
      params = parseStreamParams(new URL(req.url ?? '/', 'http://x'));
      const entry = this.supervisor.require(params.model);
      this.entry = entry;
      this.lease = await entry.admit({
        requestTimeoutMs: params.busyTimeoutMs,
        signal: this.gone.signal,
        onRevoke: (why) => this.fail(toVoxError(why), toVoxError(why).type === 'shutting_down' ? CLOSE.GOING_AWAY : CLOSE.FORCE_UNLOAD),
      });
      if (this.closed) return this.lease.release();
      this.queueMs = performance.now() - this.t0;
      this.supervisor.metrics.queueWait.observe({ model: entry.id }, this.queueMs / 1000);
      this.decoder = await PcmStreamDecoder.create(params.encoding, params.sampleRate, params.channels);
      this.loaded = await entry.ensureReady(this.gone.signal);
      this.session = createTaskSession(entry.config, this.loaded.pool.info, undefined);
      if (this.closed || this.state === 'draining') return;
      this.state = 'streaming';
      this.send({ type: 'ready', session_id: this.id, model: entry.id, task: entry.config.task, sample_rate: 16_000 });
      for (const m of this.early.splice(0)) this.onMessage(m.data, m.binary);
      this.earlyBytes = 0;
      if (this.paused && this.session.pendingSamples <= MAX_PENDING_SAMPLES) {
        this.paused = false;
        this.ws.resume();
      }
    } catch (e) {
      if (this.closed) return;
      const err = toVoxError(e);
      const code = err.type === 'invalid_request_error' || err.type === 'not_found' ? CLOSE.POLICY : err.status === 503 ? CLOSE.BUSY : CLOSE.INTERNAL;
      this.fail(err, code);
    }
  }

  private get closed(): boolean {
    return this.state === 'closed';
  }

  private touchIdle(): void {
    const idle = this.config.limits.idle_ms;
    if (idle <= 0 || this.closed) return;
    if (this.idleTimer) clearTimeout(this.idleTimer);
    this.idleTimer = setTimeout(() => {
      if (this.state === 'open' || this.state === 'streaming') this.cutOff(CLOSE.POLICY, `no message for limits.idle_ms (${idle} ms)`);
    }, idle);
  }

  /** Sends an event; cuts the client off when it stops reading (buffer cap, send deadline). */
  private send(event: Record<string, unknown>): void {
    if (this.ws.readyState !== this.ws.OPEN) return;
    const limits = this.config.limits;
    if (this.ws.bufferedAmount > limits.ws_max_buffered_bytes) {
      return this.cutOff(CLOSE.BUSY, `client is not reading: over limits.ws_max_buffered_bytes (${limits.ws_max_buffered_bytes})`);
    }
    this.unflushed++;
    if (!this.sendTimer && limits.send_timeout_ms > 0) {
      this.sendTimer = setTimeout(() => this.cutOff(CLOSE.BUSY, `client is not reading: a send waited over limits.send_timeout_ms (${limits.send_timeout_ms} ms)`, false), limits.send_timeout_ms);
    }
    this.ws.send(encodeEvent(this.protocol, event), () => {
      if (--this.unflushed === 0 && this.sendTimer) {
        clearTimeout(this.sendTimer);
        this.sendTimer = null;
      }
    });
  }

  private emit = (e: TaskEvent): void => this.send({ ...e });

  /** Processing lag of each window finished since the last call: now - arrival of its last sample. */
  private recordLag(): void {
    const s = this.session!;
    const now = performance.now();
    for (; (this.lagWindows + 1) * s.step <= s.processedSamples; this.lagWindows++) {
      const end = (this.lagWindows + 1) * s.step;
      while (this.arrivals.length > 1 && this.arrivals[0].end < end) this.arrivals.shift();
      if (this.arrivals.length) this.entry?.recordLag(now - this.arrivals[0].at);
    }
  }

  private onMessage(data: Buffer, binary: boolean): void {
    if (binary) {
      if (this.state !== 'streaming') return;
      this.session!.push(this.decoder!.push(data));
      this.arrivals.push({ end: this.session!.receivedSamples, at: performance.now() });
      if (!this.paused && this.session!.pendingSamples > MAX_PENDING_SAMPLES) {
        this.paused = true;
        this.ws.pause();
      }
      void this.pump();
      return;
    }
    let msg: unknown;
    try {
      msg = JSON.parse(data.toString('utf8'));
    } catch {
      return this.send({ type: 'error', error: { type: 'invalid_request_error', message: 'control frame is not valid JSON; expected {"type":"end"}' } });
    }
    if (msg && typeof msg === 'object' && (msg as { type?: unknown }).type === 'end') {
      if (this.state === 'streaming') this.end();
      return;
    }
    this.send({ type: 'error', error: { type: 'invalid_request_error', message: `unknown control message type ${JSON.stringify((msg as { type?: unknown })?.type)}; expected "end"` } });
  }

  /** No more audio: flush, send the last events and `done`, then close. */
  private end(): void {
    this.state = 'draining';
    for (const e of this.session!.end()) this.emit(e);
    void this.pump();
  }

  /**
   * Runs every ready job, one at a time, in order; after `end`, sends `done` and closes. A call
   * made while it runs (more audio, or `end`, possibly in the same tick as the last job was
   * taken) makes it look for work once more before it stops.
   */
  private async pump(): Promise<void> {
    if (this.pumping) {
      this.repump = true;
      return;
    }
    this.pumping = true;
    try {
      const { pool, batcher } = this.loaded!;
      // A VAD stream's ready windows go through the batcher, which runs them with other streams'.
      const run = batcher ? (job: Job) => batcher.run(job as VadJob, this.gone.signal) : (job: Job) => pool.run(job, this.gone.signal);
      do {
        this.repump = false;
        await drain(this.session!, run, this.emit, MAX_JOB_WINDOWS, () => {
          this.recordLag();
          if (this.paused && this.session!.pendingSamples < MAX_PENDING_SAMPLES / 2) {
            this.paused = false;
            this.ws.resume();
          }
        });
      } while (this.repump);
    } catch (e) {
      if (!this.gone.signal.aborted) this.fail(toVoxError(e), CLOSE.INTERNAL);
      return;
    } finally {
      this.pumping = false;
    }
    if (this.paused) {
      this.paused = false;
      this.ws.resume();
    }
    if (this.state === 'draining' && this.session!.finished) {
      const wallMs = performance.now() - this.t0;
      const audioMs = this.session!.receivedSamples / 16;
      this.send({
        type: 'done',
        processed_ms: Math.round(audioMs),
        timing: { wall_ms: Math.round(wallMs), queue_ms: Math.round(this.queueMs), audio_duration_ms: Math.round(audioMs), rtf: audioMs ? Math.round((wallMs / audioMs) * 10_000) / 10_000 : 0 },
      });
      this.ws.close(this.doneCode, this.doneCode === CLOSE.NORMAL ? 'done' : 'server shutting down');
    }
  }

  /** Sends an `error` event, then closes with `code`; pending inference is dropped. */
  fail(err: VoxError, code: number): void {
    if (this.closed) return;
    this.send({ type: 'error', error: { type: err.type, message: err.message } });
    this.state = 'draining';
    this.gone.abort();
    this.ws.close(code, reason(err.message));
  }

  /**
   * Shutdown, phase 2: the stream is finished as if the client had sent `end` (its last events
   * and `done`, then close 1001). A stream not yet streaming is closed with 1001 at once.
   */
  drainForShutdown(): void {
    if (this.state === 'streaming') {
      this.doneCode = CLOSE.GOING_AWAY;
      this.end();
    } else if (this.state === 'draining') {
      this.doneCode = CLOSE.GOING_AWAY;
    } else if (this.state === 'open') {
      this.cutOff(CLOSE.GOING_AWAY, 'server shutting down', false);
    }
  }

  /** Shutdown, phase 3 (drain deadline passed): close 1001 with a reason, now. */
  goAway(why = 'server shutting down'): void {
    this.cutOff(CLOSE.GOING_AWAY, why, false);
  }

  /**
   * Cuts the connection off: an `error` event (unless `notify` is false) and a close frame if
   * they can still go out, then the lease is released at once and the socket is destroyed if
   * the peer does not complete the close within a second.
   */
  private cutOff(code: number, why: string, notify = true): void {
    if (this.closed) return;
    this.cutReason = why;
    if (notify && this.ws.bufferedAmount <= this.config.limits.ws_max_buffered_bytes) {
      this.ws.send(encodeEvent(this.protocol, { type: 'error', error: { type: code === CLOSE.BUSY ? 'server_busy' : 'invalid_request_error', message: why } }));
    }
    this.ws.close(code, reason(why));
    const ws = this.ws;
    setTimeout(() => ws.terminate(), 1000).unref();
    this.finish(code);
  }

  private finish(code: number): void {
    if (this.closed) return;
    const outcome = code === CLOSE.NORMAL || code === CLOSE.GOING_AWAY ? 'ok' : `close_${code}`;
    this.supervisor.metrics.wsClosed.inc({ code: String(code) });
    if (this.entry) this.supervisor.metrics.requests.inc({ model: this.entry.id, outcome });
    this.supervisor.log.info(
      { route: 'stream', session_id: this.id, model: this.entry?.id, state: this.state, code, reason: this.cutReason ?? undefined, processed_ms: Math.round((this.session?.receivedSamples ?? 0) / 16), duration_ms: Math.round(performance.now() - this.t0) },
      'stream closed',
    );
    this.state = 'closed';
    this.gone.abort();
    for (const t of this.timers) clearTimeout(t);
    if (this.idleTimer) clearTimeout(this.idleTimer);
    if (this.sendTimer) clearTimeout(this.sendTimer);
    this.decoder?.close();
    this.lease?.release();
    this.onClosed(this);
    this.resolveClosed();
  }
}
