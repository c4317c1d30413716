/**
 * RNNoise (the `denoise` task's `rnnoise` model) as `@echogarden/rnnoise-wasm` ships it: the
 * xiph.org C library with its weights compiled in, built to WebAssembly (no file is read but the
 * package's own `.wasm`, nothing is downloaded). Only slot hosts load it (runtime/slots/slot-worker.ts):
 * a frame's processing is CPU work, which belongs off the server's event loop like an ONNX run.
 *
 * RNNoise keeps a `DenoiseState` per stream (its analysis and synthesis memories, pitch buffers
 * and GRU states). Slot hosts are stateless between jobs (DESIGN.md section 2): the state is
 * copied out of the WASM memory after a job and travels with the stream, as a VAD stream's
 * recurrent state does, and is copied back in before its next job. That copy needs the struct's
 * layout in this build (RNNoise 0.1's `denoise.c`): `rnnoise_get_size()` bytes whose last 16 are
 * `RNNState` = {model pointer, and pointers to the VAD (24 floats), noise (48) and denoise (96)
 * GRU states on the heap}. The serialised state is the struct up to those pointers, then the
 * three GRU states; the model pointer is the same in every instance of the module (static data).
 * spec/runtime/rnnoise.spec.ts checks that a stream cut into jobs, its state moved through other
 * module instances between them, gives the library's own output sample for sample.
 */
import { dirname, join } from 'node:path';
import { RNNOISE_WASM } from '../catalog.js';

export { RNNOISE_WASM } from '../catalog.js';

/** The package's module factory (an Emscripten ES module), imported by path so it resolves without typings. */
const RNNOISE_JS = join(dirname(RNNOISE_WASM), 'rnnoise.js');

/** RNNoise's fixed format: 48 kHz, frames of 480 samples (10 ms), samples at int16 scale as float. */
export const RNNOISE = {
  RATE: 48_000,
  FRAME: 480,
  /** The struct's size in this build (checked at load). */
  STRUCT_BYTES: 18_492,
  /** The GRU states' lengths, floats: vad, noise, denoise (rnn_data.c of RNNoise 0.1). */
  GRU: [24, 48, 96],
  /** A serialised state, bytes: the struct before `RNNState`'s 16 bytes, then the three GRU states. */
  STATE_BYTES: 18_492 - 16 + (24 + 48 + 96) * 4,
  /** The same in float32s (the state travels as a Float32Array, its bytes copied, never read as numbers). */
  STATE_FLOATS: (18_492 - 16 + (24 + 48 + 96) * 4) / 4,
  /** Float samples in [-1, 1] are scaled by this on the way in (and back on the way out). */
  SCALE: 32_768,
} as const;

/** The Emscripten module's exports used here. */
interface RnnoiseModule {
  HEAPU8: Uint8Array;
  HEAPF32: Float32Array;
  _rnnoise_get_size(): number;
  _rnnoise_create(model: number): number;
  _rnnoise_destroy(state: number): void;
  _rnnoise_process_frame(state: number, out: number, input: number): number;
  _malloc(bytes: number): number;
  _free(ptr: number): void;
}

/** Instantiates the package's WASM module (each call: a module instance of its own). */
export async function loadRnnoiseModule(): Promise<RnnoiseModule> {
  const factory = (await import(RNNOISE_JS)).default as () => Promise<RnnoiseModule>;
  return factory();
}

/**
 * One module instance and one working `DenoiseState` in it: each row of a job has its state
 * copied in, its frames run, and its state copied out again.
 */
export class RnnoiseEngine {
  private readonly st: number;
  private readonly inPtr: number;
  private readonly outPtr: number;

  private constructor(private readonly m: RnnoiseModule) {
    const size = m._rnnoise_get_size();
    if (size !== RNNOISE.STRUCT_BYTES)
      throw new Error(`rnnoise: DenoiseState is ${size} bytes, expected ${RNNOISE.STRUCT_BYTES} (another build?)`);
    this.st = m._rnnoise_create(0);
    this.inPtr = m._malloc(RNNOISE.FRAME * 4);
    this.outPtr = m._malloc(RNNOISE.FRAME * 4);
  }

  /** Loads a module instance and makes its working state. @throws Error for a build of another layout. */
  static async load(): Promise<RnnoiseEngine> {
    return new RnnoiseEngine(await loadRnnoiseModule());
  }

  /** The three GRU state pointers of the working state (read afresh: the heap may have grown). */
  private gruPointers(st: number): number[] {
    const view = new DataView(this.m.HEAPU8.buffer);
    const tail = st + RNNOISE.STRUCT_BYTES - 16;
    return [view.getUint32(tail + 4, true), view.getUint32(tail + 8, true), view.getUint32(tail + 12, true)];
  }

  /** A fresh stream's serialised state (what `rnnoise_create` gives). */
  initialState(): Float32Array {
    const fresh = this.m._rnnoise_create(0);
    const out = new Float32Array(RNNOISE.STATE_FLOATS);
    this.save(out, fresh);
    this.m._rnnoise_destroy(fresh);
    return out;
  }

  /** Copies a serialised state into the working state. */
  private restore(state: Float32Array): void {
    const bytes = new Uint8Array(state.buffer, state.byteOffset, RNNOISE.STATE_BYTES);
    const heap = this.m.HEAPU8;
    const head = RNNOISE.STRUCT_BYTES - 16;
    heap.set(bytes.subarray(0, head), this.st);
    let at = head;
    const ptrs = this.gruPointers(this.st);
    RNNOISE.GRU.forEach((n, i) => {
      heap.set(bytes.subarray(at, at + n * 4), ptrs[i]);
      at += n * 4;
    });
  }

  /** Copies the state at `st` (default: the working one) out into `state`. */
  private save(state: Float32Array, st = this.st): void {
    const bytes = new Uint8Array(state.buffer, state.byteOffset, RNNOISE.STATE_BYTES);
    const heap = this.m.HEAPU8;
    const head = RNNOISE.STRUCT_BYTES - 16;
    bytes.set(heap.subarray(st, st + head), 0);
    let at = head;
    const ptrs = this.gruPointers(st);
    RNNOISE.GRU.forEach((n, i) => {
      bytes.set(heap.subarray(ptrs[i], ptrs[i] + n * 4), at);
      at += n * 4;
    });
  }

  /**
   * Runs one stream's frames: `audio` (whole frames of 480 samples at int16 scale, 48 kHz) is
   * denoised in place, each frame's speech probability written to `probs`, and `state` (a
   * serialised state, see the module's comment) updated in place.
   */
  run(audio: Float32Array, state: Float32Array, probs: Float32Array): void {
    this.restore(state);
    const frames = audio.length / RNNOISE.FRAME;
    for (let f = 0; f < frames; f++) {
      const frame = audio.subarray(f * RNNOISE.FRAME, (f + 1) * RNNOISE.FRAME);
      this.m.HEAPF32.set(frame, this.inPtr >> 2);
      probs[f] = this.m._rnnoise_process_frame(this.st, this.outPtr, this.inPtr);
      frame.set(this.m.HEAPF32.subarray(this.outPtr >> 2, (this.outPtr >> 2) + RNNOISE.FRAME));
    }
    this.save(state);
  }
}
