/**
 * The Wyoming endpoint on loopback, with a small client written from the Wyoming README
 * (https://github.com/rhasspy/wyoming: "Format", "Wake Word", "Event Flow"), not from voxserve's parser.
 */
import { mkdtempSync, writeFileSync } from 'node:fs';
import { connect, createServer, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it, onTestFinished } from 'vitest';
import { Resampler } from '../../runtime/audio/audio.js';
import { defaultCatalog } from '../../runtime/config.js';
import type { VoxServer } from '../../transport/server.js';
import { spawnServer } from '../../tools/spawn-server.js';
import { fixture, startTestServer, until, WaveFile } from '../helpers.js';

interface Event {
  type: string;
  data: Record<string, any>;
  payload: Buffer;
}

/** A Wyoming peer: header line, `data_length` bytes of JSON data, `payload_length` bytes of payload. */
class Client {
  readonly events: Event[] = [];
  readonly closed: Promise<void>;
  private buf = Buffer.alloc(0);
  private wake: (() => void) | null = null;

  private constructor(readonly socket: Socket) {
    socket.on('data', (d: Buffer) => {
      this.buf = Buffer.concat([this.buf, d]);
      for (;;) {
        const nl = this.buf.indexOf('\n');
        if (nl < 0) break;
        const header = JSON.parse(this.buf.subarray(0, nl).toString());
        const dl = header.data_length ?? 0;
        const pl = header.payload_length ?? 0;
        if (this.buf.length < nl + 1 + dl + pl) break;
        const data = {
          ...(header.data ?? {}),
          ...(dl ? JSON.parse(this.buf.subarray(nl + 1, nl + 1 + dl).toString()) : {}),
        };
        this.events.push({ type: header.type, data, payload: this.buf.subarray(nl + 1 + dl, nl + 1 + dl + pl) });
        this.buf = this.buf.subarray(nl + 1 + dl + pl);
      }
      this.wake?.();
    });
    socket.on('error', () => {});
    this.closed = new Promise((r) => socket.on('close', () => r()));
  }

  static open(port: number): Promise<Client> {
    return new Promise((resolve, reject) => {
      const s = connect(port, '127.0.0.1', () => resolve(new Client(s)));
      s.once('error', reject);
    });
  }

  /** Sends an event with its data in the data section (as wyoming's Python writer does). */
  send(type: string, data?: Record<string, unknown>, payload?: Buffer): void {
    const body = data ? Buffer.from(JSON.stringify(data)) : Buffer.alloc(0);
    const header = { type, data_length: body.length, payload_length: payload?.length ?? 0 };
    this.socket.write(Buffer.concat([Buffer.from(JSON.stringify(header) + '\n'), body, payload ?? Buffer.alloc(0)]));
  }

  /** Waits for the first event of `type` not yet taken. */
  async next(type: string, ms = 20_000): Promise<Event> {
    const end = Date.now() + ms;
    for (;;) {
      const e = this.events.find((x) => x.type === type);
      if (e) return e;
      if (Date.now() > end || this.socket.destroyed)
        throw new Error(`no ${type} event; got ${this.events.map((x) => x.type).join(', ')}`);
      await new Promise<void>((r) => {
        this.wake = r;
        setTimeout(r, 50);
      });
    }
  }

  /**
   * audio-start, the file's PCM in 100 ms audio-chunks, then audio-stop (unless `stop` is false).
   * `start`: the audio-start's data (default: the file's format, timestamp 0); `timestamp(i)`:
   * chunk i's timestamp (default: 100 i, the ms of audio before it). Returns the chunks' timestamps.
   */
  sendWav(
    file: string,
    stop = true,
    { start, timestamp = (i) => 100 * i }: { start?: Record<string, unknown>; timestamp?: (i: number) => number } = {},
  ): number[] {
    const w = new WaveFile(fixture(file));
    const { sampleRate: rate, numChannels: channels } = w.fmt as { sampleRate: number; numChannels: number };
    const pcm = Buffer.from((w.data as { samples: Uint8Array }).samples);
    const fmt = { rate, width: 2, channels };
    this.send('audio-start', start ?? { ...fmt, timestamp: 0 });
    const step = (rate / 10) * 2 * channels;
    const sent: number[] = [];
    for (let off = 0, i = 0; off < pcm.length; off += step, i++) {
      sent.push(timestamp(i));
      this.send('audio-chunk', { ...fmt, timestamp: timestamp(i) }, pcm.subarray(off, off + step));
    }
    if (stop) this.send('audio-stop', { timestamp: Math.round((pcm.length / 2 / channels / rate) * 1000) });
    return sent;
  }
}

let server: VoxServer;
let port: number;
beforeAll(async () => {
  server = await startTestServer({
    wyoming: { enabled: true, port: 0 },
    limits: { ws_max_frame_bytes: 64 * 1024, max_header_bytes: 4096 },
    models: [{ id: 'house', task: 'wakeword', heads: ['alexa', 'hey-jarvis', 'hey-rhasspy'] }],
  });
  port = server.wyoming!.port;
  await until(async () => (await fetch(`${server.url}/ready`)).status === 200, 10_000);
});
afterAll(async () => {
  await server?.close();
});

const leases = async (): Promise<number> => {
  const { models } = await (await fetch(`${server.url}/v1/models`)).json();
  return models.reduce((n: number, m: { active_leases: number }) => n + m.active_leases, 0);
};

describe('Wyoming', () => {
  it('describe -> info lists every wake word, named and phrased as wyoming-openwakeword names its own, with languages, attribution and licence', async () => {
    const c = await Client.open(port);
    c.send('describe');
    const info = await c.next('info');
    const models = info.data.wake[0].models;
    // wyoming-openwakeword 2.1.0 (handler.py _get_info): names are pyopen_wakeword's Model values
    // (`hey_jarvis`), phrases its _get_phrase of them (`Hey Jarvis`), version "v0.1".
    expect(models.map((m: { name: string }) => m.name)).toEqual([
      'alexa',
      'hey_jarvis',
      'hey_mycroft',
      'hey_rhasspy',
      'timer',
      'weather',
    ]);
    expect(models[1]).toMatchObject({
      name: 'hey_jarvis',
      phrase: 'Hey Jarvis',
      version: 'v0.1',
      languages: ['en'],
      installed: true,
      attribution: { url: 'https://github.com/dscripka/openWakeWord' },
    });
    expect(models[1].description).toContain('CC BY-NC-SA 4.0');
    c.socket.end();
  });

  it('detect naming a model that is neither a wake word nor VAD (rnnoise) is an error naming detect.names', async () => {
    const c = await Client.open(port);
    c.send('detect', { names: ['rnnoise'] });
    expect((await c.next('error')).data.text).toMatch(/detect\.names.*rnnoise.*denoise model/);
    c.socket.end();
  });

  it('detect + audio: "alexa" at 16 kHz then "hey jarvis" at 22.05 kHz on one connection, each detected with its name', async () => {
    const c = await Client.open(port);
    c.send('detect', { names: ['alexa', 'hey_jarvis'] });
    c.sendWav('espeak_alexa_16k.wav');
    const a = await c.next('detection');
    expect(a.data.name).toBe('alexa');
    // The espeak phrase ends at 1.6 s; openWakeWord fires within about half a second of the end.
    expect(a.data.timestamp).toBeGreaterThan(1000);
    expect(a.data.timestamp).toBeLessThan(2600);
    c.sendWav('espeak_hey_jarvis_22k.wav');
    await until(() => c.events.filter((e) => e.type === 'detection').length === 2, 20_000);
    // Each detection carries the name detect asked by (wyoming-openwakeword's Detector.id).
    expect(c.events.filter((e) => e.type === 'detection').map((e) => e.data.name)).toEqual(['alexa', 'hey_jarvis']);
    expect(c.events.some((e) => e.type === 'not-detected')).toBe(false);
    c.socket.end();
    await c.closed;
  });

  it('names omitted: every wake word; silence gets not-detected at audio-stop', async () => {
    const c = await Client.open(port);
    c.send('detect');
    c.sendWav('silence_3s_16k.wav');
    await c.next('not-detected');
    expect(c.events.filter((e) => e.type === 'detection')).toEqual([]);
    c.sendWav('espeak_hey_jarvis_22k.wav');
    // Not asked by name: the name describe lists.
    expect((await c.next('detection')).data.name).toBe('hey_jarvis');
    c.socket.end();
  });

  it('detect {names: ["house"]}: the configured group itself (no new model entry), its heads named as describe names them', async () => {
    const idsNow = async (): Promise<string[]> =>
      ((await (await fetch(`${server.url}/v1/models`)).json()).models as { id: string }[]).map((m) => m.id).sort();
    const before = await idsNow();
    const c = await Client.open(port);
    c.send('detect', { names: ['house'] });
    c.sendWav('espeak_hey_jarvis_22k.wav');
    expect((await c.next('detection')).data.name).toBe('hey_jarvis');
    c.socket.end();
    await c.closed;
    const house = await (await fetch(`${server.url}/v1/models/house`)).json();
    expect(house).toMatchObject({ loaded: true });
    expect(await idsNow()).toEqual(before);
  });

  it("a connection's steps count in the model's processing_lag_ms, as a WebSocket stream's do", async () => {
    const c = await Client.open(port);
    c.send('detect', { names: ['hey-mycroft'] });
    c.sendWav('silence_3s_16k.wav');
    await c.next('not-detected');
    c.socket.end();
    const status = await (await fetch(`${server.url}/v1/models/hey-mycroft`)).json();
    // 3 s of audio: 37 whole 80 ms steps (the last, partial one, padded at audio-stop, is not
    // counted, as on a WebSocket stream: its audio never fully arrived).
    expect(status.processing_lag_ms.windows).toBe(37);
    expect(status.processing_lag_ms.p99).toBeGreaterThanOrEqual(0);
  });

  it('voice-started / voice-stopped from Silero VAD when detect names it', async () => {
    const c = await Client.open(port);
    c.send('detect', { names: ['alexa', 'silero-vad'] });
    c.sendWav('espeak_alexa_16k.wav');
    const started = await c.next('voice-started');
    const stopped = await c.next('voice-stopped');
    // REFERENCE.jsonl: espeak_alexa_16k.wav speech 962-1662 ms (`segments_v6`: silero-vad is Silero v6, default
    // parameters).
    expect(Math.abs(started.data.timestamp - 962)).toBeLessThanOrEqual(40);
    expect(Math.abs(stopped.data.timestamp - 1662)).toBeLessThanOrEqual(40);
    expect((await c.next('detection')).data.name).toBe('alexa');
    c.socket.end();
  });

  it('20 satellites at once each get their own detection', async () => {
    const clients = await Promise.all(Array.from({ length: 20 }, () => Client.open(port)));
    clients.forEach((c, i) => {
      c.send('detect', { names: ['alexa', 'hey-jarvis'] });
      c.sendWav(i % 2 ? 'espeak_hey_jarvis_22k.wav' : 'espeak_alexa_16k.wav');
    });
    const names = await Promise.all(clients.map(async (c) => (await c.next('detection', 60_000)).data.name));
    expect(names).toEqual(clients.map((_, i) => (i % 2 ? 'hey-jarvis' : 'alexa')));
    for (const c of clients) c.socket.end();
    await Promise.all(clients.map((c) => c.closed));
    await until(async () => (await leases()) === 0);
  });

  it('item 1 (#25): detect {names: ["timer"]} (a multi-class head) answers detection {name: "timer"}, the name Home Assistant asked by', async () => {
    const c = await Client.open(port);
    // What Home Assistant's wyoming/wake_word.py sends: detect with the id it keeps (describe's
    // name), audio-start 16 kHz without a timestamp; it drops every detection whose name differs.
    c.send('detect', { names: ['timer'] });
    c.sendWav('espeak_timer_16k.wav', true, { start: { rate: 16000, width: 2, channels: 1 } });
    // "set a timer for five minutes": the timer head's class `5_minute_timer` fires.
    const d = await c.next('detection');
    expect(d.data.name).toBe('timer');
    c.socket.end();
    await c.closed;
    expect(new Set(c.events.filter((e) => e.type === 'detection').map((e) => e.data.name))).toEqual(new Set(['timer']));
  });

  it('item 1 (#25): the timer head among others (detect {names: ["alexa", "timer"]}, one group of two heads): still named "timer"', async () => {
    const c = await Client.open(port);
    c.send('detect', { names: ['alexa', 'timer'] });
    c.sendWav('espeak_timer_16k.wav');
    expect((await c.next('detection')).data.name).toBe('timer');
    c.socket.end();
  });

  it('item 2 (#25): audio-chunks whose rate differs from audio-start are converted by their own header (22.05 kHz chunks after a 16 kHz start are detected)', async () => {
    const c = await Client.open(port);
    c.send('detect', { names: ['hey_jarvis'] });
    // The start claims 16 kHz; every chunk says 22050 Hz, as its audio is.
    c.sendWav('espeak_hey_jarvis_22k.wav', true, { start: { rate: 16000, width: 2, channels: 1, timestamp: 0 } });
    expect((await c.next('detection')).data.name).toBe('hey_jarvis');
    expect(c.events.some((e) => e.type === 'not-detected')).toBe(false);
    c.socket.end();
  });

  it('item 2 (#25): a stream whose chunks change format midway (16 kHz mono, then 22.05 kHz, then 16 kHz stereo) is heard throughout', async () => {
    const c = await Client.open(port);
    c.send('detect', { names: ['alexa', 'hey_jarvis'] });
    c.send('audio-start', { rate: 16000, width: 2, channels: 1, timestamp: 0 });
    c.send('audio-chunk', { rate: 16000, width: 2, channels: 1, timestamp: 0 }, Buffer.alloc(16000));
    // hey jarvis at 22.05 kHz (the chunks' own format), no new audio-start.
    const jarvis = new WaveFile(fixture('espeak_hey_jarvis_22k.wav'));
    const pcm22 = Buffer.from((jarvis.data as { samples: Uint8Array }).samples);
    for (let off = 0; off < pcm22.length; off += 4410)
      c.send('audio-chunk', { rate: 22050, width: 2, channels: 1 }, pcm22.subarray(off, off + 4410));
    // alexa as 16 kHz stereo (each sample twice).
    const alexa = new WaveFile(fixture('espeak_alexa_16k.wav'));
    const mono = new Int16Array(
      Buffer.from((alexa.data as { samples: Uint8Array }).samples).buffer.slice(0) as ArrayBuffer,
    );
    const stereo = new Int16Array(mono.length * 2);
    mono.forEach((v, i) => stereo.set([v, v], 2 * i));
    const pcm2 = Buffer.from(stereo.buffer);
    for (let off = 0; off < pcm2.length; off += 6400)
      c.send('audio-chunk', { rate: 16000, width: 2, channels: 2 }, pcm2.subarray(off, off + 6400));
    c.send('audio-stop');
    await until(() => c.events.filter((e) => e.type === 'detection').length === 2, 20_000);
    expect(c.events.filter((e) => e.type === 'detection').map((e) => e.data.name)).toEqual(['hey_jarvis', 'alexa']);
    c.socket.end();
  });

  it('an audio-stop with no audio stream open: not-detected when the latest detect asks for a wake word, nothing for VAD alone, whatever the stream before asked', async () => {
    const c = await Client.open(port);
    const answers = (): string[] => c.events.map((e) => e.type).filter((t) => t === 'not-detected');
    // A stream of a wake word and VAD, then VAD alone asked: a stray audio-stop gets no answer.
    c.send('detect', { names: ['hey_jarvis', 'silero-vad'] });
    c.send('audio-start', { rate: 16000, width: 2, channels: 1 });
    c.send('audio-chunk', { rate: 16000, width: 2, channels: 1 }, Buffer.alloc(3200));
    c.send('audio-stop');
    await until(() => answers().length === 1, 20_000);
    c.send('detect', { names: ['silero-vad'] });
    c.send('audio-stop');
    // Then a wake word asked: the next stray audio-stop is answered.
    c.send('detect', { names: ['hey_jarvis'] });
    c.send('audio-stop');
    await until(() => answers().length === 2, 20_000);
    await new Promise((r) => setTimeout(r, 200));
    expect(answers()).toHaveLength(2);
    c.socket.end();
  });

  it('item 2 (#25): a client switching between 16 and 48 kHz on every tiny chunk makes the server create no converter per switch (one per connection at most), and is still heard', async () => {
    const c = await Client.open(port);
    c.send('detect', { names: ['alexa'] });
    c.send('audio-start', { rate: 16000, width: 2, channels: 1, timestamp: 0 });
    c.send('audio-chunk', { rate: 16000, width: 2, channels: 1 }, Buffer.alloc(320));
    await until(async () => (await leases()) === 1); // the stream has begun
    const created = Resampler.created;
    for (let i = 0; i < 500; i++)
      c.send('audio-chunk', { rate: i % 2 ? 16000 : 48000, width: 2, channels: 1 }, Buffer.alloc(96));
    c.sendWav('espeak_alexa_16k.wav');
    expect((await c.next('detection')).data.name).toBe('alexa');
    // 500 switches on one connection: at most the one converter its first 48 kHz chunk needed.
    expect(Resampler.created - created).toBeLessThanOrEqual(1);
    c.socket.end();
  });

  it("item 5 (#25): a detection echoes the timestamp of the client audio-chunk it came in (wyoming-openwakeword), not a position in voxserve's audio", async () => {
    const c = await Client.open(port);
    c.send('detect', { names: ['alexa'] });
    // As Home Assistant: no audio-start timestamp; chunk timestamps on the pipeline's clock (here
    // starting at 7 s, 100 ms apart with a few ms of jitter).
    const sent = c.sendWav('espeak_alexa_16k.wav', true, {
      start: { rate: 16000, width: 2, channels: 1 },
      timestamp: (i) => 7000 + 100 * i + (i % 3),
    });
    const d = await c.next('detection');
    expect(sent).toContain(d.data.timestamp);
    // The espeak phrase ends at 1.6 s of the file; openWakeWord fires within about a second of the end.
    expect(d.data.timestamp).toBeGreaterThanOrEqual(7000 + 1500);
    expect(d.data.timestamp).toBeLessThan(7000 + 2600);
    c.socket.end();
  });

  const malformed: [string, (s: Socket) => void, RegExp][] = [
    ['a header line that is not JSON', (s) => s.write('{"type": "describe"\n'), /not valid JSON/],
    [
      'a header line over the size limit',
      (s) => s.write(`{"type":"audio-chunk","pad":"${'x'.repeat(5000)}`),
      /header line over 4096 bytes/,
    ],
    [
      'payload_length over the frame limit',
      (s) => s.write(JSON.stringify({ type: 'audio-chunk', payload_length: 65 * 1024 }) + '\n'),
      /payload_length 66560 is over the limit/,
    ],
    [
      'data that is not an object (header)',
      (s) => s.write(JSON.stringify({ type: 'detect', data: [1, 2] }) + '\n'),
      /data must be a JSON object/,
    ],
    [
      'data that is not an object (data section)',
      (s) => s.write(JSON.stringify({ type: 'detect', data_length: 5 }) + '\n"abc"'),
      /data section must be a JSON object/,
    ],
    [
      'a negative data_length',
      (s) => s.write(JSON.stringify({ type: 'detect', data_length: -1 }) + '\n'),
      /non-negative integer/,
    ],
    [
      'an unknown wake word',
      (s) => s.write(JSON.stringify({ type: 'detect', data: { names: ['ok-nabu'] } }) + '\n'),
      /detect\.names: model 'ok-nabu' does not exist/,
    ],
    [
      '16-bit only',
      (s) => s.write(JSON.stringify({ type: 'audio-start', data: { rate: 16000, width: 4, channels: 1 } }) + '\n'),
      /width: only 2/,
    ],
    // Item 2 (#25): each chunk's own header is read, and a bad one named.
    [
      'item 2 (#25): an audio-chunk rate that is not a number',
      (s) =>
        s.write(
          JSON.stringify({ type: 'audio-chunk', data: { rate: 'fast', width: 2, channels: 1 }, payload_length: 4 }) +
            '\n\0\0\0\0',
        ),
      /audio-chunk\.rate: required integer, got "fast"/,
    ],
    [
      'item 2 (#25): an audio-chunk rate out of range',
      (s) =>
        s.write(
          JSON.stringify({ type: 'audio-chunk', data: { rate: 1000, width: 2, channels: 1 }, payload_length: 4 }) +
            '\n\0\0\0\0',
        ),
      /audio-chunk\.rate: 1000 Hz is out of range/,
    ],
    [
      'item 2 (#25): an audio-chunk width other than 2',
      (s) =>
        s.write(
          JSON.stringify({ type: 'audio-chunk', data: { rate: 16000, width: 3, channels: 1 }, payload_length: 6 }) +
            '\n\0\0\0\0\0\0',
        ),
      /audio-chunk\.width: only 2/,
    ],
    [
      'item 2 (#25): an audio-chunk with 0 channels',
      (s) =>
        s.write(
          JSON.stringify({ type: 'audio-chunk', data: { rate: 16000, width: 2, channels: 0 }, payload_length: 4 }) +
            '\n\0\0\0\0',
        ),
      /audio-chunk\.channels: 0 is out of range/,
    ],
    [
      'item 5 (#25): an audio-chunk timestamp that is a string',
      (s) =>
        s.write(
          JSON.stringify({
            type: 'audio-chunk',
            data: { rate: 16000, width: 2, channels: 1, timestamp: 'x' },
            payload_length: 4,
          }) + '\n\0\0\0\0',
        ),
      /audio-chunk\.timestamp: must be a number of ms from 0 to 9007199254740991, got "x"/,
    ],
    [
      'item 5 (#25): an audio-chunk timestamp that is an array',
      (s) =>
        s.write(
          JSON.stringify({
            type: 'audio-chunk',
            data: { rate: 16000, width: 2, channels: 1, timestamp: [1] },
            payload_length: 4,
          }) + '\n\0\0\0\0',
        ),
      /audio-chunk\.timestamp: must be a number of ms from 0 to 9007199254740991, got \[1\]/,
    ],
    [
      'item 5 (#25): an audio-chunk timestamp that is an object',
      (s) =>
        s.write(
          JSON.stringify({
            type: 'audio-chunk',
            data: { rate: 16000, width: 2, channels: 1, timestamp: {} },
            payload_length: 4,
          }) + '\n\0\0\0\0',
        ),
      /audio-chunk\.timestamp: must be a number of ms from 0 to 9007199254740991, got \{\}/,
    ],
    [
      'item 5 (#25): an audio-chunk timestamp that is a boolean',
      (s) =>
        s.write(
          JSON.stringify({
            type: 'audio-chunk',
            data: { rate: 16000, width: 2, channels: 1, timestamp: true },
            payload_length: 4,
          }) + '\n\0\0\0\0',
        ),
      /audio-chunk\.timestamp: must be a number of ms from 0 to 9007199254740991, got true/,
    ],
    [
      'item 5 (#25): an audio-chunk timestamp that is negative',
      (s) =>
        s.write(
          JSON.stringify({
            type: 'audio-chunk',
            data: { rate: 16000, width: 2, channels: 1, timestamp: -5000 },
            payload_length: 4,
          }) + '\n\0\0\0\0',
        ),
      /audio-chunk\.timestamp: must be a number of ms from 0 to 9007199254740991, got -5000/,
    ],
    [
      'item 5 (#25): an audio-chunk timestamp that is huge',
      (s) =>
        s.write(
          JSON.stringify({
            type: 'audio-chunk',
            data: { rate: 16000, width: 2, channels: 1, timestamp: 1e300 },
            payload_length: 4,
          }) + '\n\0\0\0\0',
        ),
      /audio-chunk\.timestamp: must be a number of ms from 0 to 9007199254740991, got 1e\+300/,
    ],
  ];
  it.each(malformed)('%s: an error event, then the close; nothing leaks', async (_, write, message) => {
    const c = await Client.open(port);
    // Mid-stream, holding a lease: the error must release it.
    c.send('detect', { names: ['alexa'] });
    c.send('audio-start', { rate: 16000, width: 2, channels: 1 });
    c.send('audio-chunk', { rate: 16000, width: 2, channels: 1 }, Buffer.alloc(3200));
    await until(async () => (await leases()) === 1);
    write(c.socket);
    const err = await c.next('error');
    expect(err.data.text).toMatch(message);
    await c.closed;
    await until(async () => (await leases()) === 0);
    expect(server.wyoming!.links.size).toBe(0);
    // The server goes on.
    const d = await Client.open(port);
    d.send('describe');
    await d.next('info');
    d.socket.end();
  });
});

describe('Wyoming deadlines and limits', () => {
  it('item 4 (#25): a quiet connection is not cut at limits.idle_ms (wyoming-openwakeword does not cut): mid-stream, quiet for 5 x idle_ms, it is still heard; past limits.max_ws_connections a connection gets an error', async () => {
    const small = await startTestServer({
      wyoming: { enabled: true, port: 0 },
      limits: { idle_ms: 300, max_ws_connections: 2 },
    });
    onTestFinished(() => small.close());
    await until(async () => (await fetch(`${small.url}/ready`)).status === 200, 10_000);
    const [a, b] = await Promise.all([Client.open(small.wyoming!.port), Client.open(small.wyoming!.port)]);
    await until(() => small.wyoming!.links.size === 2);
    const c = await Client.open(small.wyoming!.port);
    expect((await c.next('error')).data).toMatchObject({
      code: 'server_busy',
      text: expect.stringContaining('max_ws_connections'),
    });
    await c.closed;
    // b starts an audio stream, then says nothing for 1.5 s (as a satellite whose pipeline runs).
    b.send('detect', { names: ['alexa'] });
    b.send('audio-start', { rate: 16000, width: 2, channels: 1, timestamp: 0 });
    b.send('audio-chunk', { rate: 16000, width: 2, channels: 1, timestamp: 0 }, Buffer.alloc(3200));
    await new Promise((r) => setTimeout(r, 1500));
    expect(b.socket.destroyed).toBe(false);
    expect(b.events).toEqual([]);
    b.sendWav('espeak_alexa_16k.wav');
    expect((await b.next('detection')).data.name).toBe('alexa');
    // a, silent from the start, is still there too.
    expect(a.socket.destroyed).toBe(false);
    a.send('describe');
    await a.next('info');
    a.socket.end();
    b.socket.end();
  });

  it('item 4 (#25): wyoming.idle_ms, when set, cuts a silent connection (its own setting, named in the error)', async () => {
    const small = await startTestServer({ wyoming: { enabled: true, port: 0, idle_ms: 300 } });
    onTestFinished(() => small.close());
    await until(async () => (await fetch(`${small.url}/ready`)).status === 200, 10_000);
    const [a, b] = await Promise.all([Client.open(small.wyoming!.port), Client.open(small.wyoming!.port)]);
    // a keeps talking (describe counts as a message), b stays silent.
    const talk = setInterval(() => a.send('describe'), 100);
    onTestFinished(() => clearInterval(talk));
    expect((await b.next('error', 3000)).data.text).toContain('wyoming.idle_ms (300 ms)');
    await b.closed;
    expect(a.socket.destroyed).toBe(false);
    clearInterval(talk);
    await a.next('error', 3000);
  });
});

describe('Wyoming half-sent events', () => {
  it('item 4 (#25): an event begun and not finished (part of a header line, or a body one byte short) is cut at wyoming.event_timeout_ms even with idle_ms 0; a quiet connection between events stays', async () => {
    const small = await startTestServer({ wyoming: { enabled: true, port: 0, event_timeout_ms: 400 } });
    onTestFinished(() => small.close());
    await until(async () => (await fetch(`${small.url}/ready`)).status === 200, 10_000);
    const p = small.wyoming!.port;
    const [line, body, quiet] = await Promise.all([Client.open(p), Client.open(p), Client.open(p)]);
    line.socket.write('{"type": "describe", "da');
    body.socket.write(`${JSON.stringify({ type: 'audio-chunk', payload_length: 1000 })}\n`);
    body.socket.write(Buffer.alloc(999));
    quiet.send('describe');
    await quiet.next('info');
    for (const c of [line, body]) {
      expect((await c.next('error', 3000)).data.text).toMatch(
        /not finished within wyoming\.event_timeout_ms \(400 ms\)/,
      );
      await c.closed;
    }
    await new Promise((r) => setTimeout(r, 800));
    expect(quiet.socket.destroyed).toBe(false);
    quiet.send('describe');
    await until(() => quiet.events.filter((e) => e.type === 'info').length === 2);
    await until(() => small.wyoming!.links.size === 1);
    quiet.socket.end();
  });
});

describe('Wyoming drain', () => {
  it('SIGTERM: live audio streams are finished as if audio-stop had come (detection, or not-detected), then closed; exit 0 before the drain deadline', async () => {
    const wyomingPort = await new Promise<number>((resolve) => {
      const s = createServer().listen(0, '127.0.0.1', () => {
        const p = (s.address() as { port: number }).port;
        s.close(() => resolve(p));
      });
    });
    const dir = mkdtempSync(join(tmpdir(), 'voxserve-wyoming-'));
    const config = join(dir, 'config.json');
    const path = defaultCatalog().find((m) => m.id === 'hey-jarvis')!.path;
    writeFileSync(
      config,
      JSON.stringify({
        port: 0,
        drain_timeout_ms: 8000,
        wyoming: { enabled: true, port: wyomingPort },
        models: [{ id: 'hey-jarvis', lazy: false, task: 'wakeword', path }],
      }),
    );
    const { child } = await spawnServer(['--config', config]);
    onTestFinished(() => void child.kill('SIGKILL'));
    const exited = new Promise<number | null>((r) => child.on('exit', (code) => r(code)));
    // Neither sends audio-stop: the drain ends their audio streams.
    const [phrase, silence] = await Promise.all([Client.open(wyomingPort), Client.open(wyomingPort)]);
    for (const [c, file] of [
      [phrase, 'espeak_hey_jarvis_22k.wav'],
      [silence, 'silence_3s_16k.wav'],
    ] as const) {
      c.send('detect', { names: ['hey-jarvis'] });
      c.sendWav(file, false);
    }
    await phrase.next('detection');
    const t0 = performance.now();
    child.kill('SIGTERM');
    await Promise.all([phrase.closed, silence.closed]);
    expect(phrase.events.map((e) => e.type)).toEqual(['detection']);
    expect(silence.events.map((e) => e.type)).toEqual(['not-detected']);
    expect(await exited).toBe(0);
    expect(performance.now() - t0).toBeLessThan(8000);
  });
});
