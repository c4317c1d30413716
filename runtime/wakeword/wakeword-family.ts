import { readFile } from 'node:fs/promises';
import { headInfo } from '../onnx-file.js';
import type { Job, JobResult, LoadSpec, SlotInfo } from '../slots/slot-protocol.js';
import { SlotPool, type ModelPool, type SlotFactory } from '../slots/slots.js';

/**
 * Wake words share their features (issue 22): every wake-word model (a single head, an ad hoc
 * group, a configured group) with the same feature models, slot count and slot-host settings runs
 * on one family of slot hosts that hold the melspectrogram and embedding models once and load
 * each head the first time a job names it. A model is a {@link FamilyView} of its family: its
 * jobs carry its heads' files, and its `SlotInfo` (each head's window and labels) is read from
 * the head files here, on the main thread, without onnxruntime. So `alexa`, `hey-jarvis` and
 * `alexa,hey-jarvis` cost three model entries (admission, leases, status) and three heads, not
 * three sets of slot hosts. The family starts with its first model and stops with its last; a
 * head no model of the family names any more is released by its hosts at their next job.
 */

/** One family: its pool (once started), the models using it, and what they do when it fails. */
interface Family {
  pool: Promise<SlotPool>;
  views: Set<FamilyView>;
  failed: boolean;
  /** Every head file its models name (sent with each job: the hosts release the heads of models gone). */
  keep: string[];
}

/** The head files `views` name, each once. */
const keepOf = (views: Set<FamilyView>): string[] => [...new Set([...views].flatMap((v) => v.heads))];

/** The shared slot hosts of the wake-word models, by family key (feature models, slots, host settings). */
export class WakewordFamilies {
  private readonly families = new Map<string, Family>();

  /**
   * A model's view of the family `key`, starting the family (`spec` on `count` slots) if there is
   * none, or none that has not failed.
   * @param heads the model's heads' files, in order.
   * @throws Error when the family's pool cannot start (every model waiting for it fails the same),
   *   or a head file is not a head (its problem).
   */
  async acquire(
    key: string,
    spec: LoadSpec,
    count: number,
    factory: SlotFactory,
    heads: string[],
    opts: { signal?: AbortSignal; loadTimeoutMs?: number } = {},
  ): Promise<FamilyView> {
    const info = await viewInfo(heads);
    let family = this.families.get(key);
    if (!family || family.failed) {
      const pool = SlotPool.start(spec, count, factory, opts);
      const f: Family = { pool, views: new Set(), failed: false, keep: [] };
      family = f;
      this.families.set(key, f);
      pool.then(
        (p) => {
          p.onFailure((err) => {
            f.failed = true;
            if (this.families.get(key) === f) this.families.delete(key);
            for (const v of [...f.views]) v.failed(err);
          });
          p.onHostExit = (why, respawn) => {
            for (const v of f.views) v.onHostExit?.(why, respawn);
          };
          // The slots are shared: stuck for one model, stuck for all (C4).
          p.onStuck = (stuck) => {
            for (const v of f.views) v.onStuck?.(stuck);
          };
        },
        () => {
          if (this.families.get(key) === f) this.families.delete(key);
        },
      );
    }
    const f = family;
    const pool = await f.pool;
    // The family's overdue limit: the shortest busy timeout of its models (0 = unbounded).
    const limits = (): void => {
      const ms = [...f.views].map((v) => v.waitTimeoutMs).filter((v) => v > 0);
      pool.waitTimeoutMs = ms.length ? Math.min(...ms) : 0;
    };
    const view = new FamilyView(
      pool,
      heads,
      { ...info, initialEmbeddings: pool.info.initialEmbeddings },
      () => f.views.size,
      limits,
      () => f.keep,
      () => {
        f.views.delete(view);
        f.keep = keepOf(f.views);
        limits();
        if (f.views.size > 0) return Promise.resolve();
        if (this.families.get(key) === f) this.families.delete(key);
        return pool.close();
      },
    );
    f.views.add(view);
    f.keep = keepOf(f.views);
    return view;
  }

  /** Families running now. */
  get size(): number {
    return this.families.size;
  }
}

/** A model's `SlotInfo` heads from its head files (as a slot host reports them at load). */
async function viewInfo(heads: string[]): Promise<SlotInfo> {
  const out: NonNullable<SlotInfo['heads']> = [];
  for (const path of heads) {
    const h = headInfo(await readFile(path));
    if ('problem' in h) throw new Error(`${path}: ${h.problem}`);
    out.push(h);
  }
  return { heads: out };
}

/**
 * One wake-word model's pool: its family's slots, its own heads. Its jobs name its heads; its
 * waits, run times, host exits and failure are its own; closing it releases the family.
 */
export class FamilyView implements ModelPool {
  onRun: ((ms: number) => void) | null = null;
  onHostExit: ((why: string, respawn: boolean) => void) | null = null;
  /** Called when the family's slots turn stuck and when they move again (see `SlotPool.onStuck`). */
  onStuck: ((stuck: boolean) => void) | null = null;
  private waitMs = 0;
  private failCb: ((err: Error) => void) | null = null;
  private failure: Error | null = null;
  private closed: Promise<void> | null = null;
  private running = 0;

  constructor(
    private readonly pool: SlotPool,
    /** This model's head files. */
    readonly heads: string[],
    readonly info: SlotInfo,
    private readonly members: () => number,
    private readonly limitsChanged: () => void,
    /** Every head file the family's models name now. */
    private readonly keep: () => string[],
    private readonly release: () => Promise<void>,
  ) {}

  /**
   * This model's longest wait for a slot, ms (its busy timeout; 0 = unbounded); the family's overdue limit is the
   * shortest.
   */
  get waitTimeoutMs(): number {
    return this.waitMs;
  }

  set waitTimeoutMs(ms: number) {
    this.waitMs = ms;
    this.limitsChanged();
  }

  get size(): number {
    return this.pool.size;
  }

  get capacity(): number {
    return this.pool.capacity;
  }

  /** The family's jobs waiting for a slot (its slots are shared: this is their load). */
  get queued(): number {
    return this.pool.queued;
  }

  /** The family's jobs sent to its slots and not yet settled. */
  get inFlight(): number {
    return this.pool.inFlight;
  }

  get slots(): SlotPool['slots'] {
    return this.pool.slots;
  }

  /** This model's jobs running now. */
  get activeSlots(): number {
    return this.running;
  }

  /** The family's slots' busy time (SlotPool `busyMs`; its slots are shared: this is their load), ms. */
  busyMs(now?: number): number {
    return this.pool.busyMs(now);
  }

  /** Its share of the family's slot hosts' memory: theirs divided by the models using them. */
  residentBytes(): number {
    return Math.round(this.pool.residentBytes() / Math.max(1, this.members()));
  }

  onFailure(cb: (err: Error) => void): void {
    this.failCb = cb;
  }

  /** The family failed: this model's pool with it. */
  failed(err: Error): void {
    if (this.failure) return;
    this.failure = err;
    const cb = this.failCb;
    this.failCb = null;
    cb?.(err);
  }

  /** Runs a job of this model on the family's slots, with this model's heads (see `SlotPool.run`). */
  async run(job: Job, signal?: AbortSignal, waitMs = 0, behind = false): Promise<JobResult> {
    if (this.failure) throw this.failure;
    const limit = [waitMs, this.waitTimeoutMs].filter((v) => v > 0);
    this.running++;
    try {
      const r = await this.pool.run(
        job.kind === 'wakeword' ? { ...job, heads: this.heads, keep: this.keep() } : job,
        signal,
        limit.length ? Math.min(...limit) : 0,
        behind,
      );
      if (r.ran) this.onRun?.(r.ran[1] - r.ran[0]);
      return r;
    } finally {
      this.running--;
    }
  }

  /** Releases the family (its last model stops its slot hosts). Idempotent. */
  close(): Promise<void> {
    this.failCb = null;
    this.closed ??= this.release();
    return this.closed;
  }
}
