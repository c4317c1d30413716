import { Resampler } from '../runtime/audio/audio.js';
import { invalid, toVoxError, type VoxError } from '../runtime/errors.js';
import { RNNOISE } from '../runtime/slots/rnnoise.js';
import { CLOSE } from '../runtime/wire.js';
import type { Job, JobResult, SlotInfo } from '../runtime/slots/slot-protocol.js';
import { type Done, lapseOf } from '../runtime/batcher.js';
import type { ModelConfig } from '../runtime/config.js';
import type { Metrics } from '../runtime/telemetry.js';
import { createTaskSession, type DenoiseSession, type TaskEvent, type TaskSession } from '../runtime/tasks/index.js';
import type { ModelEntry } from './model.js';

/**
 * The request path every work actor shares (a WebSocket stream, a Wyoming connection, an HTTP
 * exchange): ask a model entry for a lease, have the model made ready, be told by events how it
 * went, and pump a task session's jobs through the slots. The work actors keep only what differs:
 * their framing and the events they send out.
 */

export { CLOSE } from '../runtime/wire.js';

/** The close code for a stream whose lease was revoked: 1001 at shutdown, else 1012 (a forced unload). */
export function revokeCloseCode(err: VoxError): number {
  return err.type === 'shutting_down' ? CLOSE.GOING_AWAY : CLOSE.FORCE_UNLOAD;
}

/** What a granted lease carries: the ready model and how to submit jobs to its slots. */
export interface Granted {
  model: string;
  config: ModelConfig;
  /** What the model's slots reported at load (task sessions are made from it). */
  info: SlotInfo;
  /**
   * Submits one job. Stream jobs go through the model's batcher when it has one; `waitMs` (files)
   * bounds the wait for a slot and runs it unbatched. Aborted when the lease ends.
   */
  run: (job: Job, waitMs?: number) => Promise<JobResult>;
  /**
   * {@link run} without a wait bound, its end told to `done` (a stream's jobs: no promise per job, see {@link
   * Batcher.submit}).
   */
  send: (job: Job, done: Done<JobResult>) => void;
  /** Time from the request to the grant of its lease (before any load), ms. */
  queueMs: number;
  /** Records one stream window's processing lag on the model entry, ms. */
  recordLag: (ms: number) => void;
  /** The model's busy-timeout ceiling, ms (0 = unbounded). */
  busyTimeoutMs: number;
}

/**
 * The answers to a lease request, each delivered at most once and in this order:
 * `LEASE_GRANTED` (lease held and the model ready) or `LEASE_REFUSED` (the wire error: busy,
 * stuck, a failed load; an `AbortError` once the holder released it before the grant); after a
 * grant, `LEASE_REVOKED` (forced unload, shutdown) with the error and the close code a stream
 * closes with. Nothing follows a refusal or a revocation.
 */
export type LeaseEvent =
  | { type: 'LEASE_GRANTED'; granted: Granted }
  | { type: 'LEASE_REFUSED'; error: unknown }
  | { type: 'LEASE_REVOKED'; error: VoxError; code: number };

/** A lease request in flight or held. */
export interface LeaseHandle {
  /** Aborted when the lease is released or revoked: pending jobs and waits end with it. */
  readonly signal: AbortSignal;
  /** Leaves the queue or gives the lease back (marks the model used). Idempotent. */
  release(): void;
}

/**
 * A place in a model's line of first jobs: `before` resolves once every earlier holder's first job is submitted (or its
 * lease ended); `done()` passes the turn on.
 */
interface Turn {
  readonly before: Promise<void>;
  done(): void;
}

/**
 * A model's line of first jobs (DESIGN.md section 3: every inference of every leased request runs
 * on the model's slots in arrival order). Requests that waited for a cold load are granted
 * together when it ends, then each prepares its input (a file is decoded in a decode worker):
 * without a line, whichever decodes first takes the slot (issue 25 item 15). A file request
 * that had to wait for the model to load, and any file request arriving while such turns are
 * still held, takes a turn in arrival order; its first job waits for every earlier turn. Warm
 * requests with nobody in line go as they come (unchanged), and streams never take turns (their
 * jobs follow their audio as it arrives; a silent stream would hold the line).
 */
class FirstJobs {
  private tail: Promise<void> = Promise.resolve();
  private held = 0;

  /** A turn if `cold` (the request waits for a load) or turns are held; otherwise null. */
  take(cold: boolean): Turn | null {
    if (!cold && this.held === 0) return null;
    this.held++;
    const before = this.tail;
    let pass!: () => void;
    const mine = new Promise<void>((resolve) => (pass = resolve));
    this.tail = before.then(() => mine);
    let over = false;
    return {
      before,
      done: () => {
        if (over) return;
        over = true;
        this.held--;
        pass();
      },
    };
  }
}

/**
 * The reason a lease's signal carries when it ends: one shared AbortError (a DOMException per
 * release, with its stack, cost a remote job's holder ~30 µs).
 */
const LEASE_ENDED = new DOMException('the lease ended', 'AbortError');

/** Each model's line of first jobs. */
const firstJobs = new WeakMap<ModelEntry, FirstJobs>();

/**
 * Asks `entry` for a lease (FIFO, within the busy timeout min(request, model, server)), loads the
 * model if needed, and answers by `deliver` (see {@link LeaseEvent}). The time queued is counted
 * in `voxserve_queue_wait_seconds`.
 * @param opts.requestTimeoutMs the request's own `busy_timeout_ms`, if it gave one.
 * @param opts.ordered a file request: its first job keeps its arrival order among requests that
 *   waited for a cold load ({@link FirstJobs}).
 */
export function requestLease(
  entry: ModelEntry,
  opts: { requestTimeoutMs?: number; metrics?: Metrics; ordered?: boolean },
  deliver: (e: LeaseEvent) => void,
): LeaseHandle {
  const t0 = performance.now();
  const ended = new AbortController();
  let answered: 'granted' | 'done' | null = null;
  let release: (() => void) | null = null;
  let turn: Turn | null = null;
  const answer = (e: LeaseEvent): void => {
    if (answered === 'done') return;
    answered = e.type === 'LEASE_GRANTED' ? 'granted' : 'done';
    if (answered === 'done') turn?.done();
    deliver(e);
  };
  void (async () => {
    const lease = await entry.admit({
      requestTimeoutMs: opts.requestTimeoutMs,
      signal: ended.signal,
      onRevoke: (why) => {
        const error = toVoxError(why);
        answer({ type: 'LEASE_REVOKED', error, code: revokeCloseCode(error) });
        ended.abort(LEASE_ENDED);
      },
    });
    release = () => {
      entry.touch();
      lease.release();
    };
    if (ended.signal.aborted) return release();
    const queueMs = performance.now() - t0;
    opts.metrics?.queueWait.observe({ model: entry.id }, queueMs / 1000);
    // Leases are granted in arrival order: the turn is taken now, before the load is awaited.
    if (opts.ordered) {
      let line = firstJobs.get(entry);
      if (!line) firstJobs.set(entry, (line = new FirstJobs()));
      turn = line.take(entry.state !== 'ready');
      if (turn) ended.signal.addEventListener('abort', () => turn?.done(), { once: true });
    }
    const { pool, batcher } = await entry.ensureReady(ended.signal);
    const signal = ended.signal;
    const submit = (job: Job, waitMs?: number): Promise<JobResult> =>
      batcher && waitMs === undefined ? batcher.run(job, signal) : pool.run(job, signal, waitMs);
    // The first job waits for its turn; once submitted (queued at the pool in order), the turn passes on.
    let gate: Promise<void> | null = turn?.before ?? null;
    const run = (job: Job, waitMs?: number): Promise<JobResult> => {
      if (!gate) return submit(job, waitMs);
      return untilAborted(gate, signal).then(() => {
        gate = null;
        const result = submit(job, waitMs);
        turn?.done();
        return result;
      });
    };
    const lapse = lapseOf(signal);
    const send = (job: Job, done: Done<JobResult>): void => {
      if (batcher && !gate) return batcher.submit(job, lapse, done);
      run(job).then((r) => done(null, r), done);
    };
    answer({
      type: 'LEASE_GRANTED',
      granted: {
        model: entry.id,
        config: entry.config,
        info: pool.info,
        run,
        send,
        queueMs,
        recordLag: (ms) => entry.recordLag(ms),
        busyTimeoutMs: entry.busyTimeoutMs,
      },
    });
  })().catch((error) => answer({ type: 'LEASE_REFUSED', error }));
  return {
    signal: ended.signal,
    release: () => {
      ended.abort(LEASE_ENDED);
      release?.();
      release = null;
    },
  };
}

/**
 * The promise form of {@link requestLease}: `granted` resolves on the grant and rejects on the
 * refusal, or with the revocation's error when the lease is revoked before the model was ready,
 * or with an `AbortError` when the handle is released before either (no answer comes for a lease
 * its holder ended: a peer's job cancelled while it waited for admission hung for good);
 * `onRevoke` hears every revocation.
 */
export function leaseGranted(
  entry: ModelEntry,
  opts: { requestTimeoutMs?: number; metrics?: Metrics; ordered?: boolean },
  onRevoke: (e: Extract<LeaseEvent, { type: 'LEASE_REVOKED' }>) => void,
): { handle: LeaseHandle; granted: Promise<Granted> } {
  let handle!: LeaseHandle;
  const granted = new Promise<Granted>((resolve, reject) => {
    const lease = requestLease(entry, opts, (e) => {
      if (e.type === 'LEASE_GRANTED') return resolve(e.granted);
      if (e.type === 'LEASE_REFUSED') return reject(e.error);
      onRevoke(e);
      reject(e.error);
    });
    handle = {
      signal: lease.signal,
      release: () => {
        lease.release();
        reject(lease.signal.reason);
      },
    };
  });
  granted.catch(() => {});
  return { handle, granted };
}

/** `work`, or the signal's reason as soon as it aborts. */
function untilAborted<T>(work: Promise<T>, signal: AbortSignal): Promise<T> {
  if (signal.aborted) return Promise.reject(signal.reason);
  return new Promise<T>((resolve, reject) => {
    const onAbort = (): void => reject(signal.reason);
    signal.addEventListener('abort', onAbort, { once: true });
    work.then(resolve, reject).finally(() => signal.removeEventListener('abort', onAbort));
  });
}

/**
 * Audio per slot job of a stream, at most, ms: bounds one stream's share of a batched run (a
 * stream that fell behind catches up in jobs of this much). VAD: 64 windows of 32 ms; wake
 * words: 25 steps of 80 ms (a job of 64 steps, 5 s of audio, held a slot ~170 ms on its own).
 */
export const MAX_JOB_MS = 2048;

/**
 * Runs a stream's task session through its lease, one job at a time and in order, and measures
 * the processing lag of each window (last sample arrival to result) on the model entry. A plain
 * callback loop (after each result it looks for the next job; jobs go by {@link Granted.send}),
 * not an async one: an async function per pump and per drain allocated ~1 KB of the ~5.8 KB the
 * main thread allocated per 100 ms frame (V8's sampling heap profiler, 300 VAD streams).
 */
export class JobPump {
  /** True while a job is in flight. */
  running = false;
  /** Callers of {@link drained} waiting for the pump to run dry. */
  private waiters: (() => void)[] = [];
  /** Per received chunk, oldest first from `head`: samples received after it, and when it arrived. */
  private readonly ends: number[] = [];
  private readonly ats: number[] = [];
  private head = 0;
  /** Windows whose lag is recorded: from the session's processed ones on (a resumed stream starts past 0). */
  private windows: number;
  /** Windows (or steps) per job: {@link MAX_JOB_MS} of audio. */
  private readonly maxSteps: number;

  /**
   * @param hooks.emit each task event; `accepted` after each result; `idle` when no job is left
   *   (not after a failure); `fail` with the error of a failed job (the pump stops).
   */
  constructor(
    readonly session: TaskSession,
    private readonly granted: Pick<Granted, 'send' | 'recordLag'>,
    private readonly hooks: {
      emit: (e: TaskEvent) => void;
      accepted?: () => void;
      idle?: () => void;
      fail: (e: unknown) => void;
    },
  ) {
    // MAX_JOB_MS of audio at the session's rate (16 kHz; a denoise stream's 48 kHz).
    this.maxSteps = Math.max(1, Math.floor((MAX_JOB_MS * ((session.rate ?? 16_000) / 1000)) / session.step));
    this.windows = Math.floor(session.processedSamples / session.step);
  }

  /** Samples arrived at `at` (performance.now(), ms), already pushed into the session. */
  arrived(at: number): void {
    this.ends.push(this.session.receivedSamples);
    this.ats.push(at);
  }

  /**
   * Runs every ready job, in order. While a job is in flight a call does nothing: the next job is looked for after each
   * result.
   */
  pump(): void {
    if (!this.running) this.next();
  }

  /** {@link pump}, resolved once no job is left, or a job failed (after `fail`). */
  drained(): Promise<void> {
    this.pump();
    if (!this.running) return Promise.resolve();
    return new Promise((resolve) => this.waiters.push(resolve));
  }

  /**
   * Sends the session's next job, or (none ready) goes idle. A throw fails the pump a microtask later, as a failed job
   * does.
   */
  private next(): void {
    let job: Job | null;
    try {
      job = this.session.nextJob(this.maxSteps);
    } catch (e) {
      this.running = true;
      queueMicrotask(() => this.failed(e));
      return;
    }
    if (!job) return this.rest();
    this.running = true;
    this.granted.send(job, this.done);
  }

  private rest(): void {
    this.running = false;
    this.hooks.idle?.();
    this.settle();
  }

  private readonly done = (error: unknown, result?: JobResult): void => {
    if (error !== null) return this.failed(error);
    try {
      for (const e of this.session.accept(result!)) this.hooks.emit(e);
      this.lagFinished();
      this.hooks.accepted?.();
    } catch (e) {
      return this.failed(e);
    }
    this.next();
  };

  private readonly failed = (e: unknown): void => {
    this.running = false;
    this.hooks.fail(e);
    this.settle();
  };

  private settle(): void {
    if (!this.waiters.length) return;
    const waiters = this.waiters;
    this.waiters = [];
    for (const resolve of waiters) resolve();
  }

  /** Records the lag of each window finished since the last call. */
  private lagFinished(): void {
    const now = performance.now();
    const { processedSamples: processed, step } = this.session;
    for (; (this.windows + 1) * step <= processed; this.windows++) {
      const end = (this.windows + 1) * step;
      while (this.head < this.ends.length - 1 && this.ends[this.head] < end) this.head++;
      if (this.head < this.ends.length) this.granted.recordLag(now - this.ats[this.head]);
    }
    if (this.head > 1024 && this.head * 2 > this.ends.length) {
      this.ends.splice(0, this.head);
      this.ats.splice(0, this.head);
      this.head = 0;
    }
  }
}

/**
 * The first link of a chain (`denoise=rnnoise` on a VAD or wake-word stream; `wyoming.denoise` on
 * a Wyoming connection): 48 kHz audio pushed into {@link session} (the decoder's output) is
 * denoised on the denoise model's slots, under that model's own lease (`granted`), and handed on
 * at 16 kHz, in order, to the next model(s) by `hooks.out`. A WebSocket stream and a Wyoming
 * connection both chain through it; an HTTP file chains through `denoisedAt16k` (actors/http.ts).
 */
export class ChainLink {
  /** The denoise session: push 48 kHz mono samples ([-1, 1]) into it, then `pump.arrived` and `pump.pump`. */
  readonly session: DenoiseSession;
  readonly pump: JobPump;
  /** Resolves {@link end}'s promise once the last audio has gone `out`. */
  private ending: (() => void) | null = null;
  private flushed = false;
  private closed = false;

  private constructor(
    granted: Granted,
    /** RNNoise's 48 kHz output to the 16 kHz the next model takes. */
    private readonly toNext: Resampler,
    hooks: ChainHooks,
  ) {
    const session = createTaskSession(granted.config, granted.info, undefined, false) as DenoiseSession;
    this.session = session;
    this.pump = new JobPump(session, granted, {
      emit: () => {},
      accepted: () => {
        if (this.closed) return;
        const out = toNext.push(session.takeOutput());
        if (out.length) hooks.out(out);
        hooks.accepted?.();
      },
      idle: () => {
        if (this.closed) return;
        hooks.idle?.();
        if (!session.finished || this.flushed) return;
        // The session is done: the resampler's tail, then the end is told.
        this.flushed = true;
        const tail = toNext.flush();
        if (tail.length) hooks.out(tail);
        this.ending?.();
      },
      fail: hooks.fail,
    });
  }

  /**
   * A link on the denoise model `granted` holds a lease on.
   * @param field the setting or parameter that named the model (`denoise`, `wyoming.denoise`), for the error.
   * @throws VoxError `invalid_request_error` naming `field` when `granted` is not a denoise model.
   */
  static async create(granted: Granted, field: string, hooks: ChainHooks): Promise<ChainLink> {
    if (granted.config.task !== 'denoise')
      throw invalid(field, `'${granted.model}' is a ${granted.config.task} model, not a denoise model (rnnoise)`);
    return new ChainLink(granted, await Resampler.create(RNNOISE.RATE, 16_000), hooks);
  }

  /** The link holds audio it has not handed on yet: a job in flight, or a whole frame waiting. */
  get busy(): boolean {
    return this.pump.running || this.session.pendingSamples >= this.session.step;
  }

  /**
   * No more audio comes: what the link holds is denoised and handed on (the resampler's tail
   * last). Resolves once all of it has gone `out`; never when a job failed (`hooks.fail` was told).
   */
  end(): Promise<void> {
    const done = new Promise<void>((resolve) => {
      this.ending = resolve;
    });
    this.session.end();
    this.pump.pump();
    return done;
  }

  /** Frees the resampler; results still to come are dropped. */
  close(): void {
    this.closed = true;
    this.toNext.close();
  }
}

/** What a {@link ChainLink} tells its owner. */
export interface ChainHooks {
  /** Denoised audio, 16 kHz mono in [-1, 1], in order (a view: copy what you keep beyond the call). */
  out: (samples: Float32Array) => void;
  /** After each job's audio has gone `out`. */
  accepted?: () => void;
  /** The link has no job left (before its end's tail goes `out`). */
  idle?: () => void;
  /** A job failed: the link stops. */
  fail: (e: unknown) => void;
}
