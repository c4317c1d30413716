/**
 * Streamed speech probabilities (`probabilities=true`, `probability_interval_ms`): a stream's
 * `probability` events carry, window by window, the probabilities that onnxruntime-node gives
 * here, in the test, for the same 16 kHz audio (Silero's OnnxWrapper: see
 * {@link sileroWindowProbs}), to 1e-5; at 16 kHz, and at 44.1 kHz, where the 16 kHz audio is
 * what libsamplerate (the resampler the server uses, at its SINC_FASTEST setting) makes of it.
 */
import { ConverterType, create } from '@alexanderolsen/libsamplerate-js';
import { unpack } from 'msgpackr';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import WebSocket from 'ws';
import { ServerConfig } from '../../runtime/config.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { fixture, handshake, sileroWindowProbs, WaveFile } from '../helpers.js';

let server: VoxServer;
beforeAll(async () => {
  server = await startServer(ServerConfig.parse({ log_level: 'silent', port: 0 }));
});
afterAll(async () => {
  await server?.close();
});

type Event = Record<string, unknown> & { type: string };

/** Streams s16le `pcm` at `rate` in 100 ms frames; resolves with every event and the close code. */
function stream(
  query: string,
  pcm: Buffer,
  rate: number,
  protocol = 'voxserve.v1.json',
): Promise<{ events: Event[]; code: number }> {
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(`${server.url.replace('http', 'ws')}/v1/stream?sample_rate=${rate}&${query}`, protocol);
    const events: Event[] = [];
    ws.on('error', reject);
    ws.on('message', (d: Buffer) => {
      const e = (protocol === 'voxserve.v1.msgpack' ? unpack(d) : JSON.parse(d.toString())) as Event;
      events.push(e);
      if (e.type !== 'ready') return;
      const frame = (rate / 10) * 2;
      for (let o = 0; o < pcm.length; o += frame) ws.send(pcm.subarray(o, o + frame));
      ws.send(JSON.stringify({ type: 'end' }));
    });
    ws.on('close', (code) => resolve({ events, code }));
  });
}

const s16Of = (wav: Buffer): Int16Array => new WaveFile(wav).getSamples(false, Int16Array) as unknown as Int16Array;
const bytes = (s: Int16Array): Buffer => Buffer.from(s.buffer, s.byteOffset, s.byteLength);
const floats = (s: Int16Array): Float32Array => Float32Array.from(s, (v) => v / 32768);

/** Asserts one probability per 32 ms window, in order, equal to `want` to 1e-5. */
function expectPerWindow(events: Event[], want: number[]): void {
  const probs = events.filter((e) => e.type === 'probability');
  expect(probs.map((e) => e.at_ms)).toEqual(want.map((_, i) => i * 32));
  const worst = Math.max(...probs.map((e, i) => Math.abs((e.p as number) - want[i])));
  expect(worst).toBeLessThanOrEqual(1e-5);
}

describe('probability events against onnxruntime run in the test', () => {
  it('16 kHz, JSON: one event per window, {type, at_ms, p}, before the segment events it explains', async () => {
    const s16 = s16Of(fixture('espeak_sentence_16k.wav'));
    const want = await sileroWindowProbs(floats(s16));
    const { events, code } = await stream('model=silero-vad&probabilities=true', bytes(s16), 16_000);
    expect(code).toBe(1000);
    expectPerWindow(events, want);
    expect(Object.keys(events.find((e) => e.type === 'probability')!).sort()).toEqual(['at_ms', 'p', 'type']);
    // The speech_start comes after the probabilities of the windows that make it certain.
    const start = events.findIndex((e) => e.type === 'speech_start');
    const before = events.slice(0, start).filter((e) => e.type === 'probability');
    expect(before.length).toBeGreaterThan((events[start].at_ms as number) / 32 + 250 / 32);
    expect(events.at(-1)!.type).toBe('done');
  });

  it('44.1 kHz, JSON: the probabilities of the resampled audio', async () => {
    // A 44.1 kHz recording, made here from the 16 kHz one.
    const up = await create(1, 16_000, 44_100, { converterType: ConverterType.SRC_SINC_BEST_QUALITY });
    const at44 = up.simple(floats(s16Of(fixture('espeak_sentence_16k.wav'))));
    up.destroy();
    const s16 = Int16Array.from(at44, (v) => Math.max(-32768, Math.min(32767, Math.round(v * 32768))));
    // What the server makes of it: libsamplerate SINC_FASTEST, stateful, 20 ms of silence to flush, cut to the signal's
    // length at 16 kHz.
    const down = await create(1, 44_100, 16_000, { converterType: ConverterType.SRC_SINC_FASTEST });
    const out = [...down.full(floats(s16)), ...down.full(new Float32Array(882))];
    down.destroy();
    const audio = Float32Array.from(out.slice(0, Math.round((s16.length * 16_000) / 44_100)));
    const want = await sileroWindowProbs(audio);
    const { events, code } = await stream('model=silero-vad&probabilities=true', bytes(s16), 44_100);
    expect(code).toBe(1000);
    expectPerWindow(events, want);
  });

  it('16 kHz, msgpack, probability_interval_ms=100: one event per 100 ms span carrying its windows', async () => {
    const s16 = s16Of(fixture('espeak_sentence_16k.wav'));
    const want = await sileroWindowProbs(floats(s16));
    const { events, code } = await stream(
      'model=silero-vad&probability_interval_ms=100',
      bytes(s16),
      16_000,
      'voxserve.v1.msgpack',
    );
    expect(code).toBe(1000);
    const spans = events.filter((e) => e.type === 'probability');
    // Each event: the windows whose start falls in its 100 ms span, at_ms = the first one's start.
    const expected: { at_ms: number; n: number }[] = [];
    want.forEach((_, i) => {
      const span = Math.floor((i * 32) / 100);
      if (expected.length && Math.floor(expected.at(-1)!.at_ms / 100) === span) expected.at(-1)!.n++;
      else expected.push({ at_ms: i * 32, n: 1 });
    });
    expect(spans.map((e) => ({ at_ms: e.at_ms, n: (e.p as number[]).length }))).toEqual(expected);
    const got = spans.flatMap((e) => e.p as number[]);
    expect(Math.max(...got.map((p, i) => Math.abs(p - want[i])))).toBeLessThanOrEqual(1e-5);
  });

  it('off by default; refused on a wake-word model and for bad values (1008 naming the parameter)', async () => {
    const s16 = s16Of(fixture('espeak_alexa_16k.wav'));
    const off = await stream('model=silero-vad', bytes(s16), 16_000);
    expect(off.events.filter((e) => e.type === 'probability')).toEqual([]);
    const wake = await stream('model=alexa&probabilities=true', bytes(s16), 16_000);
    expect(wake.code).toBe(1008);
    expect(JSON.stringify(wake.events.find((e) => e.type === 'error'))).toContain('probabilities');
    for (const [q, name] of [
      ['probabilities=yes', 'probabilities'],
      ['probability_interval_ms=10', 'probability_interval_ms'],
      ['probability_interval_ms=abc', 'probability_interval_ms'],
    ]) {
      // Bad values of known parameters are reported on the open stream (unknown ones are refused at the handshake).
      const bad = await stream(`model=silero-vad&${q}`, bytes(s16), 16_000);
      expect(bad.code).toBe(1008);
      expect(
        (bad.events.find((e) => e.type === 'error') as unknown as { error: { message: string } }).error.message,
      ).toMatch(new RegExp(`^${name}:`));
    }
    expect(
      (await handshake(`${server.url.replace('http', 'ws')}/v1/stream?model=silero-vad&probability=true`)).status,
    ).toBe(400);
  });
});
