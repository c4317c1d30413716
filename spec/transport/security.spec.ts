/**
 * Security and limits on a real server on loopback (issue 12): the Host check, the Origin
 * policy and CORS, 415 for non-JSON bodies, the default models_root, API keys, max_queued, and
 * body limits that agree with the documented longest file. The reproductions are here
 * with the answers they must get.
 */
import { execFile, execFileSync } from 'node:child_process';
import { copyFileSync, mkdirSync, mkdtempSync, symlinkSync, writeFileSync } from 'node:fs';
import { createServer, request, type IncomingHttpHeaders, type IncomingMessage, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { afterAll, beforeAll, describe, expect, it, onTestFinished } from 'vitest';
import { chromium } from 'playwright-core';
import WebSocket, { WebSocketServer } from 'ws';
import { VoxClient as BrowserClient, type WebSocketConstructor } from '../../client/index.js';
import { VoxClient } from '../../client/node.js';
import { defaultCatalog, loadServerConfig, ServerConfig } from '../../runtime/config.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { spawnServer } from '../../tools/spawn-server.js';
import { fixture, fixturePath, until, WaveFile } from '../helpers.js';

const silero = defaultCatalog().find((m) => m.id === 'silero-vad')!.path;
const wav = fixture('Front_Left.wav');
const servers: VoxServer[] = [];
afterAll(async () => {
  await Promise.all(servers.map((s) => s.close()));
});
async function serve(config: Record<string, unknown>): Promise<VoxServer> {
  const s = await startServer(ServerConfig.parse({ log_level: 'silent', port: 0, ...config }));
  servers.push(s);
  return s;
}

interface Answer {
  status: number;
  headers: IncomingHttpHeaders;
  body: any;
}
/** One HTTP request with any headers (fetch cannot set Host). */
function call(
  url: string,
  opts: { method?: string; headers?: Record<string, string>; body?: string | Buffer } = {},
): Promise<Answer> {
  return new Promise((done, fail) => {
    const req = request(url, { method: opts.method ?? 'GET', headers: opts.headers }, (res) => {
      let text = '';
      res.on('data', (c: Buffer) => (text += c.toString('utf8')));
      res.on('end', () =>
        done({
          status: res.statusCode!,
          headers: res.headers,
          body: res.headers['content-type'] === 'application/json' ? JSON.parse(text) : text,
        }),
      );
    });
    req.on('error', fail);
    req.end(opts.body);
  });
}
const json = { 'content-type': 'application/json' };
const runWav = (s: VoxServer, headers: Record<string, string> = {}, model = 'silero-vad'): Promise<Answer> =>
  call(`${s.url}/v1/tasks/run?model=${model}`, {
    method: 'POST',
    headers: { 'content-type': 'audio/wav', ...headers },
    body: wav,
  });

/** Opens a stream: either the handshake is refused (status and JSON body) or the first event arrives. */
function stream(
  s: VoxServer,
  opts: { query?: string; protocols?: string[]; headers?: Record<string, string> } = {},
): Promise<{
  status?: number;
  body?: any;
  ws?: WebSocket;
  first?: any;
  closed?: Promise<{ code: number; reason: string }>;
}> {
  return new Promise((done, fail) => {
    const ws = new WebSocket(
      `${s.url.replace('http', 'ws')}/v1/stream?${opts.query ?? 'model=silero-vad'}`,
      opts.protocols ?? [],
      { headers: opts.headers },
    );
    const closed = new Promise<{ code: number; reason: string }>((r) =>
      ws.on('close', (code, reason) => r({ code, reason: reason.toString() })),
    );
    ws.on('unexpected-response', (_req, res) => {
      let text = '';
      res.on('data', (c: Buffer) => (text += c.toString('utf8')));
      res.on('end', () => done({ status: res.statusCode, body: JSON.parse(text) }));
    });
    ws.on('error', (e) => (e.message.startsWith('Unexpected server response') ? undefined : fail(e)));
    ws.once('message', (d) => done({ ws, first: JSON.parse(d.toString()), closed }));
  });
}
const loaded = async (s: VoxServer, id = 'silero-vad'): Promise<boolean> =>
  (await call(`${s.url}/v1/models/${id}`)).body.loaded;
/** `seconds` of silence, 16 kHz mono 16-bit. */
const silence = (seconds: number): Buffer => {
  const w = new WaveFile();
  w.fromScratch(1, 16000, '16', new Int16Array(16000 * seconds));
  return Buffer.from(w.toBuffer());
};
/**
 * A server that answers 413 as soon as it has a request's headers and destroys the connection once the answer is
 * written (as a proxy may).
 */
async function cutting(): Promise<{ url: string; close: () => void }> {
  const refuse = (req: IncomingMessage, res: ServerResponse): void => {
    res.writeHead(413, { 'content-type': 'application/json', connection: 'close' });
    res.end(JSON.stringify({ error: { type: 'payload_too_large', message: 'too large' } }), () => req.socket.destroy());
  };
  const early = createServer(refuse).on('checkContinue', refuse);
  await new Promise<void>((r) => early.listen(0, '127.0.0.1', r));
  return { url: `http://127.0.0.1:${(early.address() as AddressInfo).port}`, close: () => early.close() };
}
const cli = fileURLToPath(new URL('../../dist/tools/cli.js', import.meta.url));
const runCli = (args: string[]): Promise<{ code?: number; stdout: string; stderr: string }> =>
  promisify(execFile)(process.execPath, [cli, ...args]).catch((e) => e);

describe('Host check (DNS rebinding)', () => {
  let s: VoxServer;
  beforeAll(async () => {
    s = await serve({ management: { enabled: true }, allowed_hosts: ['voice.example.internal'] });
    expect((await runWav(s)).status).toBe(200); // silero-vad is loaded
  });
  const rebind = { host: 'rebind.attacker.example' };

  it('Host: rebind.attacker.example gets 403 on status, a run and unload_all, and nothing is unloaded', async () => {
    for (const r of [
      await call(`${s.url}/v1/models`, { headers: rebind }),
      await runWav(s, rebind),
      await call(`${s.url}/v1/models/unload_all`, { method: 'POST', headers: { ...rebind, ...json } }),
    ]) {
      expect(r.status).toBe(403);
      expect(r.body.error).toEqual({
        type: 'forbidden',
        code: 'host_not_allowed',
        message: expect.stringMatching(/^Host 'rebind\.attacker\.example' is not served here: add it to allowed_hosts/),
      });
    }
    expect(await loaded(s)).toBe(true);
  });

  it('a WebSocket upgrade with a foreign Host gets 403', async () => {
    const r = await stream(s, { headers: rebind });
    expect(r.status).toBe(403);
    expect(r.body.error).toMatchObject({ type: 'forbidden', code: 'host_not_allowed' });
  });

  it('serves loopback names, the configured host and allowed_hosts, with or without a port', async () => {
    const port = new URL(s.url).port;
    for (const host of [
      `localhost:${port}`,
      'LOCALHOST',
      `127.0.0.1:${port}`,
      '127.8.9.10',
      `[::1]:${port}`,
      'voice.example.internal',
      `Voice.Example.Internal:${port}`,
    ]) {
      expect((await call(`${s.url}/v1/models`, { headers: { host } })).status, host).toBe(200);
    }
    const open = await stream(s, { headers: { host: 'voice.example.internal' } });
    expect(open.first.type).toBe('ready');
    open.ws!.close();
    for (const host of ['localhost.attacker.example', '127.0.0.1.nip.io', 'example.internal', '[::2]']) {
      expect((await call(`${s.url}/v1/models`, { headers: { host } })).status, host).toBe(403);
    }
  });

  it('allowed_hosts ["*"] turns the check off', async () => {
    const any = await serve({ allowed_hosts: ['*'] });
    expect((await call(`${any.url}/v1/models`, { headers: rebind })).status).toBe(200);
  });
});

describe('Origin policy, CORS and 415', () => {
  let s: VoxServer;
  const app = 'https://app.example.com';
  const foreign = { origin: 'https://any-website.example' };
  beforeAll(async () => {
    s = await serve({ management: { enabled: true }, allowed_origins: [app] });
    expect((await runWav(s)).status).toBe(200);
  });

  it('a cross-site POST unload_all with no body (Origin: https://any-website.example) gets 403; every model stays loaded', async () => {
    const r = await call(`${s.url}/v1/models/unload_all`, { method: 'POST', headers: foreign });
    expect(r.status).toBe(403);
    expect(r.body.error).toMatchObject({
      code: 'origin_not_allowed',
      message: expect.stringMatching(
        /^Origin 'https:\/\/any-website\.example' may not call this server: add it to allowed_origins/,
      ),
    });
    expect(r.headers['access-control-allow-origin']).toBeUndefined();
    expect(await loaded(s)).toBe(true);
    // Even declared as JSON, and on every other route.
    expect(
      (await call(`${s.url}/v1/models/unload_all`, { method: 'POST', headers: { ...foreign, ...json } })).status,
    ).toBe(403);
    expect((await runWav(s, foreign)).status).toBe(403);
    expect((await call(`${s.url}/v1/models`, { headers: foreign })).status).toBe(403);
    expect((await call(`${s.url}/v1/models`, { headers: { origin: 'null' } })).status).toBe(403);
    expect(await loaded(s)).toBe(true);
  });

  it('a WebSocket from a foreign Origin gets 403; the own origin and allowed origins stream', async () => {
    const refused = await stream(s, { headers: foreign });
    expect(refused.status).toBe(403);
    expect(refused.body.error).toMatchObject({
      code: 'origin_not_allowed',
      message: expect.stringMatching(/^Origin 'https:\/\/any-website\.example' may not call/),
    });
    for (const origin of [app, s.url]) {
      const r = await stream(s, { headers: { origin } });
      expect(r.first.type, origin).toBe('ready');
      r.ws!.close();
    }
  });

  it('an allowed origin gets CORS headers, on its preflight too; a foreign preflight gets 403', async () => {
    const get = await call(`${s.url}/v1/models`, { headers: { origin: app } });
    expect(get.status).toBe(200);
    expect(get.headers).toMatchObject({
      'access-control-allow-origin': app,
      vary: 'Origin',
      'access-control-expose-headers': expect.stringContaining('retry-after'),
    });
    const preflight = {
      'access-control-request-method': 'POST',
      'access-control-request-headers': 'authorization,content-type',
    };
    const ok = await call(`${s.url}/v1/models/load`, { method: 'OPTIONS', headers: { origin: app, ...preflight } });
    expect(ok.status).toBe(204);
    expect(ok.headers).toMatchObject({
      'access-control-allow-origin': app,
      'access-control-allow-methods': 'GET, POST',
    });
    expect(ok.headers['access-control-allow-headers']).toMatch(/authorization.*content-type/);
    expect(
      (await call(`${s.url}/v1/models/load`, { method: 'OPTIONS', headers: { ...foreign, ...preflight } })).status,
    ).toBe(403);
    // The page's own origin (same Host) is always allowed.
    const own = await runWav(s, { origin: s.url });
    expect(own.status).toBe(200);
    expect(own.headers['access-control-allow-origin']).toBe(s.url);
  });

  it('a load sent as text/plain (a JSON body) gets 415 and loads nothing; so do a text/plain batch and run', async () => {
    const body = JSON.stringify({ id: 'plain', task: 'vad', path: silero, slots: 16 });
    const r = await call(`${s.url}/v1/models/load`, {
      method: 'POST',
      headers: { 'content-type': 'text/plain' },
      body,
    });
    expect(r.status).toBe(415);
    expect(r.body.error).toEqual({
      type: 'unsupported_media_type',
      code: 'unsupported_media_type',
      message: "content-type: expected application/json, got 'text/plain'",
    });
    expect((await call(`${s.url}/v1/models/plain`)).status).toBe(404);
    const batch = await call(`${s.url}/v1/tasks/batch`, {
      method: 'POST',
      headers: { 'content-type': 'text/plain' },
      body: JSON.stringify({ model: 'silero-vad', files: [wav.toString('base64')] }),
    });
    expect(batch.status).toBe(415);
    const run = await call(`${s.url}/v1/tasks/run?model=silero-vad`, {
      method: 'POST',
      headers: { 'content-type': 'text/plain' },
      body: wav,
    });
    expect(run.status).toBe(415);
    expect(run.body.error).toEqual({
      type: 'unsupported_media_type',
      code: 'unsupported_media_type',
      message:
        "content-type: expected application/json, application/msgpack (tensors), multipart/form-data (curl -F file=@x.wav) or an audio type (audio/wav, audio/mpeg, audio/ogg, audio/flac, audio/webm, application/octet-stream; with ?model=ID), got 'text/plain'",
    });
    // unload_all with no body and no Content-Type: 415 too.
    expect((await call(`${s.url}/v1/models/unload_all`, { method: 'POST' })).status).toBe(415);
    expect(await loaded(s)).toBe(true);
  });
});

describe('models_root by default', () => {
  const dir = mkdtempSync(join(tmpdir(), 'voxserve-cfg-'));
  const outside = mkdtempSync(join(tmpdir(), 'voxserve-outside-'));
  let s: VoxServer;
  beforeAll(async () => {
    mkdirSync(join(dir, 'models'));
    copyFileSync(silero, join(dir, 'models', 'mine.onnx'));
    copyFileSync(silero, join(outside, 'real.onnx'));
    symlinkSync(outside, join(dir, 'models', 'out'));
    execFileSync('mkfifo', [join(outside, 'blocks.fifo')]); // opening it would hang
    writeFileSync(
      join(dir, 'voxserve.json'),
      JSON.stringify({ port: 0, log_level: 'silent', management: { enabled: true } }),
    );
    const config = loadServerConfig(join(dir, 'voxserve.json'));
    expect(config.models_root).toBe(join(dir, 'models'));
    s = await startServer(config);
    servers.push(s);
  });
  const load = (body: Record<string, unknown>): Promise<Answer> =>
    call(`${s.url}/v1/models/load`, { method: 'POST', headers: json, body: JSON.stringify({ task: 'vad', ...body }) });
  const refusal = (path: string) => ({
    type: 'invalid_request_error',
    code: 'invalid_model_file',
    message: `path: '${path}' is outside models_root (${join(dir, 'models')}); put the model there, or set models_root in the config`,
  });

  it('is models/ beside the config file, or in the working directory without one', () => {
    expect(ServerConfig.parse({}).models_root).toBe(resolve('models'));
    expect(loadServerConfig(undefined).models_root).toBe(resolve('models'));
  });

  it('refuses /etc/shadow with 400 before opening it, with the same message as a missing file', async () => {
    for (const path of [
      '/etc/shadow',
      '/etc/voxserve-no-such-file',
      join(outside, 'real.onnx'),
      join(outside, 'blocks.fifo'),
      '../../etc/passwd',
    ]) {
      const r = await load({ id: 'escape', path });
      expect(r.status, path).toBe(400);
      expect(r.body.error, path).toEqual(refusal(path));
    }
    // Judged on the fully resolved path: through a symlink out, an existing and a missing file alike.
    for (const path of ['out/real.onnx', 'out/missing.onnx', 'out/blocks.fifo']) {
      expect((await load({ id: 'escape', path })).body.error, path).toEqual(refusal(path));
    }
    expect((await call(`${s.url}/v1/models/escape`)).status).toBe(404);
  });

  it('loads a model inside the root, and the embedded catalog models from node_modules', async () => {
    expect((await load({ id: 'mine', path: 'mine.onnx' })).status).toBe(200);
    expect((await load({ id: 'vad-copy', path: silero })).status).toBe(200); // a file the catalog ships
    expect((await runWav(s)).status).toBe(200);
    const jarvis = await call(`${s.url}/v1/tasks/run?model=hey-jarvis`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: fixture('espeak_hey_jarvis_22k.wav'),
    });
    expect(jarvis.body.detections).toEqual([expect.objectContaining({ label: 'hey-jarvis' })]);
  });

  it('a path inside the root that does not exist, or is a folder -> 400 naming path (was a 500 from the loader)', async () => {
    const missing = await load({ id: 'missing', path: 'no-such-model.onnx' });
    expect(missing.status).toBe(400);
    expect(missing.body.error).toEqual({
      type: 'invalid_request_error',
      code: 'invalid_model_file',
      message: `path: 'no-such-model.onnx' does not exist in models_root (${join(dir, 'models')})`,
    });
    mkdirSync(join(dir, 'models', 'folder'));
    const folder = await load({ id: 'folder', path: 'folder' });
    expect(folder.body.error).toEqual({
      type: 'invalid_request_error',
      code: 'invalid_model_file',
      message: "path: 'folder' is not a regular file",
    });
    // An empty path names the root itself: it is not "outside" it, it names no file.
    const empty = await load({ id: 'empty', path: '' });
    expect(empty.body.error).toEqual({
      type: 'invalid_request_error',
      code: 'invalid_field',
      message: "path: must name a model file, got ''",
    });
    expect((await call(`${s.url}/v1/models/missing`)).status).toBe(404);
  });

  it('models_root: false opts out: any readable path loads', async () => {
    const open = await serve({ management: { enabled: true }, models_root: false });
    const r = await call(`${open.url}/v1/models/load`, {
      method: 'POST',
      headers: json,
      body: JSON.stringify({ id: 'anywhere', task: 'vad', path: join(outside, 'real.onnx') }),
    });
    expect(r.status).toBe(200);
  });
});

describe('auth.api_keys', () => {
  const key = 'k3y-0123456789abcdef';
  let s: VoxServer;
  beforeAll(async () => {
    s = await serve({
      management: { enabled: true, token: 'management-token' },
      auth: { api_keys: ['another-key-0123456789', key] },
    });
  });
  const bearer = (k: string) => ({ authorization: `Bearer ${k}` });

  it('a run needs a key: 401 with WWW-Authenticate without one or with a wrong one, 200 with one', async () => {
    const none = await runWav(s);
    expect(none.status).toBe(401);
    expect(none.headers['www-authenticate']).toBe('Bearer realm="voxserve"');
    expect(none.body.error).toEqual({
      type: 'unauthorized',
      code: 'api_key_required',
      message:
        'this server needs an API key: Authorization: Bearer <key>, or on a stream the subprotocol voxserve.key.<key> (voxserve run/stream: --api-key KEY or VOXSERVE_API_KEY)',
    });
    expect((await runWav(s, bearer(`${key}x`))).body.error).toEqual({
      type: 'unauthorized',
      code: 'api_key_invalid',
      message:
        "the API key is not valid: it is not one of the server's auth.api_keys (voxserve run/stream: --api-key KEY or VOXSERVE_API_KEY)",
    });
    expect((await runWav(s, bearer('management-token'))).status).toBe(401); // the management token is not an API key
    expect((await runWav(s, bearer(key))).status).toBe(200);
    const batch = (h: Record<string, string>) =>
      call(`${s.url}/v1/tasks/batch`, {
        method: 'POST',
        headers: { ...json, ...h },
        body: JSON.stringify({ model: 'silero-vad', files: [wav.toString('base64')] }),
      });
    expect((await batch({})).status).toBe(401);
    expect((await batch(bearer(key))).status).toBe(200);
  });

  it('an API key does not open management; status stays open', async () => {
    expect(
      (await call(`${s.url}/v1/models/unload_all`, { method: 'POST', headers: { ...json, ...bearer(key) } })).status,
    ).toBe(403);
    expect((await call(`${s.url}/v1/models`)).status).toBe(200);
  });

  it('a stream needs a key: as a voxserve.key.<key> subprotocol (browsers) or an Authorization header', async () => {
    const none = await stream(s, { protocols: ['voxserve.v1.json'] });
    expect(none.status).toBe(401);
    expect(none.body.error).toMatchObject({ type: 'unauthorized', code: 'api_key_required' });
    expect((await stream(s, { protocols: ['voxserve.v1.json', 'voxserve.key.wrong-key-0123456789'] })).status).toBe(
      401,
    );
    const sub = await stream(s, { protocols: ['voxserve.v1.json', `voxserve.key.${key}`] });
    expect(sub.first.type).toBe('ready');
    expect(sub.ws!.protocol).toBe('voxserve.v1.json'); // the key is never echoed as the chosen subprotocol
    sub.ws!.close();
    const header = await stream(s, { headers: bearer(key) });
    expect(header.first.type).toBe('ready');
    header.ws!.close();
  });

  it('refuses keys a subprotocol cannot carry, naming the field', () => {
    expect(() => ServerConfig.parse({ auth: { api_keys: ['short'] } })).toThrow(/api_keys/);
    expect(() => ServerConfig.parse({ auth: { api_keys: ['has a space in it, 0123456789'] } })).toThrow(/api_keys/);
  });
});

describe('max_queued', () => {
  let s: VoxServer;
  beforeAll(async () => {
    s = await serve({
      max_queued: 1,
      models: [
        { id: 'capped', task: 'vad', path: silero, max_streams: 1, max_queued: 2 },
        { id: 'default-cap', task: 'vad', path: silero, max_streams: 1 },
      ],
    });
  });
  const queued = async (id: string): Promise<number> => (await call(`${s.url}/v1/models/${id}`)).body.queued_requests;

  it('past models[].max_queued a request gets 503 server_busy at once, with Retry-After; so does a stream waiting for its lease', async () => {
    const holder = await stream(s, { query: 'model=capped' }); // holds the only lease
    expect(holder.first.type).toBe('ready');
    const waiting = [runWav(s, {}, 'capped'), runWav(s, {}, 'capped')];
    await until(async () => (await queued('capped')) === 2);
    const t = performance.now();
    const full = await runWav(s, {}, 'capped');
    expect(performance.now() - t).toBeLessThan(1000); // at once, not after the busy timeout
    expect(full.status).toBe(503);
    expect(full.headers['retry-after']).toBe('1');
    expect(full.body.error).toEqual({
      type: 'server_busy',
      code: 'queue_full',
      message: 'the queue is full: 2 requests already wait for this model (max_queued); retry later',
    });
    const late = await stream(s, { query: 'model=capped' });
    expect(late.first).toEqual({
      type: 'error',
      error: { type: 'server_busy', code: 'queue_full', message: expect.stringMatching(/^the queue is full/) },
    });
    expect((await late.closed!).code).toBe(1013);
    holder.ws!.send(JSON.stringify({ type: 'end' }));
    expect((await Promise.all(waiting)).map((r) => r.status)).toEqual([200, 200]);
  });

  it('a model without max_queued takes the server default', async () => {
    const holder = await stream(s, { query: 'model=default-cap' });
    const waiting = runWav(s, {}, 'default-cap');
    await until(async () => (await queued('default-cap')) === 1);
    expect((await runWav(s, {}, 'default-cap')).status).toBe(503);
    holder.ws!.send(JSON.stringify({ type: 'end' }));
    expect((await waiting).status).toBe(200);
  });
});

describe('limits that agree', () => {
  let s: VoxServer;
  beforeAll(async () => {
    s = await serve({});
  });

  it('the documented longest file (30 min, 16 kHz mono 16-bit) fits the default body limit, as WAV and as base64 JSON', async () => {
    const longest = silence(1800);
    expect(longest.length).toBe(57_600_044);
    // An unknown model is answered after the body is read: 404 (not 413) shows the body was admitted.
    const asWav = await call(`${s.url}/v1/tasks/run?model=no-such-model`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: longest,
    });
    expect(asWav.status).toBe(404);
    const asJson = await call(`${s.url}/v1/tasks/run`, {
      method: 'POST',
      headers: json,
      body: JSON.stringify({ model: 'no-such-model', audio: longest.toString('base64') }),
    });
    expect(asJson.status).toBe(404);
    // One second more is refused as too long, by the documented limit, not by the body limit.
    const over = await call(`${s.url}/v1/tasks/run?model=silero-vad`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: silence(1801),
    });
    expect(over.status).toBe(400);
    expect(over.body.error).toEqual({
      type: 'invalid_request_error',
      code: 'audio_too_long',
      message: 'audio: 1801 s is longer than the limit of 1800 s per file',
    });
  });

  it('a client still uploading when the server answers 413 gets the answer, not a reset', async () => {
    // A server process of its own: in one process the client's writes and the server's close do not race.
    const config = join(mkdtempSync(join(tmpdir(), 'voxserve-limit-')), 'voxserve.json');
    writeFileSync(config, JSON.stringify({ port: 0, log_level: 'silent', limits: { max_body_bytes: 1024 * 1024 } }));
    const { child, url } = await spawnServer(['--config', config]);
    onTestFinished(() => void child.kill('SIGKILL'));
    const big = new Uint8Array(silence(600)); // 19.2 MB
    for (let i = 0; i < 10; i++) {
      const r = await fetch(`${url}/v1/tasks/run?model=silero-vad`, {
        method: 'POST',
        headers: { 'content-type': 'audio/wav' },
        body: big,
      });
      expect(r.status).toBe(413);
      expect((await r.json()).error).toMatchObject({ type: 'payload_too_large', code: 'body_too_large' });
    }
  });

  it('voxserve run prints the 413 of a server that answers on the headers and cuts the connection (voxserve and any other)', async () => {
    const file = join(mkdtempSync(join(tmpdir(), 'voxserve-big-')), 'ten-minutes.wav');
    writeFileSync(file, silence(600)); // 19.2 MB
    const early = await cutting();
    const small = await serve({ limits: { max_body_bytes: 1024 * 1024 } });
    try {
      for (const url of [early.url, small.url]) {
        for (let i = 0; i < 8; i++) {
          const r = await runCli(['run', 'silero-vad', file, '--url', url]);
          expect(r.stderr, url).toBe('');
          expect(r.code).toBe(1);
          expect(JSON.parse(r.stdout).error.type).toBe('payload_too_large');
        }
      }
    } finally {
      early.close();
    }
  });
});

describe('voxserve/client and the CLI with API keys, and early answers', () => {
  const key = 'client-key-0123456789';
  const model = 'silero-vad';
  const drain = async (events: AsyncIterable<unknown>): Promise<void> => {
    for await (const _ of events) {
      // read to the end
    }
  };

  it("apiKey: run, batch and streams need it (401 unauthorized with the server's message), work with it; management takes the token, with JSON on every call", async () => {
    const s = await serve({ management: { enabled: true, token: 'management-token-0123' }, auth: { api_keys: [key] } });
    const open = new VoxClient({ url: s.url });
    for (const attempt of [
      () => open.run(wav, { model }),
      () => drain(open.batch([wav], { model })),
      () => open.stream({ model }),
    ]) {
      expect(
        await attempt().then(
          () => 'no error',
          (e) => e,
        ),
      ).toMatchObject({
        name: 'VoxClientError',
        type: 'unauthorized',
        status: 401,
        message: expect.stringMatching(/^this server needs an API key/),
      });
    }
    expect(
      await new VoxClient({ url: s.url, apiKey: 'wrong-key-0123456789' }).stream({ model }).catch((e) => e),
    ).toMatchObject({ type: 'unauthorized', status: 401, message: expect.stringMatching(/^the API key is not valid/) });
    const keyed = new VoxClient({ url: s.url, apiKey: key });
    expect((await keyed.run(wav, { model })).task).toBe('vad');
    expect(await keyed.run(wav, { model, contentType: 'text/plain' }).catch((e) => e)).toMatchObject({
      type: 'unsupported_media_type',
      status: 415,
    });
    const events = [];
    for await (const e of keyed.batch([wav], { model })) events.push(e.type);
    expect(events).toEqual(['result', 'done']);
    // Streams: the header under Node, the subprotocol from the browser client (here with ws's constructor, which it
    // gives no headers).
    const browser = new BrowserClient({
      url: s.url,
      apiKey: key,
      WebSocket: WebSocket as unknown as WebSocketConstructor,
    });
    for (const client of [keyed, browser]) {
      const stream = await client.stream({ model });
      expect(stream.ready.type).toBe('ready');
      await stream.send(new Uint8Array(3200));
      expect((await stream.end()).type).toBe('done');
    }
    // Management: the token, not the key; unload_all is sent as JSON too (the server answers 415 otherwise).
    expect(await keyed.unloadAll().catch((e) => e)).toMatchObject({ type: 'forbidden', status: 403 });
    expect(await new VoxClient({ url: s.url, token: 'management-token-0123' }).unloadAll()).toEqual({
      unloaded: expect.arrayContaining([model]),
    });
    expect(() => new VoxClient({ apiKey: 'has a space 0123456789' })).toThrow(/^apiKey:/);
  });

  it('on a stream the Node client sends the key as Authorization, the browser client as the subprotocol voxserve.key.<key>', async () => {
    const wss = new WebSocketServer({ port: 0, host: '127.0.0.1', handleProtocols: () => 'voxserve.v1.json' });
    onTestFinished(() => void wss.close());
    await new Promise((r) => wss.once('listening', r));
    const seen: unknown[] = [];
    wss.on('connection', (ws, req) => {
      seen.push({ authorization: req.headers.authorization, protocols: req.headers['sec-websocket-protocol'] });
      ws.send(JSON.stringify({ type: 'ready', session_id: 's', model, task: 'vad', sample_rate: 16000 }));
    });
    const url = `http://127.0.0.1:${(wss.address() as AddressInfo).port}`;
    (await new VoxClient({ url, apiKey: key }).stream({ model })).close();
    (
      await new BrowserClient({ url, apiKey: key, WebSocket: WebSocket as unknown as WebSocketConstructor }).stream({
        model,
      })
    ).close();
    expect(seen, JSON.stringify(seen)).toEqual([
      { authorization: `Bearer ${key}`, protocols: 'voxserve.v1.json' },
      { authorization: undefined, protocols: `voxserve.v1.json,voxserve.key.${key}` },
    ]);
  });

  it('run() under Node gets an answer given before the upload ends (401, 413) as a VoxClientError with its status and type, also from a server that then cuts the connection', async () => {
    // The client in a process of its own (in one process its writes and the server's close do not race).
    const config = join(mkdtempSync(join(tmpdir(), 'voxserve-early-')), 'voxserve.json');
    writeFileSync(
      config,
      JSON.stringify({
        port: 0,
        log_level: 'silent',
        limits: { max_body_bytes: 1024 * 1024 },
        auth: { api_keys: [key] },
      }),
    );
    const { child, url } = await spawnServer(['--config', config]);
    onTestFinished(() => void child.kill('SIGKILL'));
    const early = await cutting();
    onTestFinished(() => early.close());
    const file = join(mkdtempSync(join(tmpdir(), 'voxserve-big-')), 'ten-minutes.wav');
    writeFileSync(file, silence(600)); // 19.2 MB
    const script = `const { VoxClient } = await import('voxserve/client');
      const { readFileSync } = await import('node:fs');
      const audio = readFileSync(${JSON.stringify(file)});
      const out = [];
      for (const [url, apiKey] of ${JSON.stringify([[early.url], [url], [url, key]])})
        for (let i = 0; i < 6; i++) out.push(await new VoxClient({ url, apiKey }).run(audio, { model: 'silero-vad' }).then(() => 'ok', (e) => e.name + ' ' + e.type + ' ' + e.status));
      console.log(JSON.stringify(out));`;
    const root = fileURLToPath(new URL('../..', import.meta.url));
    const { stdout } = await promisify(execFile)(process.execPath, ['--input-type=module', '-e', script], {
      cwd: root,
    });
    expect(JSON.parse(stdout)).toEqual([
      ...Array(6).fill('VoxClientError payload_too_large 413'),
      ...Array(6).fill('VoxClientError unauthorized 401'),
      ...Array(6).fill('VoxClientError payload_too_large 413'),
    ]);
  });

  it('voxserve run and stream --api-key: without it the 401 body on stdout and exit 1; with it the result', async () => {
    const s = await serve({ auth: { api_keys: [key] } });
    const file = fixturePath('Front_Left.wav');
    for (const command of ['run', 'stream']) {
      const refused = await runCli([command, model, file, '--url', s.url]);
      expect(refused.code, command).toBe(1);
      expect(refused.stderr, command).toBe('');
      expect(JSON.parse(refused.stdout).error, command).toMatchObject({
        type: 'unauthorized',
        message: expect.stringMatching(/^this server needs an API key/),
      });
    }
    const run = await runCli(['run', model, file, '--url', s.url, '--api-key', key]);
    expect(JSON.parse(run.stdout).task).toBe('vad');
    const stream = await runCli(['stream', model, file, '--url', s.url, '--api-key', key]);
    expect(
      stream.stdout
        .trim()
        .split('\n')
        .map((l) => JSON.parse(l).type),
    ).toEqual(expect.arrayContaining(['ready', 'done']));
    expect(stream.code).toBeUndefined();
  });
});

describe('in a browser (headless Chromium)', () => {
  it('a page of an allowed origin runs a model (preflight, key) and streams (key as subprotocol); a foreign page can do neither, nor unload', async () => {
    const key = 'browser-key-0123456789';
    // One page server, reached under two origins: http://localhost:P is allowed, http://127.0.0.1:P is not.
    const pages = createServer((_req, res) =>
      res.writeHead(200, { 'content-type': 'text/html' }).end('<!doctype html><title>page</title>'),
    );
    await new Promise<void>((r) => pages.listen(0, '127.0.0.1', r));
    const port = (pages.address() as AddressInfo).port;
    const s = await serve({
      management: { enabled: true },
      allowed_origins: [`http://localhost:${port}`],
      auth: { api_keys: [key] },
    });
    const browser = await chromium.launch({
      executablePath: '/usr/bin/chromium',
      args: ['--headless', '--no-sandbox', '--disable-gpu', '--no-first-run', '--disable-background-networking'],
    });
    try {
      const page = await browser.newPage();
      /**
       * In the page (a string: the page has its own WebSocket): a run with the key (a preflight: audio/wav and
       * Authorization), a stream's first event, an unload_all.
       */
      const script = `async ({ url, key, audio }) => {
        const body = Uint8Array.from(atob(audio), (c) => c.charCodeAt(0));
        const run = await fetch(url + '/v1/tasks/run?model=silero-vad', { method: 'POST', headers: { 'content-type': 'audio/wav', authorization: 'Bearer ' + key }, body }).then(
          async (r) => r.status + ' ' + (await r.json()).task,
          (e) => 'refused: ' + e.name,
        );
        const stream = await new Promise((done) => {
          const ws = new WebSocket(url.replace('http', 'ws') + '/v1/stream?model=silero-vad', ['voxserve.v1.json', 'voxserve.key.' + key]);
          ws.onmessage = (m) => (done(JSON.parse(m.data).type), ws.close());
          ws.onerror = () => done('refused');
        });
        const unload = await fetch(url + '/v1/models/unload_all', { method: 'POST', headers: { 'content-type': 'application/json' }, body: '{}' }).then(
          (r) => String(r.status),
          (e) => 'refused: ' + e.name,
        );
        return { run, stream, unload };
      }`;
      const tryAll = async (origin: string): Promise<unknown> => {
        await page.goto(origin);
        return page.evaluate(`(${script})(${JSON.stringify({ url: s.url, key, audio: wav.toString('base64') })})`);
      };
      expect(await tryAll(`http://127.0.0.1:${port}/`)).toEqual({
        run: 'refused: TypeError',
        stream: 'refused',
        unload: 'refused: TypeError',
      });
      expect(await tryAll(`http://localhost:${port}/`)).toEqual({ run: '200 vad', stream: 'ready', unload: '200' });
    } finally {
      await browser.close();
      pages.close();
    }
  });
});
