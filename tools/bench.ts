/**
 * `voxserve bench`: live streaming benchmark. For each N it runs N concurrent real-time
 * WebSocket streams (16 kHz s16le, real speech looped, each frame sent when its audio has
 * elapsed) against a `voxserve serve` child process it starts, then, in the same run, the two
 * baselines on the same windows: the bare batched loop (one onnxruntime-node session, batches
 * of the size the server formed) and the per-client way (one session per stream, unbatched).
 * Prints one table. CPU is read from /proc for the server and from process.cpuUsage() for the
 * client; both exclude start-up.
 *
 * Client-side event lag: a `speech_end` can only be decided `min_silence_duration_ms` after the
 * speech ends, i.e. at end_ms - speech_pad_ms + min_silence_duration_ms (+ one 32 ms window);
 * the lag is its arrival minus the moment that audio position was due on the wire.
 */
import type { ChildProcess } from 'node:child_process';
import { mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import ort from 'onnxruntime-node';
import { defaultCatalog } from '../runtime/catalog.js';
import type { Job } from '../runtime/slot-protocol.js';
import { SlotPool, slotFactory } from '../runtime/slots.js';
import { VoxClient, type VoxStream } from '../client/node.js';
import { paceFrames } from './pace.js';
import { treeCpuSeconds, treeRssBytes } from './proc.js';
import { progressBar } from './progress.js';
import { spawnServer } from './spawn-server.js';

export interface BenchOptions {
  /** Stream counts to run, e.g. [100, 500, 1000]. */
  streams: number[];
  /** Frame length, ms (20 or 100). */
  frameMs: number;
  /** Audio per stream, s. */
  seconds: number;
  /** Server slots for the model. */
  slots: number;
  /** The model's max_batch_delay_ms. */
  batchDelayMs: number;
  /** Slot host isolation modes to run, side by side. */
  isolation: ('process' | 'thread')[];
  /** Also run each count with `probabilities=true` (a probability event per window) and print its cost against the run without. */
  probabilities?: boolean;
}

const root = fileURLToPath(new URL('../..', import.meta.url));
const silero = defaultCatalog().find((m) => m.id === 'silero-vad')!;
const WINDOW = 512;
const WINDOWS_PER_S = 16000 / WINDOW;

function speechPcm(): Buffer {
  const wav = readFileSync(join(root, 'spec/fixtures/espeak_sentence_16k.wav'));
  return wav.subarray(44); // 16 kHz mono s16le after the 44-byte header
}

const cpuOf = treeCpuSeconds;
const rssOf = treeRssBytes;
const pct = (xs: number[], q: number): number => {
  if (!xs.length) return NaN;
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor(q * s.length))];
};

async function startChild(n: number, o: BenchOptions, isolation: 'process' | 'thread'): Promise<{ child: ChildProcess; url: string }> {
  const dir = mkdtempSync(join(tmpdir(), 'voxserve-bench-'));
  const config = join(dir, 'config.json');
  writeFileSync(
    config,
    JSON.stringify({
      port: 0,
      log_level: 'warn',
      busy_timeout_ms: 0,
      isolation,
      limits: { max_ws_connections: n + 16, idle_ms: 0, heartbeat_ms: 0 },
      models: [{ ...silero, slots: o.slots, max_streams: n + 16, max_batch_size: 256, max_batch_delay_ms: o.batchDelayMs, lazy: false }],
    }),
  );
  return spawnServer(['--config', config]);
}

async function metricSum(url: string, name: string): Promise<number> {
  const text = await (await fetch(`${url}/metrics`)).text();
  const line = text.split('\n').find((l) => l.startsWith(`${name}{`) && l.includes('model="silero-vad"'));
  return line ? Number(line.split(' ').at(-1)) : 0;
}

interface LiveResult {
  streams: number;
  sustained: number;
  lagP50: number;
  lagP99: number;
  eventLagP50: number;
  eventLagP99: number;
  serverCpuS: number;
  clientCpuS: number;
  streamSeconds: number;
  rssMiB: number;
  meanBatch: number;
}

/** N live streams against a fresh server, through the client; progress on stderr while they run. */
async function live(n: number, o: BenchOptions, isolation: 'process' | 'thread', probabilities = false): Promise<LiveResult> {
  const { child, url } = await startChild(n, o, isolation);
  const pcm = speechPcm();
  const frameBytes = Math.round((16000 * o.frameMs) / 1000) * 2;
  const totalFrames = Math.round((o.seconds * 1000) / o.frameMs);
  const vox = new VoxClient({ url });
  interface S { stream: VoxStream; next: number; start: number; done: boolean; lastSentAt: number; doneAt: number; eventLags: number[] }
  const bar = progressBar(`${isolation} ${n} streams: opening`, 'streams');
  let opened = 0;
  const streams: S[] = await Promise.all(
    Array.from({ length: n }, async () => {
      const s: S = { stream: await vox.stream({ model: 'silero-vad', highWaterMark: 1024 * 1024, probabilities }), next: 0, start: 0, done: false, lastSentAt: 0, doneAt: 0, eventLags: [] };
      s.stream.on('speech_end', (e) => s.eventLags.push(performance.now() - (s.start + e.end_ms - 30 + 100 + 32)));
      s.stream.on('done', () => {
        s.done = true;
        s.doneAt = performance.now();
      });
      bar.update(++opened, n);
      return s;
    }),
  );
  bar.stop();
  const cpu0 = cpuOf(child.pid!);
  const client0 = process.cpuUsage();
  const batches0 = await metricSum(url, 'voxserve_batch_size_count');
  const windows0 = await metricSum(url, 'voxserve_batch_size_sum');
  const t0 = performance.now();
  // Spread stream starts over one frame; then each frame goes when its audio has elapsed.
  streams.forEach((s, i) => (s.start = t0 + (i / n) * o.frameMs));
  const sending = progressBar(`${isolation} ${n} streams: audio sent`, 's');
  await paceFrames(
    streams,
    totalFrames,
    o.frameMs,
    (s, k) => {
      const off = (k * frameBytes) % (pcm.length - frameBytes);
      // A stream whose socket is behind by more than its high-water mark waits (and falls behind real time).
      void s.stream.send(pcm.subarray(off, off + frameBytes)).catch(() => {});
      if (k === totalFrames - 1) {
        s.lastSentAt = performance.now();
        s.stream.end().catch(() => {});
      }
    },
    (now) => sending.update(Math.min(o.seconds, (now - t0) / 1000), o.seconds),
  );
  sending.stop();
  const deadline = performance.now() + 30_000;
  while (streams.some((s) => !s.done) && performance.now() < deadline) await new Promise((r) => setTimeout(r, 20));
  const serverCpuS = cpuOf(child.pid!) - cpu0;
  const c = process.cpuUsage(client0);
  const status = (await vox.model('silero-vad')) as { processing_lag_ms?: { p50: number; p99: number } | null };
  const batches = (await metricSum(url, 'voxserve_batch_size_count')) - batches0;
  const windows = (await metricSum(url, 'voxserve_batch_size_sum')) - windows0;
  const rss = rssOf(child.pid!);
  for (const s of streams) s.stream.close();
  child.kill('SIGTERM');
  await new Promise((r) => child.on('exit', r));
  // Sustained: finished, and done within one second of the last frame (kept up with real time).
  const sustained = streams.filter((s) => s.done && s.doneAt - s.lastSentAt < 1000).length;
  const eventLags = streams.flatMap((s) => s.eventLags);
  return {
    streams: n,
    sustained,
    lagP50: status.processing_lag_ms?.p50 ?? NaN,
    lagP99: status.processing_lag_ms?.p99 ?? NaN,
    eventLagP50: pct(eventLags, 0.5),
    eventLagP99: pct(eventLags, 0.99),
    serverCpuS,
    clientCpuS: (c.user + c.system) / 1e6,
    streamSeconds: n * o.seconds,
    rssMiB: rss / 1024 / 1024,
    meanBatch: batches ? windows / batches : 1,
  };
}

/** CPU seconds per stream-second of a bare loop: `sessions` sessions, batches of `batch` windows, one thread. */
async function bare(batch: number, sessions: number, windows: number): Promise<number> {
  const opts: ort.InferenceSession.SessionOptions = { intraOpNumThreads: 1, interOpNumThreads: 1, executionMode: 'sequential', graphOptimizationLevel: 'all' };
  const ss = await Promise.all(Array.from({ length: sessions }, () => ort.InferenceSession.create(silero.path!, opts)));
  const pcm = speechPcm();
  const sr = new ort.Tensor('int64', BigInt64Array.from([16000n]), []);
  const states = ss.map(() => new Float32Array(2 * batch * 128));
  const input = new Float32Array(batch * 576);
  const runs = Math.ceil(windows / batch);
  const cpu0 = process.cpuUsage();
  for (let i = 0; i < runs; i++) {
    for (let r = 0; r < batch; r++) {
      const off = (((i * batch + r) * WINDOW) % (pcm.length / 2 - WINDOW)) * 2;
      for (let k = 0; k < WINDOW; k++) input[r * 576 + 64 + k] = pcm.readInt16LE(off + 2 * k) / 32768;
    }
    const j = i % ss.length;
    const out = await ss[j].run({ input: new ort.Tensor('float32', input, [batch, 576]), state: new ort.Tensor('float32', states[j], [2, batch, 128]), sr });
    states[j] = Float32Array.from(out.stateN.data as Float32Array);
  }
  const c = process.cpuUsage(cpu0);
  for (const s of ss) await s.release();
  const cpuPerWindow = (c.user + c.system) / 1e6 / (runs * batch);
  return cpuPerWindow * WINDOWS_PER_S;
}

/**
 * The cost of reaching a slot host, per batched job: the round trip seen by the caller minus the
 * run time the host reports, µs, over 500 jobs of `windows` windows one after another.
 */
async function ipcCost(isolation: 'process' | 'thread', windows: number): Promise<number> {
  const pool = await SlotPool.start({ kind: 'vad', model: silero.path! }, 1, slotFactory(isolation, 0));
  try {
    const job = (): Job => ({ kind: 'vad', windows: new Float32Array(windows * WINDOW).map(() => Math.random() * 0.1), state: new Float32Array(256), context: new Float32Array(64) });
    for (let i = 0; i < 50; i++) await pool.run(job());
    let overhead = 0;
    for (let i = 0; i < 500; i++) {
      const j = job();
      const t0 = performance.timeOrigin + performance.now();
      const r = await pool.run(j);
      const t1 = performance.timeOrigin + performance.now();
      overhead += t1 - t0 - (r.ran![1] - r.ran![0]);
    }
    return (overhead / 500) * 1000;
  } finally {
    await pool.close();
  }
}

/** Runs the benchmark and prints the table. */
export async function bench(o: BenchOptions): Promise<void> {
  const rows: string[] = [];
  const f = (x: number, d = 1): string => (Number.isFinite(x) ? x.toFixed(d) : '-');
  rows.push(`voxserve bench: silero-vad, ${o.frameMs} ms frames, ${o.seconds} s of speech per stream, ${o.slots} slot(s), max_batch_delay_ms ${o.batchDelayMs}, on ${(await import('node:os')).cpus().length} cores`);
  rows.push('');
  rows.push('isolation | streams | sustained | lag p50/p99 ms | event lag p50/p99 ms | server CPU s | client CPU s | server RSS MiB | mean batch | server CPU per stream-s ms | bare batched ms | ratio bare/server | per-client ms | streams/core server vs per-client');
  rows.push('---|---|---|---|---|---|---|---|---|---|---|---|---|---');
  const say = (line: string): boolean => process.stderr.write(`bench: ${line}\n`);
  say('per-client baseline: 8 sessions, 20,000 windows unbatched ...');
  const perClient = await bare(1, 8, 20_000);
  const batches = new Map<string, number>();
  const probabilityCost: string[] = [];
  let offPer = NaN;
  for (const n of o.streams) for (const isolation of o.isolation) for (const probabilities of o.probabilities ? [false, true] : [false]) {
    const r = await live(n, o, isolation, probabilities);
    batches.set(isolation, Math.max(batches.get(isolation) ?? 1, Math.round(r.meanBatch)));
    const serverPer = r.serverCpuS / r.streamSeconds;
    say(`bare batched baseline: batches of ${Math.max(1, Math.round(r.meanBatch))} windows ...`);
    const barePer = await bare(Math.max(1, Math.round(r.meanBatch)), 1, 20_000);
    if (!probabilities) offPer = serverPer;
    else probabilityCost.push(`${isolation} | ${n} | ${f(offPer * 1000, 3)} | ${f(serverPer * 1000, 3)} | ${f(serverPer / offPer, 2)}`);
    rows.push(
      [
        `${isolation}${probabilities ? ' +probabilities' : ''}`,
        r.streams,
        r.sustained,
        `${f(r.lagP50)} / ${f(r.lagP99)}`,
        `${f(r.eventLagP50, 0)} / ${f(r.eventLagP99, 0)}`,
        f(r.serverCpuS, 2),
        f(r.clientCpuS, 2),
        f(r.rssMiB, 0),
        f(r.meanBatch),
        f(serverPer * 1000, 3),
        f(barePer * 1000, 3),
        f(barePer / serverPer, 2),
        f(perClient * 1000, 3),
        `${f(1 / serverPer, 0)} vs ${f(1 / perClient, 0)} (${f(perClient / serverPer, 1)}x)`,
      ].join(' | '),
    );
    say(rows.at(-1)!);
  }
  if (probabilityCost.length) {
    rows.push('');
    rows.push('isolation | streams | server CPU per stream-s ms, off | with probabilities=true | ratio on/off');
    rows.push('---|---|---|---|---');
    rows.push(...probabilityCost);
  }
  rows.push('');
  rows.push('isolation | windows per batched job | IPC and dispatch per job µs (round trip - run time, mean of 500)');
  rows.push('---|---|---');
  for (const isolation of o.isolation) {
    const windows = Math.max(1, batches.get(isolation) ?? 32);
    say(`${isolation}: IPC cost, 500 jobs of ${windows} windows ...`);
    rows.push(`${isolation} | ${windows} | ${f(await ipcCost(isolation, windows), 0)}`);
  }
  process.stdout.write(`${rows.join('\n')}\n`);
}
