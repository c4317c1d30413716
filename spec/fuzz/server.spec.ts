/**
 * Fuzzing through a real server on loopback (HTTP and WebSocket), for the end-to-end invariants:
 * every input ends in a result or a named 4xx error (`{error:{type,message}}` with the type's
 * status), never a 500, a dropped connection or a hang (a per-input time budget), and every model's
 * lease and queue counts return to zero (`GET /v1/models`). The catalog models (`silero-vad`,
 * `hey-jarvis`) run for real in slot-host processes; models registered by fuzzed
 * `POST /v1/models/load` bodies get fake in-process slots (spec/fuzz/fakes.ts), so a load costs
 * nothing. A failure prints its seed: `FC_SEED=<seed> npx vitest run spec/fuzz/server.spec.ts -t '<name>'`.
 */
import fc from 'fast-check';
import { pack, unpack } from 'msgpackr';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import WebSocket from 'ws';
import { defaultCatalog, ServerConfig } from '../../runtime/config.js';
import { ERRORS, VoxError, type ErrorCode } from '../../runtime/errors.js';
import { createLoader, WeightBundles, type ModelLoader } from '../../runtime/loader.js';
import { SUBPROTOCOLS } from '../../runtime/wire.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { fakeLoader } from './fakes.js';
import {
  base64Wav,
  edgeInt,
  fuzz,
  jsonBodyArb,
  junkValue,
  optionsArb,
  queryArb,
  queryValue,
  report,
  sometimes,
  wavArb,
} from './gen.js';

let server: VoxServer;
const catalog = defaultCatalog().filter((m) => m.id === 'silero-vad' || m.id === 'hey-jarvis');
const real = createLoader(new WeightBundles());
const loader: ModelLoader = (config) =>
  catalog.some((m) => m.id === config.id && m.path === config.path) ? real(config) : fakeLoader(config);

beforeAll(async () => {
  const config = ServerConfig.parse({
    log_level: 'silent',
    port: 0,
    busy_timeout_ms: 5000,
    management: { enabled: true },
    limits: { max_body_bytes: 1024 * 1024, heartbeat_ms: 0 },
  });
  server = await startServer(config, { loader, catalog });
  // Load the real models once, before the clock of any input starts.
  for (const m of catalog)
    await fetch(`${server.url}/v1/models/load`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ id: m.id }),
    });
});
afterAll(async () => {
  report('server');
  await server?.close();
});

/** Checks an HTTP answer: 2xx, or a 4xx whose body is `{error:{type,message}}` with the type's status. */
function checkAnswer(status: number, text: string, what: string): boolean {
  if (status < 300) return true;
  let body: { error?: { type?: string; code?: string; message?: unknown } };
  try {
    body = JSON.parse(text);
  } catch {
    throw new Error(`${what}: ${status} with a body that is not JSON: ${text.slice(0, 200)}`);
  }
  const code = body.error?.code;
  const known = code !== undefined && code in ERRORS ? new VoxError(code as ErrorCode, '') : null;
  if (
    status >= 500 ||
    !known ||
    known.status !== status ||
    known.type !== body.error?.type ||
    typeof body.error?.message !== 'string'
  )
    throw new Error(`${what}: ${status} ${text.slice(0, 300)}`);
  return false;
}

/** Waits (up to 2 s) until no model holds a lease or has a request queued, by `GET /v1/models`. */
async function leasesReturn(what: string): Promise<void> {
  let held: { id: string; active_leases: number; queued_requests: number }[] = [];
  for (let i = 0; i < 100; i++) {
    const { models } = (await (await fetch(`${server.url}/v1/models`)).json()) as { models: typeof held };
    held = models.filter((m) => m.active_leases || m.queued_requests);
    if (!held.length) return;
    await new Promise((r) => setTimeout(r, 20));
  }
  throw new Error(`lease left held after ${what}: ${JSON.stringify(held)}`);
}

async function post(path: string, type: string, body: Uint8Array | string): Promise<{ status: number; text: string }> {
  const res = await fetch(`${server.url}${path}`, {
    method: 'POST',
    headers: type ? { 'content-type': type } : {},
    body: typeof body === 'string' ? body : new Uint8Array(body),
  });
  return { status: res.status, text: await res.text() };
}

const model = fc.oneof(
  { weight: 4, arbitrary: fc.constant('silero-vad') },
  { weight: 1, arbitrary: fc.constantFrom('hey-jarvis', 'nope', '') },
);

describe('fuzz through the server: HTTP', () => {
  it('POST /v1/tasks/run with a WAV body and query parameters', async () => {
    const query = fc.oneof(
      {
        weight: 3,
        arbitrary: fc
          .tuple(model, sometimes(fc.nat(5000)))
          .map(([m, t]) => `model=${m}${t === null ? '' : `&busy_timeout_ms=${t}`}`),
      },
      {
        weight: 1,
        arbitrary: queryArb({
          model,
          busy_timeout_ms: fc.oneof(fc.constantFrom('0', '100', '-1', '1.5'), edgeInt.map(String)),
        }),
      },
    );
    const type = fc.constantFrom(
      'audio/wav',
      'audio/wav',
      'audio/wav',
      'audio/x-wav',
      'application/octet-stream',
      'text/plain',
      '',
    );
    await fuzz(
      'http',
      fc.tuple(query, type, wavArb),
      500,
      5000,
      async ([q, t, wav]) => {
        const r = await post(`/v1/tasks/run?${q}`, t, wav);
        const ok = checkAnswer(
          r.status,
          r.text,
          `run?${q} (${t}, ${wav.length} bytes: ${wav.subarray(0, 64).toString('hex')})`,
        );
        await leasesReturn(`run?${q}`);
        return ok;
      },
      0.02,
    );
  });

  it('POST /v1/tasks/run and /v1/tasks/batch with JSON bodies', async () => {
    const run = jsonBodyArb(
      fc.record(
        { model, audio: base64Wav, busy_timeout_ms: fc.nat(1000), options: optionsArb },
        { requiredKeys: ['model', 'audio'] },
      ),
    );
    const batch = jsonBodyArb(
      fc.record(
        { model, files: fc.array(base64Wav, { maxLength: 3 }), busy_timeout_ms: fc.nat(1000), options: optionsArb },
        { requiredKeys: ['model', 'files'] },
      ),
    );
    await fuzz(
      'http',
      fc.oneof(
        run.map((b) => ['run', b] as const),
        batch.map((b) => ['batch', b] as const),
      ),
      400,
      5000,
      async ([route, body]) => {
        const r = await post(`/v1/tasks/${route}`, 'application/json', body);
        const ok = checkAnswer(r.status, r.text, `${route} ${body.slice(0, 300)}`);
        if (ok && route === 'batch') {
          // Server-sent events: per-file errors are named 4xx errors, and the stream ends with `done`.
          expect(r.text, body.slice(0, 300)).toContain('event: done');
          for (const m of r.text.matchAll(/event: error\ndata: (.*)\n/g))
            expect(JSON.parse(m[1]).error.type, body.slice(0, 300)).toBe('invalid_request_error');
        }
        await leasesReturn(`${route} ${body.slice(0, 100)}`);
        return ok;
      },
      0.01,
    );
  });

  it('management: load, reconfigure, unload, unload_many with JSON bodies', async () => {
    const ids = fc.constantFrom('fz-a', 'fz-b', 'nope', '');
    const load = jsonBodyArb(
      fc.record(
        {
          id: ids,
          task: fc.constantFrom('vad', 'vad', 'wakeword'),
          path: fc.constantFrom('/fake/m.onnx', '/fake/n.onnx'),
          slots: fc.integer({ min: 1, max: 3 }),
          max_streams: fc.nat(8),
          busy_timeout_ms: fc.nat(1000),
          options: optionsArb,
        },
        { requiredKeys: ['id', 'task', 'path'] },
      ),
    );
    const unload = jsonBodyArb(
      fc.record({ id: ids, force: fc.oneof(fc.boolean(), junkValue) }, { requiredKeys: ['id'] }),
    );
    const many = jsonBodyArb(fc.record({ ids: fc.oneof(fc.array(ids, { maxLength: 4 }), junkValue) }));
    const op = fc.oneof(
      load.map((b) => ['load', b] as const),
      unload.map((b) => ['unload', b] as const),
      many.map((b) => ['unload_many', b] as const),
    );
    await fuzz(
      'http',
      op,
      300,
      5000,
      async ([route, body]) => {
        const r = await post(`/v1/models/${route}`, 'application/json', body);
        const ok = checkAnswer(r.status, r.text, `${route} ${body}`);
        await leasesReturn(`${route} ${body}`);
        return ok;
      },
      0.02,
    );
  });

  it('GET /v1/models/{id} and unknown routes', async () => {
    const path = fc.oneof(
      fc.string({ maxLength: 20 }).map((s) => `/v1/models/${encodeURIComponent(s)}`),
      fc.constantFrom(
        '/v1/models/%',
        '/v1/models/%E0%A4%A',
        '/v1/models/silero-vad',
        '/v1/models//',
        '/v1/tasks/run',
        '/v1/../health',
        '/v1/stream',
      ),
      fc.string({ maxLength: 12 }).map((s) => `/${encodeURIComponent(s)}`),
    );
    await fuzz(
      'http',
      fc.tuple(fc.constantFrom('GET', 'POST', 'PUT', 'DELETE'), path),
      300,
      5000,
      async ([method, p]) => {
        const res = await fetch(`${server.url}${p}`, {
          method,
          headers: method === 'GET' ? {} : { 'content-type': 'application/json' },
          body: method === 'GET' ? undefined : '{}',
        });
        const text = method === 'GET' && p.startsWith('/debug') ? '' : await res.text();
        return checkAnswer(res.status, text, `${method} ${p}`);
      },
      0.01,
    );
  });
});

/** One WebSocket client message (see the in-process suite for the full mix). */
const wsMessage = fc.oneof(
  {
    weight: 5,
    arbitrary: fc.uint8Array({ minLength: 1, maxLength: 3200 }).map((b) => ({ text: false, data: Buffer.from(b) })),
  },
  { weight: 2, arbitrary: fc.constant({ text: true, data: '{"type":"end"}' }) },
  {
    weight: 2,
    arbitrary: fc
      .oneof(
        fc.jsonValue({ maxDepth: 4 }).map((v) => JSON.stringify(v) ?? ''),
        fc.record({ type: junkValue }).map((v) => JSON.stringify(v)),
        fc.constantFrom('{"type":"END"}', '{"type":"end"', ''),
      )
      .map((data) => ({ text: true, data })),
  },
  { weight: 1, arbitrary: fc.jsonValue({ maxDepth: 3 }).map((v) => ({ text: false, data: pack(v) })) },
);

describe('fuzz through the server: WebSocket', () => {
  it('GET /v1/stream: query strings and message scripts, JSON and msgpack subprotocols', async () => {
    const query = fc.oneof(
      {
        weight: 3,
        arbitrary: fc
          .record({
            model: fc.constantFrom('silero-vad', 'silero-vad', 'hey-jarvis'),
            sample_rate: fc.constantFrom('16000', '16000', '8000', '22050'),
            encoding: fc.constantFrom('s16le', 'f32le'),
            channels: fc.constantFrom('1', '2'),
          })
          .map((q) => new URLSearchParams(q).toString()),
      },
      {
        weight: 1,
        arbitrary: queryArb({
          model,
          sample_rate: queryValue,
          encoding: fc.constantFrom('s16le', 'f32le', 'u8'),
          channels: queryValue,
          busy_timeout_ms: queryValue,
        }),
      },
    );
    const session = fc.record({
      query,
      protocol: fc.constantFrom(...SUBPROTOCOLS, undefined),
      messages: fc.array(wsMessage, { maxLength: 10 }),
      leave: sometimes(fc.constant(true), 6),
    });
    await fuzz(
      'ws',
      session,
      200,
      8000,
      async (s) => {
        const ws = new WebSocket(
          `${server.url.replace('http', 'ws')}/v1/stream?${s.query.replace(/#/g, '%23')}`,
          s.protocol,
        );
        const events: { type: string; error?: { type: string; code: string } }[] = [];
        const what = (): string => JSON.stringify({ query: s.query, protocol: s.protocol, events }).slice(0, 600);
        if (s.protocol === undefined) expect(ws.protocol).toBe('');
        let ended = false;
        const closed = new Promise<{ code: number; refused?: number }>((resolve) => {
          ws.on('unexpected-response', (_req, res) => {
            // A refused handshake must be a named 4xx.
            let text = '';
            res
              .on('data', (c: Buffer) => (text += c))
              .on('end', () =>
                resolve({
                  code: 0,
                  refused: checkAnswer(res.statusCode ?? 0, text, `stream ${what()}`) ? 200 : res.statusCode,
                }),
              );
          });
          ws.on('error', () => {});
          ws.on('close', (code) => resolve({ code }));
        });
        ws.on('message', (data: Buffer, binary: boolean) =>
          events.push(binary ? unpack(data) : JSON.parse(data.toString())),
        );
        ws.on('open', async () => {
          for (const m of s.messages) {
            if (ws.readyState !== ws.OPEN) return;
            ws.send(m.data, { binary: !m.text });
            if (m.text && m.data === '{"type":"end"}') ended = true;
          }
          if (s.leave || !ended) ws.close(1000);
        });
        const { code, refused } = await closed;
        if (refused) return false;
        for (const e of events)
          if (
            e.type === 'error' &&
            e.error &&
            (!(e.error.code in ERRORS) || new VoxError(e.error.code as ErrorCode, '').status >= 500)
          )
            throw new Error(`stream: server error ${what()}`);
        if (![1000, 1005, 1008].includes(code)) throw new Error(`stream closed ${code}: ${what()}`);
        await leasesReturn(`stream ${what()}`);
        return events.some((e) => e.type === 'done');
      },
      0.05,
    );
  });
});
