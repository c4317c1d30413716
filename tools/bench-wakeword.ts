/**
 * The bare openWakeWord pipeline for `voxserve bench` (tools/bench.ts): one onnxruntime-node
 * session set on one thread (melspectrogram, embedding, heads) in a plain loop over real speech,
 * the espeak "alexa" phrase and sentence fixtures.
 */
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import ort from 'onnxruntime-node';
import { OWW_EMBEDDING, OWW_MELSPECTROGRAM } from '../runtime/catalog.js';
import { defaultCatalog } from '../runtime/config.js';

const root = fileURLToPath(new URL('../..', import.meta.url));
const STEP = 1280;
const STEPS_PER_S = 16000 / STEP;

/** 16 kHz mono s16le speech: the "alexa" phrase and an espeak sentence (both 16 kHz fixtures). */
function speechPcm(): Buffer {
  const pcm = (f: string): Buffer => readFileSync(join(root, 'spec/fixtures', f)).subarray(44);
  return Buffer.concat([pcm('espeak_alexa_16k.wav'), pcm('espeak_sentence_16k.wav')]);
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
