/** Shutdown of `voxserve serve` on SIGTERM, in phases (C15), with live streams and queued requests. */
import { mkdtempSync, writeFileSync } from 'node:fs';
import http from 'node:http';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it, onTestFinished } from 'vitest';
import WebSocket from 'ws';
import { defaultCatalog } from '../../runtime/config.js';
import { spawnServer } from '../../tools/spawn-server.js';
import { fixture } from '../helpers.js';

const silero = defaultCatalog().find((m) => m.id === 'silero-vad')!.path;
const DRAIN_MS = 4000;

describe('SIGTERM', () => {
  it('20 live streams get done then 1001, 20 queued requests get a result or 503, a keep-alive client never sees "not found"; exit 0 within the drain deadline', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'voxserve-shutdown-'));
    const config = join(dir, 'config.json');
    writeFileSync(
      config,
      JSON.stringify({
        port: 0,
        drain_timeout_ms: DRAIN_MS,
        limits: { idle_ms: 0, heartbeat_ms: 0 },
        models: [{ id: 'vad20', task: 'vad', path: silero, max_streams: 20, lazy: false }],
      }),
    );
    const { child, url } = await spawnServer(['--config', config]);
    // A failed run must not leave the server behind.
    onTestFinished(() => void child.kill('SIGKILL'));
    const exited = new Promise<{ code: number | null; at: number }>((r) =>
      child.on('exit', (code) => r({ code, at: performance.now() })),
    );
    const status = async () => (await fetch(`${url}/v1/models/vad20`)).json();
    // The keep-alive client below uses silero-vad: load it now (by a first request), so that its first request is not a
    // cold load that (on a loaded machine) outlasts the whole drain.
    const warm = await fetch(`${url}/v1/tasks/run?model=silero-vad`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: new Uint8Array(fixture('Front_Left.wav')),
    });
    expect(warm.status).toBe(200);

    // 20 streams hold every lease; each has sent speech and not yet `end`.
    const speech = fixture('espeak_sentence_16k.wav').subarray(44);
    const streams = await Promise.all(
      Array.from(
        { length: 20 },
        () =>
          new Promise<{ events: any[]; closed: Promise<number> }>((resolve, reject) => {
            const ws = new WebSocket(`${url.replace('http', 'ws')}/v1/stream?model=vad20`);
            const events: any[] = [];
            const closed = new Promise<number>((r) => ws.on('close', (code) => r(code)));
            ws.on('error', reject);
            ws.on('message', (d) => {
              const e = JSON.parse(d.toString());
              events.push(e);
              if (e.type === 'ready') {
                ws.send(speech);
                resolve({ events, closed });
              }
            });
          }),
      ),
    );
    // 20 HTTP requests queue behind them.
    const wav = fixture('Front_Left.wav');
    const queued = Array.from({ length: 20 }, () =>
      fetch(`${url}/v1/tasks/run?model=vad20`, {
        method: 'POST',
        headers: { 'content-type': 'audio/wav' },
        body: new Uint8Array(wav),
      }).then(
        async (r) => ({ status: r.status, body: await r.json() }),
        (e: Error) => ({ status: 0, body: { error: { message: `no response: ${e.message}` } } }),
      ),
    );
    while ((await status()).queued_requests < 20) await new Promise((r) => setTimeout(r, 10));

    // A keep-alive client: one request every 100 ms until the server is gone. node:http's agent says
    // whether a request went on a connection kept alive (`reusedSocket`): one of those must never be
    // reset. A new connection that the kernel completed in the instant the listener closed, before
    // the server accepted it, is reset instead of refused (measured: requests started 1-3 ms before the
    // listener closed): no byte of it was read, so for the client the server is gone either way.
    const agent = new http.Agent({ keepAlive: true });
    onTestFinished(() => agent.destroy());
    const { hostname, port } = new URL(url);
    const post = () =>
      new Promise<{ status: number; type?: string; reused: boolean; code?: string }>((resolve) => {
        const req = http.request(
          {
            hostname,
            port,
            path: '/v1/tasks/run?model=silero-vad',
            method: 'POST',
            agent,
            headers: { 'content-type': 'audio/wav' },
          },
          (res) => {
            let body = '';
            res.setEncoding('utf8');
            res.on('data', (d: string) => (body += d));
            res.on('end', () => {
              let type: string | undefined;
              try {
                type = JSON.parse(body).error?.type;
              } catch {
                type = `not JSON: ${body.slice(0, 80)}`;
              }
              resolve({ status: res.statusCode ?? 0, type, reused: req.reusedSocket });
            });
            res.on('error', (e: NodeJS.ErrnoException) =>
              resolve({ status: 0, code: e.code, reused: req.reusedSocket }),
            );
          },
        );
        req.on('error', (e: NodeJS.ErrnoException) => resolve({ status: 0, code: e.code, reused: req.reusedSocket }));
        req.end(wav);
      });
    const keepAlive = (async () => {
      const seen: { status: number; type?: string; reused: boolean; code?: string }[] = [];
      for (;;) {
        const r = await post();
        if (r.code === 'ECONNREFUSED') return seen;
        seen.push(r);
        await new Promise((r) => setTimeout(r, 100));
      }
    })();

    await new Promise((r) => setTimeout(r, 300));
    const t0 = performance.now();
    child.kill('SIGTERM');
    const exit = await exited;

    const statuses = (await Promise.all(queued)).map((q) => q.status);
    console.log(
      `shutdown: exit ${exit.code} after ${Math.round(exit.at - t0)} ms (drain_timeout_ms ${DRAIN_MS}); queued requests: ${statuses.filter((c) => c === 200).length} served, ${statuses.filter((c) => c === 503).length} got 503`,
    );
    expect(exit.code).toBe(0);
    expect(exit.at - t0).toBeLessThan(DRAIN_MS + 1000);
    for (const s of streams) {
      expect(await s.closed).toBe(1001);
      expect(s.events.at(-1)).toMatchObject({ type: 'done' });
      expect(s.events.some((e) => e.type === 'speech_start')).toBe(true);
    }
    for (const q of await Promise.all(queued)) {
      expect([200, 503], JSON.stringify(q.body)).toContain(q.status);
      if (q.status === 503) expect(q.body.error.type).toBe('shutting_down');
    }
    const seen = await keepAlive;
    // Only the last attempt before the refusals may have been reset, on a new connection.
    const last = seen.at(-1);
    if (last?.code === 'ECONNRESET' && !last.reused) seen.pop();
    for (const r of seen) {
      expect([200, 503], JSON.stringify(r)).toContain(r.status);
      if (r.status === 503) expect(r.type).toBe('shutting_down');
    }
    expect(seen.some((r) => r.type === 'shutting_down')).toBe(true);
  });
});
