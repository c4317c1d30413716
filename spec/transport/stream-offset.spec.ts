/**
 * A stream's start offset and progress events (docs/websocket-api.md "Resuming a stream"):
 * `offset_ms` is validated with an error naming it, and moves every time the stream reports by
 * that much; `progress=true` confirms the audio processed after each job's events. Expected
 * values: spec/fixtures/REFERENCE.jsonl (silero-vad's own segmentation of the fixture), shifted by
 * the offset, and the same stream without an offset.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { MAX_OFFSET_MS, parseStreamParams } from '../../actors/stream.js';
import { ServerConfig } from '../../runtime/config.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { expectSegments, fixture, reference, streamPcm, WaveFile } from '../helpers.js';

type Event = Record<string, any>;

const parse = (q: string) => parseStreamParams(new URL(`/v1/stream?model=silero-vad&${q}`, 'http://localhost'));

describe('offset_ms and progress: validation', () => {
  it('absent: the clock starts at 0 and no progress events', () => {
    expect(parse('')).toMatchObject({ offsetMs: 0, progress: false });
  });

  it('in range: taken as is', () => {
    expect(parse('offset_ms=0&progress=false')).toMatchObject({ offsetMs: 0, progress: false });
    expect(parse('offset_ms=123456&progress=true')).toMatchObject({ offsetMs: 123456, progress: true });
    expect(parse(`offset_ms=${MAX_OFFSET_MS}`).offsetMs).toBe(604_800_000);
  });

  it.each(['-1', '1.5', '1e3', '', 'abc', ' 5', String(MAX_OFFSET_MS + 1), '99999999999'])(
    'offset_ms=%j: invalid_request_error naming offset_ms and its range',
    (v) => {
      expect(() => parse(`offset_ms=${encodeURIComponent(v)}`)).toThrow(
        /^offset_ms: must be an integer from 0 to 604800000, got '/,
      );
      try {
        parse(`offset_ms=${encodeURIComponent(v)}`);
      } catch (e) {
        expect((e as { toWire(): { type: string } }).toWire().type).toBe('invalid_request_error');
      }
    },
  );

  it.each(['1', 'yes', ''])('progress=%j: invalid_request_error naming progress', (v) => {
    expect(() => parse(`progress=${v}`)).toThrow(/^progress: must be true or false, got '/);
  });
});

let server: VoxServer;
beforeAll(async () => {
  server = await startServer(ServerConfig.parse({ log_level: 'silent', port: 0 }));
});
afterAll(async () => {
  await server?.close();
});

/** Streams a 16 kHz WAV fixture in 100 ms frames with `query`; resolves with every event and the close code. */
async function stream(model: string, file: string, query: string): Promise<{ events: Event[]; code: number }> {
  const pcm = Buffer.from((new WaveFile(fixture(file)).data as { samples: Uint8Array }).samples);
  const r = await streamPcm(`${server.url.replace('http', 'ws')}/v1/stream?model=${model}&${query}`, pcm);
  return r as { events: Event[]; code: number };
}

/** A 16 kHz mono WAV fixture's duration, ms (its sample count / 16). */
const durationMs = (file: string): number =>
  Math.round((new WaveFile(fixture(file)).data as { samples: Uint8Array }).samples.length / 2 / 16);

const ends = (events: Event[]) =>
  events.filter((e) => e.type === 'speech_end').map((e) => ({ start_ms: e.start_ms, end_ms: e.end_ms }));

describe('offset_ms and progress: on a stream', () => {
  it('a bad offset_ms: an error event naming it, close 1008, and the server keeps serving', async () => {
    const { events, code } = await stream('silero-vad', 'silence_3s_16k.wav', 'offset_ms=-5');
    expect(code).toBe(1008);
    expect(events.at(-1)).toMatchObject({
      type: 'error',
      error: { type: 'invalid_request_error', message: expect.stringMatching(/^offset_ms: /) },
    });
    expect((await fetch(`${server.url}/ready`)).status).toBe(200);
  });

  it('offset_ms moves every time by that much (VAD segments against REFERENCE.jsonl + the offset)', async () => {
    const file = 'espeak_sentence_16k.wav';
    const offset = 5000;
    const plain = await stream('silero-vad', file, '');
    const moved = await stream('silero-vad', file, `offset_ms=${offset}&probabilities=true`);
    expect(moved.code).toBe(1000);
    const want = reference(file).segments_v6.map((s) => ({ start_ms: s.start_ms + offset, end_ms: s.end_ms + offset }));
    expectSegments(ends(moved.events), want, 32);
    expect(ends(moved.events)).toEqual(
      ends(plain.events).map((s) => ({ start_ms: s.start_ms + offset, end_ms: s.end_ms + offset })),
    );
    const starts = (es: Event[]) => es.filter((e) => e.type === 'speech_start').map((e) => e.at_ms);
    expect(starts(moved.events)).toEqual(starts(plain.events).map((t) => t + offset));
    // One probability per 32 ms window, the first at the offset.
    const probs = moved.events.filter((e) => e.type === 'probability').map((e) => e.at_ms);
    expect(probs[0]).toBe(offset);
    expect(probs[1]).toBe(offset + 32);
    const done = (es: Event[]) => es.find((e) => e.type === 'done')!;
    expect(done(moved.events).processed_ms).toBe(done(plain.events).processed_ms + offset);
    expect(done(plain.events).processed_ms).toBe(durationMs(file));
    expect(moved.events.some((e) => e.type === 'progress')).toBe(false);
  });

  it('wake word: detection at_ms moves by the offset', async () => {
    const plain = await stream('alexa', 'espeak_alexa_16k.wav', '');
    const moved = await stream('alexa', 'espeak_alexa_16k.wav', 'offset_ms=777');
    const at = (es: Event[]) => es.filter((e) => e.type === 'detection').map((e) => e.at_ms);
    expect(at(plain.events).length).toBe(1);
    expect(at(moved.events)).toEqual(at(plain.events).map((t) => t + 777));
  });

  it('progress=true: after each job, the processed audio on the stream clock; every event before the progress that covers it', async () => {
    const file = 'espeak_sentence_16k.wav';
    const offset = 2000;
    const { events, code } = await stream('silero-vad', file, `offset_ms=${offset}&progress=true`);
    expect(code).toBe(1000);
    const progress = events.filter((e) => e.type === 'progress').map((e) => e.processed_ms);
    // One per job; a job runs at most 64 windows (MAX_JOB_MS, 2048 ms) of 32 ms.
    expect(progress.length).toBeGreaterThanOrEqual(Math.ceil(durationMs(file) / 32 / 64));
    // Whole 32 ms windows from the offset, rising, up to the end of the audio (the last window padded).
    const audioMs = durationMs(file);
    for (const [i, p] of progress.entries()) {
      if (i) expect(p).toBeGreaterThan(progress[i - 1]);
      if (i < progress.length - 1) expect((p - offset) % 32).toBe(0);
    }
    expect(progress.at(-1)).toBe(offset + audioMs);
    // Each segment's end is confirmed by the first progress after it.
    events.forEach((e, i) => {
      if (e.type !== 'speech_end') return;
      const next = events.slice(i).find((x) => x.type === 'progress');
      expect(next?.processed_ms).toBeGreaterThanOrEqual(e.end_ms);
    });
    expect(ends(events).length).toBe(reference(file).segments_v6.length);
  });
});
