/**
 * The slot-host message protocol (DESIGN.md section 2): one set of messages whatever carries
 * them. Slot hosts are stateless between `run` messages: the per-stream state (VAD recurrent
 * state and context, wake-word feature buffers) travels in the job and comes back in the result.
 * To a worker thread every message goes over its port, Float32Arrays transferred, not copied. To
 * a child process `load` and `release` go over the IPC channel, and `run` with its answer as
 * binary frames ({@link encodeFrame}) through shared files ({@link FrameChannel}).
 */
import { readSync, writevSync } from 'node:fs';
import type { Socket } from 'node:net';

/**
 * The model files a slot loads: the model by path (onnxruntime reads it), the wake-word
 * feature models as bytes shared read-only by every slot of every wake-word model.
 */
export type LoadSpec =
  | { kind: 'vad'; model: string }
  /**
   * `heads`: the classifier heads' files, run in this order on the same features each step (a
   * job's own `heads` win: a slot host of a wake-word family loads heads as jobs name them).
   */
  | { kind: 'wakeword'; heads: string[]; melspectrogram: Uint8Array; embedding: Uint8Array }
  /** Any ONNX model, run as it is: named tensors in, named tensors out. */
  | { kind: 'tensor'; model: string }
  /** RNNoise (`denoise`): `model` is the package's WASM build (runtime/slots/rnnoise.ts), which the slot imports. */
  | { kind: 'denoise'; model: string };

/**
 * One input or output of a `tensor` model as its session reports it: `dtype` as onnxruntime names
 * it (`float32`, `int64`, ...; null for a value that is not a tensor: a sequence or a map), and
 * `shape` with a number for each fixed dimension and a string (its symbolic name, maybe '') for
 * each dynamic one (null when not a tensor).
 */
export interface TensorMeta {
  name: string;
  dtype: string | null;
  shape: (number | string)[] | null;
}

/** What a slot reports after loading. */
export interface SlotInfo {
  /** vad: 'v5' (input+state+context) or 'v4' (input+h+c). */
  vadVersion?: 'v4' | 'v5';
  /**
   * wakeword, one per head in load order: how many embeddings it reads (input [1, N, 96]) and one
   * label per output column ('@model' for a single-output head, '' for the "no wake word" column
   * of a multi-class head).
   */
  heads?: { window: number; labels: string[] }[];
  /**
   * wakeword: a stream's initial embedding history: the embeddings of 4 s of noise, as
   * openWakeWord's AudioFeatures starts (see `noiseEmbeddings`), every one of them (41 x 96
   * floats); a stream takes the last N (its longest head window).
   */
  initialEmbeddings?: Float32Array;
  /** tensor: the model's inputs and outputs, in the session's order. */
  tensor?: { inputs: TensorMeta[]; outputs: TensorMeta[] };
  /** denoise: a fresh stream's serialised RNNoise state (runtime/slots/rnnoise.ts). */
  denoiseState?: Float32Array;
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

/**
 * openWakeWord over consecutive 1280-sample (80 ms) steps of one or more streams (rows). Row r has
 * `counts[r]` steps; each field holds the rows' parts in turn. The slot runs the rows one after
 * the other (the heads take batch 1).
 */
export interface WakewordJob {
  kind: 'wakeword';
  /** Per row: 480 samples of look-back then k x 1280 new samples, 16 kHz, int16 scale (+-32767) as float32. */
  audio: Float32Array;
  /** Per row: the last 76 melspectrogram frames x 32 bins, already transformed (x/10 + 2). */
  mel: Float32Array;
  /** Per row: the last N embeddings x 96 (N: the longest head window). */
  embeddings: Float32Array;
  /** Steps per row; absent: one row. */
  counts?: number[];
  /** The heads' files to run, in this order (absent: the heads the slot loaded); loaded on first use. */
  heads?: string[];
  /**
   * Every head file the family's models name now (a family's job): the host releases each head it loaded that is
   * not in it (their models have unloaded, their files may be gone), before it runs the job.
   */
  keep?: string[];
}
export interface WakewordResult {
  kind: 'wakeword';
  /** Every row's steps in turn x (every head's columns, heads in load order) outputs. */
  scores: Float32Array;
  mel: Float32Array;
  embeddings: Float32Array;
  /** Heads the host holds once the job has run (a family's host loads them as jobs name them). */
  headsLoaded?: number;
}

/** The typed arrays a tensor's data may be (onnxruntime-node's: `bool` is a Uint8Array of 0 and 1). */
export type TensorData =
  | Float32Array
  | Float64Array
  | Int8Array
  | Uint8Array
  | Int16Array
  | Uint16Array
  | Int32Array
  | Uint32Array
  | BigInt64Array
  | BigUint64Array;

/** One tensor: onnxruntime's dtype name, dimensions, and data in row-major order (string tensors: a list). */
export interface WireTensor {
  dtype: string;
  shape: number[];
  data: TensorData | string[];
}

/** A `tensor` model's run: its inputs by name, and the outputs wanted (absent: all). */
export interface TensorJob {
  kind: 'tensor';
  inputs: Record<string, WireTensor>;
  outputs?: string[];
  /** A tensor job is one request: never batched or split. */
  counts?: undefined;
}
export interface TensorResult {
  kind: 'tensor';
  outputs: Record<string, WireTensor>;
}

/**
 * RNNoise over consecutive 480-sample (10 ms) frames at 48 kHz of one or more streams (rows). Row
 * r has `rows[r]` frames; the slot runs the rows one after another (RNNoise has no batch).
 */
export interface DenoiseJob {
  kind: 'denoise';
  /** Each row's frames in turn, 480 samples each, 48 kHz, int16 scale (+-32768) as float32. */
  audio: Float32Array;
  /** rows x RNNOISE.STATE_FLOATS: each row's serialised state (bytes, not numbers: copied, never read). */
  state: Float32Array;
  /** Frames per row; absent: one row. */
  rows?: number[];
  /** Not `counts`: a batch of denoise rows is not split over a cluster link (cluster/wire.ts splitJob). */
  counts?: undefined;
}
export interface DenoiseResult {
  kind: 'denoise';
  /** The denoised frames, in the layout of the job's `audio`. */
  audio: Float32Array;
  /** RNNoise's speech probability of each frame, in the same order. */
  probs: Float32Array;
  state: Float32Array;
}

export type Job = VadJob | WakewordJob | TensorJob | DenoiseJob;
/**
 * A result, with when the slot ran it: [start, end] in ms since the epoch (sub-ms precision),
 * and (set by the pool) how long the job waited for a slot, ms.
 */
export type JobResult = (VadResult | WakewordResult | TensorResult | DenoiseResult) & {
  ran?: [number, number];
  waitedMs?: number;
};

export type ToSlot =
  | { type: 'load'; spec: LoadSpec }
  | { type: 'run'; seq: number; job: Job }
  /** Free the sessions and exit the thread (after any job still running). */
  | { type: 'release' };

export type FromSlot =
  | { type: 'loaded'; info: SlotInfo }
  | { type: 'result'; seq: number; result: JobResult }
  | { type: 'error'; seq?: number; message: string };

/** The buffers of the typed arrays in a job or result (a tensor result's outputs included), for the transfer list. */
export function transferList(value: Job | JobResult): ArrayBuffer[] {
  const out: ArrayBuffer[] = [];
  const views =
    value.kind !== 'tensor'
      ? Object.values(value)
      : 'inputs' in value
        ? Object.values(value.inputs).map((t) => t.data)
        : Object.values((value as TensorResult).outputs).map((t) => t.data);
  for (const v of views) {
    if (ArrayBuffer.isView(v) && v.buffer instanceof ArrayBuffer && !out.includes(v.buffer)) out.push(v.buffer);
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

/**
 * openWakeWord's label map (`SlotInfo.heads[].labels`): a single-output head is `@model` (its
 * model id); a multi-class head names its classes in its output's name as JSON
 * (`{"0": "", "1": "1_minute_timer", ...}`; class 0 is "no wake word", '').
 */
export function headLabels(outputName: string, columns: number): string[] {
  if (columns === 1) return ['@model'];
  try {
    const map = JSON.parse(outputName) as Record<string, string>;
    return Array.from({ length: columns }, (_, i) => map[String(i)] ?? '');
  } catch {
    return Array.from({ length: columns }, (_, i) => (i === 0 ? '' : `class_${i}`));
  }
}

/** Silero VAD at 16 kHz: window and (v5) context sizes, samples. */
export const SILERO = { WINDOW: 512, CONTEXT: 64, STATE: 256 } as const;

/** The typed arrays a frame carries besides Float32Array (`$ta` entries), by constructor name. */
const TYPED = {
  Float64Array,
  Int8Array,
  Uint8Array,
  Int16Array,
  Uint16Array,
  Int32Array,
  Uint32Array,
  BigInt64Array,
  BigUint64Array,
} as const;
type TypedName = keyof typeof TYPED;

/**
 * Encodes one message as a binary frame (for a child-process slot host, see {@link FrameChannel}):
 *
 *     u32le n (bytes after this field) | u32le h | h bytes of JSON | 0-7 zero bytes | arrays
 *
 * The JSON is the message with each Float32Array replaced by `{"$f32": [offset, length]}`: its
 * byte offset into the arrays region (which starts 8-aligned) and its length in floats; any other
 * typed array (a tensor job's) by `{"$ta": [offset, length, constructor name]}`, at an 8-aligned
 * offset. The arrays' bytes follow one after another, not copied here (the buffers are handed to
 * the writer as they are).
 * Costs one JSON of the small fields; 0.5 MB of audio goes as 0.5 MB.
 * @returns the buffers of one frame, in order (written with one `pwritev`).
 */
export function encodeFrame(msg: ToSlot | FromSlot): Buffer[] {
  const arrays: Buffer[] = [];
  let at = 0;
  // A walk that swaps the typed arrays for their references (in copies of the objects and lists
  // holding them; the message is not changed), then one JSON.stringify without a replacer: a
  // replacer is called for every value, each of a batch's `counts` included (10.6 against 4.3 us
  // for a 32-row VAD job).
  const swap = (v: object): object => {
    if (ArrayBuffer.isView(v)) {
      const name = v.constructor.name;
      if (name !== 'Float32Array' && !(name in TYPED)) return v;
      if (name !== 'Float32Array' && at % 8) {
        arrays.push(Buffer.alloc(8 - (at % 8)));
        at += 8 - (at % 8);
      }
      arrays.push(Buffer.from(v.buffer, v.byteOffset, v.byteLength));
      at += v.byteLength;
      const length = v.byteLength / (v as Float32Array).BYTES_PER_ELEMENT;
      return name === 'Float32Array'
        ? { $f32: [at - v.byteLength, length] }
        : { $ta: [at - v.byteLength, length, name] };
    }
    if (Array.isArray(v)) {
      let list: unknown[] | null = null;
      for (let i = 0; i < v.length; i++) {
        const x: unknown = v[i];
        if (x === null || typeof x !== 'object') continue;
        const y = swap(x);
        if (y !== x) (list ??= v.slice())[i] = y;
      }
      return list ?? v;
    }
    const fields = v as Record<string, unknown>;
    let copy: Record<string, unknown> | null = null;
    for (const k in fields) {
      const x = fields[k];
      if (x === null || typeof x !== 'object') continue;
      const y = swap(x);
      if (y !== x) (copy ??= { ...fields })[k] = y;
    }
    return copy ?? v;
  };
  const head = Buffer.from(JSON.stringify(swap(msg)));
  const prefix = Buffer.alloc(8 + head.length + ((8 - (head.length % 8)) % 8));
  prefix.writeUInt32LE(prefix.length - 4 + at, 0);
  prefix.writeUInt32LE(head.length, 4);
  head.copy(prefix, 8);
  return [prefix, ...arrays];
}

/**
 * Jobs a slot host holds at once where a job over `job_timeout_ms` is killed (a process host with
 * a job timeout; otherwise one): the one it runs and one queued behind it, so that a loaded
 * host starts its next job as soon as it has answered one, instead of sleeping until the server
 * has taken the answer and sent the next (a host woken from sleep runs slower on these VMs,
 * and the server's event loop may be busy with stream traffic when the answer comes).
 */
export const SLOT_DEPTH = 2;

/**
 * Where a job channel's frame regions start, bytes apart: frame k goes at `(k % depth) * REGION_BYTES` (a sparse file).
 */
const REGION_BYTES = 2 ** 31;

/**
 * A process slot host's job channel, one end of it: each frame ({@link encodeFrame}) is written
 * whole into a file shared with the other end (on tmpfs, `/dev/shm`), with one `pwritev`, and
 * announced by a doorbell on a socket pair: the frame's length, u32le. The reader copies the
 * frame out with one `pread` into an ArrayBuffer of its own; its Float32Arrays are views into
 * it. Each direction has its own file, holding up to `depth` frames, each in its own region
 * (2 GiB apart), used in turn by both ends: the k-th frame written is the k-th read, from region
 * `k % depth`. So a writer must never be more than `depth` frames ahead of the reader: a slot
 * host holds at most `depth` jobs (the one it runs and those queued behind it) and answers each
 * with one frame, in order.
 *
 * Why not the socket itself: a job of a few hundred KB does not fit a socket pair's buffer, so
 * writing it there takes several turns of the server's event loop, and while the loop is busy
 * with stream traffic the job sits half-sent (measured: nearly every job, at 450 live streams).
 */
export class FrameChannel<In extends ToSlot | FromSlot, Out extends ToSlot | FromSlot> {
  private bell: Buffer = Buffer.alloc(0);
  /** The reused receive buffers (with `reuse`), one per region, grown as frames grow. */
  private readonly scratch: ArrayBuffer[];
  /** Frames written and read so far: the next one's region. */
  private sent = 0;
  private received = 0;

  /**
   * @param socket carries the doorbells both ways. @param outFd the file this end writes frames to.
   * @param inFd the file the other end writes frames to. @param onMessage each decoded frame.
   * @param onError a frame could not be read (the channel is unusable).
   * @param reuse read every frame into a reused buffer, one per region: only for an end that is
   *   done with a frame's arrays before the frame `depth` places later can come (a slot host
   *   answers a job before it is sent the one `depth` places after it; the server copies what it
   *   keeps of a result before the next turn). A fresh page-faulting allocation of a few hundred
   *   KB per job otherwise costs the host more than reading it.
   * @param depth frames a writer may be ahead of its reader, each in its own region (both ends must agree).
   */
  constructor(
    private readonly socket: Socket,
    private readonly outFd: number,
    private readonly inFd: number,
    onMessage: (msg: In) => void,
    onError: (e: Error) => void,
    reuse = false,
    private readonly depth = 1,
  ) {
    this.scratch = Array.from({ length: depth }, () => new ArrayBuffer(0));
    socket.on('data', (chunk: Buffer) => {
      this.bell = this.bell.length ? Buffer.concat([this.bell, chunk]) : chunk;
      let at = 0;
      for (; at + 4 <= this.bell.length; at += 4) {
        const length = this.bell.readUInt32LE(at);
        const region = this.received++ % this.depth;
        if (reuse && this.scratch[region].byteLength < length)
          this.scratch[region] = new ArrayBuffer(Math.max(length, 2 * this.scratch[region].byteLength));
        const frame = reuse ? new Uint8Array(this.scratch[region], 0, length) : new Uint8Array(length);
        try {
          if (readSync(this.inFd, frame, 0, frame.length, region * REGION_BYTES) !== frame.length)
            throw new Error('job channel: short read');
        } catch (e) {
          return onError(e as Error);
        }
        onMessage(decodeFrame(frame) as In);
      }
      this.bell = this.bell.subarray(at);
    });
  }

  /**
   * Writes `msg` into the shared file's next region and rings. Nothing is sent once the socket is closed.
   * @throws Error when the file cannot be written (tmpfs full: ENOSPC), or the frame is over 2 GiB.
   */
  send(msg: Out): void {
    if (!this.socket.writable) return;
    const frame = encodeFrame(msg);
    const bytes = frame[0].readUInt32LE(0) + 4;
    if (bytes > REGION_BYTES) throw new Error(`job channel: a frame of ${bytes} bytes is over 2 GiB`);
    const n = writevSync(this.outFd, frame, (this.sent++ % this.depth) * REGION_BYTES);
    const bell = Buffer.alloc(4);
    bell.writeUInt32LE(n, 0);
    this.socket.write(bell);
  }
}

/**
 * Decodes a frame of {@link encodeFrame} (the whole frame, length field included, at offset 0 of its buffer); its
 * arrays are views into that buffer.
 * @throws RangeError when an array reaches past the frame's end (a frame cut short: its buffer may be longer and
 *   hold an earlier frame's bytes, cluster/wire.ts `FrameBuffers`).
 */
export function decodeFrame(frame: Uint8Array): unknown {
  const h = new DataView(frame.buffer).getUint32(4, true);
  const base = 8 + h + ((8 - (h % 8)) % 8);
  /** `at`, once the `bytes` from it are within the frame. */
  const within = (at: number, bytes: number): number => {
    if (at + bytes > frame.byteLength)
      throw new RangeError(`frame cut short: an array ends at byte ${at + bytes} of a frame of ${frame.byteLength}`);
    return at;
  };
  // One JSON.parse without a reviver, then a walk through the objects and lists only: a reviver
  // is called for every value (22.6 against 3.6 us for a 32-row VAD job).
  const revive = (v: Record<string, unknown> | unknown[]): unknown => {
    if (Array.isArray(v)) {
      for (let i = 0; i < v.length; i++) {
        const x: unknown = v[i];
        if (x !== null && typeof x === 'object') v[i] = revive(x as Record<string, unknown>);
      }
      return v;
    }
    const f32 = v.$f32 as [number, number] | undefined;
    if (Array.isArray(f32)) return new Float32Array(frame.buffer, within(base + f32[0], f32[1] * 4), f32[1]);
    const ta = v.$ta as [number, number, TypedName] | undefined;
    if (Array.isArray(ta) && ta[2] in TYPED)
      return new TYPED[ta[2]](
        frame.buffer as ArrayBuffer,
        within(base + ta[0], ta[1] * TYPED[ta[2]].BYTES_PER_ELEMENT),
        ta[1],
      );
    for (const k in v) {
      const x = v[k];
      if (x !== null && typeof x === 'object') v[k] = revive(x as Record<string, unknown>);
    }
    return v;
  };
  const msg = JSON.parse(Buffer.from(frame.buffer, 8, h).toString()) as unknown;
  return msg !== null && typeof msg === 'object' ? revive(msg as Record<string, unknown>) : msg;
}
