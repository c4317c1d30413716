import { existsSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { Worker } from 'node:worker_threads';
import { VoxError } from './errors.js';
import { transferList, type FromSlot, type Job, type JobResult, type LoadSpec, type SlotInfo, type ToSlot } from './slot-protocol.js';

/**
 * The compiled worker entry. Under the TypeScript sources (vitest) the worker still runs the
 * compiled `dist/runtime/slot-worker.js`, so `npm run build` must have run first.
 */
function workerFile(): URL {
  const sibling = new URL('./slot-worker.js', import.meta.url);
  if (existsSync(fileURLToPath(sibling))) return sibling;
  return new URL('../dist/runtime/slot-worker.js', import.meta.url);
}

/** What the pool needs of one slot; the real one is a worker thread, tests may use fakes. */
export interface SlotHost {
  readonly info: SlotInfo;
  /** Runs one job. Rejects if the job fails or the slot dies. */
  run(job: Job): Promise<JobResult>;
  /** Frees the sessions and stops the slot. Idempotent. */
  close(): Promise<void>;
  /** Called once if the slot dies on its own (not through close). */
  onExit(cb: (err: Error) => void): void;
}

/** Starts one slot and loads a model into it. */
export type SlotFactory = (spec: LoadSpec) => Promise<SlotHost>;

/** A slot worker thread (see slot-worker.ts). */
export class WorkerSlot implements SlotHost {
  info: SlotInfo = {};
  private seq = 0;
  private readonly pending = new Map<number, { resolve: (r: JobResult) => void; reject: (e: Error) => void }>();
  private loadWaiter: { resolve: () => void; reject: (e: Error) => void } | null = null;
  private exitCb: ((err: Error) => void) | null = null;
  private closing = false;
  private exited = false;
  private readonly exitPromise: Promise<void>;

  constructor(readonly worker: Worker) {
    worker.on('message', (m: FromSlot) => this.onMessage(m));
    worker.on('error', (e) => this.fail(e));
    this.exitPromise = new Promise((resolve) => {
      worker.on('exit', (code) => {
        this.exited = true;
        this.fail(new Error(`slot worker exited with code ${code}`));
        resolve();
      });
    });
  }

  private onMessage(m: FromSlot): void {
    if (m.type === 'loaded') {
      this.info = m.info;
      this.loadWaiter?.resolve();
    } else if (m.type === 'result' || (m.type === 'error' && m.seq !== undefined)) {
      const p = this.pending.get(m.seq!);
      this.pending.delete(m.seq!);
      if (m.type === 'result') p?.resolve(m.result);
      else p?.reject(new VoxError('server_error', `inference failed: ${m.message}`));
    } else if (m.type === 'error') {
      this.loadWaiter?.reject(new Error(m.message));
    }
  }

  private fail(e: Error): void {
    const err = new VoxError('server_error', `slot failed: ${e.message}`, { cause: e });
    this.loadWaiter?.reject(err);
    this.loadWaiter = null;
    for (const p of this.pending.values()) p.reject(err);
    this.pending.clear();
    if (!this.closing) {
      this.closing = true;
      const cb = this.exitCb;
      this.exitCb = null;
      cb?.(err);
      // An 'error' event means the thread is already gone; ask it to exit in case it is not.
      if (!this.exited) this.send({ type: 'release' });
    }
  }

  load(spec: LoadSpec): Promise<void> {
    return new Promise((resolve, reject) => {
      this.loadWaiter = { resolve, reject };
      this.send({ type: 'load', spec });
    });
  }

  private send(msg: ToSlot, transfer: ArrayBuffer[] = []): void {
    if (!this.exited) this.worker.postMessage(msg, transfer);
  }

  run(job: Job): Promise<JobResult> {
    if (this.closing) return Promise.reject(new VoxError('server_error', 'slot is closed'));
    const seq = ++this.seq;
    return new Promise((resolve, reject) => {
      this.pending.set(seq, { resolve, reject });
      this.send({ type: 'run', seq, job }, transferList(job));
    });
  }

  /**
   * Asks the worker to release its sessions and exit, and waits until it has. A job still running
   * finishes first: the worker is never terminated from outside, because terminating a thread
   * inside an onnxruntime call aborts the whole process.
   */
  async close(): Promise<void> {
    if (!this.closing && !this.exited) {
      this.closing = true;
      this.exitCb = null;
      this.send({ type: 'release' });
    }
    await this.exitPromise;
  }

  onExit(cb: (err: Error) => void): void {
    this.exitCb = cb;
  }
}

/** Starts a slot worker thread and loads `spec` into it. Rejects (and stops the worker) if the load fails. */
export const startWorkerSlot: SlotFactory = async (spec) => {
  const slot = new WorkerSlot(new Worker(workerFile()));
  try {
    await slot.load(spec);
    return slot;
  } catch (e) {
    await slot.close();
    throw e;
  }
};

interface QueuedRun {
  job: Job;
  resolve: (r: JobResult) => void;
  reject: (e: Error) => void;
  signal?: AbortSignal;
  onAbort?: () => void;
}

/**
 * A model's slots: the primary and its clones. Jobs from every leased request run in arrival
 * order on the first free slot (one job per slot at a time).
 */
export class SlotPool {
  private readonly idle: SlotHost[];
  /** Slots running a job, with when the job started (ms since the epoch). */
  private readonly running = new Map<SlotHost, number>();
  private readonly queue: QueuedRun[] = [];
  private failure: Error | null = null;
  private failCb: ((err: Error) => void) | null = null;
  /** Called with each finished job's run time, ms (for metrics). */
  onRun: ((ms: number) => void) | null = null;

  private constructor(readonly slots: readonly SlotHost[]) {
    this.idle = [...slots];
    for (const s of slots) {
      s.onExit((err) => this.fail(err instanceof VoxError ? err : new VoxError('server_error', `slot failed: ${err.message}`, { cause: err })));
    }
  }

  /**
   * Builds the primary, then the clones (in parallel). Only a complete pool is returned: on any
   * failure the clones are closed before the primary and the error is rethrown.
   * @param count slots, 1-16.
   */
  static async start(spec: LoadSpec, count: number, factory: SlotFactory = startWorkerSlot): Promise<SlotPool> {
    const primary = await factory(spec);
    const clones = await Promise.allSettled(Array.from({ length: count - 1 }, () => factory(spec)));
    const failed = clones.find((c): c is PromiseRejectedResult => c.status === 'rejected');
    if (failed) {
      for (const c of clones) if (c.status === 'fulfilled') await c.value.close();
      await primary.close();
      throw failed.reason;
    }
    return new SlotPool([primary, ...clones.map((c) => (c as PromiseFulfilledResult<SlotHost>).value)]);
  }

  /** What the primary reported at load. */
  get info(): SlotInfo {
    return this.slots[0].info;
  }

  /** Slots running a job now. */
  get activeSlots(): number {
    return this.running.size;
  }

  /**
   * Stuck work (DESIGN.md C4): true when every slot is running a job that started more than
   * `timeoutMs` ago. Always false for `timeoutMs` 0 (unbounded).
   */
  allOverdue(timeoutMs: number, now = Date.now()): boolean {
    if (timeoutMs <= 0 || this.running.size < this.slots.length) return false;
    for (const started of this.running.values()) if (now - started <= timeoutMs) return false;
    return true;
  }

  /** Called once if a slot dies: the pool is then failed and must be closed. */
  onFailure(cb: (err: Error) => void): void {
    this.failCb = cb;
  }

  /**
   * Queues a job; it runs when a slot is free and every earlier job has started.
   * An aborted `signal` drops a job that has not started (rejecting with `AbortError`);
   * a started job's result is still delivered, and the caller discards it.
   */
  run(job: Job, signal?: AbortSignal): Promise<JobResult> {
    if (this.failure) return Promise.reject(this.failure);
    if (signal?.aborted) return Promise.reject(abortError());
    return new Promise((resolve, reject) => {
      const q: QueuedRun = { job, resolve, reject, signal };
      if (signal) {
        q.onAbort = () => {
          const i = this.queue.indexOf(q);
          if (i >= 0) {
            this.queue.splice(i, 1);
            reject(abortError());
          }
        };
        signal.addEventListener('abort', q.onAbort, { once: true });
      }
      this.queue.push(q);
      this.dispatch();
    });
  }

  private dispatch(): void {
    while (this.idle.length && this.queue.length) {
      const slot = this.idle.shift()!;
      const q = this.queue.shift()!;
      if (q.onAbort) q.signal!.removeEventListener('abort', q.onAbort);
      this.running.set(slot, Date.now());
      slot
        .run(q.job)
        .then((r) => {
          if (r.ran) this.onRun?.(r.ran[1] - r.ran[0]);
          q.resolve(r);
        }, q.reject)
        .finally(() => {
        this.running.delete(slot);
        if (this.failure) return;
        this.idle.push(slot);
        this.dispatch();
      });
    }
  }

  private fail(err: Error): void {
    if (this.failure) return;
    this.failure = err;
    for (const q of this.queue.splice(0)) q.reject(err);
    this.failCb?.(err);
  }

  /** Stops every slot: clones first, then the primary. Queued jobs are rejected. */
  async close(): Promise<void> {
    this.failCb = null;
    this.fail(new VoxError('server_error', 'model unloaded'));
    for (const s of [...this.slots].reverse()) await s.close();
  }
}

function abortError(): Error {
  return new DOMException('the client went away', 'AbortError');
}
