/**
 * `max_speech_duration_s` (and `min_silence_at_max_speech`, `use_max_poss_sil_at_max_speech`)
 * against Silero's own definition: on 37 s of nearly unbroken espeak-ng speech
 * (spec/fixtures/espeak_long_speech_16k.wav), the server's segments, on the file route and over a
 * stream, equal those of `get_speech_timestamps` (silero-vad src/silero_vad/utils_vad.py, commit
 * 806dcba) written out below, fed with window probabilities that onnxruntime-node computes here,
 * in the test ({@link sileroWindowProbs}: Silero's own ONNX wrapper).
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import WebSocket from 'ws';
import { ServerConfig } from '../../runtime/config.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { fixture, sileroWindowProbs, WaveFile } from '../helpers.js';

const FILE = 'espeak_long_speech_16k.wav';
const SR = 16_000;

interface Params {
  threshold?: number;
  min_speech_duration_ms?: number;
  max_speech_duration_s?: number;
  min_silence_duration_ms?: number;
  speech_pad_ms?: number;
  min_silence_at_max_speech?: number;
  use_max_poss_sil_at_max_speech?: boolean;
}

/** get_speech_timestamps (utils_vad.py) after its probability loop, at 16 kHz, in samples. */
function getSpeechTimestamps(
  speechProbs: number[],
  audioLengthSamples: number,
  p: Params,
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

/** The cases: each splits or cuts differently (checked below against the unlimited segments). */
const CASES: { name: string; params: Params }[] = [
  { name: 'max 4 s, longest silence (Silero default)', params: { max_speech_duration_s: 4 } },
  { name: 'max 4 s, last silence', params: { max_speech_duration_s: 4, use_max_poss_sil_at_max_speech: false } },
  { name: 'max 1.5 s, longest silence (cuts)', params: { max_speech_duration_s: 1.5 } },
  {
    name: 'max 1.5 s, last silence, 60 ms pad (cuts, short gaps)',
    params: { max_speech_duration_s: 1.5, use_max_poss_sil_at_max_speech: false, speech_pad_ms: 60 },
  },
  {
    name: 'max 3 s, min_silence_at_max_speech 200 ms',
    params: { max_speech_duration_s: 3, min_silence_at_max_speech: 200 },
  },
];

let server: VoxServer;
let audio: Float32Array;
let pcm: Buffer;
let probs: number[];
beforeAll(async () => {
  const w = new WaveFile(fixture(FILE));
  const s16 = w.getSamples(false, Int16Array) as unknown as Int16Array;
  audio = Float32Array.from(s16, (v) => v / 32768);
  pcm = Buffer.from(s16.buffer, s16.byteOffset, s16.byteLength);
  probs = await sileroWindowProbs(audio);
  server = await startServer(ServerConfig.parse({ log_level: 'silent', port: 0 }));
});
afterAll(async () => {
  await server?.close();
});

const samples = (segs: { start_sample: number; end_sample: number }[]): { start: number; end: number }[] =>
  segs.map((s) => ({ start: s.start_sample, end: s.end_sample }));
const ms = (segs: { start: number; end: number }[]): { start_ms: number; end_ms: number }[] =>
  segs.map((s) => ({ start_ms: Math.round((s.start * 1000) / SR), end_ms: Math.round((s.end * 1000) / SR) }));

/** Streams the fixture's PCM in 100 ms frames with `params` as query options; resolves with every event. */
function stream(params: Params): Promise<Record<string, unknown>[]> {
  const q = new URLSearchParams(
    Object.entries({ model: 'silero-vad', sample_rate: '16000', ...params }).map(([k, v]) => [k, String(v)]),
  );
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(`${server.url.replace('http', 'ws')}/v1/stream?${q}`);
    const events: Record<string, unknown>[] = [];
    ws.on('error', reject);
    ws.on('message', (d) => {
      const e = JSON.parse(d.toString());
      events.push(e);
      if (e.type !== 'ready') return;
      for (let o = 0; o < pcm.length; o += 3200) ws.send(pcm.subarray(o, o + 3200));
      ws.send(JSON.stringify({ type: 'end' }));
    });
    ws.on('close', (code) =>
      code === 1000 ? resolve(events) : reject(new Error(`closed ${code}: ${JSON.stringify(events.at(-1))}`)),
    );
  });
}

describe(`max_speech_duration_s on ${FILE} against get_speech_timestamps`, () => {
  it('the recording is long unbroken speech: without a limit, its segments run for many seconds', () => {
    const unlimited = getSpeechTimestamps(probs, audio.length, {});
    expect(Math.max(...unlimited.map((s) => s.end - s.start)) / SR).toBeGreaterThan(6);
  });

  it.each(CASES)('file route: $name', async ({ params }) => {
    const want = getSpeechTimestamps(probs, audio.length, params);
    // The case limits segments, so it differs from the unlimited result.
    expect(want).not.toEqual(getSpeechTimestamps(probs, audio.length, {}));
    const res = await fetch(`${server.url}/v1/tasks/run`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ model: 'silero-vad', audio: fixture(FILE).toString('base64'), options: params }),
    });
    const body = await res.json();
    expect(res.status, JSON.stringify(body)).toBe(200);
    expect(samples(body.segments)).toEqual(want);
  });

  it.each(CASES)('stream: $name', async ({ params }) => {
    const want = getSpeechTimestamps(probs, audio.length, params);
    const events = await stream(params);
    const ends = events.filter((e) => e.type === 'speech_end').map((e) => ({ start_ms: e.start_ms, end_ms: e.end_ms }));
    expect(ends).toEqual(ms(want));
    // Each speech_start comes before its speech_end, with the same start.
    const order = events
      .filter((e) => e.type === 'speech_start' || e.type === 'speech_end')
      .map((e) => (e.type === 'speech_start' ? `s${e.at_ms}` : `e${e.start_ms}`));
    expect(order).toEqual(ms(want).flatMap((s) => [`s${s.start_ms}`, `e${s.start_ms}`]));
  });

  it('a cut case does cut: some segments run to the limit with no silence to split at', () => {
    const want = getSpeechTimestamps(probs, audio.length, { max_speech_duration_s: 1.5 });
    expect(want.some((s) => s.end - s.start > 1.4 * SR)).toBe(true);
  });

  it('bad values are refused naming the field', async () => {
    for (const [q, field] of [
      ['max_speech_duration_s=0', 'options.max_speech_duration_s'],
      ['max_speech_duration_s=abc', 'options.max_speech_duration_s'],
      ['use_max_poss_sil_at_max_speech=yes', 'options.use_max_poss_sil_at_max_speech'],
    ]) {
      const res = await fetch(`${server.url}/v1/tasks/run?model=silero-vad&${q}`, {
        method: 'POST',
        headers: { 'content-type': 'audio/wav' },
        body: new Uint8Array(fixture('silence_3s_16k.wav')),
      });
      expect(res.status).toBe(400);
      expect((await res.json()).error.message).toContain(field);
    }
  });
});
