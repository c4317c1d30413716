/**
 * Issue 43 (e): the Open Inference Protocol (KServe v2 REST) for tensor models, checked against
 * the protocol's own example (specification/protocol/inference_rest.md, "Inference Request
 * Examples": model `mymodel`, inputs `input0` UINT32 [2, 2] and `input1` BOOL [3], output
 * `output0` FP32 [3, 2], request id "42"), on a model built here with that signature.
 */
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { VoxServer } from '../../transport/server.js';
import { startTestServer } from '../helpers.js';

const require = createRequire(import.meta.url);
const { onnx } = require('onnx-proto') as typeof import('onnx-proto');
const T = onnx.TensorProto.DataType;

/**
 * The example's model: output0 = the first 6 of [input0 as floats (4), input1 as 0/1 (3)], as
 * [3, 2]: so the answer shows each input arrived, in order.
 */
function exampleModel(): Uint8Array {
  const info = (name: string, elemType: number, dims: number[]) => ({
    name,
    type: { tensorType: { elemType, shape: { dim: dims.map((d) => ({ dimValue: d })) } } },
  });
  const i64 = (name: string, values: number[]) => ({
    name,
    dims: [values.length],
    dataType: T.INT64,
    rawData: new Uint8Array(BigInt64Array.from(values.map(BigInt)).buffer),
  });
  const node = (opType: string, input: string[], output: string[], attribute: object[] = []) => ({
    opType,
    input,
    output,
    attribute,
    name: output[0],
  });
  const to = (t: number) => [{ name: 'to', type: onnx.AttributeProto.AttributeType.INT, i: t }];
  return onnx.ModelProto.encode({
    irVersion: 7,
    opsetImport: [{ domain: '', version: 13 }],
    graph: {
      name: 'oip-example',
      node: [
        node('Cast', ['input0'], ['a2'], to(T.FLOAT)),
        node('Reshape', ['a2', 'flat'], ['a']),
        node('Cast', ['input1'], ['b'], to(T.FLOAT)),
        node('Concat', ['a', 'b'], ['c'], [{ name: 'axis', type: onnx.AttributeProto.AttributeType.INT, i: 0 }]),
        node('Slice', ['c', 'starts', 'ends'], ['d']),
        node('Reshape', ['d', 'shape'], ['output0']),
      ],
      initializer: [i64('flat', [-1]), i64('starts', [0]), i64('ends', [6]), i64('shape', [3, 2])],
      input: [info('input0', T.UINT32, [2, 2]), info('input1', T.BOOL, [3])],
      output: [info('output0', T.FLOAT, [3, 2])],
    },
  }).finish();
}

let server: VoxServer;
let dir: string;
beforeAll(async () => {
  dir = mkdtempSync(join(tmpdir(), 'vox-oip-'));
  writeFileSync(join(dir, 'mymodel.onnx'), exampleModel());
  server = await startTestServer({
    models_root: dir,
    models: [{ id: 'mymodel', task: 'tensor', path: join(dir, 'mymodel.onnx') }],
  });
});
afterAll(async () => {
  await server?.close();
  rmSync(dir, { recursive: true, force: true });
});

const get = async (path: string) => {
  const r = await fetch(`${server.url}${path}`);
  return { status: r.status, json: await r.json() };
};

describe('Open Inference Protocol (KServe v2 REST, issue 43)', () => {
  it("the protocol's inference example: the request as the specification writes it, the answer in its shape", async () => {
    const r = await fetch(`${server.url}/v2/models/mymodel/infer`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      // The specification's request; its input1 has shape [3] but one value ([true]): three are given here.
      body: JSON.stringify({
        id: '42',
        inputs: [
          { name: 'input0', shape: [2, 2], datatype: 'UINT32', data: [1, 2, 3, 4] },
          { name: 'input1', shape: [3], datatype: 'BOOL', data: [true, false, true] },
        ],
        outputs: [{ name: 'output0' }],
      }),
    });
    expect(r.status).toBe(200);
    expect(await r.json()).toEqual({
      model_name: 'mymodel',
      id: '42',
      outputs: [{ name: 'output0', shape: [3, 2], datatype: 'FP32', data: [1, 2, 3, 4, 1, 0] }],
    });
  });

  it('health, server and model metadata, model readiness', async () => {
    expect(await get('/v2/health/live')).toEqual({ status: 200, json: { live: true } });
    expect(await get('/v2/health/ready')).toEqual({ status: 200, json: { ready: true } });
    const meta = await get('/v2');
    expect(meta.status).toBe(200);
    expect(meta.json).toMatchObject({ name: 'voxserve', extensions: [] });
    expect(await get('/v2/models/mymodel')).toEqual({
      status: 200,
      json: {
        name: 'mymodel',
        platform: 'onnxruntime_onnx',
        inputs: [
          { name: 'input0', datatype: 'UINT32', shape: [2, 2] },
          { name: 'input1', datatype: 'BOOL', shape: [3] },
        ],
        outputs: [{ name: 'output0', datatype: 'FP32', shape: [3, 2] }],
      },
    });
    expect(await get('/v2/models/mymodel/ready')).toEqual({ status: 200, json: { name: 'mymodel', ready: true } });
  });

  it('a bad request names the field; an audio model is refused with where to send audio', async () => {
    const bad = await fetch(`${server.url}/v2/models/mymodel/infer`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ inputs: [{ name: 'input0', shape: [2, 2], datatype: 'UINT128', data: [1, 2, 3, 4] }] }),
    });
    expect(bad.status).toBe(400);
    expect((await bad.json()).error.message).toMatch(/^inputs\[0\]\.datatype: must be one of BOOL, UINT8/);
    const vad = await get('/v2/models/silero-vad');
    expect(vad.status).toBe(400);
    expect(vad.json.error.message).toBe(
      'model silero-vad is a vad model: the Open Inference Protocol (/v2) serves tensor models; send audio to POST /v1/tasks/run',
    );
  });
});
