import { writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, describe, expect, it, vi } from 'vitest';
import { defaultCatalog } from '../../runtime/config.js';
import { voxError } from '../../runtime/errors.js';
import {
  SLOT_DEPTH,
  type Job,
  type JobResult,
  type LoadSpec,
  type SlotInfo,
} from '../../runtime/slots/slot-protocol.js';
import { processSlots, SlotPool, type SlotHost } from '../../runtime/slots/slots.js';
import { createTaskSession } from '../../runtime/tasks/index.js';
import { ModelConfig } from '../../runtime/config.js';
import { until } from '../helpers.js';

const vadPath = defaultCatalog().find((m) => m.id === 'silero-vad')!.path;
const vadSpec = (): LoadSpec => ({ kind: 'vad', model: vadPath });
const vadJob = (windows: number): Job => ({
  kind: 'vad',
  windows: new Float32Array(windows * 512).map((_, i) => Math.sin(i / 10) * 0.3),
  state: new Float32Array(256),
  context: new Float32Array(64),
});

describe('SlotPool on real slot workers', () => {
  it('runs two jobs at once on a pool of two slots (their run intervals overlap)', async () => {
    const pool = await SlotPool.start(vadSpec(), 2);
    try {
      const [a, b] = await Promise.all([pool.run(vadJob(400)), pool.run(vadJob(400))]);
      const [a0, a1] = a.ran!;
      const [b0, b1] = b.ran!;
      expect(a0 < b1 && b0 < a1).toBe(true);
    } finally {
      await pool.close();
    }
  });

  it('runs jobs one after another on a pool of one slot', async () => {
    const pool = await SlotPool.start(vadSpec(), 1);
    try {
      // A thread host cannot be killed at a job timeout: nothing is queued behind its running job.
      expect(pool.capacity).toBe(1);
      const [a, b] = await Promise.all([pool.run(vadJob(100)), pool.run(vadJob(100))]);
      expect(a.ran![1]).toBeLessThanOrEqual(b.ran![0]);
    } finally {
      await pool.close();
    }
  });

  it('rejects a model file that is not ONNX', async () => {
    const path = join(tmpdir(), `voxserve-bad-${process.pid}.onnx`);
    writeFileSync(path, 'definitely not an onnx protobuf');
    const bad: LoadSpec = { kind: 'vad', model: path };
    await expect(SlotPool.start(bad, 1)).rejects.toThrow();
  });
});

/** A fake slot recording what happened to it. */
function fakeFactory(log: string[], failOn: number | null) {
  let n = 0;
  return async (_spec: LoadSpec): Promise<SlotHost> => {
    const id = n++;
    await new Promise((r) => setTimeout(r, id === 0 ? 1 : 5 * id));
    if (id === failOn) throw new Error(`clone ${id} failed`);
    log.push(`start ${id}`);
    return {
      info: {} as SlotInfo,
      run: async (job: Job) =>
        (log.push(`run ${id}`),
        {
          kind: 'vad',
          probs: new Float32Array(0),
          state: (job as { state: Float32Array }).state,
          context: new Float32Array(64),
        }) as JobResult,
      close: async () => void log.push(`close ${id}`),
      onExit: () => {},
      residentBytes: () => 0,
    };
  };
}

describe('SlotPool.start', () => {
  it('on a failing clone closes the clones, then the primary, and rethrows', async () => {
    const log: string[] = [];
    await expect(SlotPool.start(vadSpec(), 4, fakeFactory(log, 2))).rejects.toThrow('clone 2 failed');
    expect(log).toEqual(['start 0', 'start 1', 'start 3', 'close 1', 'close 3', 'close 0']);
  });

  it('drops a queued job whose client went away, without running it', async () => {
    const log: string[] = [];
    const pool = await SlotPool.start(vadSpec(), 1, fakeFactory(log, null));
    const first = pool.run(vadJob(1));
    const gone = new AbortController();
    const second = pool.run(vadJob(1), gone.signal);
    gone.abort();
    await expect(second).rejects.toThrow(/went away/);
    await first;
    expect(log.filter((l) => l.startsWith('run'))).toEqual(['run 0']);
    await pool.close();
  });

  it('a respawn still loading after its load timeout fails the pool naming load_timeout_ms (the host is abandoned through its signal)', async () => {
    let n = 0;
    const exits: ((e: Error) => void)[] = [];
    const signals: (AbortSignal | undefined)[] = [];
    const factory = async (_spec: LoadSpec, signal?: AbortSignal): Promise<SlotHost> => {
      signals.push(signal);
      // The first host starts; its respawn never finishes loading.
      if (n++ > 0) return new Promise<never>(() => {});
      return {
        info: {},
        run: async () => ({}) as JobResult,
        close: async () => {},
        onExit: (cb) => exits.push(cb),
        residentBytes: () => 0,
      };
    };
    const pool = await SlotPool.start(vadSpec(), 1, factory, { loadTimeoutMs: 150 });
    const failed = new Promise<Error>((resolve) => pool.onFailure(resolve));
    exits[0](new Error('slot host was killed by SIGKILL'));
    const err = await failed;
    expect(err.message).toMatch(/a slot could not be restarted: it took longer than load_timeout_ms \(150 ms\)/);
    expect(signals[1]?.aborted).toBe(true);
    await pool.close();
  });

  it('close() abandons a respawn in flight: its signal aborts (a process host is killed) and close does not hang on it', async () => {
    let n = 0;
    const exits: ((e: Error) => void)[] = [];
    let respawn: AbortSignal | undefined;
    const factory = (_spec: LoadSpec, signal?: AbortSignal): Promise<SlotHost> => {
      if (n++ === 0)
        return Promise.resolve({
          info: {},
          run: async () => ({}) as JobResult,
          close: async () => {},
          onExit: (cb) => exits.push(cb),
          residentBytes: () => 0,
        });
      respawn = signal;
      // A host that never finishes loading.
      return new Promise<never>(() => {});
    };
    const pool = await SlotPool.start(vadSpec(), 1, factory, { loadTimeoutMs: 0 });
    exits[0](new Error('slot host exited with code 1'));
    await until(() => respawn !== undefined, 2000);
    await pool.close();
    expect(respawn!.aborted).toBe(true);
  });
});

/** Slots whose jobs run until the test ends them (`finish()`: the oldest running job answers). */
function hangingFactory() {
  const running: (() => void)[] = [];
  const factory = async (): Promise<SlotHost> => ({
    info: {} as SlotInfo,
    run: (job: Job) =>
      new Promise<JobResult>((resolve) =>
        running.push(() =>
          resolve({
            kind: 'vad',
            probs: new Float32Array(0),
            state: (job as { state: Float32Array }).state,
          } as JobResult),
        ),
      ),
    close: async () => {},
    onExit: () => {},
    residentBytes: () => 0,
  });
  return { factory, finish: () => running.shift()!() };
}

describe("stuck slots (DESIGN.md C4): the pool's slot-wait timer decides, onStuck says so", () => {
  afterEach(() => void vi.useRealTimers());

  it('every slot running one job longer than waitTimeoutMs turns the pool stuck (no waiter needed), not a ms before; a job that ends frees it', async () => {
    vi.useFakeTimers({ now: 0 });
    const slots = hangingFactory();
    const pool = await SlotPool.start(vadSpec(), 2, slots.factory);
    pool.waitTimeoutMs = 100;
    const said: boolean[] = [];
    pool.onStuck = (stuck) => void said.push(stuck);
    const a = pool.run(vadJob(1));
    await vi.advanceTimersByTimeAsync(30);
    const b = pool.run(vadJob(1)); // both slots busy from t=30
    await vi.advanceTimersByTimeAsync(100); // t=130: the job of t=30 has run 100 ms, not more
    expect(said).toEqual([]);
    await vi.advanceTimersByTimeAsync(1); // 101 ms
    expect(said).toEqual([true]);
    // While stuck, a queued job is answered 503 model_stuck at once.
    const c = pool.run(vadJob(1));
    const refused = c.catch((e: unknown) => e);
    await vi.advanceTimersByTimeAsync(2);
    expect(await refused).toMatchObject({ code: 'model_stuck', status: 503 });
    slots.finish();
    await a;
    await vi.advanceTimersByTimeAsync(0); // the slot is handed back after the result
    expect(said).toEqual([true, false]);
    slots.finish();
    await b;
    await vi.advanceTimersByTimeAsync(0);
    expect(said).toEqual([true, false]);
    await pool.close();
  });

  it('waitTimeoutMs 0 (unbounded): never stuck', async () => {
    vi.useFakeTimers({ now: 0 });
    const slots = hangingFactory();
    const pool = await SlotPool.start(vadSpec(), 1, slots.factory);
    const said: boolean[] = [];
    pool.onStuck = (stuck) => void said.push(stuck);
    const a = pool.run(vadJob(1));
    await vi.advanceTimersByTimeAsync(3_600_000);
    expect(said).toEqual([]);
    slots.finish();
    await a;
    await pool.close();
  });
});

describe("the slots' busy time (busyMs: the autoscaler's average busy slots)", () => {
  afterEach(() => void vi.useRealTimers());

  it('sums each job from its start on its slot to its end, the running ones up to now, not the time queued', async () => {
    vi.useFakeTimers({ now: 0 });
    const slots = hangingFactory();
    const pool = await SlotPool.start(vadSpec(), 2, slots.factory);
    const a = pool.run(vadJob(1));
    await vi.advanceTimersByTimeAsync(10);
    const b = pool.run(vadJob(1));
    const c = pool.run(vadJob(1)); // queued behind a and b
    await vi.advanceTimersByTimeAsync(30); // t=40: a has run 40 ms, b 30
    expect(pool.busyMs(Date.now())).toBe(70);
    slots.finish(); // a ends at 40; c starts on its slot
    await a;
    await vi.advanceTimersByTimeAsync(20); // t=60: a 40 (ended) + b 50 + c 20
    expect(pool.busyMs(Date.now())).toBe(110);
    slots.finish();
    slots.finish();
    await Promise.all([b, c]);
    await vi.advanceTimersByTimeAsync(100); // nothing running: it stays
    expect(pool.busyMs(Date.now())).toBe(110);
    await pool.close();
  });
});

describe("a pool's window (a remote pool's jobs in flight follow its holders' slots)", () => {
  it('sends at most window() jobs at once, read at each dispatch: a window widened later lets the waiting jobs go', async () => {
    // One slot object for every place, as a remote pool has (cluster/remote.ts); its jobs end when the test says.
    const ends: (() => void)[] = [];
    const slot: SlotHost = {
      info: {} as SlotInfo,
      run: () => new Promise<JobResult>((resolve) => ends.push(() => resolve({ kind: 'vad' } as JobResult))),
      close: async () => {},
      onExit: () => {},
      residentBytes: () => 0,
    };
    let window = 2;
    const pool = await SlotPool.start(vadSpec(), 32, async () => slot, { window: () => window });
    expect([pool.size, pool.capacity]).toEqual([2, 2]);
    const job: Job = {
      kind: 'vad',
      windows: new Float32Array(512),
      state: new Float32Array(256),
      context: new Float32Array(64),
    };
    const runs = Array.from({ length: 6 }, () => pool.run(job));
    expect(ends.length).toBe(2);
    expect(pool.queued).toBe(4);
    // A second holder: the window is 4 from the next dispatch (a job's end, or a new job).
    window = 4;
    expect([pool.size, pool.capacity]).toEqual([4, 4]);
    const flush = () => new Promise((r) => setImmediate(r));
    ends.shift()!();
    await flush();
    expect(ends.length).toBe(4);
    expect(pool.inFlight).toBe(4);
    // Narrowed again (a holder gone): the jobs in flight finish, no new one goes until fewer than 2 are.
    window = 2;
    for (let i = 0; i < 3; i++) ends.shift()!();
    await flush();
    expect(pool.inFlight).toBe(2);
    for (const end of ends.splice(0)) end();
    await Promise.all(runs);
    expect(pool.inFlight).toBe(0);
    await pool.close();
  });
});

describe('main-process memory of process slot hosts (issue 25 item 14)', () => {
  it('issue 25 item 14: results from a process host are read into reused buffers (one per region of the job channel), not a fresh one per frame; a VAD session keeps copies, not views', async () => {
    const pool = await SlotPool.start(vadSpec(), 1, processSlots(0));
    try {
      // Without job_timeout_ms a host holds one job at a time (nothing would bound a wait behind it).
      expect(pool.capacity).toBe(1);
      const a = await pool.run(vadJob(64));
      const aState = (a as { state: Float32Array }).state.slice();
      // The frames between land in the channel's other regions (SLOT_DEPTH of them, used in turn).
      for (let i = 1; i < SLOT_DEPTH; i++) await pool.run(vadJob(4));
      const b = await pool.run(vadJob(4)); // smaller: it fits the buffer a grew
      // One buffer for every SLOT_DEPTH-th frame of the host: no garbage per result (which nothing collected while
      // idle).
      expect((b as { probs: Float32Array }).probs.buffer).toBe((a as { probs: Float32Array }).probs.buffer);
      // So a's arrays now hold b's values: whoever keeps a result's arrays must copy them.
      expect(Array.from((a as { state: Float32Array }).state)).not.toEqual(Array.from(aState));
      // A VAD session does: its state after accepting a result does not change when the next result arrives.
      const config = ModelConfig.parse({ id: 'v', task: 'vad', path: vadPath });
      const session = createTaskSession(config, pool.info, {}, true);
      session.push(new Float32Array(512 * 4).map((_, i) => Math.sin(i / 7) * 0.3));
      session.accept(await pool.run(session.nextJob(64)!));
      const state = (): number[] => Array.from((session as unknown as { state: Float32Array }).state);
      const kept = state();
      expect(kept.some((v) => v !== 0)).toBe(true);
      // The next results land in the same buffers.
      for (let i = 0; i < SLOT_DEPTH; i++) await pool.run(vadJob(8));
      expect(state()).toEqual(kept);
    } finally {
      await pool.close();
    }
  });
});

describe('a busy slot holds a second job queued behind its running one (SlotHost.depth)', () => {
  afterEach(() => void vi.useRealTimers());

  /**
   * Slots of depth 2 whose jobs run until the test answers them. `sent` lists every job a slot
   * was given, in order, as `slot:job` (a job is named by its first window sample); `answer(i)`
   * ends slot i's oldest job; `die(i)` kills slot i's host (its jobs fail `slot_failed`, as a real
   * host's do).
   */
  function lineFactory() {
    const sent: string[] = [];
    const slots: { jobs: (() => void)[]; fails: ((e: Error) => void)[]; exit?: (e: Error) => void }[] = [];
    const factory = async (): Promise<SlotHost> => {
      const me = {
        jobs: [] as (() => void)[],
        fails: [] as ((e: Error) => void)[],
        exit: undefined as ((e: Error) => void) | undefined,
      };
      const i = slots.push(me) - 1;
      return {
        info: {} as SlotInfo,
        depth: 2,
        run: (job: Job) =>
          new Promise<JobResult>((resolve, reject) => {
            const name = (job as { windows: Float32Array }).windows[0];
            sent.push(`${i}:${name}`);
            me.jobs.push(() => resolve({ kind: 'vad', probs: new Float32Array([name]) } as unknown as JobResult));
            me.fails.push(reject);
          }),
        close: async () => {},
        onExit: (cb) => void (me.exit = cb),
        residentBytes: () => 0,
      };
    };
    const answer = (i: number): void => {
      slots[i].fails.shift();
      slots[i].jobs.shift()!();
    };
    /**
     * Slot i's running job runs over its job timeout: rejected as the pool's `slotLost`; the host's exit comes later
     * (`die`).
     */
    const lose = (i: number): void => {
      slots[i].jobs.shift();
      slots[i].fails.shift()!(Object.assign(voxError('job_timeout', { ms: 100 }), { slotLost: true }));
    };
    const die = (i: number): void => {
      const err = voxError('slot_failed', { reason: 'slot host was killed by SIGKILL' });
      slots[i].exit!(err);
      for (const fail of slots[i].fails.splice(0)) fail(err);
      slots[i].jobs.length = 0;
    };
    return { factory, sent, answer, lose, die };
  }
  const job = (name: number): Job => ({
    kind: 'vad',
    windows: new Float32Array(512).fill(name),
    state: new Float32Array(256),
    context: new Float32Array(64),
  });
  const probe = (r: JobResult): number => (r as { probs: Float32Array }).probs[0];
  /** A batcher's job: it may be queued behind a busy slot's running job. */
  const go = (pool: SlotPool, j: Job): Promise<JobResult> => pool.run(j, undefined, 0, true);

  it('a free slot first; with every slot busy, the slot whose job started first gets the next job behind it; past the capacity, jobs wait in the pool', async () => {
    vi.useFakeTimers({ now: 0 });
    const f = lineFactory();
    const pool = await SlotPool.start(vadSpec(), 2, f.factory);
    expect(pool.capacity).toBe(4);
    const runs = [go(pool, job(1))];
    await vi.advanceTimersByTimeAsync(5);
    runs.push(go(pool, job(2)), go(pool, job(3)), go(pool, job(4)), go(pool, job(5)));
    await vi.advanceTimersByTimeAsync(0);
    // Job 3 goes behind job 1 (it started first), job 4 behind job 2; job 5 waits for room.
    expect(f.sent).toEqual(['0:1', '1:2', '0:3', '1:4']);
    expect(pool.activeSlots).toBe(2);
    f.answer(1); // slot 1's job 2 ends: its job 4 runs, and job 5 goes behind it
    await vi.advanceTimersByTimeAsync(0);
    expect(f.sent).toEqual(['0:1', '1:2', '0:3', '1:4', '1:5']);
    expect(probe(await runs[1])).toBe(2);
    f.answer(0);
    f.answer(0);
    f.answer(1);
    f.answer(1);
    expect((await Promise.all(runs)).map(probe)).toEqual([1, 2, 3, 4, 5]);
    await pool.close();
  });

  it('a job goes to the free slot freed last: under light load one host takes batch after batch while the other sleeps', async () => {
    const f = lineFactory();
    const pool = await SlotPool.start(vadSpec(), 2, f.factory);
    const one = async (name: number, slot: number): Promise<void> => {
      const r = go(pool, job(name));
      await vi.waitFor(() => expect(f.sent.length).toBeGreaterThanOrEqual(name));
      f.answer(slot);
      expect(probe(await r)).toBe(name);
    };
    // One job at a time: slot 0 every time (taking the slot freed first would alternate 0, 1, 0).
    await one(1, 0);
    await one(2, 0);
    await one(3, 0);
    // Both busy, slot 0 ends first, then slot 1: the next job goes to slot 1.
    const both = [go(pool, job(4)), go(pool, job(5))];
    await vi.waitFor(() => expect(f.sent.length).toBe(5));
    f.answer(0);
    f.answer(1);
    await Promise.all(both);
    await one(6, 1);
    expect(f.sent).toEqual(['0:1', '0:2', '0:3', '0:4', '1:5', '1:6']);
    await pool.close();
  });

  it('a job queued behind another waits, in `waitedMs`, until that one has ended', async () => {
    vi.useFakeTimers({ now: 0 });
    const f = lineFactory();
    const pool = await SlotPool.start(vadSpec(), 1, f.factory);
    const a = go(pool, job(1));
    const b = go(pool, job(2));
    await vi.advanceTimersByTimeAsync(40);
    f.answer(0);
    expect((await a).waitedMs).toBe(0);
    await vi.advanceTimersByTimeAsync(10);
    f.answer(0);
    expect((await b).waitedMs).toBe(40);
    await pool.close();
  });

  it("C3: a batcher's job queued behind a running one waits there without a deadline, as in its batcher; a request's own job is never queued behind one: it waits in the pool's queue and is answered 503 busy_timeout at its bound", async () => {
    vi.useFakeTimers({ now: 0 });
    const f = lineFactory();
    const pool = await SlotPool.start(vadSpec(), 1, f.factory);
    const a = go(pool, job(1));
    const r = pool.run(job(7), undefined, 50).catch((e: unknown) => e); // a request's job, its busy timeout 50 ms
    const b = go(pool, job(2)); // after it in the queue: jobs start in arrival order
    await vi.advanceTimersByTimeAsync(0);
    expect(f.sent).toEqual(['0:1']);
    await vi.advanceTimersByTimeAsync(80);
    expect(await r).toMatchObject({ code: 'busy_timeout', status: 503 });
    // Job 2 is next: it goes behind job 1, and waits there past any deadline.
    expect(f.sent).toEqual(['0:1', '0:2']);
    await vi.advanceTimersByTimeAsync(10_000);
    f.answer(0);
    f.answer(0);
    expect([probe(await a), probe(await b)]).toEqual([1, 2]);
    await pool.close();
  });

  it("a request's job at the queue's head that goes away lets the batcher's job after it go behind a running one", async () => {
    const f = lineFactory();
    const pool = await SlotPool.start(vadSpec(), 1, f.factory);
    const a = go(pool, job(1));
    const gone = new AbortController();
    const r = pool.run(job(7), gone.signal).catch((e: unknown) => e);
    const b = go(pool, job(2));
    await until(() => f.sent.length === 1, 1000);
    gone.abort();
    expect(await r).toMatchObject({ name: 'AbortError' });
    expect(f.sent).toEqual(['0:1', '0:2']);
    f.answer(0);
    f.answer(0);
    expect([probe(await a), probe(await b)]).toEqual([1, 2]);
    await pool.close();
  });

  it("C4: no job goes behind an overdue one; once every slot is overdue a request's job is answered 503 model_stuck, and one queued behind a running job before waits for it", async () => {
    vi.useFakeTimers({ now: 0 });
    const f = lineFactory();
    const pool = await SlotPool.start(vadSpec(), 2, f.factory);
    pool.waitTimeoutMs = 100;
    const a = go(pool, job(1)); // slot 0 from t=0
    await vi.advanceTimersByTimeAsync(60);
    const b = go(pool, job(2)); // slot 1 from t=60
    await vi.advanceTimersByTimeAsync(50); // t=110: job 1 is overdue
    const d = go(pool, job(4));
    await vi.advanceTimersByTimeAsync(0);
    // Not behind the overdue job 1 (slot 0), though it started first: behind job 2.
    expect(f.sent).toEqual(['0:1', '1:2', '1:4']);
    await vi.advanceTimersByTimeAsync(60); // t=170: job 2 has run 110 ms too: stuck
    const e = go(pool, job(5)).catch((err: unknown) => err);
    await vi.advanceTimersByTimeAsync(2);
    expect(await e).toMatchObject({ code: 'model_stuck', status: 503 });
    for (const i of [0, 1, 1]) f.answer(i);
    expect([probe(await a), probe(await b), probe(await d)]).toEqual([1, 2, 4]);
    await pool.close();
  });

  it('a job queued behind one whose host crashes goes back to the pool, and so does the running job, once, ahead of it: both run on a live slot', async () => {
    vi.useFakeTimers({ now: 0 });
    const f = lineFactory();
    const pool = await SlotPool.start(vadSpec(), 2, f.factory);
    const a = go(pool, job(1));
    const b = go(pool, job(2));
    const c = go(pool, job(3)); // behind job 1, on slot 0
    await vi.advanceTimersByTimeAsync(0);
    expect(f.sent).toEqual(['0:1', '1:2', '0:3']);
    f.die(0); // job 1 was running: it runs again; job 3 had not started
    await vi.advanceTimersByTimeAsync(0);
    expect(f.sent.slice(3)).toEqual(['1:1']); // behind job 2 on slot 1, ahead of job 3 (arrival order)
    f.answer(1); // job 2 ends; job 1 runs, and job 3 goes behind it
    expect(probe(await b)).toBe(2);
    await vi.advanceTimersByTimeAsync(0);
    expect(f.sent.slice(4)).toEqual(['1:3']);
    f.answer(1);
    expect(probe(await a)).toBe(1);
    f.answer(1);
    expect(probe(await c)).toBe(3);
    await vi.advanceTimersByTimeAsync(200); // slot 0's respawn (after its backoff), which close waits for
    await pool.close();
  });

  it('a running job whose host crashes runs once more; a second crash under it fails it input_crashed_model (a job that kills hosts kills two, not every slot)', async () => {
    vi.useFakeTimers({ now: 0 });
    const f = lineFactory();
    const pool = await SlotPool.start(vadSpec(), 3, f.factory);
    const a = go(pool, job(1)).catch((e: unknown) => e);
    await vi.advanceTimersByTimeAsync(0);
    f.die(0);
    await vi.advanceTimersByTimeAsync(0);
    expect(f.sent).toEqual(['0:1', '1:1']);
    f.die(1);
    expect(await a).toMatchObject({ code: 'input_crashed_model', message: expect.stringMatching(/SIGKILL/) });
    await vi.advanceTimersByTimeAsync(0);
    expect(f.sent).toEqual(['0:1', '1:1']); // not sent to slot 2
    await vi.advanceTimersByTimeAsync(400); // both respawn (backoffs 100 and 200 ms)
    expect(pool.slots).toHaveLength(3);
    const b = go(pool, job(2));
    await vi.advanceTimersByTimeAsync(0);
    f.answer(Number(f.sent.at(-1)!.split(':')[0]));
    expect(probe(await b)).toBe(2);
    await pool.close();
  });

  it('a slot whose job was killed at its timeout, its exit still to come, counts as neither running nor stuck; its queued job runs elsewhere once the exit comes', async () => {
    vi.useFakeTimers({ now: 0 });
    const f = lineFactory();
    const pool = await SlotPool.start(vadSpec(), 2, f.factory);
    pool.waitTimeoutMs = 100;
    const said: boolean[] = [];
    pool.onStuck = (stuck) => void said.push(stuck);
    const a = go(pool, job(1)).catch((e: unknown) => e); // slot 0 from t=0
    const b = go(pool, job(2)); // slot 1
    await vi.advanceTimersByTimeAsync(40);
    const c = go(pool, job(3)); // t=40, behind job 1 (its deadline: t=140)
    await vi.advanceTimersByTimeAsync(5);
    f.answer(1); // slot 1 is free
    expect(probe(await b)).toBe(2);
    await vi.advanceTimersByTimeAsync(5);
    f.lose(0); // t=50: job 1 killed at its timeout; slot 0's host has not exited yet
    expect(await a).toMatchObject({ slotLost: true });
    expect(pool.activeSlots).toBe(0);
    await vi.advanceTimersByTimeAsync(70); // t=120: job 1 (from t=0) would be overdue
    expect(said).toEqual([]);
    f.die(0); // the exit: job 3 goes back to the pool and runs on slot 1
    await vi.advanceTimersByTimeAsync(0);
    expect(f.sent).toEqual(['0:1', '1:2', '0:3', '1:3']);
    f.answer(1);
    expect(probe(await c)).toBe(3);
    await vi.advanceTimersByTimeAsync(200); // slot 0's respawn (after its backoff), which close waits for
    await pool.close();
  });

  it("the crashes of jobs that crashed two hosts each are their inputs', not the model's: two such jobs (four crashes) do not fail the pool, and the next job runs (issue 44 item 8)", async () => {
    vi.useFakeTimers({ now: 0 });
    const f = lineFactory();
    const pool = await SlotPool.start(vadSpec(), 1, f.factory);
    let failed: Error | null = null;
    pool.onFailure((e) => void (failed = e));
    for (const name of [1, 2]) {
      const a = go(pool, job(name)).catch((e: unknown) => e);
      for (const _ of [1, 2]) {
        await vi.advanceTimersByTimeAsync(400); // the (respawned) slot takes it
        f.die(Number(f.sent.at(-1)!.split(':')[0])); // the host running it
      }
      expect(await a).toMatchObject({ code: 'input_crashed_model' });
    }
    await vi.advanceTimersByTimeAsync(400);
    expect(failed).toBeNull();
    const b = go(pool, job(3));
    await vi.advanceTimersByTimeAsync(0);
    f.answer(Number(f.sent.at(-1)!.split(':')[0]));
    expect(probe(await b)).toBe(3);
    await pool.close();
  });

  it("the running job whose host's death fails the pool (the third crash in a minute), and the job queued behind it, get the pool's error, as the queue does", async () => {
    const f = lineFactory();
    const pool = await SlotPool.start(vadSpec(), 1, f.factory);
    pool.onFailure(() => {});
    for (const i of [0, 1]) {
      f.die(i); // a crash: respawned after a backoff
      await until(() => pool.slots.length === 1, 2000);
    }
    const a = go(pool, job(1)).catch((e: unknown) => e);
    const b = go(pool, job(2)).catch((e: unknown) => e); // behind job 1
    await until(() => f.sent.length === 2, 1000);
    f.die(2);
    // Not run again: the pool has failed. The running job names the cause (the loop), as the others do.
    expect(await a).toMatchObject({ code: 'slot_crash_loop', message: expect.stringMatching(/SIGKILL/) });
    expect(await b).toMatchObject({ code: 'slot_crash_loop' });
    await pool.close();
  });

  it('a process host runs the jobs it holds one at a time, in order, each with its own frame region: every result is what the job gives alone', async () => {
    const pool = await SlotPool.start(vadSpec(), 1, processSlots(60_000));
    try {
      expect(pool.capacity).toBe(SLOT_DEPTH);
      const jobs = [3, 1, 5, 2, 4, 1].map((n, k) => ({
        kind: 'vad' as const,
        windows: new Float32Array(n * 512).map((_, i) => Math.sin((i * (k + 1)) / 13) * 0.4),
        state: new Float32Array(256),
        context: new Float32Array(64),
      }));
      const copy = (r: JobResult): number[][] =>
        ['probs', 'state', 'context'].map((k) => Array.from((r as unknown as Record<string, Float32Array>)[k]));
      const alone: number[][][] = [];
      for (const j of jobs) alone.push(copy(await pool.run(structuredClone(j))));
      // All at once: two go to the host together, the rest follow as it answers.
      const together = await Promise.all(jobs.map((j) => go(pool, structuredClone(j)).then(copy)));
      expect(together).toEqual(alone);
    } finally {
      await pool.close();
    }
  });
});
