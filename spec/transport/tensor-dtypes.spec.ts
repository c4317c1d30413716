/**
 * Tensor models with every dtype onnxruntime-node takes (issue 44, items 1 and 2), on a real
 * server: models built here with the ONNX schema, and each answer checked against onnxruntime-node
 * run directly in the test on the same tensors. JSON has no NaN or infinity: non-finite floats
 * are the strings "NaN", "Infinity", "-Infinity" (the proto3 JSON mapping of floats, which the
 * Open Inference Protocol's gRPC form maps to), in answers and in requests. A model whose
 * tensors onnxruntime-node cannot build (int4) is refused at load, with the reason.
 */
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { pack, unpack } from 'msgpackr';
import ort from 'onnxruntime-node';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { VoxServer } from '../../transport/server.js';
import { startTestServer } from '../helpers.js';

const require = createRequire(import.meta.url);
const { onnx } = require('onnx-proto') as typeof import('onnx-proto');
const T = onnx.TensorProto.DataType;

/** onnxruntime's dtype name -> ONNX's element type. */
const ELEM: Record<string, number> = {
  float32: T.FLOAT,
  float64: T.DOUBLE,
  float16: T.FLOAT16,
  int8: T.INT8,
  uint8: T.UINT8,
  int16: T.INT16,
  uint16: T.UINT16,
  int32: T.INT32,
  uint32: T.UINT32,
  int64: T.INT64,
  uint64: T.UINT64,
  bool: T.BOOL,
  string: T.STRING,
};

const vi = (name: string, elemType: number) => ({
  name,
  type: { tensorType: { elemType, shape: { dim: [{ dimParam: 'n' }] } } },
});
type Node = { opType: string; input: string[]; output: string[]; attribute?: object[] };
/** An ONNX model (opset 21) of `nodes`, with these inputs and outputs ([n] each). */
function model(nodes: Node[], inputs: [string, number][], outputs: [string, number][]): Uint8Array {
  return onnx.ModelProto.encode({
    irVersion: 10,
    opsetImport: [{ domain: '', version: 21 }],
    graph: {
      name: 'g',
      node: nodes.map((n) => ({ ...n, name: n.output[0] })),
      input: inputs.map(([n, t]) => vi(n, t)),
      output: outputs.map(([n, t]) => vi(n, t)),
    },
  }).finish();
}
const castTo = (to: number) => [{ name: 'to', type: onnx.AttributeProto.AttributeType.INT, i: to }];

const DTYPES = Object.keys(ELEM);
/** One Identity per dtype: x_<dtype> -> y_<dtype>. */
const identity = model(
  DTYPES.map((d) => ({ opType: 'Identity', input: [`x_${d}`], output: [`y_${d}`] })),
  DTYPES.map((d) => [`x_${d}`, ELEM[d]]),
  DTYPES.map((d) => [`y_${d}`, ELEM[d]]),
);
/** q32 = a32 / b32 (float32), q64 = a64 / b64 (float64). */
const divide = model(
  [
    { opType: 'Div', input: ['a32', 'b32'], output: ['q32'] },
    { opType: 'Div', input: ['a64', 'b64'], output: ['q64'] },
  ],
  [
    ['a32', T.FLOAT],
    ['b32', T.FLOAT],
    ['a64', T.DOUBLE],
    ['b64', T.DOUBLE],
  ],
  [
    ['q32', T.FLOAT],
    ['q64', T.DOUBLE],
  ],
);
/** The test's own reference for half precision: f32 -> float16 and float16 -> f32, by onnxruntime's Cast. */
const halfCast = model(
  [
    { opType: 'Cast', input: ['f32'], output: ['half'], attribute: castTo(T.FLOAT16) },
    { opType: 'Cast', input: ['f16'], output: ['back'], attribute: castTo(T.FLOAT) },
  ],
  [
    ['f32', T.FLOAT],
    ['f16', T.FLOAT16],
  ],
  [
    ['half', T.FLOAT16],
    ['back', T.FLOAT],
  ],
);
/** An int4 input (onnxruntime-node loads it but cannot build an int4 tensor). */
const int4 = model(
  [{ opType: 'Cast', input: ['x'], output: ['y'], attribute: castTo(T.FLOAT) }],
  [['x', 22]],
  [['y', T.FLOAT]],
);

const dir = mkdtempSync(join(tmpdir(), 'voxserve-dtypes-'));
const file = (name: string, bytes: Uint8Array): string => {
  writeFileSync(join(dir, name), bytes);
  return join(dir, name);
};

let server: VoxServer;
beforeAll(async () => {
  server = await startTestServer({
    models: [
      { id: 'identity', task: 'tensor', path: file('identity.onnx', identity) },
      { id: 'divide', task: 'tensor', path: file('divide.onnx', divide) },
      { id: 'int4', task: 'tensor', path: file('int4.onnx', int4) },
    ],
  });
});
afterAll(async () => {
  await server?.close();
  rmSync(dir, { recursive: true, force: true });
});

async function post(body: unknown, msgpack = false): Promise<{ status: number; body: Record<string, any> }> {
  const r = await fetch(`${server.url}/v1/tasks/run`, {
    method: 'POST',
    headers: { 'content-type': msgpack ? 'application/msgpack' : 'application/json' },
    body: msgpack ? new Uint8Array(pack(body)) : JSON.stringify(body),
  });
  const bytes = Buffer.from(await r.arrayBuffer());
  const type = r.headers.get('content-type') ?? '';
  return { status: r.status, body: type.includes('msgpack') ? unpack(bytes) : JSON.parse(bytes.toString()) };
}

/** What the docs say JSON carries for each element of an onnxruntime output (written here, not the server's code). */
function jsonOf(t: ort.Tensor, halfValues?: Float32Array): unknown[] {
  if (t.type === 'float16') return Array.from(halfValues!, nonFinite);
  if (t.type === 'bool') return Array.from(t.data as Uint8Array, (v) => v === 1);
  if (t.type === 'int64' || t.type === 'uint64')
    return Array.from(t.data as BigInt64Array, (v) => (v <= 2n ** 53n && v >= -(2n ** 53n) ? Number(v) : v.toString()));
  if (t.type === 'float32' || t.type === 'float64') return Array.from(t.data as Float64Array, nonFinite);
  return Array.from(t.data as ArrayLike<unknown>);
}
const nonFinite = (v: number): number | string =>
  Number.isNaN(v) ? 'NaN' : v === Infinity ? 'Infinity' : v === -Infinity ? '-Infinity' : v;

// float16 values: float32-exact doubles, so that the reference's f32 -> float16 rounds once, as the
// server's double -> float16 does: ties to even (1 + 2^-11 -> 1, 3 x 2^-25 -> 2^-23), subnormals, 65504.
const halves = [0, 1, Math.fround(0.1), 1 + 2 ** -11, 1 + 3 * 2 ** -11, 3 * 2 ** -25, 2 ** -24, 65504, 65519, -2.5];
/** Values of each dtype, as JSON carries them. */
const json: Record<string, unknown[]> = {
  float32: [1.5, -2.25, Math.fround(0.1)],
  float64: [0.1, -1e300, 5e-324],
  float16: halves,
  int8: [-128, 0, 127],
  uint8: [0, 255, 7],
  int16: [-32768, 32767, 1],
  uint16: [0, 65535, 2],
  int32: [-2147483648, 2147483647, 3],
  uint32: [0, 4294967295, 4],
  int64: ['-9223372036854775808', 9007199254740991, 5],
  uint64: ['18446744073709551615', 0, 6],
  bool: [true, false, true],
  string: ['a', 'bé', ''],
};
/** Every input of the identity model ({@link json}'s values), with `over` in place of some. */
const allInputs = (over: Record<string, unknown> = {}) => ({
  ...Object.fromEntries(DTYPES.map((d) => [`x_${d}`, { dtype: d, shape: [json[d].length], data: json[d] }])),
  ...over,
});

describe('every dtype onnxruntime-node takes, in and out', () => {
  /** The same values as onnxruntime tensors (float16 through onnxruntime's own Cast). */
  async function tensors(): Promise<Record<string, ort.Tensor>> {
    const cast = await ort.InferenceSession.create(halfCast);
    const h = await cast.run({
      f32: new ort.Tensor('float32', Float32Array.from(halves), [halves.length]),
      f16: new ort.Tensor('float16', new Uint16Array(1), [1]),
    });
    const feeds: Record<string, ort.Tensor> = {};
    for (const d of DTYPES) {
      const v = json[d];
      const data =
        d === 'float16'
          ? (h.half.data as Uint16Array)
          : d === 'int64'
            ? BigInt64Array.from(v, (x) => BigInt(x as string))
            : d === 'uint64'
              ? BigUint64Array.from(v, (x) => BigInt(x as string))
              : d === 'bool'
                ? Uint8Array.from(v, (x) => (x ? 1 : 0))
                : d === 'string'
                  ? (v as string[])
                  : (v as number[]);
      feeds[`x_${d}`] = new ort.Tensor(d as 'float32', data as unknown as Float32Array, [v.length]);
    }
    return feeds;
  }

  it('JSON: each output as onnxruntime gives it, float16 rounded as its Cast rounds', async () => {
    const feeds = await tensors();
    const want = await (await ort.InferenceSession.create(identity)).run(feeds);
    const cast = await ort.InferenceSession.create(halfCast);
    const halfBack = (
      await cast.run({
        f32: new ort.Tensor('float32', new Float32Array(1), [1]),
        f16: want.y_float16,
      })
    ).back.data as Float32Array;
    const { status, body } = await post({ model: 'identity', inputs: allInputs() });
    expect(status, JSON.stringify(body)).toBe(200);
    for (const d of DTYPES) {
      const out = body.outputs[`y_${d}`];
      expect(out.dtype, d).toBe(d);
      expect(out.shape, d).toEqual(want[`y_${d}`].dims);
      expect(out.data, d).toEqual(jsonOf(want[`y_${d}`], halfBack));
    }
  });

  it('msgpack: raw bytes in and out (float16 as its 16-bit patterns), strings as lists', async () => {
    const feeds = await tensors();
    const want = await (await ort.InferenceSession.create(identity)).run(feeds);
    const inputs = Object.fromEntries(
      Object.entries(feeds).map(([name, t]) => {
        const d = t.data as Uint8Array | string[];
        return [
          name,
          {
            dtype: t.type,
            shape: t.dims,
            data: Array.isArray(d) ? d : Buffer.from(d.buffer, d.byteOffset, d.byteLength),
          },
        ];
      }),
    );
    const { status, body } = await post({ model: 'identity', inputs }, true);
    expect(status, JSON.stringify(body)).toBe(200);
    for (const d of DTYPES) {
      const w = want[`y_${d}`].data as Uint8Array | string[];
      const got = body.outputs[`y_${d}`].data;
      if (Array.isArray(w)) expect(got, d).toEqual(w);
      else expect(Buffer.from(got).equals(Buffer.from(w.buffer, w.byteOffset, w.byteLength)), d).toBe(true);
    }
  });

  it('a float16 value past 65504 by half an ulp is refused, naming the element', async () => {
    const { status, body } = await post({
      model: 'identity',
      inputs: allInputs({ x_float16: { dtype: 'float16', shape: [2], data: [1, 65520] } }),
    });
    expect(status).toBe(400);
    expect(body.error.message).toContain('inputs.x_float16.data[1]');
    expect(body.error.message).toContain('65504');
  });

  it('a string tensor of something else than strings is refused, naming the element', async () => {
    const { status, body } = await post({
      model: 'identity',
      inputs: allInputs({ x_string: { dtype: 'string', shape: [2], data: ['a', 3] } }),
    });
    expect(status).toBe(400);
    expect(body.error.message).toContain('inputs.x_string.data[1]');
  });
});

describe('non-finite floats in JSON are "NaN", "Infinity", "-Infinity"', () => {
  const a = [0, 1, -1, 6];
  const b = [0, 0, 0, 3];
  it('outputs: 0/0, 1/0, -1/0 as strings, other values as numbers (float32 and float64)', async () => {
    const want = await (await ort.InferenceSession.create(divide)).run({
      a32: new ort.Tensor('float32', Float32Array.from(a), [4]),
      b32: new ort.Tensor('float32', Float32Array.from(b), [4]),
      a64: new ort.Tensor('float64', Float64Array.from(a), [4]),
      b64: new ort.Tensor('float64', Float64Array.from(b), [4]),
    });
    const tensor = (dtype: string, data: number[]) => ({ dtype, shape: [4], data });
    const res = await fetch(`${server.url}/v1/tasks/run`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({
        model: 'divide',
        inputs: {
          a32: tensor('float32', a),
          b32: tensor('float32', b),
          a64: tensor('float64', a),
          b64: tensor('float64', b),
        },
      }),
    });
    const text = await res.text();
    expect(res.status).toBe(200);
    const body = JSON.parse(text); // valid JSON: no bare NaN, no null in their place
    for (const q of ['q32', 'q64']) {
      expect(body.outputs[q].data, q).toEqual(jsonOf(want[q]));
      expect(body.outputs[q].data.slice(0, 3), q).toEqual(['NaN', 'Infinity', '-Infinity']);
    }
  });

  it('inputs: the same strings are read as NaN and the infinities (float32, float64, float16)', async () => {
    const data = ['NaN', 'Infinity', '-Infinity', 2];
    const inputs = allInputs(
      Object.fromEntries(['float32', 'float64', 'float16'].map((d) => [`x_${d}`, { dtype: d, shape: [4], data }])),
    );
    const { status, body } = await post({
      model: 'identity',
      inputs,
      outputs: ['y_float32', 'y_float64', 'y_float16'],
    });
    expect(status, JSON.stringify(body)).toBe(200);
    for (const d of ['float32', 'float64', 'float16']) expect(body.outputs[`y_${d}`].data, d).toEqual(data);
    const bad = await post({
      model: 'identity',
      inputs: allInputs({ x_int32: { dtype: 'int32', shape: [1], data: ['NaN'] } }),
    });
    expect(bad.status).toBe(400);
    expect(bad.body.error.message).toContain('inputs.x_int32.data[0]');
  });
});

describe('a model with a dtype onnxruntime-node cannot pass is refused at load, with the reason', () => {
  it('int4: not listed ready; a request is answered load_failed naming the input and the dtype', async () => {
    const { status, body } = await post({ model: 'int4', inputs: { x: { dtype: 'int8', shape: [1], data: [1] } } });
    expect(status).toBe(500);
    expect(body.error.code).toBe('load_failed');
    expect(body.error.message).toContain('input x is int4');
    const info = (await (await fetch(`${server.url}/v1/models/int4`)).json()) as Record<string, unknown>;
    expect(info.loaded).toBe(false);
    expect(String(JSON.stringify(info.last_error))).toContain('int4');
  });
});
