/**
 * Issue 43 (b): the six mistakes a newcomer made, each answered with what to do: a missing
 * `--wakeword-dir` folder, content that is not what it is sent as, a model whose file is missing,
 * typos in config keys and model names, and npm's warning on `npm start`.
 */
import { execFile, spawn } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { VoxServer } from '../../transport/server.js';
import { fixture, fixturePath, startTestServer, until } from '../helpers.js';

const root = fileURLToPath(new URL('../../', import.meta.url));
const cli = join(root, 'dist/tools/cli.js');
const dir = mkdtempSync(join(tmpdir(), 'voxserve-front-door-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

/** Runs the compiled CLI to its end; resolves with its exit code and output. */
function voxserve(args: string[]): Promise<{ code: number; stdout: string; stderr: string }> {
  return new Promise((resolve) => {
    execFile(process.execPath, [cli, ...args], { timeout: 60_000, cwd: root }, (e, stdout, stderr) =>
      resolve({ code: e ? ((e as { code?: number }).code ?? 1) : 0, stdout, stderr }),
    );
  });
}

/**
 * Starts a command that serves, waits for `voxserve listening on URL` on its stderr, runs `fn`
 * with the URL and what it printed on stderr so far, then stops it (SIGTERM to its process group).
 */
async function serving<T>(
  command: string,
  args: string[],
  fn: (url: string, stderr: () => string) => Promise<T>,
  ms = 30_000,
): Promise<T> {
  const child = spawn(command, args, { cwd: root, stdio: ['ignore', 'pipe', 'pipe'], detached: true });
  let stderr = '';
  child.stderr.on('data', (d) => (stderr += d));
  child.stdout.on('data', () => {});
  const exited = new Promise<void>((r) => child.on('exit', () => r()));
  try {
    await until(() => /voxserve listening on /.test(stderr), ms).catch(() => {
      throw new Error(`no 'listening' within ${ms} ms; stderr:\n${stderr}`);
    });
    const url = /voxserve listening on (http:\/\/\S+) /.exec(stderr)![1];
    return await fn(url, () => stderr);
  } finally {
    process.kill(-child.pid!, 'SIGTERM');
    await exited;
  }
}

describe('serve: configuration mistakes are said before it listens, exit code 2', () => {
  it('a --wakeword-dir folder that does not exist: one line, exit 2, no "listening"', async () => {
    const missing = join(dir, 'no-such-folder');
    const r = await voxserve(['serve', '--port', '0', '--wakeword-dir', missing]);
    expect(r.code).toBe(2);
    expect(r.stderr).toBe(
      `voxserve: invalid configuration: wakeword_dir: the folder '${missing}' does not exist; create it (mkdir -p '${missing}') or give --wakeword-dir a folder that exists\n`,
    );
  });

  it('a typo in a config key gets "did you mean" (a slip of two letters too), at the root and in options', async () => {
    const config = join(dir, 'typos.json');
    writeFileSync(config, JSON.stringify({ prot: 9000, models: [{ id: 'silero-vad', options: { treshold: 0.3 } }] }));
    const r = await voxserve(['serve', '--config', config]);
    expect(r.code).toBe(2);
    expect(r.stderr).toBe(
      'voxserve: invalid configuration: models.0.options: Unrecognized key: "treshold" (did you mean "threshold"?); (root): Unrecognized key: "prot" (did you mean "port"?)\n',
    );
  });
});

describe('a model whose file is missing', () => {
  it('is warned on stderr at start, and a request for it is answered 503 model_unavailable naming the config entry and the path', async () => {
    const config = join(dir, 'missing-file.json');
    const path = join(dir, 'nope.onnx');
    writeFileSync(config, JSON.stringify({ port: 0, models: [{ id: 'my-vad', task: 'vad', path }] }));
    await serving(process.execPath, [cli, 'serve', '--config', config], async (url, stderr) => {
      await until(() => stderr().includes('warning'), 5000);
      expect(stderr().split('\n')[1]).toBe(
        `voxserve: warning: model my-vad (config models[0], path '${path}') cannot load: cannot read model file ${path}: it does not exist; requests for it get 503 model_unavailable until it is fixed`,
      );
      const r = await fetch(`${url}/v1/tasks/run?model=my-vad`, {
        method: 'POST',
        headers: { 'content-type': 'audio/wav' },
        body: new Uint8Array(fixture('Front_Center.wav')),
      });
      expect(r.status).toBe(503);
      expect((await r.json()).error).toEqual({
        type: 'server_error',
        code: 'model_unavailable',
        message: `model my-vad is unavailable: its config entry models[0] (path '${path}') cannot load: cannot read model file ${path}: it does not exist; fix models[0] in the config file and restart, or load it with POST /v1/models/load`,
      });
    });
  }, 60_000);
});

describe('a running server', () => {
  let server: VoxServer;
  beforeAll(async () => {
    server = await startTestServer();
  });
  afterAll(async () => {
    await server?.close();
  });
  const run = (model: string, body: Uint8Array, type = 'audio/wav') =>
    fetch(`${server.url}/v1/tasks/run?model=${encodeURIComponent(model)}`, {
      method: 'POST',
      headers: { 'content-type': type },
      body: new Uint8Array(body),
    });

  it('model names: "did you mean" by a part of an id and by task', async () => {
    const cases: [string, string][] = [
      [
        'vad',
        "model 'vad' does not exist (did you mean 'silero-vad' or 'silero-vad-v5'?); GET /v1/models lists the models",
      ],
      [
        'silero',
        "model 'silero' does not exist (did you mean 'silero-vad' or 'silero-vad-v5'?); GET /v1/models lists the models",
      ],
      ['jarvis', "model 'jarvis' does not exist (did you mean 'hey-jarvis'?); GET /v1/models lists the models"],
    ];
    for (const [model, message] of cases) {
      const r = await run(model, new Uint8Array(fixture('Front_Center.wav')));
      expect(r.status, model).toBe(404);
      expect((await r.json()).error.message, model).toBe(message);
    }
  });

  it('a body sent as audio/wav that is not a WAV is named, with what to do', async () => {
    const cases: [Uint8Array, string][] = [
      [
        new TextEncoder().encode('{"model":"silero-vad"}'),
        'audio: the body was sent as audio/wav but is not a WAV file: this looks like JSON ("{\\"model\\":\\"silero-vad\\"}"...); send JSON with content-type: application/json ({"model", "audio": <base64 WAV>})',
      ],
      [
        new TextEncoder().encode('<!DOCTYPE html><html>404</html>'),
        'audio: the body was sent as audio/wav but is not a WAV file: this looks like an HTML or XML page ("<!DOCTYPE html><html>404"...), not audio: was an error page saved in place of the file?',
      ],
    ];
    for (const [body, message] of cases) {
      const r = await run('silero-vad', body);
      expect(r.status).toBe(400);
      expect((await r.json()).error).toEqual({ type: 'invalid_request_error', code: 'invalid_audio', message });
    }
  });

  it('voxserve stream on an Ogg file names it and says to use run', async () => {
    const file = fixturePath('Front_Center.ogg');
    const r = await voxserve(['stream', 'silero-vad', file, '--url', server.url]);
    expect(r.code).toBe(1);
    expect(r.stderr).toBe(
      `voxserve: cannot stream ${file}: this looks like Ogg Vorbis; \`stream\` sends WAV audio: send it with \`node dist/tools/cli.js run silero-vad ${file}\` (the server decodes Ogg Vorbis), or convert it to WAV\n`,
    );
  });
});

describe('npm start', () => {
  it("prints npm's 'Unknown project config' warning at most once", async () => {
    await serving(
      'npm',
      ['start', '--', '--port', '0'],
      async (_url, stderr) => {
        expect(stderr().match(/Unknown project config/g)?.length ?? 0).toBeLessThanOrEqual(1);
      },
      240_000,
    );
  }, 300_000);
});
