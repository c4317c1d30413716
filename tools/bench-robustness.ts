/**
 * Re-measures issue 25's figures on a real `voxserve serve` process (a child of this one), each
 * against a baseline measured in the same run (other processes on the machine load the CPU:
 * absolute times vary, ratios less):
 *
 *   node dist/tools/bench-robustness.js shutdown    # SIGTERM during a cold load with 4 slots
 *   node dist/tools/bench-robustness.js groups      # memory after 57 ad hoc wake-word groups
 *   node dist/tools/bench-robustness.js crashloop   # other clients' latency while a model crash-loops
 *   node dist/tools/bench-robustness.js memory      # main-process memory after wake-word streams, then idle
 *   node dist/tools/bench-robustness.js churn       # main-process memory after wake-word churn, then idle
 *
 * Each prints one JSON line of figures.
 */
import { copyFileSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import WebSocket from 'ws';
import { OWW_MODELS } from '../runtime/catalog.js';
import { defaultCatalog } from '../runtime/config.js';
import { processTree, treeRssBytes } from './proc.js';
import { spawnServer } from './spawn-server.js';
import { writeSyntheticModel } from './synth-model.js';

const root = fileURLToPath(new URL('../..', import.meta.url));
const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));
const MiB = 1024 * 1024;
const round = (x: number, d = 1): number => Math.round(x * 10 ** d) / 10 ** d;
const dir = mkdtempSync(join(tmpdir(), 'voxserve-robust-'));

/** Writes a config file and returns `--config` args. */
function config(name: string, body: Record<string, unknown>): string[] {
  const file = join(dir, `${name}.json`);
  writeFileSync(file, JSON.stringify({ port: 0, log_level: 'warn', ...body }));
  return ['--config', file];
}

/** Proportional set size of a process tree, bytes (shared pages split between their users). */
function treePss(pid: number): number {
  return processTree(pid).reduce((n, p) => {
    try {
      return n + Number(/^Pss:\s+(\d+) kB/m.exec(readFileSync(`/proc/${p}/smaps_rollup`, 'utf8'))?.[1] ?? 0) * 1024;
    } catch {
      return n;
    }
  }, 0);
}

/** One process's resident bytes. */
const ownRss = (pid: number): number =>
  Number(/VmRSS:\s+(\d+) kB/.exec(readFileSync(`/proc/${pid}/status`, 'utf8'))?.[1] ?? 0) * 1024;

/** The thread ids of a process now (`/proc/<pid>/task`; empty once it has exited). */
function threadIds(pid: number): number[] {
  try {
    return readdirSync(`/proc/${pid}/task`).map(Number);
  } catch {
    return [];
  }
}

/** A metric's value from `/metrics` (the first sample of that name). */
async function metric(url: string, name: string): Promise<number> {
  const text = await (await fetch(`${url}/metrics`)).text();
  const m = new RegExp(`^${name}(?:\\{[^}]*\\})? (\\S+)$`, 'm').exec(text);
  return m ? Number(m[1]) : Number.NaN;
}

const wav = (name: string): Uint8Array => new Uint8Array(readFileSync(join(root, 'spec/fixtures', name)));

/** A 16 kHz mono 16-bit WAV of `samples`, the first sample set to `first` (int16). */
function toneWav(samples: number, first?: number): Uint8Array {
  const b = Buffer.alloc(44 + samples * 2);
  b.write('RIFF', 0);
  b.writeUInt32LE(36 + samples * 2, 4);
  b.write('WAVEfmt ', 8);
  b.writeUInt32LE(16, 16);
  b.writeUInt16LE(1, 20);
  b.writeUInt16LE(1, 22);
  b.writeUInt32LE(16000, 24);
  b.writeUInt32LE(32000, 28);
  b.writeUInt16LE(2, 32);
  b.writeUInt16LE(16, 34);
  b.write('data', 36);
  b.writeUInt32LE(samples * 2, 40);
  for (let i = 0; i < samples; i++) b.writeInt16LE(Math.round(3000 * Math.sin(i / 10)), 44 + i * 2);
  if (first !== undefined) b.writeInt16LE(first, 44);
  return new Uint8Array(b);
}

async function post(url: string, path: string, body: Uint8Array | string, type = 'audio/wav') {
  const t0 = performance.now();
  const r = await fetch(`${url}${path}`, { method: 'POST', headers: { 'content-type': type }, body: body as BodyInit });
  const json = await r.json().catch(() => ({}));
  return { status: r.status, ms: performance.now() - t0, json, retryAfter: r.headers.get('retry-after') };
}

/**
 * SIGTERM while a model with 4 slots loads (a request and a management load wait on it): time to exit against
 * drain_timeout_ms.
 */
async function shutdown(): Promise<void> {
  const drain = 3000;
  const model = join(dir, 'big.onnx');
  await writeSyntheticModel(model, 150, 1); // 150 MiB of weights: each slot host takes a while to load
  const out: Record<string, unknown> = { drain_timeout_ms: drain, slots: 4, model_mib: 150 };
  const { child, url } = await spawnServer(
    config('shutdown', { drain_timeout_ms: drain, management: { enabled: true }, models_root: dir }),
  );
  const exited = new Promise<number>((r) => child.on('exit', () => r(performance.now())));
  // How long the load takes here, alone (the baseline): a management load of the same model under another id.
  const t0 = performance.now();
  const warm = await post(
    url,
    '/v1/models/load',
    JSON.stringify({ id: 'probe', task: 'vad', path: 'big.onnx', slots: 4 }),
    'application/json',
  );
  out.load_alone_ms = round(performance.now() - t0, 0);
  out.load_alone_status = warm.status;
  await post(url, '/v1/models/unload', JSON.stringify({ id: 'probe' }), 'application/json');
  const managed = post(
    url,
    '/v1/models/load',
    JSON.stringify({ id: 'big', task: 'vad', path: 'big.onnx', slots: 4 }),
    'application/json',
  );
  await sleep(300); // the load is under way
  const task = post(url, '/v1/tasks/run?model=big', toneWav(16000));
  await sleep(100);
  const t1 = performance.now();
  child.kill('SIGTERM');
  const [m, t] = await Promise.all([managed, task]);
  out.exit_after_sigterm_ms = round((await exited) - t1, 0);
  out.limit_ms = drain + 1000;
  out.management_load = { status: m.status, code: m.json?.error?.code };
  out.request = { status: t.status, code: t.json?.error?.code };
  console.log(JSON.stringify({ figure: 'shutdown during a cold load', ...out }));
}

/** 57 different ad hoc groups, one request each: the server's memory and processes, default cap against no cap. */
async function groups(): Promise<void> {
  const heads = ['alexa', 'hey-jarvis', 'hey-mycroft', 'hey-rhasspy', 'timer', 'weather'];
  const all = Array.from({ length: 63 }, (_, m) => heads.filter((_, i) => ((m + 1) >> i) & 1))
    .filter((g) => g.length >= 2)
    .map((g) => g.join(','));
  const audio = wav('espeak_alexa_16k.wav');
  const run = async (name: string, body: Record<string, unknown>) => {
    const { child, url } = await spawnServer(config(name, body));
    try {
      const pid = child.pid!;
      const base = { pss: treePss(pid), procs: processTree(pid).length };
      const t0 = performance.now();
      const statuses: Record<number, number> = {};
      for (const g of all) {
        const r = await post(url, `/v1/tasks/run?model=${g}`, audio);
        statuses[r.status] = (statuses[r.status] ?? 0) + 1;
      }
      const seconds = (performance.now() - t0) / 1000;
      await sleep(1000); // evicted groups' hosts exit
      const after = { pss: treePss(pid), procs: processTree(pid).length };
      return {
        groups: all.length,
        statuses,
        seconds: round(seconds),
        pss_mib: { before: round(base.pss / MiB, 0), after: round(after.pss / MiB, 0) },
        processes: { before: base.procs, after: after.procs },
        growth_ratio: round(after.pss / base.pss, 2),
      };
    } finally {
      child.kill('SIGKILL');
    }
  };
  const capped = await run('groups-default', {});
  const uncapped = await run('groups-nocap', { max_ad_hoc_groups: 0, ad_hoc_keep_alive_ms: 0 });
  console.log(JSON.stringify({ figure: '57 ad hoc groups', default_cap_8: capped, no_cap: uncapped }));
}

const percentile = (xs: number[], q: number): number => {
  const s = [...xs].sort((a, b) => a - b);
  return round(s[Math.min(s.length - 1, Math.floor(q * s.length))] ?? Number.NaN, 0);
};

/**
 * A model that crashes its slot host on some input (the test hook VOXSERVE_TEST_ABORT_AT): 30
 * crashing requests, while another client sends a request to another model every 100 ms. Its
 * latency before (the baseline) and during; the crashing model's loads; default cool-down
 * against none.
 */
async function crashloop(): Promise<void> {
  const ABORT_AT = 12345;
  process.env.VOXSERVE_TEST_ABORT_AT = String(ABORT_AT / 32768);
  const silero = defaultCatalog().find((m) => m.id === 'silero-vad')!.path;
  const good = wav('Front_Left.wav');
  const bad = toneWav(16000, ABORT_AT);
  // The other client runs while the 30 crashing requests go.
  const measure = async (name: string, body: Record<string, unknown>) => {
    const { child, url } = await spawnServer(
      config(name, {
        models: [
          { id: 'crashy', task: 'vad', path: silero, lazy: false },
          { id: 'good', task: 'vad', path: silero, lazy: false },
        ],
        ...body,
      }),
    );
    try {
      const other = async (stop: () => boolean): Promise<{ lat: number[]; failed: number }> => {
        const lat: number[] = [];
        let failed = 0;
        while (!stop()) {
          const r = await post(url, '/v1/tasks/run?model=good', good);
          if (r.status === 200) lat.push(r.ms);
          else failed++;
          await sleep(100);
        }
        return { lat, failed };
      };
      const end0 = performance.now() + 3000;
      const baseline = await other(() => performance.now() > end0);
      let done = false;
      const t0 = performance.now();
      const statuses: Record<number, number> = {};
      const crashing = (async () => {
        for (let i = 0; i < 30; i++) {
          const r = await post(url, '/v1/tasks/run?model=crashy', bad);
          statuses[r.status] = (statuses[r.status] ?? 0) + 1;
        }
        done = true;
      })();
      const [during] = await Promise.all([other(() => done), crashing]);
      const seconds = (performance.now() - t0) / 1000;
      const text = await (await fetch(`${url}/metrics`)).text();
      const crashyLoads = [...text.matchAll(/^voxserve_loads_total\{([^}]*)\} (\S+)$/gm)]
        .filter((m) => m[1].includes('model="crashy"'))
        .reduce((n, m) => n + Number(m[2]), 0);
      const status = await (await fetch(`${url}/v1/models/crashy`)).json();
      return {
        crashing_requests: statuses,
        seconds: round(seconds),
        crashy_loads: crashyLoads,
        crashy_cool_down: status.cool_down,
        other_client_ms: {
          baseline_p50: percentile(baseline.lat, 0.5),
          baseline_max: percentile(baseline.lat, 1),
          during_p50: percentile(during.lat, 0.5),
          during_max: percentile(during.lat, 1),
          during_failed: during.failed,
          ratio_p50: round(percentile(during.lat, 0.5) / percentile(baseline.lat, 0.5), 2),
        },
      };
    } finally {
      child.kill('SIGKILL');
    }
  };
  const withCoolDown = await measure('crash-default', {});
  const without = await measure('crash-off', { crash_cooldown_ms: 0 });
  console.log(
    JSON.stringify({
      figure: 'crash loop',
      default_crash_cooldown_ms_10000: withCoolDown,
      crash_cooldown_off: without,
    }),
  );
}

/**
 * Main-process memory after wake-word streams: `streams` concurrent WebSocket streams on `alexa`
 * send `seconds` of speech each as fast as the server takes it (an hour of audio in all by
 * default), then the server idles 15 s. RSS and external memory of the main process (not the
 * slot hosts), against its baseline after one warm-up stream.
 */
async function memory(): Promise<void> {
  const streams = Number(process.env.STREAMS ?? 16);
  const seconds = Number(process.env.SECONDS_EACH ?? 225); // 16 x 225 s = 1 h
  const { child, url } = await spawnServer(config('memory', { limits: { idle_ms: 0, heartbeat_ms: 0 } }));
  const pid = child.pid!;
  const speech = readFileSync(join(root, 'spec/fixtures/espeak_sentence_16k.wav')).subarray(44);
  const stream = (secs: number): Promise<void> =>
    new Promise((resolve, reject) => {
      const ws = new WebSocket(`${url.replace('http', 'ws')}/v1/stream?model=alexa`);
      ws.on('error', reject);
      ws.on('message', async (d) => {
        const e = JSON.parse(d.toString());
        if (e.type === 'ready') {
          const frames = Math.ceil((secs * 32000) / speech.length);
          for (let i = 0; i < frames; i++) {
            while (ws.bufferedAmount > 1 << 20) await sleep(5);
            ws.send(speech);
          }
          ws.send(JSON.stringify({ type: 'end' }));
        }
        if (e.type === 'done') ws.close();
      });
      ws.on('close', () => resolve());
    });
  const sample = async () => ({
    rss_mib: round(ownRss(pid) / MiB, 0),
    external_mib: round((await metric(url, 'voxserve_nodejs_external_memory_bytes')) / MiB, 0),
    heap_mib: round((await metric(url, 'voxserve_nodejs_heap_size_used_bytes')) / MiB, 0),
  });
  try {
    await stream(5);
    await sleep(2000);
    const baseline = await sample();
    const t0 = performance.now();
    await Promise.all(Array.from({ length: streams }, () => stream(seconds)));
    const ran = (performance.now() - t0) / 1000;
    const after = await sample();
    await sleep(15_000);
    const idle = await sample();
    console.log(
      JSON.stringify({
        figure: 'main-process memory after wake-word streams',
        streams,
        audio_s: streams * seconds,
        ran_s: round(ran),
        baseline,
        after_streams: after,
        after_15s_idle: idle,
        rss_ratio_idle: round(idle.rss_mib / baseline.rss_mib, 2),
        slot_hosts_rss_mib: round((treeRssBytes(pid) - ownRss(pid)) / MiB, 0),
      }),
    );
  } finally {
    child.kill('SIGKILL');
  }
}

/**
 * Issue 44 item 6: main-process memory after wake-word churn. A server with a watched wake-word
 * folder and management runs `ROUNDS` rounds (default 30) of: `STREAMS` (default 6) concurrent
 * WebSocket streams, each on an ad hoc group of 2-4 heads (embedded and folder heads, so groups
 * come and go past `max_ad_hoc_groups`), a managed head reconfigured (its `slots` changed) and
 * force-unloaded under a live stream, and the folder changed (a head copied in, the previous
 * round's removed). Then it idles `IDLE_S` (default 20) seconds. RSS (from /proc), heap used and
 * external memory (`/metrics`) of the main process, against the same process before the churn:
 * `cold` just after start, `warm` after one round and the same idle; and the threads the main
 * process started during the churn (`/proc/<pid>/task` polled each 100 ms, against its threads
 * once warm). `ISOLATION=thread` runs the slot hosts as threads of the main process. `FRAME_MS`
 * sends each stream's audio in frames of that many ms (default: the whole 5.8 s sentence as one
 * frame). `HOLD_S` keeps the server running that many seconds after the figures (to inspect it).
 * `streams_per_round` counts the `STREAMS` group streams plus the managed head's two. The managed
 * head's forced unload ends its never-ending stream each round: one `server_busy` error and one
 * close 1012 per round are expected.
 */
async function churn(): Promise<void> {
  const rounds = Number(process.env.ROUNDS ?? 30);
  const streams = Number(process.env.STREAMS ?? 6);
  const idleS = Number(process.env.IDLE_S ?? 20);
  const isolation = process.env.ISOLATION ?? 'process';
  const folder = join(dir, 'wakewords');
  mkdirSync(folder);
  const heads = ['alexa', 'hey_jarvis', 'hey_mycroft', 'hey_rhasspy', 'timer', 'weather'];
  const file = (h: string): string => join(OWW_MODELS, `${h}_v0.1.onnx`);
  copyFileSync(file('alexa'), join(folder, 'my_alexa_v0.1.onnx'));
  const { child, url } = await spawnServer(
    config('churn', {
      isolation,
      wakeword_dir: folder,
      management: { enabled: true },
      models_root: OWW_MODELS,
      limits: { idle_ms: 0, heartbeat_ms: 0 },
    }),
  );
  const pid = child.pid!;
  const speech = readFileSync(join(root, 'spec/fixtures/espeak_sentence_16k.wav')).subarray(44);
  // FRAME_MS: each WebSocket frame's audio, ms (default: the whole 5.8 s sentence in one frame).
  const frameBytes = Number(process.env.FRAME_MS ?? 0) * 32 || speech.length;
  const closes: Record<string, number> = {};
  const errors: Record<string, number> = {};
  /**
   * One stream on `model` sending `secs` of speech as fast as the server takes it (Infinity: one
   * frame each 50 ms until the server closes it); resolves on close, whatever its code.
   */
  const stream = (model: string, secs: number): Promise<void> =>
    new Promise((resolve) => {
      const ws = new WebSocket(`${url.replace('http', 'ws')}/v1/stream?model=${model}`);
      ws.on('error', () => {});
      ws.on('message', async (d) => {
        const e = JSON.parse(d.toString());
        if (e.type === 'ready') {
          const frames = Math.ceil((secs * 32000) / frameBytes);
          for (let i = 0; i < frames && ws.readyState === WebSocket.OPEN; i++) {
            while (ws.bufferedAmount > 1 << 20) await sleep(5);
            const at = (i * frameBytes) % speech.length;
            ws.send(speech.subarray(at, at + frameBytes));
            if (secs === Number.POSITIVE_INFINITY) await sleep(50);
          }
          if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: 'end' }));
        }
        if (e.type === 'done') ws.close();
        if (e.type === 'error' && process.env.DEBUG) console.error(model, e.error?.message);
        if (e.type === 'error') errors[e.error?.type] = (errors[e.error?.type] ?? 0) + 1;
      });
      ws.on('close', (code) => {
        closes[code] = (closes[code] ?? 0) + 1;
        resolve();
      });
    });
  const json = (path: string, body: unknown) => post(url, path, JSON.stringify(body), 'application/json');
  const statuses: Record<string, number> = {};
  const count = (what: string, status: number) => {
    statuses[`${what} ${status}`] = (statuses[`${what} ${status}`] ?? 0) + 1;
  };
  let folderHead = 'my_alexa';
  /** One round of churn (`r` picks its groups and files). */
  const round1 = async (r: number): Promise<void> => {
    const names = [...heads.map((h) => h.replaceAll('_', '-')), folderHead.replaceAll('_', '-')];
    const groups = Array.from({ length: streams }, (_, i) => {
      const size = 2 + ((r + i) % 3);
      return Array.from({ length: size }, (_, k) => names[(r * 5 + i * 3 + k * 2) % names.length]);
    }).map((g) => [...new Set(g)].join(','));
    const live = groups.map((g) => stream(g, 4));
    // A managed head, loaded by the management API.
    const load = await json('/v1/models/load', {
      id: 'managed',
      task: 'wakeword',
      path: `${heads[r % heads.length]}_v0.1.onnx`,
      slots: 1 + (r % 2),
    });
    count('load', load.status);
    // Reconfigured while a stream runs on it (the reconfigure waits for it), then force-unloaded under a stream that
    // would never end.
    const short = stream('managed', 4);
    await sleep(300);
    count('reconfigure', (await json('/v1/models/load', { id: 'managed', slots: 2 - (r % 2) })).status);
    await short;
    const onManaged = stream('managed', Number.POSITIVE_INFINITY);
    await sleep(500);
    count('unload', (await json('/v1/models/unload', { id: 'managed', force: true })).status);
    // The folder changes: a new head in, the previous one out.
    const next = `w${r}_${heads[r % heads.length]}`;
    copyFileSync(file(heads[r % heads.length]), join(folder, `${next}_v0.1.onnx`));
    rmSync(join(folder, `${folderHead}_v0.1.onnx`), { force: true });
    folderHead = next;
    await Promise.all([...live, onManaged]);
    const id = next.replaceAll('_', '-');
    for (let t = 0; t < 100; t++) {
      const listed = (await (await fetch(`${url}/v1/models`)).json()) as { models: { id: string }[] };
      if (listed.models.some((m) => m.id === id)) break;
      await sleep(100);
    }
    // A forced unload of one of this round's groups, idle by now.
    count('unload group', (await json('/v1/models/unload', { id: groups[0], force: true })).status);
  };
  const sample = async () => {
    const text = await (await fetch(`${url}/metrics`)).text();
    const m = (name: string): number => Number(new RegExp(`^${name} (\\S+)$`, 'm').exec(text)?.[1] ?? Number.NaN);
    return {
      rss_mib: round(ownRss(pid) / MiB, 0),
      heap_mib: round(m('voxserve_nodejs_heap_size_used_bytes') / MiB, 0),
      external_mib: round(m('voxserve_nodejs_external_memory_bytes') / MiB, 0),
      threads: threadIds(pid).length,
      metric_series: text.split('\n').filter((l) => l && !l.startsWith('#')).length,
    };
  };
  /** Unloads every model, then idles `idleS` (the idle collection runs). */
  const unloadAll = async (): Promise<void> => {
    count('unload_all', (await post(url, '/v1/models/unload_all', '{}', 'application/json')).status);
    await sleep(idleS * 1000);
  };
  /** SIGUSR2 to the server: a heap snapshot when it runs with `--heapsnapshot-signal=SIGUSR2`. */
  const snapshot = async (): Promise<void> => {
    if (!(process.env.VOXSERVE_SERVER_NODE_ARGS ?? '').includes('heapsnapshot-signal')) return;
    child.kill('SIGUSR2');
    await sleep(5000);
  };
  try {
    await sleep(1000);
    const cold = await sample();
    await round1(0);
    await sleep(idleS * 1000);
    const warmLoaded = await sample();
    await unloadAll();
    const warm = await sample();
    await snapshot();
    // The main process's threads, polled through the churn: any not there once warm was started by it.
    const warmThreads = new Set(threadIds(pid));
    const seen = new Set<number>();
    const poll = setInterval(() => {
      for (const t of threadIds(pid)) seen.add(t);
    }, 100);
    const t0 = performance.now();
    for (let r = 1; r <= rounds; r++) await round1(r);
    const ran = (performance.now() - t0) / 1000;
    clearInterval(poll);
    const started = [...seen].filter((t) => !warmThreads.has(t)).length;
    const after = await sample();
    await sleep(idleS * 1000);
    const idleLoaded = await sample();
    const hosts = round((treeRssBytes(pid) - ownRss(pid)) / MiB, 0);
    await unloadAll();
    const idle = await sample();
    await snapshot();
    console.log(
      JSON.stringify({
        figure: 'main-process memory after wake-word churn',
        isolation,
        rounds,
        frame_bytes: frameBytes,
        streams_per_round: streams + 2,
        ran_s: round(ran),
        statuses,
        closes,
        errors,
        cold,
        warm_models_loaded: warmLoaded,
        warm,
        after_churn: after,
        [`after_${idleS}s_idle_models_loaded`]: idleLoaded,
        after_unload_all_and_idle: idle,
        rss_ratio_idle_vs_cold: round(idle.rss_mib / cold.rss_mib, 2),
        rss_ratio_idle_vs_warm: round(idle.rss_mib / warm.rss_mib, 2),
        rss_ratio_loaded_vs_warm_loaded: round(idleLoaded.rss_mib / warmLoaded.rss_mib, 2),
        heap_ratio_idle_vs_warm: round(idle.heap_mib / warm.heap_mib, 2),
        threads_started_during_churn: started,
        slot_hosts_rss_mib_models_loaded: hosts,
      }),
    );
    await sleep(Number(process.env.HOLD_S ?? 0) * 1000);
  } finally {
    child.kill('SIGKILL');
  }
}

const what = process.argv[2];
const runs: Record<string, () => Promise<void>> = { shutdown, groups, crashloop, memory, churn };
if (!runs[what]) {
  console.error(`usage: bench-robustness ${Object.keys(runs).join('|')}`);
  process.exit(2);
}
await runs[what]();
process.exit(0);
