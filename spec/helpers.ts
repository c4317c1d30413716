import { readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { createRequire } from 'node:module';

const require = createRequire(import.meta.url);
export const { WaveFile } = require('wavefile') as typeof import('wavefile');

/** Path of a file in spec/fixtures (see spec/fixtures/README.md for provenance). */
export function fixturePath(name: string): string {
  return fileURLToPath(new URL(`./fixtures/${name}`, import.meta.url));
}

export function fixture(name: string): Buffer {
  return readFileSync(fixturePath(name));
}

/** A WAV file built with wavefile: `channels` x `frames` of a 440 Hz tone. */
export function toneWav(opts: { rate: number; channels: number; bitDepth: string; frames: number }): Buffer {
  const w = new WaveFile();
  const chans: number[][] = [];
  const scale = opts.bitDepth === '32f' ? 0.5 : opts.bitDepth === '8' ? 64 : 0.5 * 2 ** (Number(opts.bitDepth) - 1);
  for (let c = 0; c < opts.channels; c++) {
    chans.push(
      Array.from({ length: opts.frames }, (_, i) => {
        const v = Math.sin((2 * Math.PI * 440 * i) / opts.rate) * scale;
        return opts.bitDepth === '8' ? Math.round(128 + v) : opts.bitDepth === '32f' ? v : Math.round(v);
      }),
    );
  }
  w.fromScratch(opts.channels, opts.rate, opts.bitDepth, opts.channels === 1 ? chans[0] : chans);
  return Buffer.from(w.toBuffer());
}

/** A 16 kHz mono s16 WAV of `seconds` of a fixture (16 kHz mono) played in a loop. */
export function loopWav(name: string, seconds: number): Buffer {
  const src = new WaveFile(fixture(name));
  const one = src.getSamples(false, Int16Array) as unknown as Int16Array;
  const out = new Int16Array(16000 * seconds);
  for (let i = 0; i < out.length; i++) out[i] = one[i % one.length];
  const w = new WaveFile();
  w.fromScratch(1, 16000, '16', out);
  return Buffer.from(w.toBuffer());
}

/** Polls `pred` every 5 ms until it holds; throws after `ms`. */
export async function until(pred: () => boolean | Promise<boolean>, ms = 5000): Promise<void> {
  const end = Date.now() + ms;
  while (!(await pred())) {
    if (Date.now() > end) throw new Error('condition not reached');
    await new Promise((r) => setTimeout(r, 5));
  }
}
