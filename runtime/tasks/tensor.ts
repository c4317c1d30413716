import type { ModelConfig } from '../config.js';
import { invalid, voxError } from '../errors.js';
import type { SlotInfo, TensorData, TensorJob, TensorMeta, TensorResult, WireTensor } from '../slots/slot-protocol.js';

/**
 * The `tensor` task (docs/models.md#any-onnx-model-the-tensor-task): any ONNX model, named
 * tensors in and out. The request's tensors are read here on the main thread (JSON lists or
 * msgpack binary), checked against the metadata the model's session reported at load (dtype,
 * rank, each fixed dimension; dynamic dimensions take any size), and run by a slot host as one
 * job; its outputs go back as JSON lists or msgpack binary.
 */

/**
 * The element types a tensor input may have, with the typed array that holds them: every type
 * onnxruntime-node passes to and from a session (`string` is a list of strings, not a typed
 * array). A model with an input or output of another type (int4, uint4: onnxruntime-node loads
 * them but cannot build their tensors) is refused at load ({@link unsupportedDtype}).
 */
export const DTYPES = {
  float32: Float32Array,
  float16: Uint16Array,
  float64: Float64Array,
  int8: Int8Array,
  uint8: Uint8Array,
  int16: Int16Array,
  uint16: Uint16Array,
  int32: Int32Array,
  uint32: Uint32Array,
  int64: BigInt64Array,
  uint64: BigUint64Array,
  bool: Uint8Array,
  string: Array,
} as const;
export type Dtype = keyof typeof DTYPES;

/** The floating-point dtypes: their non-finite values are written as strings in JSON. */
const FLOATS = new Set<string>(['float16', 'float32', 'float64']);

/**
 * JSON has no NaN or infinity: a float tensor's non-finite values are these strings, in answers
 * and in requests, as the proto3 JSON mapping (which the Open Inference Protocol's gRPC form
 * maps to) writes floats.
 */
const NON_FINITE: Record<string, number> = {
  NaN: Number.NaN,
  Infinity: Number.POSITIVE_INFINITY,
  '-Infinity': Number.NEGATIVE_INFINITY,
};

/**
 * Why a model with this input or output dtype cannot be served (null: it can): `dtype` as the
 * session's metadata names it (null: not a tensor, a sequence or a map).
 */
export function unsupportedDtype(dtype: string | null): string | null {
  if (dtype === null) return 'is not a tensor (a sequence or a map): not supported';
  return Object.hasOwn(DTYPES, dtype)
    ? null
    : `is ${dtype}: onnxruntime-node cannot pass ${dtype} tensors (supported: ${Object.keys(DTYPES).join(', ')})`;
}

/** Integer ranges of the integer dtypes (JSON values are checked against them). */
const RANGE: Partial<Record<Dtype, [bigint, bigint]>> = {
  int8: [-128n, 127n],
  uint8: [0n, 255n],
  int16: [-32768n, 32767n],
  uint16: [0n, 65535n],
  int32: [-2147483648n, 2147483647n],
  uint32: [0n, 4294967295n],
  int64: [-(2n ** 63n), 2n ** 63n - 1n],
  uint64: [0n, 2n ** 64n - 1n],
  bool: [0n, 1n],
};

/** The largest finite value of each float dtype (float32: 2^128 - 2^104; float16: 65504). */
const FLOAT_MAX: Record<string, number> = { float16: 65504, float32: 3.4028234663852886e38 };

/** Most dimensions a tensor may have (ONNX itself sets no limit; no model of ours comes near). */
export const MAX_RANK = 32;

/** A `tensor` request as the transport read it: inputs by name, the outputs wanted, and how to answer. */
export interface TensorRequest {
  inputs: Record<string, WireTensor>;
  /** Output names wanted; absent: every output. */
  outputs?: string[];
  /** Answer in msgpack with binary data (the request was msgpack, or asked for it by `Accept`). */
  binary: boolean;
}

const plural = (n: number, word: string): string => `${n} ${word}${n === 1 ? '' : 's'}`;
const dims = (shape: readonly (number | string)[]): string =>
  `[${shape.map((d) => (typeof d === 'number' ? String(d) : d || '?')).join(', ')}]`;

/**
 * One input tensor of a request, `{dtype, shape, data}`: `data` is a list of numbers (nested
 * lists too, as numpy's `tolist()` gives; int64/uint64 may be given as decimal strings; bool as
 * true/false or 0/1), raw little-endian bytes (msgpack `bin`), or a typed array of the dtype's
 * own kind (msgpackr's typed-array extension). Copied into a new typed array of the dtype.
 * @throws VoxError `invalid_tensor` naming `inputs.<name>` and the field.
 */
export function readTensor(name: string, value: unknown): WireTensor {
  const at = `inputs.${name}`;
  if (!value || typeof value !== 'object' || Array.isArray(value))
    throw voxError('invalid_tensor', { field: at, problem: 'must be an object {dtype, shape, data}' });
  const t = value as Record<string, unknown>;
  const extra = Object.keys(t).find((k) => !['dtype', 'shape', 'data'].includes(k));
  if (extra !== undefined)
    throw voxError('invalid_tensor', {
      field: `${at}.${extra}`,
      problem: 'unknown field; expected dtype, shape, data',
    });
  if (typeof t.dtype !== 'string' || !Object.hasOwn(DTYPES, t.dtype))
    throw voxError('invalid_tensor', {
      field: `${at}.dtype`,
      problem: `must be one of ${Object.keys(DTYPES).join(', ')}, got ${JSON.stringify(t.dtype) ?? 'nothing'}`,
    });
  const dtype = t.dtype as Dtype;
  const shape = t.shape;
  if (
    !Array.isArray(shape) ||
    shape.length > MAX_RANK ||
    !shape.every((d) => typeof d === 'number' && Number.isSafeInteger(d) && d >= 0)
  )
    throw voxError('invalid_tensor', {
      field: `${at}.shape`,
      problem: `must be a list of at most ${MAX_RANK} non-negative integers ([] for a scalar)`,
    });
  const count = (shape as number[]).reduce((n, d) => n * d, 1);
  // A 0-d tensor as numpy's `tolist()` gives it: the bare value.
  const data = shape.length === 0 && t.data !== null && typeof t.data !== 'object' ? [t.data] : t.data;
  if (dtype === 'string') {
    const list = Array.isArray(data) ? flatList(`${at}.data`, data, shape as number[], count) : null;
    const i = list ? list.findIndex((v) => typeof v !== 'string') : -1;
    if (!list || i >= 0)
      throw voxError('invalid_tensor', {
        field: list ? `${at}.data[${i}]` : `${at}.data`,
        problem: 'required: a list of strings (dtype string)',
      });
    return { dtype, shape: shape as number[], data: list as string[] };
  }
  const Ctor = DTYPES[dtype];
  const size = Ctor.BYTES_PER_ELEMENT;
  let out: TensorData;
  if (data instanceof Uint8Array) {
    // Raw bytes (msgpack bin, which msgpackr reads as a Buffer): little-endian, count x element size.
    if (data.byteLength !== count * size)
      throw voxError('invalid_tensor', {
        field: `${at}.data`,
        problem: `${data.byteLength} bytes, but ${dtype} ${dims(shape as number[])} needs ${count * size} (${plural(count, 'element')} of ${size} bytes, little-endian)`,
      });
    out = new Ctor(count);
    new Uint8Array(out.buffer).set(data);
  } else if (ArrayBuffer.isView(data) && !(data instanceof DataView)) {
    // A typed array (msgpackr's extension): it must be of the dtype's own kind.
    if (data.constructor !== Ctor)
      throw voxError('invalid_tensor', {
        field: `${at}.data`,
        problem: `a ${data.constructor.name}, but dtype ${dtype} is held in a ${Ctor.name}`,
      });
    if ((data as TensorData).length !== count)
      throw voxError('invalid_tensor', {
        field: `${at}.data`,
        problem: `${plural((data as TensorData).length, 'value')}, but shape ${dims(shape as number[])} needs ${count}`,
      });
    out = (data as TensorData).slice();
  } else if (Array.isArray(data)) {
    out = fromList(`${at}.data`, dtype, flatList(`${at}.data`, data, shape as number[], count));
  } else {
    throw voxError('invalid_tensor', {
      field: `${at}.data`,
      problem: 'required: a list of numbers (JSON), or raw little-endian bytes (msgpack bin)',
    });
  }
  return { dtype, shape: shape as number[], data: out };
}

/**
 * `data` as a flat list: flat already with `count` values, or nested exactly as `shape` (a list of
 * `shape[0]` lists of `shape[1]` ... values, as numpy's `tolist()` gives). Walks at most `shape`'s
 * rank deep, so a deeper or ragged nesting is an error, not a stack overflow or a silent reshape.
 * @throws VoxError `invalid_tensor` naming `field` (with the index where the nesting is wrong).
 */
function flatList(field: string, data: unknown[], shape: number[], count: number): unknown[] {
  if (!data.some(Array.isArray)) {
    if (data.length !== count)
      throw voxError('invalid_tensor', {
        field,
        problem: `${plural(data.length, 'value')}, but shape ${dims(shape)} needs ${count}`,
      });
    return data;
  }
  const out: unknown[] = [];
  const at: number[] = [];
  const where = (): string => `${field}${at.map((i) => `[${i}]`).join('')}`;
  const walk = (v: unknown, depth: number): void => {
    if (depth === shape.length) {
      if (Array.isArray(v))
        throw voxError('invalid_tensor', { field: where(), problem: `nested deeper than shape ${dims(shape)}` });
      out.push(v);
      return;
    }
    if (!Array.isArray(v) || v.length !== shape[depth])
      throw voxError('invalid_tensor', {
        field: where(),
        problem: `must be a list of ${shape[depth]} (dimension ${depth} of shape ${dims(shape)}), got ${Array.isArray(v) ? plural(v.length, 'value') : 'a single value'}`,
      });
    for (let i = 0; i < v.length; i++) {
      at.push(i);
      walk(v[i], depth + 1);
      at.pop();
    }
  };
  walk(data, 0);
  return out;
}

/**
 * A flat list of JSON values as a typed array of `dtype`: integers within the dtype's range, floats
 * as numbers within it (a float32 value past about 3.4e38, a float16 one past 65504, is refused,
 * not made Infinity) or as the strings "NaN", "Infinity", "-Infinity".
 * @throws VoxError `invalid_tensor` naming `field` and the first bad element.
 */
function fromList(field: string, dtype: Exclude<Dtype, 'string'>, list: unknown[]): TensorData {
  const Ctor = DTYPES[dtype];
  const out = new Ctor(list.length);
  const range = RANGE[dtype];
  const bad = (i: number, what: string): never => {
    throw voxError('invalid_tensor', {
      field: `${field}[${i}]`,
      problem: `${JSON.stringify(list[i])?.slice(0, 40) ?? String(list[i])} is not ${what}`,
    });
  };
  for (let i = 0; i < list.length; i++) {
    let v = list[i];
    if (dtype === 'bool' && typeof v === 'boolean') v = v ? 1 : 0;
    if (!range) {
      if (typeof v === 'string' && Object.hasOwn(NON_FINITE, v)) v = NON_FINITE[v];
      if (typeof v !== 'number') bad(i, `a number (${dtype}), or "NaN", "Infinity", "-Infinity"`);
      const x =
        dtype === 'float16'
          ? halfToNumber(numberToHalf(v as number))
          : dtype === 'float32'
            ? Math.fround(v as number)
            : v;
      // A finite value past the dtype's range would silently become Infinity.
      if (!Number.isFinite(x) && Number.isFinite(v))
        bad(i, `in the range of ${dtype} (magnitude at most ${FLOAT_MAX[dtype]})`);
      (out as Float32Array)[i] = dtype === 'float16' ? numberToHalf(v as number) : (v as number);
      continue;
    }
    let n: bigint;
    if (typeof v === 'number' && Number.isSafeInteger(v)) n = BigInt(v);
    else if (typeof v === 'string' && /^-?\d{1,20}$/.test(v) && (dtype === 'int64' || dtype === 'uint64'))
      n = BigInt(v);
    else n = bad(i, dtype === 'bool' ? 'a boolean (or 0, 1)' : `an integer (${dtype})`);
    if (n < range[0] || n > range[1]) bad(i, `in the range of ${dtype} (${range[0]} to ${range[1]})`);
    if (out instanceof BigInt64Array || out instanceof BigUint64Array) out[i] = n;
    else out[i] = Number(n);
  }
  return out;
}

/**
 * Reads the tensor fields of a `POST /v1/tasks/run` body (JSON or msgpack, already decoded):
 * `inputs` (an object of named tensors, {@link readTensor}) and `outputs` (a list of names, optional).
 * @param maxBytes `limits.max_tensor_bytes`: the inputs' data together may not be larger (a string element
 *   counts its UTF-8 bytes and 4, its length in the binary tensor data form).
 * @throws VoxError `invalid_tensor` / `invalid_field` naming the field; `tensor_too_large` (413).
 */
export function readTensorRequest(
  body: { inputs?: unknown; outputs?: unknown },
  binary: boolean,
  maxBytes: number,
): TensorRequest {
  const raw = body.inputs;
  if (!raw || typeof raw !== 'object' || Array.isArray(raw) || ArrayBuffer.isView(raw))
    throw invalid('inputs', 'required: an object of named tensors {"<name>": {"dtype", "shape", "data"}}');
  // No prototype: an input named `__proto__` is an input like any other (then refused by name), not the object's prototype.
  const inputs: Record<string, WireTensor> = Object.create(null);
  let bytes = 0;
  for (const [name, value] of Object.entries(raw)) {
    const t = readTensor(name, value);
    bytes += Array.isArray(t.data)
      ? // A string counts its UTF-8 bytes and 4 for its length (as the binary tensor data form carries it), so
        // many empty strings are not free: each is an object on the event loop and in the slot host.
        t.data.reduce((n, v) => n + 4 + Buffer.byteLength(v), 0)
      : (t.data as TensorData).byteLength;
    if (bytes > maxBytes) throw voxError('tensor_too_large', { limit: maxBytes });
    inputs[name] = t;
  }
  let outputs: string[] | undefined;
  if (body.outputs !== undefined) {
    if (
      !Array.isArray(body.outputs) ||
      !body.outputs.length ||
      !body.outputs.every((o) => typeof o === 'string' && o.length > 0)
    )
      throw invalid('outputs', 'must be a non-empty list of output names (omit it for every output)');
    outputs = [...new Set(body.outputs as string[])];
  }
  return { inputs, outputs, binary };
}

/** How a model's input or output is shown in messages: `name (float32 [batch_size, samples])`. */
const described = (m: TensorMeta): string =>
  `${m.name} (${m.dtype ?? 'not a tensor'}${m.shape ? ` ${dims(m.shape)}` : ''})`;

/**
 * The slot job of a tensor request, after checking it against what the model's session reported:
 * every input present and no other, each of the input's dtype and rank, each fixed dimension
 * matched (a dynamic one, named or '', takes any size); every output asked for exists.
 * @throws VoxError `wrong_task` for a model that is not a tensor model; `invalid_tensor` naming the
 *   input and what the model expects; `unknown_output` naming the output and the model's outputs.
 */
export function tensorJob(config: ModelConfig, info: SlotInfo, request: TensorRequest): TensorJob {
  const meta = info.tensor;
  if (config.task !== 'tensor' || !meta)
    throw voxError('wrong_task', {
      id: config.id,
      task: config.task,
      problem: 'it takes audio (`audio`, or an audio body), not `inputs`',
    });
  const want = meta.inputs.map(described).join(', ');
  for (const name of Object.keys(request.inputs))
    if (!meta.inputs.some((m) => m.name === name))
      throw voxError('invalid_tensor', {
        field: `inputs.${name}`,
        problem: `model ${config.id} has no such input; its inputs: ${want}`,
      });
  for (const m of meta.inputs) {
    const t = request.inputs[m.name];
    const at = `inputs.${m.name}`;
    if (!t) throw voxError('invalid_tensor', { field: at, problem: `missing; model ${config.id} takes ${want}` });
    if (m.dtype === null || m.shape === null)
      throw voxError('invalid_tensor', {
        field: at,
        problem: 'is not a tensor input (a sequence or map): not supported',
      });
    if (t.dtype !== m.dtype)
      throw voxError('invalid_tensor', { field: `${at}.dtype`, problem: `expected ${m.dtype}, got ${t.dtype}` });
    if (t.shape.length !== m.shape.length)
      throw voxError('invalid_tensor', {
        field: `${at}.shape`,
        problem: `expected rank ${m.shape.length} ${dims(m.shape)}, got rank ${t.shape.length} ${dims(t.shape)}`,
      });
    m.shape.forEach((d, i) => {
      if (typeof d === 'number' && d !== t.shape[i])
        throw voxError('invalid_tensor', {
          field: `${at}.shape`,
          problem: `dimension ${i} must be ${d} (${dims(m.shape!)}), got ${dims(t.shape)}`,
        });
    });
  }
  for (const name of request.outputs ?? [])
    if (!meta.outputs.some((m) => m.name === name))
      throw voxError('unknown_output', {
        name,
        id: config.id,
        outputs: meta.outputs.map(described).join(', '),
      });
  return { kind: 'tensor', inputs: request.inputs, outputs: request.outputs };
}

/** Rounds to the nearest integer, ties to even. */
function roundEven(x: number): number {
  const f = Math.floor(x);
  const d = x - f;
  return d > 0.5 || (d === 0.5 && f % 2 !== 0) ? f + 1 : f;
}

/**
 * A number as IEEE 754 half precision bits, rounded to nearest, ties to even (straight from the
 * double, so never rounded twice); past 65504 by half an ulp or more it is Infinity.
 */
export function numberToHalf(v: number): number {
  if (Number.isNaN(v)) return 0x7e00;
  const sign = v < 0 || Object.is(v, -0) ? 0x8000 : 0;
  const a = Math.abs(v);
  if (a >= 65520) return sign | 0x7c00;
  if (a < 2 ** -14) return sign | roundEven(a * 2 ** 24); // subnormal (1024 is the least normal's bits)
  let e = Math.floor(Math.log2(a));
  if (2 ** e > a) e--;
  else if (2 ** (e + 1) <= a) e++;
  let m = roundEven((a / 2 ** e - 1) * 1024);
  if (m === 1024) {
    m = 0;
    e++;
  }
  return sign | ((e + 15) << 10) | m;
}

/** IEEE 754 half precision bits as a number. */
function halfToNumber(h: number): number {
  const e = (h >> 10) & 0x1f;
  const f = h & 0x3ff;
  const sign = h & 0x8000 ? -1 : 1;
  if (e === 0) return sign * f * 2 ** -24;
  if (e === 31) return f ? Number.NaN : sign * Number.POSITIVE_INFINITY;
  return sign * (1 + f / 1024) * 2 ** (e - 15);
}

/** A float as JSON writes it: a number, or "NaN", "Infinity", "-Infinity" ({@link NON_FINITE}). */
const jsonFloat = (v: number): number | string =>
  Number.isFinite(v) ? v : Number.isNaN(v) ? 'NaN' : v > 0 ? 'Infinity' : '-Infinity';

/**
 * A tensor result's outputs as the answer carries them: `{name: {dtype, shape, data}}` with
 * `data` a flat list in row-major order (JSON: int64/uint64 as numbers, or as decimal strings
 * beyond 2^53; float16 as numbers; floats' non-finite values as "NaN", "Infinity", "-Infinity";
 * bool as true/false), or (`binary`) the raw little-endian bytes, for msgpack's `bin` (string
 * tensors stay lists).
 */
export function tensorOutputs(result: TensorResult, binary: boolean): Record<string, unknown> {
  const out: Record<string, unknown> = {};
  for (const [name, t] of Object.entries(result.outputs)) {
    const d = t.data;
    let data: unknown;
    if (!ArrayBuffer.isView(d)) data = d;
    else if (binary) data = Buffer.from(d.buffer, d.byteOffset, d.byteLength);
    else if (d instanceof BigInt64Array || d instanceof BigUint64Array)
      data = Array.from(d, (v) => (v >= -(2n ** 53n) && v <= 2n ** 53n ? Number(v) : String(v)));
    else if (t.dtype === 'bool') data = Array.from(d as Uint8Array, (v) => v !== 0);
    else if (t.dtype === 'float16') data = Array.from(d as Uint16Array, (h) => jsonFloat(halfToNumber(h)));
    else if (FLOATS.has(t.dtype)) data = Array.from(d as Float32Array, jsonFloat);
    else data = Array.from(d as Float32Array);
    out[name] = { dtype: t.dtype, shape: t.shape, data };
  }
  return out;
}
