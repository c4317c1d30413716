import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import WebSocket from 'ws';
import { ServerConfig } from '../../runtime/config.js';
import { audioFormat } from '../../runtime/audio/decode.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { expectSegments, fixture, handshake, reference } from '../helpers.js';

/** Server input (issue 13): compressed audio, options as query parameters, unknown parameters, Silero v6/v5. */

let server: VoxServer;

beforeAll(async () => {
  server = await startServer(ServerConfig.parse({ log_level: 'silent', port: 0 }));
});
afterAll(async () => {
  await server?.close();
});

async function run(query: string, body: Buffer, type: string): Promise<{ status: number; body: any }> {
  const res = await fetch(`${server.url}/v1/tasks/run?${query}`, {
    method: 'POST',
    headers: { 'content-type': type },
    body: new Uint8Array(body),
  });
  return { status: res.status, body: await res.json() };
}

async function postJson(path: string, body: unknown): Promise<{ status: number; text: string }> {
  const res = await fetch(`${server.url}${path}`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify(body),
  });
  return { status: res.status, text: await res.text() };
}

describe('compressed input on /v1/tasks/run', () => {
  it.each([
    ['silero_test.mp3', 'audio/mpeg'],
    ['silero_test.opus', 'audio/ogg'],
  ])("the Silero project's %s gives REFERENCE.jsonl's segments within 300 ms, v6 and v5", async (file, type) => {
    const ref = reference(file);
    const bytes = fixture(file);
    const v6 = await run('model=silero-vad', bytes, type);
    expect(v6.status).toBe(200);
    expect(v6.body.timing.audio_duration_ms).toBeGreaterThan(ref.seconds * 1000 - 100);
    expectSegments(v6.body.segments, ref.segments_v6, 300);
    const v5 = await run('model=silero-vad-v5', bytes, 'application/octet-stream'); // by magic bytes alone
    expect(v5.status).toBe(200);
    expectSegments(v5.body.segments, ref.segments, 300);
  });

  it.each([
    ['espeak_alexa_16k.flac', 'espeak_alexa_16k.wav', 'audio/flac'],
    ['Front_Center.ogg', 'Front_Center.wav', 'audio/ogg'],
    ['espeak_sentence_16k.webm', 'espeak_sentence_16k.wav', 'audio/webm'],
  ])('%s (made from %s) gives the WAV reference segments within 100 ms', async (file, wav, type) => {
    const r = await run('model=silero-vad', fixture(file), type);
    expect(r.status).toBe(200);
    expectSegments(r.body.segments, reference(wav).segments_v6, 100);
  });

  const cut = (name: string, fraction: number): Buffer => {
    const b = fixture(name);
    return b.subarray(0, Math.floor(b.length * fraction));
  };
  const corrupt = (name: string): Buffer => {
    const b = Buffer.from(fixture(name));
    for (let i = Math.floor(b.length / 3); i < Math.floor(b.length / 3) + 400; i++) b[i] ^= 0x5a;
    return b;
  };
  it.each([
    [
      'a WAV cut to 50 bytes (inside its data chunk)',
      fixture('silero_test.wav').subarray(0, 50),
      'audio/wav',
      /truncated WAV file \(its 'data' chunk declares 1920000 bytes, 6 present\)/,
    ],
    [
      'a WAV cut to 30 bytes (inside its fmt chunk)',
      fixture('silero_test.wav').subarray(0, 30),
      'audio/wav',
      /truncated WAV file \(its 'fmt' chunk declares 16 bytes, 10 present\)/,
    ],
    ['a truncated FLAC', cut('espeak_alexa_16k.flac', 0.5), 'audio/flac', /truncated FLAC/],
    ['a truncated Ogg Vorbis', cut('Front_Center.ogg', 0.7), 'audio/ogg', /truncated Ogg Vorbis/],
    ['a truncated Ogg Opus', cut('silero_test.opus', 0.7), 'audio/ogg', /truncated Ogg Opus/],
    ['a truncated WebM', cut('espeak_sentence_16k.webm', 0.7), 'audio/webm', /truncated WebM/],
    ['an MP3 cut inside its ID3 tag', cut('silero_test.mp3', 0.5), 'audio/mpeg', /not a readable MP3 file/],
    ['a corrupt Ogg Vorbis', corrupt('Front_Center.ogg'), 'audio/ogg', /Ogg Vorbis/],
    ['a corrupt FLAC', corrupt('espeak_alexa_16k.flac'), 'audio/flac', /FLAC/],
    [
      // The decoder reports a negative sample count for a chunk of these (it answered 500 'Invalid typed array length').
      '50 Ogg Vorbis files joined end to end',
      Buffer.concat(new Array(50).fill(fixture('Front_Center.ogg'))),
      'audio/ogg',
      /not a readable Ogg Vorbis file \(its decoder reported -\d+ samples for a chunk\)/,
    ],
    ['garbage declared as MP3', Buffer.alloc(4000, 7), 'audio/mpeg', /not a readable MP3 file/],
    ['garbage declared as Ogg', Buffer.alloc(4000, 7), 'audio/ogg', /not a readable Ogg file/],
  ])('%s -> 400 naming the format, and the server keeps serving', async (_what, body, type, message) => {
    const r = await run('model=silero-vad', body, type);
    expect(r.status).toBe(400);
    expect(r.body.error).toMatchObject({
      type: 'invalid_request_error',
      code: 'invalid_audio',
      message: expect.stringMatching(message),
    });
    expect((await run('model=silero-vad', fixture('espeak_alexa_16k.flac'), 'audio/flac')).status).toBe(200);
  });

  it('an unsupported format -> 400 that names it and lists what is accepted', async () => {
    const m4a = Buffer.concat([Buffer.from([0, 0, 0, 0x20]), Buffer.from('ftypM4A '), Buffer.alloc(100)]);
    const r = await run('model=silero-vad', m4a, 'audio/mp4');
    expect(r.status).toBe(400);
    expect(r.body.error).toMatchObject({
      code: 'unsupported_audio',
      message: expect.stringMatching(
        /MP4\/M4A \(AAC\) is not supported; accepted: WAV .*MP3.*Ogg Vorbis.*Ogg Opus.*FLAC.*WebM\/Opus/,
      ),
    });
    const aac = await run('model=silero-vad', Buffer.from('not audio at all'), 'audio/aac');
    expect(aac.body.error).toMatchObject({
      code: 'unsupported_audio',
      message: expect.stringMatching(/^audio: audio\/aac is not supported; accepted: /),
    });
  });

  it('base64 in JSON with a data: prefix (run and batch): the prefix names the type', async () => {
    const flac = `data:audio/flac;base64,${fixture('espeak_alexa_16k.flac').toString('base64')}`;
    const one = await postJson('/v1/tasks/run', { model: 'silero-vad', audio: flac });
    expect(one.status).toBe(200);
    expectSegments(JSON.parse(one.text).segments, reference('espeak_alexa_16k.wav').segments_v6, 100);
    const wav = `data:audio/wav;codecs=1;base64,${fixture('Front_Center.wav').toString('base64')}`;
    const batch = await postJson('/v1/tasks/batch', {
      model: 'silero-vad',
      files: [flac, wav, 'data:text/plain,hello'],
    });
    expect(batch.status).toBe(400);
    expect(JSON.parse(batch.text).error.message).toMatch(/^files\.2: a data: URL must be base64/);
    const ok = await postJson('/v1/tasks/batch', { model: 'silero-vad', files: [flac, wav] });
    const results = ok.text
      .split('\n\n')
      .filter((e) => e.startsWith('event: result'))
      .map((e) => JSON.parse(e.split('data: ')[1]));
    expect(results).toHaveLength(2);
    for (const r of results)
      expectSegments(
        r.segments,
        reference(r.index === 0 ? 'espeak_alexa_16k.wav' : 'Front_Center.wav').segments_v6,
        100,
      );
  });

  it('the decoded-duration limit is checked while decoding', async () => {
    // audioFormat is the main thread's part; the limit itself is the worker's (decodeAudio's maxSeconds).
    const { decodeAudio } = await import('../../runtime/audio/decode.js');
    await expect(decodeAudio(fixture('espeak_sentence_16k.webm'), 'audio/webm', 2)).rejects.toThrow(
      /longer than the limit of 2 s/,
    );
    await expect(decodeAudio(fixture('Front_Center.ogg'), 'audio/ogg', 1)).rejects.toThrow(
      /longer than the limit of 1 s/,
    );
    expect((await decodeAudio(fixture('Front_Center.ogg'), 'audio/ogg', 2)).length).toBeGreaterThan(22_000);
  });
});

describe('format choice', () => {
  it('magic bytes first, then the content type', () => {
    expect(audioFormat(fixture('Front_Center.ogg'), 'application/octet-stream')).toBe('ogg-vorbis');
    expect(audioFormat(fixture('silero_test.opus'), 'audio/wav')).toBe('ogg-opus');
    expect(audioFormat(fixture('espeak_alexa_16k.flac'))).toBe('flac');
    expect(audioFormat(fixture('espeak_sentence_16k.webm'))).toBe('webm-opus');
    expect(audioFormat(fixture('silero_test.mp3'))).toBe('mp3');
    expect(audioFormat(fixture('Front_Left.wav'), 'audio/mpeg')).toBe('wav');
    expect(audioFormat(Buffer.from('xxxxxxxx'), 'audio/mpeg')).toBe('mp3');
    expect(() => audioFormat(Buffer.from('xxxxxxxx'))).toThrow(/unrecognised format .*accepted: WAV/);
  });
});

describe('task options as query parameters', () => {
  const sentence = fixture('espeak_sentence_16k.wav');

  it('a WAV body with ?threshold= is validated and applied like a JSON body`s options', async () => {
    const plain = await run('model=silero-vad', sentence, 'audio/wav');
    expect(plain.body.segments).toHaveLength(1);
    const strictJson = await postJson('/v1/tasks/run', {
      model: 'silero-vad',
      audio: sentence.toString('base64'),
      options: { threshold: 0.99, min_speech_duration_ms: 5000 },
    });
    expect(JSON.parse(strictJson.text).segments).toEqual([]);
    const strict = await run('model=silero-vad&threshold=0.99&min_speech_duration_ms=5000', sentence, 'audio/wav');
    expect(strict.status).toBe(200);
    expect(strict.body.segments).toEqual([]);
    const bad = await run('model=silero-vad&threshold=2', sentence, 'audio/wav');
    expect(bad.status).toBe(400);
    expect(bad.body.error).toMatchObject({
      code: 'invalid_fields',
      message: expect.stringMatching(/^options\.threshold: /),
    });
    const notNumber = await run('model=silero-vad&threshold=high', sentence, 'audio/wav');
    expect(notNumber.body.error.message).toMatch(/^options\.threshold: .*number/);
    const otherTask = await run('model=alexa&min_speech_duration_ms=100', fixture('espeak_alexa_16k.wav'), 'audio/wav');
    expect(otherTask.status).toBe(400);
    expect(otherTask.body.error.message).toMatch(/options.*min_speech_duration_ms/);
  });

  it('an unknown query parameter -> 400 naming it (raw body, JSON body, batch)', async () => {
    const typo = await run('model=silero-vad&samplerate=8000', sentence, 'audio/wav');
    expect(typo.status).toBe(400);
    expect(typo.body.error).toMatchObject({
      code: 'unknown_field',
      message: expect.stringMatching(
        /^samplerate: unknown query parameter; expected model, busy_timeout_ms, sample_rate, denoise, threshold/,
      ),
    });
    const twice = await run('model=silero-vad&threshold=0.3&threshold=0.9', sentence, 'audio/wav');
    expect(twice.body.error).toMatchObject({
      code: 'invalid_field',
      message: expect.stringMatching(/^threshold: query parameter given more than once/),
    });
    const json = await fetch(`${server.url}/v1/tasks/run?threshold=0.9`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ model: 'silero-vad', audio: sentence.toString('base64') }),
    });
    expect(json.status).toBe(400);
    expect((await json.json()).error).toMatchObject({
      code: 'unknown_field',
      message: expect.stringMatching(/^threshold: unknown query parameter; with a JSON body/),
    });
    const batch = await fetch(`${server.url}/v1/tasks/batch?model=silero-vad`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ model: 'silero-vad', files: [sentence.toString('base64')] }),
    });
    expect(batch.status).toBe(400);
  });

  it('the WebSocket handshake: an unknown parameter -> 400 naming it; options apply to the stream', async () => {
    const typo = await handshake(`${server.url.replace('http', 'ws')}/v1/stream?model=silero-vad&samplerate=8000`);
    expect(typo.status).toBe(400);
    expect(JSON.parse(typo.body).error.code).toBe('unknown_field');
    expect(JSON.parse(typo.body).error.message).toMatch(
      /^samplerate: unknown query parameter; expected model, sample_rate, encoding, channels, busy_timeout_ms, probabilities, probability_interval_ms, offset_ms, progress, checkpoints, resume_from, denoise, threshold/,
    );
    expect(
      (
        await handshake(
          `${server.url.replace('http', 'ws')}/v1/stream?model=silero-vad&sample_rate=16000&threshold=0.7`,
        )
      ).status,
    ).toBe(101);
    const events = await streamEvents('model=silero-vad&threshold=0.99&min_speech_duration_ms=5000', sentence);
    expect(events.map((e) => e.type)).toEqual(['ready', 'done']);
    const plain = await streamEvents('model=silero-vad', sentence);
    expect(plain.map((e) => e.type)).toEqual(['ready', 'speech_start', 'speech_end', 'done']);
  });

  it.each([
    ['sample_rate=-1', /^sample_rate: must be an integer from 8000 to 192000, got '-1'$/],
    ['sample_rate=200000', /^sample_rate: must be an integer from 8000 to 192000, got '200000'$/],
    ['channels=0', /^channels: must be an integer from 1 to 32, got '0'$/],
    ['sample_rate=', /^sample_rate: must be an integer from 8000 to 192000, got ''$/],
    ['busy_timeout_ms=-5', /^busy_timeout_ms: must be an integer from 0 to 2147483647, got '-5'$/],
  ])('a stream with %s -> an error event naming the field and its accepted range', async (query, message) => {
    const events = await streamEvents(`model=silero-vad&${query}`, sentence);
    expect(events).toEqual([
      {
        type: 'error',
        error: { type: 'invalid_request_error', code: 'invalid_field', message: expect.stringMatching(message) },
      },
    ]);
  });
});

/** Streams a 16 kHz mono s16 WAV's samples at once and collects the events. */
function streamEvents(query: string, wav: Buffer): Promise<any[]> {
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(`${server.url.replace('http', 'ws')}/v1/stream?${query}`);
    const events: any[] = [];
    ws.on('error', reject);
    ws.on('message', (data: Buffer) => {
      const e = JSON.parse(data.toString());
      events.push(e);
      if (e.type === 'ready') {
        ws.send(wav.subarray(44));
        ws.send(JSON.stringify({ type: 'end' }));
      }
    });
    ws.on('close', () => resolve(events));
  });
}

describe('Silero VAD v6 as silero-vad, v5 as silero-vad-v5', () => {
  it.each([
    ['silero-vad', 'segments_v6'],
    ['silero-vad-v5', 'segments'],
  ] as const)("%s matches REFERENCE.jsonl's %s on silero_test.wav to one window (32 ms)", async (model, key) => {
    const r = await run(`model=${model}`, fixture('silero_test.wav'), 'audio/wav');
    expect(r.status).toBe(200);
    expectSegments(r.body.segments, reference('silero_test.wav')[key], 32);
  });

  it('/v1/models lists both ids', async () => {
    const { models } = await (await fetch(`${server.url}/v1/models`)).json();
    expect(models.map((m: { id: string }) => m.id)).toEqual(expect.arrayContaining(['silero-vad', 'silero-vad-v5']));
  });
});
