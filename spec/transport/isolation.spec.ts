/**
 * Slot hosts as child processes (isolation: "process"): a job over `job_timeout_ms` gets its host
 * killed and a 503, a job that aborts its host twice (it runs once more) gets a 422 naming the
 * signal and the host is respawned (the input's crashes: the model serves on), three crashes of
 * the model's own within a minute unload the model, waiting for a
 * slot is bounded by the busy timeout, and SIGTERM does not wait for a job that never returns.
 * Synthetic models of known run time.
 */
import { execFileSync } from 'node:child_process';
import { existsSync, mkdtempSync, readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { monitorEventLoopDelay } from 'node:perf_hooks';
import { afterAll, beforeAll, describe, expect, it, onTestFinished } from 'vitest';
import { defaultCatalog, ServerConfig } from '../../runtime/config.js';
import { spawnServer } from '../../tools/spawn-server.js';
import { calibrate, syntheticModel } from '../../tools/synth-model.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { fixture, references, until, WaveFile } from '../helpers.js';

/** The first sample of a job that makes a host call process.abort() (the slot host's test hook; s16 12345). */
const ABORT_AT = 12345 / 32768;
process.env.VOXSERVE_TEST_ABORT_AT = String(ABORT_AT);

const dir = mkdtempSync(join(tmpdir(), 'voxserve-iso-'));
const silero = defaultCatalog().find((m) => m.id === 'silero-vad')!.path;
let msPerMatmul = 1;
/** A synthetic VAD-shaped model taking about `runMs` per 512-sample window. */
function slowModel(name: string, runMs: number): string {
  const path = join(dir, `${name}.onnx`);
  writeFileSync(path, syntheticModel(1, Math.max(1, Math.round(runMs / msPerMatmul))));
  return path;
}
/** 16 kHz mono s16 WAV of `seconds` of a quiet tone; `first` replaces its first sample. */
function wav(seconds: number, first?: number): Buffer {
  const samples = Int16Array.from({ length: Math.round(16000 * seconds) }, (_, i) =>
    Math.round(Math.sin(i / 10) * 300),
  );
  if (first !== undefined) samples[0] = first;
  const w = new WaveFile();
  w.fromScratch(1, 16000, '16', samples);
  return Buffer.from(w.toBuffer());
}
const servers: VoxServer[] = [];
async function serve(extra: Record<string, unknown>): Promise<VoxServer> {
  const s = await startServer(ServerConfig.parse({ log_level: 'silent', port: 0, isolation: 'process', ...extra }));
  servers.push(s);
  await until(async () => (await fetch(`${s.url}/ready`)).status === 200, 10_000);
  return s;
}
const run = async (s: VoxServer, model: string, body: Buffer) => {
  const res = await fetch(`${s.url}/v1/tasks/run?model=${model}`, {
    method: 'POST',
    headers: { 'content-type': 'audio/wav' },
    body: new Uint8Array(body),
  });
  return { status: res.status, body: await res.json(), retryAfter: res.headers.get('retry-after') };
};
const status = async (s: VoxServer, id: string) => (await fetch(`${s.url}/v1/models/${id}`)).json();

beforeAll(async () => {
  msPerMatmul = await calibrate();
});
afterAll(async () => {
  await Promise.all(servers.map((s) => s.close()));
});

describe('process isolation', () => {
  it('a job over job_timeout_ms: its host is killed, 503 naming the timeout; the respawned slot serves the next request; another model is served throughout with no event-loop pause over 50 ms', async () => {
    const s = await serve({
      models: [
        { id: 'slow', task: 'vad', path: slowModel('slow', 300), job_timeout_ms: 800, lazy: false, max_batch_size: 1 },
      ],
    });
    expect((await run(s, 'silero-vad', fixture('Front_Left.wav'))).status).toBe(200); // loaded before the clock starts
    const sentence = fixture('espeak_sentence_16k.wav');
    const loop = monitorEventLoopDelay({ resolution: 5 });
    loop.enable();
    let serving = true;
    const other = (async () => {
      const codes: number[] = [];
      // 16 kHz: no resampling on the main thread.
      while (serving) codes.push((await run(s, 'silero-vad', sentence)).status);
      return codes;
    })();
    const t0 = performance.now();
    let long, short;
    try {
      long = await run(s, 'slow', wav(1)); // ~31 windows x 300 ms in one job
    } finally {
      serving = false;
    }
    const tookMs = performance.now() - t0;
    expect(long.status).toBe(503);
    expect(long.body.error).toMatchObject({
      type: 'server_busy',
      message: expect.stringMatching(/job_timeout_ms \(800 ms\)/),
    });
    expect(tookMs).toBeLessThan(3000);
    const codes = await other;
    short = await run(s, 'slow', wav(0.03)); // one window: well within the timeout, on the respawned slot
    expect(short.status).toBe(200);
    loop.disable();
    expect(codes.length).toBeGreaterThan(0);
    expect(codes.every((c) => c === 200)).toBe(true);
    console.log('event loop delay ms: max', loop.max / 1e6, 'p99', loop.percentile(99) / 1e6, 'mean', loop.mean / 1e6);
    expect(loop.max / 1e6).toBeLessThan(50);
    expect(await status(s, 'slow')).toMatchObject({ state: 'ready', last_error: null });
  });

  it("a job that aborts its host, and the respawned host it runs on again: 422 input_crashed_model naming the signal, and again for a second such request (its crashes are the input's: issue 44 item 8), while the model, the server and other models serve on; three crashes of its own in a minute unload the model with last_error and hold it back for crash_cooldown_ms (503 model_cooling_down with Retry-After; issue 25 item 9); then the next request loads it again", async () => {
    const before = slotHosts();
    const s = await serve({
      crash_cooldown_ms: 2000,
      models: [{ id: 'crashy', task: 'vad', path: silero, lazy: false, max_batch_size: 1 }],
    });
    // crashy's one slot host (no other model of this server is used before the kills below).
    const mine = (): number[] => slotHosts().filter((p) => !before.includes(p));
    const marker = wav(0.5, 12345);
    // Its job aborts the host, runs again on the respawned one (a host keeps nothing between jobs)
    // and aborts that too: two crashes, the input's, then the 422. Twice: before issue 44 the
    // second request made the third crash in a minute and held the model back from everyone.
    for (const _ of [1, 2]) {
      const poisoned = await run(s, 'crashy', marker);
      expect(poisoned.status).toBe(422);
      expect(poisoned.body.error).toMatchObject({
        code: 'input_crashed_model',
        message: expect.stringMatching(/SIGABRT/),
      });
      expect((await run(s, 'crashy', fixture('Front_Left.wav'))).status).toBe(200); // the respawned slot
      expect(await status(s, 'crashy')).toMatchObject({ state: 'ready', last_error: null });
    }
    // Three crashes that no one input explains (its host killed): the model's own crash loop.
    // Each kill once the respawned host serves (a host killed while it loads fails the respawn).
    for (let i = 0; i < 3; i++) {
      const [host] = mine();
      process.kill(host, 'SIGKILL');
      if (i < 2) expect((await run(s, 'crashy', fixture('Front_Left.wav'))).status).toBe(200);
    }
    await until(async () => (await status(s, 'crashy')).state === 'unloaded', 5000);
    expect((await status(s, 'crashy')).last_error).toMatch(
      /^3 slot crashes within a minute; the last: slot failed: slot host was killed by SIGKILL/,
    );
    const held = await run(s, 'crashy', fixture('Front_Left.wav'));
    expect(held).toMatchObject({ status: 503, body: { error: { code: 'model_cooling_down' } } });
    expect(Number(held.retryAfter)).toBeGreaterThanOrEqual(1);
    expect(Number(held.retryAfter)).toBeLessThanOrEqual(2);
    expect((await status(s, 'crashy')).cool_down).toMatchObject({ failures: 1 });
    expect((await run(s, 'silero-vad', fixture('Front_Left.wav'))).status).toBe(200); // others unaffected
    await until(async () => (await status(s, 'crashy')).cool_down === null, 5000);
    const again = await run(s, 'crashy', fixture('Front_Left.wav'));
    expect(again.status).toBe(200);
    expect(again.body.segments.length).toBeGreaterThan(0);
  });

  it('waiting for a slot is bounded: behind a job that outlasts the busy timeout, a second request gets 503 within busy timeout + 100 ms (regression)', async () => {
    const s = await serve({
      busy_timeout_ms: 1000,
      job_timeout_ms: 0,
      models: [{ id: 'sluggish', task: 'vad', path: slowModel('sluggish', 400), lazy: false, max_batch_size: 1 }],
    });
    const first = run(s, 'sluggish', wav(0.3)); // ~10 windows x 400 ms in one job
    await new Promise((r) => setTimeout(r, 200));
    const t = performance.now();
    const second = await run(s, 'sluggish', wav(0.1));
    const waited = performance.now() - t;
    expect(second.status).toBe(503);
    expect(second.body.error.type).toBe('server_busy');
    expect(waited).toBeLessThan(1000 + 100);
    expect((await first).status).toBe(200);
  });

  it("a request's own busy_timeout_ms bounds its wait for a slot, and queue_ms counts that wait", async () => {
    const s = await serve({
      busy_timeout_ms: 0,
      job_timeout_ms: 0,
      models: [{ id: 'plodding', task: 'vad', path: slowModel('plodding', 150), lazy: false, max_batch_size: 1 }],
    });
    const first = run(s, 'plodding', wav(0.2)); // ~7 windows x 150 ms in one job
    await new Promise((r) => setTimeout(r, 100));
    const t = performance.now();
    const res = await fetch(`${s.url}/v1/tasks/run?model=plodding&busy_timeout_ms=300`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: new Uint8Array(wav(0.05)),
    });
    const waited = performance.now() - t;
    expect(res.status).toBe(503);
    expect((await res.json()).error.message).toMatch(/waited for a slot longer than the busy timeout \(300 ms\)/);
    expect(waited).toBeLessThan(300 + 150);
    expect((await first).status).toBe(200);
    // Unbounded, the same request waits for the slot, and says so in queue_ms.
    const again = run(s, 'plodding', wav(0.5)); // ~16 windows x 150 ms
    await new Promise((r) => setTimeout(r, 100));
    const patient = await run(s, 'plodding', wav(0.05));
    expect(patient.status).toBe(200);
    expect(patient.body.timing.queue_ms).toBeGreaterThan(400);
    await again;
  });
});

/** Pids of the slot-host child processes of this process (the test servers run in it). */
function slotHosts(): number[] {
  const pids: number[] = [];
  for (const pid of readdirSync('/proc').filter((d) => /^\d+$/.test(d))) {
    try {
      const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
      if (
        Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[1]) === process.pid &&
        readFileSync(`/proc/${pid}/cmdline`, 'utf8').includes('slot-worker')
      )
        pids.push(Number(pid));
    } catch {
      // exited meanwhile
    }
  }
  return pids;
}

describe('a wake-word slot host killed with SIGKILL', () => {
  it("a file sent while the only slot respawns starts from the model's state: silence scores as in REFERENCE.jsonl, and a group of two heads is served (regression)", async () => {
    const s = await serve({});
    const want = references().find((r) => r.file === 'silence_3s_16k.wav')!.wakeword_max!;
    // Every step after the warm-up is reported, so each head's highest score can be read off.
    const every = '&threshold=0.000001&refractory_ms=0';
    // The slot host serving the models: `alexa` starts one; the group shares it (wake-word models
    // share a family of hosts), as respawned after the first kill.
    let host = 0;
    for (const model of ['alexa', 'alexa,hey-jarvis']) {
      const before = slotHosts();
      expect((await run(s, model + every, fixture('silence_3s_16k.wav'))).status).toBe(200);
      const fresh = slotHosts().filter((p) => !before.includes(p));
      expect(fresh).toHaveLength(model === 'alexa' ? 1 : 0);
      if (model === 'alexa') host = fresh[0];
      process.kill(host, 'SIGKILL');
      // Reaped: the pool has seen the exit; its respawn waits 100 ms, then loads.
      await until(() => !existsSync(`/proc/${host}`), 3000);
      const res = await run(s, model + every, fixture('silence_3s_16k.wav'));
      const killed = host;
      [host] = slotHosts().filter((p) => !before.includes(p) && p !== killed);
      // Before the fix the session took its heads and initial embedding history from a live slot,
      // and there was none: "alexa" scored 0.79 on silence, the group answered 500.
      expect(res.status, JSON.stringify(res.body)).toBe(200);
      for (const head of model.split(',')) {
        const highest = Math.max(
          0,
          ...res.body.detections
            .filter((d: { label: string }) => d.label === head)
            .map((d: { score: number }) => d.score),
        );
        expect(Math.abs(highest - want[head.replace(/-/g, '_')]), `${model}: ${head} ${highest}`).toBeLessThan(0.02);
      }
    }
  });
});

describe('loads that do not finish', () => {
  it('a load over load_timeout_ms is abandoned: 500 naming it, its host processes killed, other models serve on; a FIFO as a model path is refused at once (503 model_unavailable)', async () => {
    const fifo = join(dir, 'fifo.onnx');
    execFileSync('mkfifo', [fifo]);
    const s = await serve({
      models: [
        { id: 'sloth', task: 'vad', path: silero, slots: 2, load_timeout_ms: 30 },
        { id: 'pipe', task: 'vad', path: fifo },
      ],
    });
    expect((await run(s, 'silero-vad', fixture('Front_Left.wav'))).status).toBe(200);
    const before = slotHosts().length;
    const t0 = performance.now();
    const slow = await run(s, 'sloth', fixture('Front_Left.wav'));
    expect(slow.status).toBe(500);
    expect(slow.body.error.message).toMatch(/loading took longer than load_timeout_ms \(30 ms\)/);
    expect(performance.now() - t0).toBeLessThan(1000);
    expect(await status(s, 'sloth')).toMatchObject({
      state: 'unloaded',
      last_error: expect.stringMatching(/load_timeout_ms/),
    });
    await until(() => slotHosts().length === before, 3000);
    expect((await run(s, 'silero-vad', fixture('Front_Left.wav'))).status).toBe(200);
    const t1 = performance.now();
    // Found at start (the config's files are checked then): 503 model_unavailable naming the entry (issue 43).
    const piped = await run(s, 'pipe', fixture('Front_Left.wav'));
    expect(piped.status).toBe(503);
    expect(piped.body.error.code).toBe('model_unavailable');
    expect(piped.body.error.message).toMatch(/models\[1\].*is not a regular file/);
    expect(performance.now() - t1).toBeLessThan(1000);
  });
});

describe('SIGTERM with a job that never returns in time', () => {
  it('`serve` exits 0 within drain_timeout_ms + 1 s: the host still running is killed', async () => {
    const DRAIN_MS = 1000;
    const config = join(dir, 'sigterm.json');
    writeFileSync(
      config,
      JSON.stringify({
        port: 0,
        drain_timeout_ms: DRAIN_MS,
        job_timeout_ms: 0,
        models: [{ id: 'forever', task: 'vad', path: slowModel('forever', 500), lazy: false, max_batch_size: 1 }],
      }),
    );
    const { child, url } = await spawnServer(['--config', config]);
    onTestFinished(() => void child.kill('SIGKILL'));
    const exited = new Promise<{ code: number | null; at: number }>((r) =>
      child.on('exit', (code) => r({ code, at: performance.now() })),
    );
    // ~94 windows x 500 ms: its first job alone is half a minute.
    const pending = fetch(`${url}/v1/tasks/run?model=forever`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: new Uint8Array(wav(3)),
    }).then(
      (r) => r.status,
      () => 0,
    );
    await until(async () => (await (await fetch(`${url}/v1/models/forever`)).json()).active_slots === 1);
    const t0 = performance.now();
    child.kill('SIGTERM');
    const exit = await exited;
    expect(exit.code).toBe(0);
    expect(exit.at - t0).toBeLessThan(DRAIN_MS + 1000);
    expect([0, 503]).toContain(await pending);
  });
});
