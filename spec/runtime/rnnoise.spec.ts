import { describe, expect, it } from 'vitest';
import { loadRnnoiseModule, RNNOISE, RnnoiseEngine } from '../../runtime/slots/rnnoise.js';

/** Deterministic noise with a tone in it, int16 scale, `frames` x 480 samples. */
function signal(frames: number): Float32Array {
  const x = new Float32Array(frames * RNNOISE.FRAME);
  let s = 7;
  for (let i = 0; i < x.length; i++) {
    s = (Math.imul(s, 1_664_525) + 1_013_904_223) >>> 0;
    x[i] = ((s / 2 ** 32) * 2 - 1) * 2000 + Math.sin(i / 20) * 6000 * (Math.floor(i / 9600) % 2);
  }
  return x;
}

/** The library run directly: one DenoiseState over every frame, as its own example does. */
async function direct(x: Float32Array): Promise<{ out: Float32Array; probs: number[] }> {
  const m = await loadRnnoiseModule();
  const st = m._rnnoise_create(0);
  const inp = m._malloc(RNNOISE.FRAME * 4);
  const outp = m._malloc(RNNOISE.FRAME * 4);
  const out = new Float32Array(x.length);
  const probs: number[] = [];
  for (let f = 0; f < x.length / RNNOISE.FRAME; f++) {
    m.HEAPF32.set(x.subarray(f * RNNOISE.FRAME, (f + 1) * RNNOISE.FRAME), inp >> 2);
    probs.push(m._rnnoise_process_frame(st, outp, inp));
    out.set(m.HEAPF32.subarray(outp >> 2, (outp >> 2) + RNNOISE.FRAME), f * RNNOISE.FRAME);
  }
  return { out, probs };
}

describe('RnnoiseEngine (the state that travels between slot hosts)', () => {
  it('gives the library own output, sample for sample, when a stream is cut into jobs run by different module instances', async () => {
    const x = signal(300);
    const ref = await direct(x);
    const engines = [await RnnoiseEngine.load(), await RnnoiseEngine.load(), await RnnoiseEngine.load()];
    const state = engines[0].initialState();
    expect(state.length).toBe(RNNOISE.STATE_FLOATS);
    const out = Float32Array.from(x);
    const probs = new Float32Array(300);
    // Jobs of 1, 2, 7 and 10 frames, each on the next engine (another WASM instance, another heap).
    const sizes = [1, 2, 7, 10];
    for (let f = 0, j = 0; f < 300; j++) {
      const n = Math.min(sizes[j % sizes.length], 300 - f);
      engines[j % engines.length].run(
        out.subarray(f * RNNOISE.FRAME, (f + n) * RNNOISE.FRAME),
        state,
        probs.subarray(f, f + n),
      );
      f += n;
    }
    let differ = 0;
    for (let i = 0; i < out.length; i++) if (out[i] !== ref.out[i]) differ++;
    expect(differ).toBe(0);
    expect(Array.from(probs)).toEqual(ref.probs.map((p) => Math.fround(p)));
  });

  it('starts every stream afresh: the initial state is what rnnoise_create gives', async () => {
    const e = await RnnoiseEngine.load();
    const a = e.initialState();
    e.run(signal(5), Float32Array.from(a), new Float32Array(5));
    expect(Buffer.from(e.initialState().buffer).equals(Buffer.from(a.buffer))).toBe(true);
  });
});
