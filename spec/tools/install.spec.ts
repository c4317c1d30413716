/**
 * Installed like a tool (issue 23): `npm pack`, `npm install -g` into a fresh prefix, then the
 * systemd unit of docs/operations.md runs that `voxserve` with the config example of
 * docs/configuration.md and serves a request; `voxserve run` and `voxserve models` talk to it.
 */
import { execFile, spawn } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { afterAll, describe, expect, it } from 'vitest';
import { fixturePath } from '../helpers.js';

const exec = promisify(execFile);
const root = fileURLToPath(new URL('../..', import.meta.url));
const dir = mkdtempSync(join(tmpdir(), 'voxserve-install-'));
const prefix = join(dir, 'prefix');

afterAll(() => rmSync(dir, { recursive: true, force: true }));

/** The fenced blocks of a markdown file with their language. */
function blocks(file: string): { lang: string; code: string }[] {
  const text = readFileSync(join(root, file), 'utf8');
  return [...text.matchAll(/^```(\w*)\n([\s\S]*?)^```$/gm)].map((m) => ({ lang: m[1], code: m[2] }));
}

describe('npm pack and npm install -g', () => {
  it('give a voxserve command that the documented systemd unit runs with the documented config', async () => {
    // npm test has just built dist/: pack without the prepack build.
    const { stdout: packed } = await exec('npm', ['pack', '--ignore-scripts', '--pack-destination', dir, '--json'], {
      cwd: root,
    });
    const tgz = join(dir, (JSON.parse(packed) as { filename: string }[])[0].filename);
    // The install of the README, from npm's cache where it can (npm ci filled it).
    await exec('npm', ['install', '-g', '--prefix', prefix, '--prefer-offline', '--no-audit', '--no-fund', tgz], {
      env: { ...process.env, ONNXRUNTIME_NODE_INSTALL: 'skip' },
      timeout: 300_000,
    });
    const bin = join(prefix, 'bin', 'voxserve');
    expect(existsSync(bin)).toBe(true);
    // The package holds what it runs, and no sources or tests.
    const pkg = join(prefix, 'lib', 'node_modules', 'voxserve');
    for (const f of [
      'dist/tools/cli.js',
      'dist/demo/index.html',
      'docs/configuration.md',
      'spec/fixtures/espeak_sentence_16k.wav',
    ])
      expect(existsSync(join(pkg, f)), f).toBe(true);
    for (const f of ['actors', 'spec/tools', 'tools']) expect(existsSync(join(pkg, f)), f).toBe(false);

    // docs/operations.md: the unit's ExecStart, with npm's global prefix (/usr/local) and /etc/voxserve moved here.
    const unit = blocks('docs/operations.md').find((b) => b.lang === 'ini' && b.code.includes('[Service]'));
    const execStart = /^ExecStart=(.+)$/m.exec(unit!.code)![1];
    expect(execStart).toBe('/usr/local/bin/voxserve serve --config /etc/voxserve/voxserve.json');
    const etc = join(dir, 'etc', 'voxserve');
    mkdirSync(etc, { recursive: true });
    // docs/configuration.md's example, as copied (port 0 instead of 8080: other tests may hold it).
    const example = JSON.parse(blocks('docs/configuration.md').find((b) => b.lang === 'json')!.code);
    writeFileSync(join(etc, 'voxserve.json'), JSON.stringify({ ...example, port: 0 }));
    const [cmd, ...args] = execStart
      .replace('/usr/local/', `${prefix}/`)
      .replace('/etc/voxserve/', `${etc}/`)
      .split(' ');
    const server = spawn(cmd, args, { cwd: dir, stdio: ['ignore', 'ignore', 'pipe'] });
    try {
      const url = await new Promise<string>((resolve, reject) => {
        let err = '';
        server.stderr.on('data', (d: Buffer) => {
          err += d;
          const m = /listening on (\S+)/.exec(err);
          if (m) resolve(m[1]);
        });
        server.on('exit', (code) => reject(new Error(`voxserve exited ${code}: ${err}`)));
      });
      while ((await fetch(`${url}/ready`)).status !== 200) await new Promise((r) => setTimeout(r, 50));
      // Every model of the example loaded (lazy: false), none failed.
      const ready = await (await fetch(`${url}/ready`)).json();
      expect(ready).toEqual({ status: 'ready' });
      const run = await exec(bin, [
        'run',
        'silero-vad',
        fixturePath('Front_Center.wav'),
        '--url',
        url,
        '--no-progress',
      ]);
      expect(JSON.parse(run.stdout)).toMatchObject({
        model: 'silero-vad',
        task: 'vad',
        segments: [expect.anything(), expect.anything()],
      });
      const models = await exec(bin, ['models', '--url', url]);
      const lines = models.stdout.trim().split('\n');
      expect(lines[0]).toMatch(/^ID +TASK +STATE +LICENCE$/);
      expect(lines).toContainEqual(expect.stringMatching(/^silero-vad +vad +ready +MIT$/));
      expect(lines).toContainEqual(
        expect.stringMatching(/^house +wakeword +ready +CC BY-NC-SA 4\.0 \(non-commercial\)$/),
      );
    } finally {
      server.kill('SIGTERM');
      await new Promise((r) => server.once('exit', r));
    }
  }, 420_000);
});
