import { execFile } from 'node:child_process';
import { mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { createServer, type AddressInfo } from 'node:net';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ServerConfig } from '../../runtime/config.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { expectSegments, fixturePath, loopWav, reference } from '../helpers.js';

const exec = promisify(execFile);
const root = fileURLToPath(new URL('../..', import.meta.url));
const cli = join(root, 'dist/tools/cli.js');
let server: VoxServer;

beforeAll(async () => {
  server = await startServer(ServerConfig.parse({ log_level: 'silent', port: 0 }));
});
afterAll(async () => {
  await server?.close();
});

async function voxserve(...args: string[]): Promise<{ code: number; stdout: string; stderr: string }> {
  try {
    const { stdout, stderr } = await exec(process.execPath, [cli, ...args], { cwd: root });
    return { code: 0, stdout, stderr };
  } catch (e) {
    const err = e as { code: number; stdout: string; stderr: string };
    return { code: err.code, stdout: err.stdout, stderr: err.stderr };
  }
}

describe('voxserve CLI', () => {
  it('run prints the JSON result of a file', async () => {
    const r = await voxserve('run', 'silero-vad', fixturePath('Front_Center.wav'), '--url', server.url);
    expect(r.code).toBe(0);
    const result = JSON.parse(r.stdout);
    expect(result).toMatchObject({ model: 'silero-vad', task: 'vad' });
    expect(result.segments.length).toBeGreaterThan(0);
  });

  it('run detects the wake word in the hey jarvis phrase', async () => {
    const r = await voxserve('run', 'hey-jarvis', fixturePath('espeak_hey_jarvis_22k.wav'), '--url', server.url);
    expect(JSON.parse(r.stdout).detections).toEqual([expect.objectContaining({ label: 'hey-jarvis' })]);
  });

  it('stream prints one event per line: ready, detection, done', async () => {
    const r = await voxserve('stream', 'alexa', fixturePath('espeak_alexa_16k.wav'), '--url', server.url);
    expect(r.code).toBe(0);
    const events = r.stdout
      .trim()
      .split('\n')
      .map((l) => JSON.parse(l));
    expect(events.map((e) => e.type)).toEqual(['ready', 'detection', 'done']);
    expect(events[1]).toMatchObject({ label: 'alexa' });
  });

  it("stream rnnoise prints each audio chunk's size, not its bytes as numbers, and -o writes the denoised WAV", async () => {
    const out = join(mkdtempSync(join(tmpdir(), 'voxserve-cli-')), 'out.wav');
    const input = readFileSync(fixturePath('Front_Center.wav'));
    const r = await voxserve('stream', 'rnnoise', fixturePath('Front_Center.wav'), '--url', server.url, '-o', out);
    expect(r.code, r.stderr).toBe(0);
    const lines = r.stdout.trim().split('\n');
    expect(Math.max(...lines.map((l) => l.length))).toBeLessThan(200);
    const audio = lines.map((l) => JSON.parse(l)).filter((e) => e.type === 'audio');
    const bytes = audio.reduce((n, e) => n + e.bytes, 0);
    // The WAV header (RIFF, fmt, data size at byte 40): as many samples back as sent, at the file's rate.
    const wav = readFileSync(out);
    expect(wav.readUInt32LE(24)).toBe(input.readUInt32LE(24));
    expect(wav.readUInt32LE(40)).toBe(bytes);
    expect(bytes / 2).toBe(input.readUInt32LE(40) / 2);
  });

  it("run -o: --option sample_rate chooses the WAV's rate; a model that is not a denoise model is refused, not written", async () => {
    const dir = mkdtempSync(join(tmpdir(), 'voxserve-cli-'));
    const at16 = join(dir, 'a.wav');
    const r = await voxserve(
      'run',
      'rnnoise',
      fixturePath('Front_Center.wav'),
      '--url',
      server.url,
      '-o',
      at16,
      '--option',
      'sample_rate=16000',
    );
    expect(r.code, r.stderr).toBe(0);
    expect(readFileSync(at16).readUInt32LE(24)).toBe(16_000);
    const vad = await voxserve(
      'run',
      'silero-vad',
      fixturePath('Front_Center.wav'),
      '--url',
      server.url,
      '-o',
      join(dir, 'b.wav'),
    );
    expect(vad.code).not.toBe(0);
    expect(vad.stdout).toMatch(/not a denoise model/);
  });

  it.each(['espeak_sentence_8k_mulaw.wav', 'espeak_sentence_8k_alaw.wav'])(
    'stream sends telephone audio (%s) expanded by its G.711 codec: the speech of its source',
    async (file) => {
      const r = await voxserve('stream', 'silero-vad', fixturePath(file), '--url', server.url);
      expect(r.code).toBe(0);
      const events = r.stdout
        .trim()
        .split('\n')
        .map((l) => JSON.parse(l) as { type: string; start_ms: number; end_ms: number });
      // Through the resampler, as the HTTP path's G.711 test: boundaries within 300 ms (spec/fixtures/README.md).
      expectSegments(
        events.filter((e) => e.type === 'speech_end'),
        reference('espeak_sentence_16k.wav').segments_v6,
        300,
      );
    },
  );

  it('stream refuses a truncated WAV as the HTTP route does, naming the problem (breaker: it streamed what was there)', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'voxserve-cli-'));
    const whole = readFileSync(fixturePath('espeak_sentence_8k_mulaw.wav'));
    const half = join(dir, 'half.wav');
    writeFileSync(half, whole.subarray(0, whole.length >> 1));
    const r = await voxserve('stream', 'silero-vad', half, '--url', server.url);
    expect(r.code).toBe(1);
    expect(r.stdout).toBe('');
    expect(r.stderr).toMatch(/cannot read .*half\.wav as WAV: .*truncated/);
  });

  it('stream piped into a reader that stops after one line (| head -1) exits 0, no EPIPE crash', async () => {
    const { spawn } = await import('node:child_process');
    const child = spawn(
      process.execPath,
      [cli, 'stream', 'silero-vad', fixturePath('espeak_sentence_16k.wav'), '--url', server.url, '--realtime'],
      { stdio: ['ignore', 'pipe', 'pipe'] },
    );
    let stderr = '';
    child.stderr.on('data', (d) => (stderr += d));
    // Read the first line, then close the pipe while events are still to come.
    await new Promise<void>((resolve) => child.stdout.once('data', () => resolve()));
    child.stdout.destroy();
    const code = await new Promise<number | null>((resolve) => child.on('exit', (c) => resolve(c)));
    expect(stderr).not.toContain('EPIPE');
    expect(code).toBe(0);
  });

  it('stream --protocol msgpack prints the same events as JSON', async () => {
    const strip = (out: string) =>
      out
        .trim()
        .split('\n')
        .map((l) => {
          const { session_id: _s, timing: _t, ...rest } = JSON.parse(l);
          return rest;
        });
    const json = await voxserve('stream', 'silero-vad', fixturePath('espeak_sentence_16k.wav'), '--url', server.url);
    const msgpack = await voxserve(
      'stream',
      'silero-vad',
      fixturePath('espeak_sentence_16k.wav'),
      '--url',
      server.url,
      '--protocol',
      'msgpack',
    );
    expect(msgpack.code).toBe(0);
    expect(strip(json.stdout).map((e) => e.type)).toEqual(['ready', 'speech_start', 'speech_end', 'done']);
    expect(strip(msgpack.stdout)).toEqual(strip(json.stdout));
  });

  it('run --progress draws a progress bar on stderr up to 100 %, and still prints the result', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'voxserve-cli-'));
    const file = join(dir, 'long.wav');
    writeFileSync(file, loopWav('espeak_sentence_16k.wav', 120));
    const r = await voxserve('run', 'silero-vad', file, '--url', server.url, '--progress');
    expect(r.code).toBe(0);
    expect(JSON.parse(r.stdout).timing.audio_duration_ms).toBe(120_000);
    expect(r.stderr).toMatch(/processed \[.*\] 100% \| 120\/120 s/);
    // Not a terminal and no --progress: no bar.
    const quiet = await voxserve('run', 'silero-vad', file, '--url', server.url);
    expect(quiet.stderr).toBe('');
  });

  it('run and stream exit 1 with an error body for an unknown model', async () => {
    const r = await voxserve('run', 'nope', fixturePath('Front_Center.wav'), '--url', server.url);
    expect(r.code).toBe(1);
    expect(JSON.parse(r.stdout).error.type).toBe('not_found');
    const s = await voxserve('stream', 'nope', fixturePath('Front_Center.wav'), '--url', server.url);
    expect(s.code).toBe(1);
    expect(s.stderr).toMatch(/closed 1008/);
  });

  it('says clearly when no server is running, with the command that starts one as the README gives it, on the port asked for', async () => {
    // A port that was free a moment ago: nothing listens there.
    const probe = createServer();
    await new Promise<void>((r) => probe.listen(0, '127.0.0.1', r));
    const { port } = probe.address() as AddressInfo;
    await new Promise((r) => probe.close(r));
    for (const cmd of ['run', 'stream']) {
      const r = await voxserve(cmd, 'silero-vad', fixturePath('Front_Center.wav'), '--url', `http://127.0.0.1:${port}`);
      expect(r.code).toBe(1);
      expect(r.stderr).toContain(
        `no voxserve is running at http://127.0.0.1:${port} (ECONNREFUSED); start one with: node dist/tools/cli.js serve --port ${port}`,
      );
    }
  });

  it('says clearly when the file is missing', async () => {
    const r = await voxserve('run', 'silero-vad', '/no/such/file.wav', '--url', server.url);
    expect(r.code).toBe(1);
    expect(r.stderr).toMatch(/cannot read \/no\/such\/file\.wav: ENOENT/);
  });

  it('serve refuses an invalid config naming the field', async () => {
    const r = await voxserve('serve', '--port', '99999');
    expect(r.code).toBe(2);
    expect(r.stderr).toMatch(/invalid configuration: port:/);
  });
});
