import { SILERO, type VadJob, type VadResult } from './slot-protocol.js';
import type { SlotPool } from './slots.js';

interface Item {
  window: Float32Array;
  state: Float32Array;
  context: Float32Array;
  at: number;
  resolve: (r: VadResult) => void;
  reject: (e: unknown) => void;
  signal?: AbortSignal;
}

/**
 * Dynamic batching for Silero VAD streams: single-window jobs from many streams are collected
 * and run as one batched inference (`rows` = streams) on a free slot, and each row's
 * probability, state and context go back to its stream. A batch is sent when it is full
 * (`maxBatch`), when its oldest window has waited `maxDelayMs` for company, or as soon as a
 * slot frees up while windows wait (under load, windows gather while every slot is busy).
 * A batch holds its slot for its run only. Jobs of more than one window (files) bypass it.
 */
export class VadBatcher {
  private pending: Item[] = [];
  private inFlight = 0;
  private timer: NodeJS.Timeout | null = null;

  /**
   * @param maxBatch windows per batch (1-512). @param maxDelayMs longest wait for company, ms.
   * @param onBatch called with each batch's size (for metrics).
   */
  constructor(
    private readonly pool: SlotPool,
    private readonly maxBatch: number,
    private readonly maxDelayMs: number,
    private readonly onBatch: (size: number) => void = () => {},
  ) {}

  /**
   * Runs a VAD job: batched if it is one window of one stream, else directly on the pool.
   * An aborted `signal` drops a window that has not been sent (rejecting with `AbortError`).
   */
  run(job: VadJob, signal?: AbortSignal): Promise<VadResult> {
    if ((job.rows ?? 1) !== 1 || job.windows.length !== SILERO.WINDOW) return this.pool.run(job, signal) as Promise<VadResult>;
    if (signal?.aborted) return Promise.reject(signal.reason);
    return new Promise((resolve, reject) => {
      const item: Item = { window: job.windows, state: job.state, context: job.context, at: Date.now(), resolve, reject, signal };
      signal?.addEventListener(
        'abort',
        () => {
          const i = this.pending.indexOf(item);
          if (i >= 0) {
            this.pending.splice(i, 1);
            reject(signal.reason);
          }
        },
        { once: true },
      );
      this.pending.push(item);
      this.schedule();
    });
  }

  private schedule(): void {
    if (!this.pending.length || this.inFlight >= this.pool.slots.length) return;
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
    const batch = this.pending.splice(0, this.maxBatch);
    const rows = batch.length;
    const job: VadJob = {
      kind: 'vad',
      rows,
      windows: new Float32Array(rows * SILERO.WINDOW),
      state: new Float32Array(rows * SILERO.STATE),
      context: new Float32Array(rows * SILERO.CONTEXT),
    };
    batch.forEach((b, r) => {
      job.windows.set(b.window, r * SILERO.WINDOW);
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
              probs: res.probs.slice(r, r + 1),
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
