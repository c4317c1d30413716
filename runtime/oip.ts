/**
 * The Open Inference Protocol (KServe v2, REST) for `tensor` models: its JSON shapes as voxserve's
 * own tensor requests and answers (a wire codec, as transport/codec.ts is for events). `POST
 * /v2/models/{id}/infer` becomes a tensor `run` of the same model (the same lease, checks and
 * slots as `POST /v1/tasks/run`); its answer is written back in the protocol's shape. Datatypes: `BOOL`,
 * `UINT8`-`UINT64`, `INT8`-`INT64`, `FP16` (as binary data, and in answers), `FP32`, `FP64`, `BYTES`
 * (voxserve's `string` tensors: UTF-8 text).
 * See https://github.com/kserve/open-inference-protocol (specification/protocol/inference_rest.md).
 *
 * And its binary tensor data extension (Triton's docs/protocol/extension_binary_data.md,
 * https://github.com/triton-inference-server/server): a body that is the JSON request followed by
 * raw tensor bytes, the `Inference-Header-Content-Length` header giving the JSON's length in bytes;
 * an input sent so carries `"parameters": {"binary_data_size": <bytes>}` and no `data`, its bytes
 * following the JSON in the order of `inputs`. Bytes are little-endian, row-major, no padding;
 * `BOOL` one byte (0 or 1) per element; `BYTES` each element a 4-byte little-endian unsigned length
 * then its bytes. Outputs asked for with `"parameters": {"binary_data": true}` (or all of them, by
 * the request's `"parameters": {"binary_data_output": true}`, which an output's own `binary_data`
 * overrides) come back the same way: the JSON answer, each such output with
 * `"parameters": {"binary_data_size": <bytes>}`, then their bytes in the order of `outputs`.
 */
import { invalid, voxError } from './errors.js';
import type { TensorMeta, WireTensor } from './slots/slot-protocol.js';
import { MAX_RANK } from './tasks/tensor.js';

/** The protocol's datatypes and voxserve's dtypes, both ways. */
const DATATYPES: Record<string, string> = {
  BOOL: 'bool',
  UINT8: 'uint8',
  UINT16: 'uint16',
  UINT32: 'uint32',
  UINT64: 'uint64',
  INT8: 'int8',
  INT16: 'int16',
  INT32: 'int32',
  INT64: 'int64',
  FP16: 'float16',
  FP32: 'float32',
  FP64: 'float64',
  BYTES: 'string',
};
const DATATYPE_OF: Record<string, string> = Object.fromEntries(Object.entries(DATATYPES).map(([k, v]) => [v, k]));

/** Bytes per element of each fixed-size datatype as binary data (`BYTES` is sized per element). */
const ELEMENT_BYTES: Record<string, number> = {
  BOOL: 1,
  UINT8: 1,
  UINT16: 2,
  UINT32: 4,
  UINT64: 8,
  INT8: 1,
  INT16: 2,
  INT32: 4,
  INT64: 8,
  FP16: 2,
  FP32: 4,
  FP64: 8,
};

/** The HTTP header that gives the JSON part's length, bytes, in a body with binary tensor data. */
export const INFERENCE_HEADER = 'inference-header-content-length';

/** A tensor's metadata as `$metadata_tensor`: `{name, datatype, shape}`, dynamic dimensions as -1. */
export function v2TensorMeta(m: TensorMeta): { name: string; datatype: string; shape: number[] } {
  return {
    name: m.name,
    datatype: (m.dtype && DATATYPE_OF[m.dtype]) ?? 'BYTES',
    shape: (m.shape ?? []).map((d) => (typeof d === 'number' ? d : -1)),
  };
}

/** Which outputs an answer carries as binary data: each named one as it says, the others as `all`. */
export interface BinaryOutputs {
  all: boolean;
  byName: Record<string, boolean>;
}

/** A parsed `POST /v2/models/{id}/infer` body. */
export interface V2Infer {
  /** A tensor request's fields: `inputs` by name as `{dtype, shape, data}`, `outputs` names. */
  fields: { inputs: Record<string, unknown>; outputs?: string[] };
  /** The request's `id`, echoed in the answer. */
  id?: string;
  /** The outputs to answer as binary data. */
  binary: BinaryOutputs;
}

const isObject = (v: unknown): v is Record<string, unknown> => !!v && typeof v === 'object' && !Array.isArray(v);

/**
 * Reads a `parameters` object allowing only `allowed` (each a boolean, or for `binary_data_size`
 * a non-negative integer).
 * @throws VoxError `invalid_field` naming `<at>.parameters.<key>`.
 */
function readParameters(at: string, raw: unknown, allowed: string[]): Record<string, unknown> {
  if (raw === undefined) return {};
  if (!isObject(raw)) throw invalid(`${at}parameters`, 'must be an object');
  for (const [k, v] of Object.entries(raw)) {
    const field = `${at}parameters.${k}`;
    if (!allowed.includes(k))
      throw invalid(field, `not supported; the parameters taken here: ${allowed.join(', ') || 'none'}`);
    if (k === 'binary_data_size' ? !Number.isSafeInteger(v) || (v as number) < 0 : typeof v !== 'boolean')
      throw invalid(field, k === 'binary_data_size' ? 'must be a non-negative integer (bytes)' : 'must be a boolean');
  }
  return raw;
}

/**
 * One binary input's bytes as the data {@link readTensor} takes: the bytes themselves for a fixed-size
 * datatype (checked against the shape; `BOOL` bytes 0 or 1), a list of strings for `BYTES`.
 * @throws VoxError `invalid_field` naming `inputs[i].parameters.binary_data_size` or the element.
 */
function binaryInput(at: string, datatype: string, shape: unknown, bytes: Buffer): Uint8Array | string[] {
  const field = `${at}.parameters.binary_data_size`;
  if (datatype !== 'BYTES') {
    // A shape that is not a list of sizes (at most MAX_RANK of them) is left to readTensor to name.
    const sizes =
      Array.isArray(shape) && shape.length <= MAX_RANK && shape.every((d) => Number.isSafeInteger(d) && d >= 0)
        ? shape
        : null;
    const count = sizes ? sizes.reduce((n: number, d: number) => n * d, 1) : 0;
    const want = count * ELEMENT_BYTES[datatype];
    if (sizes && bytes.length !== want)
      throw invalid(
        field,
        `${bytes.length} bytes, but ${datatype} [${sizes.join(', ')}] is ${want} (${count} elements of ${ELEMENT_BYTES[datatype]} bytes, little-endian)`,
      );
    const bad = datatype === 'BOOL' ? bytes.findIndex((b) => b > 1) : -1;
    if (bad >= 0) throw invalid(`${at} (binary data)`, `BOOL element ${bad} is byte ${bytes[bad]}; must be 0 or 1`);
    return bytes;
  }
  const out: string[] = [];
  const utf8 = new TextDecoder('utf-8', { fatal: true });
  for (let p = 0; p < bytes.length; ) {
    const n = p + 4 <= bytes.length ? bytes.readUInt32LE(p) : -1;
    if (n < 0 || p + 4 + n > bytes.length)
      throw invalid(
        field,
        `BYTES element ${out.length} at byte ${p} runs past the input's ${bytes.length} bytes (each element: a 4-byte little-endian length, then that many bytes)`,
      );
    try {
      out.push(utf8.decode(bytes.subarray(p + 4, p + 4 + n)));
    } catch {
      throw invalid(
        `${at} (binary data)`,
        `BYTES element ${out.length} is not UTF-8 text; voxserve's string tensors hold text only`,
      );
    }
    p += 4 + n;
  }
  return out;
}

/**
 * Reads an `$inference_request` (`{id?, parameters?, inputs: [{name, shape, datatype, data |
 * parameters.binary_data_size}], outputs?: [{name, parameters?: {binary_data}}]}`) as a tensor
 * request's fields, its `id`, and which outputs to answer as binary data.
 * @param binary the bytes after the JSON (binary tensor data extension), in `inputs`' order; absent:
 *   the body was JSON only, and no input may have `binary_data_size`.
 * @throws VoxError `invalid_field` naming the field (`inputs[0].datatype`, `inputs[1].parameters.binary_data_size`, ...).
 */
export function readV2Infer(json: Record<string, unknown>, binary?: Buffer): V2Infer {
  const extra = Object.keys(json).find((k) => !['id', 'parameters', 'inputs', 'outputs'].includes(k));
  if (extra) throw invalid(extra, 'unknown field of an inference request; expected id, parameters, inputs, outputs');
  if (json.id !== undefined && typeof json.id !== 'string') throw invalid('id', 'must be a string');
  const params = readParameters('', json.parameters, ['binary_data_output']);
  if (!Array.isArray(json.inputs) || !json.inputs.length)
    throw invalid('inputs', 'required: a list of input tensors [{"name", "shape", "datatype", "data"}]');
  // No prototype: an input named `__proto__` is an input like any other (then refused by name), not the object's prototype.
  const inputs: Record<string, unknown> = Object.create(null);
  let offset = 0;
  json.inputs.forEach((raw, i) => {
    const at = `inputs[${i}]`;
    if (!isObject(raw)) throw invalid(at, 'must be an object {name, shape, datatype, data}');
    const t = raw;
    const bad = Object.keys(t).find((k) => !['name', 'shape', 'datatype', 'data', 'parameters'].includes(k));
    if (bad) throw invalid(`${at}.${bad}`, 'unknown field; expected name, shape, datatype, data, parameters');
    if (typeof t.name !== 'string' || !t.name) throw invalid(`${at}.name`, 'required, a string');
    const size = readParameters(`${at}.`, t.parameters, ['binary_data_size']).binary_data_size as number | undefined;
    const datatype = typeof t.datatype === 'string' && Object.hasOwn(DATATYPES, t.datatype) ? t.datatype : undefined;
    if (!datatype || (datatype === 'FP16' && size === undefined))
      throw invalid(
        `${at}.datatype`,
        `must be one of ${Object.keys(DATATYPES).join(', ')} (FP16 as binary data only), got ${JSON.stringify(t.datatype) ?? 'nothing'}`,
      );
    if (Object.hasOwn(inputs, t.name)) throw invalid(`${at}.name`, `'${t.name}' is given twice`);
    let data = t.data;
    if (size !== undefined) {
      if (!binary)
        throw invalid(
          `${at}.parameters.binary_data_size`,
          "binary data needs the Inference-Header-Content-Length header (the JSON part's length, bytes) and the bytes after the JSON",
        );
      if (data !== undefined)
        throw invalid(`${at}.data`, 'an input sent as binary data (binary_data_size) has no data');
      if (offset + size > binary.length)
        throw invalid(
          `${at}.parameters.binary_data_size`,
          `${size} bytes from byte ${offset} of the binary data, but only ${binary.length} follow the JSON`,
        );
      data = binaryInput(at, datatype, t.shape, binary.subarray(offset, offset + size));
      offset += size;
    }
    inputs[t.name] = { dtype: DATATYPES[datatype], shape: t.shape, data };
  });
  if (binary && offset !== binary.length)
    throw invalid(
      'inputs',
      `the inputs' binary_data_size add up to ${offset} bytes, but ${binary.length} follow the JSON (Inference-Header-Content-Length)`,
    );
  const all = params.binary_data_output === true;
  const byName: Record<string, boolean> = {};
  let outputs: string[] | undefined;
  if (json.outputs !== undefined) {
    if (!Array.isArray(json.outputs)) throw invalid('outputs', 'must be a list [{"name"}]');
    outputs = json.outputs.map((o, i) => {
      const at = `outputs[${i}]`;
      if (!isObject(o)) throw invalid(at, 'must be an object {name, parameters?}');
      const bad = Object.keys(o).find((k) => k !== 'name' && k !== 'parameters');
      if (bad) throw invalid(`${at}.${bad}`, 'unknown field; expected name, parameters');
      if (typeof o.name !== 'string' || !o.name) throw invalid(`${at}.name`, 'required, a string');
      const p = readParameters(`${at}.`, o.parameters, ['binary_data']);
      if (typeof p.binary_data === 'boolean') byName[o.name] = p.binary_data;
      return o.name;
    });
  }
  return { fields: { inputs, outputs }, id: json.id as string | undefined, binary: { all, byName } };
}

/**
 * Splits a body with binary tensor data at `Inference-Header-Content-Length`: the JSON part and the
 * bytes after it.
 * @param header the header's value as received.
 * @param maxTensorBytes `limits.max_tensor_bytes`: the bytes after the JSON are the binary inputs' data
 *   as it is counted against that limit (a `BYTES` element its 4-byte length and its text), so more is
 *   refused here, before a `BYTES` input's elements are read one by one on the event loop.
 * @throws VoxError `invalid_field` naming the header: not a whole number, 0 (a raw binary request,
 *   which voxserve does not take), or past the body's end; `tensor_too_large` (413) for more binary
 *   data than `maxTensorBytes`.
 */
export function splitBinaryBody(
  header: string,
  body: Buffer,
  maxTensorBytes: number,
): { json: Buffer; binary: Buffer } {
  const field = 'Inference-Header-Content-Length';
  if (!/^\d{1,12}$/.test(header.trim()))
    throw invalid(field, `must be the JSON part's length in bytes, got ${JSON.stringify(header.slice(0, 32))}`);
  const n = Number(header);
  if (n === 0)
    throw invalid(
      field,
      '0 (a raw binary request, with no JSON header) is not supported: send the JSON inference request first',
    );
  if (n > body.length) throw invalid(field, `${n} bytes, but the body has ${body.length}`);
  if (body.length - n > maxTensorBytes) throw voxError('tensor_too_large', { limit: maxTensorBytes });
  return { json: body.subarray(0, n), binary: body.subarray(n) };
}

/** A tensor's elements as binary data: its bytes (little-endian), or for strings each as a 4-byte length and UTF-8. */
function tensorBytes(t: WireTensor): Buffer {
  const d = t.data;
  if (ArrayBuffer.isView(d)) return Buffer.from(d.buffer, d.byteOffset, d.byteLength);
  return Buffer.concat(
    d.flatMap((s) => {
      const b = Buffer.from(s, 'utf8');
      const n = Buffer.alloc(4);
      n.writeUInt32LE(b.length);
      return [n, b];
    }),
  );
}

/**
 * Voxserve's tensor answer as an `$inference_response`: `{model_name, id?, outputs: [{name, shape,
 * datatype, data | parameters.binary_data_size}]}`, outputs in the answer's order. With any output
 * as binary data the answer is the JSON followed by those outputs' bytes, and `headerLength` the
 * JSON's length (for `Inference-Header-Content-Length`); else `json` alone.
 * @param toJson the outputs written as JSON (voxserve's JSON tensor form: `{name: {dtype, shape, data}}`).
 * @throws VoxError `internal_error` for an output with a type the protocol cannot carry.
 */
export function v2InferResponse(
  model: string,
  id: string | undefined,
  outputs: Record<string, WireTensor>,
  binary: BinaryOutputs,
  toJson: (outputs: Record<string, WireTensor>) => Record<string, { data: unknown }>,
): { json: Record<string, unknown> } | { body: Buffer; headerLength: number } {
  const asBinary = (name: string): boolean => binary.byName[name] ?? binary.all;
  const jsonData = toJson(Object.fromEntries(Object.entries(outputs).filter(([name]) => !asBinary(name))));
  const bytes: Buffer[] = [];
  const json = {
    model_name: model,
    ...(id !== undefined ? { id } : {}),
    outputs: Object.entries(outputs).map(([name, t]) => {
      const datatype = DATATYPE_OF[t.dtype];
      if (!datatype) throw voxError('internal_error', { message: `output ${name} is ${t.dtype}, not a v2 datatype` });
      if (!asBinary(name)) return { name, shape: t.shape, datatype, data: jsonData[name].data };
      bytes.push(tensorBytes(t));
      return { name, shape: t.shape, datatype, parameters: { binary_data_size: bytes[bytes.length - 1].length } };
    }),
  };
  if (!bytes.length) return { json };
  const head = Buffer.from(JSON.stringify(json));
  return { body: Buffer.concat([head, ...bytes]), headerLength: head.length };
}
