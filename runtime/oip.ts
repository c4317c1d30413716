/**
 * The Open Inference Protocol (KServe v2, REST) for `tensor` models: its JSON shapes as voxserve's
 * own tensor requests and answers (a wire codec, as transport/codec.ts is for events). `POST
 * /v2/models/{id}/infer` becomes a tensor `run` of the same model (the same lease, checks and
 * slots as `POST /v1/tasks/run`); its answer is written back in the protocol's shape. Datatypes: `BOOL`,
 * `UINT8`-`UINT64`, `INT8`-`INT64`, `FP16` (outputs),
 * `FP32`, `FP64`; `BYTES` is not a tensor type voxserve takes.
 * See https://github.com/kserve/open-inference-protocol (specification/protocol/inference_rest.md).
 */
import { invalid, voxError } from './errors.js';
import type { TensorMeta } from './slots/slot-protocol.js';

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
};
const DATATYPE_OF: Record<string, string> = Object.fromEntries(Object.entries(DATATYPES).map(([k, v]) => [v, k]));

/** A tensor's metadata as `$metadata_tensor`: `{name, datatype, shape}`, dynamic dimensions as -1. */
export function v2TensorMeta(m: TensorMeta): { name: string; datatype: string; shape: number[] } {
  return {
    name: m.name,
    datatype: (m.dtype && DATATYPE_OF[m.dtype]) ?? 'BYTES',
    shape: (m.shape ?? []).map((d) => (typeof d === 'number' ? d : -1)),
  };
}

/**
 * Reads an `$inference_request` (`{id?, parameters?, inputs: [{name, shape, datatype, data,
 * parameters?}], outputs?: [{name, parameters?}]}`) as a tensor request's fields (`inputs` by
 * name as `{dtype, shape, data}`, `outputs` names) and its `id`.
 * @throws VoxError `invalid_field` naming the field (`inputs[0].datatype`, ...).
 */
export function readV2Infer(json: Record<string, unknown>): {
  fields: { inputs: Record<string, unknown>; outputs?: string[] };
  id?: string;
} {
  const extra = Object.keys(json).find((k) => !['id', 'parameters', 'inputs', 'outputs'].includes(k));
  if (extra) throw invalid(extra, 'unknown field of an inference request; expected id, parameters, inputs, outputs');
  if (json.id !== undefined && typeof json.id !== 'string') throw invalid('id', 'must be a string');
  if (!Array.isArray(json.inputs) || !json.inputs.length)
    throw invalid('inputs', 'required: a list of input tensors [{"name", "shape", "datatype", "data"}]');
  const inputs: Record<string, unknown> = {};
  json.inputs.forEach((raw, i) => {
    const at = `inputs[${i}]`;
    if (!raw || typeof raw !== 'object' || Array.isArray(raw))
      throw invalid(at, 'must be an object {name, shape, datatype, data}');
    const t = raw as Record<string, unknown>;
    const bad = Object.keys(t).find((k) => !['name', 'shape', 'datatype', 'data', 'parameters'].includes(k));
    if (bad) throw invalid(`${at}.${bad}`, 'unknown field; expected name, shape, datatype, data, parameters');
    if (typeof t.name !== 'string' || !t.name) throw invalid(`${at}.name`, 'required, a string');
    if (t.parameters !== undefined && Object.keys(t.parameters as object).length)
      throw invalid(
        `${at}.parameters`,
        'no input parameters are supported (the binary data extension is not implemented: send data as JSON)',
      );
    const dtype = typeof t.datatype === 'string' ? DATATYPES[t.datatype] : undefined;
    if (!dtype || dtype === 'float16')
      throw invalid(
        `${at}.datatype`,
        `must be one of ${Object.keys(DATATYPES)
          .filter((d) => d !== 'FP16')
          .join(', ')}, got ${JSON.stringify(t.datatype) ?? 'nothing'}`,
      );
    if (Object.hasOwn(inputs, t.name)) throw invalid(`${at}.name`, `'${t.name}' is given twice`);
    inputs[t.name] = { dtype, shape: t.shape, data: t.data };
  });
  let outputs: string[] | undefined;
  if (json.outputs !== undefined) {
    if (!Array.isArray(json.outputs)) throw invalid('outputs', 'must be a list [{"name"}]');
    outputs = json.outputs.map((o, i) => {
      const name = (o as { name?: unknown } | null)?.name;
      if (typeof name !== 'string' || !name) throw invalid(`outputs[${i}].name`, 'required, a string');
      return name;
    });
  }
  return { fields: { inputs, outputs }, id: json.id as string | undefined };
}

/**
 * Voxserve's tensor answer (`outputs: {name: {dtype, shape, data}}`) as an `$inference_response`:
 * `{model_name, id?, outputs: [{name, shape, datatype, data}]}`, outputs in the answer's order.
 * @throws VoxError `server_error` for an output with a type the protocol cannot carry.
 */
export function v2InferResponse(
  model: string,
  id: string | undefined,
  outputs: Record<string, { dtype: string; shape: number[]; data: unknown }>,
): Record<string, unknown> {
  return {
    model_name: model,
    ...(id !== undefined ? { id } : {}),
    outputs: Object.entries(outputs).map(([name, t]) => {
      const datatype = DATATYPE_OF[t.dtype];
      if (!datatype) throw voxError('internal_error', { message: `output ${name} is ${t.dtype}, not a v2 datatype` });
      return { name, shape: t.shape, datatype, data: t.data };
    }),
  };
}
