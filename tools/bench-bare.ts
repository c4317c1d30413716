/**
 * The bare loops `voxserve bench` (tools/bench.ts) judges the server against: one onnxruntime-node
 * session set on one thread in a plain loop over real speech, nothing else (Silero VAD; the
 * openWakeWord pipeline: melspectrogram, embedding, heads); for RNNoise, `@echogarden/rnnoise-wasm`
 * itself on 48 kHz frames of 480 samples, one state.
 *
 * Each loop runs in a process of its own (`bareInChild`): `process.cpuUsage()` counts every
 * thread of a process, and in the bench's own process it counted the load generator's garbage
 * collection after a run too (a 30-row VAD loop read 3.0 ms per stream-second there against 1.8
 * alone). Run directly: `node dist/tools/bench-bare.js vad ROWS WINDOWS [IDLE_MS [RUNS_PER_IDLE]]`,
 * `node dist/tools/bench-bare.js wakeword HEAD[,HEAD] BATCH STEPS` or
 * `node dist/tools/bench-bare.js denoise FRAMES` prints CPU ms per stream-second.
 */
import { execFile } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import ort from 'onnxruntime-node';
import { OWW_EMBEDDING, OWW_MELSPECTROGRAM } from '../runtime/catalog.js';
import { defaultCatalog } from '../runtime/config.js';
import { loadRnnoiseModule, RNNOISE } from '../runtime/slots/rnnoise.js';

const root = fileURLToPath(new URL('../..', import.meta.url));
const STEP = 1280;
const STEPS_PER_S = 16000 / STEP;

const fixture = (f: string): Buffer => readFileSync(join(root, 'spec/fixtures', f)).subarray(44); // 16 kHz mono s16le after the 44-byte header

/** 16 kHz mono s16le speech: the "alexa" phrase and an espeak sentence (both 16 kHz fixtures). */
function speechPcm(): Buffer {
  return Buffer.concat([fixture('espeak_alexa_16k.wav'), fixture('espeak_sentence_16k.wav')]);
}

const OPTS: ort.InferenceSession.SessionOptions = {
  intraOpNumThreads: 1,
  interOpNumThreads: 1,
  executionMode: 'sequential',
  graphOptimizationLevel: 'all',
};

/**
 * The bare pipeline: `batch` streams' 80 ms steps at a time (melspectrogram and embedding as runs
 * of batch `batch`, each head per stream as the heads take batch 1), over `steps` steps per
 * stream. Returns CPU ms per stream-second.
 */
export async function bareWakeword(heads: string[], batch: number, steps: number): Promise<number> {
  const mel = await ort.InferenceSession.create(OWW_MELSPECTROGRAM, OPTS);
  const emb = await ort.InferenceSession.create(OWW_EMBEDDING, OPTS);
  const catalog = defaultCatalog();
  const hs = await Promise.all(
    heads.map((h) => ort.InferenceSession.create(catalog.find((m) => m.id === h)!.path!, OPTS)),
  );
  const pcm = speechPcm();
  const samples = new Float32Array(pcm.length / 2);
  for (let i = 0; i < samples.length; i++) samples[i] = pcm.readInt16LE(2 * i);
  const x = new Float32Array(batch * (STEP + 480));
  const melBuf = new Float32Array(batch * 76 * 32).fill(1);
  const windows = hs.map((h) => {
    const m = h.inputMetadata[0];
    return m?.isTensor && typeof m.shape[1] === 'number' ? m.shape[1] : 16;
  });
  const embBuf = new Float32Array(Math.max(16, ...windows) * 96);
  let cpu = 0;
  for (let warm = 0; warm < 2; warm++) {
    const c0 = process.cpuUsage();
    for (let s = 0; s < (warm ? steps : 20); s++) {
      for (let b = 0; b < batch; b++)
        x.set(
          samples.subarray(((s + b * 7) * STEP) % (samples.length - STEP - 480)).subarray(0, STEP + 480),
          b * (STEP + 480),
        );
      const mo = await mel.run({ [mel.inputNames[0]]: new ort.Tensor('float32', x, [batch, STEP + 480]) });
      const spec = mo[mel.outputNames[0]].data as Float32Array;
      const frames = spec.length / batch / 32;
      for (let b = 0; b < batch; b++) {
        const row = melBuf.subarray(b * 76 * 32, (b + 1) * 76 * 32);
        row.copyWithin(0, frames * 32);
        for (let j = 0; j < frames * 32; j++) row[row.length - frames * 32 + j] = spec[b * frames * 32 + j] / 10 + 2;
      }
      const eo = await emb.run({ [emb.inputNames[0]]: new ort.Tensor('float32', melBuf.slice(), [batch, 76, 32, 1]) });
      const e = eo[emb.outputNames[0]].data as Float32Array;
      for (let b = 0; b < batch; b++) {
        embBuf.copyWithin(0, 96);
        embBuf.set(e.subarray(b * 96, (b + 1) * 96), embBuf.length - 96);
        for (let k = 0; k < hs.length; k++)
          await hs[k].run({
            [hs[k].inputNames[0]]: new ort.Tensor('float32', embBuf.slice(embBuf.length - windows[k] * 96), [
              1,
              windows[k],
              96,
            ]),
          });
      }
    }
    const c = process.cpuUsage(c0);
    cpu = (c.user + c.system) / 1000;
  }
  for (const s of [mel, emb, ...hs]) await s.release();
  return (cpu / (steps * batch)) * STEPS_PER_S;
}

/**
 * The bare Silero VAD loop: runs of `rows` streams' next windows (the speech fixture, 576 samples:
 * 64 of context and a 512-sample window), state fed back; nothing else. With `idleMs`, the thread
 * sleeps that long before every `runsPerIdle`-th run (`Atomics.wait`, a futex: the core idles), as
 * a slot host waits between batches (a batch of rows with several windows each makes several
 * runs): on the machines measured here a thread that sleeps a few ms between runs spends more CPU
 * in the same runs (32 rows: +9 % at 2 ms, +20 % at 5 ms, +25 % at 8 ms; 1 ms, or a 5 ms busy
 * wait: none).
 * @returns CPU ms per stream-second over `windows` windows (after 200 to warm up), the sleeps'
 *   wake-ups included.
 */
export async function bareVad(rows: number, windows = 20_000, idleMs = 0, runsPerIdle = 1): Promise<number> {
  const silero = defaultCatalog().find((m) => m.id === 'silero-vad')!;
  const session = await ort.InferenceSession.create(silero.path!, OPTS);
  const pcm = fixture('espeak_sentence_16k.wav');
  const samples = new Float32Array(pcm.length / 2);
  for (let i = 0; i < samples.length; i++) samples[i] = pcm.readInt16LE(2 * i) / 32768;
  const sr = new ort.Tensor('int64', BigInt64Array.from([16000n]), []);
  let state: Float32Array = new Float32Array(2 * rows * 128);
  const input = new Float32Array(rows * 576);
  const sleeper = new Int32Array(new SharedArrayBuffer(4));
  const loop = async (runs: number): Promise<number> => {
    const c0 = process.cpuUsage();
    for (let i = 0; i < runs; i++) {
      if (idleMs > 0 && i % runsPerIdle === 0) Atomics.wait(sleeper, 0, 0, idleMs);
      for (let r = 0; r < rows; r++)
        input.set(samples.subarray(((i * rows + r) * 512) % (samples.length - 576)).subarray(0, 576), r * 576);
      const out = await session.run({
        input: new ort.Tensor('float32', input, [rows, 576]),
        state: new ort.Tensor('float32', state, [2, rows, 128]),
        sr,
      });
      state = out.stateN.data as Float32Array;
    }
    const c = process.cpuUsage(c0);
    return (c.user + c.system) / 1000;
  };
  await loop(Math.ceil(200 / rows));
  const runs = Math.ceil(windows / rows);
  const ms = await loop(runs);
  await session.release();
  return (ms / (runs * rows)) * (16000 / 512);
}

/** 48 kHz mono s16le speech: the two 48 kHz fixtures ("front center", "front left"). */
export function speech48k(): Buffer {
  return Buffer.concat([fixture('Front_Center.wav'), fixture('Front_Left.wav')]);
}

/**
 * The bare RNNoise loop: `@echogarden/rnnoise-wasm`'s module (loaded as the slot hosts load it,
 * nothing else of voxserve), one `DenoiseState`, `rnnoise_process_frame` on 480-sample frames of
 * 48 kHz speech ({@link speech48k}, looped) back to back, the frame copied into the module's heap
 * and the output read back as floats: what a frame costs with nothing around it (no state copied
 * in and out, no messages, no resampling).
 * @returns CPU ms per stream-second over `frames` frames (10 ms each), after 200 to warm up.
 */
export async function bareDenoise(frames: number): Promise<number> {
  const m = await loadRnnoiseModule();
  const st = m._rnnoise_create(0);
  const inp = m._malloc(RNNOISE.FRAME * 4);
  const outp = m._malloc(RNNOISE.FRAME * 4);
  const pcm = speech48k();
  const samples = new Float32Array(pcm.length / 2);
  // RNNoise takes samples at int16 scale as float.
  for (let i = 0; i < samples.length; i++) samples[i] = pcm.readInt16LE(2 * i);
  const out = new Float32Array(RNNOISE.FRAME);
  const usable = samples.length - (samples.length % RNNOISE.FRAME);
  let sink = 0;
  const loop = (n: number): number => {
    const c0 = process.cpuUsage();
    for (let f = 0; f < n; f++) {
      const at = (f * RNNOISE.FRAME) % usable;
      m.HEAPF32.set(samples.subarray(at, at + RNNOISE.FRAME), inp >> 2);
      sink += m._rnnoise_process_frame(st, outp, inp);
      out.set(m.HEAPF32.subarray(outp >> 2, (outp >> 2) + RNNOISE.FRAME));
    }
    const c = process.cpuUsage(c0);
    return (c.user + c.system) / 1000;
  };
  loop(200);
  const ms = loop(frames);
  m._rnnoise_destroy(st);
  if (!Number.isFinite(sink)) throw new Error('rnnoise gave no probability');
  return (ms / frames) * (1000 / 10);
}

/**
 * One bare loop in a fresh process of its own (this file run directly), so its CPU figure counts
 * the loop alone. `args`: `['vad', rows, windows, idleMs?, runsPerIdle?]`, `['wakeword', 'head,head', batch, steps]`
 * or `['denoise', frames]`.
 * @returns CPU ms per stream-second. @throws if the child fails or prints no number.
 */
export async function bareInChild(args: (string | number)[]): Promise<number> {
  const { stdout } = await promisify(execFile)(process.execPath, [fileURLToPath(import.meta.url), ...args.map(String)]);
  const ms = Number(stdout.trim());
  if (!Number.isFinite(ms)) throw new Error(`bench-bare ${args.join(' ')} printed ${JSON.stringify(stdout)}`);
  return ms;
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  const [kind, a, b, c, d, ...extra] = process.argv.slice(2);
  const idle = c === undefined ? 0 : /^\d+(\.\d+)?$/.test(c) ? Number(c) : Number.NaN;
  // Up to 10^7: a row is 2.3 KB of input, and a larger count is a typo.
  const count = (x: string | undefined): number => (/^[1-9]\d{0,6}$/.test(x ?? '') ? Number(x) : Number.NaN);
  const known = new Set(defaultCatalog().flatMap((m) => (m.task === 'wakeword' ? [m.id] : [])));
  const heads = (a ?? '').split(',');
  const ms =
    extra.length > 0
      ? Number.NaN
      : kind === 'vad' && count(a) && count(b) && Number.isFinite(idle) && (d === undefined || count(d))
        ? await bareVad(count(a), count(b), idle, d === undefined ? 1 : count(d))
        : kind === 'wakeword' && heads.every((h) => known.has(h)) && count(b) && count(c)
          ? await bareWakeword(heads, count(b), count(c))
          : kind === 'denoise' && count(a) && b === undefined
            ? await bareDenoise(count(a))
            : Number.NaN;
  if (!Number.isFinite(ms)) {
    console.error(
      'usage: bench-bare.js vad ROWS WINDOWS [IDLE_MS [RUNS_PER_IDLE]] | wakeword HEAD[,HEAD] BATCH STEPS | denoise FRAMES (positive integers up to 10^7 but IDLE_MS, ms >= 0; HEAD a default wake-word model, e.g. hey-jarvis); prints CPU ms per stream-second',
    );
    process.exit(2);
  }
  console.log(ms);
}
