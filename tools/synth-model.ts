/**
 * Writes synthetic ONNX models for tests and benchmarks: a weight initializer of a chosen size
 * (MiB) and a chosen run time (ms per window), with Silero VAD v5's signature so voxserve serves
 * them as `task: "vad"` (inputs `input` [1, n], `state` [2, 1, 128], `sr` int64; outputs
 * `output` [1, 1] ~ 0, i.e. never speech, and `stateN` = `state`).
 *
 * The model is built with protobufjs through the ONNX schema (`onnx-proto`), not by hand-encoding
 * bytes. The weights are read by a Gather whose index is computed from the input, so
 * onnxruntime can neither constant-fold nor drop them; run time comes from a chain of
 * 256 x 256 MatMuls by the identity, started from a value that depends on the input.
 *
 *   node dist/tools/synth-model.js --out /tmp/m200.onnx --size-mib 200 --run-ms 20
 */
import { writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { parseArgs } from 'node:util';

const require = createRequire(import.meta.url);
const { onnx } = require('onnx-proto') as typeof import('onnx-proto');

const FLOAT = onnx.TensorProto.DataType.FLOAT;
const INT64 = onnx.TensorProto.DataType.INT64;
const N = 256;

type Dim = number | string;
const valueInfo = (name: string, elemType: number, dims: Dim[]): import('onnx-proto').onnx.IValueInfoProto => ({
  name,
  type: {
    tensorType: {
      elemType,
      shape: { dim: dims.map((d) => (typeof d === 'number' ? { dimValue: d } : { dimParam: d })) },
    },
  },
});
const node = (
  opType: string,
  input: string[],
  output: string[],
  attribute: import('onnx-proto').onnx.IAttributeProto[] = [],
) => ({ opType, input, output, attribute, name: output[0] });
const intsAttr = (name: string, ints: number[]) => ({ name, type: onnx.AttributeProto.AttributeType.INTS, ints });
const intAttr = (name: string, i: number) => ({ name, type: onnx.AttributeProto.AttributeType.INT, i });

/**
 * Encodes a synthetic model.
 * @param sizeMiB size of the weight initializer, MiB (the file is that size plus 256 KiB).
 * @param matmuls 256 x 256 MatMuls per run (the run time; see {@link calibrate}).
 * @returns the ONNX file bytes.
 */
export function syntheticModel(sizeMiB: number, matmuls: number): Uint8Array {
  const weights = new Float32Array(Math.max(1, Math.round((sizeMiB * 1024 * 1024) / 4)));
  for (let i = 0; i < weights.length; i += 1024) weights[i] = 1; // not all zeros
  const identity = new Float32Array(N * N);
  for (let i = 0; i < N; i++) identity[i * N + i] = 1;
  const nodes = [
    // zero = mean(input) * 0, computed at run time
    node('ReduceMean', ['input'], ['mean'], [intsAttr('axes', [1]), intAttr('keepdims', 1)]),
    node('Mul', ['mean', 'c_zero'], ['zero']),
    // one element of the weights, at an index computed from the input
    node('Cast', ['zero'], ['zero_i'], [intAttr('to', INT64)]),
    node('Reshape', ['zero_i', 'c_shape1'], ['index']),
    node('Gather', ['weights', 'index'], ['picked']),
    // the MatMul chain
    node('Add', ['identity', 'zero'], ['m0']),
    ...Array.from({ length: matmuls }, (_, i) => node('MatMul', [`m${i}`, 'identity'], [`m${i + 1}`])),
    node('ReduceSum', [`m${matmuls}`], ['work'], [intAttr('keepdims', 0)]),
    node('Add', ['work', 'picked'], ['junk']),
    node('Mul', ['junk', 'c_zero'], ['junk0']),
    node('Add', ['zero', 'junk0'], ['z']),
    node('Add', ['z', 'c_minus10'], ['logit']),
    node('Sigmoid', ['logit'], ['output']),
    node('Identity', ['state'], ['stateN']),
  ];
  const f = (name: string, dims: number[], data: Float32Array) => ({
    name,
    dims,
    dataType: FLOAT,
    rawData: new Uint8Array(data.buffer),
  });
  const model: import('onnx-proto').onnx.IModelProto = {
    irVersion: 7,
    producerName: 'voxserve synth-model',
    opsetImport: [{ domain: '', version: 13 }],
    graph: {
      name: `synthetic-${sizeMiB}MiB-${matmuls}mm`,
      node: nodes,
      initializer: [
        f('weights', [weights.length], weights),
        f('identity', [N, N], identity),
        f('c_zero', [], new Float32Array([0])),
        f('c_minus10', [], new Float32Array([-10])),
        { name: 'c_shape1', dims: [1], dataType: INT64, rawData: new Uint8Array(new BigInt64Array([1n]).buffer) },
      ],
      input: [valueInfo('input', FLOAT, [1, 'n']), valueInfo('state', FLOAT, [2, 1, 128]), valueInfo('sr', INT64, [])],
      output: [valueInfo('output', FLOAT, [1, 1]), valueInfo('stateN', FLOAT, [2, 1, 128])],
    },
  };
  return onnx.ModelProto.encode(model).finish();
}

/**
 * Measures ms per MatMul of the chain on this machine (onnxruntime-node, one thread), so that
 * `matmuls = runMs / msPerMatmul` gives about the chosen run time.
 */
export async function calibrate(): Promise<number> {
  const ort = (await import('onnxruntime-node')).default;
  const time = async (k: number): Promise<number> => {
    const s = await ort.InferenceSession.create(syntheticModel(0, k), { intraOpNumThreads: 1, interOpNumThreads: 1 });
    const feeds = {
      input: new ort.Tensor('float32', new Float32Array(576), [1, 576]),
      state: new ort.Tensor('float32', new Float32Array(256), [2, 1, 128]),
      sr: new ort.Tensor('int64', BigInt64Array.from([16000n]), []),
    };
    await s.run(feeds);
    const t = performance.now();
    for (let i = 0; i < 5; i++) await s.run(feeds);
    const ms = (performance.now() - t) / 5;
    await s.release();
    return ms;
  };
  const [a, b] = [await time(0), await time(40)];
  return Math.max(0.001, (b - a) / 40);
}

/**
 * Writes a model of `sizeMiB` whose run takes about `runMs`.
 * @returns the MatMul count used.
 */
export async function writeSyntheticModel(path: string, sizeMiB: number, runMs: number): Promise<number> {
  const matmuls = runMs > 0 ? Math.max(1, Math.round(runMs / (await calibrate()))) : 0;
  writeFileSync(path, syntheticModel(sizeMiB, matmuls));
  return matmuls;
}

if (import.meta.url === `file://${process.argv[1]}`) {
  const usage = (): never => {
    process.stderr.write('usage: synth-model --out FILE [--size-mib MIB] [--run-ms MS]\n');
    process.exit(2);
  };
  let values: { out?: string; 'size-mib'?: string; 'run-ms'?: string };
  try {
    values = parseArgs({
      options: {
        out: { type: 'string' },
        'size-mib': { type: 'string', default: '1' },
        'run-ms': { type: 'string', default: '0' },
      },
    }).values;
  } catch {
    usage();
  }
  const size = Number(values!['size-mib']);
  const runMs = Number(values!['run-ms']);
  if (!values!.out || !(size >= 0) || !(runMs >= 0)) usage();
  const k = await writeSyntheticModel(values!.out!, size, runMs);
  process.stdout.write(`wrote ${values!.out}: ${size} MiB of weights, ${k} MatMuls per run (~${runMs} ms)\n`);
}
