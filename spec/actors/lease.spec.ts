/**
 * The lease module (actors/lease.ts): after a cold load, the requests that waited for it reach
 * the slot in arrival order (DESIGN.md section 3; issue 25 item 15), whichever prepares its input
 * first. Deterministic: the load and each request's input preparation are promises the test
 * settles in the order it chooses. And `JobPump`'s contract (one job of a stream in flight at a
 * time, in order; `idle`, `fail` and `drained`), against a slot the test answers by hand.
 */
import { describe, expect, it } from 'vitest';
import { type Granted, JobPump, leaseGranted } from '../../actors/lease.js';
import { ModelEntry } from '../../actors/model.js';
import { ModelConfig } from '../../runtime/config.js';
import type { LoadedModel, ModelLoader } from '../../runtime/loader.js';
import type { Job, JobResult, LoadSpec, VadJob } from '../../runtime/slots/slot-protocol.js';
import { type SlotHost, SlotPool } from '../../runtime/slots/slots.js';
import type { TaskEvent, TaskSession } from '../../runtime/tasks/index.js';

const flush = (): Promise<void> => new Promise((r) => setImmediate(r));

/**
 * A model of one slot whose load ends when the test says; the slot records each job's tag (its first sample) in the
 * order jobs start.
 */
function coldModel() {
  const started: number[] = [];
  let finishLoad!: () => void;
  const loaded = new Promise<void>((r) => (finishLoad = r));
  const loader: ModelLoader = async (c) => {
    await loaded;
    const factory = async (_s: LoadSpec): Promise<SlotHost> => ({
      info: {},
      run: async (job: Job) => {
        started.push((job as VadJob).windows[0]);
        await flush();
        return {
          kind: 'vad',
          probs: new Float32Array(1),
          state: (job as VadJob).state,
          context: new Float32Array(64),
        } as JobResult;
      },
      close: async () => {},
      onExit: () => {},
      residentBytes: () => 0,
    });
    const pool = await SlotPool.start({ kind: 'vad', model: '/fake.onnx' }, c.slots, factory);
    return { pool, residentBytes: 0, close: () => pool.close() } satisfies LoadedModel;
  };
  const entry = new ModelEntry(ModelConfig.parse({ id: 'slow', task: 'vad', path: '/slow.onnx', slots: 1 }), {
    loader,
  });
  return { entry, started, finishLoad };
}

const job = (tag: number): VadJob => ({
  kind: 'vad',
  windows: new Float32Array(512).fill(tag),
  state: new Float32Array(256),
  context: new Float32Array(64),
});

/**
 * A file request: takes its lease in arrival order, then (once granted) prepares its input and submits its first job.
 */
function fileRequest(entry: ModelEntry, tag: number) {
  let prepared!: () => void;
  const input = new Promise<void>((r) => (prepared = r));
  const { handle, granted } = leaseGranted(entry, { ordered: true }, () => {});
  const result = granted.then(async (g: Granted) => {
    await input; // decoding
    return g.run(job(tag), 3000);
  });
  return { handle, prepared, result };
}

describe('lease: arrival order after a cold load (issue 25 item 15)', () => {
  it('issue 25 item 15: requests that waited for a cold load reach the slot in arrival order, even when a later one prepares its input first', async () => {
    const m = coldModel();
    const first = fileRequest(m.entry, 1); // starts the cold load
    await flush();
    const second = fileRequest(m.entry, 2); // arrives while it loads
    await flush();
    m.finishLoad();
    await flush();
    await flush();
    second.prepared(); // the later request's audio is decoded first
    await flush();
    expect(m.started).toEqual([]); // it waits for the earlier one's first job
    first.prepared();
    await Promise.all([first.result, second.result]);
    expect(m.started).toEqual([1, 2]);
    first.handle.release();
    second.handle.release();
  });

  it('issue 25 item 15: a request that leaves before its first job (its client went away, bad audio) passes its turn on', async () => {
    const m = coldModel();
    const first = fileRequest(m.entry, 1);
    await flush();
    const second = fileRequest(m.entry, 2);
    await flush();
    m.finishLoad();
    await flush();
    second.prepared();
    first.handle.release(); // gone without a job
    await expect(second.result).resolves.toMatchObject({ kind: 'vad' });
    expect(m.started).toEqual([2]);
    second.handle.release();
  });

  it('a lease released before its answer (a cancelled job, a client gone) rejects its grant, and gives the slot back', async () => {
    const m = coldModel();
    m.finishLoad();
    await m.entry.ensureReady();
    // Released in the same turn: admission grants the free slot, and the grant comes after the release.
    const gone = leaseGranted(m.entry, {}, () => {});
    gone.handle.release();
    const outcome = await Promise.race([
      gone.granted.then(
        () => 'granted',
        (e: Error) => e.name,
      ),
      new Promise((r) => setTimeout(() => r('no answer'), 500)),
    ]);
    expect(outcome).toBe('AbortError');
    // The one slot is free: the next request is granted and runs.
    const next = fileRequest(m.entry, 7);
    next.prepared();
    await expect(next.result).resolves.toMatchObject({ kind: 'vad' });
    expect(m.started).toEqual([7]);
    next.handle.release();
  });

  it('a warm model with nobody in line: requests go as they come (unchanged)', async () => {
    const m = coldModel();
    m.finishLoad();
    await m.entry.ensureReady();
    const first = fileRequest(m.entry, 1);
    const second = fileRequest(m.entry, 2);
    await flush();
    second.prepared();
    await second.result;
    first.prepared();
    await first.result;
    expect(m.started).toEqual([2, 1]);
    first.handle.release();
    second.handle.release();
  });
});

/**
 * A session of numbered windows (512 samples each): a job takes every whole window buffered, one
 * job in flight at a time; a result yields one `speech_start` per window, at its number.
 */
function countingSession(): TaskSession & { windows: number } {
  let received = 0;
  let sent = 0;
  let processed = 0;
  let busy = false;
  return {
    step: 512,
    windows: 0,
    push(samples) {
      received += samples.length;
    },
    end: () => [],
    nextJob() {
      const n = Math.floor((received - sent) / 512);
      if (busy || n === 0) return null;
      busy = true;
      sent += n * 512;
      return job(n);
    },
    accept(result) {
      busy = false;
      const events: TaskEvent[] = [];
      for (let i = 0; i < (result as { probs: Float32Array }).probs.length; i++) {
        events.push({ type: 'speech_start', at_ms: processed / 512 });
        processed += 512;
      }
      return events;
    },
    get finished() {
      return false;
    },
    get receivedSamples() {
      return received;
    },
    get pendingSamples() {
      return received - sent;
    },
    get processedSamples() {
      return processed;
    },
  } as TaskSession & { windows: number };
}

describe("JobPump: a stream's jobs through its lease", () => {
  /** A pump whose slot answers when the test says; records what it was given and told. */
  function pumped() {
    const session = countingSession();
    const runs: { windows: number; answer: (r: JobResult) => void; refuse: (e: unknown) => void }[] = [];
    const told: string[] = [];
    const lags: number[] = [];
    const pump = new JobPump(
      session,
      {
        send: (j: Job, done: (error: unknown, result?: JobResult) => void) =>
          runs.push({ windows: (j as VadJob).windows[0], answer: (r) => done(null, r), refuse: (e) => done(e) }),
        recordLag: (ms: number) => lags.push(ms),
      },
      {
        emit: (e) => told.push(`${e.type}@${(e as { at_ms: number }).at_ms}`),
        accepted: () => told.push('accepted'),
        idle: () => told.push('idle'),
        fail: (e) => told.push(`fail:${(e as Error).message}`),
      },
    );
    const feed = (windows: number): void => {
      session.push(new Float32Array(512 * windows));
      pump.arrived(performance.now());
      pump.pump();
    };
    const result = (windows: number): JobResult =>
      ({
        kind: 'vad',
        probs: new Float32Array(windows),
        state: new Float32Array(256),
        context: new Float32Array(64),
      }) as JobResult;
    return { pump, runs, told, lags, feed, result };
  }

  it('one job in flight at a time, in order: audio that arrives meanwhile goes in the next job, then idle once', async () => {
    const p = pumped();
    p.feed(2);
    p.feed(3); // while the first job is out
    expect(p.runs.map((r) => r.windows)).toEqual([2]);
    expect(p.pump.running).toBe(true);
    p.runs[0].answer(p.result(2));
    await flush();
    expect(p.runs.map((r) => r.windows)).toEqual([2, 3]);
    const drained = p.pump.drained();
    let settled = false;
    void drained.then(() => (settled = true));
    await flush();
    expect(settled).toBe(false);
    p.runs[1].answer(p.result(3));
    await drained;
    expect(p.told).toEqual([
      'speech_start@0',
      'speech_start@1',
      'accepted',
      'speech_start@2',
      'speech_start@3',
      'speech_start@4',
      'accepted',
      'idle',
    ]);
    expect(p.pump.running).toBe(false);
    expect(p.lags).toHaveLength(5); // one per window
  });

  it('a failed job: `fail` once with its error, no `idle`, and `drained` resolves', async () => {
    const p = pumped();
    p.feed(1);
    const drained = p.pump.drained();
    p.runs[0].refuse(new Error('slot crashed'));
    await drained;
    expect(p.told).toEqual(['fail:slot crashed']);
    expect(p.pump.running).toBe(false);
  });

  it('an event handler that throws fails the pump like a failed job (not the caller)', async () => {
    const session = countingSession();
    const told: string[] = [];
    let answer!: (r: JobResult) => void;
    const pump = new JobPump(
      session,
      {
        send: (_j: Job, done: (error: unknown, result?: JobResult) => void) => {
          answer = (r) => done(null, r);
        },
        recordLag: () => {},
      },
      {
        emit: () => {
          throw new Error('client gone');
        },
        idle: () => told.push('idle'),
        fail: (e) => told.push(`fail:${(e as Error).message}`),
      },
    );
    session.push(new Float32Array(512));
    pump.pump();
    answer({
      kind: 'vad',
      probs: new Float32Array(1),
      state: new Float32Array(256),
      context: new Float32Array(64),
    } as JobResult);
    await flush();
    expect(told).toEqual(['fail:client gone']);
  });

  it('nothing to run: `drained` resolves at once and `idle` is told', async () => {
    const p = pumped();
    await p.pump.drained();
    expect(p.runs).toHaveLength(0);
    expect(p.told).toEqual(['idle']);
  });
});
