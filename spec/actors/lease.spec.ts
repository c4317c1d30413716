/**
 * The lease module (actors/lease.ts): after a cold load, the requests that waited for it reach
 * the slot in arrival order (DESIGN.md section 3; issue 25 item 15), whichever prepares its input
 * first. Deterministic: the load and each request's input preparation are promises the test
 * settles in the order it chooses.
 */
import { describe, expect, it } from 'vitest';
import { type Granted, leaseGranted } from '../../actors/lease.js';
import { ModelEntry } from '../../actors/model.js';
import { ModelConfig } from '../../runtime/config.js';
import type { LoadedModel, ModelLoader } from '../../runtime/loader.js';
import type { Job, JobResult, LoadSpec, VadJob } from '../../runtime/slot-protocol.js';
import { type SlotHost, SlotPool } from '../../runtime/slots.js';

const flush = (): Promise<void> => new Promise((r) => setImmediate(r));

/** A model of one slot whose load ends when the test says; the slot records each job's tag (its first sample) in the order jobs start. */
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

/** A file request: takes its lease in arrival order, then (once granted) prepares its input and submits its first job. */
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
