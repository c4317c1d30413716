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
import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest';
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

/** A model of BYTES (string) tensors: `same` = Identity(`text`), `text` a string [3]. */
function stringsModel(): Uint8Array {
  const info = (name: string) => ({
    name,
    type: { tensorType: { elemType: T.STRING, shape: { dim: [{ dimValue: 3 }] } } },
  });
  return onnx.ModelProto.encode({
    irVersion: 7,
    opsetImport: [{ domain: '', version: 13 }],
    graph: {
      name: 'oip-strings',
      node: [{ opType: 'Identity', input: ['text'], output: ['same'], name: 'same' }],
      input: [info('text')],
      output: [info('same')],
    },
  }).finish();
}

/** A model of one FP16 input: `f` (FP32 [4]) = Cast(`h`, FP16 [4]). */
function halfModel(): Uint8Array {
  const info = (name: string, elemType: number) => ({
    name,
    type: { tensorType: { elemType, shape: { dim: [{ dimValue: 4 }] } } },
  });
  return onnx.ModelProto.encode({
    irVersion: 7,
    opsetImport: [{ domain: '', version: 13 }],
    graph: {
      name: 'oip-half',
      node: [
        {
          opType: 'Cast',
          input: ['h'],
          output: ['f'],
          name: 'f',
          attribute: [{ name: 'to', type: onnx.AttributeProto.AttributeType.INT, i: T.FLOAT }],
        },
      ],
      input: [info('h', T.FLOAT16)],
      output: [info('f', T.FLOAT)],
    },
  }).finish();
}

let server: VoxServer;
let dir: string;
beforeAll(async () => {
  dir = mkdtempSync(join(tmpdir(), 'vox-oip-'));
  writeFileSync(join(dir, 'mymodel.onnx'), exampleModel());
  writeFileSync(join(dir, 'strings.onnx'), stringsModel());
  writeFileSync(join(dir, 'half.onnx'), halfModel());
  server = await startTestServer({
    models_root: dir,
    models: [
      { id: 'mymodel', task: 'tensor', path: join(dir, 'mymodel.onnx') },
      { id: 'strings', task: 'tensor', path: join(dir, 'strings.onnx') },
      { id: 'half', task: 'tensor', path: join(dir, 'half.onnx') },
    ],
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
    expect(meta.json).toMatchObject({ name: 'voxserve', extensions: ['binary_tensor_data'] });
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
    expect((await bad.json()).error).toMatch(/^inputs\[0\]\.datatype: must be one of BOOL, UINT8/);
    const vad = await get('/v2/models/silero-vad');
    expect(vad.status).toBe(400);
    expect(vad.json.error).toBe(
      'model silero-vad is a vad model: the Open Inference Protocol (/v2) serves tensor models; send audio to POST /v1/tasks/run',
    );
  });
});

/** `POST /v2/models/{model}/infer` with a JSON body. */
async function inferJson(model: string, request: object): Promise<{ status: number; json: any }> {
  const r = await fetch(`${server.url}/v2/models/${model}/infer`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify(request),
  });
  return { status: r.status, json: await r.json() };
}

/**
 * A body as the binary tensor data extension lays it out (extension_binary_data.md, "Binary Tensor
 * Request"), built here by hand: the JSON request, then each binary input's bytes in `inputs` order;
 * `Inference-Header-Content-Length` is the JSON's length in bytes.
 */
async function inferBinary(
  model: string,
  header: object,
  data: Uint8Array[],
  headers: Record<string, string> = {},
): Promise<{ status: number; headers: Headers; body: Buffer }> {
  const json = Buffer.from(JSON.stringify(header));
  const r = await fetch(`${server.url}/v2/models/${model}/infer`, {
    method: 'POST',
    headers: {
      'content-type': 'application/octet-stream',
      'inference-header-content-length': String(json.length),
      ...headers,
    },
    body: Buffer.concat([json, ...data]),
  });
  return { status: r.status, headers: r.headers, body: Buffer.from(await r.arrayBuffer()) };
}

/** An answer with binary data split as the extension says: the JSON (its length in the header), then the bytes. */
function splitAnswer(a: { headers: Headers; body: Buffer }): { json: any; bytes: Buffer } {
  const n = Number(a.headers.get('inference-header-content-length'));
  expect(Number.isInteger(n) && n > 0).toBe(true);
  return { json: JSON.parse(a.body.subarray(0, n).toString()), bytes: a.body.subarray(n) };
}

/** Little-endian bytes of UINT32 values, written with DataView (not the server's typed arrays). */
function u32le(values: number[]): Uint8Array {
  const b = new Uint8Array(values.length * 4);
  const v = new DataView(b.buffer);
  values.forEach((x, i) => v.setUint32(i * 4, x, true));
  return b;
}

/** BYTES elements as the extension writes them: each a 4-byte little-endian length, then its UTF-8 bytes. */
function bytesElements(values: string[]): Uint8Array {
  return Buffer.concat(
    values.map((s) => {
      const b = Buffer.from(s, 'utf8');
      const n = Buffer.alloc(4);
      new DataView(n.buffer, n.byteOffset).setUint32(0, b.length, true);
      return Buffer.concat([n, b]);
    }),
  );
}

/** Reads BYTES elements back from an answer's bytes (4-byte little-endian length, then UTF-8). */
function readBytesElements(b: Buffer): string[] {
  const out: string[] = [];
  for (let p = 0; p < b.length; ) {
    const n = new DataView(b.buffer, b.byteOffset + p, 4).getUint32(0, true);
    out.push(b.subarray(p + 4, p + 4 + n).toString('utf8'));
    p += 4 + n;
  }
  return out;
}

describe('Open Inference Protocol: binary tensor data extension (issue 43)', () => {
  const jsonInputs = [
    { name: 'input0', shape: [2, 2], datatype: 'UINT32', data: [1, 2, 3, 4] },
    { name: 'input1', shape: [3], datatype: 'BOOL', data: [true, false, true] },
  ];

  it("the extension's own example: inputs as 16 + 3 bytes after the JSON, output0 as 24 bytes, the JSON route's values", async () => {
    const reference = await inferJson('mymodel', { inputs: jsonInputs, outputs: [{ name: 'output0' }] });
    expect(reference.status).toBe(200);
    const a = await inferBinary(
      'mymodel',
      {
        inputs: [
          { name: 'input0', shape: [2, 2], datatype: 'UINT32', parameters: { binary_data_size: 16 } },
          { name: 'input1', shape: [3], datatype: 'BOOL', parameters: { binary_data_size: 3 } },
        ],
        outputs: [{ name: 'output0', parameters: { binary_data: true } }],
      },
      [u32le([1, 2, 3, 4]), Uint8Array.of(1, 0, 1)],
    );
    expect(a.status, a.body.toString()).toBe(200);
    expect(a.headers.get('content-type')).toBe('application/octet-stream');
    expect(Number(a.headers.get('content-length'))).toBe(a.body.length);
    const { json, bytes } = splitAnswer(a);
    expect(json).toEqual({
      model_name: 'mymodel',
      outputs: [{ name: 'output0', shape: [3, 2], datatype: 'FP32', parameters: { binary_data_size: 24 } }],
    });
    expect(bytes.length).toBe(24);
    const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.length);
    const values = Array.from({ length: 6 }, (_, i) => view.getFloat32(i * 4, true));
    expect(values).toEqual(reference.json.outputs[0].data);
    expect(values).toEqual([1, 2, 3, 4, 1, 0]);
  });

  it('binary inputs, JSON answer (no output asks for binary data): the same answer as the JSON route', async () => {
    const reference = await inferJson('mymodel', { id: '7', inputs: jsonInputs });
    const a = await inferBinary(
      'mymodel',
      {
        id: '7',
        inputs: [
          { name: 'input0', shape: [2, 2], datatype: 'UINT32', parameters: { binary_data_size: 16 } },
          { name: 'input1', shape: [3], datatype: 'BOOL', data: [true, false, true] },
        ],
      },
      [u32le([1, 2, 3, 4])],
      // As tritonclient sends it: no Content-Type.
      { 'content-type': '' },
    );
    expect(a.status, a.body.toString()).toBe(200);
    expect(a.headers.get('inference-header-content-length')).toBeNull();
    expect(JSON.parse(a.body.toString())).toEqual(reference.json);
    // And JSON alone, with no Content-Type and no Inference-Header-Content-Length (tritonclient's
    // request when no input is binary).
    const bare = await fetch(`${server.url}/v2/models/mymodel/infer`, {
      method: 'POST',
      body: new Blob([JSON.stringify({ id: '7', inputs: jsonInputs })]),
    });
    expect(bare.status).toBe(200);
    expect(await bare.json()).toEqual(reference.json);
    const text = await fetch(`${server.url}/v2/models/mymodel/infer`, {
      method: 'POST',
      headers: { 'content-type': 'text/plain' },
      body: JSON.stringify({ inputs: jsonInputs }),
    });
    expect(text.status).toBe(415);
    expect((await text.json()).error).toMatch(
      /application\/json, or application\/octet-stream with Inference-Header-Content-Length/,
    );
  });

  it("binary_data_output asks for every output as binary data; an output's binary_data: false overrides it", async () => {
    const all = await inferBinary('mymodel', { parameters: { binary_data_output: true }, inputs: jsonInputs }, []);
    expect(all.status, all.body.toString()).toBe(200);
    const { json, bytes } = splitAnswer(all);
    expect(json.outputs).toEqual([
      { name: 'output0', shape: [3, 2], datatype: 'FP32', parameters: { binary_data_size: 24 } },
    ]);
    expect(Array.from(new Float32Array(new Uint8Array(bytes).buffer))).toEqual([1, 2, 3, 4, 1, 0]);
    const off = await inferJson('mymodel', {
      parameters: { binary_data_output: true },
      inputs: jsonInputs,
      outputs: [{ name: 'output0', parameters: { binary_data: false } }],
    });
    expect(off.json.outputs).toEqual([{ name: 'output0', shape: [3, 2], datatype: 'FP32', data: [1, 2, 3, 4, 1, 0] }]);
  });

  it('BYTES tensors: each element a 4-byte little-endian length then UTF-8, in and out; JSON BYTES the same', async () => {
    const text = ['a', 'bé', ''];
    const reference = await inferJson('strings', {
      inputs: [{ name: 'text', shape: [3], datatype: 'BYTES', data: text }],
    });
    expect(reference).toEqual({
      status: 200,
      json: { model_name: 'strings', outputs: [{ name: 'same', shape: [3], datatype: 'BYTES', data: text }] },
    });
    const elements = bytesElements(text);
    expect(elements.length).toBe(4 + 1 + 4 + 3 + 4);
    const a = await inferBinary(
      'strings',
      {
        inputs: [{ name: 'text', shape: [3], datatype: 'BYTES', parameters: { binary_data_size: elements.length } }],
        outputs: [{ name: 'same', parameters: { binary_data: true } }],
      },
      [elements],
    );
    expect(a.status, a.body.toString()).toBe(200);
    const { json, bytes } = splitAnswer(a);
    expect(json.outputs).toEqual([
      { name: 'same', shape: [3], datatype: 'BYTES', parameters: { binary_data_size: elements.length } },
    ]);
    expect(readBytesElements(bytes)).toEqual(text);
    const notText = Buffer.concat([Buffer.from([1, 0, 0, 0, 0xff]), bytesElements(['x', 'y'])]);
    const bad = await inferBinary(
      'strings',
      { inputs: [{ name: 'text', shape: [3], datatype: 'BYTES', parameters: { binary_data_size: notText.length } }] },
      [notText],
    );
    expect(bad.status).toBe(400);
    expect(JSON.parse(bad.body.toString())).toEqual({
      error: "inputs[0] (binary data): BYTES element 0 is not UTF-8 text; voxserve's string tensors hold text only",
    });
  });

  it('FP16 inputs go as binary data, the exact half-precision bits; as JSON numbers they are refused', async () => {
    // IEEE 754 binary16: 0x3c00 = 1, 0xc000 = -2, 0x3800 = 0.5, 0x7bff = 65504 (the largest finite).
    const bits = Buffer.alloc(8);
    [0x3c00, 0xc000, 0x3800, 0x7bff].forEach((b, i) => bits.writeUInt16LE(b, i * 2));
    const a = await inferBinary(
      'half',
      { inputs: [{ name: 'h', shape: [4], datatype: 'FP16', parameters: { binary_data_size: 8 } }] },
      [bits],
    );
    expect(a.status, a.body.toString()).toBe(200);
    expect(JSON.parse(a.body.toString()).outputs).toEqual([
      { name: 'f', shape: [4], datatype: 'FP32', data: [1, -2, 0.5, 65504] },
    ]);
    const json = await inferJson('half', {
      inputs: [{ name: 'h', shape: [4], datatype: 'FP16', data: [1, -2, 0.5, 1] }],
    });
    expect(json.status).toBe(400);
    expect(json.json.error).toMatch(
      /^inputs\[0\]\.datatype: must be one of .* \(FP16 as binary data only\), got "FP16"$/,
    );
  });

  it('binary data that does not add up is a 400 naming the input or the header', async () => {
    const header = (size0: number) => ({
      inputs: [
        { name: 'input0', shape: [2, 2], datatype: 'UINT32', parameters: { binary_data_size: size0 } },
        { name: 'input1', shape: [3], datatype: 'BOOL', parameters: { binary_data_size: 3 } },
      ],
    });
    const short = await inferBinary('mymodel', header(12), [u32le([1, 2, 3]), Uint8Array.of(1, 0, 1)]);
    expect(short.status).toBe(400);
    expect(JSON.parse(short.body.toString()).error).toBe(
      'inputs[0].parameters.binary_data_size: 12 bytes, but UINT32 [2, 2] is 16 (4 elements of 4 bytes, little-endian)',
    );
    const missing = await inferBinary('mymodel', header(16), [u32le([1, 2, 3, 4])]);
    expect(JSON.parse(missing.body.toString()).error).toBe(
      'inputs[1].parameters.binary_data_size: 3 bytes from byte 16 of the binary data, but only 16 follow the JSON',
    );
    const extra = await inferBinary('mymodel', header(16), [u32le([1, 2, 3, 4]), Uint8Array.of(1, 0, 1, 9)]);
    expect(JSON.parse(extra.body.toString()).error).toMatch(
      /^inputs: the inputs' binary_data_size add up to 19 bytes, but 20/,
    );
    const notBool = await inferBinary('mymodel', header(16), [u32le([1, 2, 3, 4]), Uint8Array.of(1, 2, 1)]);
    expect(JSON.parse(notBool.body.toString()).error).toBe(
      'inputs[1] (binary data): BOOL element 1 is byte 2; must be 0 or 1',
    );
    const noHeader = await inferJson('mymodel', header(16));
    expect(noHeader.status).toBe(400);
    expect(noHeader.json.error).toMatch(
      /^inputs\[0\]\.parameters\.binary_data_size: binary data needs the Inference-Header-Content-Length header/,
    );
    const past = await fetch(`${server.url}/v2/models/mymodel/infer`, {
      method: 'POST',
      headers: { 'content-type': 'application/octet-stream', 'inference-header-content-length': '999' },
      body: '{}',
    });
    expect(past.status).toBe(400);
    expect(await past.json()).toEqual({ error: 'Inference-Header-Content-Length: 999 bytes, but the body has 2' });
    // The extension's raw binary request (no JSON header) is not taken: said so.
    const raw = await fetch(`${server.url}/v2/models/mymodel/infer`, {
      method: 'POST',
      headers: { 'content-type': 'application/octet-stream', 'inference-header-content-length': '0' },
      body: Buffer.concat([u32le([1, 2, 3, 4]), Uint8Array.of(1, 0, 1)]),
    });
    expect(raw.status).toBe(400);
    expect((await raw.json()).error).toMatch(
      /^Inference-Header-Content-Length: 0 \(a raw binary request, with no JSON header\) is not supported/,
    );
  });
});

describe('Open Inference Protocol: a binary input with a shape of more than 32 dimensions', () => {
  it('is refused for its shape, not with every dimension written out (a 2 MB shape answered 3 MB)', async () => {
    const shape = new Array(100_000).fill(1);
    const a = await inferBinary(
      'mymodel',
      { inputs: [{ name: 'input0', shape, datatype: 'UINT32', parameters: { binary_data_size: 8 } }] },
      [u32le([1, 2])],
    );
    expect(a.status).toBe(400);
    expect(a.body.length).toBeLessThan(1000);
    expect(JSON.parse(a.body.toString()).error).toMatch(/^inputs\.input0\.shape: must be a list of at most 32 /);
  });
});

describe('Open Inference Protocol: an input named __proto__', () => {
  it("is an input the model does not have, named so (it was taken as the inputs object's prototype and lost)", async () => {
    const a = await inferJson('mymodel', {
      inputs: [
        { name: 'input0', shape: [2, 2], datatype: 'UINT32', data: [1, 2, 3, 4] },
        { name: 'input1', shape: [3], datatype: 'BOOL', data: [true, false, true] },
        { name: '__proto__', shape: [1], datatype: 'FP32', data: [0] },
      ],
    });
    expect(a.status).toBe(400);
    expect(a.json.error).toMatch(/^inputs\.__proto__: model mymodel has no such input/);
  });
});

describe('Open Inference Protocol: a large JSON part before binary data is parsed off the event loop', () => {
  it('1 MiB of JSON (a long id) with Inference-Header-Content-Length: no JSON.parse of it on the main thread, id echoed', async () => {
    // The server runs in this process: a JSON.parse of the request's JSON here is one on its event loop. (A 60 MB
    // JSON part with the header held /health 6 s, against 1.7 s for the same body without it.)
    const id = 'x'.repeat(1024 * 1024);
    const parse = vi.spyOn(JSON, 'parse');
    let a: Awaited<ReturnType<typeof inferBinary>>;
    let calls: unknown[][];
    try {
      a = await inferBinary(
        'mymodel',
        {
          id,
          inputs: [
            { name: 'input0', shape: [2, 2], datatype: 'UINT32', parameters: { binary_data_size: 16 } },
            { name: 'input1', shape: [3], datatype: 'BOOL', parameters: { binary_data_size: 3 } },
          ],
        },
        [u32le([1, 2, 3, 4]), Uint8Array.of(1, 0, 1)],
      );
    } finally {
      calls = [...parse.mock.calls]; // (mockRestore clears them)
      parse.mockRestore();
    }
    const onMain = calls.filter(([text]) => typeof text === 'string' && text.length >= id.length);
    expect(onMain.length).toBe(0);
    expect(a.status).toBe(200);
    const answer = JSON.parse(a.body.toString());
    expect(answer.id === id).toBe(true);
    expect(answer.outputs).toEqual([{ name: 'output0', shape: [3, 2], datatype: 'FP32', data: [1, 2, 3, 4, 1, 0] }]);
  });
});

describe('Open Inference Protocol: many empty BYTES elements are not free (limits.max_tensor_bytes)', () => {
  // One more empty element than limits.max_tensor_bytes (16 MiB, the default) holds at 4 bytes each: the
  // extension's layout gives each element a 4-byte length, so 4 Mi + 1 empty strings are 16 MiB + 4 bytes.
  const n = (16 * 1024 * 1024) / 4 + 1;

  it('as binary data: a 413 before its elements are read (a 90 MB body of them blocked the event loop for 24 s)', async () => {
    const zeros = Buffer.alloc(n * 4);
    const a = await inferBinary(
      'strings',
      { inputs: [{ name: 'text', shape: [n], datatype: 'BYTES', parameters: { binary_data_size: zeros.length } }] },
      [zeros],
    );
    expect(a.status, a.body.toString().slice(0, 200)).toBe(413);
    expect(JSON.parse(a.body.toString())).toEqual({
      error: 'tensor inputs exceed limits.max_tensor_bytes (16777216)',
    });
  });

  it('as JSON strings: counted the same, each its UTF-8 bytes and 4', async () => {
    const a = await inferJson('strings', {
      inputs: [{ name: 'text', shape: [n], datatype: 'BYTES', data: new Array(n).fill('') }],
    });
    expect(a.status).toBe(413);
    expect(a.json).toEqual({ error: 'tensor inputs exceed limits.max_tensor_bytes (16777216)' });
  });
});

describe('Open Inference Protocol: errors in the protocol\'s shape, {"error": "<message>"} (issue 43)', () => {
  it('an unknown model is a 404 on every model route; an unknown /v2 route a 404; a bad field a 400 naming it', async () => {
    for (const [method, path] of [
      ['GET', '/v2/models/nope'],
      ['GET', '/v2/models/nope/ready'],
      ['POST', '/v2/models/nope/infer'],
    ]) {
      const r = await fetch(`${server.url}${path}`, {
        method,
        headers: { 'content-type': 'application/json' },
        body:
          method === 'POST'
            ? JSON.stringify({ inputs: [{ name: 'x', shape: [1], datatype: 'FP32', data: [1] }] })
            : undefined,
      });
      expect(r.status, path).toBe(404);
      const body = await r.json();
      expect(Object.keys(body), path).toEqual(['error']);
      expect(body.error, path).toMatch(/^model 'nope' does not exist/);
    }
    const route = await get('/v2/repository/index');
    expect(route).toEqual({ status: 404, json: { error: 'no route GET /v2/repository/index' } });
    const output = await inferJson('mymodel', { inputs: jsonInputsOf(), outputs: [{ name: 'output9' }] });
    expect(output.status).toBe(400);
    expect(output.json).toEqual({
      error: "outputs: 'output9' is not an output of model mymodel; its outputs: output0 (float32 [3, 2])",
    });
    const shape = await inferJson('mymodel', {
      inputs: [jsonInputsOf()[0], { name: 'input1', shape: [2], datatype: 'BOOL', data: [true, false] }],
    });
    expect(shape.status).toBe(400);
    expect(shape.json.error).toMatch(/^inputs\.input1\.shape: dimension 0 must be 3/);
    const param = await inferJson('mymodel', {
      inputs: jsonInputsOf(),
      outputs: [{ name: 'output0', parameters: { classification: 2 } }],
    });
    expect(param).toEqual({
      status: 400,
      json: { error: 'outputs[0].parameters.classification: not supported; the parameters taken here: binary_data' },
    });
    // Outside /v2, voxserve's own shape stays.
    const v1 = await fetch(`${server.url}/v1/models/nope`);
    expect((await v1.json()).error).toMatchObject({ type: 'not_found' });
  });
});

/** The protocol example's inputs as JSON. */
function jsonInputsOf() {
  return [
    { name: 'input0', shape: [2, 2], datatype: 'UINT32', data: [1, 2, 3, 4] },
    { name: 'input1', shape: [3], datatype: 'BOOL', data: [true, false, true] },
  ];
}
