/**
 * Issue 43 (a): the client sends files. `stream.sendFile(path | bytes)` sends a WAV file whole; the
 * server reads its header and takes the stream's format from it. The README's client example,
 * taken from README.md as it stands, runs on a 44.1 kHz stereo WAV and an 8 kHz mu-law WAV and
 * prints the speech segments `POST /v1/tasks/run` finds in the same file; a declared format the
 * header contradicts fails the stream, saying so. A compressed file (Ogg, FLAC, WebM, MP3 with
 * an ID3 tag) goes whole, and the server decodes it at `end`: the file route's segments again.
 */
import { execFile } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { VoxClient, VoxClientError, type StreamEvent } from '../../client/node.js';
import { decodeWav, resample } from '../../runtime/audio/audio.js';
import type { VoxServer } from '../../transport/server.js';
import { fixture, fixturePath, startTestServer, WaveFile } from '../helpers.js';

const exec = promisify(execFile);
const root = fileURLToPath(new URL('../../', import.meta.url));
let server: VoxServer;
let dir: string;

beforeAll(async () => {
  server = await startTestServer();
  dir = mkdtempSync(join(tmpdir(), 'vox-sendfile-'));
});
afterAll(async () => {
  await server?.close();
  rmSync(dir, { recursive: true, force: true });
});

/** The sentence fixture at 44.1 kHz, two channels (the left at full level, the right at half), 16-bit. */
async function stereo44k(): Promise<Buffer> {
  const { samples } = decodeWav(fixture('espeak_sentence_16k.wav'));
  const up = await resample(samples, 16000, 44100);
  const toInt = (x: number): number => Math.max(-32768, Math.min(32767, Math.round(x * 32767)));
  const w = new WaveFile();
  w.fromScratch(2, 44100, '16', [Array.from(up, toInt), Array.from(up, (x) => toInt(x / 2))]);
  return Buffer.from(w.toBuffer());
}

/** The file route's segments of a file, as `[start_ms, end_ms]`. */
async function fileSegments(bytes: Buffer): Promise<number[][]> {
  return (await fileRoute(bytes, 'audio/wav')).segments;
}

/** `POST /v1/tasks/run` of a file: its segments as `[start_ms, end_ms]`, and its audio's duration, ms. */
async function fileRoute(bytes: Buffer, type: string): Promise<{ segments: number[][]; durationMs: number }> {
  const res = await fetch(`${server.url}/v1/tasks/run?model=silero-vad`, {
    method: 'POST',
    headers: { 'content-type': type },
    body: new Uint8Array(bytes),
  });
  expect(res.status).toBe(200);
  const body = (await res.json()) as {
    segments: { start_ms: number; end_ms: number }[];
    timing: { audio_duration_ms: number };
  };
  return { segments: body.segments.map((s) => [s.start_ms, s.end_ms]), durationMs: body.timing.audio_duration_ms };
}

/** README.md's client example (its first `js` block), run as the README says, on `file`. */
async function readmeExample(file: string): Promise<Record<string, unknown>[]> {
  const readme = readFileSync(join(root, 'README.md'), 'utf8');
  const code = /^```js\n([\s\S]*?)^```/m.exec(readme)![1];
  expect(code).toContain('new VoxClient()');
  const script = join(root, `.sendfile-example-${process.pid}.mjs`);
  writeFileSync(script, code.replace('new VoxClient()', `new VoxClient({ url: ${JSON.stringify(server.url)} })`));
  try {
    const { stdout } = await exec(process.execPath, [script, file], { cwd: root, timeout: 60_000 });
    return stdout
      .trim()
      .split('\n')
      .map((l) => JSON.parse(l));
  } finally {
    rmSync(script, { force: true });
  }
}

describe("the README's client example on a user's WAV (issue 43)", () => {
  it('44.1 kHz stereo 16-bit: the file route segments', async () => {
    const bytes = await stereo44k();
    const file = join(dir, 'sentence_44k_stereo.wav');
    writeFileSync(file, bytes);
    const events = await readmeExample(file);
    const ends = events.filter((e) => e.type === 'speech_end').map((e) => [e.start_ms, e.end_ms]);
    expect(ends.length).toBeGreaterThan(0);
    expect(ends).toEqual(await fileSegments(bytes));
    const done = events.at(-1)!;
    expect(done.type).toBe('done');
    // The audio's own length (5.8 s), not the 26 s its bytes would be as 16 kHz mono PCM.
    expect(Math.abs((done.processed_ms as number) - (decodeWav(bytes).samples.length / 44100) * 1000)).toBeLessThan(20);
  }, 90_000);

  it('8 kHz mu-law: the file route segments', async () => {
    const file = fixturePath('espeak_sentence_8k_mulaw.wav');
    const events = await readmeExample(file);
    const ends = events.filter((e) => e.type === 'speech_end').map((e) => [e.start_ms, e.end_ms]);
    expect(ends.length).toBeGreaterThan(0);
    expect(ends).toEqual(await fileSegments(fixture('espeak_sentence_8k_mulaw.wav')));
  }, 90_000);
});

describe('sendFile (issue 43)', () => {
  const vox = (): VoxClient => new VoxClient({ url: server.url });

  async function streamed(bytes: Uint8Array): Promise<number[][]> {
    const stream = await vox().stream({ model: 'silero-vad' });
    const sent = stream.sendFile(bytes).then(() => stream.end());
    const events: StreamEvent[] = [];
    for await (const e of stream) events.push(e);
    await sent;
    return events.flatMap((e) => (e.type === 'speech_end' ? [[e.start_ms, e.end_ms]] : []));
  }

  it('24-bit, 32-bit float and A-law WAVs, the header split across frames too: the file route segments', async () => {
    const src = new WaveFile(fixture('espeak_sentence_16k.wav'));
    for (const depth of ['24', '32f']) {
      const w = new WaveFile(fixture('espeak_sentence_16k.wav'));
      w.toBitDepth(depth);
      const bytes = Buffer.from(w.toBuffer());
      expect(await streamed(bytes), depth).toEqual(await fileSegments(bytes));
    }
    const alaw = fixture('espeak_sentence_8k_alaw.wav');
    expect(await streamed(alaw)).toEqual(await fileSegments(alaw));
    // The header in 3-byte frames, then the samples: the server waits for the whole header.
    const bytes = Buffer.from(src.toBuffer());
    const stream = await vox().stream({ model: 'silero-vad' });
    for (let i = 0; i < 60; i += 3) await stream.send(bytes.subarray(i, i + 3));
    await stream.send(bytes.subarray(60));
    const events: StreamEvent[] = [];
    const ended = stream.end();
    for await (const e of stream) events.push(e);
    await ended;
    expect(events.flatMap((e) => (e.type === 'speech_end' ? [[e.start_ms, e.end_ms]] : []))).toEqual(
      await fileSegments(bytes),
    );
  }, 90_000);

  it("an rnnoise stream given a WAV answers at the header's rate, as many samples as it was sent (a newcomer's finding: 16 kHz)", async () => {
    const bytes = fixture('Front_Center.wav'); // 48 kHz
    const { sampleRate, samples } = {
      sampleRate: bytes.readUInt32LE(24),
      samples: new WaveFile(bytes).getSamples(false, Int16Array).length,
    };
    expect(sampleRate).toBe(48_000);
    const stream = await vox().stream({ model: 'rnnoise' });
    const sent = stream.sendFile(bytes).then(() => stream.end());
    let back = 0;
    for await (const e of stream) if (e.type === 'audio') back += e.data.length / 2; // s16le
    await sent;
    expect(back).toBe(samples);
  }, 60_000);

  it('a declared format the WAV header contradicts fails the stream, saying so', async () => {
    const bytes = await stereo44k();
    const stream = await vox().stream({ model: 'silero-vad', sampleRate: 16000 });
    const sent = stream.sendFile(bytes).then(() => stream.end());
    const error = await (async () => {
      for await (const _ of stream);
    })().catch((e) => e);
    await sent.catch(() => {});
    expect(error).toBeInstanceOf(VoxClientError);
    expect(error.message).toBe(
      'sample_rate: the stream was opened with sample_rate=16000, but the WAV header it received says 44100 Hz, 2 channels, 16-bit PCM; ' +
        'open the stream without sample_rate, encoding and channels (the header sets them), or send the samples without the header',
    );
    expect(error.closeCode).toBe(1008);
  }, 30_000);

  it('compressed files (Ogg Vorbis, Ogg Opus, FLAC, WebM/Opus, MP3) go whole: the file route segments and duration', async () => {
    for (const name of [
      'Front_Center.ogg',
      'silero_test.opus',
      'espeak_alexa_16k.flac',
      'espeak_sentence_16k.webm',
      'silero_test.mp3',
    ]) {
      const bytes = fixture(name);
      const stream = await vox().stream({ model: 'silero-vad' });
      const sent = stream.sendFile(bytes).then(() => stream.end());
      const events: StreamEvent[] = [];
      for await (const e of stream) events.push(e);
      await sent;
      const reference = await fileRoute(bytes, 'application/octet-stream');
      // silero_test.opus has no speech (fixtures/README.md): its answer is no segments, and the duration.
      if (name !== 'silero_test.opus') expect(reference.segments.length, name).toBeGreaterThan(0);
      expect(
        events.flatMap((e) => (e.type === 'speech_end' ? [[e.start_ms, e.end_ms]] : [])),
        name,
      ).toEqual(reference.segments);
      const done = events.at(-1)!;
      expect(done.type, name).toBe('done');
      expect(
        Math.abs((done as { processed_ms: number }).processed_ms - reference.durationMs),
        name,
      ).toBeLessThanOrEqual(1);
    }
  }, 120_000);

  it('a compressed file the decoder cannot read, or one over limits.max_body_bytes, fails the stream saying so', async () => {
    const failure = async (url: string, bytes: Uint8Array): Promise<VoxClientError> => {
      const stream = await new VoxClient({ url }).stream({ model: 'silero-vad' });
      const sent = stream.sendFile(bytes).then(() => stream.end());
      const error = await (async () => {
        for await (const _ of stream);
      })().catch((e) => e);
      await sent.catch(() => {});
      return error;
    };
    const notOgg = await failure(server.url, Buffer.concat([Buffer.from('OggS'), Buffer.alloc(200)]));
    expect(notOgg).toBeInstanceOf(VoxClientError);
    expect(notOgg.message).toMatch(/^audio: Ogg with an unknown codec is not supported; accepted: WAV/);
    expect(notOgg.closeCode).toBe(1008);
    const small = await startTestServer({ limits: { max_body_bytes: 4096 } });
    try {
      const big = await failure(small.url, fixture('Front_Center.ogg'));
      expect(big.message).toMatch(/^body of \d+ bytes exceeds limits\.max_body_bytes \(4096\)$/);
      expect(big.closeCode).toBe(1009);
    } finally {
      await small.close();
    }
  }, 60_000);

  it('an MP3 without an ID3 tag, or a format no stream takes, is named, with what to do instead', async () => {
    const mp3 = fixture('silero_test.mp3');
    // ID3v2: a 10-byte header whose last 4 bytes give the tag's size, 7 bits each.
    const tag = 10 + ((mp3[6] << 21) | (mp3[7] << 14) | (mp3[8] << 7) | mp3[9]);
    const bare = mp3.subarray(tag);
    expect(bare[0]).toBe(0xff);
    const stream = await vox().stream({ model: 'silero-vad' });
    await expect(stream.sendFile(bare)).rejects.toThrow(
      'this looks like MP3 without an ID3 tag: a stream takes WAV, Ogg, FLAC, WebM, MP3 with an ID3 tag or raw PCM; send it with run() (POST /v1/tasks/run decodes it), or convert it to WAV',
    );
    const m4a = Buffer.concat([Buffer.from([0, 0, 0, 0x20]), Buffer.from('ftypM4A '), Buffer.alloc(24)]);
    await expect(stream.sendFile(m4a)).rejects.toThrow('this looks like MP4/M4A: a stream takes WAV, Ogg');
    stream.close();
  });
});
