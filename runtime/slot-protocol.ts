/**
 * The slot-host message protocol (DESIGN.md section 2): one set of messages whatever carries
 * them (a worker MessagePort today). Slot workers are stateless between `run` messages: the
 * per-stream state (VAD recurrent state and context, wake-word feature buffers) travels in the
 * job and comes back in the result. Float32Array payloads are transferred, not copied.
 */

/**
 * The model files a slot loads: the model by path (onnxruntime reads it), the wake-word
 * feature models as bytes shared read-only by every slot of every wake-word model.
 */
export type LoadSpec =
  | { kind: 'vad'; model: string }
  | { kind: 'wakeword'; model: string; melspectrogram: Uint8Array; embedding: Uint8Array };

/** What a slot reports after loading. */
export interface SlotInfo {
  /** vad: 'v5' (input+state+context) or 'v4' (input+h+c). */
  vadVersion?: 'v4' | 'v5';
  /** wakeword: number of embeddings the head reads (input shape [1, N, 96]). */
  headWindow?: number;
  /** wakeword: one label per output column; '' for the "no wake word" column of multi-class heads. */
  labels?: string[];
  /** wakeword: the embedding of the initial (all-ones) melspectrogram buffer, 96 floats. */
  initialEmbedding?: Float32Array;
}

/**
 * Silero VAD over consecutive 512-sample windows of one or more streams (rows) at once. Row r
 * has `counts[r]` windows; the slot runs step by step, each run holding the next window of every
 * row that still has one (a ragged batch).
 */
export interface VadJob {
  kind: 'vad';
  /** Each row's windows in turn (row-major), 512 samples each, 16 kHz, float32 in [-1, 1]. */
  windows: Float32Array;
  /** rows x 256 floats of recurrent state (v5: `state` layers 0 and 1; v4: `h` then `c`). */
  state: Float32Array;
  /** rows x 64: v5 only, the last 64 samples before each row's windows (zeros at stream start). */
  context: Float32Array;
  /** Windows per row; absent: one row holding every window. */
  counts?: number[];
}
export interface VadResult {
  kind: 'vad';
  /** One speech probability per window, in the layout of `windows`. */
  probs: Float32Array;
  state: Float32Array;
  context: Float32Array;
}

/** openWakeWord over consecutive 1280-sample (80 ms) steps of one stream. */
export interface WakewordJob {
  kind: 'wakeword';
  /** 480 samples of look-back then k x 1280 new samples, 16 kHz, int16 scale (+-32767) as float32. */
  audio: Float32Array;
  /** The last 76 melspectrogram frames x 32 bins, already transformed (x/10 + 2). */
  mel: Float32Array;
  /** The last N embeddings x 96. */
  embeddings: Float32Array;
}
export interface WakewordResult {
  kind: 'wakeword';
  /** k x labels.length head outputs. */
  scores: Float32Array;
  mel: Float32Array;
  embeddings: Float32Array;
}

export type Job = VadJob | WakewordJob;
/** A result, with when the slot ran it: [start, end] in ms since the epoch (sub-ms precision). */
export type JobResult = (VadResult | WakewordResult) & { ran?: [number, number] };

export type ToSlot =
  | { type: 'load'; spec: LoadSpec }
  | { type: 'run'; seq: number; job: Job }
  /** Free the sessions and exit the thread (after any job still running). */
  | { type: 'release' };

export type FromSlot =
  | { type: 'loaded'; info: SlotInfo }
  | { type: 'result'; seq: number; result: JobResult }
  | { type: 'error'; seq?: number; message: string };

/** Float32Arrays in a job or result, for the transfer list. */
export function transferList(value: Job | JobResult): ArrayBuffer[] {
  const out: ArrayBuffer[] = [];
  for (const v of Object.values(value)) {
    if (v instanceof Float32Array && v.buffer instanceof ArrayBuffer && !out.includes(v.buffer)) out.push(v.buffer);
  }
  return out;
}

/** openWakeWord constants (openwakeword/utils.py AudioFeatures). */
export const OWW = {
  STEP: 1280,
  LOOKBACK: 480,
  MEL_FRAMES: 76,
  MEL_BINS: 32,
  EMBEDDING: 96,
} as const;

/** Silero VAD at 16 kHz: window and (v5) context sizes, samples. */
export const SILERO = { WINDOW: 512, CONTEXT: 64, STATE: 256 } as const;
