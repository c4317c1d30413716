/**
 * `voxserve bench --task wakeword`: live wake-word streams against a `voxserve serve` child
 * process, against the bare openWakeWord pipeline measured in the same run.
 *
 * - Live: N real-time WebSocket streams (16 kHz s16le, 100 ms frames by default, real espeak
 *   speech with the phrases looped, each frame sent when its audio has elapsed) on one model
 *   (`hey-jarvis`, or a group); server CPU (the server and its slot-host processes, from /proc)
 *   per stream-second, and the processing lag p50/p99 from the model's status.
 * - Bare: one onnxruntime-node session set on one thread (melspectrogram, embedding, heads) in a
 *   plain loop over the same audio, one 80 ms step at a time: CPU per stream-second.
 * - Batched bare: the melspectrogram and embedding of B streams' steps as one run of batch B,
 *   per stream, against B = 1: whether batching across streams pays on this CPU.
 */
import type { ChildProcess } from 'node:child_process';
import { mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { cpus, tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import ort from 'onnxruntime-node';
import WebSocket from 'ws';
import { defaultCatalog } from '../runtime/config.js';
import { OWW_EMBEDDING, OWW_MELSPECTROGRAM } from '../runtime/catalog.js';
import { paceFrames } from './pace.js';
import { treeCpuSeconds } from './proc.js';
import { spawnServer } from './spawn-server.js';

export interface WakeBenchOptions {
  /** Stream counts for the `hey-jarvis` live runs. */
  streams: number[];
  frameMs: number;
  /** Audio per stream, s. */
  seconds: number;
  slots: number;
  isolation: 'process' | 'thread';
  /** Streams for the 1 / 2 / 6 heads comparison. */
  headStreams: number;
}

const root = fileURLToPath(new URL('../..', import.meta.url));
const HEADS6 = ['alexa', 'hey-jarvis', 'hey-mycroft', 'hey-rhasspy', 'timer', 'weather'];
const STEP = 1280;
const STEPS_PER_S = 16000 / STEP;

/** 16 kHz mono s16le speech: the "alexa" phrase and an espeak sentence (both 16 kHz fixtures). */
function speechPcm(): Buffer {
  const pcm = (f: string): Buffer => readFileSync(join(root, 'spec/fixtures', f)).subarray(44);
  return Buffer.concat([pcm('espeak_alexa_16k.wav'), pcm('espeak_sentence_16k.wav')]);
}


async function startChild(n: number, o: WakeBenchOptions, model: string): Promise<{ child: ChildProcess; url: string }> {
  const dir = mkdtempSync(join(tmpdir(), 'voxserve-bench-wake-'));
  const config = join(dir, 'config.json');
  const heads = model.split(',');
  const catalog = defaultCatalog();
  const models =
    heads.length === 1
      ? [{ ...catalog.find((m) => m.id === model)!, slots: o.slots, max_streams: n + 16, lazy: false }]
      : [{ id: 'bench-group', task: 'wakeword', heads, slots: o.slots, max_streams: n + 16, lazy: false }];
  writeFileSync(config, JSON.stringify({ port: 0, log_level: 'warn', busy_timeout_ms: 0, isolation: o.isolation, limits: { max_ws_connections: n + 16, idle_ms: 0, heartbeat_ms: 0 }, models }));
  return spawnServer(['--config', config]);
}

interface Live {
  streams: number;
  sustained: number;
  lagP50: number;
  lagP99: number;
  cpuPerStreamS: number;
  /** Of which the server's main process (sockets, actors, framing, IPC to the slots). */
  mainPerStreamS: number;
}

/** CPU seconds of one process (not its children). */
function ownCpuSeconds(pid: number): number {
  const f = readFileSync(`/proc/${pid}/stat`, 'utf8').split(') ')[1].split(' ');
  return (Number(f[11]) + Number(f[12])) / 100;
}

/** N real-time streams on `model` (one id, or several joined by commas: a configured group). */
async function live(n: number, o: WakeBenchOptions, model: string): Promise<Live> {
  const { child, url } = await startChild(n, o, model);
  const id = model.includes(',') ? 'bench-group' : model;
  try {
    const pcm = speechPcm();
    const frameBytes = Math.round((16000 * o.frameMs) / 1000) * 2;
    const totalFrames = Math.round((o.seconds * 1000) / o.frameMs);
    interface S { ws: WebSocket; next: number; start: number; done: boolean; lastSentAt: number; doneAt: number }
    const streams = await Promise.all(
      Array.from({ length: n }, () =>
        new Promise<S>((resolve, reject) => {
          const s: S = { ws: new WebSocket(`${url.replace('http', 'ws')}/v1/stream?model=${id}`), next: 0, start: 0, done: false, lastSentAt: 0, doneAt: 0 };
          s.ws.on('error', reject);
          s.ws.on('message', (d) => {
            const e = JSON.parse(d.toString());
            if (e.type === 'ready') resolve(s);
            if (e.type === 'done') {
              s.done = true;
              s.doneAt = performance.now();
            }
          });
        }),
      ),
    );
    const cpu0 = treeCpuSeconds(child.pid!);
    const main0 = ownCpuSeconds(child.pid!);
    const t0 = performance.now();
    streams.forEach((s, i) => (s.start = t0 + (i / n) * o.frameMs));
    await paceFrames(streams, totalFrames, o.frameMs, (s, k) => {
      const off = (k * frameBytes) % (pcm.length - frameBytes);
      s.ws.send(pcm.subarray(off, off + frameBytes));
      if (k === totalFrames - 1) {
        s.lastSentAt = performance.now();
        s.ws.send(JSON.stringify({ type: 'end' }));
      }
    });
    const deadline = performance.now() + 30_000;
    while (streams.some((s) => !s.done) && performance.now() < deadline) await new Promise((r) => setTimeout(r, 20));
    // CPU per stream-second means something only once every stream's audio has been processed.
    const all = streams.every((s) => s.done);
    const cpu = all ? treeCpuSeconds(child.pid!) - cpu0 : NaN;
    const main = all ? ownCpuSeconds(child.pid!) - main0 : NaN;
    const status = (await (await fetch(`${url}/v1/models/${id}`)).json()) as { processing_lag_ms: { p50: number; p99: number } | null };
    for (const s of streams) s.ws.terminate();
    return {
      streams: n,
      sustained: streams.filter((s) => s.done && s.doneAt - s.lastSentAt < 1000).length,
      lagP50: status.processing_lag_ms?.p50 ?? NaN,
      lagP99: status.processing_lag_ms?.p99 ?? NaN,
      cpuPerStreamS: cpu / (n * o.seconds),
      mainPerStreamS: main / (n * o.seconds),
    };
  } finally {
    child.kill('SIGTERM');
    await new Promise((r) => child.on('exit', r));
  }
}

const OPTS: ort.InferenceSession.SessionOptions = { intraOpNumThreads: 1, interOpNumThreads: 1, executionMode: 'sequential', graphOptimizationLevel: 'all' };

/**
 * The bare pipeline: `batch` streams' 80 ms steps at a time (melspectrogram and embedding as runs
 * of batch `batch`, each head per stream as the heads take batch 1), over `steps` steps per
 * stream. Returns CPU ms per stream-second.
 */
async function bare(heads: string[], batch: number, steps: number): Promise<number> {
  const mel = await ort.InferenceSession.create(OWW_MELSPECTROGRAM, OPTS);
  const emb = await ort.InferenceSession.create(OWW_EMBEDDING, OPTS);
  const catalog = defaultCatalog();
  const hs = await Promise.all(heads.map((h) => ort.InferenceSession.create(catalog.find((m) => m.id === h)!.path!, OPTS)));
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
      for (let b = 0; b < batch; b++) x.set(samples.subarray(((s + b * 7) * STEP) % (samples.length - STEP - 480)).subarray(0, STEP + 480), b * (STEP + 480));
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
        for (let k = 0; k < hs.length; k++) await hs[k].run({ [hs[k].inputNames[0]]: new ort.Tensor('float32', embBuf.slice(embBuf.length - windows[k] * 96), [1, windows[k], 96]) });
      }
    }
    const c = process.cpuUsage(c0);
    cpu = (c.user + c.system) / 1000;
  }
  for (const s of [mel, emb, ...hs]) await s.release();
  return (cpu / (steps * batch)) * STEPS_PER_S;
}

/** Runs the wake-word benchmark and prints its tables. */
export async function benchWakeword(o: WakeBenchOptions): Promise<void> {
  const f = (x: number, d = 1): string => (Number.isFinite(x) ? x.toFixed(d) : '-');
  const out: string[] = [];
  const say = (line: string): void => {
    out.push(line);
    process.stderr.write(`progress: ${line}\n`);
  };
  say(`voxserve bench --task wakeword: ${o.frameMs} ms frames, ${o.seconds} s per stream, ${o.slots} slot(s), isolation ${o.isolation}, on ${cpus().length} cores`);
  const bare1 = await bare(['hey-jarvis'], 1, 1000);
  // What the machine can do at all: every core running the bare pipeline and nothing else.
  say(`bare hey-jarvis pipeline: ${f(bare1, 2)} ms of CPU per stream-second, so ${cpus().length} cores hold at most ${Math.floor((cpus().length * 1000) / bare1)} live streams`);
  say('');
  say('model | streams | sustained | lag p50/p99 ms | server CPU per stream-s ms (main process + slot hosts) | bare pipeline ms | server / bare');
  say('---|---|---|---|---|---|---');
  for (const n of o.streams) {
    const r = await live(n, o, 'hey-jarvis');
    say(`hey-jarvis | ${n} | ${r.sustained} | ${f(r.lagP50)} / ${f(r.lagP99)} | ${f(r.cpuPerStreamS * 1000, 2)} (${f(r.mainPerStreamS * 1000, 2)} + ${f((r.cpuPerStreamS - r.mainPerStreamS) * 1000, 2)}) | ${f(bare1, 2)} | ${f((r.cpuPerStreamS * 1000) / bare1, 2)}`);
  }
  say('');
  say(`heads per stream (${o.headStreams} streams) | sustained | lag p50/p99 ms | server CPU per stream-s ms | vs 1 head | bare ms | bare vs 1 head`);
  say('---|---|---|---|---|---|---');
  let one = NaN;
  let bareOne = NaN;
  for (const heads of [['hey-jarvis'], ['alexa', 'hey-jarvis'], HEADS6]) {
    const r = await live(o.headStreams, o, heads.join(','));
    const b = await bare(heads, 1, 600);
    if (heads.length === 1) {
      one = r.cpuPerStreamS;
      bareOne = b;
    }
    say(`${heads.length} (${heads.join(',')}) | ${r.sustained} | ${f(r.lagP50)} / ${f(r.lagP99)} | ${f(r.cpuPerStreamS * 1000, 2)} | ${f(r.cpuPerStreamS / one, 2)} | ${f(b, 2)} | ${f(b / bareOne, 2)}`);
  }
  say('');
  say('melspectrogram + embedding batched across B streams (bare, one thread) | CPU per stream-s ms | vs B = 1');
  say('---|---|---');
  const b1 = await bare([], 1, 600);
  for (const b of [1, 4, 8, 16]) {
    const v = b === 1 ? b1 : await bare([], b, Math.ceil(600 / b));
    say(`B = ${b} | ${f(v, 2)} | ${f(v / b1, 2)}`);
  }
  process.stdout.write(`${out.join('\n')}\n`);
}
