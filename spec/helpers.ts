import { readFileSync } from 'node:fs';
import { connect } from 'node:net';
import { fileURLToPath } from 'node:url';
import { createRequire } from 'node:module';
import type { Tensor } from 'onnxruntime-node';
import WebSocket from 'ws';
import { SILERO_V6 } from '../runtime/catalog.js';
import { ServerConfig } from '../runtime/config.js';
import { startServer, type ServerOptions, type VoxServer } from '../transport/server.js';

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

/**
 * Starts a server for a spec: `fields` (server config, as in a config file) over a silent log and a
 * free port; `options` are {@link startServer}'s test seams (a fake loader, ...).
 */
export function startTestServer(fields: Record<string, unknown> = {}, options?: ServerOptions): Promise<VoxServer> {
  return startServer(ServerConfig.parse({ log_level: 'silent', port: 0, ...fields }), options);
}

/** Polls `pred` every 5 ms until it holds; throws after `ms`. */
export async function until(pred: () => boolean | Promise<boolean>, ms = 5000): Promise<void> {
  const end = Date.now() + ms;
  while (!(await pred())) {
    if (Date.now() > end) throw new Error('condition not reached');
    await new Promise((r) => setTimeout(r, 5));
  }
}

/**
 * The sum of a Prometheus series' samples in `<url>/metrics` (a counter, or a histogram's `_count` or `_bucket`)
 * whose labels include every one of `labels`; 0 when none. Throws past 5 s without an answer.
 */
export async function metric(url: string, name: string, labels: Record<string, string> = {}): Promise<number> {
  const text = await (await fetch(`${url}/metrics`, { signal: AbortSignal.timeout(5000) })).text();
  let sum = 0;
  for (const line of text.split('\n')) {
    if (!line.startsWith(`${name}{`) && !line.startsWith(`${name} `)) continue;
    if (Object.entries(labels).every(([k, v]) => line.includes(`${k}="${v}"`))) sum += Number(line.split(' ').pop());
  }
  return sum;
}

/**
 * Streams 16 kHz 16-bit PCM to a stream URL (`ws://.../v1/stream?...`) in 100 ms frames once
 * `ready` arrives, then `end`; resolves with every event (parsed JSON) and the close code.
 */
export function streamPcm(url: string, pcm: Buffer): Promise<{ events: Record<string, unknown>[]; code: number }> {
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(url);
    const events: Record<string, unknown>[] = [];
    ws.on('error', reject);
    ws.on('message', (d) => {
      const e = JSON.parse(d.toString());
      events.push(e);
      if (e.type !== 'ready') return;
      for (let o = 0; o < pcm.length; o += 3200) ws.send(pcm.subarray(o, o + 3200));
      ws.send(JSON.stringify({ type: 'end' }));
    });
    ws.on('close', (code) => resolve({ events, code }));
  });
}

/** The wake-word models a Wyoming `describe` answer lists (its first `wake` program). */
export interface WyomingInfo {
  wake: { models: { name: string; phrase: string }[] }[];
}

/**
 * Asks a Wyoming server (`uri`, `tcp://host:port`) to `describe` itself on a new connection and
 * returns the `info` event's data: the header line, then `data_length` bytes of JSON on the next.
 */
export async function wyomingDescribe(uri: string): Promise<WyomingInfo> {
  const { hostname, port } = new URL(uri.replace('tcp:', 'http:'));
  const socket = connect(Number(port), hostname);
  socket.on('error', () => {});
  socket.write('{"type":"describe"}\n');
  let text = '';
  socket.on('data', (d) => (text += d));
  await until(() => {
    const [header, rest = ''] = text.split(/\n(.*)/s);
    return !!header && Buffer.byteLength(rest) >= (JSON.parse(header) as { data_length: number }).data_length;
  }, 10_000);
  socket.destroy();
  return JSON.parse(text.split(/\n(.*)/s)[1]) as WyomingInfo;
}

/**
 * One line of `fixtures/REFERENCE.jsonl` (copied from the shared fixtures): independent expected values for a fixture.
 */
export interface Reference {
  file: string;
  seconds: number;
  /** Silero VAD v5 segments, ms. */
  segments: { start_ms: number; end_ms: number }[];
  /** Silero VAD v6 segments, ms. */
  segments_v6: { start_ms: number; end_ms: number }[];
  wakeword_max: Record<string, number>;
}

/** Every line of REFERENCE.jsonl. */
export function references(): Reference[] {
  return fixture('REFERENCE.jsonl')
    .toString('utf8')
    .split('\n')
    .filter(Boolean)
    .map((l) => JSON.parse(l) as Reference);
}

/** The REFERENCE.jsonl line of `file`. */
export function reference(file: string): Reference {
  const line = references().find((r) => r.file === file);
  if (!line) throw new Error(`no REFERENCE.jsonl line for ${file}`);
  return line;
}

/** Asserts that `got` has the reference's segments, each boundary within `toleranceMs`. */
export function expectSegments(
  got: { start_ms: number; end_ms: number }[],
  want: { start_ms: number; end_ms: number }[],
  toleranceMs: number,
): void {
  const far = (a: number, b: number): boolean => Math.abs(a - b) > toleranceMs;
  const bad =
    got.length !== want.length ||
    got.some((g, i) => far(g.start_ms, want[i].start_ms) || far(g.end_ms, want[i].end_ms));
  if (bad)
    throw new Error(
      `segments differ from the reference by more than ${toleranceMs} ms:\n got  ${JSON.stringify(got.map((s) => [s.start_ms, s.end_ms]))}\n want ${JSON.stringify(want.map((s) => [s.start_ms, s.end_ms]))}`,
    );
}

/**
 * Opens a WebSocket to `url` (ws://...): the status and body of a handshake the server answers
 * without upgrading, or status 101 (then the socket is closed) when it upgrades.
 */
export function handshake(url: string): Promise<{ status: number; body: string }> {
  return new Promise((resolve) => {
    const ws = new WebSocket(url);
    ws.on('error', () => {});
    ws.on('unexpected-response', (_req, res) => {
      let body = '';
      res.on('data', (d: Buffer) => (body += d));
      res.on('end', () => resolve({ status: res.statusCode ?? 0, body }));
    });
    ws.on('open', () => {
      ws.close();
      resolve({ status: 101, body: '' });
    });
  });
}

/**
 * Silero VAD v6's speech probability for each 512-sample window of 16 kHz `audio` (the last
 * window zero-padded), computed here with onnxruntime-node as Silero's own wrapper computes it
 * (OnnxWrapper.__call__ in silero-vad's utils_vad.py, as get_speech_timestamps calls it): each
 * window preceded by the last 64 samples of the one before (zeros at first), the state [2, 1, 128]
 * carried from window to window. An independent reference for the server's VAD.
 */
export async function sileroWindowProbs(audio: Float32Array): Promise<number[]> {
  // Loaded here, not at the top: most suites that import these helpers never run a model.
  const { default: ort } = await import('onnxruntime-node');
  const session = await ort.InferenceSession.create(SILERO_V6);
  let state: Tensor = new ort.Tensor('float32', new Float32Array(2 * 128), [2, 1, 128]);
  let context = new Float32Array(64);
  const sr = new ort.Tensor('int64', BigInt64Array.from([16000n]), []);
  const probs: number[] = [];
  for (let at = 0; at < audio.length; at += 512) {
    const x = new Float32Array(64 + 512);
    x.set(context, 0);
    x.set(audio.subarray(at, at + 512), 64);
    const out = await session.run({ input: new ort.Tensor('float32', x, [1, 576]), state, sr });
    probs.push((out.output.data as Float32Array)[0]);
    state = out.stateN as Tensor;
    context = x.slice(-64);
  }
  await session.release();
  return probs;
}

const SR = 16_000;

/** get_speech_timestamps's segmentation parameters (utils_vad.py names; absent = its defaults). */
export interface SileroParams {
  threshold?: number;
  min_speech_duration_ms?: number;
  max_speech_duration_s?: number;
  min_silence_duration_ms?: number;
  speech_pad_ms?: number;
  min_silence_at_max_speech?: number;
  use_max_poss_sil_at_max_speech?: boolean;
}

/**
 * get_speech_timestamps (silero-vad src/silero_vad/utils_vad.py, commit 806dcba) after its
 * probability loop, at 16 kHz, in samples: written out from Silero's Python, line by line, as the
 * independent reference for the server's VAD segments (fed with {@link sileroWindowProbs}).
 */
export function getSpeechTimestamps(
  speechProbs: number[],
  audioLengthSamples: number,
  p: SileroParams,
): { start: number; end: number }[] {
  const threshold = p.threshold ?? 0.5;
  const minSpeechDurationMs = p.min_speech_duration_ms ?? 250;
  const maxSpeechDurationS = p.max_speech_duration_s ?? Infinity;
  const minSilenceDurationMs = p.min_silence_duration_ms ?? 100;
  const speechPadMs = p.speech_pad_ms ?? 30;
  const minSilenceAtMaxSpeech = p.min_silence_at_max_speech ?? 98;
  const useMaxPossSilAtMaxSpeech = p.use_max_poss_sil_at_max_speech ?? true;
  const windowSizeSamples = 512;
  const minSpeechSamples = (SR * minSpeechDurationMs) / 1000;
  const speechPadSamples = (SR * speechPadMs) / 1000;
  const maxSpeechSamples = SR * maxSpeechDurationS - windowSizeSamples - 2 * speechPadSamples;
  const minSilenceSamples = (SR * minSilenceDurationMs) / 1000;
  const minSilenceSamplesAtMaxSpeech = (SR * minSilenceAtMaxSpeech) / 1000;

  let triggered = false;
  const speeches: { start: number; end?: number }[] = [];
  let currentSpeech: { start?: number; end?: number } = {};
  const negThreshold = Math.max(threshold - 0.15, 0.01);
  let tempEnd = 0;
  let prevEnd = 0;
  let nextStart = 0;
  let possibleEnds: [number, number][] = [];

  for (let i = 0; i < speechProbs.length; i++) {
    const speechProb = speechProbs[i];
    const curSample = windowSizeSamples * i;
    if (speechProb >= threshold && tempEnd) {
      const silDur = curSample - tempEnd;
      if (silDur > minSilenceSamplesAtMaxSpeech) possibleEnds.push([tempEnd, silDur]);
      tempEnd = 0;
      if (nextStart < prevEnd) nextStart = curSample;
    }
    if (speechProb >= threshold && !triggered) {
      triggered = true;
      currentSpeech.start = curSample;
      continue;
    }
    if (triggered && curSample - currentSpeech.start! > maxSpeechSamples) {
      if (useMaxPossSilAtMaxSpeech && possibleEnds.length) {
        let best = possibleEnds[0];
        for (const e of possibleEnds) if (e[1] > best[1]) best = e;
        const dur = best[1];
        prevEnd = best[0];
        currentSpeech.end = prevEnd;
        speeches.push(currentSpeech as { start: number });
        currentSpeech = {};
        nextStart = prevEnd + dur;
        if (nextStart < prevEnd + curSample) currentSpeech.start = nextStart;
        else triggered = false;
        prevEnd = nextStart = tempEnd = 0;
        possibleEnds = [];
      } else if (prevEnd) {
        currentSpeech.end = prevEnd;
        speeches.push(currentSpeech as { start: number });
        currentSpeech = {};
        if (nextStart < prevEnd) triggered = false;
        else currentSpeech.start = nextStart;
        prevEnd = nextStart = tempEnd = 0;
        possibleEnds = [];
      } else {
        currentSpeech.end = curSample;
        speeches.push(currentSpeech as { start: number });
        currentSpeech = {};
        prevEnd = nextStart = tempEnd = 0;
        triggered = false;
        possibleEnds = [];
        continue;
      }
    }
    if (speechProb < negThreshold && triggered) {
      if (!tempEnd) tempEnd = curSample;
      const silDurNow = curSample - tempEnd;
      if (!useMaxPossSilAtMaxSpeech && silDurNow > minSilenceSamplesAtMaxSpeech) prevEnd = tempEnd;
      if (silDurNow < minSilenceSamples) continue;
      currentSpeech.end = tempEnd;
      if (currentSpeech.end - currentSpeech.start! > minSpeechSamples)
        speeches.push(currentSpeech as { start: number });
      currentSpeech = {};
      prevEnd = nextStart = tempEnd = 0;
      triggered = false;
      possibleEnds = [];
    }
  }
  if (currentSpeech.start !== undefined && audioLengthSamples - currentSpeech.start > minSpeechSamples) {
    currentSpeech.end = audioLengthSamples;
    speeches.push(currentSpeech as { start: number });
  }
  const out = speeches as { start: number; end: number }[];
  for (let i = 0; i < out.length; i++) {
    const speech = out[i];
    if (i === 0) speech.start = Math.trunc(Math.max(0, speech.start - speechPadSamples));
    if (i !== out.length - 1) {
      const silenceDuration = out[i + 1].start - speech.end;
      if (silenceDuration < 2 * speechPadSamples) {
        speech.end += Math.trunc(Math.floor(silenceDuration / 2));
        out[i + 1].start = Math.trunc(Math.max(0, out[i + 1].start - Math.floor(silenceDuration / 2)));
      } else {
        speech.end = Math.trunc(Math.min(audioLengthSamples, speech.end + speechPadSamples));
        out[i + 1].start = Math.trunc(Math.max(0, out[i + 1].start - speechPadSamples));
      }
    } else {
      speech.end = Math.trunc(Math.min(audioLengthSamples, speech.end + speechPadSamples));
    }
  }
  return out;
}
