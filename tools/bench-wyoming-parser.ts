/**
 * What a trickled Wyoming payload costs the parser (issue 25 item 3): CPU time (process.cpuUsage,
 * user + system) to parse one `audio-chunk` with a 1 MB payload pushed in 50-byte pieces, as a
 * slow satellite's TCP segments may arrive, against the same bytes pushed at once (the baseline,
 * measured in the same run). After a warm-up, five rounds, interleaved so machine load hits both;
 * prints the medians and their ratio. (At once is one 1 MB copy; in pieces adds 20,000 calls, so
 * even a linear parser's ratio is well above 1; one that joins all it holds on every piece copies
 * about 10 GB.)
 *
 *   npm run build && node dist/tools/bench-wyoming-parser.js
 *   node dist/tools/bench-wyoming-parser.js --parser /path/to/other/dist/transport/wyoming.js
 *
 * `--parser` measures another build's WyomingParser (e.g. the one before the fix).
 */
import { resolve } from 'node:path';
import { pathToFileURL } from 'node:url';
import type { WyomingParser } from '../transport/wyoming.js';

const at = process.argv.indexOf('--parser');
const modulePath = at > 0 ? pathToFileURL(resolve(process.argv[at + 1])).href : '../transport/wyoming.js';
const { WyomingParser: Parser } = (await import(modulePath)) as {
  WyomingParser: new (maxHeader: number, maxPayload: number) => WyomingParser;
};

/** One audio-chunk event with `bytes` of payload, as wyoming's Python writer sends it. */
function event(bytes: number): Buffer {
  const data = Buffer.from(JSON.stringify({ rate: 16000, width: 2, channels: 1, timestamp: 0 }));
  const header = { type: 'audio-chunk', data_length: data.length, payload_length: bytes };
  return Buffer.concat([Buffer.from(`${JSON.stringify(header)}\n`), data, Buffer.alloc(bytes, 1)]);
}

/** CPU ms to parse `bytes` pushed in pieces of `piece` bytes. */
function cpuMs(bytes: Buffer, piece: number): number {
  const parser = new Parser(4096, bytes.length);
  const t0 = process.cpuUsage();
  let events = 0;
  for (let i = 0; i < bytes.length; i += piece) events += parser.push(bytes.subarray(i, i + piece)).length;
  const t = process.cpuUsage(t0);
  if (events !== 1) throw new Error(`parsed ${events} events, expected 1`);
  return (t.user + t.system) / 1000;
}

const median = (xs: number[]): number => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];
// Warm-up (JIT), not counted.
for (let i = 0; i < 3; i++) cpuMs(event(1_000_000), 50);
const bytes = event(1_000_000);
const once: number[] = [];
const trickled: number[] = [];
for (let round = 0; round < 5; round++) {
  once.push(cpuMs(bytes, bytes.length));
  trickled.push(cpuMs(bytes, 50));
}
console.log(
  `1 MB payload: at once ${median(once).toFixed(2)} ms CPU, in 50-byte pieces ${median(trickled).toFixed(2)} ms CPU (medians of 5); in pieces / at once: ${(median(trickled) / median(once)).toFixed(1)}`,
);
