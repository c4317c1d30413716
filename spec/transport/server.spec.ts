import { writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { unpack } from 'msgpackr';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import WebSocket from 'ws';
import { defaultCatalog } from '../../runtime/config.js';
import type { ModelLoader } from '../../runtime/loader.js';
import type { VoxServer } from '../../transport/server.js';
import { fakeLoader } from '../fuzz/fakes.js';
import { expectSegments, fixture, handshake, reference, startTestServer, toneWav, WaveFile } from '../helpers.js';

let server: VoxServer;
const MAX_BODY = 4 * 1024 * 1024;

beforeAll(async () => {
  server = await startTestServer({
    management: { enabled: true },
    models_root: tmpdir(),
    limits: { max_body_bytes: MAX_BODY },
  });
});
afterAll(async () => {
  await server?.close();
});

async function runWav(
  model: string,
  wav: Buffer,
  query = '',
): Promise<{ status: number; body: any; headers: Headers }> {
  const res = await fetch(`${server.url}/v1/tasks/run?model=${model}${query}`, {
    method: 'POST',
    headers: { 'content-type': 'audio/wav' },
    body: new Uint8Array(wav),
  });
  return { status: res.status, body: await res.json(), headers: res.headers };
}

async function postJson(path: string, body: unknown): Promise<{ status: number; body: any }> {
  const res = await fetch(`${server.url}${path}`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: typeof body === 'string' ? body : JSON.stringify(body),
  });
  return { status: res.status, body: await res.json() };
}

interface StreamOutcome {
  events: any[];
  closeCode: number;
  closeReason: string;
  /** Audio frames sent when the first task event (not `ready`) arrived. */
  framesSentAtFirstEvent: number | null;
  frames: number;
}

/** Streams a WAV file's PCM (s16le at its own rate and channels) and collects every event. */
function streamWav(
  model: string,
  wav: Buffer,
  opts: { protocol?: string; frameMs?: number; paceMs?: number; query?: string; before?: (ws: WebSocket) => void } = {},
): Promise<StreamOutcome> {
  const w = new WaveFile(wav);
  w.toBitDepth('16');
  const fmt = w.fmt as { sampleRate: number; numChannels: number };
  const pcm = Buffer.from((w.data as { samples: Uint8Array }).samples);
  const frameBytes = Math.round((fmt.sampleRate * (opts.frameMs ?? 100)) / 1000) * 2 * fmt.numChannels;
  const frames = Math.ceil(pcm.length / frameBytes);
  const protocol = opts.protocol ?? 'voxserve.v1.json';
  const q = opts.query ?? `model=${model}&sample_rate=${fmt.sampleRate}&channels=${fmt.numChannels}&encoding=s16le`;
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(`${server.url.replace('http', 'ws')}/v1/stream?${q}`, protocol);
    const out: StreamOutcome = { events: [], closeCode: 0, closeReason: '', framesSentAtFirstEvent: null, frames };
    let sent = 0;
    ws.on('error', reject);
    ws.on('message', async (data: Buffer, binary: boolean) => {
      const event = protocol === 'voxserve.v1.msgpack' ? unpack(data) : JSON.parse(data.toString());
      if (protocol === 'voxserve.v1.msgpack') expect(binary).toBe(true);
      out.events.push(event);
      if (event.type !== 'ready') {
        out.framesSentAtFirstEvent ??= sent;
        return;
      }
      opts.before?.(ws);
      for (let off = 0; off < pcm.length; off += frameBytes) {
        ws.send(pcm.subarray(off, off + frameBytes));
        sent++;
        if (opts.paceMs) await new Promise((r) => setTimeout(r, opts.paceMs));
      }
      ws.send(JSON.stringify({ type: 'end' }));
    });
    ws.on('close', (code, reason) => {
      out.closeCode = code;
      out.closeReason = reason.toString();
      resolve(out);
    });
  });
}

describe('server basics', () => {
  it('the idle collection runs once after work while a probe polls /health every second, and not again for the probe', async () => {
    const poll = async (ms: number, stop: () => boolean = () => false): Promise<void> => {
      for (const end = Date.now() + ms; Date.now() < end && !stop(); ) {
        expect((await fetch(`${server.url}/health`)).status).toBe(200);
        await new Promise((r) => setTimeout(r, 1000));
      }
    };
    // The file's first test: no work yet, so no collection is due from earlier tests.
    const base = server.idleGc.runs;
    expect(base).toBe(0);
    expect((await runWav('silero-vad', fixture('silero_test.wav'))).status).toBe(200);
    await poll(9000, () => server.idleGc.runs > base);
    expect(server.idleGc.runs).toBe(base + 1);
    await poll(6500);
    expect(server.idleGc.runs).toBe(base + 1);
  }, 30_000);

  it('reports /health, /ready and the embedded catalog', async () => {
    expect(await (await fetch(`${server.url}/health`)).json()).toMatchObject({ status: 'ok' });
    expect((await fetch(`${server.url}/ready`)).status).toBe(200);
    const { models } = await (await fetch(`${server.url}/v1/models`)).json();
    expect(models.map((m: { id: string }) => m.id).sort()).toEqual([
      'alexa',
      'hey-jarvis',
      'hey-mycroft',
      'hey-rhasspy',
      'rnnoise',
      'silero-vad',
      'silero-vad-v5',
      'timer',
      'weather',
    ]);
    const one = await (await fetch(`${server.url}/v1/models/silero-vad`)).json();
    expect(Object.keys(one).sort()).toEqual(
      [
        'active_leases',
        'active_slots',
        'cool_down',
        'id',
        'last_error',
        'last_eviction',
        'last_used_at',
        'licence',
        'loaded',
        'max_streams',
        'oldest_wait_ms',
        'processing_lag_ms',
        'queued_requests',
        'resident_bytes',
        'retiring',
        'slots',
        'state',
        'task',
      ].sort(),
    );
  });

  it('routes: 404 for a path no route has, 405 with Allow for a method the path does not take, 426 for a plain GET of the stream route', async () => {
    const call = async (method: string, path: string) => {
      const r = await fetch(`${server.url}${path}`, { method });
      return { status: r.status, allow: r.headers.get('allow'), error: (await r.json()).error };
    };
    expect(await call('GET', '/no/such/route')).toMatchObject({
      status: 404,
      error: { type: 'not_found', code: 'route_not_found', message: 'no route GET /no/such/route' },
    });
    expect(await call('PUT', '/health')).toMatchObject({
      status: 405,
      allow: 'GET',
      error: { type: 'invalid_request_error', code: 'method_not_allowed' },
    });
    expect(await call('GET', '/v1/tasks/run')).toMatchObject({
      status: 405,
      allow: 'POST',
      error: { code: 'method_not_allowed' },
    });
    expect(await call('DELETE', '/v1/models/silero-vad/')).toMatchObject({
      status: 405,
      allow: 'GET',
      error: { code: 'method_not_allowed' },
    });
    expect(await call('POST', '/demo/x.js')).toMatchObject({ status: 405, allow: 'GET, HEAD' });
    expect(await call('GET', '/v1/models/%ZZ')).toMatchObject({
      status: 400,
      error: { code: 'invalid_field', message: expect.stringMatching(/^id: /) },
    });
    expect(await call('GET', '/v1/stream')).toMatchObject({ status: 426, error: { code: 'websocket_required' } });
    // A route's own path with a trailing slash is the route.
    expect((await fetch(`${server.url}/health/`)).status).toBe(200);
  });
});

describe('while starting (an eager model still loading)', () => {
  it('a run and a stream upgrade both answer 503 server_busy "the server is starting", not "shutting down"', async () => {
    let release!: () => void;
    const gate = new Promise<void>((resolve) => (release = resolve));
    const loader: ModelLoader = async (config, signal) => {
      await Promise.race([
        gate,
        new Promise((_, reject) => signal?.addEventListener('abort', () => reject(new Error('aborted')))),
      ]);
      return fakeLoader(config, signal);
    };
    const s = await startTestServer(
      { models: [{ id: 'eager', task: 'vad', path: 'eager.onnx', lazy: false }] },
      { loader },
    );
    try {
      expect(s.supervisor.phase).toBe('starting');
      const starting = {
        type: 'server_busy',
        code: 'server_starting',
        message: 'the server is starting: its models are loading; GET /ready answers 200 once it accepts work',
      };
      const run = await fetch(`${s.url}/v1/tasks/run?model=silero-vad`, {
        method: 'POST',
        headers: { 'content-type': 'audio/wav' },
        body: new Uint8Array(fixture('silero_test.wav')),
      });
      expect(run.status).toBe(503);
      expect((await run.json()).error).toEqual(starting);
      const upgrade = await handshake(`${s.url.replace('http', 'ws')}/v1/stream?model=silero-vad`);
      expect(upgrade.status).toBe(503);
      expect(JSON.parse(upgrade.body).error).toEqual(starting);
    } finally {
      release();
      await s.close();
    }
  });
});

describe('POST /v1/tasks/run on real models and real audio', () => {
  // VAD segments on real audio: spec/transport/vad-reference.spec.ts (against independent reference values).
  const phrases = [
    'espeak_alexa_16k.wav',
    'espeak_hey_jarvis_22k.wav',
    'espeak_sentence_16k.wav',
    'Front_Center.wav',
    'silence_3s_16k.wav',
  ];
  it.each(phrases)('alexa detects only on the "alexa" phrase: %s', async (f) => {
    const r = await runWav('alexa', fixture(f));
    expect(r.status).toBe(200);
    const labels = r.body.detections.map((d: { label: string }) => d.label);
    expect(labels).toEqual(f === 'espeak_alexa_16k.wav' ? ['alexa'] : []);
  });

  it.each(phrases)('hey-jarvis detects only on the "hey jarvis" phrase (22.05 kHz, resampled): %s', async (f) => {
    const r = await runWav('hey-jarvis', fixture(f));
    const d = r.body.detections;
    if (f === 'espeak_hey_jarvis_22k.wav') {
      expect(d).toHaveLength(1);
      expect(d[0]).toMatchObject({ label: 'hey-jarvis' });
      expect(d[0].score).toBeGreaterThan(0.5);
      expect(d[0].at_ms).toBeGreaterThan(1000); // the phrase starts after 1 s of silence
    } else {
      expect(d).toEqual([]);
    }
  });

  it('accepts JSON with base64 audio and per-request options, with the same result', async () => {
    const wav = fixture('espeak_alexa_16k.wav');
    const viaWav = await runWav('alexa', wav);
    const viaJson = await postJson('/v1/tasks/run', {
      model: 'alexa',
      audio: wav.toString('base64'),
      options: { threshold: 0.5 },
    });
    expect(viaJson.status).toBe(200);
    expect(viaJson.body.detections).toEqual(viaWav.body.detections);
    // Per-request options: the ~3 s sentence is no segment when speech must last 5 s.
    const sentence = fixture('espeak_sentence_16k.wav').toString('base64');
    expect((await postJson('/v1/tasks/run', { model: 'silero-vad', audio: sentence })).body.segments).toHaveLength(1);
    const strict = await postJson('/v1/tasks/run', {
      model: 'silero-vad',
      audio: sentence,
      options: { min_speech_duration_ms: 5000 },
    });
    expect(strict.body.segments).toEqual([]);
  });
});

describe('GET /v1/stream', () => {
  it.each(['voxserve.v1.json', 'voxserve.v1.msgpack'])(
    'streams alexa in %s: ready, detection, done, close 1000',
    async (protocol) => {
      const out = await streamWav('alexa', fixture('espeak_alexa_16k.wav'), { protocol });
      expect(out.events[0]).toMatchObject({ type: 'ready', model: 'alexa', task: 'wakeword', sample_rate: 16000 });
      expect(out.events.filter((e) => e.type === 'detection')).toEqual([expect.objectContaining({ label: 'alexa' })]);
      expect(out.events.at(-1)).toMatchObject({ type: 'done' });
      expect(out.events.at(-1).processed_ms).toBeGreaterThan(2900);
      expect(out.closeCode).toBe(1000);
    },
  );

  it.each(['voxserve.v1.json', 'voxserve.v1.msgpack'])(
    'streams hey-jarvis at 22.05 kHz in %s with the HTTP result',
    async (protocol) => {
      const wav = fixture('espeak_hey_jarvis_22k.wav');
      const http = await runWav('hey-jarvis', wav);
      const out = await streamWav('hey-jarvis', wav, { protocol });
      const detections = out.events.filter((e) => e.type === 'detection').map(({ type: _t, ...d }) => d);
      expect(detections).toHaveLength(1);
      expect(detections[0].label).toBe(http.body.detections[0].label);
      // The stream resamples chunk by chunk, the file in one go: same step, nearly the same score.
      expect(detections[0].at_ms).toBe(http.body.detections[0].at_ms);
      expect(detections[0].score).toBeCloseTo(http.body.detections[0].score, 1);
    },
  );

  it('VAD over a stream gives the segments of the file', async () => {
    const wav = fixture('espeak_sentence_16k.wav');
    const http = await runWav('silero-vad', wav);
    const out = await streamWav('silero-vad', wav, { frameMs: 20 });
    const ends = out.events.filter((e) => e.type === 'speech_end');
    expect(ends.map(({ start_ms, end_ms }) => ({ start_ms, end_ms }))).toEqual(
      http.body.segments.map(({ start_ms, end_ms }: any) => ({ start_ms, end_ms })),
    );
    expect(out.events.filter((e) => e.type === 'speech_start')).toHaveLength(1);
  });

  it.each([8000, 22050, 44100])(
    "the stream resampler is flushed at `end`: at %i Hz a stream gives the file route's processed_ms and last boundary",
    async (rate) => {
      // The sentence cut inside its speech (2.5 s), so the last segment runs to the end of the audio;
      // converted to the rate by wavefile's own resampler, not the server's.
      const src = new WaveFile(fixture('espeak_sentence_16k.wav'));
      const cut = new WaveFile();
      cut.fromScratch(1, 16000, '16', (src.getSamples(false, Int16Array) as unknown as Int16Array).slice(0, 40_000));
      cut.toSampleRate(rate);
      const wav = Buffer.from(cut.toBuffer());
      const file = await runWav('silero-vad', wav);
      const out = await streamWav('silero-vad', wav, { frameMs: 20 });
      expect(out.events.at(-1)).toMatchObject({ type: 'done', processed_ms: 2500 });
      expect(file.body.timing.audio_duration_ms).toBe(2500);
      const ends = out.events.filter((e) => e.type === 'speech_end');
      expect(ends.at(-1).end_ms).toBe(2500);
      expect(ends.at(-1).end_ms).toBe(file.body.segments.at(-1).end_ms);
    },
  );

  it('delivers events while the client is still sending', async () => {
    const out = await streamWav('silero-vad', fixture('espeak_sentence_16k.wav'), { frameMs: 100, paceMs: 25 });
    expect(out.events.find((e) => e.type === 'speech_start')).toBeDefined();
    expect(out.framesSentAtFirstEvent).not.toBeNull();
    expect(out.framesSentAtFirstEvent!).toBeLessThan(out.frames);
  });

  it('runs two streams concurrently on a model with slots: 2 (both slots busy at once)', async () => {
    const silero = defaultCatalog().find((m) => m.id === 'silero-vad')!;
    // Batching off: with it, both streams' windows would share one batched run on one slot.
    const load = await postJson('/v1/models/load', {
      id: 'vad-two-slots',
      task: 'vad',
      path: silero.path,
      slots: 2,
      max_batch_size: 1,
    });
    expect(load).toEqual({ status: 200, body: { id: 'vad-two-slots', loaded: true, reconfigured: false } });
    // 20 s of speech-like tone per stream, sent at once: each stream keeps a long job in flight.
    const long = toneWav({ rate: 16000, channels: 1, bitDepth: '16', frames: 16000 * 20 });
    let maxActive = 0;
    let polling = true;
    const poll = (async () => {
      while (polling) {
        const s = await (await fetch(`${server.url}/v1/models/vad-two-slots`)).json();
        maxActive = Math.max(maxActive, s.active_slots);
        await new Promise((r) => setTimeout(r, 2));
      }
    })();
    const outs = await Promise.all([
      streamWav('vad-two-slots', long, { frameMs: 1000 }),
      streamWav('vad-two-slots', long, { frameMs: 1000 }),
    ]);
    polling = false;
    await poll;
    expect(outs.map((o) => o.closeCode)).toEqual([1000, 1000]);
    expect(maxActive).toBe(2);
  });
});

describe('bad input: a clear error, and the server keeps serving', () => {
  const stillWorks = async (): Promise<void> => {
    const r = await runWav('silero-vad', fixture('Front_Left.wav'));
    expect(r.status).toBe(200);
    expect(r.body.segments.length).toBeGreaterThan(0);
    expect(server.supervisor.getOrRegister('silero-vad')!.status().active_leases).toBe(0);
  };

  it('unknown model -> 404 not_found', async () => {
    const r = await runWav('no-such-model', fixture('Front_Left.wav'));
    expect(r.status).toBe(404);
    expect(r.body.error).toMatchObject({
      type: 'not_found',
      code: 'model_not_found',
      message: expect.stringContaining('no-such-model'),
    });
    await stillWorks();
  });

  it.each([
    ['missing audio', Buffer.alloc(0), /empty body/],
    ['malformed WAV', Buffer.from('RIFF....WAVEjunkjunkjunkjunk'), /not a readable WAV/],
    ['zero-length audio', toneWav({ rate: 16000, channels: 1, bitDepth: '16', frames: 0 }), /no samples/],
  ])('%s -> 400 naming the problem', async (_n, wav, message) => {
    const r = await runWav('silero-vad', wav);
    expect(r.status).toBe(400);
    expect(r.body.error).toMatchObject({ type: 'invalid_request_error', code: 'invalid_audio' });
    expect(r.body.error.message).toMatch(message);
    await stillWorks();
  });

  it.each(['espeak_sentence_8k_mulaw.wav', 'espeak_sentence_8k_alaw.wav'])(
    'telephone audio (%s, 8 kHz G.711 made by sox) gives the speech of its source',
    async (file) => {
      const r = await runWav('silero-vad', fixture(file));
      expect(r.status).toBe(200);
      // Another sample rate goes through the resampler: boundaries within 300 ms (spec/fixtures/README.md).
      expectSegments(r.body.segments, reference('espeak_sentence_16k.wav').segments_v6, 300);
    },
  );

  it('unsupported encoding, sample rate or channels -> 400', async () => {
    const adpcm = toneWav({ rate: 8000, channels: 1, bitDepth: '16', frames: 800 });
    adpcm.writeUInt16LE(2, 20); // MS ADPCM
    expect((await runWav('silero-vad', adpcm)).body.error).toMatchObject({
      code: 'unsupported_audio',
      message: expect.stringMatching(/format code 2/),
    });
    const rate = toneWav({ rate: 16000, channels: 1, bitDepth: '16', frames: 800 });
    rate.writeUInt32LE(1000, 24);
    expect((await runWav('silero-vad', rate)).body.error).toMatchObject({
      code: 'invalid_field',
      message: expect.stringMatching(/^sample_rate:/),
    });
    const chans = toneWav({ rate: 16000, channels: 1, bitDepth: '16', frames: 800 });
    chans.writeUInt16LE(0, 22);
    expect((await runWav('silero-vad', chans)).status).toBe(400);
    await stillWorks();
  });

  it('invalid JSON and missing fields -> 400 naming them', async () => {
    expect((await postJson('/v1/tasks/run', '{"model": ')).body.error.code).toBe('invalid_json');
    expect((await postJson('/v1/tasks/run', { audio: 'AAAA' })).body.error).toMatchObject({
      code: 'invalid_field',
      message: expect.stringMatching(/^model:/),
    });
    expect((await postJson('/v1/tasks/run', { model: 'silero-vad' })).body.error).toMatchObject({
      code: 'invalid_field',
      message: expect.stringMatching(/^audio:/),
    });
    expect((await postJson('/v1/tasks/run', { model: 'silero-vad', audio: '%%%' })).body.error).toMatchObject({
      code: 'invalid_field',
      message: expect.stringMatching(/base64/),
    });
    const opt = await postJson('/v1/tasks/run', {
      model: 'silero-vad',
      audio: fixture('Front_Left.wav').toString('base64'),
      options: { threshold: 3 },
    });
    expect(opt.status).toBe(400);
    expect(opt.body.error).toMatchObject({
      code: 'invalid_fields',
      message: expect.stringMatching(/^options\.threshold:/),
    });
    expect((await runWav('silero-vad', fixture('Front_Left.wav'), '&busy_timeout_ms=-5')).body.error).toMatchObject({
      code: 'invalid_field',
      message: expect.stringMatching(/^busy_timeout_ms:/),
    });
    await stillWorks();
  });

  it('a body over limits.max_body_bytes -> 413', async () => {
    const big = toneWav({ rate: 16000, channels: 1, bitDepth: '16', frames: MAX_BODY / 2 + 1000 });
    const r = await runWav('silero-vad', big);
    expect(r.status).toBe(413);
    expect(r.body.error).toMatchObject({
      type: 'payload_too_large',
      code: 'body_too_large',
      message: expect.stringContaining('max_body_bytes'),
    });
    await stillWorks();
  });

  it.each([
    ['model=no-such-model', /no-such-model/, 'model_not_found'],
    ['', /model: required/, 'invalid_field'],
    ['model=silero-vad&encoding=mp3', /^encoding:/, 'invalid_field'],
    ['model=silero-vad&sample_rate=0', /^sample_rate:/, 'invalid_field'],
    ['model=silero-vad&sample_rate=abc', /^sample_rate:/, 'invalid_field'],
    ['model=silero-vad&channels=99', /^channels:/, 'invalid_field'],
  ])(
    'a WebSocket with bad parameters (%s) -> error event and close 1008 with a reason',
    async (query, message, code) => {
      const out = await streamWav('x', fixture('Front_Left.wav'), { query });
      expect(out.closeCode).toBe(1008);
      expect(out.closeReason).toMatch(message);
      expect(out.events).toEqual([
        { type: 'error', error: { type: expect.any(String), code, message: expect.stringMatching(message) } },
      ]);
      await stillWorks();
    },
  );

  it('a malformed control frame -> error event, and the stream goes on', async () => {
    const out = await streamWav('alexa', fixture('espeak_alexa_16k.wav'), {
      before: (ws) => ws.send('{"type": "end"'),
    });
    expect(out.events[1]).toMatchObject({
      type: 'error',
      error: {
        type: 'invalid_request_error',
        code: 'invalid_control_message',
        message: expect.stringMatching(/not valid JSON/),
      },
    });
    expect(out.events.some((e) => e.type === 'detection')).toBe(true);
    expect(out.events.at(-1).type).toBe('done');
    expect(out.closeCode).toBe(1000);
  });

  it('a frame over ws_max_frame_bytes -> close 1009', async () => {
    const out = await new Promise<number>((resolve) => {
      const ws = new WebSocket(`${server.url.replace('http', 'ws')}/v1/stream?model=silero-vad`);
      ws.on('error', () => {});
      ws.on('open', () => ws.send(Buffer.alloc(2 * 1024 * 1024)));
      ws.on('close', (code) => resolve(code));
    });
    expect(out).toBe(1009);
    await stillWorks();
  });

  it('a model file that is not ONNX: load fails with last_error, can be retried, the server stays up', async () => {
    const path = join(tmpdir(), `voxserve-not-onnx-${process.pid}.onnx`);
    writeFileSync(path, 'this is not an onnx model');
    const r = await postJson('/v1/models/load', { id: 'broken', task: 'vad', path });
    expect(r.status).toBe(500);
    expect(r.body.error.code).toBe('load_failed');
    const status = await (await fetch(`${server.url}/v1/models/broken`)).json();
    expect(status).toMatchObject({ state: 'unloaded', loaded: false });
    expect(status.last_error).toBeTruthy();
    // Retry with a real file: the same entry loads.
    const silero = defaultCatalog().find((m) => m.id === 'silero-vad')!;
    const retry = await postJson('/v1/models/load', { id: 'broken', path: silero.path });
    expect(retry).toEqual({ status: 200, body: { id: 'broken', loaded: true, reconfigured: true } });
    await stillWorks();
  });

  it('invalid load bodies -> 400 naming the field', async () => {
    const a = defaultCatalog().find((m) => m.id === 'silero-vad')!.path; // a model file that exists: only the named field is wrong
    for (const [body, field] of [
      [{ id: 'x1', task: 'vad', path: a, slots: 0 }, 'slots'],
      [{ id: 'x1', task: 'vad', path: a, slots: 17 }, 'slots'],
      [{ id: 'x1', task: 'vad', path: a, slots: 1.5 }, 'slots'],
      [{ id: 'x1', task: 'vad', path: a, slots: '2' }, 'slots'],
      [{ id: 'x1', task: 'asr', path: a }, 'task'],
      [{ id: 'x1', task: 'vad', path: a, busy_timeout_ms: -1 }, 'busy_timeout_ms'],
    ] as const) {
      const r = await postJson('/v1/models/load', body);
      expect(r.status).toBe(400);
      expect(r.body.error).toMatchObject({
        code: 'invalid_fields',
        message: expect.stringMatching(new RegExp(`^${field}:`)),
      });
    }
    expect((await fetch(`${server.url}/v1/models/x1`)).status).toBe(404);
  });

  it('unload frees the model; the next request loads it again', async () => {
    expect(await postJson('/v1/models/unload', { id: 'alexa' })).toEqual({
      status: 200,
      body: { id: 'alexa', loaded: false },
    });
    expect(await (await fetch(`${server.url}/v1/models/alexa`)).json()).toMatchObject({
      state: 'unloaded',
      resident_bytes: 0,
    });
    const r = await runWav('alexa', fixture('espeak_alexa_16k.wav'));
    expect(r.body.detections).toHaveLength(1);
  });
});

describe('management routes', () => {
  it('answer 403 when management is disabled', async () => {
    const s = await startTestServer();
    try {
      const res = await fetch(`${s.url}/v1/models/load`, {
        method: 'POST',
        body: '{}',
        headers: { 'content-type': 'application/json' },
      });
      expect(res.status).toBe(403);
      expect((await res.json()).error.type).toBe('forbidden');
    } finally {
      await s.close();
    }
  });
});
