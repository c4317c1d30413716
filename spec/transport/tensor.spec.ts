/**
 * The generic `tensor` task (issue 22): any ONNX model served as it is on `POST /v1/tasks/run`,
 * named tensors in and out, in JSON and in msgpack (binary data). Expected outputs come from
 * onnxruntime-node run here, in the test, on the same inputs (to 1e-6); bad requests are 400s
 * naming the input and what the model expects; a 50 MB input is refused by the body limit.
 */
import { request } from 'node:http';
import { pack, unpack } from 'msgpackr';
import ort from 'onnxruntime-node';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { OWW_MELSPECTROGRAM, SILERO_V6 } from '../../runtime/catalog.js';
import type { VoxServer } from '../../transport/server.js';
import { fixture, startTestServer, WaveFile } from '../helpers.js';

let server: VoxServer;
beforeAll(async () => {
  server = await startTestServer({
    models: [
      { id: 'mel', task: 'tensor', path: OWW_MELSPECTROGRAM },
      { id: 'vad-tensor', task: 'tensor', path: SILERO_V6 },
      // The same model in a worker thread: its tensors cross by structured clone, not frames.
      { id: 'vad-tensor-thread', task: 'tensor', path: SILERO_V6, isolation: 'thread' },
    ],
  });
});
afterAll(async () => {
  await server?.close();
});

type Outputs = Record<string, { dtype: string; shape: number[]; data: number[] | Uint8Array }>;

/** POSTs a JSON body to /v1/tasks/run. */
async function runJson(body: unknown): Promise<{ status: number; json: Record<string, unknown> }> {
  const r = await fetch(`${server.url}/v1/tasks/run`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify(body),
  });
  return { status: r.status, json: (await r.json()) as Record<string, unknown> };
}

/** POSTs a msgpack body to /v1/tasks/run; the answer decoded (msgpack, or JSON for an error). */
async function runMsgpack(body: unknown): Promise<{ status: number; type: string; value: Record<string, unknown> }> {
  const r = await fetch(`${server.url}/v1/tasks/run`, {
    method: 'POST',
    headers: { 'content-type': 'application/msgpack' },
    body: new Uint8Array(pack(body)),
  });
  const type = r.headers.get('content-type') ?? '';
  const bytes = Buffer.from(await r.arrayBuffer());
  return {
    status: r.status,
    type,
    value: (type === 'application/msgpack' ? unpack(bytes) : JSON.parse(bytes.toString())) as Record<string, unknown>,
  };
}

/** Little-endian bytes of a typed array (what a msgpack client sends as `bin`). */
const raw = (a: Float32Array | BigInt64Array): Buffer => Buffer.from(a.buffer, a.byteOffset, a.byteLength);

/** The largest difference between two arrays of numbers of the same length. */
function worst(got: ArrayLike<number>, want: ArrayLike<number>): number {
  expect(got.length).toBe(want.length);
  let w = 0;
  for (let i = 0; i < want.length; i++) w = Math.max(w, Math.abs(got[i] - want[i]));
  return w;
}

/** 1 s of the "alexa" fixture at int16 scale, as openWakeWord feeds its melspectrogram model. */
const audio = Float32Array.from(
  (new WaveFile(fixture('espeak_alexa_16k.wav')).getSamples(false, Int16Array) as unknown as Int16Array).subarray(
    8000,
    24_000,
  ),
);

/** Silero VAD's inputs for one window of the fixture: 64 samples of context + 512, a state, the rate. */
const window = Float32Array.from(audio.subarray(4000, 4576), (v) => v / 32768);
const state = Float32Array.from({ length: 256 }, (_, i) => Math.sin(i) / 10);
const sileroInputs = {
  input: new ort.Tensor('float32', window, [1, 576]),
  state: new ort.Tensor('float32', state, [2, 1, 128]),
  sr: new ort.Tensor('int64', BigInt64Array.from([16000n]), []),
};

describe('tensor models give what onnxruntime gives, run directly in the test', () => {
  it("openWakeWord's melspectrogram: JSON in and out, every output value to 1e-6", async () => {
    const session = await ort.InferenceSession.create(OWW_MELSPECTROGRAM);
    const want = (await session.run({ input: new ort.Tensor('float32', audio, [1, audio.length]) })).output;
    const { status, json } = await runJson({
      model: 'mel',
      inputs: { input: { dtype: 'float32', shape: [1, audio.length], data: Array.from(audio) } },
    });
    expect(status).toBe(200);
    expect(json.task).toBe('tensor');
    expect(Object.keys(json.timing as object).sort()).toEqual(['inference_ms', 'queue_ms', 'wall_ms']);
    const out = (json.outputs as Outputs).output;
    expect(out.dtype).toBe('float32');
    expect(out.shape).toEqual(want.dims);
    expect(worst(out.data as number[], want.data as Float32Array)).toBeLessThanOrEqual(1e-6);
  });

  it("openWakeWord's melspectrogram: msgpack with binary data in and out", async () => {
    const session = await ort.InferenceSession.create(OWW_MELSPECTROGRAM);
    const want = (await session.run({ input: new ort.Tensor('float32', audio, [1, audio.length]) })).output;
    const { status, type, value } = await runMsgpack({
      model: 'mel',
      inputs: { input: { dtype: 'float32', shape: [1, audio.length], data: raw(audio) } },
    });
    expect(status).toBe(200);
    expect(type).toBe('application/msgpack');
    const out = (value.outputs as Outputs).output;
    expect(out.shape).toEqual(want.dims);
    const bytes = out.data as Uint8Array;
    const got = new Float32Array(bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength));
    expect(worst(got, want.data as Float32Array)).toBeLessThanOrEqual(1e-6);
  });

  for (const model of ['vad-tensor', 'vad-tensor-thread'])
    it(`Silero VAD (${model}): an int64 scalar and a state, both outputs, and one output by name`, async () => {
      const session = await ort.InferenceSession.create(SILERO_V6);
      const want = await session.run(sileroInputs);
      const inputs = {
        input: { dtype: 'float32', shape: [1, 576], data: Array.from(window) },
        state: { dtype: 'float32', shape: [2, 1, 128], data: Array.from(state) },
        sr: { dtype: 'int64', shape: [], data: [16000] },
      };
      const { status, json } = await runJson({ model, inputs });
      expect(status).toBe(200);
      const out = json.outputs as Outputs;
      expect(Object.keys(out).sort()).toEqual(['output', 'stateN']);
      for (const name of ['output', 'stateN']) {
        expect(out[name].shape, name).toEqual(want[name].dims);
        expect(worst(out[name].data as number[], want[name].data as Float32Array), name).toBeLessThanOrEqual(1e-6);
      }
      // msgpack, the int64 scalar as raw bytes, and only `output` asked for.
      const one = await runMsgpack({
        model,
        outputs: ['output'],
        inputs: {
          input: { dtype: 'float32', shape: [1, 576], data: raw(window) },
          state: { dtype: 'float32', shape: [2, 1, 128], data: raw(state) },
          sr: { dtype: 'int64', shape: [], data: raw(BigInt64Array.from([16000n])) },
        },
      });
      expect(one.status).toBe(200);
      const o = one.value.outputs as Outputs;
      expect(Object.keys(o)).toEqual(['output']);
      const b = o.output.data as Uint8Array;
      expect(new Float32Array(b.buffer.slice(b.byteOffset, b.byteOffset + 4))[0]).toBeCloseTo(
        (want.output.data as Float32Array)[0],
        6,
      );
    });
});

describe('a request the model cannot take is a 400 naming the input and what the model expects', () => {
  const good = {
    input: { dtype: 'float32', shape: [1, 576], data: Array.from(window) },
    state: { dtype: 'float32', shape: [2, 1, 128], data: Array.from(state) },
    sr: { dtype: 'int64', shape: [], data: [16000] },
  };
  const expect400 = async (body: unknown, code: string, ...parts: string[]): Promise<void> => {
    const { status, json } = await runJson(body);
    expect(status).toBe(400);
    const error = json.error as { code: string; message: string };
    expect(error.code).toBe(code);
    for (const p of parts) expect(error.message).toContain(p);
  };

  it('wrong dtype', () =>
    expect400(
      { model: 'vad-tensor', inputs: { ...good, sr: { dtype: 'int32', shape: [], data: [16000] } } },
      'invalid_tensor',
      'inputs.sr.dtype',
      'expected int64, got int32',
    ));

  it('wrong rank, and a fixed dimension of the wrong size', async () => {
    await expect400(
      { model: 'vad-tensor', inputs: { ...good, input: { dtype: 'float32', shape: [576], data: Array.from(window) } } },
      'invalid_tensor',
      'inputs.input.shape',
      'expected rank 2',
      'got rank 1 [576]',
    );
    await expect400(
      {
        model: 'vad-tensor',
        inputs: { ...good, state: { dtype: 'float32', shape: [2, 2, 64], data: Array.from(state) } },
      },
      'invalid_tensor',
      'inputs.state.shape',
      'dimension 2 must be 128',
    );
  });

  it('a missing input, and one the model does not have', async () => {
    const { sr: _, ...noRate } = good;
    await expect400({ model: 'vad-tensor', inputs: noRate }, 'invalid_tensor', 'inputs.sr: missing', 'sr (int64 [])');
    await expect400(
      { model: 'vad-tensor', inputs: { ...good, extra: { dtype: 'float32', shape: [1], data: [0] } } },
      'invalid_tensor',
      'inputs.extra',
      'no such input',
    );
  });

  it("an input named __proto__ is one the model does not have (it answered a 500 'Cannot read properties of undefined')", async () => {
    // JSON.parse makes `__proto__` an own key, as any JSON body does; an object literal would set the prototype.
    const inputs = { ...good, ...JSON.parse('{"__proto__": {"dtype": "float32", "shape": [1], "data": [0]}}') };
    expect(Object.keys(inputs)).toContain('__proto__');
    await expect400({ model: 'vad-tensor', inputs }, 'invalid_tensor', 'inputs.__proto__', 'no such input');
  });

  it('an unknown output', () =>
    expect400(
      { model: 'vad-tensor', inputs: good, outputs: ['output', 'probability'] },
      'unknown_output',
      "'probability' is not an output of model vad-tensor",
      'output (float32',
    ));

  it('data that does not fit the shape, and values that are not of the dtype', async () => {
    await expect400(
      { model: 'vad-tensor', inputs: { ...good, input: { dtype: 'float32', shape: [1, 576], data: [1, 2] } } },
      'invalid_tensor',
      'inputs.input.data: 2 values, but shape [1, 576] needs 576',
    );
    await expect400(
      { model: 'vad-tensor', inputs: { ...good, sr: { dtype: 'int64', shape: [], data: [1.5] } } },
      'invalid_tensor',
      'inputs.sr.data[0]',
      'an integer (int64)',
    );
    const short = await runMsgpack({
      model: 'vad-tensor',
      inputs: { ...good, input: { dtype: 'float32', shape: [1, 576], data: Buffer.alloc(10) } },
    });
    expect(short.status).toBe(400);
    expect((short.value.error as { message: string }).message).toContain('10 bytes, but float32 [1, 576] needs 2304');
  });

  it('audio to a tensor model, and tensors to a VAD model, say which task the model has', async () => {
    const r = await fetch(`${server.url}/v1/tasks/run?model=mel`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: new Uint8Array(fixture('espeak_alexa_16k.wav')),
    });
    expect(r.status).toBe(400);
    expect(((await r.json()) as { error: { code: string } }).error.code).toBe('wrong_task');
    await expect400({ model: 'silero-vad', inputs: good }, 'wrong_task', 'model silero-vad is a vad model');
  });
});

describe('limits and bookkeeping', () => {
  it('a 50 MB input is refused by the body limit (413) before the model sees it', async () => {
    // msgpack, as a client that waits for `100 Continue` sends it: refused by its Content-Length, nothing uploaded.
    const big = pack({
      model: 'mel',
      inputs: { input: { dtype: 'float32', shape: [1, 12_500_000], data: Buffer.alloc(50_000_000) } },
    });
    const { status, body } = await new Promise<{ status: number; body: string }>((resolve, reject) => {
      const req = request(`${server.url}/v1/tasks/run`, {
        method: 'POST',
        headers: { 'content-type': 'application/msgpack', 'content-length': big.length, expect: '100-continue' },
      });
      req.on('continue', () => req.end(big));
      req.on('response', (res) => {
        let text = '';
        res.on('data', (d: Buffer) => (text += d));
        res.on('end', () => resolve({ status: res.statusCode ?? 0, body: text }));
      });
      req.on('error', reject);
      req.flushHeaders();
    });
    expect(status).toBe(413);
    const error = (JSON.parse(body) as { error: { code: string; message: string } }).error;
    expect(error.code).toBe('tensor_too_large');
    expect(error.message).toContain('limits.max_tensor_bytes (16777216)');
    // As JSON too: 18 MB of float32 zeros (a 9 MB body, under limits.max_body_bytes).
    const n = 4_500_000;
    const j = await runJson({
      model: 'mel',
      inputs: { input: { dtype: 'float32', shape: [1, n], data: new Array(n).fill(0) } },
    });
    expect(j.status).toBe(413);
    expect((j.json.error as { code: string }).code).toBe('tensor_too_large');
  });

  it('a tensor model is a model like the others: listed, resident in its slot host, counted in the metrics', async () => {
    const m = (await (await fetch(`${server.url}/v1/models/mel`)).json()) as Record<string, unknown>;
    expect(m).toMatchObject({ id: 'mel', task: 'tensor', state: 'ready', loaded: true, active_leases: 0 });
    expect(m.resident_bytes as number).toBeGreaterThan(0);
    const metrics = await (await fetch(`${server.url}/metrics`)).text();
    expect(metrics).toMatch(/voxserve_requests_total\{model="mel",outcome="ok"\} [1-9]/);
    expect(metrics).toMatch(/voxserve_inference_duration_seconds_count\{model="mel"\} [1-9]/);
  });
});
