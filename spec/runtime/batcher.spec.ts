import { describe, expect, it } from 'vitest';
import { Batcher, lapseOf, vadPacking, wakewordPacking } from '../../runtime/batcher.js';
import {
  OWW,
  type JobResult,
  type VadJob,
  type VadResult,
  type WakewordJob,
  type WakewordResult,
} from '../../runtime/slots/slot-protocol.js';
import type { SlotPool } from '../../runtime/slots/slots.js';

/** Waits (in 1 ms steps) until `done()`. */
const until = async (done: () => boolean): Promise<void> => {
  while (!done()) await new Promise((r) => setTimeout(r, 1));
};

/** A stream's VAD job of `windows` windows whose every sample is `value`. */
const row = (value: number, windows = 2): VadJob => ({
  kind: 'vad',
  windows: new Float32Array(windows * 512).fill(value),
  state: new Float32Array(256).fill(value),
  context: new Float32Array(64).fill(value),
});

/**
 * A pool of `size` slots, a job each, that holds each job until the test answers it; the answer echoes each row's first
 * sample as its probabilities.
 */
function heldPool(size: number) {
  const held: { job: VadJob; answer: () => void }[] = [];
  const pool = {
    size,
    capacity: size,
    run(job: VadJob): Promise<JobResult> {
      return new Promise((resolve) => {
        held.push({
          job,
          answer: () => {
            const probs = new Float32Array(job.windows.length / 512).map((_, w) => job.windows[w * 512]);
            resolve({ kind: 'vad', probs, state: job.state.slice(), context: job.context.slice() });
          },
        });
      });
    },
  };
  return { pool: pool as unknown as SlotPool, held };
}

describe('Batcher', () => {
  it("keeps a batch's packed job intact until its result is back, while later batches are packed and answered", async () => {
    const { pool, held } = heldPool(2);
    // A 20 ms delay: the two rows run back to back must share the first batch (with 1 ms, a tick of
    // Date.now() between the two calls sent the first alone: a flake seen once in CI).
    const batcher = new Batcher<VadJob, VadResult>(pool, vadPacking, 2, 20);
    const first = [batcher.run(row(1)), batcher.run(row(2))];
    expect(held).toHaveLength(1);
    const second = batcher.run(row(3));
    await until(() => held.length === 2);
    // The second batch is answered first; its buffers go to the third batch, packed while the first is still out.
    held[1].answer();
    expect((await second).probs[0]).toBe(3);
    const third = batcher.run(row(9, 4));
    await until(() => held.length === 3);
    expect(held[2].job.windows.every((v) => v === 9)).toBe(true);
    // The first batch's job still holds its own rows' samples and state.
    const job = held[0].job;
    expect(job.counts).toEqual([2, 2]);
    expect(
      job.windows.subarray(0, 1024).every((v) => v === 1) && job.windows.subarray(1024).every((v) => v === 2),
    ).toBe(true);
    expect(job.state.subarray(0, 256).every((v) => v === 1) && job.state.subarray(256).every((v) => v === 2)).toBe(
      true,
    );
    held[0].answer();
    const [a, b] = await Promise.all(first);
    expect([...a.probs]).toEqual([1, 1]);
    expect([...b.probs]).toEqual([2, 2]);
    expect(b.state.every((v) => v === 2)).toBe(true);
    held[2].answer();
    expect([...(await third).probs]).toEqual([9, 9, 9, 9]);
  });

  it('keeps rows of more windows out of a full batch, so that its runs hold every row; each row gets its own result', async () => {
    const { pool, held } = heldPool(1);
    const batcher = new Batcher<VadJob, VadResult>(pool, vadPacking, 2, 0);
    // The only slot takes the first job; four wait, more than a batch (2 rows) holds.
    const first = batcher.run(row(1, 3));
    const waiting = [batcher.run(row(2, 3)), batcher.run(row(3, 4)), batcher.run(row(4, 3)), batcher.run(row(5, 4))];
    expect(held).toHaveLength(1);
    held[0].answer();
    await first;
    await until(() => held.length === 2);
    // Led by the oldest (3 windows): the other 3-window job, not the older 4-window one.
    expect(held[1].job.counts).toEqual([3, 3]);
    expect([held[1].job.windows[0], held[1].job.windows[3 * 512]]).toEqual([2, 4]);
    held[1].answer();
    await until(() => held.length === 3);
    expect(held[2].job.counts).toEqual([4, 4]);
    held[2].answer();
    const results = await Promise.all(waiting);
    expect(results.map((r) => [...r.probs])).toEqual([
      [2, 2, 2],
      [3, 3, 3, 3],
      [4, 4, 4],
      [5, 5, 5, 5],
    ]);
  });

  it('wake words (rows run one after another): a batch takes its fair share of the waiting steps, so that a backlog is spread over the slots', async () => {
    const held: WakewordJob[] = [];
    const pool = {
      size: 2,
      capacity: 2,
      run: (job: WakewordJob) => (held.push(job), new Promise<JobResult>(() => {})),
    };
    // A wake-word job of `steps` 80 ms steps; its first sample names it.
    const ww = (name: number, steps: number): WakewordJob => ({
      kind: 'wakeword',
      audio: new Float32Array(OWW.LOOKBACK + steps * OWW.STEP).fill(name),
      mel: new Float32Array(OWW.MEL_FRAMES * OWW.MEL_BINS),
      embeddings: new Float32Array(16 * OWW.EMBEDDING),
    });
    const batcher = new Batcher<WakewordJob, WakewordResult>(pool as unknown as SlotPool, wakewordPacking, 32, 50);
    // Six streams' jobs of 10, 10, 10, 10, 2 and 2 steps (44 in all) wait, then the batch goes: half of 44 is 22.
    for (const [name, steps] of [
      [1, 10],
      [2, 10],
      [3, 10],
      [4, 10],
      [5, 2],
      [6, 2],
    ])
      void batcher.run(ww(name, steps));
    await until(() => held.length === 2);
    const names = (job: WakewordJob) =>
      job.counts!.map(
        (_, r) => job.audio[r === 0 ? 0 : job.counts!.slice(0, r).reduce((a, c) => a + OWW.LOOKBACK + c * OWW.STEP, 0)],
      );
    // The first batch: the two oldest (20 steps; a third would make 30 > 22); the second slot at once
    // the next (half of the 24 left is 12, under the 16 never split: one job of 10, as a second would
    // make 20); the other 14 steps wait for a free slot.
    expect(names(held[0])).toEqual([1, 2]);
    expect(names(held[1])).toEqual([3]);
    await new Promise((r) => setTimeout(r, 80));
    expect(held).toHaveLength(2);
  });

  it("drops the jobs of streams that went away from the batch that takes them, and runs the others' rows", async () => {
    const { pool, held } = heldPool(1);
    const batcher = new Batcher<VadJob, VadResult>(pool, vadPacking, 4, 5);
    const gone = new AbortController();
    const lost = batcher.run(row(1), gone.signal);
    const kept = [batcher.run(row(2)), batcher.run(row(3))];
    gone.abort();
    await expect(lost).rejects.toThrow(/aborted/);
    await until(() => held.length === 1);
    // One batch of the two live rows: the aborted job's row is not in it.
    expect(held[0].job.counts).toEqual([2, 2]);
    expect([held[0].job.windows[0], held[0].job.windows[512 * 2]]).toEqual([2, 3]);
    held[0].answer();
    expect((await Promise.all(kept)).map((r) => r.probs[0])).toEqual([2, 3]);
  });

  it('wake words: a batch whose every job was dropped (their streams went away) sends nothing, and nothing breaks', async () => {
    const held: WakewordJob[] = [];
    const pool = {
      size: 2,
      capacity: 2,
      run: (job: WakewordJob) => (held.push(job), new Promise<JobResult>(() => {})),
    };
    const batcher = new Batcher<WakewordJob, WakewordResult>(pool as unknown as SlotPool, wakewordPacking, 32, 5);
    const gone = new AbortController();
    const job: WakewordJob = {
      kind: 'wakeword',
      audio: new Float32Array(OWW.LOOKBACK + OWW.STEP),
      mel: new Float32Array(OWW.MEL_FRAMES * OWW.MEL_BINS),
      embeddings: new Float32Array(16 * OWW.EMBEDDING),
    };
    const result = batcher.run(job, gone.signal);
    gone.abort();
    await expect(result).rejects.toThrow(/aborted/);
    await new Promise((r) => setTimeout(r, 20));
    expect(held).toEqual([]);
  });

  it('wake words: a short batch (up to SERIAL_BATCH_STEPS steps) is not split among the slots', async () => {
    const held: WakewordJob[] = [];
    const pool = {
      size: 2,
      capacity: 2,
      run: (job: WakewordJob) => (held.push(job), new Promise<JobResult>(() => {})),
    };
    const batcher = new Batcher<WakewordJob, WakewordResult>(pool as unknown as SlotPool, wakewordPacking, 32, 20);
    const ww = (steps: number): WakewordJob => ({
      kind: 'wakeword',
      audio: new Float32Array(OWW.LOOKBACK + steps * OWW.STEP),
      mel: new Float32Array(OWW.MEL_FRAMES * OWW.MEL_BINS),
      embeddings: new Float32Array(16 * OWW.EMBEDDING),
    });
    // Eight streams' jobs of 2 steps: 16 in all go as one batch (split in halves, they would make two).
    for (let i = 0; i < 8; i++) void batcher.run(ww(2));
    await until(() => held.length > 0);
    await new Promise((r) => setTimeout(r, 40));
    expect(held).toHaveLength(1);
    expect(held[0].counts).toEqual([2, 2, 2, 2, 2, 2, 2, 2]);
  });

  it("submit: a row's callback that throws does not keep the batch's other rows from their results", async () => {
    const { pool, held } = heldPool(1);
    const batcher = new Batcher<VadJob, VadResult>(pool, vadPacking, 3, 20);
    const told: number[] = [];
    const rejections: unknown[] = [];
    const onRejection = (e: unknown): void => void rejections.push(e);
    process.on('unhandledRejection', onRejection);
    try {
      batcher.submit(row(1), undefined, (_e, r) => told.push(r!.probs[0]));
      batcher.submit(row(2), undefined, () => {
        throw new Error('a stream handler failed');
      });
      batcher.submit(row(3), undefined, (_e, r) => told.push(r!.probs[0]));
      expect(held).toHaveLength(1);
      held[0].answer();
      await until(() => told.length === 2 && rejections.length === 1);
      expect(told).toEqual([1, 3]);
      // Raised again where it would have surfaced with promises: as an unhandled rejection.
      expect((rejections[0] as Error).message).toBe('a stream handler failed');
    } finally {
      process.off('unhandledRejection', onRejection);
    }
  });

  it('submit: a job already aborted is told so a microtask later, never inside the submit', async () => {
    const { pool, held } = heldPool(1);
    const batcher = new Batcher<VadJob, VadResult>(pool, vadPacking, 4, 20);
    const gone = new AbortController();
    gone.abort();
    const told: unknown[] = [];
    batcher.submit(row(1), gone.signal, (e) => told.push(e));
    expect(told).toEqual([]);
    await Promise.resolve();
    expect(told).toHaveLength(1);
    expect((told[0] as Error).name).toBe('AbortError');
    expect(held).toEqual([]);
  });

  it('lapseOf: a job whose lease ends while it waits for its batch is dropped with the abort reason; the others run', async () => {
    const { pool, held } = heldPool(1);
    const batcher = new Batcher<VadJob, VadResult>(pool, vadPacking, 4, 1000);
    const lease = new AbortController();
    const lapse = lapseOf(lease.signal);
    expect(lapse.aborted).toBe(false);
    const told: unknown[] = [];
    batcher.submit(row(1), lapse, (e, r) => told.push(e ?? r!.probs[0]));
    batcher.submit(row(2), undefined, (e, r) => told.push(e ?? r!.probs[0]));
    lease.abort(new Error('lease released'));
    expect(lapse).toMatchObject({ aborted: true, reason: new Error('lease released') });
    batcher.submit(row(3), undefined, (e, r) => told.push(e ?? r!.probs[0]));
    batcher.submit(row(4), undefined, (e, r) => told.push(e ?? r!.probs[0]));
    await until(() => held.length === 1);
    expect(held[0].job.counts).toEqual([2, 2, 2]);
    held[0].answer();
    await until(() => told.length === 4);
    expect(told).toEqual([new Error('lease released'), 2, 3, 4]);
  });

  it("submit: a batch that cannot be packed tells every row's callback its error, and the submit does not throw", async () => {
    const { pool, held } = heldPool(1);
    const broken = {
      ...vadPacking,
      pack: () => {
        throw new RangeError('out of memory for the batch');
      },
    };
    const batcher = new Batcher<VadJob, VadResult>(pool, broken, 2, 20);
    const told: string[] = [];
    batcher.submit(row(1), undefined, (e) => told.push((e as Error).message));
    expect(() => batcher.submit(row(2), undefined, (e) => told.push((e as Error).message))).not.toThrow();
    await until(() => told.length === 2);
    expect(told).toEqual(['out of memory for the batch', 'out of memory for the batch']);
    expect(held).toEqual([]);
  });
});
