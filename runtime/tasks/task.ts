import type { Job, JobResult, SlotInfo } from '../slots/slot-protocol.js';

/** Events a task emits while audio is processed (DESIGN.md section 4). Times are ms from stream start. */
export type TaskEvent =
  | { type: 'speech_start'; at_ms: number }
  | { type: 'speech_end'; start_ms: number; end_ms: number; confidence: number }
  | { type: 'detection'; label: string; score: number; at_ms: number }
  /**
   * VAD streams that ask for them (`probabilities=true`): the speech probability of the 32 ms
   * window starting at `at_ms`, or (`probability_interval_ms`) of each window starting in one
   * span, `at_ms` being the first one's start.
   */
  | { type: 'probability'; at_ms: number; p: number | number[] }
  /** Wake-word sessions with the option `scores`: each 80 ms step's score per label, the step ending at `at_ms`. */
  | { type: 'score'; at_ms: number; scores: Record<string, number> };

/**
 * One request's or stream's task state on the main thread: it buffers 16 kHz mono audio, cuts it
 * into jobs for the slots, and turns results into events. At most one job of a session is in
 * flight at a time, because each result carries the state the next job needs.
 */
export interface TaskSession {
  /** Appends 16 kHz mono float32 samples. */
  push(samples: Float32Array): void;
  /**
   * No more audio will come: the last partial window is padded with zeros and processed. Returns
   * the closing events when nothing is left to process (otherwise the last `accept` returns them).
   */
  end(): TaskEvent[];
  /** The next job over at most `maxSteps` windows/steps, or null if not enough audio is buffered. */
  nextJob(maxSteps: number): Job | null;
  /** Applies a job's result; returns the events it produced, in time order. */
  accept(result: JobResult): TaskEvent[];
  /** True once `end()` was called and every buffered sample has been processed. */
  readonly finished: boolean;
  /** Samples received so far (16 kHz). */
  readonly receivedSamples: number;
  /** Samples received and not yet sent to a slot. */
  readonly pendingSamples: number;
  /** Samples whose results have been accepted (at most `receivedSamples`). */
  readonly processedSamples: number;
  /** Samples per window (VAD, 512), step (wake word, 1280) or frame (denoise, 480). */
  readonly step: number;
  /** The rate `push` takes, Hz: 48 kHz for denoise; absent: 16 kHz. */
  readonly rate?: number;
}

/** Creates a session for one request or stream; `info` is what the model's slots reported at load. */
export type TaskSessionFactory = (info: SlotInfo) => TaskSession;

/**
 * Runs every job a session has ready, in order, through `run`; calls `emit` for each event and
 * `accepted` after each result is applied.
 */
export async function drain(
  session: TaskSession,
  run: (job: Job) => Promise<JobResult>,
  emit: (e: TaskEvent) => void,
  maxSteps: number,
  accepted: () => void = () => {},
): Promise<void> {
  for (let job = session.nextJob(maxSteps); job; job = session.nextJob(maxSteps)) {
    const result = await run(job);
    for (const e of session.accept(result)) emit(e);
    accepted();
  }
}

/**
 * Growable float32 buffer with cheap consumption from the front. What `take` returns is a view
 * of the buffer, not a copy: while it is lent (until `release`), making room moves the samples
 * to a second buffer kept for that (the two swap roles) instead of over the view; otherwise in
 * place. Buffers only grow: a new array every few frames costs the server more in garbage
 * collection (V8 collects in proportion to the memory allocated outside its heap) than the copy.
 */
export class SampleBuffer {
  private data = new Float32Array(0);
  /** The other buffer: the samples move there when room is needed while `data` is lent. */
  private spare = new Float32Array(0);
  private start = 0;
  private end = 0;
  /** The buffer the views `take` returned are of (`data` or `spare`), null when none is lent. */
  private lent: Float32Array | null = null;

  get length(): number {
    return this.end - this.start;
  }

  push(samples: Float32Array, scale = 1): void {
    if (this.end + samples.length > this.data.length) this.makeRoom(this.length + samples.length);
    if (scale === 1) this.data.set(samples, this.end);
    else for (let i = 0; i < samples.length; i++) this.data[this.end + i] = samples[i] * scale;
    this.end += samples.length;
  }

  /**
   * Moves the samples to the front of a buffer at most half full with `need` samples (so moves are amortized). A
   * buffer that must grow at least doubles: growing to just twice `need`, a stream falling behind (its unprocessed
   * samples at a new high on most pushes) made a new array nearly every time room was made.
   */
  private makeRoom(need: number): void {
    const old = this.data;
    const size = need * 2 <= old.length ? old.length : Math.max(need * 2, old.length * 2, 4096);
    if (this.lent !== old && size === old.length) {
      old.copyWithin(0, this.start, this.end);
    } else {
      const next = this.lent !== this.spare && this.spare.length >= size ? this.spare : new Float32Array(size);
      next.set(old.subarray(this.start, this.end), 0);
      this.data = next;
      this.spare = old;
    }
    this.end -= this.start;
    this.start = 0;
  }

  /**
   * Removes and returns the first `n` samples: a view, unchanged until {@link release}. One view is lent at a time:
   * take again only after `release` (a second take before it may move samples over the first view).
   */
  take(n: number): Float32Array {
    const out = this.data.subarray(this.start, this.start + n);
    this.start += n;
    this.lent = this.data;
    return out;
  }

  /** The views `take` returned are no longer used: room may be made in place again. */
  release(): void {
    this.lent = null;
  }
}

/**
 * The buffering every task session shares: audio in, whole windows (`step` samples) out, one
 * job in flight at a time, and the last partial window padded with zeros at `end()`.
 * Subclasses build the job from {@link takeWindows} and apply results in `accept`.
 */
export abstract class WindowedSession implements TaskSession {
  protected readonly pending = new SampleBuffer();
  protected received = 0;
  protected ended = false;
  private busy = false;

  /** A job is out (its windows are lent from the buffer); set false once its result is applied. */
  protected get inFlight(): boolean {
    return this.busy;
  }

  protected set inFlight(v: boolean) {
    this.busy = v;
    if (!v) this.pending.release();
  }

  /** @param step samples per window/step. @param scale applied to incoming samples. */
  constructor(
    readonly step: number,
    private readonly scale = 1,
  ) {}

  get receivedSamples(): number {
    return this.received;
  }

  /** The rate `push` takes, Hz (16 kHz unless a task says otherwise). */
  get rate(): number {
    return 16_000;
  }

  get pendingSamples(): number {
    return this.pending.length;
  }

  get finished(): boolean {
    return this.ended && !this.inFlight && this.pending.length === 0;
  }

  abstract readonly processedSamples: number;
  abstract nextJob(maxSteps: number): Job | null;
  abstract accept(result: JobResult): TaskEvent[];

  push(samples: Float32Array): void {
    this.pending.push(samples, this.scale);
    this.received += samples.length;
  }

  end(): TaskEvent[] {
    if (this.ended) return [];
    this.ended = true;
    const partial = this.pending.length % this.step;
    if (partial) this.pending.push(new Float32Array(this.step - partial));
    return this.finished ? this.closing() : [];
  }

  /** Events due when the session finishes with nothing left to run (see `end`). */
  protected closing(): TaskEvent[] {
    return [];
  }

  /**
   * Takes up to `maxSteps` whole windows for the next job and marks it in flight; null while a
   * job is in flight or no whole window is buffered.
   */
  protected takeWindows(maxSteps: number): { count: number; samples: Float32Array } | null {
    const count = Math.min(maxSteps, Math.floor(this.pending.length / this.step));
    if (this.inFlight || count === 0) return null;
    this.inFlight = true;
    return { count, samples: this.pending.take(count * this.step) };
  }
}
