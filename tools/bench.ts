/**
 * `voxserve bench`: what share of the bare models' capacity the server holds, per workload (VAD
 * with 100 ms frames, VAD with 20 ms frames, wake words), in one run on this machine:
 *
 * - **bare limit**: streams the bare models could run on this machine's cores: cores x 1000 /
 *   (bare CPU ms per stream-second + the load generator's own CPU ms per stream-second). The bare
 *   loop (one onnxruntime-node session set on one thread, back to back, in a process of its own;
 *   see tools/bench-bare.ts) is measured in the same run: at the workload's start (the limit the
 *   search steps through, with the load generator's cost from a calibration run at 25 % of cores
 *   x 1000 / bare), after every run and at the end; the held share is judged against the limit
 *   from the medians of all of them (bare) and of the runs from 25 % up (load generator).
 * - **streams held**: the most streams for which every stream finishes (done within 1 s of its
 *   last frame) and the processing lag p99 stays under 100 ms over the whole run (from the
 *   server's `voxserve_processing_lag_seconds` histogram: at least 99 % of windows at or under
 *   its 0.1 s bucket), as a count and as a share of the limit; searched in steps of the limit
 *   from the target share up or down, in `rounds` rounds, median. The lag p99 is also shown for
 *   the run's three parts apart (the first second of audio, the steady part, and the end: the
 *   last results and every stream's close), to tell a server that falls behind from one that
 *   stumbles as streams start or end together.
 * - **server CPU per stream-second** (per second of audio the server processed in the window),
 *   main process and slot hosts apart (from /proc), against
 *   bare, at 10 %, 40 % and 70 % of the limit (and every other run); slot hosts also against the
 *   bare loop at the rows per run the server formed; main-process CPU per stream-second and the
 *   streams one core of ingress would carry. CPU is counted over the steady part of each run
 *   (from 1 s after the streams start to when their last frame is due), not their opening or
 *   closing.
 * - **events identical**: every stream sends the same audio, so every stream's events must be
 *   the same; a run where they are not is flagged.
 *
 * Each run starts a fresh `voxserve serve` child process and drives N real-time WebSocket
 * streams (16 kHz s16le, each frame sent when its audio has elapsed, starts spread over one
 * frame) from this process. Before its measured streams, the server gets a warm-up: N streams of
 * `warmUpS` seconds each, started and ended the same way, not measured. A server fresh from
 * start runs its first second or so of work several times slower (V8 has not compiled its hot
 * paths yet; the slot hosts meet each batch shape for the first time): at 240 VAD streams of
 * 100 ms frames, 0.6-23 % of a fresh server's windows came over 100 ms (about half the runs
 * stumbled in their first 0.5-1.5 s), 0.7-1.9 % after a 2-3 s warm-up (nearly all in the end).
 * A held count is a sustained figure, so it is measured warm; `--warm-up 0` measures fresh
 * servers.
 * `--streams` runs fixed counts instead of the search.
 */
import type { ChildProcess } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { cpus, loadavg } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import WebSocket from 'ws';
import { defaultCatalog } from '../runtime/config.js';
import { bareInChild } from './bench-bare.js';
import { paceFrames } from './pace.js';
import { cpuApart } from './proc.js';
import { spawnWithConfig, stopSpawned } from './spawn-server.js';

export type WorkloadName = 'vad100' | 'vad20' | 'wakeword';

export interface BenchOptions {
  /** Workloads to run, in order. */
  workloads: WorkloadName[];
  /** Rounds of the held search (median reported). */
  rounds: number;
  /** Audio per stream and run, s. */
  seconds: number;
  /** Step of the held search, as a share of the limit (0.05 = 5 %). */
  step: number;
  /** Server slots per model. */
  slots: number;
  isolation: 'process' | 'thread';
  /** The model's `max_batch_size` / `max_batch_delay_ms` (absent: the server's defaults). */
  batchSize?: number;
  batchDelayMs?: number;
  /** Fixed stream counts instead of the held search (for profiling). */
  streams?: number[];
  /** VAD streams ask for `probabilities=true` (a probability event per window). */
  probabilities?: boolean;
  /** Audio per stream of the warm-up each run's server gets before its measured streams, s (0: none). */
  warmUpS: number;
}

const root = fileURLToPath(new URL('../..', import.meta.url));
const CORES = cpus().length;
const fixture = (f: string): Buffer => readFileSync(join(root, 'spec/fixtures', f)).subarray(44); // 16 kHz mono s16le after the 44-byte header

/** One kind of stream the server is judged on. */
interface Workload {
  title: string;
  /** Model id on the wire, and its config entry. */
  id: string;
  model: Record<string, unknown>;
  frameMs: number;
  /** The held target, share of the limit. */
  target: number;
  pcm: Buffer;
  /**
   * Bare CPU ms per stream-second, with `rows` streams per run (VAD) or one at a time (wake
   * words); `short`: a shorter loop, for the figures measured beside each run; `idle`: the loop
   * sleeps `ms` before every `runs`-th run, as a slot host waits between batches (VAD; wake words: NaN).
   */
  bare(rows: number, short?: boolean, idle?: { ms: number; runs: number }): Promise<number>;
  /** Rows per run for the limit's bare figure. */
  limitRows: number;
  /** Samples per window (VAD) or step (wake word): the unit of the processing-lag histogram. */
  stepSamples: number;
  /** An event's identity for the identical-events check; null for events that are not task results. */
  eventKey(e: Record<string, unknown>): string | null;
}

const silero = defaultCatalog().find((m) => m.id === 'silero-vad')!;
const jarvis = defaultCatalog().find((m) => m.id === 'hey-jarvis')!;

const vadEvent = (e: Record<string, unknown>): string | null =>
  e.type === 'speech_start'
    ? `s${e.at_ms}`
    : e.type === 'speech_end'
      ? `e${e.start_ms}-${e.end_ms}:${e.confidence}`
      : null;

function workload(name: WorkloadName, o: BenchOptions): Workload {
  const batching = {
    ...(o.batchSize ? { max_batch_size: o.batchSize } : {}),
    ...(o.batchDelayMs !== undefined ? { max_batch_delay_ms: o.batchDelayMs } : {}),
  };
  if (name === 'wakeword') {
    return {
      title: 'wake word (hey-jarvis), 100 ms frames',
      id: 'hey-jarvis',
      model: { ...jarvis, ...batching },
      frameMs: 100,
      target: 0.7,
      pcm: Buffer.concat([fixture('espeak_alexa_16k.wav'), fixture('espeak_sentence_16k.wav')]),
      bare: (_rows, short, idle) =>
        idle ? Promise.resolve(Number.NaN) : bareInChild(['wakeword', 'hey-jarvis', 1, short ? 300 : 600]),
      limitRows: 1,
      stepSamples: 1280,
      eventKey: (e) => (e.type === 'detection' ? `${e.label}@${e.at_ms}:${e.score}` : null),
    };
  }
  const frameMs = name === 'vad20' ? 20 : 100;
  return {
    title: `VAD (silero-vad), ${frameMs} ms frames`,
    id: 'silero-vad',
    model: { ...silero, ...batching },
    frameMs,
    target: name === 'vad20' ? 0.6 : 0.7,
    pcm: fixture('espeak_sentence_16k.wav'),
    bare: (rows, short, idle = { ms: 0, runs: 1 }) =>
      bareInChild(['vad', rows, short ? 6000 : 20_000, idle.ms.toFixed(2), idle.runs]),
    // The server's default max_batch_size: the largest run it forms.
    limitRows: 32,
    stepSamples: 512,
    eventKey: vadEvent,
  };
}

/** A server for one run (its config's folder is removed once it has exited). */
function startServer(w: Workload, n: number, o: BenchOptions): Promise<{ child: ChildProcess; url: string }> {
  return spawnWithConfig({
    port: 0,
    log_level: 'warn',
    busy_timeout_ms: 0,
    isolation: o.isolation,
    limits: { max_ws_connections: n + 16, idle_ms: 0, heartbeat_ms: 0 },
    models: [{ ...w.model, slots: o.slots, max_streams: n + 16, lazy: false }],
  });
}

/** The model's metric samples that a run reads, summed over label sets: `name{le=...}` keeps its `le`. */
async function scrape(url: string, id: string): Promise<Map<string, number>> {
  const text = await (await fetch(`${url}/metrics`)).text();
  const out = new Map<string, number>();
  for (const line of text.split('\n')) {
    if (!line.startsWith('voxserve_') || !line.includes(`model="${id}"`)) continue;
    const name = line.slice(0, line.search(/[{ ]/));
    const le = /le="([^"]+)"/.exec(line)?.[1];
    const key = le ? `${name}{${le}}` : name;
    out.set(key, (out.get(key) ?? 0) + Number(line.split(' ').at(-1)));
  }
  return out;
}

const LAG_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30];

/** p99 of the lag, ms, from histogram bucket counts (linear within its bucket), and the share of windows at or under 100 ms. */
function lagFrom(
  before: Map<string, number>,
  after: Map<string, number>,
): { p99: number; under100: number; windows: number } {
  const d = (k: string): number => (after.get(k) ?? 0) - (before.get(k) ?? 0);
  const total = d('voxserve_processing_lag_seconds_count');
  if (!total) return { p99: NaN, under100: NaN, windows: 0 };
  let prevLe = 0;
  let prevCum = 0;
  let p99 = Infinity;
  for (const le of LAG_BUCKETS) {
    const cum = d(`voxserve_processing_lag_seconds_bucket{${le}}`);
    if (cum >= 0.99 * total) {
      p99 = (prevLe + ((0.99 * total - prevCum) / Math.max(1, cum - prevCum)) * (le - prevLe)) * 1000;
      break;
    }
    prevLe = le;
    prevCum = cum;
  }
  return { p99, under100: d('voxserve_processing_lag_seconds_bucket{0.1}') / total, windows: total };
}

interface Run {
  streams: number;
  share: number;
  finished: number;
  lagP99: number;
  /** The lag p99 of the first second of audio, the steady part and the end, ms. */
  lagParts: [number, number, number];
  under100: number;
  held: boolean;
  /** CPU ms per stream-second over the steady window. */
  main: number;
  hosts: number;
  client: number;
  /** Streams per batched job, mean. */
  rows: number;
  /** Slot run time (wall) per stream-second, ms. */
  runMs: number;
  /** How long a slot idled between two batches in the steady window, mean, ms. */
  idleMs: number;
  /** Windows (or steps) per row of a batch in the steady window, mean. */
  stepsPerRow: number;
  /** Streams whose events differ from the most common sequence. */
  differ: number;
  load: number;
  /**
   * The bare loop, ms per stream-second, that this run's ratios are against: `bare` at the limit's
   * rows, the median of every such figure of the workload so far (at its start and after each
   * run, this one included); `sameBare` at the rows per run the server formed, measured right
   * after this run; `idleBare` at those rows with the slots' mean idle between runs (`idleMs`). The
   * machine's speed moves by tens of percent from one second to the next and drifts over minutes:
   * one figure is not a baseline.
   */
  bare: number;
  sameBare: number;
  idleBare: number;
}

/** N real-time streams against a new server (after its warm-up); CPU over the steady window. */
async function live(
  w: Workload,
  n: number,
  share: number,
  o: BenchOptions,
): Promise<Omit<Run, 'bare' | 'sameBare' | 'idleBare'>> {
  const { child, url } = await startServer(w, n, o);
  const pid = child.pid!;
  try {
    const frameBytes = Math.round((16000 * w.frameMs) / 1000) * 2;
    const totalFrames = Math.round((o.seconds * 1000) / w.frameMs);
    const wsUrl = `${url.replace('http', 'ws')}/v1/stream?model=${w.id}${o.probabilities && w.id === 'silero-vad' ? '&probabilities=true' : ''}`;
    interface S {
      ws: WebSocket;
      next: number;
      start: number;
      done: boolean;
      lastSentAt: number;
      doneAt: number;
      events: string[];
    }
    /** N streams, each open and `ready`. */
    const open = (): Promise<S[]> =>
      Promise.all(
        Array.from(
          { length: n },
          () =>
            new Promise<S>((resolve, reject) => {
              const s: S = {
                ws: new WebSocket(wsUrl, { perMessageDeflate: false }),
                next: 0,
                start: 0,
                done: false,
                lastSentAt: 0,
                doneAt: 0,
                events: [],
              };
              s.ws.on('error', reject);
              s.ws.on('message', (d) => {
                const e = JSON.parse(d.toString()) as Record<string, unknown>;
                const key = w.eventKey(e);
                if (key) s.events.push(key);
                else if (e.type === 'ready') resolve(s);
                else if (e.type === 'done') {
                  s.done = true;
                  s.doneAt = performance.now();
                }
              });
            }),
        ),
      );
    /** Every stream's frames in real time from `t0` (starts spread over one frame), then `end`; `onTick` as {@link paceFrames}'s. */
    const drive = (streams: S[], frames: number, t0: number, onTick?: (now: number) => void): Promise<void> => {
      streams.forEach((s, i) => (s.start = t0 + (i / n) * w.frameMs));
      return paceFrames(
        streams,
        frames,
        w.frameMs,
        (s, k) => {
          const off = (k * frameBytes) % (w.pcm.length - frameBytes);
          s.ws.send(w.pcm.subarray(off, off + frameBytes));
          if (k === frames - 1) {
            s.lastSentAt = performance.now();
            s.ws.send('{"type":"end"}');
          }
        },
        onTick,
      );
    };
    const finish = async (streams: S[]): Promise<void> => {
      const deadline = performance.now() + 30_000;
      while (streams.some((s) => !s.done) && performance.now() < deadline) await new Promise((r) => setTimeout(r, 20));
    };
    // The warm-up: the same streams' worth of audio through the new server first, not measured (see the file's docstring).
    if (o.warmUpS > 0) {
      const warmUp = await open();
      await drive(warmUp, Math.max(1, Math.round((o.warmUpS * 1000) / w.frameMs)), performance.now());
      await finish(warmUp);
      // Closed before the measured streams open (the server's connection limit is the run's streams + 16).
      const closed = warmUp.map((s) =>
        s.ws.readyState === WebSocket.CLOSED ? null : new Promise((r) => s.ws.once('close', r)),
      );
      for (const s of warmUp) s.ws.close();
      await Promise.race([Promise.all(closed), new Promise((r) => setTimeout(r, 5000))]);
      for (const s of warmUp) s.ws.terminate();
    }
    const streams = await open();
    const before = await scrape(url, w.id);
    // CPU at the window's edges, and the windows (or steps) processed by then (the scrape's own cost is small).
    const snap = (): {
      at: number;
      server: { main: number; hosts: number };
      client: NodeJS.CpuUsage;
      metrics: Promise<Map<string, number>>;
    } => ({
      at: performance.now(),
      server: cpuApart(pid),
      client: process.cpuUsage(),
      metrics: scrape(url, w.id),
    });
    const t0 = performance.now();
    const warm = Math.min(1000, (o.seconds * 1000) / 4);
    let c0: ReturnType<typeof snap> | null = null;
    let c1: ReturnType<typeof snap> | null = null;
    await drive(streams, totalFrames, t0, (now) => {
      if (!c0 && now >= t0 + warm) c0 = snap();
      if (!c1 && now >= t0 + o.seconds * 1000) c1 = snap();
    });
    c1 ??= snap();
    await finish(streams);
    const after = await scrape(url, w.id);
    const a = c0!;
    const b = c1 as ReturnType<typeof snap>;
    // For profiling (`perf record -k CLOCK_MONOTONIC`, then `perf report --time A,B`): the window on the monotonic clock, s.
    const mono = (at: number): string =>
      ((Number(process.hrtime.bigint()) / 1e6 - (performance.now() - at)) / 1000).toFixed(6);
    if (process.env.VOXSERVE_BENCH_MARKS) process.stderr.write(`bench-window: ${mono(a.at)},${mono(b.at)}\n`);
    // Stream-seconds processed in the window: when the server falls behind, its CPU goes to fewer of them.
    const [ma, mb] = [await a.metrics, await b.metrics];
    const windows = (m: Map<string, number>): number => m.get('voxserve_processing_lag_seconds_count') ?? 0;
    const streamS = ((windows(mb) - windows(ma)) * w.stepSamples) / 16000;
    const lag = lagFrom(before, after);
    const finished = streams.filter((s) => s.done && s.doneAt - s.lastSentAt < 1000).length;
    const seqs = new Map<string, number>();
    for (const s of streams) seqs.set(s.events.join(' '), (seqs.get(s.events.join(' ')) ?? 0) + 1);
    const batches = (after.get('voxserve_batch_size_count') ?? 0) - (before.get('voxserve_batch_size_count') ?? 0);
    const rows = (after.get('voxserve_batch_size_sum') ?? 0) - (before.get('voxserve_batch_size_sum') ?? 0);
    const between = (m0: Map<string, number>, m1: Map<string, number>, name: string): number =>
      (m1.get(name) ?? 0) - (m0.get(name) ?? 0);
    const runS = between(before, after, 'voxserve_inference_duration_seconds_sum');
    // The slots' time not spent in a run, over the steady window's runs.
    const idleS = o.slots * ((b.at - a.at) / 1000) - between(ma, mb, 'voxserve_inference_duration_seconds_sum');
    for (const s of streams) s.ws.terminate();
    return {
      streams: n,
      share,
      finished,
      lagP99: lag.p99,
      lagParts: [lagFrom(before, ma).p99, lagFrom(ma, mb).p99, lagFrom(mb, after).p99],
      under100: lag.under100,
      held: finished === n && lag.under100 >= 0.99,
      main: ((b.server.main - a.server.main) * 1000) / streamS,
      hosts: ((b.server.hosts - a.server.hosts) * 1000) / streamS,
      client: (b.client.user + b.client.system - a.client.user - a.client.system) / 1000 / ((n * (b.at - a.at)) / 1000),
      rows: batches ? rows / batches : 1,
      runMs: (runS * 1000) / (n * o.seconds),
      idleMs: Math.max(0, (idleS * 1000) / Math.max(1, between(ma, mb, 'voxserve_batch_size_count'))),
      stepsPerRow: (windows(mb) - windows(ma)) / Math.max(1, between(ma, mb, 'voxserve_batch_size_sum')),
      differ: n - Math.max(...seqs.values()),
      load: loadavg()[0],
    };
  } finally {
    child.kill('SIGTERM');
    await new Promise((r) => child.on('exit', r));
  }
}

const f = (x: number, d = 1): string => (Number.isFinite(x) ? x.toFixed(d) : x === Infinity ? 'inf' : '-');
/**
 * Streams the machine's cores could run at `msPerStream` ms CPU per stream-second: whole streams
 * (floored), so that a share printed beside a limit is of the figure printed.
 */
const limitFor = (msPerStream: number): number => Math.floor((CORES * 1000) / msPerStream);

/** The median (of an even count, the mean of the two middle values). */
const median = (xs: number[]): number => {
  const s = [...xs].sort((a, b) => a - b);
  const m = (s.length - 1) / 2;
  return (s[Math.floor(m)] + s[Math.ceil(m)]) / 2;
};

/** Runs the benchmark and prints its tables (progress on stderr). */
export async function bench(o: BenchOptions): Promise<void> {
  // Interrupted (SIGINT, SIGTERM to this process alone): the run's server is stopped too, not left running.
  const interrupted = (signal: NodeJS.Signals): void => {
    stopSpawned();
    process.exit(signal === 'SIGINT' ? 130 : 143);
  };
  process.once('SIGINT', interrupted).once('SIGTERM', interrupted);
  const out: string[] = [];
  const say = (line = ''): void => {
    out.push(line);
    process.stderr.write(`bench: ${line}\n`);
  };
  const started = loadavg();
  say(
    `voxserve bench: ${o.seconds} s per stream and run after a warm-up of ${o.warmUpS} s, ${o.slots} slot(s), isolation ${o.isolation}, ${o.streams ? `stream counts ${o.streams.join(', ')}` : `${o.rounds} round(s)`}, on ${CORES} cores; load average at start ${started.map((x) => x.toFixed(2)).join(' ')}`,
  );
  const summary: string[] = [];
  for (const name of o.workloads) {
    const w = workload(name, o);
    say();
    say(`## ${w.title}`);
    const bare0 = await w.bare(w.limitRows);
    const runs: Run[] = [];
    /** Every bare figure at the limit's rows in this workload. */
    const bares = [bare0];
    let limit = limitFor(bare0);
    const row = (r: Run): string =>
      [
        `${f(r.share * 100, 0)} %`,
        r.streams,
        r.held ? 'yes' : 'no',
        `${r.finished}/${r.streams}`,
        `${f(r.lagP99, 0)} (${r.lagParts.map((x) => f(x, 0)).join(' / ')})`,
        f(r.under100 * 100, 2),
        `${f(r.main + r.hosts, 2)} (${f(r.main, 2)} + ${f(r.hosts, 2)})`,
        f((r.main + r.hosts) / r.bare, 2),
        f(r.hosts / r.sameBare, 2),
        `${f(r.hosts / r.idleBare, 2)} (${f(r.idleMs, 1)})`,
        f(r.main / r.bare, 2),
        f(r.client, 2),
        f(r.rows, 1),
        f(r.runMs / r.sameBare, 2),
        r.differ ? `NO: ${r.differ} differ` : 'yes',
        f(r.load, 1),
      ].join(' | ');
    const header = (): void => {
      say(
        'share of limit | streams | held | finished | lag p99 ms (start / steady / end) | windows <= 100 ms % | server CPU ms per stream-s (main + hosts) | server / bare | hosts / bare at same rows | hosts / bare at same rows and idle (slot idle between batches, ms) | main / bare | client ms per stream-s | rows per batch | slot run time / bare at same rows | events identical | load avg',
      );
      say('---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---');
    };
    const runAt = async (share: number, n = Math.max(1, Math.round(share * limit))): Promise<Run> => {
      const run = await live(w, n, share, o);
      bares.push(await w.bare(w.limitRows, true));
      const rows = Math.max(1, Math.round(run.rows));
      const sameBare = w.limitRows === 1 || rows === w.limitRows ? bares.at(-1)! : await w.bare(rows, true);
      const idleBare = await w.bare(rows, true, { ms: run.idleMs, runs: Math.max(1, Math.round(run.stepsPerRow)) });
      const r = { ...run, bare: median(bares), sameBare, idleBare };
      runs.push(r);
      say(row(r));
      return r;
    };
    if (o.streams) {
      say(`bare: ${f(bare0, 3)} ms CPU per stream-second (${w.limitRows} row(s) per run, one thread)`);
      header();
      for (const n of o.streams) await runAt(n / limit, n);
      continue;
    }
    // The load generator's own cost per stream-second, from a calibration run.
    say(
      `bare: ${f(bare0, 3)} ms CPU per stream-second (${w.limitRows} row(s) per run, one thread); calibrating the load generator at 25 % of ${f(limit, 0)} streams`,
    );
    header();
    const cal = await runAt(0.25);
    limit = limitFor(bare0 + cal.client);
    for (const r of runs) r.share = r.streams / limit;
    say(
      `limit: ${CORES} cores x 1000 / (bare ${f(bare0, 3)} + load generator ${f(cal.client, 3)}) = ${f(limit, 0)} streams`,
    );
    const at: Record<number, Run> = {};
    for (const share of [0.1, 0.4]) at[share] = await runAt(share);
    const rounds: number[] = [];
    for (let round = 0; round < o.rounds; round++) {
      let share = w.target;
      let best = 0;
      let r = await runAt(share);
      if (share === 0.7) at[0.7] ??= r;
      if (r.held) {
        best = r.streams;
        while (share + o.step <= 1.5) {
          share = Math.round((share + o.step) * 100) / 100;
          r = await runAt(share);
          if (!r.held) break;
          best = r.streams;
        }
      } else {
        while (share - o.step >= 0.05) {
          share = Math.round((share - o.step) * 100) / 100;
          r = await runAt(share);
          if (r.held) {
            best = r.streams;
            break;
          }
        }
      }
      rounds.push(best);
      say(`round ${round + 1}: held ${best} streams (${f((best / limit) * 100, 0)} % of the search's limit)`);
    }
    at[0.7] ??= await runAt(0.7);
    // The bare loop again at the end. The limit the held share is judged against: the medians of
    // every bare figure at the limit's rows (start, end, after each run) and of the load
    // generator's cost in the runs from 25 % of the search's limit up; one figure from the start
    // alone swung the share by a third when the machine's speed moved within the workload.
    const bare1 = await w.bare(w.limitRows);
    bares.push(bare1);
    const bare = median(bares);
    const client = median(runs.filter((r) => r.share >= 0.25).map((r) => r.client));
    const searched = limit;
    limit = limitFor(bare + client);
    const held = median(rounds);
    say(
      `bare: ${f(bare0, 3)} at start, ${f(bare1, 3)} at end, median ${f(bare, 3)} of ${bares.length} (${f(Math.min(...bares), 3)}-${f(Math.max(...bares), 3)}) ms per stream-second; load generator: median ${f(client, 3)}`,
    );
    say(
      `limit over the workload: ${CORES} cores x 1000 / (bare ${f(bare, 3)} + load generator ${f(client, 3)}) = ${f(limit, 0)} streams (the search's, from the start: ${f(searched, 0)})`,
    );
    say(
      `held: ${rounds.join(', ')} streams, median ${held} = ${f((held / limit) * 100, 0)} % of the limit ${f(limit, 0)} (target ${f(w.target * 100, 0)} %)`,
    );
    const steady = [0.1, 0.4, 0.7].map((s) => at[s]);
    const mainMs = median(steady.map((r) => r.main));
    const ratios = (part: (r: Run) => number): string => steady.map((r) => f(part(r) / bare, 2)).join(' / ');
    say(
      `server CPU per stream-s at 10 / 40 / 70 % of the search's limit: ${steady.map((r) => f(r.main + r.hosts, 2)).join(' / ')} ms = ${ratios((r) => r.main + r.hosts)}x bare (target <= 1.15); slot hosts ${ratios((r) => r.hosts)}x bare`,
    );
    say(
      `main process: ${steady.map((r) => f(r.main, 3)).join(' / ')} ms per stream-s = ${ratios((r) => r.main)}x bare; one core of ingress carries about ${f(1000 / mainMs, 0)} streams`,
    );
    summary.push(
      [
        w.title,
        f(bare, 3),
        f(client, 3),
        f(limit, 0),
        `${held} (${rounds.join(', ')})`,
        `${f((held / limit) * 100, 0)} % (${f(w.target * 100, 0)} %)`,
        ratios((r) => r.main + r.hosts),
        ratios((r) => r.hosts),
        ratios((r) => r.main),
        f(1000 / mainMs, 0),
      ].join(' | '),
    );
  }
  if (summary.length) {
    say();
    say('## Summary');
    say(
      'workload | bare ms per stream-s | load generator ms per stream-s | limit (streams) | held, median (rounds) | held / limit (target) | server / bare at 10/40/70 % | slot hosts / bare | main / bare | streams per core of ingress',
    );
    say('---|---|---|---|---|---|---|---|---|---');
    for (const s of summary) say(s);
  }
  say();
  say(
    `load average at start ${started.map((x) => x.toFixed(2)).join(' ')}, at end ${loadavg()
      .map((x) => x.toFixed(2))
      .join(' ')}`,
  );
  // A terminal has seen every line as progress on stderr; a file or pipe gets the tables alone.
  if (!process.stdout.isTTY || !process.stderr.isTTY) process.stdout.write(`${out.join('\n')}\n`);
}
