import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import WebSocket from 'ws';
import { ServerConfig } from '../../runtime/config.js';
import type { VoxServer } from '../../transport/server.js';
import { fixture, references, startTestServer, WaveFile } from '../helpers.js';

/** Several wake-word heads on one stream (issue 14): each head's detections as if it ran alone. */

let server: VoxServer;
beforeAll(async () => {
  server = await startTestServer({
    management: { enabled: true },
    models: [{ id: 'house', task: 'wakeword', heads: ['alexa', { model: 'hey-jarvis', threshold: 0.9 }] }],
  });
});
afterAll(async () => {
  await server?.close();
});

interface Detection {
  label: string;
  score: number;
  at_ms: number;
}

async function run(model: string, file: string, options: Record<string, unknown> = {}): Promise<Detection[]> {
  const res = await fetch(`${server.url}/v1/tasks/run`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ model, audio: fixture(file).toString('base64'), options }),
  });
  const body = await res.json();
  expect(res.status, JSON.stringify(body)).toBe(200);
  return body.detections;
}

/** Streams a fixture's PCM in frames of `frameMs` (100 ms); returns the detections and the `ready` event. */
function stream(
  model: string,
  file: string,
  options: Record<string, unknown> = {},
  frameMs = 100,
): Promise<{ ready: any; detections: Detection[] }> {
  const w = new WaveFile(fixture(file));
  const fmt = w.fmt as { sampleRate: number };
  const pcm = Buffer.from((w.data as { samples: Uint8Array }).samples);
  const frame = Math.round((fmt.sampleRate * frameMs) / 1000) * 2;
  return new Promise((resolve, reject) => {
    const query = new URLSearchParams({
      model,
      sample_rate: String(fmt.sampleRate),
      ...Object.fromEntries(Object.entries(options).map(([k, v]) => [k, String(v)])),
    });
    const ws = new WebSocket(`${server.url.replace('http', 'ws')}/v1/stream?${query}`);
    let ready: any;
    const detections: Detection[] = [];
    ws.on('error', reject);
    ws.on('message', (data: Buffer) => {
      const e = JSON.parse(data.toString());
      if (e.type === 'ready') {
        ready = e;
        for (let off = 0; off < pcm.length; off += frame) ws.send(pcm.subarray(off, off + frame));
        ws.send(JSON.stringify({ type: 'end' }));
      } else if (e.type === 'detection') {
        const { type: _, ...d } = e;
        detections.push(d);
      } else if (e.type === 'error') reject(new Error(JSON.stringify(e)));
    });
    ws.on('close', () => resolve({ ready, detections }));
  });
}

const HEADS = ['alexa', 'hey-jarvis', 'hey-mycroft', 'hey-rhasspy', 'timer', 'weather'];
const FILES = ['espeak_alexa_16k.wav', 'espeak_hey_jarvis_22k.wav', 'espeak_sentence_16k.wav', 'Front_Center.wav'];
/** A low threshold and no refractory period: many detections per head, so the comparison has material. */
const LOUD = { threshold: 0.001, refractory_ms: 0 };

/** Scores to 1e-4, as the issue asks. */
const rounded = (ds: Detection[]): Detection[] => ds.map((d) => ({ ...d, score: Math.round(d.score * 1e4) / 1e4 }));

describe('wake-word scores', () => {
  // The single-class heads; REFERENCE.jsonl names them with underscores. A threshold of 1e-6: every step
  // after the warm-up is reported, so the highest score over the file can be read off.
  const SINGLE = ['alexa', 'hey-jarvis', 'hey-mycroft', 'hey-rhasspy'];
  const ALL = { threshold: 1e-6, refractory_ms: 0 };
  const highest = (ds: Detection[], label: string): number =>
    Math.max(0, ...ds.filter((d) => d.label === label).map((d) => d.score));
  const wavs = references().filter((r) => r.file.endsWith('.wav') && r.wakeword_max);

  it.each(wavs.map((r) => r.file))(
    "each head's highest score matches REFERENCE.jsonl, as a file and as a stream of 100 ms frames: %s",
    async (file) => {
      const want = wavs.find((r) => r.file === file)!.wakeword_max;
      const asFile = await run(SINGLE.join(','), file, ALL);
      const asStream = (await stream(SINGLE.join(','), file, ALL)).detections;
      // Streamed, a step's 480 samples of look-back come from the previous job (of 1 or 2 steps in
      // 100 ms frames, up to 9 in 700 ms frames): the stream must score every step as the file does.
      expect(rounded(asStream)).toEqual(rounded(asFile));
      expect(rounded((await stream(SINGLE.join(','), file, ALL, 700)).detections)).toEqual(rounded(asFile));
      for (const head of SINGLE) {
        const ref = want[head.replace(/-/g, '_')];
        // 0.02: the reference is rounded to 3 decimals, its 22.05 kHz file resampled by sox, and a
        // low score moves with the 80 ms step grid (hey-rhasspy on the sentence: 0.016 vs 0.002).
        // Enough to catch a missed phrase (0.999) or a false score such as the 0.14 that "alexa"
        // had on silence before the noise-initialised embedding history.
        expect(
          Math.abs(highest(asFile, head) - ref),
          `${head} as a file: ${highest(asFile, head)} vs ${ref}`,
        ).toBeLessThan(0.02);
        expect(
          Math.abs(highest(asStream, head) - ref),
          `${head} as a stream: ${highest(asStream, head)} vs ${ref}`,
        ).toBeLessThan(0.02);
      }
    },
  );
});

describe('wake-word groups', () => {
  it.each(FILES)('all six heads on one request give each head the detections it gives alone: %s', async (file) => {
    const together = await run(HEADS.join(','), file, LOUD);
    let total = 0;
    for (const head of HEADS) {
      const alone = await run(head, file, LOUD);
      // Multi-class heads (timer, weather) label their classes; the others carry their model id.
      const mine = together.filter((d) => (alone.length ? alone.some((a) => a.label === d.label) : d.label === head));
      expect(rounded(mine), head).toEqual(rounded(alone));
      total += alone.length;
    }
    expect(together).toHaveLength(total);
  });

  it('a stream with two heads gives each head the detections of a stream with that head alone', async () => {
    for (const file of ['espeak_alexa_16k.wav', 'espeak_hey_jarvis_22k.wav']) {
      const both = await stream('alexa,hey-jarvis', file);
      for (const head of ['alexa', 'hey-jarvis']) {
        const alone = await stream(head, file);
        expect(rounded(both.detections.filter((d) => d.label === head))).toEqual(rounded(alone.detections));
      }
    }
  });

  it('one stream with alexa,hey-jarvis detects each phrase once, with its label', async () => {
    const a = await stream('alexa,hey-jarvis', 'espeak_alexa_16k.wav');
    expect(a.ready).toMatchObject({ model: 'alexa,hey-jarvis', task: 'wakeword' });
    expect(a.detections.map((d) => d.label)).toEqual(['alexa']);
    // The 22.05 kHz fixture is resampled; order in the model id does not matter.
    const j = await stream('hey-jarvis,alexa', 'espeak_hey_jarvis_22k.wav');
    expect(j.ready).toMatchObject({ model: 'alexa,hey-jarvis' });
    expect(j.detections.map((d) => d.label)).toEqual(['hey-jarvis']);
    expect(j.detections[0].score).toBeGreaterThan(0.9);
  });

  it('the refractory period keeps one utterance to one detection', async () => {
    // The "alexa" score stays above 0.5 for over a second after the phrase (REFERENCE.jsonl: max 0.999).
    const every = await run('alexa', 'espeak_alexa_16k.wav', { threshold: 0.5, refractory_ms: 0 });
    expect(every.length).toBeGreaterThan(5);
    expect(await run('alexa', 'espeak_alexa_16k.wav', { threshold: 0.5, refractory_ms: 2000 })).toEqual([every[0]]);
    // The default is 2 s.
    expect(await run('alexa', 'espeak_alexa_16k.wav')).toEqual([every[0]]);
    expect(await run('alexa,hey-jarvis', 'espeak_alexa_16k.wav')).toEqual([every[0]]);
  });

  it("a configured group uses each head's own threshold", async () => {
    // house = alexa (0.5) + hey-jarvis at 0.9: the hey-jarvis fixture peaks at 0.955 at 2000 ms, after 0.46 at 1920 ms.
    const low = await run('house', 'espeak_hey_jarvis_22k.wav', {});
    expect(low).toEqual([expect.objectContaining({ label: 'hey-jarvis', at_ms: 2000 })]);
    // A request's threshold applies to every head.
    const req = await run('house', 'espeak_hey_jarvis_22k.wav', { threshold: 0.3 });
    expect(req).toEqual([expect.objectContaining({ label: 'hey-jarvis', at_ms: 1920 })]);
    const status = await (await fetch(`${server.url}/v1/models/house`)).json();
    expect(status).toMatchObject({ id: 'house', task: 'wakeword' });
  });

  it('a group registered and reconfigured by POST /v1/models/load', async () => {
    const load = async (body: unknown): Promise<any> =>
      (
        await fetch(`${server.url}/v1/models/load`, {
          method: 'POST',
          headers: { 'content-type': 'application/json' },
          body: JSON.stringify(body),
        })
      ).json();
    // A client's head path is not taken: the head's file is that of the model it names.
    expect(
      await load({ id: 'pair', task: 'wakeword', heads: ['hey-mycroft', { model: 'alexa', path: '/etc/passwd' }] }),
    ).toEqual({ id: 'pair', loaded: true, reconfigured: false });
    expect((await run('pair', 'espeak_alexa_16k.wav')).map((d) => d.label)).toEqual(['alexa']);
    expect(await load({ id: 'pair', heads: ['hey-mycroft', { model: 'alexa', refractory_ms: 0 }] })).toEqual({
      id: 'pair',
      loaded: true,
      reconfigured: true,
    });
    expect((await run('pair', 'espeak_alexa_16k.wav')).length).toBeGreaterThan(5);
  });

  it('an unknown model id of multi-byte characters: close 1008 with the reason cut to 123 bytes (no crash)', async () => {
    for (const model of ['a'.repeat(50) + 'é'.repeat(60), `alexa,${'é'.repeat(80)}`]) {
      const closed = await new Promise<{ code: number; bytes: number }>((resolve) => {
        const ws = new WebSocket(`${server.url.replace('http', 'ws')}/v1/stream?model=${encodeURIComponent(model)}`);
        ws.on('error', () => {});
        ws.on('close', (code, reason) => resolve({ code, bytes: reason.length }));
      });
      expect(closed.code).toBe(1008);
      expect(closed.bytes).toBeLessThanOrEqual(123);
    }
  });

  it('a group naming an unknown or non-wake-word model is refused with the name', async () => {
    const unknown = await fetch(`${server.url}/v1/tasks/run?model=alexa,nope`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: new Uint8Array(fixture('silence_3s_16k.wav')),
    });
    expect(unknown.status).toBe(404);
    expect((await unknown.json()).error.message).toContain("'nope'");
    const vad = await fetch(`${server.url}/v1/tasks/run?model=alexa,silero-vad`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: new Uint8Array(fixture('silence_3s_16k.wav')),
    });
    expect(vad.status).toBe(400);
    expect((await vad.json()).error.message).toContain('silero-vad');
    expect(() => ServerConfig.parse({ models: [{ id: 'g', task: 'vad', heads: ['alexa'] }] })).toThrow(/heads/);
  });
});
