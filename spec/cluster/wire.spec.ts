/**
 * The cluster's wire form of jobs: a frame round-trips a job exactly, and a batch split in two
 * for NATS's max_payload gives, joined, the result the whole batch gives on a real slot host.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import {
  decodeMessage,
  encodeMessage,
  errorReply,
  FrameBuffers,
  joinResults,
  notHeld,
  replyError,
  runHalves,
  splitJob,
  type ErrorReply,
  type RemoteJob,
} from '../../cluster/wire.js';
import { voxError } from '../../runtime/errors.js';
import { vadPacking, wakewordPacking } from '../../runtime/batcher.js';
import { OWW_EMBEDDING, OWW_MELSPECTROGRAM } from '../../runtime/catalog.js';
import { defaultCatalog } from '../../runtime/config.js';
import {
  OWW,
  SILERO,
  type Job,
  type VadJob,
  type VadResult,
  type WakewordJob,
} from '../../runtime/slots/slot-protocol.js';
import { processSlots, SlotPool, startWorkerSlot, type SlotHost } from '../../runtime/slots/slots.js';
import { readFileSync } from 'node:fs';

/** Deterministic noise in [-amp, amp] (a linear congruential generator). */
function noise(n: number, amp: number, seed: number): Float32Array {
  const out = new Float32Array(n);
  let x = seed;
  for (let i = 0; i < n; i++) {
    x = (x * 1103515245 + 12345) % 2 ** 31;
    out[i] = ((x / 2 ** 31) * 2 - 1) * amp;
  }
  return out;
}

const path = (id: string): string => defaultCatalog().find((c) => c.id === id)!.path;

describe('error replies to a peer: one encoding (errorReply, notHeld), one decoding (replyError)', () => {
  it('an error crosses the frame with its code, type and Retry-After; the node is named; not_held is 503 no_holder', () => {
    const sent = voxError('model_stuck', { id: 'm', ms: 500 });
    const r = decodeMessage<ErrorReply>(encodeMessage(errorReply(sent)));
    expect(r).toMatchObject({
      type: 'error',
      error: 'server_busy',
      code: 'model_stuck',
      retry_after_s: sent.retryAfterS,
    });
    const back = replyError('b', r);
    expect([back.code, back.type, back.status, back.message]).toEqual([
      'model_stuck',
      sent.type,
      sent.status,
      `node b: ${sent.message}`,
    ]);
    const gone = replyError('c', decodeMessage<ErrorReply>(encodeMessage(notHeld('c does not hold m'))));
    expect([gone.code, gone.status, gone.message]).toEqual(['no_holder', 503, 'node c: c does not hold m']);
    // An unknown code (a newer peer) is a 500 internal_error with the peer's message.
    expect(replyError('d', { type: 'error', error: 'x', code: 'not_a_code', message: 'm' }).code).toBe(
      'internal_error',
    );
  });
});

describe('remote job frames', () => {
  let vad: SlotHost;
  let ww: SlotHost;
  beforeAll(async () => {
    vad = await startWorkerSlot({ kind: 'vad', model: path('silero-vad') });
    ww = await startWorkerSlot({
      kind: 'wakeword',
      heads: [path('hey-jarvis')],
      melspectrogram: readFileSync(OWW_MELSPECTROGRAM),
      embedding: readFileSync(OWW_EMBEDDING),
    });
  });
  afterAll(async () => {
    await vad?.close();
    await ww?.close();
  });

  it('a job survives the frame byte for byte', () => {
    const job: VadJob = {
      kind: 'vad',
      windows: noise(3 * SILERO.WINDOW, 0.3, 1),
      state: noise(SILERO.STATE, 0.1, 2),
      context: noise(SILERO.CONTEXT, 0.1, 3),
    };
    const back = decodeMessage<RemoteJob>(encodeMessage({ type: 'job', id: 'A:1', model: 'm', wait_ms: 5, job }));
    expect(back).toMatchObject({ type: 'job', id: 'A:1', model: 'm', wait_ms: 5 });
    expect(back.job).toEqual(job);
  });

  it('a holder decodes jobs into buffers kept from job to job: each the same job, none lent twice at once', () => {
    const job = (seed: number, windows: number): VadJob => ({
      kind: 'vad',
      windows: noise(windows * SILERO.WINDOW, 0.3, seed),
      state: noise(SILERO.STATE, 0.1, seed + 1),
      context: noise(SILERO.CONTEXT, 0.1, seed + 2),
    });
    const frame = (j: VadJob): Uint8Array => encodeMessage({ type: 'job', id: 'A:1', model: 'm', wait_ms: 5, job: j });
    const buffers = new FrameBuffers();
    const a = frame(job(1, 3));
    const b = frame(job(4, 3));
    const bufA = buffers.take(a.length);
    const bufB = buffers.take(b.length);
    expect(bufB.buffer).not.toBe(bufA.buffer);
    const first = decodeMessage<RemoteJob>(a, bufA);
    const second = decodeMessage<RemoteJob>(b, bufB);
    expect(first.job).toEqual(job(1, 3));
    expect(second.job).toEqual(job(4, 3));
    // Given back, a buffer serves the next job that fits, in place of a new one; a larger job gets a larger buffer.
    buffers.give(bufA);
    const c = frame(job(7, 2));
    const bufC = buffers.take(c.length);
    expect(bufC).toBe(bufA);
    expect(decodeMessage<RemoteJob>(c, bufC).job).toEqual(job(7, 2));
    expect(second.job).toEqual(job(4, 3));
    const big = frame(job(9, 64));
    const bufBig = buffers.take(big.length);
    expect(bufBig.byteLength).toBeGreaterThanOrEqual(big.length);
    expect(decodeMessage<RemoteJob>(big, bufBig).job).toEqual(job(9, 64));
    // A frame cut short fails as in a buffer of its own size: no array of it is read from an earlier job's bytes.
    buffers.give(bufBig);
    const cut = frame(job(11, 3)).subarray(0, b.length - 4096);
    expect(() => decodeMessage(cut)).toThrow(RangeError);
    expect(() => decodeMessage(cut, buffers.take(cut.length))).toThrow(/frame cut short/);
  });

  it("a VAD batch of 5 streams, split in two and joined, gives the whole batch's result", async () => {
    const rows: VadJob[] = [1, 3, 2, 4, 1].map((n, r) => ({
      kind: 'vad',
      windows: noise(n * SILERO.WINDOW, 0.5, 10 + r),
      state: new Float32Array(SILERO.STATE),
      context: new Float32Array(SILERO.CONTEXT),
    }));
    const batch = vadPacking.pack(rows);
    const whole = await vad.run(batch);
    const halves = splitJob(batch)!;
    expect((halves[0] as VadJob).counts).toEqual([1, 3]);
    const joined = joinResults(await vad.run(halves[0]), await vad.run(halves[1]));
    if (joined.kind !== 'vad' || whole.kind !== 'vad') throw new Error('not vad');
    expect(Array.from(joined.probs)).toEqual(Array.from(whole.probs));
    expect(Array.from(joined.state)).toEqual(Array.from(whole.state));
    expect(Array.from(joined.context)).toEqual(Array.from(whole.context));
  });

  it("halves run on a local process slot, another job's answer between theirs, join to the whole batch's result", async () => {
    // A model held here behind its remote pool runs a split job's halves on its own slots, while the batcher's other
    // jobs run there too. A process slot's answer is read into a buffer its host reuses two answers later.
    const pool = await SlotPool.start({ kind: 'vad', model: path('silero-vad') }, 1, processSlots(0));
    try {
      const rows: VadJob[] = [2, 3, 1, 4, 2, 3].map((n, r) => ({
        kind: 'vad',
        windows: noise(n * SILERO.WINDOW, 0.5, 40 + r),
        state: noise(SILERO.STATE, 0.2, 50 + r),
        context: new Float32Array(SILERO.CONTEXT),
      }));
      const batch = vadPacking.pack(rows);
      const other = vadPacking.pack(rows.map((r, i) => ({ ...r, windows: noise(r.windows.length, 0.5, 60 + i) })));
      const copy = (r: VadResult): number[][] => [[...r.probs], [...r.state], [...r.context]];
      const whole = copy((await pool.run(batch)) as VadResult);
      // Both of the host's answer buffers grown past these answers first (a larger answer gets a new buffer).
      const large = vadPacking.pack(rows.map((r, i) => ({ ...r, windows: noise(8 * SILERO.WINDOW, 0.5, 70 + i) })));
      await Promise.all([pool.run(large, undefined, 0, true), pool.run(large, undefined, 0, true)]);
      const halves = splitJob(batch)! as [VadJob, VadJob];
      let others: Promise<unknown> = Promise.resolve();
      const joined = await runHalves(halves, (h) => {
        if (h === halves[1]) others = pool.run(other, undefined, 0, true);
        return pool.run(h, undefined, 0, true);
      });
      await others;
      expect(copy(joined as VadResult)).toEqual(whole);
    } finally {
      await pool.close();
    }
  });

  it("a wake-word batch of 3 streams, split in two and joined, gives the whole batch's result", async () => {
    const history = ww.info.initialEmbeddings!;
    const rows: WakewordJob[] = [2, 1, 3].map((n, r) => ({
      kind: 'wakeword',
      audio: noise(OWW.LOOKBACK + n * OWW.STEP, 3000, 20 + r),
      mel: new Float32Array(OWW.MEL_FRAMES * OWW.MEL_BINS).fill(1),
      embeddings: history.slice(),
    }));
    const batch = wakewordPacking.pack(rows);
    const whole = await ww.run(batch);
    const joined = joinResults(await ww.run(splitJob(batch)![0]), await ww.run(splitJob(batch)![1]));
    if (joined.kind !== 'wakeword' || whole.kind !== 'wakeword') throw new Error('not wakeword');
    expect(Array.from(joined.scores)).toEqual(Array.from(whole.scores));
    expect(Array.from(joined.mel)).toEqual(Array.from(whole.mel));
    expect(Array.from(joined.embeddings)).toEqual(Array.from(whole.embeddings));
  });

  it('a single row cannot be split', () => {
    const job: Job = {
      kind: 'vad',
      windows: new Float32Array(SILERO.WINDOW),
      state: new Float32Array(SILERO.STATE),
      context: new Float32Array(SILERO.CONTEXT),
    };
    expect(splitJob(job)).toBeNull();
  });
});
