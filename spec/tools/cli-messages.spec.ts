/** What the command line and the server say when something is wrong: each message says what to do (issue 23). */
import { execFile, spawn } from 'node:child_process';
import { mkdtempSync, writeFileSync } from 'node:fs';
import { createServer, type AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ServerConfig } from '../../runtime/config.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { fixture, fixturePath, until } from '../helpers.js';

const cli = fileURLToPath(new URL('../../dist/tools/cli.js', import.meta.url));
const dir = mkdtempSync(join(tmpdir(), 'voxserve-messages-'));

/** Runs the compiled CLI; resolves with its exit code and output (never rejects). */
function voxserve(
  args: string[],
  env: Record<string, string | undefined> = {},
): Promise<{ code: number; stdout: string; stderr: string }> {
  const merged = Object.fromEntries(Object.entries({ ...process.env, ...env }).filter(([, v]) => v !== undefined));
  return new Promise((resolve) => {
    execFile(process.execPath, [cli, ...args], { env: merged, timeout: 60_000 }, (e, stdout, stderr) =>
      resolve({ code: e ? ((e as { code?: number }).code ?? 1) : 0, stdout, stderr }),
    );
  });
}

/** A TCP port held by another listener on 127.0.0.1 while `fn` runs. */
async function withBusyPort<T>(fn: (port: number) => Promise<T>): Promise<T> {
  const holder = createServer();
  await new Promise<void>((r) => holder.listen(0, '127.0.0.1', r));
  try {
    return await fn((holder.address() as AddressInfo).port);
  } finally {
    holder.close();
  }
}

describe('voxserve serve: why it cannot start', () => {
  it('a busy Wyoming port is named as the Wyoming address, a busy HTTP port as the HTTP address', async () => {
    await withBusyPort(async (port) => {
      const wyoming = await voxserve(['serve', '--port', '0', '--wyoming', `127.0.0.1:${port}`]);
      expect(wyoming.code).toBe(1);
      expect(wyoming.stderr).toBe(
        `voxserve: cannot start: the Wyoming address 127.0.0.1:${port} is already in use (another voxserve?); choose another with --wyoming HOST:PORT (or wyoming.port in the config)\n`,
      );
      const http = await voxserve(['serve', '--port', String(port)]);
      expect(http.code).toBe(1);
      expect(http.stderr).toBe(
        `voxserve: cannot start: the HTTP address 127.0.0.1:${port} is already in use (another voxserve?); choose another with --port (or VOXSERVE_PORT, or port in the config)\n`,
      );
    });
  });

  it('an unknown head in the config is a configuration error naming the field and the wake words it knows, not a route of a server that is not running', async () => {
    const config = join(dir, 'heads.json');
    writeFileSync(
      config,
      JSON.stringify({ port: 0, models: [{ id: 'house', task: 'wakeword', heads: ['alexa', 'hey_jarvs'] }] }),
    );
    const r = await voxserve(['serve', '--config', config]);
    expect(r.code).toBe(2);
    expect(r.stderr).toBe(
      "voxserve: invalid configuration: models.0.heads.1: wake-word model 'hey_jarvs' does not exist (did you mean 'hey-jarvis'?); the wake-word models this server knows: alexa, hey-jarvis, hey-mycroft, hey-rhasspy, timer, weather\n",
    );
  });
});

describe('voxserve serve: what it prints', () => {
  it('stdout is the log, JSON lines only (its first says where it listens); stderr has the plain lines for a person', async () => {
    const child = spawn(process.execPath, [cli, 'serve', '--port', '0'], { stdio: ['ignore', 'pipe', 'pipe'] });
    let stdout = '';
    let stderr = '';
    child.stdout.on('data', (d) => (stdout += d));
    child.stderr.on('data', (d) => (stderr += d));
    const exited = new Promise<number | null>((r) => child.on('exit', r));
    try {
      // The CLI sets its signal handlers right after it prints where it listens.
      await until(() => /voxserve listening on .*\n/.test(stderr) && stdout.includes('\n'), 30_000);
    } finally {
      child.kill('SIGTERM');
    }
    expect(await exited, `${stderr}${stdout}`).toBe(0);
    const url = /^voxserve listening on (http:\/\/127\.0\.0\.1:\d+) /.exec(stderr)?.[1];
    expect(url, stderr).toBeDefined();
    const lines = stdout.trim().split('\n');
    const log = lines.map((l) => JSON.parse(l) as { msg: string; url?: string });
    expect(log[0]).toMatchObject({ msg: 'listening', url });
    expect(log.at(-1)!.msg).toBe('stopped');
    expect(stderr.split('\n').every((l) => l === '' || l.startsWith('voxserve'))).toBe(true);
  });
});

describe('a running server', () => {
  let server: VoxServer;
  let keyed: VoxServer;
  const key = 'k'.repeat(16) + '-cli-env-key';
  beforeAll(async () => {
    server = await startServer(ServerConfig.parse({ log_level: 'silent', port: 0 }));
    keyed = await startServer(ServerConfig.parse({ log_level: 'silent', port: 0, auth: { api_keys: [key] } }));
  });
  afterAll(async () => {
    await server?.close();
    await keyed?.close();
  });

  const run = (url: string, model: string) =>
    fetch(`${url}/v1/tasks/run?model=${encodeURIComponent(model)}`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: new Uint8Array(fixture('Front_Left.wav')),
    });

  it('a 404 for a model id suggests the id it probably meant (_ for -, a typo); an id like none gets no guess', async () => {
    const cases: [string, string][] = [
      ['hey_jarvis', "model 'hey_jarvis' does not exist (did you mean 'hey-jarvis'?); GET /v1/models lists the models"],
      ['Hey Jarvis', "model 'Hey Jarvis' does not exist (did you mean 'hey-jarvis'?); GET /v1/models lists the models"],
      ['silero-vda', "model 'silero-vda' does not exist (did you mean 'silero-vad'?); GET /v1/models lists the models"],
      ['xyzzy', "model 'xyzzy' does not exist; GET /v1/models lists the models"],
      [
        'alexa,hey_jarvis',
        "model: wake-word model 'hey_jarvis' does not exist (did you mean 'hey-jarvis'?); GET /v1/models lists the models",
      ],
    ];
    for (const [model, message] of cases) {
      const r = await run(server.url, model);
      expect(r.status, model).toBe(404);
      expect((await r.json()).error, model).toEqual({ type: 'not_found', code: 'model_not_found', message });
    }
    const one = await fetch(`${server.url}/v1/models/silero_vad`);
    expect(one.status).toBe(404);
    expect((await one.json()).error.message).toBe(
      "model 'silero_vad' does not exist (did you mean 'silero-vad'?); GET /v1/models lists the models",
    );
  });

  it('GET / is an index page linking the demo, /debug, the model list and the docs', async () => {
    const r = await fetch(`${server.url}/`);
    expect(r.status).toBe(200);
    expect(r.headers.get('content-type')).toBe('text/html; charset=utf-8');
    const html = await r.text();
    for (const link of [
      'href="/demo"',
      'href="/debug"',
      'href="/v1/models"',
      'href="/ready"',
      'href="/metrics"',
      'docs/http-api.md',
      'README.md',
    ])
      expect(html).toContain(link);
  });

  it('/debug on a server without management is a page saying how to turn it on, not a bare 403', async () => {
    const r = await fetch(`${server.url}/debug`);
    expect(r.status).toBe(403);
    expect(r.headers.get('content-type')).toBe('text/html; charset=utf-8');
    const html = await r.text();
    expect(html).toContain('voxserve serve --management --inspect');
    expect(html).toContain('/debug?token=');
    // The data routes stay JSON errors for programs.
    expect((await (await fetch(`${server.url}/debug/state`)).json()).error.type).toBe('forbidden');
  });

  it('the CLI takes its API key from VOXSERVE_API_KEY; without one the 401 says how to give it', async () => {
    const file = fixturePath('Front_Left.wav');
    const without = await voxserve(['run', 'silero-vad', file, '--url', keyed.url, '--no-progress'], {
      VOXSERVE_API_KEY: undefined,
    });
    expect(without.code).toBe(1);
    expect(JSON.parse(without.stdout).error.message).toContain('--api-key KEY or VOXSERVE_API_KEY');
    const withEnv = await voxserve(['run', 'silero-vad', file, '--url', keyed.url, '--no-progress'], {
      VOXSERVE_API_KEY: key,
    });
    expect(withEnv.code).toBe(0);
    expect(JSON.parse(withEnv.stdout).task).toBe('vad');
    const stream = await voxserve(['stream', 'silero-vad', file, '--url', keyed.url], { VOXSERVE_API_KEY: key });
    expect(stream.code).toBe(0);
  });
});

describe('/debug with a management token, in headless Chromium', () => {
  it('says to add ?token= when it is missing, and that it is wrong when it is', async () => {
    const token = 't'.repeat(32);
    const s = await startServer(
      ServerConfig.parse({ log_level: 'silent', port: 0, management: { enabled: true, token } }),
    );
    const browser = await chromium.launch({
      executablePath: '/usr/bin/chromium',
      args: ['--headless', '--no-sandbox', '--disable-gpu', '--no-first-run', '--disable-background-networking'],
    });
    try {
      const page = await browser.newPage();
      const phase = async (query: string): Promise<string> => {
        await page.goto(`${s.url}/debug${query}`);
        await page.waitForFunction(() => (document.getElementById('phase')?.textContent ?? '') !== '', null, {
          timeout: 10_000,
        });
        return (await page.textContent('#phase')) ?? '';
      };
      expect(await phase('')).toBe('this server has a management token: open /debug?token=<management.token>');
      expect(await phase('?token=wrong')).toBe('HTTP 403: the token is not the management.token of this server');
      expect(await phase(`?token=${token}`)).toMatch(/^system: /);
    } finally {
      await browser.close();
      await s.close();
    }
  });
});

/**
 * `voxserve stream --realtime` of a 5.8 s sentence against `url`, started and waited for until its
 * stream is ready and 0.5 s of audio is sent (most still to come). `out()` gives its stdout and
 * stderr so far; `exited` its exit code.
 */
async function realtimeStream(url: string) {
  const child = spawn(
    process.execPath,
    [cli, 'stream', 'silero-vad', fixturePath('espeak_sentence_16k.wav'), '--url', url, '--realtime'],
    { stdio: ['ignore', 'pipe', 'pipe'] },
  );
  let stdout = '';
  let stderr = '';
  child.stdout.on('data', (d) => (stdout += d));
  child.stderr.on('data', (d) => (stderr += d));
  const exited = new Promise<number | null>((r) => child.on('exit', r));
  await until(() => stdout.includes('"type":"ready"'), 30_000);
  await new Promise((r) => setTimeout(r, 500));
  const out = () => ({
    events: stdout
      .trim()
      .split('\n')
      .map((l) => JSON.parse(l) as { type: string }),
    stderr,
  });
  return { exited, out };
}

describe('voxserve stream while the server shuts down', () => {
  it('reports the close 1001 (shutting_down), not "send after the stream closed"', async () => {
    const server = await startServer(ServerConfig.parse({ log_level: 'silent', port: 0, drain_timeout_ms: 5000 }));
    const stream = await realtimeStream(server.url);
    await server.close();
    expect(await stream.exited).toBe(1);
    const { events, stderr } = stream.out();
    expect(events.at(-1)!.type).toBe('done'); // the drain finished the stream as if the client had sent end
    expect(stderr).not.toContain('send after the stream closed');
    expect(stderr).toMatch(/^voxserve: stream closed 1001 \(shutting_down\): the server closed the stream \(1001/);
  });
});

describe('voxserve stream closed by the server while it waits to send its next real-time frame', () => {
  it('prints the close on one line and exits 1, not an unhandled rejection with a stack trace', async () => {
    const server = await startServer(
      ServerConfig.parse({ log_level: 'silent', port: 0, management: { enabled: true } }),
    );
    try {
      const stream = await realtimeStream(server.url);
      const res = await fetch(`${server.url}/v1/models/unload`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ id: 'silero-vad', force: true }),
      });
      expect(res.status).toBe(200);
      expect(await stream.exited).toBe(1);
      const { events, stderr } = stream.out();
      expect(events.at(-1)!.type).toBe('error');
      expect(stderr).toBe('voxserve: stream closed 1012 (server_busy): model silero-vad was unloaded (force)\n');
    } finally {
      await server.close();
    }
  });
});
