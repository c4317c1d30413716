/**
 * What decoding a file costs the event loop: a 60 s 48 kHz WAV (decoded with wavefile and
 * resampled to 16 kHz) decoded on the main thread as the server did before (the baseline, in
 * the same run), against {@link decodeAudio} in a decode worker, and the MP3 of the Silero
 * project (spec/fixtures) in a worker. Prints wall time and the event loop's longest
 * delay (perf_hooks, 1 ms resolution) while three files decode one after another, each way
 * twice (interleaved, so machine load hits both).
 *
 *   npm run build && node dist/tools/bench-decode.js
 */
import { existsSync, readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { monitorEventLoopDelay } from 'node:perf_hooks';
import { fileURLToPath } from 'node:url';
import { decodeWav, resample } from '../runtime/audio/audio.js';
import { decodeAudio, startDecoders } from '../runtime/audio/decode.js';

const require = createRequire(import.meta.url);
const { WaveFile } = require('wavefile') as typeof import('wavefile');

const rate = 48_000;
const tone = new Int16Array(rate * 60).map((_, i) => Math.round(8000 * Math.sin(i / 7)));
const w = new WaveFile();
w.fromScratch(1, rate, '16', tone);
const wav = Buffer.from(w.toBuffer());
const mp3Path = fileURLToPath(new URL('../../spec/fixtures/silero_test.mp3', import.meta.url));
const mp3 = existsSync(mp3Path) ? readFileSync(mp3Path) : null;

startDecoders();
await decodeAudio(wav, 'audio/wav'); // workers warm

async function measure(name: string, work: () => Promise<unknown>): Promise<number> {
  const h = monitorEventLoopDelay({ resolution: 1 });
  h.enable();
  const t0 = performance.now();
  for (let k = 0; k < 3; k++) await work();
  const wall = performance.now() - t0;
  h.disable();
  const max = h.max / 1e6;
  console.log(
    `${name.padEnd(34)} wall ${Math.round(wall)} ms for 3; event-loop delay max ${max.toFixed(1)} ms, p99 ${(h.percentile(99) / 1e6).toFixed(1)} ms`,
  );
  return max;
}

const ratios: number[] = [];
for (let round = 0; round < 2; round++) {
  const base = await measure('60 s 48 kHz WAV, main thread', async () => {
    const a = decodeWav(wav);
    await resample(a.samples, a.sampleRate);
  });
  const worker = await measure('60 s 48 kHz WAV, decode worker', () => decodeAudio(wav, 'audio/wav'));
  ratios.push(worker / base);
  if (mp3) await measure('silero_test.mp3, decode worker', () => decodeAudio(mp3, 'audio/mpeg'));
}
console.log(`longest event-loop delay, worker / main thread: ${ratios.map((r) => r.toFixed(3)).join(', ')}`);
process.exit(0);
