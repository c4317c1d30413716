import { fork, type ChildProcess } from 'node:child_process';
import { closeSync, existsSync, openSync, readFileSync, unlinkSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { Socket } from 'node:net';
import { fileURLToPath } from 'node:url';
import { Worker } from 'node:worker_threads';
import { VoxError, voxError } from '../errors.js';
import {
  FrameChannel,
  type FromSlot,
  type Job,
  type JobResult,
  type LoadSpec,
  type SlotInfo,
  SLOT_DEPTH,
  type ToSlot,
} from './slot-protocol.js';

/**
 * The compiled slot host entry. Under the TypeScript sources (vitest) hosts still run the
 * compiled `dist/runtime/slots/slot-worker.js`, so `npm run build` must have run first.
 */
export function slotHostFile(): URL {
  const sibling = new URL('./slot-worker.js', import.meta.url);
  if (existsSync(fileURLToPath(sibling))) return sibling;
  return new URL('../../dist/runtime/slots/slot-worker.js', import.meta.url);
}

/** What the pool needs of one slot; the real ones are child processes or worker threads, tests may use fakes. */
export interface SlotHost {
  readonly info: SlotInfo;
  /**
   * Jobs the slot may hold at once: the one it runs and those queued behind it, run in the order
   * sent (absent: 1, one at a time).
   */
  readonly depth?: number;
  /**
   * Runs one job. Rejects if the job fails, runs over its timeout, or the slot dies.
   * @param waitUntil when the job's wait for a slot ends, ms since the epoch (absent: unbounded);
   *   a local slot starts at once and ignores it, a remote one (cluster) waits for a holder up to it.
   * @param signal aborted when the job's client left: a remote slot stops waiting for a holder.
   */
  run(job: Job, waitUntil?: number, signal?: AbortSignal): Promise<JobResult>;
  /** Frees the sessions and stops the slot (a process that does not exit in time is killed). Idempotent. */
  close(): Promise<void>;
  /**
   * Called once if the slot dies on its own (not through close); `timedOut` when it was killed for a job over its
   * timeout.
   */
  onExit(cb: (err: Error & { timedOut?: boolean }) => void): void;
  /** Resident memory of the host's process, bytes; 0 for a thread (it shares the server's). */
  residentBytes(): number;
}

/**
 * Starts one slot and loads a model into it. An aborted `signal` kills a process host still
 * loading (the promise then rejects); a thread host cannot be stopped and ignores it.
 */
export type SlotFactory = (spec: LoadSpec, signal?: AbortSignal) => Promise<SlotHost>;

/** How long a closing process host may take to exit before it is killed, ms. */
const CLOSE_GRACE_MS = 500;

/** The two ends a slot host can be reached by: a worker thread's port, or a child process's IPC channel. */
interface Endpoint {
  /**
   * Sends a message. A job's arrays are never transferred (a thread gets copies): a session may
   * lend its own state buffers to its job, as it changes them only once the result is back.
   */
  send(msg: ToSlot): void;
  /** SIGKILL (process) or null (a thread cannot be stopped inside onnxruntime without aborting the server). */
  kill: (() => void) | null;
  pid: number | null;
}

/**
 * One slot host behind a message endpoint (the slot-host protocol of slot-protocol.ts). It runs
 * the jobs it holds in the order sent (up to {@link SLOT_DEPTH} of them). With a `jobTimeoutMs` and a
 * killable endpoint, a job running longer (timed from when the job before it was answered) is
 * answered 503 `server_busy` naming the timeout and its host is killed (SIGKILL); the pool
 * respawns the slot.
 */
class MessageSlot implements SlotHost {
  info: SlotInfo = {};
  /** {@link SLOT_DEPTH} where a job over `jobTimeoutMs` is killed (that bounds the wait behind it), else 1. */
  readonly depth: number;
  private seq = 0;
  private readonly pending = new Map<
    number,
    { resolve: (r: JobResult) => void; reject: (e: Error) => void; timer?: NodeJS.Timeout }
  >();
  private loadWaiter: { resolve: () => void; reject: (e: Error) => void } | null = null;
  private exitCb: ((err: Error & { timedOut?: boolean }) => void) | null = null;
  private closing = false;
  private exited = false;
  private timedOut = false;
  private readonly exitPromise: Promise<void>;
  private markExited!: () => void;

  constructor(
    private readonly endpoint: Endpoint,
    private readonly jobTimeoutMs: number,
  ) {
    this.exitPromise = new Promise((resolve) => (this.markExited = resolve));
    this.depth = endpoint.kill && jobTimeoutMs > 0 ? SLOT_DEPTH : 1;
  }

  onMessage(m: FromSlot): void {
    if (m.type === 'loaded') {
      this.info = m.info;
      this.loadWaiter?.resolve();
    } else if (m.type === 'result' || (m.type === 'error' && m.seq !== undefined)) {
      const p = this.pending.get(m.seq!);
      this.pending.delete(m.seq!);
      if (p?.timer) clearTimeout(p.timer);
      // The host runs its jobs in order: the next one starts now.
      this.timeNext();
      if (m.type === 'result') p?.resolve(m.result);
      else p?.reject(voxError('inference_failed', { reason: m.message }));
    } else if (m.type === 'error') {
      this.loadWaiter?.reject(new Error(m.message));
    }
  }

  onExit(cb: (err: Error & { timedOut?: boolean }) => void): void {
    this.exitCb = cb;
  }

  /** The host is gone: `how` says how (an exit code, a signal). */
  gone(how: string): void {
    this.exited = true;
    this.fail(new Error(how));
    this.markExited();
  }

  fail(e: Error): void {
    const err: VoxError & { timedOut?: boolean } = voxError('slot_failed', { reason: e.message, cause: e });
    err.timedOut = this.timedOut;
    this.loadWaiter?.reject(err);
    this.loadWaiter = null;
    for (const p of this.pending.values()) {
      if (p.timer) clearTimeout(p.timer);
      p.reject(err);
    }
    this.pending.clear();
    if (!this.closing) {
      this.closing = true;
      const cb = this.exitCb;
      this.exitCb = null;
      cb?.(err);
      // An 'error' event may come before the host is gone; ask it to exit in case it is not.
      if (!this.exited) this.send({ type: 'release' });
    }
  }

  load(spec: LoadSpec): Promise<void> {
    return new Promise((resolve, reject) => {
      this.loadWaiter = { resolve, reject };
      this.send({ type: 'load', spec });
    });
  }

  private send(msg: ToSlot): void {
    if (!this.exited) this.endpoint.send(msg);
  }

  run(job: Job): Promise<JobResult> {
    if (this.closing) return Promise.reject(voxError('slot_closed'));
    const seq = ++this.seq;
    return new Promise((resolve, reject) => {
      this.pending.set(seq, { resolve, reject });
      this.timeNext();
      this.send({ type: 'run', seq, job });
    });
  }

  /**
   * Arms the job timeout of the job the host runs now (the oldest unanswered: it runs them in
   * order), if not armed yet; a job queued behind another is not timed while it waits.
   */
  private timeNext(): void {
    const kill = this.endpoint.kill;
    if (!kill || this.jobTimeoutMs <= 0) return;
    const next = this.pending.entries().next();
    if (next.done || next.value[1].timer) return;
    const [seq, entry] = next.value;
    entry.timer = setTimeout(() => {
      if (!this.pending.delete(seq)) return;
      this.timedOut = true;
      // `slotLost`: the pool must not give this slot another job; its exit respawns it (and
      // fails the jobs queued behind this one).
      entry.reject(Object.assign(voxError('job_timeout', { ms: this.jobTimeoutMs }), { slotLost: true }));
      kill();
    }, this.jobTimeoutMs);
  }

  /**
   * Asks the host to release its sessions and exit, and waits until it has. A process still
   * running a job after {@link CLOSE_GRACE_MS} is killed; a thread is never terminated from
   * outside (terminating a thread inside onnxruntime aborts the whole server), so its job finishes.
   */
  async close(): Promise<void> {
    if (!this.closing && !this.exited) {
      this.closing = true;
      this.exitCb = null;
      this.send({ type: 'release' });
    }
    const kill = this.endpoint.kill;
    if (kill && !this.exited) {
      const timer = setTimeout(kill, CLOSE_GRACE_MS);
      await this.exitPromise;
      clearTimeout(timer);
    } else {
      await this.exitPromise;
    }
  }

  residentBytes(): number {
    if (this.endpoint.pid === null || this.exited) return 0;
    try {
      return (
        Number(/VmRSS:\s+(\d+) kB/.exec(readFileSync(`/proc/${this.endpoint.pid}/status`, 'utf8'))?.[1] ?? 0) * 1024
      );
    } catch {
      return 0;
    }
  }
}

/** Loads `spec` into a new slot; rejects (and stops it) if the load fails. */
async function loadSlot(slot: MessageSlot, spec: LoadSpec): Promise<SlotHost> {
  try {
    await slot.load(spec);
    return slot;
  } catch (e) {
    await slot.close();
    throw e;
  }
}

/** Starts a slot worker thread (`isolation: "thread"`) and loads `spec` into it. */
export const startWorkerSlot: SlotFactory = (spec) => slotOnWorker(new Worker(slotHostFile()), spec);

/** A slot host on a worker thread already started (tests start their own), with `spec` loaded. */
export function slotOnWorker(worker: Worker, spec: LoadSpec): Promise<SlotHost> {
  // A structured clone copies a view's whole buffer: a job's views (a session's reused buffers)
  // go as copies of their own bytes.
  const own = (job: Job): Job =>
    Object.fromEntries(
      Object.entries(job).map(([k, v]) => [
        k,
        v instanceof Float32Array && v.byteLength < v.buffer.byteLength ? v.slice() : v,
      ]),
    ) as unknown as Job;
  const slot = new MessageSlot(
    { send: (m) => worker.postMessage(m.type === 'run' ? { ...m, job: own(m.job) } : m), kill: null, pid: null },
    0,
  );
  worker.on('message', (m: FromSlot) => slot.onMessage(m));
  worker.on('error', (e) => slot.fail(e));
  worker.on('exit', (code) => slot.gone(`slot worker exited with code ${code}`));
  return loadSlot(slot, spec);
}

/**
 * A factory of child-process slot hosts (`isolation: "process"`): `node dist/runtime/slots/slot-worker.js`
 * forked with two channels: the IPC channel (Node's `advanced` serialization) for `load` and
 * `release`, and a pipe (the child's fd 4) for `run` and its answer as binary frames
 * ({@link encodeFrame}), so audio crosses as raw bytes with one copy on each side. A job over
 * `jobTimeoutMs` (0 = none) gets its host killed.
 */
export function processSlots(jobTimeoutMs: number): SlotFactory {
  return async (spec, signal) => {
    signal?.throwIfAborted();
    // The job channel's two shared files (jobs in, results out), inherited by the child as fds 5
    // and 6 and unlinked at once: nothing is left behind, even if the server is killed.
    const files = [sharedFile(), sharedFile()];
    let child: ChildProcess;
    try {
      child = fork(fileURLToPath(slotHostFile()), [], {
        serialization: 'advanced',
        stdio: ['ignore', 'ignore', 'inherit', 'ipc', 'pipe', files[0].fd, files[1].fd],
      });
    } catch (e) {
      for (const f of files) closeSync(f.fd);
      throw e;
    } finally {
      for (const f of files) unlinkSync(f.path);
    }
    const abandon = (): void => void child.kill('SIGKILL');
    signal?.addEventListener('abort', abandon, { once: true });
    const socket = child.stdio[4] as Socket;
    // A dead host's socket breaks (EPIPE, ECONNRESET); its 'exit' says why.
    socket.on('error', () => {});
    socket.once('close', () => files.forEach((f) => closeSync(f.fd)));
    let channel: FrameChannel<FromSlot, ToSlot> | null = null;
    const slot = new MessageSlot(
      {
        send: (m) => {
          if (m.type === 'run') {
            try {
              channel!.send(m);
            } catch (e) {
              // The shared file cannot be written (tmpfs full): this slot cannot run jobs.
              slot.fail(e as Error);
            }
          } else if (child.connected) {
            // Shared memory does not cross processes: the wake-word feature models go as plain bytes.
            child.send(
              m.type === 'load' && m.spec.kind === 'wakeword'
                ? {
                    ...m,
                    spec: {
                      ...m.spec,
                      melspectrogram: new Uint8Array(m.spec.melspectrogram),
                      embedding: new Uint8Array(m.spec.embedding),
                    },
                  }
                : m,
            );
          }
        },
        kill: () => child.kill('SIGKILL'),
        pid: child.pid ?? null,
      },
      jobTimeoutMs,
    );
    // Results are read into reused buffers, one per region (issue 25 item 14): a fresh one per
    // frame was garbage that nothing collected while the server idled (hundreds of MiB of external
    // memory after wake-word streams). Every consumer copies what it keeps (task sessions, the
    // batcher's rows) before that answer's promise chain ends, and the answer SLOT_DEPTH places
    // later comes in a later turn, to a job sent after that.
    channel = new FrameChannel<FromSlot, ToSlot>(
      socket,
      files[0].fd,
      files[1].fd,
      (m) => slot.onMessage(m),
      (e) => slot.fail(e),
      true,
      SLOT_DEPTH,
    );
    child.on('message', (m: FromSlot) => slot.onMessage(m));
    child.on('error', (e) => slot.fail(e));
    child.on('exit', (code, signal) =>
      slot.gone(signal ? `slot host was killed by ${signal}` : `slot host exited with code ${code}`),
    );
    try {
      return await loadSlot(slot, spec);
    } finally {
      signal?.removeEventListener('abort', abandon);
    }
  };
}

/** The directory for the job channels' shared files: tmpfs where there is one. */
const SHARED_DIR = existsSync('/dev/shm') ? '/dev/shm' : tmpdir();
let sharedSeq = 0;

/** Creates a new file for a job channel (owner-only), open for reading and writing. */
function sharedFile(): { path: string; fd: number } {
  const path = join(SHARED_DIR, `voxserve-${process.pid}-${++sharedSeq}-${Math.random().toString(36).slice(2)}`);
  return { path, fd: openSync(path, 'wx+', 0o600) };
}

/** The slot factory for an isolation mode. */
export function slotFactory(isolation: 'process' | 'thread', jobTimeoutMs: number): SlotFactory {
  return isolation === 'process' ? processSlots(jobTimeoutMs) : startWorkerSlot;
}

/**
 * What a model entry (and its batcher) uses of its slots: a {@link SlotPool} of its own, or a view
 * of a shared one (a wake-word family, runtime/wakeword/wakeword-family.ts).
 */
export type ModelPool = Pick<
  SlotPool,
  | 'size'
  | 'capacity'
  | 'queued'
  | 'inFlight'
  | 'info'
  | 'slots'
  | 'activeSlots'
  | 'busyMs'
  | 'residentBytes'
  | 'onStuck'
  | 'onFailure'
  | 'run'
  | 'close'
  | 'onRun'
  | 'onHostExit'
  | 'waitTimeoutMs'
>;

interface QueuedRun {
  job: Job;
  /** Longest wait for a slot, ms (0 = unbounded). */
  limit: number;
  resolve: (r: JobResult) => void;
  reject: (e: Error) => void;
  signal?: AbortSignal;
  onAbort?: () => void;
  /** When it was queued, ms since the epoch. */
  queuedAt: number;
  /** It may be queued behind a busy slot's running job (see {@link SlotPool.run}). */
  behind: boolean;
  /** It was running when its host died, and runs once more: a second death fails it. */
  rerun?: boolean;
  /** When its first host died under it (that crash is taken back if its rerun crashes too). */
  crashedAt?: number;
  /** Its place in arrival order (the pool's count of jobs). */
  seq: number;
}

/** A job handed to a slot: when it began to run there (null while it waits behind the slot's running job). */
interface SentRun {
  q: QueuedRun;
  startedAt: number | null;
}

/** Crashes of a pool's slots within this window, ms, that fail the pool (OTP's restart intensity). */
const CRASH_WINDOW_MS = 60_000;
/** Crashes within {@link CRASH_WINDOW_MS} that fail the pool instead of respawning. */
const MAX_CRASHES = 3;
/** First respawn delay after a crash, ms; doubled for each further crash in the window. */
const RESPAWN_BACKOFF_MS = 100;

/**
 * A model's slots: the primary and its clones. Jobs from every leased request start in arrival
 * order on the first free slot; when every slot is busy, a slot that holds more than one job
 * ({@link SlotHost.depth}) is sent the next batcher's job to queue behind its running one (the
 * slot whose job started first, and never one whose job is overdue), so that its host goes on to
 * it as soon as it has answered. A job queued behind one that kills its host goes back to the
 * front of the pool's queue; so does a running job whose host crashed, once (a host keeps nothing
 * between jobs: it runs again with the same input, and a second crash fails it).
 *
 * A slot whose host dies (a crash, or a kill for a job over `job_timeout_ms`) is respawned, one
 * for one, after a backoff; three crashes within a minute, or a respawn that fails, fail the
 * pool (the model unloads with the error). A job waiting for a slot longer than `waitTimeoutMs`
 * is answered 503; once every slot has run one job longer than that (stuck work, C4: the pool's
 * slot-wait timer is the one place that decides it, and `onStuck` says so), every waiting job is
 * answered 503 at once.
 */
export class SlotPool {
  /** Slots the pool keeps (a respawning one included). */
  private readonly count: number;
  /** The size times each slot's depth. */
  private readonly depthCapacity: number;
  /** Jobs sent to its slots and not yet settled. */
  private sent = 0;
  /**
   * What the primary reported at load (heads, initial embedding history). Kept here, not read off
   * a live slot: while every slot respawns there is none, and a session made then must still
   * start from the model's own state. A respawn loads the same spec, so it reports the same.
   */
  readonly info: SlotInfo;
  private readonly live: SlotHost[];
  /**
   * Free slots, the one freed last at the end: a job goes to it (a stack), so that under light
   * load one host takes batch after batch while the others sleep on, instead of each host in turn
   * sleeping the longer between its batches. A host that slept runs its next batch slower on these
   * VMs, the longer it slept (see docs/benchmarks-efficiency.md); measured, `bench --streams` at
   * 8-10 % of the limit: the hosts' CPU 2-10 % less than taking the slot freed first, at ~38 % 2-4 %.
   */
  private readonly idle: SlotHost[];
  /** Busy slots' jobs in the order sent (the slot runs them in that order: the first runs now). */
  private readonly lineups = new Map<SlotHost, SentRun[]>();
  private readonly queue: QueuedRun[] = [];
  /** Jobs queued so far (each job's {@link QueuedRun.seq}). */
  private jobs = 0;
  /** Run time of the jobs that have ended, summed, ms ({@link busyMs}). */
  private busyDone = 0;
  private failure: Error | null = null;
  private failCb: ((err: Error) => void) | null = null;
  private readonly crashes: number[] = [];
  private waitTimer: NodeJS.Timeout | null = null;
  /** Called with each finished job's run time, ms (for metrics). */
  onRun: ((ms: number) => void) | null = null;
  /** Called when a slot host dies: why, and whether it is respawned (for logs). */
  onHostExit: ((why: string, respawn: boolean) => void) | null = null;
  /** Longest wait for a slot, ms (the model's busy timeout); 0 = unbounded. Also the overdue limit of C4. */
  waitTimeoutMs = 0;
  /**
   * Called when the slots turn stuck (true: every slot has run its job longer than `waitTimeoutMs`)
   * and when they move again (false: a job ended, a slot freed). The model chart shows it.
   */
  onStuck: ((stuck: boolean) => void) | null = null;
  /** The slots are stuck now (see {@link onStuck}). */
  private stuck = false;

  /** Aborted at close: kills the hosts of respawns still loading. */
  private readonly closed = new AbortController();
  /** Respawns in flight (close waits for them). */
  private readonly respawns = new Set<Promise<void>>();

  private constructor(
    slots: SlotHost[],
    private readonly spec: LoadSpec,
    private readonly factory: SlotFactory,
    /** Longest a respawn may take, ms (0 = none); past it the pool fails. */
    private readonly loadTimeoutMs: number,
    /** The most jobs in flight now (see {@link SlotPool.start}'s `window`); absent: every slot's depth. */
    private readonly window?: () => number,
  ) {
    this.count = slots.length;
    this.depthCapacity = slots.length * (slots[0].depth ?? 1);
    this.info = slots[0].info;
    this.live = [...slots];
    this.idle = [...slots].reverse(); // the first slot is taken first
    for (const s of slots) this.watch(s);
  }

  /**
   * Builds the primary, then the clones (in parallel). Only a complete pool is returned: on any
   * failure, or once `opts.signal` has aborted (the load was abandoned), the clones are closed
   * before the primary and the error is rethrown.
   * @param count slots, 1-16 (a remote pool: its most jobs in flight, up to 32).
   * @param opts.window the most jobs in flight now, read at each dispatch (a remote pool's: twice
   *   the slots of the model's holders, so that it follows their replicas); never more than `count`.
   */
  static async start(
    spec: LoadSpec,
    count: number,
    factory: SlotFactory = startWorkerSlot,
    opts: { signal?: AbortSignal; loadTimeoutMs?: number; window?: () => number } = {},
  ): Promise<SlotPool> {
    const primary = await factory(spec, opts.signal);
    const clones = await Promise.allSettled(Array.from({ length: count - 1 }, () => factory(spec, opts.signal)));
    const abandoned = opts.signal?.aborted
      ? ({ status: 'rejected', reason: new Error('the load was abandoned') } as PromiseRejectedResult)
      : undefined;
    const failed = abandoned ?? clones.find((c): c is PromiseRejectedResult => c.status === 'rejected');
    if (failed) {
      for (const c of clones) if (c.status === 'fulfilled') await c.value.close();
      await primary.close();
      throw failed.reason;
    }
    return new SlotPool(
      [primary, ...clones.map((c) => (c as PromiseFulfilledResult<SlotHost>).value)],
      spec,
      factory,
      opts.loadTimeoutMs ?? 0,
      opts.window,
    );
  }

  /** Jobs waiting for a slot now. */
  get queued(): number {
    return this.queue.length;
  }

  /** Jobs sent to its slots and not yet settled (running, or lined up behind a running one). */
  get inFlight(): number {
    return this.sent;
  }

  /** Slots the pool keeps now (a respawning one included; a remote pool: its window). */
  get size(): number {
    return this.window ? Math.max(1, Math.min(this.count, this.window())) : this.count;
  }

  /** Jobs its slots hold at once, running or queued behind a running one (the size times each slot's depth). */
  get capacity(): number {
    return this.window ? Math.max(1, Math.min(this.depthCapacity, this.window())) : this.depthCapacity;
  }

  /** The slots alive now (a respawning one is missing). */
  get slots(): readonly SlotHost[] {
    return this.live;
  }

  /** Slots running a job now. */
  get activeSlots(): number {
    return this.running().size;
  }

  /**
   * The time the slots have spent running jobs since the pool started, summed over the slots, ms
   * (a job's run counted from when it started on its slot, the running ones up to `now`): its growth
   * over an interval, divided by the interval, is the slots busy on average (the autoscaler's
   * measure; an instant's {@link activeSlots} misses or catches a short job by chance).
   */
  busyMs(now = Date.now()): number {
    let ms = this.busyDone;
    for (const started of this.running().values()) ms += Math.max(0, now - started);
    return ms;
  }

  /**
   * Live slots running a job, with when it started (ms since the epoch): the first of each one's
   * lineup (a dead slot runs nothing more, though a job may wait there until its host's exit).
   */
  private running(): Map<SlotHost, number> {
    const out = new Map<SlotHost, number>();
    for (const [slot, lineup] of this.lineups) {
      const started = lineup[0]?.startedAt;
      if (started != null && this.live.includes(slot)) out.set(slot, started);
    }
    return out;
  }

  /** Resident memory of the slots' processes, bytes (0 for threads). */
  residentBytes(): number {
    return this.live.reduce((n, s) => n + s.residentBytes(), 0);
  }

  /**
   * Stuck work (DESIGN.md C4): true when every slot is running a job that started more than
   * `timeoutMs` ago. Always false for `timeoutMs` 0 (unbounded).
   */
  private allOverdue(timeoutMs: number, now = Date.now()): boolean {
    const running = this.running();
    if (timeoutMs <= 0 || running.size === 0 || running.size < this.live.length) return false;
    for (const started of running.values()) if (now - started <= timeoutMs) return false;
    return true;
  }

  /** Called once if the pool fails (too many crashes, a failed respawn): the pool must then be closed. */
  onFailure(cb: (err: Error) => void): void {
    this.failCb = cb;
  }

  /**
   * Queues a job; it runs when a slot is free and every earlier job has started.
   * An aborted `signal` drops a job that has not started (rejecting with `AbortError`);
   * a started job's result is still delivered, and the caller discards it.
   * @param waitMs the caller's own bound on the wait for a slot, ms (its request's busy timeout;
   *   0 or absent: the pool's `waitTimeoutMs` alone); the smaller non-zero bound applies.
   * @param behind with every slot busy, the job may be handed to a slot to wait behind its running
   *   job (slots of {@link SlotHost.depth} 2): its wait for a slot then ends there, as a stream's
   *   job waiting in its batcher is not bounded either (a batcher's jobs; a request's own job
   *   waits in the queue, within its busy timeout). Such a host kills a job over `job_timeout_ms`,
   *   which bounds the wait behind it; if its host dies, the job waits in the queue again, afresh.
   * @returns the result, with `waitedMs`: how long the job waited for a slot, ms (until it ran).
   * @throws VoxError `server_busy` when it waited for a slot over its bound or the slots turned
   *   stuck; `server_busy` naming `job_timeout_ms` when its host was killed for running over it;
   *   `server_error` (`slot_failed`) naming the signal or exit code when its host crashed while it
   *   ran, twice (after the first crash it runs again on another slot, or the respawned one).
   */
  run(job: Job, signal?: AbortSignal, waitMs = 0, behind = false): Promise<JobResult> {
    if (this.failure) return Promise.reject(this.failure);
    if (signal?.aborted) return Promise.reject(abortError());
    return new Promise((resolve, reject) => {
      const limit = [waitMs, this.waitTimeoutMs].filter((v) => v > 0);
      const q: QueuedRun = {
        job,
        limit: limit.length ? Math.min(...limit) : 0,
        resolve,
        reject,
        signal,
        queuedAt: Date.now(),
        behind,
        seq: ++this.jobs,
      };
      if (signal) {
        q.onAbort = () => {
          const i = this.queue.indexOf(q);
          if (i >= 0) {
            this.queue.splice(i, 1);
            reject(abortError());
            this.dispatch();
          }
        };
        signal.addEventListener('abort', q.onAbort, { once: true });
      }
      this.queue.push(q);
      this.dispatch();
    });
  }

  private dispatch(): void {
    const window = this.window ? this.capacity : Infinity;
    while (this.queue.length && this.sent < window) {
      const slot = this.idle.pop() ?? (this.queue[0].behind ? this.slotWithRoom() : undefined);
      if (!slot) break;
      const q = this.queue.shift()!;
      if (q.onAbort) q.signal!.removeEventListener('abort', q.onAbort);
      this.send(slot, q);
    }
    this.armWait();
  }

  /** A busy slot with room for a job behind its running one: the one whose job started first, not overdue (C4). */
  private slotWithRoom(): SlotHost | undefined {
    let slot: SlotHost | undefined;
    let first = Infinity;
    const now = Date.now();
    for (const [s, lineup] of this.lineups) {
      const started = lineup[0].startedAt!;
      if (lineup.length >= (s.depth ?? 1) || !this.live.includes(s)) continue;
      if (this.waitTimeoutMs > 0 && now - started > this.waitTimeoutMs) continue;
      if (started < first) [slot, first] = [s, started];
    }
    return slot;
  }

  private send(slot: SlotHost, q: QueuedRun): void {
    let lineup = this.lineups.get(slot);
    if (!lineup) this.lineups.set(slot, (lineup = []));
    const sent: SentRun = { q, startedAt: lineup.length ? null : Date.now() };
    lineup.push(sent);
    this.sent++;
    let lost = false;
    slot
      .run(q.job, q.limit > 0 ? q.queuedAt + q.limit : undefined, q.signal)
      .then(
        (r) => {
          if (r.ran) this.onRun?.(r.ran[1] - r.ran[0]);
          r.waitedMs = (sent.startedAt ?? Date.now()) - q.queuedAt;
          q.resolve(r);
        },
        (e: Error & { slotLost?: boolean }) => {
          lost = e.slotLost === true;
          // Its host died. If that death failed the pool (the third crash in a minute), the job gets
          // the pool's error, as the queue does. If the job never ran (it waited behind the job that
          // died with it), it waits for a slot again, first. If it ran, and its host crashed (not a
          // kill for its own time), it does so once: a host keeps nothing between jobs (state
          // travels with the job), so it runs again with the same input and its results do not
          // change; a second crash fails it.
          if (!this.live.includes(slot)) {
            if (this.failure) return q.reject(this.failure);
            if (sent.startedAt === null) return this.requeue(q);
            if (e instanceof VoxError && e.code === 'slot_failed') {
              if (q.rerun) return q.reject(voxError('input_crashed_model', { reason: e.message, cause: e }));
              q.rerun = true;
              return this.requeue(q);
            }
          }
          q.reject(e);
        },
      )
      .finally(() => this.settled(slot, sent, lost));
  }

  /**
   * `q` goes back into the queue at its place in arrival order (ahead of every job that came after
   * it, so the running job and the one behind it keep their order), waiting for a slot afresh (its
   * wait had ended when it was handed over).
   */
  private requeue(q: QueuedRun): void {
    if (q.signal?.aborted) return q.reject(abortError());
    if (q.onAbort) q.signal!.addEventListener('abort', q.onAbort, { once: true });
    q.queuedAt = Date.now();
    const at = this.queue.findIndex((w) => w.seq > q.seq);
    this.queue.splice(at < 0 ? this.queue.length : at, 0, q);
  }

  /** A job sent to `slot` has ended: the job behind it (if any) runs now, or the slot is free. */
  private settled(slot: SlotHost, sent: SentRun, lost: boolean): void {
    this.sent--;
    if (sent.startedAt !== null) this.busyDone += Math.max(0, Date.now() - sent.startedAt);
    const lineup = this.lineups.get(slot)!;
    lineup.splice(lineup.indexOf(sent), 1);
    if (lost) this.removeLive(slot);
    const alive = this.live.includes(slot);
    if (!lineup.length) {
      this.lineups.delete(slot);
      if (alive && !this.failure) this.idle.push(slot);
    } else if (alive) lineup[0].startedAt ??= Date.now();
    this.dispatch();
  }

  /**
   * Arms the slot-wait deadline: the earliest waiter's, or the moment the running jobs turn stuck
   * (then, while stuck, at once for any waiter). Called after every change of the running jobs.
   */
  private armWait(): void {
    if (this.waitTimer) clearTimeout(this.waitTimer);
    this.waitTimer = null;
    if (this.failure) return;
    const limit = this.waitTimeoutMs;
    if (this.stuck && !this.allOverdue(limit)) this.setStuck(false);
    let at = Infinity;
    for (const q of this.queue) if (q.limit > 0) at = Math.min(at, q.queuedAt + q.limit);
    // Stuck once the last of the running jobs is overdue (only when every live slot runs one).
    const running = this.running();
    const saturated = running.size > 0 && running.size >= this.live.length;
    if (limit > 0 && saturated && (!this.stuck || this.queue.length))
      at = Math.min(at, Math.max(...running.values()) + limit);
    if (at === Infinity) return;
    this.waitTimer = setTimeout(() => this.expire(), Math.max(1, at + 1 - Date.now()));
  }

  /** Answers 503 to every waiter past its slot-wait deadline, or to all of them once the slots are stuck. */
  private expire(): void {
    const limit = this.waitTimeoutMs;
    const now = Date.now();
    const stuck = this.allOverdue(limit, now);
    this.setStuck(stuck);
    for (const q of [...this.queue]) {
      if (!stuck && (q.limit <= 0 || now - q.queuedAt <= q.limit)) continue;
      this.queue.splice(this.queue.indexOf(q), 1);
      if (q.onAbort) q.signal!.removeEventListener('abort', q.onAbort);
      q.reject(
        stuck ? voxError('model_stuck', { ms: limit }) : voxError('busy_timeout', { what: 'slot', ms: q.limit }),
      );
    }
    // A job that may not wait behind a running one held the queue's head; those after it may.
    this.dispatch();
  }

  private setStuck(stuck: boolean): void {
    if (stuck === this.stuck) return;
    this.stuck = stuck;
    this.onStuck?.(stuck);
  }

  /** Respawns a slot whose host died, or fails the pool past the crash limit. */
  private watch(slot: SlotHost): void {
    slot.onExit((err) => {
      // Whatever is left of the dead host is released (a no-op for a process that has exited).
      void slot.close().catch(() => {});
      if (this.failure) return;
      this.removeLive(slot);
      const now = Date.now();
      // The job it ran: a job that crashed a host before crashed this one, on the same input, so
      // its input is the cause: its two crashes are not the model's (they count toward no crash
      // loop), and it alone is refused (input_crashed_model, in `send`).
      const running = this.lineups.get(slot)?.[0];
      const poisoned = running?.startedAt != null && running.q.crashedAt !== undefined;
      if (poisoned) {
        const i = this.crashes.indexOf(running.q.crashedAt!);
        if (i >= 0) this.crashes.splice(i, 1);
      } else if (!err.timedOut) {
        if (running?.startedAt != null) running.q.crashedAt = now;
        this.crashes.push(now);
        while (this.crashes[0] < now - CRASH_WINDOW_MS) this.crashes.shift();
        if (this.crashes.length >= MAX_CRASHES) {
          this.onHostExit?.(err.message, false);
          return this.fail(
            voxError('slot_crash_loop', { crashes: this.crashes.length, last: err.message, cause: err }),
          );
        }
      }
      const delay = err.timedOut ? 0 : RESPAWN_BACKOFF_MS * 2 ** (this.crashes.length - 1);
      this.onHostExit?.(err.timedOut ? `killed: its job ran over job_timeout_ms` : err.message, true);
      const respawn = new Promise<void>((resolve) => setTimeout(resolve, delay).unref())
        .then(() => {
          if (this.failure) return;
          const limit = this.loadTimeoutMs;
          const signal =
            limit > 0 ? AbortSignal.any([this.closed.signal, AbortSignal.timeout(limit)]) : this.closed.signal;
          const loading = this.factory(this.spec, signal);
          // A factory that ignores the signal (a thread host) is not waited for: its host is closed when it comes.
          const abandoned = new Promise<never>((_, reject) =>
            signal.addEventListener('abort', () => reject(signal.reason as Error), { once: true }),
          );
          loading.catch(() => {});
          return Promise.race([loading, abandoned]).then(
            (fresh) => {
              if (this.failure) return void fresh.close();
              this.live.push(fresh);
              this.idle.unshift(fresh); // taken last: the warm hosts first
              this.watch(fresh);
              this.dispatch();
            },
            (e: Error) => {
              if (signal.aborted)
                void loading.then(
                  (late) => late.close(),
                  () => {},
                );
              const why =
                signal.aborted && !this.closed.signal.aborted
                  ? `it took longer than load_timeout_ms (${limit} ms)`
                  : e.message;
              this.fail(voxError('slot_restart_failed', { reason: why, cause: e }));
            },
          );
        })
        .finally(() => this.respawns.delete(respawn));
      this.respawns.add(respawn);
    });
  }

  private removeLive(slot: SlotHost): void {
    const i = this.live.indexOf(slot);
    if (i >= 0) this.live.splice(i, 1);
    const j = this.idle.indexOf(slot);
    if (j >= 0) this.idle.splice(j, 1);
  }

  private fail(err: Error): void {
    if (this.failure) return;
    this.failure = err;
    if (this.waitTimer) clearTimeout(this.waitTimer);
    for (const q of this.queue.splice(0)) q.reject(err);
    this.failCb?.(err);
  }

  /**
   * Stops every slot: respawns in flight (their hosts killed), the clones (together), then the primary. Queued jobs are
   * rejected.
   */
  async close(): Promise<void> {
    this.failCb = null;
    this.fail(voxError('slots_unloaded'));
    this.closed.abort();
    await Promise.all(this.respawns);
    const [primary, ...clones] = this.live;
    await Promise.all(clones.map((s) => s.close()));
    await primary?.close();
  }
}

function abortError(): Error {
  return new DOMException('the client went away', 'AbortError');
}
