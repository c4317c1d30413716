/**
 * What a trickled Wyoming payload costs (issue 25 item 3): CPU time to take in one event with a
 * 1 MB payload pushed in 50-byte pieces, as a slow satellite's TCP segments may arrive, against
 * the same bytes at once (the baseline, measured in the same run).
 *
 * - The parser alone (process.cpuUsage, user + system): after a warm-up, five rounds,
 *   interleaved so machine load hits both; prints the medians and their ratio. (At once is one
 *   1 MB copy; in pieces adds 20,000 calls, so even a linear parser's ratio is well above 1; one
 *   that joins all it holds on every piece copies about 10 GB.)
 * - With `--server`, a server process too: `voxserve serve --wyoming` spawned from the compiled
 *   CLI (`--cli` another build's `dist/tools/cli.js`), sent the event over TCP at once and in
 *   50-byte writes 1 ms apart (each its own segment); its CPU (/proc/PID/stat, user + system, 10 ms
 *   ticks) while it takes them in. The event's type is one the server ignores, so only the
 *   framing is measured.
 *
 *   npm run build && node dist/tools/bench-wyoming-parser.js [--server]
 *   node dist/tools/bench-wyoming-parser.js --parser OTHER/dist/transport/wyoming.js --server --cli
 * OTHER/dist/tools/cli.js
 *
 * `--parser` measures another build's WyomingParser (e.g. the one before the fix).
 */
import { spawn } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { connect, createServer, type Socket } from 'node:net';
import { resolve } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import type { WyomingParser } from '../transport/wyoming.js';

const arg = (name: string): string | undefined => {
  const i = process.argv.indexOf(name);
  return i > 0 ? process.argv[i + 1] : undefined;
};
const parserPath = arg('--parser');
const modulePath = parserPath ? pathToFileURL(resolve(parserPath)).href : '../transport/wyoming.js';
const { WyomingParser: Parser } = (await import(modulePath)) as {
  WyomingParser: new (maxHeader: number, maxPayload: number) => WyomingParser;
};

/** One event with `bytes` of payload, as wyoming's Python writer sends it (`audio-chunk` unless `type`). */
function event(bytes: number, type = 'audio-chunk'): Buffer {
  const data = Buffer.from(JSON.stringify({ rate: 16000, width: 2, channels: 1, timestamp: 0 }));
  const header = { type, data_length: data.length, payload_length: bytes };
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

/** CPU time of process `pid` so far, ms (Linux: utime + stime of /proc/PID/stat, in 10 ms ticks). */
function processCpuMs(pid: number): number {
  const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
  const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
  return ((Number(fields[11]) + Number(fields[12])) * 1000) / 100;
}

/**
 * Sends `bytes` on a fresh connection in pieces of `piece` bytes, `gapMs` apart; resolves once the server read them (a
 * describe after them is answered).
 */
async function send(port: number, bytes: Buffer, piece: number, gapMs: number): Promise<void> {
  const socket: Socket = connect(port, '127.0.0.1');
  socket.setNoDelay(true);
  await new Promise((r) => socket.once('connect', r));
  for (let i = 0; i < bytes.length; i += piece) {
    socket.write(bytes.subarray(i, i + piece));
    if (gapMs) await new Promise((r) => setTimeout(r, gapMs));
  }
  const answered = new Promise((r) => socket.once('data', r));
  socket.write('{"type":"describe"}\n');
  await answered;
  socket.destroy();
}

if (process.argv.includes('--server')) {
  const cli = resolve(arg('--cli') ?? fileURLToPath(new URL('./cli.js', import.meta.url)));
  const port = await new Promise<number>((r) => {
    const probe = createServer().listen(0, '127.0.0.1', () => {
      const p = (probe.address() as { port: number }).port;
      probe.close(() => r(p));
    });
  });
  const child = spawn(process.execPath, [cli, 'serve', '--port', '0', '--wyoming', `127.0.0.1:${port}`], {
    stdio: ['ignore', 'ignore', 'pipe'],
  });
  await new Promise<void>((r, reject) => {
    let err = '';
    child.stderr!.on('data', (d: Buffer) => {
      err += d.toString();
      if (err.includes('wyoming on')) r();
    });
    child.once('exit', (code) => reject(new Error(`server exited ${code}: ${err}`)));
  });
  // An event type the server ignores: the cost is the framing's alone.
  const bytes = event(1_000_000, 'x-bench');
  await send(port, bytes, bytes.length, 0); // warm-up
  const cpu = async (piece: number, gapMs: number): Promise<number> => {
    const t0 = processCpuMs(child.pid!);
    await send(port, bytes, piece, gapMs);
    return processCpuMs(child.pid!) - t0;
  };
  const once: number[] = [];
  for (let i = 0; i < 5; i++) once.push(await cpu(bytes.length, 0));
  const trickled = await cpu(50, 1);
  child.kill('SIGTERM');
  console.log(
    `server process, 1 MB payload over TCP: at once ${median(once)} ms CPU (median of 5), in 50-byte writes 1 ms apart ${trickled} ms CPU; in pieces / at once: ${(trickled / Math.max(median(once), 10)).toFixed(1)} (CPU in 10 ms ticks; at once rounds to 0-10 ms)`,
  );
}
