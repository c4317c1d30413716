import { OWW, SILERO, type Job, type JobResult, type VadJob, type VadResult, type WakewordJob, type WakewordResult } from './slot-protocol.js';
import type { SlotPool } from './slots.js';

/**
 * How one task's stream jobs become one batched job (a row per stream) and its result becomes
 * one result per row again. Each row keeps its own state; the slot runs the rows together.
 */
export interface Packing<J extends Job, R extends JobResult> {
  pack(rows: J[]): J;
  unpack(result: R, rows: J[]): R[];
}

/** Concatenates equally typed arrays. */
function concat(parts: Float32Array[]): Float32Array {
  const out = new Float32Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}

/** Silero VAD: windows row after row with `counts`, state and context row by row (a ragged batch). */
export const vadPacking: Packing<VadJob, VadResult> = {
  pack: (rows) => ({
    kind: 'vad',
    counts: rows.map((r) => r.windows.length / SILERO.WINDOW),
    windows: concat(rows.map((r) => r.windows)),
    state: concat(rows.map((r) => r.state)),
    context: concat(rows.map((r) => r.context)),
  }),
  unpack: (res, rows) => {
    let at = 0;
    return rows.map((row, r) => {
      const n = row.windows.length / SILERO.WINDOW;
      at += n;
      return {
        kind: 'vad',
        probs: res.probs.slice(at - n, at),
        state: res.state.slice(r * SILERO.STATE, (r + 1) * SILERO.STATE),
        context: res.context.slice(r * SILERO.CONTEXT, (r + 1) * SILERO.CONTEXT),
      };
    });
  },
};

/** openWakeWord: each row's audio (look-back + steps), mel buffer and embedding history in turn, with `counts` (steps per row). */
export const wakewordPacking: Packing<WakewordJob, WakewordResult> = {
  pack: (rows) => ({
    kind: 'wakeword',
    counts: rows.map((r) => (r.audio.length - OWW.LOOKBACK) / OWW.STEP),
    audio: concat(rows.map((r) => r.audio)),
    mel: concat(rows.map((r) => r.mel)),
    embeddings: concat(rows.map((r) => r.embeddings)),
  }),
  unpack: (res, rows) => {
    const steps = rows.reduce((n, r) => n + (r.audio.length - OWW.LOOKBACK) / OWW.STEP, 0);
    const columns = res.scores.length / steps;
    const history = res.embeddings.length / rows.length;
    let at = 0;
    return rows.map((row, r) => {
      const n = (row.audio.length - OWW.LOOKBACK) / OWW.STEP;
      at += n;
      return {
        kind: 'wakeword',
        // Views, not copies: a wake-word session copies what it keeps (see WakewordSession.accept).
        scores: res.scores.subarray((at - n) * columns, at * columns),
        mel: res.mel.subarray(r * OWW.MEL_FRAMES * OWW.MEL_BINS, (r + 1) * OWW.MEL_FRAMES * OWW.MEL_BINS),
        embeddings: res.embeddings.subarray(r * history, (r + 1) * history),
      };
    });
  },
};

interface Item<J, R> {
  job: J;
  at: number;
  resolve: (r: R) => void;
  reject: (e: unknown) => void;
  signal?: AbortSignal;
}

/**
 * Dynamic batching for streams: the jobs of many streams (each its stream's ready windows or
 * steps) are collected and run as one batched job (a row per stream, see {@link Packing}) on a
 * free slot, and each row's result goes back to its stream. A batch is sent when it holds
 * `maxBatch` streams, when its oldest job has waited `maxDelayMs` for company, or as soon as a
 * slot frees up while jobs wait (under load, jobs gather while every slot is busy). A batch
 * holds its slot for its run only. One message per batch instead of one per stream is what
 * makes many streams cheap on process hosts.
 */
export class Batcher<J extends Job = Job, R extends JobResult = JobResult> {
  private pending: Item<J, R>[] = [];
  private inFlight = 0;
  private timer: NodeJS.Timeout | null = null;

  /**
   * @param packing how rows become a batch and back. @param maxBatch streams (rows) per batch (1-512).
   * @param maxDelayMs longest wait for company, ms. @param onBatch called with each batch's size (for metrics).
   */
  constructor(
    private readonly pool: SlotPool,
    private readonly packing: Packing<J, R>,
    private readonly maxBatch: number,
    private readonly maxDelayMs: number,
    private readonly onBatch: (size: number) => void = () => {},
  ) {}

  /**
   * Runs one stream's job (one row) in a batch with other streams'. A job whose `signal` has
   * aborted by the time its batch is formed is dropped (rejected with the signal's reason). No
   * listener is added to the signal: a stream sends thousands of jobs, and EventTarget
   * listeners are costly.
   */
  run(job: J, signal?: AbortSignal): Promise<R> {
    if (signal?.aborted) return Promise.reject(signal.reason);
    return new Promise((resolve, reject) => {
      this.pending.push({ job, at: Date.now(), resolve, reject, signal });
      this.schedule();
    });
  }

  private schedule(): void {
    if (!this.pending.length || this.inFlight >= this.pool.size) return;
    const waited = Date.now() - this.pending[0].at;
    if (this.pending.length >= this.maxBatch || waited >= this.maxDelayMs) return this.dispatch();
    this.timer ??= setTimeout(() => {
      this.timer = null;
      this.schedule();
    }, this.maxDelayMs - waited);
  }

  private dispatch(): void {
    if (this.timer) clearTimeout(this.timer);
    this.timer = null;
    const batch: Item<J, R>[] = [];
    while (batch.length < this.maxBatch && this.pending.length) {
      const item = this.pending.shift()!;
      if (item.signal?.aborted) item.reject(item.signal.reason);
      else batch.push(item);
    }
    if (!batch.length) return;
    const rows = batch.map((b) => b.job);
    this.inFlight++;
    this.onBatch(rows.length);
    (this.pool.run(this.packing.pack(rows)) as Promise<R>)
      .then(
        (res) => this.packing.unpack(res, rows).forEach((r, i) => batch[i].resolve(Object.assign(r, { ran: res.ran, waitedMs: res.waitedMs }))),
        (err) => batch.forEach((b) => b.reject(err)),
      )
      .finally(() => {
        this.inFlight--;
        this.schedule();
      });
  }
}
