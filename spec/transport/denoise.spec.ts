/**
 * The `denoise` task (`rnnoise`): what the server answers equals RNNoise run here, in the test,
 * straight from `@echogarden/rnnoise-wasm` on the same 48 kHz frames (one DenoiseState over the
 * whole signal), to 1 LSB after the 16-bit conversion; at 48 kHz (no resampling) and at 16 kHz
 * (the 48 kHz frames being what libsamplerate, the server's resampler, makes of the input, and the
 * answer what it makes of RNNoise's output). Noisy speech made here from the fixtures (speech +
 * white noise at 0 and 5 dB SNR) comes back with a higher SNR against the clean speech.
 */
import { execFile } from 'node:child_process';
import { mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { connect } from 'node:net';
import { Writable } from 'node:stream';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { pino } from 'pino';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import WebSocket from 'ws';
import { VoxClient } from '../../client/node.js';
import { resample } from '../../runtime/audio/audio.js';
import { ServerConfig } from '../../runtime/config.js';
import { loadRnnoiseModule, RNNOISE } from '../../runtime/slots/rnnoise.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { fixture, startTestServer, until, WaveFile } from '../helpers.js';

let server: VoxServer;
beforeAll(async () => {
  server = await startServer(ServerConfig.parse({ log_level: 'silent', port: 0 }));
});
afterAll(async () => {
  await server?.close();
});

/** A fixture's samples (mono s16) and rate. */
function samplesOf(name: string): { s16: Int16Array; rate: number } {
  const w = new WaveFile(fixture(name));
  return {
    s16: w.getSamples(false, Int16Array) as unknown as Int16Array,
    rate: (w.fmt as { sampleRate: number }).sampleRate,
  };
}

/** A mono 16-bit WAV. */
function wavOf(s16: Int16Array, rate: number): Buffer {
  const w = new WaveFile();
  w.fromScratch(1, rate, '16', s16);
  return Buffer.from(w.toBuffer());
}

/**
 * RNNoise run directly: 48 kHz float in [-1, 1], zero-padded to whole frames, one state; the output cut to the input's
 * length.
 */
async function rnnoiseDirect(x48: Float32Array): Promise<{ out: Float32Array; probs: number[] }> {
  const m = await loadRnnoiseModule();
  const st = m._rnnoise_create(0);
  const inp = m._malloc(RNNOISE.FRAME * 4);
  const outp = m._malloc(RNNOISE.FRAME * 4);
  const frames = Math.ceil(x48.length / RNNOISE.FRAME);
  const padded = new Float32Array(frames * RNNOISE.FRAME);
  for (let i = 0; i < x48.length; i++) padded[i] = x48[i] * RNNOISE.SCALE;
  const out = new Float32Array(padded.length);
  const probs: number[] = [];
  for (let f = 0; f < frames; f++) {
    m.HEAPF32.set(padded.subarray(f * RNNOISE.FRAME, (f + 1) * RNNOISE.FRAME), inp >> 2);
    probs.push(m._rnnoise_process_frame(st, outp, inp));
    out.set(m.HEAPF32.subarray(outp >> 2, (outp >> 2) + RNNOISE.FRAME), f * RNNOISE.FRAME);
  }
  m._rnnoise_destroy(st);
  return { out: out.subarray(0, x48.length).map((v) => v / RNNOISE.SCALE), probs };
}

/** What the server should answer for `s16` at `rate`: resampled to 48 kHz, RNNoise, resampled back, 16-bit. */
async function expected(s16: Int16Array, rate: number): Promise<{ s16: Int16Array; probs: number[] }> {
  const x = Float32Array.from(s16, (v) => v / 32768);
  const { out, probs } = await rnnoiseDirect(await resample(x, rate, RNNOISE.RATE));
  const back = await resample(out, RNNOISE.RATE, rate);
  return { s16: Int16Array.from(back, (v) => Math.min(32767, Math.max(-32768, Math.round(v * 32768)))), probs };
}

/** POST /v1/tasks/run?model=rnnoise with a WAV body. */
async function run(wav: Buffer, query = '', accept?: string): Promise<Response> {
  return fetch(`${server.url}/v1/tasks/run?model=rnnoise${query}`, {
    method: 'POST',
    headers: { 'content-type': 'audio/wav', ...(accept ? { accept } : {}) },
    body: new Uint8Array(wav),
  });
}

const answerOf = async (res: Response): Promise<{ s16: Int16Array; rate: number }> => {
  const w = new WaveFile(Buffer.from(await res.arrayBuffer()));
  return {
    s16: w.getSamples(false, Int16Array) as unknown as Int16Array,
    rate: (w.fmt as { sampleRate: number }).sampleRate,
  };
};

/** Largest absolute difference between two equally long signals. */
function maxDiff(a: Int16Array, b: Int16Array): number {
  expect(a.length).toBe(b.length);
  let d = 0;
  for (let i = 0; i < a.length; i++) d = Math.max(d, Math.abs(a[i] - b[i]));
  return d;
}

/** Seeded white noise (uniform), unit power. */
function noise(n: number, seed: number): Float32Array {
  const x = new Float32Array(n);
  let s = seed;
  for (let i = 0; i < n; i++) {
    s = (Math.imul(s, 1_664_525) + 1_013_904_223) >>> 0;
    x[i] = ((s / 2 ** 32) * 2 - 1) * Math.sqrt(3);
  }
  return x;
}

const power = (x: ArrayLike<number>): number => {
  let p = 0;
  for (let i = 0; i < x.length; i++) p += x[i] * x[i];
  return p / x.length;
};

/** SNR of `y` against `clean`, dB, at the best delay of `y` within 0-20 ms (RNNoise's output lags by a frame). */
function snr(clean: Float32Array, y: Float32Array, rate: number): number {
  let best = -Infinity;
  for (let lag = 0; lag <= rate / 50; lag++) {
    let err = 0;
    let sig = 0;
    for (let i = 0; i + lag < y.length && i < clean.length; i++) {
      const e = clean[i] - y[i + lag];
      err += e * e;
      sig += clean[i] * clean[i];
    }
    best = Math.max(best, 10 * Math.log10(sig / err));
  }
  return best;
}

/** `clean` (float) with white noise added at `db` SNR, as 16-bit samples. */
function noisy(clean: Float32Array, db: number): Int16Array {
  const n = noise(clean.length, 42);
  const g = Math.sqrt(power(clean) / 10 ** (db / 10));
  return Int16Array.from(clean, (v, i) => Math.min(32767, Math.max(-32768, Math.round((v + g * n[i]) * 32768))));
}

describe('POST /v1/tasks/run?model=rnnoise', () => {
  it.each([
    ['Front_Center.wav', 48_000],
    ['espeak_sentence_16k.wav', 16_000],
  ])(
    '%s: the WAV answered equals RNNoise run directly on the same 48 kHz frames (to 1 LSB), at the input rate',
    async (name, rate) => {
      const { s16, rate: r } = samplesOf(name);
      expect(r).toBe(rate);
      const res = await run(wavOf(s16, rate));
      expect(res.status).toBe(200);
      expect(res.headers.get('content-type')).toBe('audio/wav');
      const got = await answerOf(res);
      expect(got.rate).toBe(rate);
      const want = await expected(s16, rate);
      expect(maxDiff(got.s16, want.s16)).toBeLessThanOrEqual(1);
      // Denoising did something: the answer is not the input.
      expect(maxDiff(got.s16, s16)).toBeGreaterThan(100);
    },
  );

  it('answers at the rate asked for (sample_rate=8000)', async () => {
    const { s16 } = samplesOf('Front_Center.wav');
    const got = await answerOf(await run(wavOf(s16, 48_000), '&sample_rate=8000'));
    expect(got.rate).toBe(8000);
    expect(got.s16.length).toBe(Math.round(s16.length / 6));
  });

  it("Accept: application/json gives RNNoise's speech probability per 10 ms frame, and timing", async () => {
    const { s16 } = samplesOf('Front_Center.wav');
    const res = await run(wavOf(s16, 48_000), '', 'application/json');
    expect(res.headers.get('content-type')).toMatch(/application\/json/);
    const body = (await res.json()) as { task: string; frame_ms: number; probabilities: number[]; timing: object };
    expect(body.task).toBe('denoise');
    expect(body.frame_ms).toBe(10);
    const want = await expected(s16, 48_000);
    expect(body.probabilities.length).toBe(want.probs.length);
    body.probabilities.forEach((p, i) => expect(Math.abs(p - want.probs[i])).toBeLessThan(1e-5));
    expect(Math.max(...body.probabilities)).toBeGreaterThan(0.9);
    expect(body.timing).toHaveProperty('rtf');
  });

  it('bad input names the field: sample_rate out of range, sample_rate asked of a VAD model', async () => {
    const { s16 } = samplesOf('Front_Center.wav');
    const bad = await run(wavOf(s16, 48_000), '&sample_rate=5');
    expect(bad.status).toBe(400);
    expect(((await bad.json()) as { error: { message: string } }).error.message).toMatch(/sample_rate/);
    const vad = await fetch(`${server.url}/v1/tasks/run?model=silero-vad&sample_rate=16000`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: new Uint8Array(wavOf(s16, 48_000)),
    });
    expect(vad.status).toBe(400);
    expect(((await vad.json()) as { error: { message: string } }).error.message).toMatch(/sample_rate.*denoise/);
  });

  it('a batch to a denoise model is a 400 naming model (a denoise model answers one file at a time)', async () => {
    const res = await fetch(`${server.url}/v1/tasks/batch`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({
        model: 'rnnoise',
        files: [wavOf(samplesOf('Front_Center.wav').s16, 48_000).toString('base64')],
      }),
    });
    expect(res.status).toBe(400);
    expect(((await res.json()) as { error: { message: string } }).error.message).toMatch(
      /^model: .*one file at a time/,
    );
  });

  it("a batch takes a chain (denoise) and refuses unknown fields (a newcomer's finding: both were ignored)", async () => {
    const file = fixture('Front_Center.wav');
    const batch = async (extra: Record<string, unknown>): Promise<Response> =>
      fetch(`${server.url}/v1/tasks/batch`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ model: 'silero-vad', files: [file.toString('base64')], ...extra }),
      });
    const resultOf = async (r: Response): Promise<unknown> => {
      expect(r.status).toBe(200);
      const text = await r.text();
      const line = text.split('\n').find((l, i, all) => all[i - 1] === 'event: result' && l.startsWith('data: '));
      return (JSON.parse(line!.slice(6)) as { segments: unknown }).segments;
    };
    const runOf = async (query: string): Promise<unknown> => {
      const r = await fetch(`${server.url}/v1/tasks/run?model=silero-vad${query}`, {
        method: 'POST',
        headers: { 'content-type': 'audio/wav' },
        body: new Uint8Array(file),
      });
      return ((await r.json()) as { segments: unknown }).segments;
    };
    const chained = await resultOf(await batch({ denoise: 'rnnoise' }));
    expect(chained).toEqual(await runOf('&denoise=rnnoise'));
    expect(chained).not.toEqual(await runOf(''));
    const unknown = await batch({ sample_rate: 8000 });
    expect(unknown.status).toBe(400);
    expect(((await unknown.json()) as { error: { message: string } }).error.message).toMatch(/sample_rate/);
  });

  it('noisy speech (fixture + white noise at 0 and 5 dB SNR) comes back with a higher SNR against the clean speech', async () => {
    const { s16, rate } = samplesOf('silero_test.wav');
    const clean = Float32Array.from(s16.subarray(0, rate * 20), (v) => (v / 32768) * 0.5);
    const figures: string[] = [];
    for (const db of [0, 5]) {
      const input = noisy(clean, db);
      const got = await answerOf(await run(wavOf(input, rate)));
      const before = snr(
        clean,
        Float32Array.from(input, (v) => v / 32768),
        rate,
      );
      const after = snr(
        clean,
        Float32Array.from(got.s16, (v) => v / 32768),
        rate,
      );
      figures.push(`${db} dB: SNR ${before.toFixed(1)} -> ${after.toFixed(1)} dB`);
      expect(after).toBeGreaterThan(before + 3);
    }
    console.log(`denoise SNR (silero_test.wav, first 20 s, white noise): ${figures.join('; ')}`);
  });
});

/**
 * Streams s16le `s16` at `rate` to `/v1/stream?model=rnnoise` in frames of `frameMs`; the audio frames answered
 * (concatenated) and the events.
 */
function streamDenoise(
  s16: Int16Array,
  rate: number,
  frameMs: number,
  query = '',
): Promise<{ audio: Int16Array; events: { type: string; [k: string]: unknown }[]; order: string[] }> {
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(`${server.url.replace('http', 'ws')}/v1/stream?model=rnnoise&sample_rate=${rate}${query}`);
    const parts: Buffer[] = [];
    const events: { type: string; [k: string]: unknown }[] = [];
    const order: string[] = [];
    ws.on('error', reject);
    ws.on('message', (d: Buffer, binary: boolean) => {
      if (binary) {
        parts.push(Buffer.from(d));
        if (order[order.length - 1] !== 'audio') order.push('audio');
        return;
      }
      const e = JSON.parse(d.toString()) as { type: string };
      events.push(e);
      order.push(e.type);
      if (e.type !== 'ready') return;
      const pcm = Buffer.from(s16.buffer, s16.byteOffset, s16.byteLength);
      const frame = ((rate * frameMs) / 1000) * 2;
      for (let o = 0; o < pcm.length; o += frame) ws.send(pcm.subarray(o, o + frame));
      ws.send(JSON.stringify({ type: 'end' }));
    });
    ws.on('close', () => {
      const all = Buffer.concat(parts);
      resolve({ audio: new Int16Array(all.buffer, all.byteOffset, all.length / 2), events, order });
    });
  });
}

describe('a rnnoise stream on /v1/stream', () => {
  it.each([
    ['Front_Center.wav', 48_000, 20],
    ['Front_Center.wav', 48_000, 100],
    ['espeak_sentence_16k.wav', 16_000, 20],
    ['espeak_sentence_16k.wav', 16_000, 100],
  ])(
    '%s at %i Hz in %i ms frames: binary frames of denoised s16le at the stream rate, in order, equal to RNNoise run directly (1 LSB), between ready and done',
    async (name, rate, frameMs) => {
      const { s16 } = samplesOf(name);
      const got = await streamDenoise(s16, rate, frameMs);
      expect(got.order[0]).toBe('ready');
      expect(got.order[got.order.length - 1]).toBe('done');
      expect(got.order).toEqual(['ready', 'audio', 'done']);
      expect(got.events[0]).toMatchObject({ task: 'denoise', sample_rate: rate });
      const want = await expected(s16, rate);
      expect(maxDiff(got.audio, want.s16)).toBeLessThanOrEqual(1);
    },
  );
});

describe('the client and a rnnoise stream', () => {
  it.each(['json', 'msgpack'] as const)(
    'for await yields the denoised audio as audio chunks (%s), the same as a raw ws peer gets',
    async (protocol) => {
      const { s16 } = samplesOf('espeak_sentence_16k.wav');
      const stream = await new VoxClient({ url: server.url }).stream({
        model: 'rnnoise',
        sampleRate: 16_000,
        protocol,
      });
      const chunks: Uint8Array[] = [];
      const types: string[] = [];
      const reading = (async () => {
        for await (const e of stream) {
          types.push(e.type);
          if (e.type === 'audio') chunks.push(e.data);
        }
      })();
      const pcm = Buffer.from(s16.buffer, s16.byteOffset, s16.byteLength);
      for (let o = 0; o < pcm.length; o += 640) await stream.send(pcm.subarray(o, o + 640));
      await stream.end();
      await reading;
      expect(types[0]).toBe('ready');
      expect(types[types.length - 1]).toBe('done');
      const all = Buffer.concat(chunks);
      const got = new Int16Array(all.buffer, all.byteOffset, all.length / 2);
      expect(maxDiff(got, (await expected(s16, 16_000)).s16)).toBeLessThanOrEqual(1);
    },
  );
});

/**
 * 10 s of noise-only audio at 16 kHz: clicks (5 ms bursts of white noise at +-0.5, every 250 ms:
 * a keyboard, a ticking clock) over a faint white floor (+-0.005), seeded. Silero VAD v6 at
 * threshold 0.1 finds 1-2 "speech" segments in it for seeds 1, 2 and 3 (none at 0.3 or 0.5).
 */
function clicks(seed = 1): Int16Array {
  let s = seed;
  return Int16Array.from({ length: 16_000 * 10 }, (_, i) => {
    s = (Math.imul(s, 1_664_525) + 1_013_904_223) >>> 0;
    return Math.round(((s / 2 ** 32) * 2 - 1) * (i % 4000 < 80 ? 0.5 : 0.005) * 32768);
  });
}

describe('a chain: denoise=rnnoise on a VAD request', () => {
  it.each([1, 2, 3])(
    'VAD (Silero v6, threshold 0.1) finds speech in noise-only clicks (seed %i) alone, and none with denoise=rnnoise',
    async (seed) => {
      const body = new Uint8Array(wavOf(clicks(seed), 16_000));
      const vad = async (extra: string): Promise<{ segments: { start_ms: number; end_ms: number }[] }> => {
        const res = await fetch(`${server.url}/v1/tasks/run?model=silero-vad&threshold=0.1${extra}`, {
          method: 'POST',
          headers: { 'content-type': 'audio/wav' },
          body,
        });
        expect(res.status).toBe(200);
        return (await res.json()) as { segments: { start_ms: number; end_ms: number }[] };
      };
      const alone = await vad('');
      const chained = await vad('&denoise=rnnoise');
      const ms = (r: typeof alone): number => r.segments.reduce((t, s) => t + s.end_ms - s.start_ms, 0);
      console.log(
        `VAD on 10 s of clicks (seed ${seed}): alone ${alone.segments.length} segment(s), ${ms(alone)} ms; with denoise=rnnoise ${chained.segments.length}, ${ms(chained)} ms`,
      );
      expect(alone.segments.length).toBeGreaterThan(0);
      expect(chained.segments).toEqual([]);
    },
  );

  it('the chain still finds the speech of a fixture', async () => {
    const { s16 } = samplesOf('espeak_sentence_16k.wav');
    const res = await fetch(`${server.url}/v1/tasks/run?model=silero-vad&denoise=rnnoise`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: new Uint8Array(wavOf(s16, 16_000)),
    });
    const body = (await res.json()) as { segments: unknown[] };
    expect(body.segments.length).toBe(1);
  });

  it('bad chains are 400s naming denoise: a model that is not a denoise model, a chain on a denoise model', async () => {
    const body = new Uint8Array(wavOf(samplesOf('espeak_sentence_16k.wav').s16, 16_000));
    for (const q of ['model=silero-vad&denoise=silero-vad-v5', 'model=rnnoise&denoise=rnnoise']) {
      const res = await fetch(`${server.url}/v1/tasks/run?${q}`, {
        method: 'POST',
        headers: { 'content-type': 'audio/wav' },
        body,
      });
      expect(res.status).toBe(400);
      expect(((await res.json()) as { error: { message: string } }).error.message).toMatch(/denoise/);
    }
  });
});

describe('the CLI', () => {
  it('voxserve run rnnoise in.wav -o out.wav writes the denoised WAV; --denoise rnnoise chains a VAD run', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'voxserve-denoise-'));
    const { s16 } = samplesOf('espeak_sentence_16k.wav');
    writeFileSync(join(dir, 'in.wav'), wavOf(s16, 16_000));
    const cli = fileURLToPath(new URL('../../dist/tools/cli.js', import.meta.url));
    const run = (...args: string[]) =>
      promisify(execFile)(process.execPath, [cli, 'run', ...args, '--url', server.url]);
    await run('rnnoise', join(dir, 'in.wav'), '-o', join(dir, 'out.wav'));
    const out = new WaveFile(readFileSync(join(dir, 'out.wav')));
    expect((out.fmt as { sampleRate: number }).sampleRate).toBe(16_000);
    const got = out.getSamples(false, Int16Array) as unknown as Int16Array;
    expect(maxDiff(got, (await expected(s16, 16_000)).s16)).toBeLessThanOrEqual(1);
    const chained = JSON.parse((await run('silero-vad', join(dir, 'in.wav'), '--denoise', 'rnnoise')).stdout) as {
      segments: unknown[];
    };
    expect(chained.segments.length).toBe(1);
  });
});

/** Streams s16le `s16` at 16 kHz to `/v1/stream?<query>` in 100 ms frames; every event. */
function streamEvents(s16: Int16Array, query: string): Promise<{ type: string; [k: string]: unknown }[]> {
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(`${server.url.replace('http', 'ws')}/v1/stream?sample_rate=16000&${query}`);
    const events: { type: string; [k: string]: unknown }[] = [];
    ws.on('error', reject);
    ws.on('message', (d: Buffer) => {
      const e = JSON.parse(d.toString()) as { type: string };
      events.push(e);
      if (e.type !== 'ready') return;
      const pcm = Buffer.from(s16.buffer, s16.byteOffset, s16.byteLength);
      for (let o = 0; o < pcm.length; o += 3200) ws.send(pcm.subarray(o, o + 3200));
      ws.send(JSON.stringify({ type: 'end' }));
    });
    ws.on('close', () => resolve(events));
  });
}

describe('a chain on a stream: /v1/stream?model=silero-vad&denoise=rnnoise', () => {
  it.each([1, 2, 3])(
    'clicks (seed %i): speech events alone, none with denoise=rnnoise; done either way',
    async (seed) => {
      const alone = await streamEvents(clicks(seed), 'model=silero-vad&threshold=0.1');
      const chained = await streamEvents(clicks(seed), 'model=silero-vad&threshold=0.1&denoise=rnnoise');
      const speech = (es: { type: string }[]) => es.filter((e) => e.type === 'speech_end').length;
      console.log(
        `stream, clicks (seed ${seed}): VAD alone ${speech(alone)} segment(s), with denoise=rnnoise ${speech(chained)}`,
      );
      expect(speech(alone)).toBeGreaterThan(0);
      expect(speech(chained)).toBe(0);
      expect(chained[chained.length - 1]).toMatchObject({ type: 'done' });
      expect(chained[chained.length - 1].processed_ms).toBe(10_000);
    },
  );

  it('the chained stream still finds the sentence, and leaves no lease held', async () => {
    const events = await streamEvents(samplesOf('espeak_sentence_16k.wav').s16, 'model=silero-vad&denoise=rnnoise');
    expect(events.filter((e) => e.type === 'speech_end').length).toBe(1);
    const { models } = (await (await fetch(`${server.url}/v1/models`)).json()) as {
      models: { id: string; active_leases: number }[];
    };
    for (const m of models) expect(m.active_leases, m.id).toBe(0);
  });

  it('a bad chain closes the stream 1008 with an error naming denoise', async () => {
    const events = await streamEvents(
      samplesOf('espeak_sentence_16k.wav').s16,
      'model=silero-vad&denoise=silero-vad-v5',
    );
    expect(events.find((e) => e.type === 'error')).toMatchObject({
      error: { message: expect.stringMatching(/^denoise/) },
    });
  });
});

describe('rnnoise streams batched together', () => {
  it('four streams at once (the batcher packs their jobs as rows of one job): each gets exactly its own denoised audio', async () => {
    const inputs = [
      { ...samplesOf('espeak_sentence_16k.wav'), rate: 16_000 },
      { s16: samplesOf('Front_Center.wav').s16, rate: 48_000 },
      { s16: samplesOf('Front_Left.wav').s16, rate: 48_000 },
      { s16: Int16Array.from(samplesOf('espeak_sentence_16k.wav').s16, (v) => v >> 1), rate: 16_000 },
    ];
    const got = await Promise.all(inputs.map((i) => streamDenoise(i.s16, i.rate, 20)));
    for (const [k, i] of inputs.entries()) {
      const want = await expected(i.s16, i.rate);
      expect(maxDiff(got[k].audio, want.s16), `stream ${k}`).toBeLessThanOrEqual(1);
    }
    // Rows were packed together: more rows than batches.
    const metrics = await (await fetch(`${server.url}/metrics`)).text();
    const figure = (name: string): number =>
      Number(
        metrics
          .split('\n')
          .find((l) => l.startsWith(`${name}{model="rnnoise"}`))
          ?.split(' ')[1],
      );
    expect(figure('voxserve_batch_size_sum')).toBeGreaterThan(figure('voxserve_batch_size_count'));
  });
});

/**
 * A Wyoming session on 127.0.0.1:`port` (the framing of the Wyoming README: a JSON header line,
 * then data and payload bytes): `detect {names}`, then per audio stream of `s16` (16 kHz mono;
 * several: one after another on the connection) `audio-start`, 100 ms `audio-chunk`s stamped with
 * their ms of audio, `audio-stop`, and a wait for its `not-detected` or `detection` (and
 * `done(events)`); resolves with every event (type plus data).
 */
async function wyoming(
  port: number,
  names: string[],
  s16: Int16Array | Int16Array[],
  done: (events: { type: string; [k: string]: unknown }[]) => boolean = () => true,
): Promise<{ type: string; [k: string]: unknown }[]> {
  const socket = connect(port, '127.0.0.1');
  socket.on('error', () => {});
  const events: { type: string; [k: string]: unknown }[] = [];
  let buf = Buffer.alloc(0);
  socket.on('data', (d: Buffer) => {
    buf = Buffer.concat([buf, d]);
    for (let nl = buf.indexOf('\n'); nl >= 0; nl = buf.indexOf('\n')) {
      const header = JSON.parse(buf.subarray(0, nl).toString());
      const dl = header.data_length ?? 0;
      if (buf.length < nl + 1 + dl + (header.payload_length ?? 0)) break;
      const data = dl ? JSON.parse(buf.subarray(nl + 1, nl + 1 + dl).toString()) : {};
      events.push({ type: header.type, ...header.data, ...data });
      buf = buf.subarray(nl + 1 + dl + (header.payload_length ?? 0));
    }
  });
  const send = (type: string, data: Record<string, unknown>, payload?: Buffer): void => {
    const body = Buffer.from(JSON.stringify(data));
    const header = { type, data_length: body.length, payload_length: payload?.length ?? 0 };
    socket.write(Buffer.concat([Buffer.from(`${JSON.stringify(header)}\n`), body, payload ?? Buffer.alloc(0)]));
  };
  const fmt = { rate: 16_000, width: 2, channels: 1 };
  const answers = (): number =>
    events.filter((e) => e.type === 'error' || e.type === 'not-detected' || e.type === 'detection').length;
  send('detect', { names });
  for (const [i, one] of (Array.isArray(s16) ? s16 : [s16]).entries()) {
    const pcm = Buffer.from(one.buffer, one.byteOffset, one.byteLength);
    send('audio-start', { ...fmt, timestamp: 0 });
    for (let o = 0; o < pcm.length; o += 3200)
      send('audio-chunk', { ...fmt, timestamp: o / 32 }, pcm.subarray(o, o + 3200));
    send('audio-stop', { timestamp: pcm.length / 32 });
    await until(() => events.some((e) => e.type === 'error') || (answers() > i && done(events)), 60_000);
  }
  socket.end();
  return events;
}

describe('a chain on Wyoming: wyoming.denoise = "rnnoise"', () => {
  // Both with Silero v6 at threshold 0.1 (Wyoming takes the model's configured options), one with the chain.
  const vadLow = { models: [{ id: 'silero-vad', options: { threshold: 0.1 } }] };
  let plain: VoxServer;
  let chained: VoxServer;
  beforeAll(async () => {
    [plain, chained] = await Promise.all([
      startTestServer({ ...vadLow, wyoming: { enabled: true, port: 0 } }),
      startTestServer({ ...vadLow, wyoming: { enabled: true, port: 0, denoise: 'rnnoise' } }),
    ]);
  });
  afterAll(async () => {
    await Promise.all([plain?.close(), chained?.close()]);
  });
  const leases = async (s: VoxServer): Promise<Record<string, number>> => {
    const { models } = (await (await fetch(`${s.url}/v1/models`)).json()) as {
      models: { id: string; active_leases: number }[];
    };
    return Object.fromEntries(models.map((m) => [m.id, m.active_leases]));
  };

  it.each([1, 2])(
    'clicks (seed %i): voice-started without the chain, none with it; not-detected either way',
    async (seed) => {
      const speech = (es: { type: string }[]) => es.filter((e) => e.type === 'voice-started').length;
      const alone = await wyoming(plain.wyoming!.port, ['alexa', 'silero-vad'], clicks(seed));
      const denoised = await wyoming(chained.wyoming!.port, ['alexa', 'silero-vad'], clicks(seed));
      console.log(
        `Wyoming, clicks (seed ${seed}): VAD alone ${speech(alone)} voice-started, with wyoming.denoise ${speech(denoised)}`,
      );
      expect(speech(alone)).toBeGreaterThan(0);
      expect(speech(denoised)).toBe(0);
      expect(denoised.map((e) => e.type)).toEqual(['not-detected']);
    },
  );

  it("the chained connection still hears 'alexa' (detection) and its speech where the HTTP chain finds it; the link holds its own lease", async () => {
    const { s16 } = samplesOf('espeak_alexa_16k.wav');
    const port = chained.wyoming!.port;
    const events = await wyoming(port, ['alexa', 'silero-vad'], s16, (es) =>
      es.some((e) => e.type === 'voice-stopped'),
    );
    // The HTTP chain on the same audio and server: the reference the Wyoming chain must agree with.
    const res = await fetch(`${chained.url}/v1/tasks/run?model=silero-vad&denoise=rnnoise`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: new Uint8Array(wavOf(s16, 16_000)),
    });
    const { segments } = (await res.json()) as { segments: { start_ms: number; end_ms: number }[] };
    expect(events.find((e) => e.type === 'detection')).toMatchObject({ name: 'alexa' });
    const started = events.filter((e) => e.type === 'voice-started').map((e) => e.timestamp as number);
    const stopped = events.filter((e) => e.type === 'voice-stopped').map((e) => e.timestamp as number);
    expect(started.length).toBe(segments.length);
    segments.forEach((s, i) => {
      // One Silero window (32 ms) apart at most: the stream's and the file's resampling differ only at the edges.
      expect(Math.abs(started[i] - s.start_ms)).toBeLessThanOrEqual(32);
      expect(Math.abs(stopped[i] - s.end_ms)).toBeLessThanOrEqual(32);
    });
    // A connection open with the chain: rnnoise leased beside the wake word and VAD models.
    const socket = connect(port, '127.0.0.1');
    socket.on('error', () => {});
    const body = Buffer.from(JSON.stringify({ rate: 16_000, width: 2, channels: 1 }));
    socket.write(`${JSON.stringify({ type: 'audio-start', data_length: body.length })}\n${body}`);
    await until(async () => (await leases(chained)).rnnoise === 1, 20_000);
    const during = await leases(chained);
    socket.destroy();
    expect(during.rnnoise).toBe(1);
    await until(async () => Object.values(await leases(chained)).every((n) => n === 0), 10_000);
  });

  it('one chained connection, three audio streams (a new first link each): alexa, silence, alexa', async () => {
    const alexa = samplesOf('espeak_alexa_16k.wav').s16;
    const events = await wyoming(chained.wyoming!.port, ['alexa'], [alexa, new Int16Array(16_000), alexa]);
    expect(events.map((e) => (e.type === 'detection' ? `${e.type}:${e.name}` : e.type))).toEqual([
      'detection:alexa',
      'not-detected',
      'detection:alexa',
    ]);
  });
});

describe('wyoming.denoise: a bad value is a configuration error naming the field', () => {
  it('not a string, an unknown model, a model that is not a denoise model', async () => {
    expect(() => ServerConfig.parse({ wyoming: { denoise: 5 } })).toThrow(/wyoming.*denoise/s);
    for (const [id, problem] of [
      ['nope', /wyoming\.denoise.*'nope' is not a model this server knows/],
      ['silero-vad', /wyoming\.denoise.*'silero-vad' is a vad model, not a denoise model/],
    ] as const) {
      await expect(startTestServer({ wyoming: { enabled: true, port: 0, denoise: id } }), id).rejects.toThrow(problem);
    }
  });
});

describe("the close log line's processed_ms is the audio's length (RNNoise counts 48 kHz samples inside)", () => {
  it('2 s sent to a rnnoise stream, a chained VAD stream and a chained Wyoming connection: processed_ms 2000 each', async () => {
    const lines: Record<string, unknown>[] = [];
    const sink = new Writable({
      write(chunk, _enc, cb) {
        for (const l of chunk.toString().split('\n')) if (l) lines.push(JSON.parse(l));
        cb();
      },
    });
    const s = await startServer(
      ServerConfig.parse({ port: 0, wyoming: { enabled: true, port: 0, denoise: 'rnnoise' } }),
      { log: pino({ level: 'info' }, sink) },
    );
    try {
      const two = samplesOf('espeak_sentence_16k.wav').s16.subarray(0, 32_000);
      const pcm = Buffer.from(two.buffer, two.byteOffset, two.byteLength);
      for (const query of ['model=rnnoise', 'model=silero-vad&denoise=rnnoise']) {
        const ws = new WebSocket(`${s.url.replace('http', 'ws')}/v1/stream?sample_rate=16000&${query}`);
        await new Promise<void>((resolve, reject) => {
          ws.on('error', reject);
          ws.on('message', (d, binary) => {
            if (binary || JSON.parse(d.toString()).type !== 'ready') return;
            for (let o = 0; o < pcm.length; o += 3200) ws.send(pcm.subarray(o, o + 3200));
            ws.send(JSON.stringify({ type: 'end' }));
          });
          ws.on('close', () => resolve());
        });
      }
      await wyoming(s.wyoming!.port, ['alexa'], two);
      const closed = () => lines.filter((l) => l.msg === 'stream closed');
      await until(() => closed().length === 3, 10_000);
      expect(closed().map((l) => [l.route, l.model, l.processed_ms])).toEqual([
        ['stream', 'rnnoise', 2000],
        ['stream', 'silero-vad', 2000],
        ['wyoming', 'alexa', 2000],
      ]);
    } finally {
      await s.close();
    }
  });
});
