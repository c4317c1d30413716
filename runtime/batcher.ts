import { RNNOISE } from './slots/rnnoise.js';
import {
  type DenoiseJob,
  type DenoiseResult,
  OWW,
  SILERO,
  type Job,
  type JobResult,
  type VadJob,
  type VadResult,
  type WakewordJob,
  type WakewordResult,
} from './slots/slot-protocol.js';
import type { ModelPool } from './slots/slots.js';

/** A result with when its slot ran it and how long it waited for one (see {@link JobResult}). */
type Timed<R> = R & Pick<JobResult, 'ran' | 'waitedMs'>;

/**
 * How one task's stream jobs become one batched job (a row per stream) and its result becomes
 * one result per row again. Each row keeps its own state; the slot runs the rows together.
 */
export interface Packing<J extends Job, R extends JobResult> {
  /**
   * Packs `rows` into one job whose arrays come from `arena` (reset it only once the job's result is back; default: a
   * new one).
   */
  pack(rows: J[], arena?: Arena): J;
  /**
   * One result per row: views into `result`'s arrays (a session copies what it keeps, or keeps the
   * view), each with the batch's `ran` and `waitedMs`.
   */
  unpack(result: Timed<R>, rows: J[]): Timed<R>[];
  /**
   * Runs (steps) a slot makes for a batch holding this row, when a batch runs row by row in
   * lockstep (VAD: a batch makes as many runs as its longest row has windows, a run holding every
   * row that still has a window): the batcher then keeps rows of more steps out of a full batch.
   * Absent: rows run one after another.
   */
  steps?(row: J): number;
  /**
   * Steps a slot runs for this row alone, when a batch's rows run one after another (wake words:
   * a batch takes as long as all its rows' steps together, and holding many gains nothing but
   * messages). The batcher then gives a batch at most its fair share of the waiting steps, so
   * that one slot does not take a backlog whole while the others run dry.
   */
  serial?(row: J): number;
}

/**
 * Float32Arrays for a batch's packed job, carved out of one buffer kept from batch to batch: a
 * job of a few hundred KB per batch, allocated afresh, costs the main thread more in garbage
 * collection (V8 collects in proportion to the memory allocated outside its heap) than copying
 * it. A batch's arena is reset only once its result is back: until then a slot host (a thread's
 * structured clone, a process's shared file) may still read the job.
 */
export class Arena {
  private buffer = new Float32Array(0);
  private at = 0;

  /** Starts carving from the beginning again (the previous job is done with). */
  reset(): void {
    this.at = 0;
  }

  /** `parts` concatenated into the next free region. */
  concat(parts: Float32Array[]): Float32Array {
    let n = 0;
    for (const p of parts) n += p.length;
    if (this.at + n > this.buffer.length) {
      // Views already handed out keep the old buffer alive until their job is done.
      this.buffer = new Float32Array(Math.max(2 * this.buffer.length, this.at + n, 4096));
    }
    const out = this.buffer.subarray(this.at, this.at + n);
    this.at += n;
    let at = 0;
    for (const p of parts) {
      out.set(p, at);
      at += p.length;
    }
    return out;
  }
}

/** Silero VAD: windows row after row with `counts`, state and context row by row (a ragged batch). */
export const vadPacking: Packing<VadJob, VadResult> = {
  steps: (row) => row.windows.length / SILERO.WINDOW,
  pack: (rows, arena = new Arena()) => ({
    kind: 'vad',
    counts: rows.map((r) => r.windows.length / SILERO.WINDOW),
    windows: arena.concat(rows.map((r) => r.windows)),
    state: arena.concat(rows.map((r) => r.state)),
    context: arena.concat(rows.map((r) => r.context)),
  }),
  unpack: (res, rows) => {
    let at = 0;
    return rows.map((row, r) => {
      const n = row.windows.length / SILERO.WINDOW;
      at += n;
      return {
        kind: 'vad',
        // Views, not copies: a VAD session copies its state and context (see VadSession.accept).
        probs: res.probs.subarray(at - n, at),
        state: res.state.subarray(r * SILERO.STATE, (r + 1) * SILERO.STATE),
        context: res.context.subarray(r * SILERO.CONTEXT, (r + 1) * SILERO.CONTEXT),
        ran: res.ran,
        waitedMs: res.waitedMs,
      };
    });
  },
};

/**
 * openWakeWord: each row's audio (look-back + steps), mel buffer and embedding history in turn, with `counts` (steps
 * per row).
 */
export const wakewordPacking: Packing<WakewordJob, WakewordResult> = {
  serial: (row) => (row.audio.length - OWW.LOOKBACK) / OWW.STEP,
  pack: (rows, arena = new Arena()) => ({
    kind: 'wakeword',
    counts: rows.map((r) => (r.audio.length - OWW.LOOKBACK) / OWW.STEP),
    audio: arena.concat(rows.map((r) => r.audio)),
    mel: arena.concat(rows.map((r) => r.mel)),
    embeddings: arena.concat(rows.map((r) => r.embeddings)),
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
        ran: res.ran,
        waitedMs: res.waitedMs,
      };
    });
  },
};

/**
 * RNNoise: each row's frames and state in turn, with `rows` (frames per row). The slot runs the
 * rows one after another (RNNoise has no batch dimension): batching saves messages, not compute,
 * so a batch takes at most its fair share of the waiting frames (`serial`).
 */
export const denoisePacking: Packing<DenoiseJob, DenoiseResult> = {
  serial: (row) => row.audio.length / RNNOISE.FRAME,
  pack: (rows, arena = new Arena()) => ({
    kind: 'denoise',
    rows: rows.map((r) => r.audio.length / RNNOISE.FRAME),
    audio: arena.concat(rows.map((r) => r.audio)),
    state: arena.concat(rows.map((r) => r.state)),
  }),
  unpack: (res, rows) => {
    let at = 0;
    return rows.map((row, r) => {
      const n = row.audio.length / RNNOISE.FRAME;
      at += n;
      return {
        kind: 'denoise',
        // Views, not copies: a denoise session copies what it keeps (see DenoiseSession.accept).
        audio: res.audio.subarray((at - n) * RNNOISE.FRAME, at * RNNOISE.FRAME),
        probs: res.probs.subarray(at - n, at),
        state: res.state.subarray(r * RNNOISE.STATE_FLOATS, (r + 1) * RNNOISE.STATE_FLOATS),
        ran: res.ran,
        waitedMs: res.waitedMs,
      };
    });
  },
};

/**
 * How a job's end is told: `done(null, result)`, or `done(error)`. Never called synchronously
 * from {@link Batcher.submit} itself.
 */
export type Done<R> = (error: unknown, result?: R) => void;

/**
 * Calls `done`; a throw there does not keep the batch's other rows from their results: it is
 * raised again as an unhandled rejection, as it was when each row's result was a promise.
 */
function tell<R>(done: Done<R>, error: unknown, result?: R): void {
  try {
    done(error, result);
  } catch (e) {
    void Promise.reject(e);
  }
}

/**
 * Steps of a batch whose rows run one after another (wake words) that are never split among the
 * slots: 16 steps of 80 ms, 1.28 s of audio, 20-40 ms of a slot on the machines measured.
 */
export const SERIAL_BATCH_STEPS = 16;

/**
 * Whether a job's holder has gone: an AbortSignal, or (on the streams' path) a plain object that
 * mirrors one ({@link lapseOf}): AbortSignal's `aborted` getter checks its receiver and reads a
 * symbol-keyed field, a megamorphic load that was ~1.5 % of the main thread's busy time at 250
 * streams of 20 ms frames (read twice per job, by `--cpu-prof`).
 */
export interface Lapse {
  readonly aborted: boolean;
  readonly reason?: unknown;
}

/** A plain {@link Lapse} that follows `signal` (one listener, for as long as the signal lives). */
export function lapseOf(signal: AbortSignal): Lapse {
  const lapse = { aborted: signal.aborted, reason: signal.reason as unknown };
  signal.addEventListener(
    'abort',
    () => {
      lapse.aborted = true;
      lapse.reason = signal.reason;
    },
    { once: true },
  );
  return lapse;
}

interface Item<J, R> {
  job: J;
  at: number;
  done: Done<R>;
  signal?: Lapse;
}

/** An aborted job's end, told a microtask later: a batch is formed inside another stream's submit. */
const abandon = <R>(done: Done<R>, signal: Lapse): void => queueMicrotask(() => done(signal.reason));

/**
 * Dynamic batching for streams: the jobs of many streams (each its stream's ready windows or
 * steps) are collected and run as one batched job (a row per stream, see {@link Packing}) on a
 * free slot, and each row's result goes back to its stream. A batch is sent when it holds
 * `maxBatch` streams, or when its oldest job has waited `maxDelayMs` for company, as soon as
 * the pool has room for it: a free slot, or a place behind a slot's running job
 * ({@link ModelPool}'s `capacity`: the host goes on to it without waiting for the server). Under load,
 * jobs gather while the pool is full. One message per batch instead of one per stream is what
 * makes many streams cheap on process hosts.
 */
export class Batcher<J extends Job = Job, R extends JobResult = JobResult> {
  private pending: Item<J, R>[] = [];
  /** Arenas of batches whose results are back, for the next batches. */
  private readonly arenas: Arena[] = [];
  private inFlight = 0;
  private timer: NodeJS.Timeout | null = null;

  /**
   * @param packing how rows become a batch and back. @param maxBatch streams (rows) per batch (1-512).
   * @param maxDelayMs longest wait for company, ms. @param onBatch called with each batch's size (for metrics).
   */
  constructor(
    private readonly pool: ModelPool,
    private readonly packing: Packing<J, R>,
    private readonly maxBatch: number,
    private readonly maxDelayMs: number,
    private readonly onBatch: (size: number) => void = () => {},
  ) {}

  /**
   * Runs one stream's job (one row) in a batch with other streams' and tells `done` its row's
   * result (or the batch's error). A callback, not a promise: this is the path of every stream
   * frame, and a promise with its reaction per job was a tenth of what the main thread allocated
   * per 20 ms frame. A job whose `signal` has aborted by the time its batch is formed is dropped
   * (`done` with the signal's reason). No listener is added to the signal: a stream sends
   * thousands of jobs, and EventTarget listeners are costly (a stream passes its lease's
   * {@link lapseOf}, read per job more cheaply than the AbortSignal).
   */
  submit(job: J, signal: Lapse | undefined, done: Done<R>): void {
    if (signal?.aborted) return abandon(done, signal);
    this.pending.push({ job, at: Date.now(), done, signal });
    this.schedule();
  }

  /** {@link submit} as a promise. */
  run(job: J, signal?: Lapse): Promise<R> {
    return new Promise((resolve, reject) => this.submit(job, signal, (e, r) => (e === null ? resolve(r!) : reject(e))));
  }

  private schedule(): void {
    if (!this.pending.length || this.inFlight >= this.pool.capacity) return;
    const waited = Date.now() - this.pending[0].at;
    if (this.pending.length >= this.maxBatch || waited >= this.maxDelayMs) return this.dispatch();
    this.timer ??= setTimeout(() => {
      this.timer = null;
      this.schedule();
    }, this.maxDelayMs - waited);
  }

  /**
   * The next batch's jobs, oldest first; jobs of the chosen batch whose signal has aborted are
   * dropped (rejected with the signal's reason), so a batch may come out short or empty. Only the
   * chosen jobs are checked: under load hundreds of jobs wait, and reading every waiting job's
   * `signal.aborted` at every batch made each batch cost in proportion to the backlog (3-6 % of
   * the main process at 350 streams of 20 ms frames, by `perf`). A stream's aborted job is still
   * dropped, once a batch takes it: oldest first, it is soon. When more jobs
   * wait than a batch holds and rows run in lockstep ({@link Packing.steps}), the batch takes the
   * oldest job, then the waiting jobs of as many steps, then those of fewer, each in age order;
   * jobs of more steps wait for a batch led by one like them. Otherwise a run would hold only the
   * few rows with one window more than the rest: 100 ms frames are 3.125 windows, so nearly
   * every full batch of 3-window rows held a few 4-window rows, and a fourth run at a few rows
   * costs nearly what a run of all of them does (a run's fixed cost). When rows run one after
   * another ({@link Packing.serial}), a batch takes the oldest jobs up to its fair share of the
   * waiting steps (their total over the pool's slots, but at least {@link SERIAL_BATCH_STEPS}
   * steps, and at least one job: a short batch is not split, which would cost messages and gain
   * nothing): measured with 40 wake-word streams, a slot otherwise took a backlog of 12 streams'
   * jobs whole (a 650 ms run), while the other slot idled 43 % of the time and every stream in the
   * big batch waited for all of it. Each stream has one job in flight at a time, so its jobs stay
   * in order.
   */
  private take(): Item<J, R>[] {
    const chosen = this.choose();
    const live = chosen.filter((item) => !item.signal?.aborted);
    if (live.length < chosen.length)
      for (const item of chosen) if (item.signal?.aborted) abandon(item.done, item.signal);
    return live;
  }

  /** The next batch's jobs before dropping the aborted ones (see {@link take}). */
  private choose(): Item<J, R>[] {
    const serial = this.packing.serial;
    if (serial && this.pending.length) {
      let waiting = 0;
      for (const item of this.pending) waiting += serial(item.job);
      const share = Math.max(SERIAL_BATCH_STEPS, Math.ceil(waiting / this.pool.size));
      let n = 1;
      let taken = serial(this.pending[0].job);
      for (; n < this.pending.length && n < this.maxBatch; n++) {
        const more = serial(this.pending[n].job);
        if (taken + more > share) break;
        taken += more;
      }
      return this.pending.splice(0, n);
    }
    const steps = this.packing.steps;
    if (!steps || this.pending.length <= this.maxBatch) return this.pending.splice(0, this.maxBatch);
    const lead = steps(this.pending[0].job);
    const same: number[] = [];
    const fewer: number[] = [];
    for (let i = 0; i < this.pending.length && same.length < this.maxBatch; i++) {
      const n = steps(this.pending[i].job);
      if (n === lead) same.push(i);
      else if (n < lead && fewer.length < this.maxBatch) fewer.push(i);
    }
    const taken = new Set([...same, ...fewer.slice(0, this.maxBatch - same.length)]);
    const batch: Item<J, R>[] = [];
    const rest: Item<J, R>[] = [];
    this.pending.forEach((item, i) => (taken.has(i) ? batch : rest).push(item));
    this.pending = rest;
    return batch;
  }

  private dispatch(): void {
    if (this.timer) clearTimeout(this.timer);
    this.timer = null;
    const batch = this.take();
    // Every job of this batch was dropped: others may wait still.
    if (!batch.length) return this.schedule();
    const rows = batch.map((b) => b.job);
    this.inFlight++;
    this.onBatch(rows.length);
    const arena = this.arenas.pop() ?? new Arena();
    let result: Promise<R>;
    try {
      result = this.pool.run(this.packing.pack(rows, arena), undefined, 0, true) as Promise<R>;
    } catch (e) {
      // Told as the batch's error (a microtask later), not thrown into the stream whose job came last.
      result = Promise.reject(e);
    }
    result
      .then(
        (res) => {
          const results = this.packing.unpack(res, rows);
          for (let i = 0; i < batch.length; i++) tell(batch[i].done, null, results[i]);
        },
        (err) => {
          for (const b of batch) tell(b.done, err);
        },
      )
      .finally(() => {
        arena.reset();
        this.arenas.push(arena);
        this.inFlight--;
        this.schedule();
      });
    // Jobs the batch left (over `maxBatch`, or past its fair share) may go on another free slot.
    this.schedule();
  }
}
