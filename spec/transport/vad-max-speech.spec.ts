/**
 * `max_speech_duration_s` (and `min_silence_at_max_speech`, `use_max_poss_sil_at_max_speech`)
 * against Silero's own definition: on 37 s of nearly unbroken espeak-ng speech
 * (spec/fixtures/espeak_long_speech_16k.wav), the server's segments, on the file route and over a
 * stream, equal those of `get_speech_timestamps` (silero-vad src/silero_vad/utils_vad.py, commit
 * 806dcba) written out in spec/helpers.ts, fed with window probabilities that onnxruntime-node computes here,
 * in the test ({@link sileroWindowProbs}: Silero's own ONNX wrapper).
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ServerConfig } from '../../runtime/config.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import {
  fixture,
  getSpeechTimestamps,
  type SileroParams as Params,
  sileroWindowProbs,
  streamPcm,
  WaveFile,
} from '../helpers.js';

const FILE = 'espeak_long_speech_16k.wav';
const SR = 16_000;

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
async function stream(params: Params): Promise<Record<string, unknown>[]> {
  const q = new URLSearchParams(
    Object.entries({ model: 'silero-vad', sample_rate: '16000', ...params }).map(([k, v]) => [k, String(v)]),
  );
  const { events, code } = await streamPcm(`${server.url.replace('http', 'ws')}/v1/stream?${q}`, pcm);
  if (code !== 1000) throw new Error(`closed ${code}: ${JSON.stringify(events.at(-1))}`);
  return events;
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

/** Pads the issue named (200, 500, 1,000 ms), and one past the file's end. */
const PADS = [200, 500, 1000, 1500];

describe(`item 13 (#25): speech_pad_ms on ${FILE} against get_speech_timestamps`, () => {
  it('the reference pads the last segment by the full pad, up to the file length: its end grows with the pad', () => {
    const unpadded = getSpeechTimestamps(probs, audio.length, { speech_pad_ms: 0 }).at(-1)!.end;
    const ends = PADS.map((pad) => getSpeechTimestamps(probs, audio.length, { speech_pad_ms: pad }).at(-1)!.end);
    expect(ends).toEqual(PADS.map((pad) => Math.min(audio.length, unpadded + (pad * SR) / 1000)));
    // 200, 500 and 1,000 ms end at three different samples; 1,500 ms at the file's end.
    expect(new Set(ends.slice(0, 3)).size).toBe(3);
    expect(ends[3]).toBe(audio.length);
  });

  it.each(PADS)(
    'file route: speech_pad_ms %i (min_silence_duration_ms 100, under 2 x pad) gives get_speech_timestamps exactly',
    async (pad) => {
      const want = getSpeechTimestamps(probs, audio.length, { speech_pad_ms: pad });
      const res = await fetch(`${server.url}/v1/tasks/run?model=silero-vad&speech_pad_ms=${pad}`, {
        method: 'POST',
        headers: { 'content-type': 'audio/wav' },
        body: new Uint8Array(fixture(FILE)),
      });
      const body = await res.json();
      expect(res.status, JSON.stringify(body)).toBe(200);
      expect(samples(body.segments)).toEqual(want);
    },
  );

  it.each(PADS)('stream: speech_pad_ms %i gives the same segments as the file', async (pad) => {
    const want = getSpeechTimestamps(probs, audio.length, { speech_pad_ms: pad });
    const events = await stream({ speech_pad_ms: pad });
    const ends = events.filter((e) => e.type === 'speech_end').map((e) => ({ start_ms: e.start_ms, end_ms: e.end_ms }));
    expect(ends).toEqual(ms(want));
  });
});
