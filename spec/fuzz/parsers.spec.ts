/**
 * Fuzzing in process: the functions behind the routes, fed structure-aware inputs (spec/fuzz/gen.ts).
 * Every input must end in a result that satisfies the route's contract or in a VoxError with a
 * 4xx status: no other throw (which the server would answer 500), no input over its time budget,
 * no lease left held. The input count is printed at the end (and summed by `npm test`).
 * A failure prints its seed: `FC_SEED=<seed> npx vitest run spec/fuzz/parsers.spec.ts -t '<name>'`.
 */
import type { IncomingMessage } from 'node:http';
import { existsSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import fc from 'fast-check';
import { pack, unpack } from 'msgpackr';
import { afterAll, describe, expect, it, onTestFinished } from 'vitest';
import { validateModelConfig } from '../../actors/model.js';
import { createStreamSocket, parseStreamParams } from '../../actors/stream.js';
import { Supervisor } from '../../actors/supervisor.js';
import {
  decodeWav,
  MAX_CHANNELS,
  MAX_SAMPLE_RATE,
  MIN_SAMPLE_RATE,
  PcmStreamDecoder,
} from '../../runtime/audio/audio.js';
import { loadServerConfig, ModelConfig, parseTaskOptions, ServerConfig } from '../../runtime/config.js';
import { createTaskSession } from '../../runtime/tasks/index.js';
import { parseBatchRequest, parseRunRequest } from '../../transport/http.js';
import { bindStream } from '../../transport/stream.js';
import { SUBPROTOCOLS, type Subprotocol } from '../../runtime/wire.js';
import { FakeWs, fakeLoader } from './fakes.js';
import {
  base64Wav,
  edgeInt,
  expect4xx,
  fuzz,
  jsonBodyArb,
  junkValue,
  optionsArb,
  queryArb,
  report,
  sometimes,
  wavArb,
} from './gen.js';

afterAll(() => report('in-process'));

const VAD = ModelConfig.parse({ id: 'vad', task: 'vad', path: '/fake/vad.onnx' });
const WAKE = ModelConfig.parse({ id: 'wake', task: 'wakeword', path: '/fake/head.onnx' });

/** Decodes `bytes` and checks the result: mono float samples in [-1, 1] at an accepted rate. */
function checkDecoded(bytes: Uint8Array, what: string): boolean {
  let audio;
  try {
    audio = decodeWav(bytes);
  } catch (e) {
    expect4xx(e, what);
    return false;
  }
  expect(audio.sampleRate).toBeGreaterThanOrEqual(MIN_SAMPLE_RATE);
  expect(audio.sampleRate).toBeLessThanOrEqual(MAX_SAMPLE_RATE);
  expect(audio.samples.length).toBeGreaterThan(0);
  for (const v of audio.samples) if (!(v >= -1 && v <= 1)) throw new Error(`${what}: sample ${v} outside [-1, 1]`);
  return true;
}

/** Waits (up to 1 s) until no model holds a lease or has a request queued. */
async function leasesReturn(sup: Supervisor, what: string): Promise<void> {
  const held = () => sup.statuses().filter((s) => s.active_leases || s.queued_requests);
  for (let i = 0; i < 200 && held().length; i++) await new Promise((r) => setTimeout(r, 5));
  for (const s of held())
    throw new Error(`lease left held (${s.id}: ${s.active_leases} leases, ${s.queued_requests} queued): ${what}`);
}

/** Runs `f`; a throw must be a 4xx VoxError. Returns the result or undefined. */
function settle<T>(f: () => T, what: string): T | undefined {
  try {
    return f();
  } catch (e) {
    expect4xx(e, what);
    return undefined;
  }
}

describe('fuzz: WAV headers and chunks', () => {
  it('decodeWav: every file decodes to samples in [-1, 1] or is a 400', async () => {
    await fuzz('wav', wavArb, 40_000, 500, (wav) => checkDecoded(wav, 'decodeWav'));
  });
});

const streamQuery = queryArb({
  model: fc.constantFrom('vad', 'silero-vad', 'wake', 'nope', 'a'.repeat(300)),
  sample_rate: fc.oneof(fc.constantFrom(8000, 16000, 44100, 192000, 7999, 192001).map(String), edgeInt.map(String)),
  encoding: fc.constantFrom('s16le', 'f32le', 'S16LE', 'u8', 's16le '),
  channels: fc.oneof(fc.integer({ min: 0, max: 40 }).map(String), edgeInt.map(String)),
  busy_timeout_ms: fc.oneof(fc.constantFrom('0', '100', '2147483647', '2147483648', '-5'), edgeInt.map(String)),
});

describe('fuzz: query strings', () => {
  it('parseStreamParams (/v1/stream): parameters in range or a 400 naming one', async () => {
    await fuzz('query', streamQuery, 20_000, 500, (q) => {
      const p = settle(() => parseStreamParams(new URL(`/v1/stream?${q}`, 'http://localhost')), q);
      if (!p) return false;
      expect(p.model).toBeTruthy();
      expect(p.sampleRate).toBeGreaterThanOrEqual(MIN_SAMPLE_RATE);
      expect(p.sampleRate).toBeLessThanOrEqual(MAX_SAMPLE_RATE);
      expect(p.channels).toBeGreaterThanOrEqual(1);
      expect(p.channels).toBeLessThanOrEqual(MAX_CHANNELS);
      if (p.busyTimeoutMs !== undefined) expect(Number.isInteger(p.busyTimeoutMs) && p.busyTimeoutMs >= 0).toBe(true);
      return true;
    });
  });

  const runQuery = queryArb({
    model: fc.constantFrom('vad', 'wake', ''),
    busy_timeout_ms: fc.oneof(fc.constantFrom('0', '10', '-1', '1.5', '1e3'), edgeInt.map(String)),
  });
  const contentType = fc.constantFrom(
    'audio/wav',
    'audio/x-wav',
    'AUDIO/WAV; charset=binary',
    'application/octet-stream',
    'application/json',
    'text/plain',
    '',
    'audio/wav;',
    ';',
  );
  it('parseRunRequest with a WAV body (/v1/tasks/run?model=): a request whose audio and options decode, or a 400', async () => {
    await fuzz(
      'query',
      fc.tuple(runQuery, contentType, wavArb),
      8_000,
      500,
      ([q, type, wav]) => {
        const req = { headers: { 'content-type': type } } as IncomingMessage;
        const r = settle(() => parseRunRequest(req, new URL(`/v1/tasks/run?${q}`, 'http://localhost'), wav, 0), q);
        if (!r) return false;
        expect(r.model).toBeTruthy();
        return checkDecoded(r.files[0].bytes, q);
      },
      0.01,
    ); // most inputs fail several checks at once (query, content type, WAV): ~2 % pass
  });
});

const runBody = fc.record(
  {
    model: fc.constantFrom('vad', 'wake', 'nope'),
    audio: base64Wav,
    busy_timeout_ms: fc.oneof(fc.nat(1000), junkValue),
    options: optionsArb,
  },
  { requiredKeys: ['model', 'audio'] },
);
const batchBody = fc.record(
  {
    model: fc.constantFrom('vad', 'wake'),
    files: fc.array(base64Wav, { maxLength: 3 }),
    busy_timeout_ms: fc.nat(1000),
    options: optionsArb,
  },
  { requiredKeys: ['model', 'files'] },
);

/** A parsed task request's files and options must each decode and validate, or be a 400. */
function checkTask(r: { model: string; files: { bytes: Buffer }[]; options?: unknown }, what: string): boolean {
  expect(typeof r.model).toBe('string');
  let ok = true;
  for (const f of r.files) ok = checkDecoded(f.bytes, what) && ok;
  // Accepted if the options suit either task (VAD options are refused by a wake-word model).
  let suits = false;
  for (const config of [VAD, WAKE])
    suits =
      settle(
        () =>
          createTaskSession(
            config,
            { vadVersion: 'v5', heads: [{ window: 16, labels: ['x'] }], initialEmbeddings: new Float32Array(16 * 96) },
            r.options,
            true,
          ),
        `${what} options`,
      ) !== undefined || suits;
  return ok && suits;
}

/** A field's value: mostly valid, now and then junk of any kind. */
const field = <T>(valid: fc.Arbitrary<T>): fc.Arbitrary<unknown> =>
  fc.oneof({ weight: 12, arbitrary: valid }, { weight: 1, arbitrary: junkValue });

/** A `POST /v1/models/load` body (also a config file's `models[]` entry) with ids from `ids`. */
const modelBodyWith = (ids: fc.Arbitrary<string>) =>
  fc.record(
    {
      id: ids,
      task: field(fc.constantFrom('vad', 'wakeword', 'vad')),
      path: field(fc.constantFrom('/fake/model.onnx', 'model.onnx', '../../etc/passwd')),
      slots: field(fc.integer({ min: 1, max: 16 })),
      max_streams: field(fc.constantFrom(1, 4, 256, 65536)),
      busy_timeout_ms: field(fc.nat(2000)),
      keep_alive_ms: field(fc.nat(2000)),
      isolation: field(fc.constantFrom('process', 'thread')),
      job_timeout_ms: field(fc.nat(2000)),
      lazy: field(fc.boolean()),
      max_batch_size: field(fc.integer({ min: 1, max: 512 })),
      max_batch_delay_ms: field(fc.integer({ min: 0, max: 1000 })),
      options: optionsArb,
      melspectrogram_path: field(fc.constant('/fake/mel.onnx')),
      embedding_path: field(fc.constant('/fake/emb.onnx')),
    },
    { requiredKeys: ['id', 'task', 'path'] },
  );
const modelBody = modelBodyWith(
  fc.oneof(
    { weight: 4, arbitrary: fc.constantFrom('m1', 'm-2.x', 'silero-vad') },
    { weight: 1, arbitrary: fc.constantFrom('', '.hidden', 'a/b', 'x'.repeat(129)) },
    { weight: 1, arbitrary: fc.string({ maxLength: 12 }) },
  ),
);

/** A validated model config must be one a model entry can run: its options valid for its task. */
function checkModelConfig(c: ModelConfig): void {
  expect(c.slots).toBeGreaterThanOrEqual(1);
  expect(c.max_streams).toBeGreaterThanOrEqual(1);
  parseTaskOptions(c.task, c.options);
}

describe('fuzz: JSON request bodies', () => {
  it('run (JSON): a request whose audio and options decode, or a 400', async () => {
    const req = { headers: { 'content-type': 'application/json' } } as IncomingMessage;
    await fuzz(
      'json',
      jsonBodyArb(runBody),
      6_000,
      500,
      (body) => {
        const r = settle(
          () => parseRunRequest(req, new URL('http://localhost/v1/tasks/run'), Buffer.from(body), 0),
          body,
        );
        return r ? checkTask(r, body) : false;
      },
      0.005,
    );
  });

  it('batch: a request of 1-256 files that decode, or a 400', async () => {
    await fuzz(
      'json',
      jsonBodyArb(batchBody),
      3_000,
      500,
      (body) => {
        const r = settle(
          () => parseBatchRequest(new URL('http://localhost/v1/tasks/batch'), Buffer.from(body), 0),
          body,
        );
        if (!r) return false;
        expect(r.files.length).toBeGreaterThanOrEqual(1);
        return checkTask(r, body);
      },
      0.005,
    );
  });

  it('load and reconfigure: a config a model entry can run, or a 400', async () => {
    await fuzz('json', fc.tuple(jsonBodyArb(modelBody), fc.boolean()), 10_000, 500, ([body, reconfigure]) => {
      let json: unknown;
      try {
        json = JSON.parse(body);
      } catch {
        return false; // the route answers 400 before validation (parseJsonObject, covered through the server)
      }
      if (!json || typeof json !== 'object' || Array.isArray(json)) return false;
      // A reconfiguration validates the committed config with the body's fields on top (ModelEntry.configure).
      const raw = reconfigure ? { ...VAD, ...(json as object), id: VAD.id } : json;
      const c = settle(() => validateModelConfig(raw), body);
      if (c) checkModelConfig(c);
      return c !== undefined;
    });
  });

  it('load, reconfigure and unload through a supervisor: a result or a 4xx, and no lease left held', async () => {
    const sup = new Supervisor(ServerConfig.parse({ log_level: 'silent', busy_timeout_ms: 1000 }), {
      loader: fakeLoader,
      catalog: [VAD],
    });
    await sup.start();
    try {
      const op = fc.tuple(
        fc.constantFrom('load', 'load', 'unload', 'force'),
        jsonBodyArb(modelBodyWith(fc.constantFrom('vad', 'm1', 'm2'))),
      );
      await fuzz('json', op, 1_500, 2000, async ([kind, text]) => {
        let body: Record<string, unknown>;
        try {
          body = JSON.parse(text);
        } catch {
          return false;
        }
        if (!body || typeof body !== 'object' || Array.isArray(body)) return false;
        let ok = true;
        try {
          if (kind === 'load') await sup.load(body, 1000);
          else if (typeof body.id === 'string')
            await (kind === 'force' ? sup.require(body.id).forceUnload() : sup.require(body.id).unload(1000));
        } catch (e) {
          expect4xx(e, `${kind} ${text}`);
          ok = false;
        }
        for (const s of sup.statuses()) {
          if (s.active_leases || s.queued_requests)
            throw new Error(`${kind} ${text}: ${s.id} holds ${s.active_leases} leases, ${s.queued_requests} queued`);
          if (s.last_error) throw new Error(`${kind} ${text}: ${s.id} failed: ${s.last_error}`);
        }
        return ok;
      });
    } finally {
      await sup.stop(0);
    }
  });
});

const configArb = fc.record(
  {
    host: field(fc.constantFrom('127.0.0.1', 'localhost', '::1', '0.0.0.0')),
    port: field(fc.constantFrom(0, 8080, 65535)),
    busy_timeout_ms: field(fc.nat()),
    drain_timeout_ms: field(fc.nat()),
    max_loaded_models: field(fc.nat(4)),
    min_free_memory_mb: field(fc.nat(100)),
    idle_unload_ms: field(fc.nat()),
    isolation: field(fc.constantFrom('process', 'thread')),
    job_timeout_ms: field(fc.nat()),
    log_level: field(fc.constantFrom('info', 'silent', 'trace')),
    models_root: field(fc.constantFrom('/models', 'models')),
    management: field(
      fc.record({ enabled: field(fc.boolean()), token: field(fc.constant('t0k3n')) }, { requiredKeys: [] }),
    ),
    debug: field(
      fc.record(
        { inspect: field(fc.boolean()), stately_url: field(fc.constant('ws://localhost:8090')) },
        { requiredKeys: [] },
      ),
    ),
    limits: field(
      fc.record(
        Object.fromEntries(
          [
            'max_body_bytes',
            'max_header_bytes',
            'headers_timeout_ms',
            'max_ws_connections',
            'ws_max_frame_bytes',
            'ws_max_buffered_bytes',
            'idle_ms',
            'total_ms',
            'send_timeout_ms',
            'heartbeat_ms',
          ].map((k) => [k, field(fc.integer({ min: 1024, max: 2 ** 31 - 1 }))]),
        ),
        { requiredKeys: [] },
      ),
    ),
    // Ids mostly unique (a duplicate is an error), models mostly valid.
    models: field(
      fc.oneof(
        {
          weight: 6,
          arbitrary: fc.uniqueArray(modelBodyWith(fc.constantFrom('a', 'b', 'silero-vad')), {
            maxLength: 3,
            selector: (m) => m.id,
          }),
        },
        { weight: 1, arbitrary: fc.array(modelBodyWith(fc.constantFrom('a', 'b')), { maxLength: 3 }) },
      ),
    ),
  },
  { requiredKeys: ['models'] },
);

describe('fuzz: config files', () => {
  it('loadServerConfig: a config whose every model can run, or a 400 naming the field', async () => {
    // /dev/shm where there is one: a write to /tmp costs milliseconds on some file systems.
    const dir = mkdtempSync(join(existsSync('/dev/shm') ? '/dev/shm' : tmpdir(), 'voxserve-fuzz-'));
    onTestFinished(() => rmSync(dir, { recursive: true }));
    const file = join(dir, 'config.json');
    // An unknown top-level key now and then.
    const text = fc.oneof(
      { weight: 8, arbitrary: configArb.map((c) => JSON.stringify(c)) },
      {
        weight: 1,
        arbitrary: fc
          .tuple(configArb, fc.string({ maxLength: 8 }), junkValue)
          .map(([c, k, v]) => JSON.stringify({ ...c, [k]: v })),
      },
      { weight: 2, arbitrary: jsonBodyArb(configArb as fc.Arbitrary<Record<string, unknown>>) },
    );
    await fuzz('config', text, 6_000, 500, (t) => {
      writeFileSync(file, t);
      const c = settle(() => loadServerConfig(file), t);
      if (!c) return false;
      expect(c.port).toBeGreaterThanOrEqual(0);
      const ids = c.models.map((m) => m.id);
      if (new Set(ids).size !== ids.length)
        throw new Error(`${t}: accepted models with the same id: ${ids.join(', ')}`);
      for (const m of c.models) checkModelConfig(m);
      return true;
    });
  });
});

describe('fuzz: WebSocket binary frames and control messages', () => {
  it('PcmStreamDecoder: any split of any bytes gives one sample per whole frame, in [-1, 1]', async () => {
    const arb = fc.record({
      encoding: fc.constantFrom('s16le', 'f32le') as fc.Arbitrary<'s16le' | 'f32le'>,
      channels: fc.constantFrom(1, 2, 3, 32),
      frames: fc.array(fc.uint8Array({ maxLength: 700 }), { maxLength: 12 }),
    });
    await fuzz('ws', arb, 4_000, 500, async ({ encoding, channels, frames }) => {
      const d = await PcmStreamDecoder.create(encoding, 16000, channels);
      try {
        let out = 0;
        for (const f of frames) {
          const s = d.push(Buffer.from(f));
          for (const v of s) if (!(v >= -1 && v <= 1)) throw new Error(`sample ${v} outside [-1, 1]`);
          out += s.length;
        }
        const bytes = frames.reduce((n, f) => n + f.length, 0);
        expect(out).toBe(Math.floor(bytes / ((encoding === 's16le' ? 2 : 4) * channels)));
        return out > 0;
      } finally {
        d.close();
      }
    });
  });

  /**
   * One client message: a PCM frame, a text frame (control), a msgpack-encoded control as a binary frame, or the
   * client's close.
   */
  const message = fc.oneof(
    {
      weight: 6,
      arbitrary: fc.uint8Array({ maxLength: 4000 }).map((b) => ({ kind: 'bin' as const, data: Buffer.from(b) })),
    },
    { weight: 2, arbitrary: fc.constant({ kind: 'text' as const, data: '{"type":"end"}' }) },
    {
      weight: 3,
      arbitrary: fc
        .oneof(
          fc.constantFrom(
            '{"type":"END"}',
            '{"type":"end","x":1}',
            ' { "type" : "end" } ',
            '{"type":["end"]}',
            '{"type":null}',
            '{}',
            '[]',
            'null',
            '1e999',
            '"end"',
            'end',
            '',
            '{"type":"start"}',
            '{"type":"end"',
            '\u0000',
            '{"type":"end"}{"type":"end"}',
            '{"__proto__":{"type":"end"}}',
          ),
          fc.jsonValue({ maxDepth: 5 }).map((v) => JSON.stringify(v) ?? ''),
          fc.record({ type: junkValue, data: junkValue }).map((v) => JSON.stringify(v)),
          fc.string({ maxLength: 30 }),
        )
        .map((data) => ({ kind: 'text' as const, data })),
    },
    {
      weight: 1,
      arbitrary: fc
        .oneof(fc.constant({ type: 'end' }), fc.jsonValue({ maxDepth: 3 }))
        .map((v) => ({ kind: 'bin' as const, data: pack(v) })),
    },
    { weight: 1, arbitrary: fc.constant({ kind: 'wait' as const, data: '' }) },
  );
  const session = fc.record({
    query: fc.oneof(
      {
        weight: 4,
        arbitrary: fc
          .record({
            model: fc.constantFrom('vad', 'vad', 'vad', 'nope'),
            sample_rate: fc.constantFrom('16000', '16000', '8000', '44100'),
            encoding: fc.constantFrom('s16le', 'f32le'),
            channels: fc.constantFrom('1', '1', '2'),
          })
          .map((q) => new URLSearchParams(q).toString()),
      },
      { weight: 1, arbitrary: streamQuery },
    ),
    protocol: fc.constantFrom(...SUBPROTOCOLS),
    messages: fc.array(message, { maxLength: 12 }),
    clientClose: sometimes(fc.constantFrom(1000, 1001, 1006), 5),
  });

  it('stream sessions (socket actor + transport binding, fake slots): done or a named error, one done, nothing after end, lease released', async () => {
    const sup = new Supervisor(ServerConfig.parse({ log_level: 'silent' }), { loader: fakeLoader, catalog: [VAD] });
    await sup.start();
    const limits = ServerConfig.parse({}).limits;
    try {
      await fuzz('ws', session, 800, 3000, async (s) => {
        const ws = new FakeWs();
        const handle = createStreamSocket({ url: `/v1/stream?${s.query}`, limits, registry: sup });
        const link = bindStream(ws as never, handle, s.protocol as Subprotocol, limits);
        let params: ReturnType<typeof parseStreamParams> | null = null;
        try {
          params = parseStreamParams(new URL(`/v1/stream?${s.query}`, 'http://localhost'));
          if (!sup.getOrRegister(params.model)) params = null;
        } catch {
          params = null;
        }
        let ended = false;
        let bytesBeforeEnd = 0;
        let badBeforeEnd = 0;
        let bad = 0;
        for (const m of s.messages) {
          if (ws.readyState !== 1) break;
          if (m.kind === 'wait') await new Promise((r) => setImmediate(r));
          else if (m.kind === 'bin') {
            ws.emit('message', m.data, true);
            if (!ended) bytesBeforeEnd += m.data.length;
          } else {
            ws.emit('message', Buffer.from(m.data), false);
            const isEnd =
              /^\s*\{\s*"type"\s*:\s*"end"\s*\}\s*$/.test(m.data) ||
              (() => {
                try {
                  return JSON.parse(m.data)?.type === 'end';
                } catch {
                  return false;
                }
              })();
            if (isEnd) ended = true;
            else {
              bad++;
              if (!ended) badBeforeEnd++;
            }
          }
        }
        if (s.clientClose && ws.readyState === 1) ws.peerClose(s.clientClose);
        else if (!ended && ws.readyState === 1) ws.peerClose(1000); // a client that never ends leaves
        await link.released;
        const events = ws.sent.map((f) =>
          s.protocol === 'voxserve.v1.msgpack' ? unpack(f as Buffer) : JSON.parse(f as string),
        );
        const what = JSON.stringify({ query: s.query, events, close: ws.closedWith });
        for (const e of events)
          if (e.type === 'error' && e.error.type === 'server_error') throw new Error(`server_error: ${what}`);
        expect(ws.closedWith?.code ?? 1000, what).not.toBe(1011);
        await leasesReturn(sup, what);
        if (!params) {
          // Bad parameters or an unknown model: a named 4xx error, then close 1008 (unless the client left first).
          if (ws.closedWith) {
            expect(ws.closedWith.code, what).toBe(1008);
            const err = events.find((e) => e.type === 'error' && e.error.type !== 'invalid_request_error');
            expect(err === undefined || err.error.type === 'not_found', what).toBe(true);
          }
          return false;
        }
        const dones = events.filter((e) => e.type === 'done');
        expect(dones.length, what).toBeLessThanOrEqual(1);
        const errors = events.filter((e) => e.type === 'error');
        for (const e of errors) expect(e.error.type, what).toBe('invalid_request_error');
        expect(errors.length, what).toBeLessThanOrEqual(bad);
        if (ended && !s.clientClose) {
          expect(errors.length, what).toBeGreaterThanOrEqual(badBeforeEnd);
          expect(events.find((e) => e.type !== 'error')?.type, what).toBe('ready');
          expect(events.at(-1)?.type, what).toBe('done');
          expect(ws.closedWith?.code, what).toBe(1000);
          if (params.sampleRate === 16000) {
            // Audio after `end` is dropped: processed_ms counts whole frames sent before it.
            const frames = Math.floor(bytesBeforeEnd / ((params.encoding === 's16le' ? 2 : 4) * params.channels));
            expect(dones[0].processed_ms, what).toBe(Math.round(frames / 16));
          }
        }
        return dones.length === 1;
      });
    } finally {
      await sup.stop(0);
    }
  });
});
