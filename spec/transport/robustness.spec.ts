/**
 * Issue 25, HTTP items replayed on a real listener (fake slots): pipelined unsafe requests run in
 * order (item 6), a keep-alive connection's next request whose headers trickle in is not cut by
 * `limits.idle_ms` (item 7), and a request body has a total deadline (item 8).
 */
import { mkdtempSync, writeFileSync } from 'node:fs';
import { connect, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, describe, expect, it, vi } from 'vitest';
import WebSocket from 'ws';
import { PcmStreamDecoder } from '../../runtime/audio/audio.js';
import type { ModelLoader } from '../../runtime/loader.js';
import { ServerConfig } from '../../runtime/config.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { fakeLoader } from '../fuzz/fakes.js';
import { fixture } from '../helpers.js';

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

let server: VoxServer | null = null;
afterEach(async () => {
  await server?.destroy();
  server = null;
});

/** A raw connection that collects everything the server writes; `closed` resolves when it ends. */
function rawConnection(url: string): { socket: Socket; text: () => string; closed: Promise<number> } {
  const { port } = new URL(url);
  const socket = connect(Number(port), '127.0.0.1');
  let text = '';
  socket.on('data', (d) => (text += d.toString()));
  socket.on('error', () => {});
  const t0 = performance.now();
  const closed = new Promise<number>((r) => socket.on('close', () => r(performance.now() - t0)));
  return { socket, text: () => text, closed };
}

/** The status lines of the responses in `text`, in order. */
const statuses = (text: string): number[] => [...text.matchAll(/HTTP\/1\.1 (\d{3}) /g)].map((m) => Number(m[1]));

const post = (path: string, body: unknown): string => {
  const json = JSON.stringify(body);
  return `POST ${path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: ${Buffer.byteLength(json)}\r\n\r\n${json}`;
};

describe('issue 25 HTTP robustness', () => {
  it('issue 25 item 6: POST load then POST unload pipelined on one connection run in order (both 200, model unloaded)', async () => {
    // A load that takes a while, as a real one does: the unload must wait for it, not race it.
    const slowLoader: ModelLoader = async (config, signal) => {
      await sleep(200);
      return fakeLoader(config, signal);
    };
    // A real models_root: the load checks its path on disk (asynchronously) before it registers the model.
    const root = mkdtempSync(join(tmpdir(), 'voxserve-piped-'));
    writeFileSync(join(root, 'piped.onnx'), 'not read by the fake loader');
    server = await startServer(
      ServerConfig.parse({ log_level: 'silent', port: 0, management: { enabled: true }, models_root: root }),
      { loader: slowLoader },
    );
    const c = rawConnection(server.url);
    c.socket.write(
      post('/v1/models/load', { id: 'piped', task: 'vad', path: 'piped.onnx' }) +
        post('/v1/models/unload', { id: 'piped' }),
    );
    const t0 = performance.now();
    while (statuses(c.text()).length < 2 && performance.now() - t0 < 5000) await sleep(10);
    expect(statuses(c.text())).toEqual([200, 200]);
    expect(c.text()).toContain('"loaded":true');
    expect(c.text()).toContain('{"id":"piped","loaded":false}');
    expect(server.supervisor.status('piped')).toMatchObject({ state: 'unloaded', loaded: false });
    c.socket.destroy();
  });

  it('issue 25 item 7: a keep-alive request whose headers trickle in for longer than idle_ms is answered, not cut', async () => {
    server = await startServer(
      ServerConfig.parse({ log_level: 'silent', port: 0, limits: { idle_ms: 500, headers_timeout_ms: 5000 } }),
      { loader: fakeLoader },
    );
    const c = rawConnection(server.url);
    c.socket.write('GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n');
    while (statuses(c.text()).length < 1) await sleep(10);
    // The next request's headers: one line every 200 ms for 1.6 s (over three idle periods).
    c.socket.write('GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n');
    for (let i = 0; i < 8; i++) {
      await sleep(200);
      c.socket.write(`X-Trickle-${i}: ${i}\r\n`);
    }
    c.socket.write('\r\n');
    const t0 = performance.now();
    while (statuses(c.text()).length < 2 && performance.now() - t0 < 3000) await sleep(10);
    expect(statuses(c.text())).toEqual([200, 200]);
    // Then silent: closed by the keep-alive deadline.
    expect(await c.closed).toBeGreaterThan(1600);
  });

  it('issue 25 item 8: a body dripping one byte at a time inside idle_ms is answered 408 request_timeout at limits.request_timeout_ms', async () => {
    server = await startServer(
      ServerConfig.parse({
        log_level: 'silent',
        port: 0,
        limits: { idle_ms: 30_000, headers_timeout_ms: 500, request_timeout_ms: 1000 },
      }),
      { loader: fakeLoader },
    );
    const c = rawConnection(server.url);
    c.socket.write(
      'POST /v1/tasks/run?model=silero-vad HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: audio/wav\r\nContent-Length: 100000\r\n\r\n',
    );
    const drip = setInterval(() => c.socket.writable && c.socket.write('R'), 100);
    try {
      const ms = await c.closed;
      expect(statuses(c.text())).toEqual([408]);
      expect(c.text()).toContain('"code":"request_timeout"');
      expect(c.text()).toContain('limits.request_timeout_ms (1000 ms)');
      expect(ms).toBeGreaterThan(900);
      expect(ms).toBeLessThan(3000);
    } finally {
      clearInterval(drip);
    }
  });

  it('issue 25 item 10: shutdown during a cold load (a request and a management load waiting on it) ends within drain_timeout_ms + 1 s; the load is abandoned, both answered 503 shutting_down', async () => {
    const signals: AbortSignal[] = [];
    // A load that would take far longer than the drain (as 4 slots of a big model on a busy machine do), until
    // abandoned.
    const endless: ModelLoader = (_config, signal) =>
      new Promise((_resolve, reject) => {
        signals.push(signal!);
        signal!.addEventListener('abort', () => reject(new Error('abandoned')), { once: true });
      });
    const root = mkdtempSync(join(tmpdir(), 'voxserve-cold-'));
    writeFileSync(join(root, 'big.onnx'), 'not read by the fake loader');
    server = await startServer(
      ServerConfig.parse({
        log_level: 'silent',
        port: 0,
        drain_timeout_ms: 3000,
        management: { enabled: true },
        models_root: root,
      }),
      { loader: endless },
    );
    const url = server.url;
    const task = fetch(`${url}/v1/tasks/run?model=silero-vad`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: new Uint8Array(fixture('Front_Left.wav')),
    }).then(async (r) => ({ status: r.status, body: await r.json() }));
    const managed = fetch(`${url}/v1/models/load`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ id: 'big', task: 'vad', path: 'big.onnx', slots: 4 }),
    }).then(async (r) => ({ status: r.status, body: await r.json() }));
    const t0 = performance.now();
    while (signals.length < 2 && performance.now() - t0 < 5000) await sleep(10);
    expect(signals).toHaveLength(2);
    const s0 = performance.now();
    await server.close();
    const ms = performance.now() - s0;
    expect(ms).toBeLessThan(3000 + 1000);
    expect(signals.every((s) => s.aborted)).toBe(true);
    expect(await task).toMatchObject({ status: 503, body: { error: { code: 'shutting_down' } } });
    expect(await managed).toMatchObject({ status: 503, body: { error: { code: 'shutting_down' } } });
    expect(server.supervisor.status('big')).toMatchObject({ state: 'unloaded', loaded: false });
    server = null;
  });
});

describe('a stream whose audio the decoder cannot take', () => {
  /** A WebSocket stream: its events, and its close code once closed. */
  function open(url: string): {
    ws: WebSocket;
    events: { type: string }[];
    ready: Promise<void>;
    closed: Promise<number>;
  } {
    const ws = new WebSocket(url);
    const events: { type: string }[] = [];
    const ready = new Promise<void>((resolve) =>
      ws.on('message', (d) => {
        events.push(JSON.parse(String(d)));
        if (events.at(-1)!.type === 'ready') resolve();
      }),
    );
    ws.on('error', () => {});
    return { ws, events, ready, closed: new Promise((r) => ws.on('close', (code) => r(code))) };
  }

  it('fails alone (an error event, close 1011); a stream flushed in the same turn goes on; the server stays up (breaker: the error went uncaught and stopped the server)', async () => {
    server = await startServer(ServerConfig.parse({ log_level: 'silent', port: 0 }));
    const url = `${server.url.replace('http', 'ws')}/v1/stream?model=silero-vad`;
    const push = PcmStreamDecoder.prototype.push;
    // A fault for 6-byte frames only: the decoder's own errors are a library's (a RangeError was one).
    const spy = vi.spyOn(PcmStreamDecoder.prototype, 'push').mockImplementation(function (
      this: PcmStreamDecoder,
      chunk: Buffer,
    ) {
      if (chunk.length === 6) throw new Error('a decoder fault');
      return push.call(this, chunk);
    });
    try {
      const [bad, good] = [open(url), open(url)];
      await Promise.all([bad.ready, good.ready]);
      const pcm = fixture('espeak_sentence_16k.wav').subarray(44);
      bad.ws.send(Buffer.alloc(6));
      good.ws.send(pcm);
      good.ws.send('{"type":"end"}');
      expect(await bad.closed).toBe(1011);
      expect(bad.events.at(-1)).toMatchObject({ type: 'error', error: { code: 'internal_error' } });
      expect(await good.closed).toBe(1000);
      expect(good.events.map((e) => e.type)).toContain('speech_end');
      expect(good.events.at(-1)).toMatchObject({ type: 'done' });
      const after = open(url);
      await after.ready;
      after.ws.close();
    } finally {
      spy.mockRestore();
    }
  });
});
