import { execFile } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { createServer, type AddressInfo, type Socket } from 'node:net';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { afterAll, beforeAll, describe, expect, it, onTestFinished } from 'vitest';
import WebSocket, { WebSocketServer } from 'ws';
import { VoxClient, VoxClientError, type StreamEvent } from '../../client/node.js';
import { defaultCatalog } from '../../runtime/config.js';
import type { VoxServer } from '../../transport/server.js';
import { spawnServer } from '../../tools/spawn-server.js';
import { fixture, loopWav, startTestServer, WaveFile } from '../helpers.js';

const exec = promisify(execFile);
const silero = defaultCatalog().find((m) => m.id === 'silero-vad')!.path;
let server: VoxServer;
let vox: VoxClient;

beforeAll(async () => {
  server = await startTestServer({
    management: { enabled: true },
    models: [{ id: 'one-stream', task: 'vad', path: silero, max_streams: 1, busy_timeout_ms: 300 }],
  });
  vox = new VoxClient({ url: server.url });
});
afterAll(async () => {
  await server?.close();
});

/** A WAV fixture as the old CLI sent it: s16le PCM, its rate and channel count, 100 ms frames. */
function pcmOf(name: string): { pcm: Buffer; rate: number; channels: number; frameBytes: number } {
  const wav = new WaveFile(fixture(name));
  wav.toBitDepth('16');
  const { sampleRate: rate, numChannels: channels } = wav.fmt as { sampleRate: number; numChannels: number };
  return {
    pcm: Buffer.from((wav.data as { samples: Uint8Array }).samples),
    rate,
    channels,
    frameBytes: Math.round(rate / 10) * 2 * channels,
  };
}

/** Fields that differ from run to run. */
const stable = (e: Record<string, unknown>): Record<string, unknown> => {
  const { session_id: _s, timing: _t, ...rest } = e;
  return rest;
};

/**
 * The peer: what `voxserve stream` did before the client existed (raw ws, JSON subprotocol,
 * wait for `ready`, send every 100 ms frame, then `{"type":"end"}`, print each event).
 */
function rawStream(model: string, name: string): Promise<Record<string, unknown>[]> {
  const { pcm, rate, channels, frameBytes } = pcmOf(name);
  const q = new URLSearchParams({ model, sample_rate: String(rate), channels: String(channels), encoding: 's16le' });
  const ws = new WebSocket(`${server.url.replace('http', 'ws')}/v1/stream?${q}`, 'voxserve.v1.json');
  const events: Record<string, unknown>[] = [];
  return new Promise((resolve, reject) => {
    ws.on('error', reject);
    ws.on('message', (data) => {
      const e = JSON.parse(data.toString());
      events.push(e);
      if (e.type !== 'ready') return;
      for (let off = 0; off < pcm.length; off += frameBytes) ws.send(pcm.subarray(off, off + frameBytes));
      ws.send(JSON.stringify({ type: 'end' }));
    });
    ws.on('close', (code) => (code === 1000 ? resolve(events) : reject(new Error(`closed ${code}`))));
  });
}

async function clientStream(model: string, name: string, protocol: 'json' | 'msgpack'): Promise<StreamEvent[]> {
  const { pcm, rate, channels, frameBytes } = pcmOf(name);
  const stream = await vox.stream({ model, sampleRate: rate, channels, protocol });
  const events: StreamEvent[] = [];
  const reading = (async () => {
    for await (const e of stream) events.push(e);
  })();
  for (let off = 0; off < pcm.length; off += frameBytes) await stream.send(pcm.subarray(off, off + frameBytes));
  const done = await stream.end();
  await reading;
  expect(events.at(-1)).toEqual(done);
  return events;
}

const CASES: [string, string][] = [
  ['silero-vad', 'espeak_sentence_16k.wav'],
  ['silero-vad', 'Front_Center.wav'],
  ['silero-vad', 'silence_3s_16k.wav'],
  ['alexa', 'espeak_alexa_16k.wav'],
  ['hey-jarvis', 'espeak_hey_jarvis_22k.wav'],
];

describe('voxserve/client streams against a real server', () => {
  it.each(CASES)('%s on %s: the same events as the raw WebSocket peer, over JSON and msgpack', async (model, name) => {
    const expected = (await rawStream(model, name)).map(stable);
    expect(expected.length).toBeGreaterThanOrEqual(2);
    for (const protocol of ['json', 'msgpack'] as const) {
      const events = await clientStream(model, name, protocol);
      expect(
        events.map((e) => stable(e as Record<string, unknown>)),
        protocol,
      ).toEqual(expected);
    }
  });

  it('delivers the same events to callbacks as to the iterator', async () => {
    const { pcm, frameBytes } = pcmOf('espeak_sentence_16k.wav');
    const stream = await vox.stream({ model: 'silero-vad' });
    const heard: string[] = [];
    stream
      .on('speech_start', (e) => heard.push(`start ${e.at_ms}`))
      .on('speech_end', (e) => heard.push(`end ${e.start_ms}-${e.end_ms}`));
    let closed: number | undefined;
    stream.on('close', (c) => (closed = c.code));
    for (let off = 0; off < pcm.length; off += frameBytes) await stream.send(pcm.subarray(off, off + frameBytes));
    await stream.end();
    const iterated: string[] = [];
    for await (const e of stream) {
      if (e.type === 'speech_start') iterated.push(`start ${e.at_ms}`);
      if (e.type === 'speech_end') iterated.push(`end ${e.start_ms}-${e.end_ms}`);
    }
    expect(heard.length).toBe(2);
    expect(heard).toEqual(iterated);
    expect(stream.ready).toMatchObject({ type: 'ready', model: 'silero-vad', task: 'vad' });
    await stream.closed;
    expect(closed).toBe(1000);
  });
});

describe('backpressure', () => {
  it('send waits while the server side does not read, instead of buffering without bound', async () => {
    // A slow server: it accepts, says ready, then stops reading the socket until told to go on.
    const wss = new WebSocketServer({ port: 0, host: '127.0.0.1', handleProtocols: () => 'voxserve.v1.json' });
    await new Promise((r) => wss.once('listening', r));
    let received = 0;
    let resume!: () => void;
    wss.on('connection', (ws) => {
      const socket = (ws as unknown as { _socket: import('node:net').Socket })._socket;
      ws.on('message', (d: Buffer, binary: boolean) => {
        if (binary) received += d.length;
        else ws.close(1000);
      });
      ws.send(JSON.stringify({ type: 'ready', session_id: 's', model: 'm', task: 'vad', sample_rate: 16000 }));
      socket.pause();
      resume = () => socket.resume();
    });
    try {
      const client = new VoxClient({ url: `http://127.0.0.1:${(wss.address() as AddressInfo).port}` });
      const highWaterMark = 256 * 1024;
      const stream = await client.stream({ model: 'm', highWaterMark });
      const frame = Buffer.alloc(64 * 1024, 1);
      const total = 512; // 32 MiB, far more than the socket buffers of loopback hold
      let sent = 0;
      let maxBuffered = 0;
      const sending = (async () => {
        for (; sent < total; sent++) {
          await stream.send(frame);
          maxBuffered = Math.max(maxBuffered, stream.bufferedAmount);
        }
      })();
      // Let the kernel buffers fill, then the sender must be waiting, not buffering.
      let before = -1;
      for (let i = 0; i < 100 && before !== sent; i++) {
        before = sent;
        await new Promise((r) => setTimeout(r, 100));
      }
      expect(sent).toBe(before);
      expect(sent).toBeLessThan(total);
      expect(maxBuffered).toBeLessThanOrEqual(highWaterMark + frame.length);
      expect(stream.bufferedAmount).toBeLessThanOrEqual(highWaterMark + frame.length);
      // The server reads again: every frame arrives, in full.
      resume();
      await sending;
      await stream.end().catch(() => {});
      await stream.closed;
      expect(received).toBe(total * frame.length);
    } finally {
      for (const c of wss.clients) c.terminate();
      await new Promise((r) => wss.close(r));
    }
  });
});

describe('errors are typed with the wire type', () => {
  const refusal = async (p: Promise<unknown>): Promise<VoxClientError> => {
    const e = await p.then(
      () => null,
      (err: unknown) => err,
    );
    expect(e).toBeInstanceOf(VoxClientError);
    return e as VoxClientError;
  };

  it('a stream to an unknown model: not_found, close 1008', async () => {
    const e = await refusal(vox.stream({ model: 'no-such-model' }));
    expect(e).toMatchObject({ type: 'not_found', closeCode: 1008 });
    expect(e.message).toMatch(/no-such-model/);
  });

  it('a stream with a bad parameter: invalid_request_error naming it', async () => {
    const e = await refusal(vox.stream({ model: 'silero-vad', sampleRate: 5 }));
    expect(e).toMatchObject({ type: 'invalid_request_error', closeCode: 1008 });
    expect(e.message).toMatch(/sample_rate/);
  });

  it('a stream beyond max_streams: server_busy, close 1013', async () => {
    const first = await vox.stream({ model: 'one-stream' });
    try {
      const e = await refusal(vox.stream({ model: 'one-stream' }));
      expect(e).toMatchObject({ type: 'server_busy', closeCode: 1013 });
    } finally {
      first.close();
    }
  });

  it('a live stream whose model is unloaded with force: the iterator throws, close 1012', async () => {
    await vox.load({ id: 'forced', task: 'vad', path: silero });
    const stream = await vox.stream({ model: 'forced' });
    await stream.send(Buffer.alloc(3200));
    await vox.unload('forced', { force: true });
    const e = await refusal(
      (async () => {
        for await (const _ of stream) {
          // drain
        }
      })(),
    );
    expect(e.closeCode).toBe(1012);
    expect(e.type).not.toBe('connection_error');
    expect((await stream.closed).error).toBe(e);
    await expect(stream.send(Buffer.alloc(320))).rejects.toBe(e);
  });

  it('run: not_found 404, invalid_request_error 400 for a file that is not audio', async () => {
    expect(await refusal(vox.run(fixture('Front_Center.wav'), { model: 'nope' }))).toMatchObject({
      type: 'not_found',
      status: 404,
    });
    const bad = await refusal(
      vox.run(new TextEncoder().encode('RIFF but not really a wav file'), { model: 'silero-vad' }),
    );
    expect(bad).toMatchObject({ type: 'invalid_request_error', status: 400 });
    const badOption = await refusal(
      vox.run(fixture('Front_Center.wav'), { model: 'silero-vad', options: { thresold: 0.4 } }),
    );
    expect(badOption.type).toBe('invalid_request_error');
    expect(badOption.message).toMatch(/thresold/);
  });

  it('management without --management: forbidden 403', async () => {
    const s = await startTestServer();
    try {
      const e = await refusal(new VoxClient({ url: s.url }).load({ id: 'x', task: 'vad', path: silero }));
      expect(e).toMatchObject({ type: 'forbidden', status: 403 });
    } finally {
      await s.close();
    }
  });

  it('no server: connection_error with the system code, for HTTP and for streams', async () => {
    const probe = createServer();
    await new Promise<void>((r) => probe.listen(0, '127.0.0.1', r));
    const { port } = probe.address() as AddressInfo;
    await new Promise((r) => probe.close(r));
    const gone = new VoxClient({ url: `http://127.0.0.1:${port}` });
    expect(await refusal(gone.models())).toMatchObject({ type: 'connection_error', code: 'ECONNREFUSED' });
    expect(await refusal(gone.stream({ model: 'silero-vad' }))).toMatchObject({
      type: 'connection_error',
      code: 'ECONNREFUSED',
    });
  });

  it('an undecodable event frame fails the stream (server_error) instead of throwing in the socket listener', async () => {
    const wss = new WebSocketServer({ port: 0, host: '127.0.0.1', handleProtocols: () => 'voxserve.v1.json' });
    await new Promise((r) => wss.once('listening', r));
    wss.on('connection', (ws) => {
      ws.send(JSON.stringify({ type: 'ready', session_id: 's', model: 'm', task: 'vad', sample_rate: 16000 }));
      ws.send('{not json');
    });
    try {
      const stream = await new VoxClient({ url: `http://127.0.0.1:${(wss.address() as AddressInfo).port}` }).stream({
        model: 'm',
      });
      const e = await refusal(
        (async () => {
          for await (const _ of stream) {
            // drain
          }
        })(),
      );
      expect(e.type).toBe('server_error');
      expect(e.message).toMatch(/undecodable event frame/);
    } finally {
      await new Promise((r) => wss.close(r));
    }
  });

  it('a URL without a scheme is refused with a hint', () => {
    expect(() => new VoxClient({ url: '127.0.0.1:8080' })).toThrow(/did you mean http:\/\/127\.0\.0\.1:8080/);
  });
});

describe('heartbeat (heartbeatMs)', () => {
  /** Settles with the rejection of `p`, or with a timeout error after `ms` (a promise that never settles). */
  const outcome = (p: Promise<unknown>, ms: number): Promise<unknown> =>
    Promise.race([
      p.then(
        () => 'resolved',
        (e) => e,
      ),
      new Promise((r) => setTimeout(() => r(new Error(`still pending after ${ms} ms`)), ms)),
    ]);

  it('item 12 (#25): a frozen server (SIGSTOP): end() and the event iterator reject with connection_error heartbeat_timeout', async () => {
    const { child, url } = await spawnServer(['--port', '0']);
    const exited = new Promise((r) => child.once('exit', r));
    onTestFinished(async () => {
      child.kill('SIGCONT');
      child.kill('SIGTERM');
      await exited;
    });
    const stream = await new VoxClient({ url, heartbeatMs: 300 }).stream({ model: 'silero-vad' });
    await stream.send(Buffer.alloc(3200));
    child.kill('SIGSTOP');
    const iterated = (async () => {
      for await (const _ of stream);
    })();
    const ended = stream.end();
    // Without a heartbeat both wait for ever (the frozen server's kernel keeps the TCP connection up).
    const [endError, iterError] = await Promise.all([outcome(ended, 10_000), outcome(iterated, 10_000)]);
    for (const e of [endError, iterError]) {
      expect(e).toBeInstanceOf(VoxClientError);
      expect(e).toMatchObject({ type: 'connection_error', code: 'heartbeat_timeout' });
      expect((e as Error).message).toMatch(/no answer from .* for 300 ms after a ping \(heartbeatMs\)/);
    }
    expect((await stream.closed).error?.code).toBe('heartbeat_timeout');
  });

  it('item 12 (#25): a server that is quiet but alive answers the pings: a silent stream lives through many intervals', async () => {
    const stream = await new VoxClient({ url: server.url, heartbeatMs: 400 }).stream({ model: 'silero-vad' });
    // 2.4 s of silence, sent slowly: no event from the server, only pongs (6 intervals).
    for (let i = 0; i < 24; i++) {
      await stream.send(Buffer.alloc(3200));
      await new Promise((r) => setTimeout(r, 100));
    }
    expect((await stream.end()).type).toBe('done');
    expect((await stream.closed).error).toBeUndefined();
  });

  it('item 12 (#25): a ws server that stops answering pings fails the stream; heartbeatMs 0 turns it off; a bad value is a TypeError', async () => {
    // A server that opens the stream, sends ready, then never answers a ping (autoPong off).
    const wss = new WebSocketServer({ port: 0, autoPong: false, handleProtocols: (p) => [...p][0] });
    onTestFinished(() => new Promise<void>((r) => wss.close(() => r())));
    wss.on('connection', (ws) => {
      ws.on('error', () => {});
      ws.send(JSON.stringify({ type: 'ready', session_id: 'x', model: 'm', task: 'vad', sample_rate: 16000 }));
    });
    const url = `http://127.0.0.1:${(wss.address() as AddressInfo).port}`;
    const failing = await new VoxClient({ url, heartbeatMs: 100 }).stream({ model: 'm' });
    expect(await outcome(failing.end(), 5000)).toMatchObject({ code: 'heartbeat_timeout' });
    const off = await new VoxClient({ url, heartbeatMs: 0 }).stream({ model: 'm' });
    expect(await outcome(off.end(), 600)).toMatchObject({ message: 'still pending after 600 ms' });
    off.close();
    expect(() => new VoxClient({ url, heartbeatMs: -1 })).toThrow(/heartbeatMs: a number of ms/);
  });

  it('item 12 (#25): a server that has paused reading (backpressure) but pings is not failed; once its pings stop, it is', async () => {
    // The server reads nothing after ready (so our pings go unread and unanswered), as voxserve does
    // while more than 10 s of audio waits for a stuck model, and pings every 50 ms until told to stop.
    let beacon: ReturnType<typeof setInterval> | undefined;
    const wss = new WebSocketServer({ port: 0, handleProtocols: (p) => [...p][0] });
    onTestFinished(() => {
      clearInterval(beacon);
      // Its sockets are paused: they would never read the close; ws's close waits for them.
      for (const ws of wss.clients) ws.terminate();
      return new Promise<void>((r) => wss.close(() => r()));
    });
    wss.on('connection', (ws) => {
      ws.on('error', () => {});
      ws.send(JSON.stringify({ type: 'ready', session_id: 'x', model: 'm', task: 'vad', sample_rate: 16000 }));
      (ws as unknown as { _socket: Socket })._socket.pause();
      beacon = setInterval(() => ws.ping(), 50);
    });
    const url = `http://127.0.0.1:${(wss.address() as AddressInfo).port}`;
    const stream = await new VoxClient({ url, heartbeatMs: 100 }).stream({ model: 'm' });
    const ended = stream.end();
    // Ten heartbeat intervals with no pong and no event, only the server's pings: still open.
    expect(await outcome(ended, 1000)).toMatchObject({ message: 'still pending after 1000 ms' });
    clearInterval(beacon);
    expect(await outcome(ended, 5000)).toMatchObject({ type: 'connection_error', code: 'heartbeat_timeout' });
  });

  it('item 12 (#25): heartbeatMs is the deadline of the opening handshake (a server that accepts the connection and never answers)', async () => {
    const sockets: Socket[] = [];
    const mute = createServer((socket) => sockets.push(socket.on('error', () => {}))).listen(0, '127.0.0.1');
    await new Promise((r) => mute.once('listening', r));
    onTestFinished(() => {
      for (const socket of sockets) socket.destroy();
      mute.close();
    });
    const url = `http://127.0.0.1:${(mute.address() as AddressInfo).port}`;
    const opened = new VoxClient({ url, heartbeatMs: 200 }).stream({ model: 'm' });
    expect(await outcome(opened, 5000)).toMatchObject({
      type: 'connection_error',
      message: expect.stringContaining('Opening handshake has timed out'),
    });
  });
});

describe('files and management', () => {
  it("run gives the route's result; with options they apply", async () => {
    // Silero VAD v5: v6 (silero-vad) is confident enough on this recording to keep both segments at 0.99.
    const direct = await (
      await fetch(`${server.url}/v1/tasks/run?model=silero-vad-v5`, {
        method: 'POST',
        headers: { 'content-type': 'audio/wav' },
        body: new Uint8Array(fixture('Front_Center.wav')),
      })
    ).json();
    const r = await vox.run(fixture('Front_Center.wav'), { model: 'silero-vad-v5' });
    expect(r.task === 'vad' && r.segments).toEqual(direct.segments);
    const strict = await vox.run(fixture('Front_Center.wav'), { model: 'silero-vad-v5', options: { threshold: 0.99 } });
    expect(strict.task === 'vad' && strict.segments.length).toBeLessThan(direct.segments.length);
  });

  it('run with onProgress: progress events up to the whole file, then the same result', async () => {
    const wav = loopWav('espeak_sentence_16k.wav', 120);
    const plain = await vox.run(wav, { model: 'silero-vad' });
    const seen: { processed_ms: number; audio_duration_ms: number }[] = [];
    const r = await vox.run(wav, { model: 'silero-vad', onProgress: (p) => seen.push(p) });
    expect(r.task === 'vad' && r.segments).toEqual(plain.task === 'vad' && plain.segments);
    expect(seen.length).toBeGreaterThanOrEqual(2);
    expect(seen[0].processed_ms).toBe(0);
    expect(seen.every((p) => p.audio_duration_ms === 120_000)).toBe(true);
    expect(seen.at(-1)!.processed_ms).toBe(120_000);
    for (let i = 1; i < seen.length; i++) expect(seen[i].processed_ms).toBeGreaterThan(seen[i - 1].processed_ms);
  });

  it("batch yields each file's result or error, then done", async () => {
    const events = [];
    for await (const e of vox.batch(
      [fixture('Front_Center.wav'), new Uint8Array([1, 2, 3]), fixture('silence_3s_16k.wav')],
      { model: 'silero-vad' },
    ))
      events.push(e);
    expect(events.at(-1)).toMatchObject({ type: 'done', files: 3, failed: 1 });
    const byIndex = Object.fromEntries(
      events.filter((e) => e.type !== 'done').map((e) => [(e as { index: number }).index, e]),
    );
    expect(byIndex[0]).toMatchObject({ type: 'result', task: 'vad' });
    expect(byIndex[1]).toMatchObject({ type: 'error', error: { type: 'invalid_request_error' } });
    expect(byIndex[2]).toMatchObject({ type: 'result', segments: [] });
  });

  it('models, load, unload', async () => {
    expect((await vox.models()).map((m) => m.id)).toEqual(expect.arrayContaining(['silero-vad', 'hey-jarvis']));
    expect(await vox.load({ id: 'managed', task: 'vad', path: silero })).toMatchObject({ id: 'managed', loaded: true });
    expect(await vox.model('managed')).toMatchObject({ id: 'managed', state: 'ready' });
    expect(await vox.unload('managed')).toEqual({ id: 'managed', loaded: false });
    expect((await vox.model('managed')).state).toBe('unloaded');
  });
});

describe('package entry points', () => {
  const root = fileURLToPath(new URL('../..', import.meta.url));

  it('voxserve/client resolves under Node to the ws-backed client; voxserve to the server API', async () => {
    const script =
      "const c = await import('voxserve/client'); const s = await import('voxserve'); const v = new c.VoxClient({ url: 'http://127.0.0.1:1' }); console.log(typeof c.VoxStream, typeof s.startServer, v.url);";
    const { stdout } = await exec(process.execPath, ['--input-type=module', '-e', script], { cwd: root });
    expect(stdout.trim()).toBe('function function http://127.0.0.1:1');
  });

  it('the browser entry imports nothing from Node', () => {
    const code = readFileSync(`${root}dist/client/index.js`, 'utf8');
    const imports = [...code.matchAll(/^import .* from '([^']+)'/gm)].map((m) => m[1]);
    // The wire constants it shares with the server come from a module that imports nothing.
    expect(imports.sort()).toEqual(['../runtime/wire.js', 'eventsource-parser', 'msgpackr']);
    expect(readFileSync(`${root}dist/runtime/wire.js`, 'utf8')).not.toMatch(/^(import|export .* from) /m);
  });
});
