/**
 * Measures the main job's figures on this machine: time from `voxserve serve` to `/ready`,
 * real-time factor of `POST /v1/tasks/run` with silero-vad on a 60 s file (cold: includes the
 * model load; warm: loaded), and the resident memory (VmRSS) of the server and its slot-host
 * processes (where the models live under the default process isolation) with every default model
 * loaded. Run: `npm run build && node dist/tools/measure.js`.
 */
import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { fileURLToPath } from 'node:url';
import { treeRssBytes } from './proc.js';
import { spawnServer } from './spawn-server.js';

const require = createRequire(import.meta.url);
const { WaveFile } = require('wavefile') as typeof import('wavefile');
const root = fileURLToPath(new URL('../..', import.meta.url));

/** 60 s of 16 kHz speech: the espeak sentence fixture looped. */
function sixtySeconds(): Buffer {
  const w = new WaveFile(readFileSync(`${root}/spec/fixtures/espeak_sentence_16k.wav`));
  const one = w.getSamples(false, Int16Array) as unknown as Int16Array;
  const out = new Int16Array(16000 * 60);
  for (let i = 0; i < out.length; i++) out[i] = one[i % one.length];
  const o = new WaveFile();
  o.fromScratch(1, 16000, '16', out);
  return Buffer.from(o.toBuffer());
}

const t0 = performance.now();
const { child, url } = await spawnServer(['--port', '0']);
const readyMs = performance.now() - t0;

const wav = sixtySeconds();
const run = async (model: string): Promise<{ wall: number; rtf: number }> => {
  const s = performance.now();
  const res = await fetch(`${url}/v1/tasks/run?model=${model}`, {
    method: 'POST',
    headers: { 'content-type': 'audio/wav' },
    body: new Uint8Array(wav),
  });
  const body = (await res.json()) as { timing: { audio_duration_ms: number } };
  const wall = performance.now() - s;
  return { wall, rtf: wall / body.timing.audio_duration_ms };
};
const cold = await run('silero-vad');
const warm = await run('silero-vad');
const { models } = (await (await fetch(`${url}/v1/models`)).json()) as { models: { id: string }[] };
for (const m of models) await run(m.id);
const server = Number(/VmRSS:\s+(\d+) kB/.exec(readFileSync(`/proc/${child.pid}/status`, 'utf8'))![1]) * 1024;
const total = treeRssBytes(child.pid!);
child.kill('SIGTERM');

console.log(`serve start -> /ready         ${readyMs.toFixed(0)} ms`);
console.log(
  `silero-vad, 60 s file, cold  ${cold.wall.toFixed(0)} ms, RTF ${cold.rtf.toFixed(4)} (includes the model load)`,
);
console.log(`silero-vad, 60 s file, warm  ${warm.wall.toFixed(0)} ms, RTF ${warm.rtf.toFixed(4)}`);
const mib = (b: number): string => (b / 2 ** 20).toFixed(0);
console.log(
  `RSS, all ${models.length} default models loaded  ${mib(total)} MiB (server ${mib(server)} MiB + slot hosts ${mib(total - server)} MiB)`,
);
