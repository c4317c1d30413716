import { execFile, spawn, type ChildProcess } from 'node:child_process';
import { readFileSync, writeFileSync } from 'node:fs';
import { createServer, type AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ServerConfig } from '../../runtime/config.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { expectSegments, fixturePath, reference } from '../helpers.js';

/**
 * CLI and server start-up rough edges (issue 13): --version, environment variables, --url, --frame-ms, --option, failed
 * eager loads.
 */

const exec = promisify(execFile);
const cli = fileURLToPath(new URL('../../dist/tools/cli.js', import.meta.url));
let server: VoxServer;
const children = new Set<ChildProcess>();

beforeAll(async () => {
  server = await startServer(ServerConfig.parse({ log_level: 'silent', port: 0 }));
});
afterAll(async () => {
  for (const c of children) c.kill('SIGKILL');
  await server?.close();
});

async function voxserve(
  args: string[],
  env: Record<string, string> = {},
): Promise<{ code: number; stdout: string; stderr: string }> {
  try {
    const { stdout, stderr } = await exec(process.execPath, [cli, ...args], { env: { ...process.env, ...env } });
    return { code: 0, stdout, stderr };
  } catch (e) {
    const err = e as { code: number; stdout: string; stderr: string };
    return { code: err.code, stdout: err.stdout, stderr: err.stderr };
  }
}

/** `voxserve serve` with `env` (no flags): resolves with its URL once it listens, and its stdout so far. */
function serveWithEnv(
  env: Record<string, string>,
): Promise<{ child: ChildProcess; url: string; stdout: () => string }> {
  const clean = Object.fromEntries(Object.entries(process.env).filter(([k]) => !/^(VOXSERVE_|PORT$)/.test(k)));
  const child = spawn(process.execPath, [cli, 'serve'], {
    env: { ...clean, ...env },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  children.add(child);
  let out = '';
  child.stdout!.on('data', (d: Buffer) => (out += d));
  return new Promise((resolve, reject) => {
    let err = '';
    child.stderr!.on('data', (d: Buffer) => {
      err += d;
      const m = /listening on (\S+)/.exec(err);
      if (m) resolve({ child, url: m[1], stdout: () => out });
    });
    child.on('exit', (code) => reject(new Error(`serve exited ${code}: ${err}`)));
  });
}

async function freePort(): Promise<number> {
  const s = createServer();
  await new Promise<void>((r) => s.listen(0, '127.0.0.1', r));
  const { port } = s.address() as AddressInfo;
  await new Promise((r) => s.close(r));
  return port;
}

async function stop(child: ChildProcess): Promise<void> {
  const exited = new Promise((r) => child.once('exit', r));
  child.kill('SIGTERM');
  await exited;
  children.delete(child);
}

describe('voxserve CLI: input and rough edges', () => {
  it('--version prints the package version', async () => {
    const { version } = JSON.parse(readFileSync(fileURLToPath(new URL('../../package.json', import.meta.url)), 'utf8'));
    for (const flag of ['--version', '-V']) {
      const r = await voxserve([flag]);
      expect(r.code).toBe(0);
      expect(r.stdout.trim()).toBe(version);
    }
  });

  it('run takes an MP3 and --option k=v (validated by the server as a JSON body`s options)', async () => {
    const mp3 = fixturePath('silero_test.mp3');
    const plain = await voxserve(['run', 'silero-vad', mp3, '--url', server.url]);
    expect(plain.code).toBe(0);
    expectSegments(JSON.parse(plain.stdout).segments, reference('silero_test.mp3').segments_v6, 300);
    const strict = await voxserve([
      'run',
      'silero-vad',
      mp3,
      '--url',
      server.url,
      '--option',
      'threshold=0.99',
      '--option',
      'min_speech_duration_ms=5000',
    ]);
    expect(strict.code).toBe(0);
    expect(JSON.parse(strict.stdout).segments).toEqual([]);
    const typo = await voxserve(['run', 'silero-vad', mp3, '--url', server.url, '--option', 'thresold=0.9']);
    expect(typo.code).toBe(1);
    expect(JSON.parse(typo.stdout).error.message).toMatch(/^options: .*"thresold"/);
    const malformed = await voxserve(['run', 'silero-vad', mp3, '--url', server.url, '--option', 'threshold']);
    expect(malformed.code).not.toBe(0);
    expect(malformed.stderr).toMatch(/not of the form key=value/);
  });

  it('--url without a scheme suggests http://; --frame-ms 0 is refused', async () => {
    const r = await voxserve(['run', 'silero-vad', fixturePath('Front_Center.wav'), '--url', '127.0.0.1:8080']);
    expect(r.code).not.toBe(0);
    expect(r.stderr).toMatch(/did you mean http:\/\/127\.0\.0\.1:8080\?/);
    for (const ms of ['0', '10001', 'abc']) {
      const f = await voxserve([
        'stream',
        'silero-vad',
        fixturePath('Front_Center.wav'),
        '--url',
        server.url,
        '--frame-ms',
        ms,
      ]);
      expect(f.code).not.toBe(0);
      expect(f.stderr).toMatch(/--frame-ms/);
    }
  });

  it('serve reads VOXSERVE_HOST, VOXSERVE_PORT (over PORT) and PORT', async () => {
    const [p1, p2] = [await freePort(), await freePort()];
    const a = await serveWithEnv({ VOXSERVE_HOST: '127.0.0.2', VOXSERVE_PORT: String(p1), PORT: String(p2) });
    expect(a.url).toBe(`http://127.0.0.2:${p1}`);
    await stop(a.child);
    const b = await serveWithEnv({ PORT: String(p2) });
    expect(b.url).toBe(`http://127.0.0.1:${p2}`);
    await stop(b.child);
    const bad = await voxserve(['serve'], { PORT: 'eighty' });
    // A configuration error exits 2 (issue 43: before "listening", with what to do).
    expect(bad.code).toBe(2);
    expect(bad.stderr).toMatch(/PORT must be a non-negative integer, got 'eighty'/);
  });

  it('VOXSERVE_CONFIG: a catalog id inherits task and path; a model that fails to load eagerly is logged at error level and listed by /ready and /v1/models', async () => {
    const file = join(tmpdir(), `voxserve-input-${process.pid}.json`);
    writeFileSync(
      file,
      JSON.stringify({
        port: 0,
        models: [
          { id: 'silero-vad', slots: 2, lazy: false },
          { id: 'broken', task: 'vad', path: '/no/such/model.onnx', lazy: false },
        ],
      }),
    );
    const s = await serveWithEnv({ VOXSERVE_CONFIG: file });
    try {
      let ready: Response;
      while ((ready = await fetch(`${s.url}/ready`)).status !== 200) await new Promise((r) => setTimeout(r, 20));
      const body = await ready.json();
      expect(body).toMatchObject({
        status: 'ready',
        failed_models: [{ id: 'broken', error: expect.stringMatching(/model\.onnx/) }],
      });
      const models = await (await fetch(`${s.url}/v1/models`)).json();
      expect(models.failed_models).toEqual(body.failed_models);
      const vad = await (await fetch(`${s.url}/v1/models/silero-vad`)).json();
      expect(vad).toMatchObject({ id: 'silero-vad', task: 'vad', slots: 2, loaded: true });
      const lines = s
        .stdout()
        .split('\n')
        .filter(Boolean)
        .map((l) => JSON.parse(l));
      expect(lines).toContainEqual(
        expect.objectContaining({ level: 50, msg: 'model failed to load at start', model: 'broken' }),
      );
    } finally {
      await stop(s.child);
    }
  });
});
