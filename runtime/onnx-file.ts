import { headLabels, OWW } from './slots/slot-protocol.js';

/**
 * Reading ONNX files on the main thread without onnxruntime (whose `create` blocks the event
 * loop): whether a file starts like a model, and what an openWakeWord head's graph takes and gives.
 */

/**
 * The top-level fields of an ONNX `ModelProto` (onnx/onnx.proto: ir_version 1, producer_name 2,
 * producer_version 3, domain 4, model_version 5, doc_string 6, graph 7, opset_import 8,
 * metadata_props 14, training_info 20, functions 25) with their protobuf wire types (0 varint,
 * 2 length-delimited).
 */
const MODEL_PROTO_FIELDS = new Map([
  [1, 0],
  [2, 2],
  [3, 2],
  [4, 2],
  [5, 0],
  [6, 2],
  [7, 2],
  [8, 2],
  [14, 2],
  [20, 2],
  [25, 2],
]);

/**
 * Whether `head` (a file's first bytes) can start an ONNX model: a protobuf message whose first
 * tag (a varint: field number << 3 | wire type) is one of `ModelProto`'s fields with its wire
 * type. Serializers write fields in field-number order, so a real model starts with 0x08
 * (ir_version); a text file, an archive or a TFLite file does not.
 */
export function looksLikeOnnx(head: Uint8Array): boolean {
  let tag = 0;
  for (let i = 0, shift = 0; i < Math.min(head.length, 5); i++, shift += 7) {
    tag |= (head[i]! & 0x7f) << shift;
    if ((head[i]! & 0x80) === 0) return MODEL_PROTO_FIELDS.get(tag >>> 3) === (tag & 7);
  }
  return false;
}

/** A protobuf field: its number, wire type, and value (a varint, or the bytes of a length-delimited field). */
type Field = { n: number; wire: number; value: number; bytes: Uint8Array };

/**
 * The fields of one protobuf message (the wire format of protobuf's encoding guide: varint,
 * 64-bit, length-delimited and 32-bit fields; groups are refused).
 * @throws Error on a truncated or malformed message.
 */
function fields(buf: Uint8Array): Field[] {
  const out: Field[] = [];
  let at = 0;
  const varint = (): number => {
    let v = 0;
    for (let shift = 0; ; shift += 7) {
      if (at >= buf.length || shift > 63) throw new Error('truncated protobuf');
      const b = buf[at++];
      v += (b & 0x7f) * 2 ** shift;
      if (!(b & 0x80)) return v;
    }
  };
  while (at < buf.length) {
    const tag = varint();
    const wire = tag % 8;
    const n = Math.floor(tag / 8);
    const empty = buf.subarray(0, 0);
    if (wire === 0) out.push({ n, wire, value: varint(), bytes: empty });
    else if (wire === 1 || wire === 5) {
      at += wire === 1 ? 8 : 4;
      if (at > buf.length) throw new Error('truncated protobuf');
    } else if (wire === 2) {
      const len = varint();
      if (at + len > buf.length) throw new Error('truncated protobuf');
      out.push({ n, wire, value: len, bytes: buf.subarray(at, at + len) });
      at += len;
    } else throw new Error(`protobuf wire type ${wire} is not supported`);
  }
  return out;
}

const text = (b: Uint8Array): string => Buffer.from(b.buffer, b.byteOffset, b.byteLength).toString('utf8');

/**
 * A graph input or output: its name, element type (onnx.proto TensorProto.DataType, 1 = float) and dimensions (a
 * number, or the name of a dynamic one).
 */
interface ValueInfo {
  name: string;
  elemType: number;
  dims: (number | string)[];
}

/**
 * onnx.proto ValueInfoProto {name 1, type 2: TypeProto {tensor_type 1: {elem_type 1, shape 2: {dim 1: {dim_value 1,
 * dim_param 2}}}}}.
 */
function valueInfo(bytes: Uint8Array): ValueInfo {
  const v: ValueInfo = { name: '', elemType: 0, dims: [] };
  for (const f of fields(bytes)) {
    if (f.n === 1 && f.wire === 2) v.name = text(f.bytes);
    if (f.n !== 2 || f.wire !== 2) continue;
    for (const t of fields(f.bytes)) {
      if (t.n !== 1 || t.wire !== 2) continue;
      for (const tt of fields(t.bytes)) {
        if (tt.n === 1 && tt.wire === 0) v.elemType = tt.value;
        if (tt.n !== 2 || tt.wire !== 2) continue;
        for (const dim of fields(tt.bytes)) {
          if (dim.n !== 1 || dim.wire !== 2) continue;
          let d: number | string = '?';
          for (const x of fields(dim.bytes)) {
            if (x.n === 1 && x.wire === 0) d = x.value;
            if (x.n === 2 && x.wire === 2) d = text(x.bytes) || '?';
          }
          v.dims.push(d);
        }
      }
    }
  }
  return v;
}

const shown = (v: ValueInfo): string =>
  `${v.elemType === 1 ? 'float' : `element type ${v.elemType}`} [${v.dims.join(', ')}]`;

/**
 * What an ONNX file is as an openWakeWord classifier head: its window (N, the embeddings it reads)
 * and output labels ({@link headLabels}), as the slot host reports them when it loads the head; or
 * why it is not one. A head's graph (onnx.proto ModelProto.graph 7: inputs 11, outputs 12,
 * initializers 5 whose names 8 older exporters list among the inputs) takes one float input
 * [batch, N, 96] (N a fixed number) and gives one output [batch, classes]: the rule the slot host
 * applies when it loads a head.
 */
export function headInfo(bytes: Uint8Array): { window: number; labels: string[] } | { problem: string } {
  if (!looksLikeOnnx(bytes.subarray(0, 16)))
    return {
      problem:
        bytes.length === 0 ? 'the file is empty' : 'not an ONNX model (its first bytes are not an ONNX ModelProto)',
    };
  try {
    const graph = fields(bytes).find((f) => f.n === 7 && f.wire === 2);
    if (!graph) return { problem: 'not an ONNX model: it has no graph' };
    const g = fields(graph.bytes);
    const weights = new Set(
      g
        .filter((f) => f.n === 5 && f.wire === 2)
        .flatMap((f) => {
          const name = fields(f.bytes).find((x) => x.n === 8 && x.wire === 2);
          return name ? [text(name.bytes)] : [];
        }),
    );
    const inputs = g
      .filter((f) => f.n === 11 && f.wire === 2)
      .map((f) => valueInfo(f.bytes))
      .filter((v) => !weights.has(v.name));
    const outputs = g.filter((f) => f.n === 12 && f.wire === 2).map((f) => valueInfo(f.bytes));
    const [input] = inputs;
    const ok =
      inputs.length === 1 &&
      input.elemType === 1 &&
      input.dims.length === 3 &&
      typeof input.dims[1] === 'number' &&
      input.dims[1] > 0 &&
      input.dims[2] === OWW.EMBEDDING &&
      outputs.length === 1 &&
      outputs[0].dims.length === 2;
    if (ok) {
      const columns = outputs[0].dims[1];
      return {
        window: input.dims[1] as number,
        labels: headLabels(outputs[0].name, typeof columns === 'number' ? columns : 1),
      };
    }
    return {
      problem: `not an openWakeWord head: it takes ${inputs.map(shown).join(', ') || 'no input'} and gives ${outputs.map(shown).join(', ') || 'no output'}; a head takes one float input [1, N, 96] (N embeddings) and gives one output [1, classes]`,
    };
  } catch (e) {
    return { problem: `not a readable ONNX model (${(e as Error).message})` };
  }
}

/** Why an ONNX file is not an openWakeWord classifier head ({@link headInfo}), or null when it is one. */
export function headProblem(bytes: Uint8Array): string | null {
  const h = headInfo(bytes);
  return 'problem' in h ? h.problem : null;
}
