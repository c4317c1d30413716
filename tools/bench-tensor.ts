/**
 * What serving a model as a `tensor` model costs (issue 22): the latency of `POST /v1/tasks/run`
 * on openWakeWord's melspectrogram (80 ms of audio, 1280 samples in, [1, 1, 5, 32] out), in JSON
 * and in msgpack, against the same model run directly with onnxruntime-node in this process
 * (one thread, as a slot host runs it), measured in the same run; and the model's resident
 * memory (its slot host). Sequential requests over loopback; other processes on the machine
 * load the CPU too, so read the ratios, not the milliseconds.
 *
 *     npm run build && node dist/tools/bench-tensor.js [requests=300]
 */
import { pack, unpack } from 'msgpackr';
import ort from 'onnxruntime-node';
import { OWW_MELSPECTROGRAM } from '../runtime/catalog.js';
import { ServerConfig } from '../runtime/config.js';
import { startServer } from '../transport/server.js';

const N = Number(process.argv[2] ?? 300);
const audio = Float32Array.from({ length: 1280 }, (_, i) => Math.round(Math.sin(i / 7) * 8000));

/** The median of `n` timed calls of `f` (after 20 unmeasured ones), ms. */
async function median(n: number, f: () => Promise<unknown>): Promise<number> {
  for (let i = 0; i < 20; i++) await f();
  const t: number[] = [];
  for (let i = 0; i < n; i++) {
    const t0 = performance.now();
    await f();
    t.push(performance.now() - t0);
  }
  return t.sort((a, b) => a - b)[Math.floor(n / 2)];
}

const session = await ort.InferenceSession.create(OWW_MELSPECTROGRAM, {
  intraOpNumThreads: 1,
  interOpNumThreads: 1,
  executionMode: 'sequential',
  graphOptimizationLevel: 'all',
});
const direct = await median(N, () => session.run({ input: new ort.Tensor('float32', audio, [1, audio.length]) }));

const server = await startServer(
  ServerConfig.parse({
    log_level: 'silent',
    port: 0,
    models: [{ id: 'mel', task: 'tensor', path: OWW_MELSPECTROGRAM }],
  }),
);
try {
  const url = `${server.url}/v1/tasks/run`;
  const json = JSON.stringify({
    model: 'mel',
    inputs: { input: { dtype: 'float32', shape: [1, audio.length], data: Array.from(audio) } },
  });
  const viaJson = await median(N, async () => {
    const r = await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: json });
    if (r.status !== 200) throw new Error(await r.text());
    await r.json();
  });
  const body = new Uint8Array(
    pack({
      model: 'mel',
      inputs: { input: { dtype: 'float32', shape: [1, audio.length], data: Buffer.from(audio.buffer) } },
    }),
  );
  const viaMsgpack = await median(N, async () => {
    const r = await fetch(url, { method: 'POST', headers: { 'content-type': 'application/msgpack' }, body });
    if (r.status !== 200) throw new Error(await r.text());
    unpack(Buffer.from(await r.arrayBuffer()));
  });
  const status = (await (await fetch(`${server.url}/v1/models/mel`)).json()) as { resident_bytes: number };
  const ms = (v: number): string => `${v.toFixed(3)} ms`;
  console.log(`melspectrogram, 1280 samples, ${N} sequential requests (medians):`);
  console.log(`  onnxruntime-node direct      ${ms(direct)}`);
  console.log(`  POST /v1/tasks/run, JSON     ${ms(viaJson)}  (${(viaJson / direct).toFixed(1)}x direct)`);
  console.log(`  POST /v1/tasks/run, msgpack  ${ms(viaMsgpack)}  (${(viaMsgpack / direct).toFixed(1)}x direct)`);
  console.log(`  resident_bytes of the model  ${(status.resident_bytes / 2 ** 20).toFixed(1)} MiB`);
} finally {
  await server.close();
}
