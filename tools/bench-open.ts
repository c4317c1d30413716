/**
 * What opening and closing a stream costs the server's main process, by the audio's sample rate:
 * N WebSocket streams, C open at a time (each next one opens as one closes: calls coming and
 * going), each through its whole life: `ready`, one second of audio, `end`, `done`, close; the
 * main process's CPU (from /proc) over the round, per stream. 16 kHz s16le is the baseline (no
 * resampling); 8 kHz (telephone audio) and 48 kHz streams also take a libsamplerate converter, a
 * WASM module instance when a new one is made. Rounds alternate the rates; the median per rate
 * and its ratio to 16 kHz are printed. One server for the run, one warm-up round at every rate
 * first (not counted).
 *
 *   npm run build && node dist/tools/bench-open.js [--streams 200] [--concurrency 4] [--rounds 3] [--rates 16000,8000,48000]
 *
 * `--rates` measures only those rates (the first is the one the others are divided by).
 */
import { parseArgs } from 'node:util';
import WebSocket from 'ws';
import { defaultCatalog } from '../runtime/config.js';
import { cpuApart } from './proc.js';
import { spawnWithConfig } from './spawn-server.js';

const usage = (): never => {
  console.error(
    'usage: bench-open.js [--streams N] [--concurrency C] [--rounds R] (positive integers up to 100000) [--rates 16000,8000,48000]',
  );
  process.exit(2);
};
let values: Record<string, string | undefined> = {};
try {
  ({ values } = parseArgs({
    options: {
      streams: { type: 'string', default: '200' },
      concurrency: { type: 'string', default: '4' },
      rounds: { type: 'string', default: '3' },
      rates: { type: 'string', default: '16000,8000,48000' },
    },
  }));
} catch {
  usage();
}
const [N, C, ROUNDS] = [values.streams, values.concurrency, values.rounds].map((x) =>
  /^[1-9]\d{0,4}$/.test(x ?? '') ? Number(x) : usage(),
);
const RATES = (values.rates ?? '').split(',').map((x) => (/^\d{4,6}$/.test(x) ? Number(x) : usage()));

const silero = defaultCatalog().find((m) => m.id === 'silero-vad')!;
const { child, url } = await spawnWithConfig({
  port: 0,
  limits: { max_ws_connections: C + 10, idle_ms: 0 },
  models: [{ ...silero, max_streams: C + 10, lazy: false }],
});

/** One second of a 440 Hz tone at `rate`, s16le mono, in 100 ms frames. */
function frames(rate: number): Buffer[] {
  const out: Buffer[] = [];
  for (let f = 0; f < 10; f++) {
    const b = Buffer.alloc(rate / 5);
    for (let i = 0; i < rate / 10; i++)
      b.writeInt16LE(Math.round(8000 * Math.sin((2 * Math.PI * 440 * (f * (rate / 10) + i)) / rate)), 2 * i);
    out.push(b);
  }
  return out;
}

/** One stream at `rate` through its whole life. */
function stream(rate: number, audio: Buffer[]): Promise<void> {
  return new Promise<void>((resolve, reject) => {
    const ws = new WebSocket(`${url.replace('http', 'ws')}/v1/stream?model=silero-vad&sample_rate=${rate}`);
    ws.on('error', reject);
    ws.on('close', () => resolve());
    ws.on('message', (data) => {
      const e = JSON.parse(String(data)) as { type: string };
      if (e.type === 'ready') {
        for (const f of audio) ws.send(f);
        ws.send('{"type":"end"}');
      } else if (e.type === 'done') ws.close();
      else if (e.type === 'error') reject(new Error(String(data)));
    });
  });
}

/** N streams at `rate`, C at a time; the main process's CPU ms per stream. */
async function round(rate: number): Promise<number> {
  const audio = frames(rate);
  const c0 = cpuApart(child.pid!).main;
  let next = 0;
  const lane = async (): Promise<void> => {
    while (next < N) {
      next++;
      await stream(rate, audio);
    }
  };
  await Promise.all(Array.from({ length: Math.min(C, N) }, lane));
  // The server's side of each close (its log line, the lease's release) runs just after.
  await new Promise((r) => setTimeout(r, 200));
  return ((cpuApart(child.pid!).main - c0) * 1000) / N;
}

const median = (xs: number[]): number => [...xs].sort((a, b) => a - b)[Math.floor((xs.length - 1) / 2)];
try {
  for (const rate of RATES) await round(rate);
  const ms = new Map<number, number[]>(RATES.map((r) => [r, []]));
  for (let r = 0; r < ROUNDS; r++) for (const rate of RATES) ms.get(rate)!.push(await round(rate));
  console.log(
    `main-process CPU per stream opened, fed 1 s of audio and closed (${N} streams, ${C} at a time, ${ROUNDS} round(s)):`,
  );
  const base = median(ms.get(RATES[0])!);
  for (const rate of RATES) {
    const m = median(ms.get(rate)!);
    console.log(
      `${String(rate).padStart(5)} Hz: ${m.toFixed(2)} ms (rounds ${ms
        .get(rate)!
        .map((x) => x.toFixed(2))
        .join(', ')}), ${(m / base).toFixed(2)}x ${RATES[0]} Hz`,
    );
  }
} finally {
  child.kill('SIGTERM');
}
