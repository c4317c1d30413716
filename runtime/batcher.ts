import { SILERO, type VadJob, type VadResult } from './slot-protocol.js';
import type { SlotPool } from './slots.js';

interface Item {
  windows: Float32Array;
  state: Float32Array;
  context: Float32Array;
  at: number;
  resolve: (r: VadResult) => void;
  reject: (e: unknown) => void;
  signal?: AbortSignal;
}

/**
 * Dynamic batching for Silero VAD streams: the jobs of many streams (each its stream's ready
 * windows) are collected and run as one ragged batch (a row per stream) on a free slot, and
 * each row's probabilities, state and context go back to its stream. A batch is sent when it
 * holds `maxBatch` streams, when its oldest job has waited `maxDelayMs` for company, or as soon
 * as a slot frees up while jobs wait (under load, jobs gather while every slot is busy). A batch
 * holds its slot for its run only.
 */
export class VadBatcher {
  private pending: Item[] = [];
  private inFlight = 0;
  private timer: NodeJS.Timeout | null = null;

  /**
   * @param maxBatch streams (rows) per batch (1-512). @param maxDelayMs longest wait for company, ms.
   * @param onBatch called with each batch's size (for metrics).
   */
  constructor(
    private readonly pool: SlotPool,
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
  run(job: VadJob, signal?: AbortSignal): Promise<VadResult> {
    if (signal?.aborted) return Promise.reject(signal.reason);
    return new Promise((resolve, reject) => {
      this.pending.push({ windows: job.windows, state: job.state, context: job.context, at: Date.now(), resolve, reject, signal });
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
    const batch: Item[] = [];
    while (batch.length < this.maxBatch && this.pending.length) {
      const item = this.pending.shift()!;
      if (item.signal?.aborted) item.reject(item.signal.reason);
      else batch.push(item);
    }
    const rows = batch.length;
    if (!rows) return;
    const counts = batch.map((b) => b.windows.length / SILERO.WINDOW);
    const total = counts.reduce((a, b) => a + b, 0);
    const job: VadJob = {
      kind: 'vad',
      counts,
      windows: new Float32Array(total * SILERO.WINDOW),
      state: new Float32Array(rows * SILERO.STATE),
      context: new Float32Array(rows * SILERO.CONTEXT),
    };
    const starts: number[] = [];
    batch.forEach((b, r) => {
      starts.push(r ? starts[r - 1] + counts[r - 1] : 0);
      job.windows.set(b.windows, starts[r] * SILERO.WINDOW);
      job.state.set(b.state, r * SILERO.STATE);
      job.context.set(b.context, r * SILERO.CONTEXT);
    });
    this.inFlight++;
    this.onBatch(rows);
    (this.pool.run(job) as Promise<VadResult>)
      .then(
        (res) =>
          batch.forEach((b, r) =>
            b.resolve({
              kind: 'vad',
              probs: res.probs.slice(starts[r], starts[r] + counts[r]),
              state: res.state.slice(r * SILERO.STATE, (r + 1) * SILERO.STATE),
              context: res.context.slice(r * SILERO.CONTEXT, (r + 1) * SILERO.CONTEXT),
              ran: (res as { ran?: [number, number] }).ran,
            } as VadResult),
          ),
        (err) => batch.forEach((b) => b.reject(err)),
      )
      .finally(() => {
        this.inFlight--;
        this.schedule();
      });
  }
}
