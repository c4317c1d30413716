/**
 * A VAD stream resumed from a checkpoint (docs/websocket-api.md "Resuming a stream"): a stream with
 * `progress=true&checkpoints=true` gives a `checkpoint` in each `progress`; a new stream opened with
 * `resume_from=<checkpoint>` and sent the audio from there gives the events the first stream would
 * have given, bit for bit (Silero's recurrent state and the segmenter's are in the checkpoint).
 * Expected values: the same recording streamed in one piece (itself checked against
 * spec/fixtures/REFERENCE.jsonl, silero-vad's own segmentation); a fresh stream at the same point
 * (`offset_ms`, the state starting from zero) is shown to differ, so the comparison can fail.
 */
import { createHash } from 'node:crypto';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import WebSocket from 'ws';
import { parseStreamParams } from '../../actors/stream.js';
import { ServerConfig } from '../../runtime/config.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { expectSegments, fixture, reference, streamPcm, until, WaveFile } from '../helpers.js';

type Event = Record<string, any>;
const FILE = 'silero_test.wav';
const pcm = Buffer.from((new WaveFile(fixture(FILE)).data as { samples: Uint8Array }).samples);
const totalMs = pcm.length / 32;

let server: VoxServer;
let ws: string;
beforeAll(async () => {
  server = await startServer(ServerConfig.parse({ log_level: 'silent', port: 0 }));
  ws = `${server.url.replace('http', 'ws')}/v1/stream`;
});
afterAll(async () => {
  await server?.close();
});

/** The events of the task (speech_start, speech_end), whole. */
const task = (events: Event[]) => events.filter((e) => e.type === 'speech_start' || e.type === 'speech_end');

/**
 * Streams the recording up to `cutMs` with checkpoints, waits for the progress of its last whole window, and drops the
 * connection (no `end`): the events so far, and that progress (its ms and checkpoint).
 */
async function upTo(cutMs: number): Promise<{ events: Event[]; at: number; checkpoint: string }> {
  const socket = new WebSocket(`${ws}?model=silero-vad&progress=true&checkpoints=true`);
  const events: Event[] = [];
  socket.on('error', () => {});
  socket.on('message', (d) => events.push(JSON.parse(d.toString())));
  await until(() => events.some((e) => e.type === 'ready'), 10_000);
  const cut = cutMs * 32;
  for (let o = 0; o < cut; o += 3200) socket.send(pcm.subarray(o, Math.min(o + 3200, cut)));
  const last = Math.floor(cutMs / 32) * 32;
  await until(() => events.some((e) => e.type === 'progress' && e.processed_ms === last), 10_000);
  socket.terminate();
  const p = events.find((e) => e.type === 'progress' && e.processed_ms === last)!;
  expect(typeof p.checkpoint, JSON.stringify(p).slice(0, 200)).toBe('string');
  return { events: events.slice(0, events.indexOf(p) + 1), at: last, checkpoint: p.checkpoint };
}

describe('resume_from: a VAD stream goes on from a checkpoint', () => {
  let whole: Event[];
  beforeAll(async () => {
    const r = await streamPcm(`${ws}?model=silero-vad`, pcm);
    expect(r.code).toBe(1000);
    whole = task(r.events);
    const segments = whole
      .filter((e) => e.type === 'speech_end')
      .map((e) => ({ start_ms: e.start_ms, end_ms: e.end_ms }));
    expectSegments(segments, reference(FILE).segments_v6, 40);
  });

  it("cut anywhere (in silence, in speech): the events before the cut and those from the checkpoint on are the whole stream's, bit for bit; a fresh session at the cut differs", async () => {
    let freshDiffers = 0;
    const cuts = [2_000, 7_777, 13_050, 19_500, 26_010, 33_333, 41_000, 48_640, 55_555];
    for (const cutMs of cuts) {
      const first = await upTo(cutMs);
      const query = (q: string) => `${ws}?model=silero-vad&progress=true&checkpoints=true&${q}`;
      const rest = pcm.subarray(first.at * 32);
      const resumed = await streamPcm(query(`resume_from=${first.checkpoint}`), rest);
      expect(resumed.code).toBe(1000);
      expect([...task(first.events), ...task(resumed.events)], `cut at ${cutMs} ms`).toEqual(whole);
      // Its clock goes on from the checkpoint's: progress and done on the whole stream's clock.
      const progress = resumed.events.filter((e) => e.type === 'progress').map((e) => e.processed_ms);
      expect(progress[0]).toBeGreaterThan(first.at);
      expect(resumed.events.find((e) => e.type === 'done')?.processed_ms).toBe(totalMs);
      const fresh = await streamPcm(query(`offset_ms=${first.at}`), rest);
      if (JSON.stringify([...task(first.events), ...task(fresh.events)]) !== JSON.stringify(whole)) freshDiffers++;
    }
    console.log(
      `resume_from: ${cuts.length} cuts equal the whole stream; a fresh session at the cut differs at ${freshDiffers}`,
    );
    expect(freshDiffers).toBeGreaterThan(0);
  }, 120_000);

  it("resumed twice: the second checkpoint is on the same clock, and the events still the whole stream's", async () => {
    const a = await upTo(9_000);
    const socket = new WebSocket(`${ws}?model=silero-vad&progress=true&checkpoints=true&resume_from=${a.checkpoint}`);
    const events: Event[] = [];
    socket.on('error', () => {});
    socket.on('message', (d) => events.push(JSON.parse(d.toString())));
    await until(() => events.some((e) => e.type === 'ready'), 10_000);
    const cut = 30_016 * 32;
    for (let o = a.at * 32; o < cut; o += 3200) socket.send(pcm.subarray(o, Math.min(o + 3200, cut)));
    await until(() => events.some((e) => e.type === 'progress' && e.processed_ms === 30_016), 10_000);
    socket.terminate();
    const p = events.find((e) => e.type === 'progress' && e.processed_ms === 30_016)!;
    const b = events.slice(0, events.indexOf(p) + 1);
    const c = await streamPcm(
      `${ws}?model=silero-vad&progress=true&checkpoints=true&resume_from=${p.checkpoint}`,
      pcm.subarray(30_016 * 32),
    );
    expect([...task(a.events), ...task(b), ...task(c.events)]).toEqual(whole);
  }, 60_000);
});

describe('checkpoints and resume_from: refused clearly, the server unharmed', () => {
  const parse = (q: string) => parseStreamParams(new URL(`/v1/stream?model=silero-vad&${q}`, 'http://localhost'));
  let good: string;
  beforeAll(async () => {
    good = (await upTo(3_000)).checkpoint;
  });

  it('checkpoints=true without progress=true, or not a boolean: named', () => {
    expect(() => parse('checkpoints=true')).toThrow(/^checkpoints: a checkpoint comes in a progress event/);
    expect(() => parse('progress=true&checkpoints=1')).toThrow(/^checkpoints: must be true or false/);
  });

  it('resume_from with offset_ms, probabilities or a denoise chain: named', () => {
    for (const other of ['offset_ms=5', 'probabilities=true', 'probability_interval_ms=64', 'denoise=rnnoise'])
      expect(() => parse(`resume_from=${good}&${other}`)).toThrow(/^resume_from: a checkpoint sets the stream's clock/);
  });

  it('a resume_from that is not a checkpoint (garbage, cut short, a character changed, a field changed): named, before any audio', () => {
    // The documented form: uint32 header length, JSON header, float32s, then the first 8 bytes of SHA-256 of all that.
    const all = Buffer.from(good, 'base64url');
    const bytes = all.subarray(0, all.length - 8);
    const sealed = (b: Buffer): string =>
      Buffer.concat([b, createHash('sha256').update(b).digest().subarray(0, 8)]).toString('base64url');
    expect(sealed(bytes)).toBe(good);
    const head = bytes.readUInt32LE(0);
    const json = JSON.parse(bytes.subarray(4, 4 + head).toString());
    const lying = (change: (j: Record<string, any>) => void): string => {
      const j = structuredClone(json);
      change(j);
      const h = Buffer.from(JSON.stringify(j));
      const out = Buffer.alloc(4 + h.length + bytes.length - 4 - head);
      out.writeUInt32LE(h.length, 0);
      h.copy(out, 4);
      bytes.subarray(4 + head).copy(out, 4 + h.length);
      return sealed(out);
    };
    const withLast = (v: number): string => {
      const b = Buffer.from(bytes);
      b.writeFloatLE(v, b.length - 4);
      return sealed(b);
    };
    // One character of the state region changed: caught by the check.
    const i = Math.floor(good.length * 0.6);
    const edited = good.slice(0, i) + (good[i] === 'A' ? 'B' : 'A') + good.slice(i + 1);
    for (const [bad, problem] of [
      ['not a checkpoint!', /base64url of at most 8192/],
      ['AAAA', /integrity check/],
      [good.slice(0, 100), /integrity check/],
      [edited, /integrity check/],
      [`${good.slice(0, -5)}AAAAA`, /integrity check/],
      [withLast(Number.NaN), /not finite/],
      [lying((j) => (j.v = 2)), /v: /],
      [lying((j) => (j.processed += 1)), /processed: /],
      [lying((j) => (j.segmenter.index += 1)), /window counts disagree/],
      [lying((j) => (j.segmenter.start = -1)), /segmenter.start: /],
      [lying((j) => (j.extra = 1)), /extra/],
      // A week of audio at most (a breaker's 2^45 samples held the event loop for good).
      [
        lying((j) => {
          j.processed = 604_800_512 * 16;
          j.segmenter.index = j.processed / 512;
          j.segmenter.probsBase = j.segmenter.index - json.segmenter.probs;
        }),
        /processed: /,
      ],
      // Positions that disagree: a segment closed before it began, a window start off the grid, past the audio.
      [lying((j) => (j.segmenter.closed = { start_sample: 5120, end: 512, confidence: 0.5 })), /positions disagree/],
      [lying((j) => (j.segmenter.start = 3)), /positions disagree/],
      [lying((j) => (j.segmenter.lastEnd = j.processed + 512)), /positions disagree/],
      ['A'.repeat(9000), /at most 8192/],
    ] as const)
      expect(() => parse(`resume_from=${encodeURIComponent(bad)}`), bad.slice(0, 40)).toThrow(
        new RegExp(`^resume_from: not a VAD stream's checkpoint: .*${problem.source}`),
      );
  });

  it('a checkpoint of another model, or taken with other task options: refused naming resume_from', async () => {
    const other = await streamPcm(`${ws}?model=silero-vad-v5&resume_from=${good}`, Buffer.alloc(3200));
    expect(other.code).toBe(1008);
    expect((other.events.at(-1) as Event).error?.message).toMatch(
      /^resume_from: a checkpoint of model 'silero-vad', not of 'silero-vad-v5'/,
    );
    const options = await streamPcm(`${ws}?model=silero-vad&threshold=0.9&resume_from=${good}`, Buffer.alloc(3200));
    expect(options.code).toBe(1008);
    expect((options.events.at(-1) as Event).error?.message).toMatch(
      /^resume_from: a checkpoint taken with other task options/,
    );
  });

  it('a stream sent at once and ended: its progress events after the end still carry checkpoints, but for the last (padded) window', async () => {
    const r = await streamPcm(`${ws}?model=silero-vad&progress=true&checkpoints=true`, pcm.subarray(0, 20_010 * 32));
    const progress = r.events.filter((e) => e.type === 'progress');
    expect(progress.length).toBeGreaterThan(5);
    expect(progress.slice(0, -1).every((e) => typeof e.checkpoint === 'string')).toBe(true);
    expect(progress.at(-1)).toEqual({ type: 'progress', processed_ms: 20_010 });
  });

  it('on a stream: a bad checkpoint is an error event naming resume_from, close 1008; a wake-word model refuses one; the server serves on', async () => {
    const bad = await streamPcm(`${ws}?model=silero-vad&resume_from=AAAA`, Buffer.alloc(3200));
    expect(bad.code).toBe(1008);
    expect(bad.events.at(-1)).toMatchObject({
      type: 'error',
      error: { type: 'invalid_request_error', message: expect.stringMatching(/^resume_from: /) },
    });
    const wake = await streamPcm(`${ws}?model=alexa&resume_from=${good}`, Buffer.alloc(3200));
    expect(wake.code).toBe(1008);
    expect(wake.events.at(-1)).toMatchObject({
      type: 'error',
      error: {
        message: expect.stringMatching(/^resume_from: a checkpoint is a VAD stream's; 'alexa' is a wakeword model/),
      },
    });
    // No checkpoint for a wake-word stream, nor a VAD stream with probabilities: progress without one.
    for (const q of ['model=alexa', 'model=silero-vad&probabilities=true']) {
      const r = await streamPcm(`${ws}?${q}&progress=true&checkpoints=true`, pcm.subarray(0, 32_000 * 3));
      const progress = r.events.filter((e) => e.type === 'progress');
      expect(progress.length, q).toBeGreaterThan(0);
      expect(
        progress.some((e) => 'checkpoint' in e),
        q,
      ).toBe(false);
    }
    expect((await fetch(`${server.url}/ready`)).status).toBe(200);
  }, 60_000);
});

describe('a draining server hands a checkpointed VAD stream over', () => {
  /**
   * Streams `ms` of the recording with `query` and checkpoints, waits until the server has run its whole windows, then
   * closes the server (the drain): the events and the close code.
   */
  async function drained(query: string, ms: number): Promise<{ events: Event[]; code: number }> {
    const s = await startServer(ServerConfig.parse({ log_level: 'silent', port: 0 }));
    const socket = new WebSocket(
      `${s.url.replace('http', 'ws')}/v1/stream?model=silero-vad&progress=true&checkpoints=true&${query}`,
    );
    const events: Event[] = [];
    socket.on('error', () => {});
    socket.on('message', (d) => events.push(JSON.parse(d.toString())));
    const closed = new Promise<number>((resolve) => socket.on('close', (code) => resolve(code)));
    await until(() => events.some((e) => e.type === 'ready'), 10_000);
    for (let o = 0; o < ms * 32; o += 3200) socket.send(pcm.subarray(o, Math.min(o + 3200, ms * 32)));
    const last = Math.floor(ms / 32) * 32;
    await until(() => events.some((e) => e.type === 'progress' && e.processed_ms === last), 30_000);
    await s.close();
    return { events, code: await closed };
  }

  it('done at its last whole window with the checkpoint there (not the padded end), then 1001', async () => {
    const { events, code } = await drained('', 20_050);
    expect(code).toBe(1001);
    const done = events.find((e) => e.type === 'done')!;
    expect(done.processed_ms).toBe(20_032);
    expect(typeof done.checkpoint).toBe('string');
    // Resumed from it (here, on this process's server), the events are the whole stream's.
    const rest = await streamPcm(
      `${ws}?model=silero-vad&progress=true&checkpoints=true&resume_from=${done.checkpoint}`,
      pcm.subarray(20_032 * 32),
    );
    const whole = task((await streamPcm(`${ws}?model=silero-vad`, pcm)).events);
    expect([...task(events), ...task(rest.events)]).toEqual(whole);
  }, 60_000);

  it('a segment too long for a checkpoint (8,192 characters): progress carries none, and the drain finishes the stream as at end (the segment closed, all audio counted)', async () => {
    // Silences never end a segment: one segment from the first speech on.
    const { events, code } = await drained('min_silence_duration_ms=600000', 50_000);
    expect(code).toBe(1001);
    const progress = events.filter((e) => e.type === 'progress');
    expect(progress[0].checkpoint).toEqual(expect.any(String));
    expect(progress.at(-1)!.checkpoint).toBeUndefined();
    const lastWith = progress.filter((e) => e.checkpoint).at(-1)!;
    console.log(
      `one segment from ${events.find((e) => e.type === 'speech_start')?.at_ms} ms: the last checkpoint at ${lastWith.processed_ms} ms, ${lastWith.checkpoint.length} characters`,
    );
    const done = events.find((e) => e.type === 'done')!;
    expect(done.checkpoint).toBeUndefined();
    expect(done.processed_ms).toBe(50_000);
    const ends = events.filter((e) => e.type === 'speech_end');
    expect(ends).toHaveLength(1);
    expect(ends[0].end_ms).toBe(50_000);
  }, 60_000);
});
