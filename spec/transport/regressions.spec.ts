/** Regressions from trying to break the server (each one a failure seen on an earlier build). */
import { connect } from 'node:net';
import { dirname } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import WebSocket from 'ws';
import { OWW_MELSPECTROGRAM, SILERO_V5 } from '../../runtime/catalog.js';
import { defaultCatalog, ServerConfig } from '../../runtime/config.js';
import type { VoxServer } from '../../transport/server.js';
import { fixture, startTestServer, WaveFile } from '../helpers.js';

let server: VoxServer;
const catalog = defaultCatalog();
const legacyVad = SILERO_V5.replace('silero_vad_v5.onnx', 'silero_vad_legacy.onnx');

beforeAll(async () => {
  server = await startTestServer({
    management: { enabled: true },
    models_root: dirname(legacyVad),
    limits: { max_body_bytes: 1024 * 1024 },
  });
});
afterAll(async () => {
  await server?.close();
});

const healthy = async (): Promise<void> => {
  const r = await fetch(`${server.url}/v1/tasks/run?model=silero-vad`, {
    method: 'POST',
    headers: { 'content-type': 'audio/wav' },
    body: new Uint8Array(fixture('Front_Left.wav')),
  });
  expect(r.status).toBe(200);
  const m = server.supervisor.statuses();
  expect(m.reduce((n, s) => n + s.active_leases + s.queued_requests, 0)).toBe(0);
};

/** Sends raw bytes on a TCP socket; resolves with everything read until the server closes. */
function raw(chunks: (string | Buffer)[]): Promise<string> {
  return new Promise((resolve) => {
    const sock = connect(Number(new URL(server.url).port), '127.0.0.1', () => chunks.forEach((c) => sock.write(c)));
    let text = '';
    sock.on('data', (d) => (text += d.toString('latin1')));
    sock.on('error', () => {});
    sock.on('close', () => resolve(text));
  });
}

describe('regressions', () => {
  it('an oversized chunked upload gets 413 and the server stays up', async () => {
    const head =
      'POST /v1/tasks/run?model=silero-vad HTTP/1.1\r\nHost: localhost\r\nContent-Type: audio/wav\r\nTransfer-Encoding: chunked\r\n\r\n';
    const chunk = Buffer.alloc(256 * 1024);
    const chunks: (string | Buffer)[] = [head];
    for (let i = 0; i < 8; i++) chunks.push(`${chunk.length.toString(16)}\r\n`, chunk, '\r\n');
    expect(await raw(chunks)).toMatch(/^HTTP\/1\.1 413/);
    await healthy();
  });

  it('`end` in the same read as a sub-window frame still ends the stream with done', async () => {
    for (let i = 0; i < 5; i++) {
      const ws = new WebSocket(`${server.url.replace('http', 'ws')}/v1/stream?model=silero-vad`);
      const events: string[] = [];
      await new Promise<void>((resolve, reject) => {
        ws.on('error', reject);
        ws.on('message', (d) => {
          const e = JSON.parse(d.toString());
          events.push(e.type);
          if (e.type === 'ready') {
            // Both frames in one write: ws delivers them in one tick.
            const sock = (ws as unknown as { _socket: import('node:net').Socket })._socket;
            sock.cork();
            ws.send(Buffer.alloc(200));
            ws.send(JSON.stringify({ type: 'end' }));
            sock.uncork();
          }
        });
        ws.on('close', () => resolve());
        setTimeout(() => reject(new Error(`no done: ${events.join(',')}`)), 5000);
      });
      expect(events.at(-1)).toBe('done');
    }
    await healthy();
  });

  it('NaN, Inf and huge float samples do not make detections or change results', async () => {
    const w = new WaveFile(fixture('espeak_hey_jarvis_22k.wav'));
    const rate = (w.fmt as { sampleRate: number }).sampleRate;
    const s16 = w.getSamples(false, Int16Array) as unknown as Int16Array;
    const f32 = Float32Array.from(s16, (v) => v / 32768);
    f32[5000] = NaN;
    f32[5001] = Infinity;
    f32[5002] = 1e30;
    const bad = new WaveFile();
    bad.fromScratch(1, rate, '32f', f32);
    const clean = await (
      await fetch(`${server.url}/v1/tasks/run?model=hey-jarvis`, {
        method: 'POST',
        headers: { 'content-type': 'audio/wav' },
        body: new Uint8Array(fixture('espeak_hey_jarvis_22k.wav')),
      })
    ).json();
    const dirty = await (
      await fetch(`${server.url}/v1/tasks/run?model=hey-jarvis`, {
        method: 'POST',
        headers: { 'content-type': 'audio/wav' },
        body: new Uint8Array(bad.toBuffer()),
      })
    ).json();
    expect(dirty.detections).toHaveLength(1);
    expect(dirty.detections[0].at_ms).toBe(clean.detections[0].at_ms);
    expect(Number.isFinite(dirty.detections[0].score)).toBe(true);
    const silence = new Float32Array(16000 * 3);
    silence[100] = NaN;
    const quiet = new WaveFile();
    quiet.fromScratch(1, 16000, '32f', silence);
    const q = await (
      await fetch(`${server.url}/v1/tasks/run?model=alexa`, {
        method: 'POST',
        headers: { 'content-type': 'audio/wav' },
        body: new Uint8Array(quiet.toBuffer()),
      })
    ).json();
    expect(q.detections).toEqual([]);
  });

  it('a busy timeout beyond what timers can hold is a 400, not an immediate 503', async () => {
    const r = await fetch(`${server.url}/v1/tasks/run?model=silero-vad&busy_timeout_ms=3000000000`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: new Uint8Array(fixture('Front_Left.wav')),
    });
    expect(r.status).toBe(400);
    expect((await r.json()).error.message).toMatch(/^busy_timeout_ms: must be an integer from 0 to 2147483647/);
    expect(() => ServerConfig.parse({ busy_timeout_ms: 3_000_000_000 })).toThrow();
  });

  it('a huge unknown model id is not echoed back in full; an unknown JSON field is named', async () => {
    const r = await fetch(`${server.url}/v1/tasks/run`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ model: 'x'.repeat(100_000), audio: 'AAAA' }),
    });
    expect(r.status).toBe(404);
    expect((await r.text()).length).toBeLessThan(400);
    const j = await fetch(`${server.url}/v1/tasks/run`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ model: 'silero-vad', audio: 'AAAA', treshold: 0.4 }),
    });
    expect(j.status).toBe(400);
    expect((await j.json()).error.message).toMatch(/^treshold: unknown field/);
  });

  it('bad percent-encoding in a model path is a 400', async () => {
    const r = await fetch(`${server.url}/v1/models/%ZZ`);
    expect(r.status).toBe(400);
  });

  it('a request target that is not a valid path (//) is a 400 malformed_request, with or without a WebSocket upgrade (the upgrade crashed the process)', async () => {
    const upgrade =
      'Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n';
    for (const headers of [upgrade, 'Connection: close\r\n']) {
      const text = await raw([`GET // HTTP/1.1\r\nHost: localhost\r\n${headers}\r\n`]);
      expect(text).toMatch(/^HTTP\/1\.1 400/);
      expect(text).toContain('"code":"malformed_request"');
    }
    await healthy();
  });

  it('a non-WebSocket Upgrade (h2c) is answered over HTTP/1.1', async () => {
    const text = await raw([
      'GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n',
    ]);
    expect(text).toMatch(/^HTTP\/1\.1 200/);
    expect(text).toContain('"status":"ok"');
  });

  it.each([
    ['the legacy Silero VAD as a wake-word head', legacyVad],
    ['the melspectrogram model as a wake-word head', OWW_MELSPECTROGRAM],
  ])('refuses to load %s: the load fails with last_error', async (_what, path) => {
    const r = await fetch(`${server.url}/v1/models/load`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ id: `wrong-${path.length}`, task: 'wakeword', path }),
    });
    expect(r.status).toBe(500);
    expect((await r.json()).error.message).toMatch(/not an openWakeWord head/);
  });

  it('a float WAV declaring 16-bit samples is refused', async () => {
    const w = Buffer.from(fixture('silence_3s_16k.wav'));
    w.writeUInt16LE(3, 20); // IEEE float, but 16 bits per sample
    const r = await fetch(`${server.url}/v1/tasks/run?model=silero-vad`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: new Uint8Array(w),
    });
    expect(r.status).toBe(400);
    expect((await r.json()).error.message).toMatch(/bit depth 16 for float/);
  });

  it('a stream still waiting for its lease stops reading past a cap instead of buffering without bound', async () => {
    const silero = catalog.find((m) => m.id === 'silero-vad')!.path;
    await fetch(`${server.url}/v1/models/load`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ id: 'one-lease', task: 'vad', path: silero, max_streams: 1 }),
    });
    const holder = new WebSocket(`${server.url.replace('http', 'ws')}/v1/stream?model=one-lease`);
    await new Promise((r) => holder.on('message', r));
    const queued = new WebSocket(`${server.url.replace('http', 'ws')}/v1/stream?model=one-lease`);
    await new Promise((r) => queued.on('open', r));
    const mb = Buffer.alloc(1024 * 1024);
    for (let i = 0; i < 200; i++) queued.send(mb);
    await new Promise((r) => setTimeout(r, 1000));
    // The client still holds most of the 200 MiB: the server stopped reading at its 4 MiB cap
    // (plus what the kernel's socket buffers hold).
    expect(queued.bufferedAmount).toBeGreaterThan(150 * 1024 * 1024);
    queued.terminate();
    holder.terminate();
  });
});
