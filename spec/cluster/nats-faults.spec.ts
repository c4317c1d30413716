/**
 * NATS misbehaving (issue 40, "Why", the second list; "What to build": every wait bounded by a
 * deadline): real `voxserve serve --cluster` processes and real nats-server processes on
 * loopback. Each test is one failure of that list and asserts only what a user sees (HTTP status,
 * body and timing, `/ready`, `GET /v1/cluster`, `GET /debug/state`'s `cluster`, a process's exit
 * and stderr), each wait bounded so that a regression fails in bounded time instead of hanging:
 * 1. NATS restarted without its JetStream store: the nodes see each other again within a few
 *    heartbeats, the buckets exist again, a request for a model another node holds is answered
 *    (200) or refused (503) within its busy timeout, and cold placements work again.
 * 2. NATS frozen (SIGSTOP): `/ready` and `/debug/state` say disconnected within a few heartbeats,
 *    a request for a model held remotely is answered within its busy timeout, a cold model loads
 *    here meanwhile; after SIGCONT the cluster is connected again.
 * 3. A second process with the same node name is refused at join, naming the first one's URL; the
 *    first keeps serving.
 * 4. A 2.4 MiB tensor request (limit 16 MiB; NATS's max_payload is 1 MB) on a model another node
 *    holds gives the holder's own answer.
 * 5. A load lock left by a dead node whose clock was 40 s fast is taken over within about
 *    `lock_ms` of the reader's clock, not 40 s later.
 * 6. A model loaded with `{"node": "c"}` that only c registers is usable from every node.
 * 7. A cluster-wide unload during a cold placement lets the request under way finish (200), then
 *    unloads, as on a single node.
 * Then what testers found (each names it): among them a cold request arriving as NATS freezes
 * loads the model here once the loss is noticed, a node paused past its heartbeats whose name a
 * newcomer took gives it up when it wakes, and a client leaving drops its job at the holder too.
 * The nodes run the compiled CLI (`npm run build` first); nats-server is Debian's (/usr/sbin).
 * Each node: `port: 0`, threads for slots, management on, `heartbeat_ms` 1000, `job_deadline_ms`
 * 3000; `CLUSTER_LOG=info` shows the nodes' logs.
 */
import { type ChildProcess, spawn, spawnSync } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { Kvm } from '@nats-io/kv';
import { connect } from '@nats-io/transport-node';
import { pack, unpack } from 'msgpackr';
import { afterAll, afterEach, describe, expect, it } from 'vitest';
import { OWW_MELSPECTROGRAM } from '../../runtime/catalog.js';
import { spawnServer } from '../../tools/spawn-server.js';
import { fixture, metric } from '../helpers.js';
import { startNats, type NatsServer } from './nats-server.js';

/** Every node's heartbeat, ms: "a few heartbeats" below are counted in it. */
const HEARTBEAT_MS = 1000;
/** The busy timeout of the tests that bound a remote request by it, ms. */
const BUSY_MS = 3000;
const WAKE_FILE = 'espeak_hey_jarvis_22k.wav';
const SHORT_FILE = 'Front_Center.wav';

interface Node {
  name: string;
  url: string;
  child: ChildProcess;
}

const dir = mkdtempSync(join(tmpdir(), 'voxserve-nats-faults-'));
/** The current test's processes, killed (and their NATS stopped) after it, passed or not. */
let children: ChildProcess[] = [];
let servers: NatsServer[] = [];

afterEach(async () => {
  for (const c of children) {
    c.kill('SIGCONT');
    c.kill('SIGKILL');
  }
  children = [];
  for (const s of servers) {
    s.proc.kill('SIGCONT');
    await s.stop();
  }
  servers = [];
});

afterAll(() => {
  rmSync(dir, { recursive: true, force: true });
});

async function nats(port?: number): Promise<NatsServer> {
  const s = await startNats([], port);
  servers.push(s);
  return s;
}

/** The config file of node `name` on `natsUrl` (`extra` merged in; its `cluster` into the cluster's). */
function configFile(natsUrl: string, name: string, extra: Record<string, unknown> = {}): string {
  const file = join(dir, `${name}-${Date.now()}-${Math.random().toString(36).slice(2, 8)}.json`);
  writeFileSync(
    file,
    JSON.stringify({
      port: 0,
      log_level: process.env.CLUSTER_LOG ?? 'warn',
      isolation: 'thread',
      management: { enabled: true },
      ...extra,
      cluster: {
        nats: natsUrl,
        node: name,
        heartbeat_ms: HEARTBEAT_MS,
        job_deadline_ms: 3000,
        ...(extra.cluster as Record<string, unknown> | undefined),
      },
    }),
  );
  return file;
}

/** `voxserve serve --cluster` as a child process named `name`, ready (bounded: 60 s). */
async function startNode(natsUrl: string, name: string, extra: Record<string, unknown> = {}): Promise<Node> {
  let started: ChildProcess | undefined;
  const spawning = spawnServer(['--config', configFile(natsUrl, name, extra)]).then((r) => {
    started = r.child;
    children.push(r.child);
    return r;
  });
  const { child, url } = await within(spawning, 60_000, `node ${name} not ready in 60 s`).catch((e) => {
    started?.kill('SIGKILL');
    throw e;
  });
  if (process.env.CLUSTER_LOG) {
    child.stderr!.on('data', (d) => process.stderr.write(`[${name}] ${d}`));
    child.stdout!.on('data', (d) => process.stderr.write(`[${name}] ${d}`));
  }
  return { name, url, child };
}

/** `p`, or a rejection with `message` after `ms`. */
function within<T>(p: Promise<T>, ms: number, message: string): Promise<T> {
  let t: NodeJS.Timeout | undefined;
  return Promise.race([
    p,
    new Promise<never>((_, reject) => {
      t = setTimeout(() => reject(new Error(message)), ms);
    }),
  ]).finally(() => clearTimeout(t));
}

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

/** A response: status (0 when none came within the bound: `body` then says why), body, and how long it took. */
interface Answer {
  status: number;
  body: any;
  ms: number;
}

/** `fetch` bounded by `ms` (never throws: no answer is status 0). The body is JSON, or msgpack when so typed. */
async function call(url: string, init: RequestInit = {}, ms = 10_000): Promise<Answer> {
  const t0 = Date.now();
  try {
    const res = await fetch(url, { ...init, signal: AbortSignal.timeout(ms) });
    const bytes = Buffer.from(await res.arrayBuffer());
    const type = res.headers.get('content-type') ?? '';
    let body: unknown = bytes.toString();
    if (type.includes('msgpack')) body = unpack(bytes);
    else if (type.includes('json')) body = JSON.parse(bytes.toString());
    return { status: res.status, body, ms: Date.now() - t0 };
  } catch (e) {
    return { status: 0, body: `no answer: ${(e as Error).message}`, ms: Date.now() - t0 };
  }
}

const post = (url: string, body: unknown, ms?: number): Promise<Answer> =>
  call(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) }, ms);

/** `POST /v1/tasks/run` of a fixture, bounded by `ms`. */
const runFile = (url: string, model: string, file: string, ms?: number): Promise<Answer> =>
  call(
    `${url}/v1/tasks/run?model=${model}`,
    { method: 'POST', headers: { 'content-type': 'audio/wav' }, body: new Uint8Array(fixture(file)) },
    ms,
  );

/**
 * Polls `pred` every 50 ms until it holds; false when it did not within `ms` (never throws: a failed poll is false).
 */
async function eventually(pred: () => Promise<boolean>, ms: number): Promise<boolean> {
  const end = Date.now() + ms;
  for (;;) {
    if (await pred().catch(() => false)) return true;
    if (Date.now() >= end) return false;
    await sleep(50);
  }
}

/** The node names `url`'s `GET /v1/cluster` lists. */
async function members(url: string): Promise<string[]> {
  const r = await call(`${url}/v1/cluster`, {}, 2000);
  return r.status === 200 ? (r.body.nodes as { node: string }[]).map((n) => n.node).sort() : [];
}

/** The node names `url`'s `GET /v1/cluster` lists with a heartbeat heard within the last 2 (itself included). */
async function heard(url: string): Promise<string[]> {
  const r = await call(`${url}/v1/cluster`, {}, 2000);
  if (r.status !== 200) return [];
  return (r.body.nodes as { node: string; last_seen_ms: number }[])
    .filter((n) => n.last_seen_ms <= 2 * HEARTBEAT_MS)
    .map((n) => n.node)
    .sort();
}

/** `url`'s `GET /v1/cluster` nodes as `name last_seen_ms`, for messages. */
async function lastSeen(url: string): Promise<string> {
  const r = await call(`${url}/v1/cluster`, {}, 2000);
  if (r.status !== 200) return `status ${r.status}`;
  return (r.body.nodes as { node: string; last_seen_ms: number }[])
    .map((n) => `${n.node} seen ${n.last_seen_ms} ms ago`)
    .join(', ');
}

/** The nodes holding `model` ready as `GET /v1/models` on `url` reports them. */
async function holders(url: string, model: string): Promise<string[]> {
  const r = await call(`${url}/v1/models`, {}, 2000);
  if (r.status !== 200) return [];
  return (r.body.models.find((m: { id: string }) => m.id === model)?.nodes ?? [])
    .filter((n: { state: string }) => n.state === 'ready')
    .map((n: { node: string }) => n.node)
    .sort();
}

/**
 * Starts the nodes `names` on `natsUrl` (each with `extra[name]`), waits until every node lists
 * all of them, and loads each of `models` on `holder` alone (management, `node`), until every
 * node sees `holder` as its only holder.
 */
async function cluster(
  natsUrl: string,
  names: string[],
  holder: string | null,
  models: string[],
  extra: Record<string, Record<string, unknown>> = {},
): Promise<Record<string, Node>> {
  const started = await Promise.all(names.map((n) => startNode(natsUrl, n, extra[n])));
  const nodes = Object.fromEntries(started.map((n) => [n.name, n]));
  for (const n of started)
    if (!(await eventually(async () => (await members(n.url)).length === names.length, 30_000)))
      throw new Error(`setup: ${n.name} does not list ${names.join(', ')} after 30 s`);
  for (const model of models) {
    const r = await post(`${started[0].url}/v1/models/load`, { id: model, node: holder }, 60_000);
    if (r.status !== 200) throw new Error(`setup: load ${model} on ${holder}: ${r.status} ${JSON.stringify(r.body)}`);
    for (const n of started)
      if (!(await eventually(async () => (await holders(n.url, model)).join() === holder, 10_000)))
        throw new Error(`setup: ${n.name} does not see ${holder} holding ${model}`);
  }
  return nodes;
}

/** `/ready`'s `cluster.nats` (`connected`, `disconnected`) on `url`, or why there is none. */
async function readyNats(url: string): Promise<string> {
  const r = await call(`${url}/ready`, {}, 1000);
  return r.status === 200 ? String(r.body.cluster?.nats) : `status ${r.status}`;
}

/**
 * `GET /debug/state`'s `cluster.active` on `url` (the membership chart's active states): [] when absent, the status
 * when not 200.
 */
async function clusterActive(url: string): Promise<string[]> {
  const r = await call(`${url}/debug/state`, {}, 1000);
  if (r.status !== 200) return [`(GET /debug/state: ${r.status})`];
  const active = r.body.cluster?.active;
  return Array.isArray(active) ? active.map(String) : [];
}

/** Whether `active` (a list of active state names or paths, e.g. `link.disconnected`) names `state`. */
const names = (active: string[], state: string): boolean => active.some((a) => a.split('.').includes(state));

describe('NATS restarted without its JetStream store (a container without a volume)', () => {
  it('the nodes see each other again, the buckets exist again, a remote request is answered within its busy timeout, cold placements work', async () => {
    const n0 = await nats();
    const { A, C } = await cluster(n0.url, ['A', 'C'], 'C', ['silero-vad'], {
      A: { busy_timeout_ms: BUSY_MS },
      C: { busy_timeout_ms: BUSY_MS },
    });
    // A's remote pool to C is warm.
    expect((await runFile(A.url, 'silero-vad', SHORT_FILE)).status).toBe(200);
    // NATS goes, and a new one (empty store) comes up on the same port.
    await n0.halt();
    const n1 = await nats(n0.port);
    const back = Date.now();
    // A request for the model C holds, asked as NATS is back: answered or refused within its busy timeout.
    const first = await runFile(A.url, 'silero-vad', SHORT_FILE, BUSY_MS + 10_000);
    expect
      .soft([200, 503], `first request after the restart: ${first.status} ${JSON.stringify(first.body)}`)
      .toContain(first.status);
    expect.soft(first.ms, 'first request after the restart: ms to its answer').toBeLessThanOrEqual(BUSY_MS + 2000);
    // Each node hears the other again within a few heartbeats of NATS coming back: looked at past
    // the grace a node gives the others when its own connection comes back (3 heartbeats), each
    // node with a heartbeat heard within the last 2.
    await sleep(Math.max(0, back + 4 * HEARTBEAT_MS - Date.now()));
    const seen = await eventually(
      async () => (await heard(A.url)).join() === 'A,C' && (await heard(C.url)).join() === 'A,C',
      Math.max(0, back + 12 * HEARTBEAT_MS - Date.now()),
    );
    expect
      .soft(
        seen,
        `GET /v1/cluster 12 heartbeats after NATS came back (nodes heard within 2 heartbeats): A ${await lastSeen(A.url)}, C ${await lastSeen(C.url)}`,
      )
      .toBe(true);
    // The registry and lock buckets were created again on the new server.
    const nc = await connect({ servers: n1.url, timeout: 2000 });
    try {
      const buckets: string[] = [];
      await within(
        (async () => {
          for await (const s of new Kvm(nc).list()) buckets.push(s.bucket);
        })(),
        5000,
        'listing the buckets took over 5 s',
      ).catch(() => {});
      expect
        .soft(buckets.sort(), 'the key-value buckets on the new NATS')
        .toEqual(['voxserve_locks', 'voxserve_nodes']);
    } finally {
      await nc.close();
    }
    // A request for the model C holds, now that the reconnect's grace is over: answered or refused within its busy
    // timeout.
    const later = await runFile(A.url, 'silero-vad', SHORT_FILE, BUSY_MS + 10_000);
    expect
      .soft([200, 503], `remote request past the grace: ${later.status} ${JSON.stringify(later.body)}`)
      .toContain(later.status);
    expect.soft(later.ms, 'remote request past the grace: ms to its answer').toBeLessThanOrEqual(BUSY_MS + 2000);
    // A cold placement (no node holds hey-jarvis) works again.
    const cold = await runFile(A.url, 'hey-jarvis', WAKE_FILE, 30_000);
    expect.soft(cold.status, `cold placement after the restart: ${JSON.stringify(cold.body)}`).toBe(200);
    // And the model C holds is served through C.
    const last = await runFile(A.url, 'silero-vad', SHORT_FILE, BUSY_MS + 10_000);
    expect.soft(last.status, `remote request at the end: ${JSON.stringify(last.body)}`).toBe(200);
  }, 150_000);
});

describe('NATS frozen (SIGSTOP: a partition, a paused server)', () => {
  it('/ready and /debug/state say disconnected within a few heartbeats, a remote request is answered within its busy timeout, a cold model loads here, and all is connected after SIGCONT', async () => {
    const n = await nats();
    const { A, C } = await cluster(n.url, ['A', 'C'], 'C', ['silero-vad'], {
      A: { busy_timeout_ms: BUSY_MS, debug: { inspect: true } },
      C: { busy_timeout_ms: BUSY_MS, debug: { inspect: true } },
    });
    expect((await runFile(A.url, 'silero-vad', SHORT_FILE)).status).toBe(200);
    expect(await readyNats(A.url)).toBe('connected');
    expect.soft(await clusterActive(A.url), "/debug/state's cluster.active with NATS up").toContain('connected');
    n.proc.kill('SIGSTOP');
    const frozen = Date.now();
    const bound = 3 * HEARTBEAT_MS + 2000;
    // NATS loss noticed within a few heartbeats, on both nodes.
    for (const x of [A, C]) {
      const noticed = await eventually(
        async () => (await readyNats(x.url)) === 'disconnected',
        Math.max(0, frozen + bound - Date.now()),
      );
      expect
        .soft(noticed, `${x.name}'s /ready ${bound} ms after NATS froze: nats ${await readyNats(x.url)}`)
        .toBe(true);
    }
    const active = await clusterActive(A.url);
    expect
      .soft(names(active, 'disconnected'), `A's /debug/state cluster.active with NATS frozen: ${active}`)
      .toBe(true);
    // A request for the model C holds: answered (or refused) within its busy timeout.
    const remote = await runFile(A.url, 'silero-vad', SHORT_FILE, BUSY_MS + 10_000);
    expect
      .soft([200, 503], `remote request with NATS frozen: ${remote.status} ${JSON.stringify(remote.body)}`)
      .toContain(remote.status);
    expect.soft(remote.ms, 'remote request with NATS frozen: ms to its answer').toBeLessThanOrEqual(BUSY_MS + 2000);
    // A model no node holds loads here meanwhile (a local load does not need NATS).
    const cold = await runFile(A.url, 'hey-jarvis', WAKE_FILE, BUSY_MS + 15_000);
    expect.soft(cold.status, `cold model with NATS frozen: ${JSON.stringify(cold.body)} after ${cold.ms} ms`).toBe(200);
    expect.soft(cold.ms, 'cold model with NATS frozen: ms').toBeLessThanOrEqual(BUSY_MS + 10_000);
    // NATS resumes: the cluster is connected again and sees itself.
    n.proc.kill('SIGCONT');
    const resumed = Date.now();
    const recovered = await eventually(
      async () =>
        (await readyNats(A.url)) === 'connected' &&
        (await readyNats(C.url)) === 'connected' &&
        (await members(A.url)).join() === 'A,C',
      15_000,
    );
    expect.soft(recovered, `/ready and /v1/cluster 15 s after SIGCONT: A ${await readyNats(A.url)}`).toBe(true);
    const after = await eventually(async () => names(await clusterActive(A.url), 'connected'), 5000);
    expect.soft(after, `A's /debug/state cluster.active after SIGCONT: ${await clusterActive(A.url)}`).toBe(true);
    const last = await runFile(A.url, 'silero-vad', SHORT_FILE, BUSY_MS + 10_000);
    expect
      .soft(last.status, `remote request after SIGCONT (${Date.now() - resumed} ms): ${JSON.stringify(last.body)}`)
      .toBe(200);
  }, 150_000);
});

describe('two processes started with the same node name', () => {
  it('the second is refused at join with a message naming the first one’s URL; the first keeps serving', async () => {
    const n = await nats();
    const first = await startNode(n.url, 'dup');
    expect((await runFile(first.url, 'silero-vad', SHORT_FILE)).status).toBe(200);
    // The second, spawned by hand: its exit code and whole stderr are what is checked.
    const cli = fileURLToPath(new URL('../../dist/tools/cli.js', import.meta.url));
    const second = spawn(process.execPath, [cli, 'serve', '--config', configFile(n.url, 'dup')], {
      stdio: ['ignore', 'ignore', 'pipe'],
    });
    children.push(second);
    let stderr = '';
    second.stderr!.on('data', (d: Buffer) => {
      stderr += d.toString();
    });
    const exit = await within(
      new Promise<number | null>((r) => second.once('exit', (code) => r(code))),
      20_000,
      'still running 20 s after it was started',
    ).catch((e: Error) => e);
    expect
      .soft(exit, `the second "dup": ${exit instanceof Error ? exit.message : `exit ${exit}`}; stderr: ${stderr}`)
      .not.toBeInstanceOf(Error);
    expect.soft(exit, `the second "dup"'s exit code; stderr: ${stderr}`).not.toBe(0);
    expect.soft(stderr, 'the refusal names the first process').toContain(first.url);
    // The first is untouched.
    expect(first.child.exitCode).toBe(null);
    expect((await call(`${first.url}/ready`, {}, 2000)).status).toBe(200);
    expect(await members(first.url)).toEqual(['dup']);
    const r = await runFile(first.url, 'silero-vad', SHORT_FILE);
    expect(r.status).toBe(200);
  }, 90_000);
});

describe('a node paused past its heartbeats while a newcomer took its name (a tester found it, issue 40)', () => {
  it('gives the name up when it wakes (exit 1, naming the newcomer), and the newcomer keeps it: no job runs twice', async () => {
    const n = await nats();
    const old = await startNode(n.url, 'pz');
    let stderr = '';
    old.child.stderr!.on('data', (d: Buffer) => {
      stderr += d.toString();
    });
    expect((await runFile(old.url, 'silero-vad', SHORT_FILE)).status).toBe(200);
    // Paused past 2.5 heartbeats: a newcomer under the same name takes its entry for a dead process's and joins.
    old.child.kill('SIGSTOP');
    await sleep(3 * HEARTBEAT_MS);
    const newcomer = await startNode(n.url, 'pz');
    old.child.kill('SIGCONT');
    // Its next heartbeat finds the newcomer's entry: it leaves instead of writing its own over it.
    const exit = await within(
      new Promise<number | null>((r) =>
        old.child.exitCode !== null ? r(old.child.exitCode) : old.child.once('exit', (code) => r(code)),
      ),
      15_000,
      'the woken node still running 15 s after SIGCONT',
    ).catch((e: Error) => e);
    expect.soft(exit, `the woken node; stderr: ${stderr}`).toBe(1);
    expect.soft(stderr, 'its message names the newcomer').toContain(newcomer.url);
    // The newcomer holds the name: the registry's entry is its own, and it serves.
    const r = await call(`${newcomer.url}/v1/cluster`, {}, 2000);
    const entry = (r.body.nodes as { node: string; url: string }[]).find((x) => x.node === 'pz');
    expect(entry?.url).toBe(newcomer.url);
    expect((await runFile(newcomer.url, 'silero-vad', SHORT_FILE)).status).toBe(200);
  }, 120_000);
});

describe('a tensor request larger than NATS max_payload (1 MB) on a model another node holds', () => {
  it('2.4 MiB of input (the limit is 16 MiB) gives the holder’s own answer', async () => {
    const n = await nats();
    const mel = { id: 'mel', task: 'tensor', path: OWW_MELSPECTROGRAM };
    const { A, C } = await cluster(n.url, ['A', 'C'], 'C', ['mel'], { A: { models: [mel] }, C: { models: [mel] } });
    // 629,146 float32 samples (2.4 MiB): a ramp, so the answer depends on every part of it.
    const input = Float32Array.from({ length: 629_146 }, (_, i) => ((i % 32_000) - 16_000) / 2);
    const body = new Uint8Array(
      pack({
        model: 'mel',
        inputs: { input: { dtype: 'float32', shape: [1, input.length], data: Buffer.from(input.buffer) } },
      }),
    );
    const run = (url: string): Promise<Answer> =>
      call(`${url}/v1/tasks/run`, { method: 'POST', headers: { 'content-type': 'application/msgpack' }, body }, 30_000);
    const onHolder = await run(C.url);
    expect(onHolder.status, JSON.stringify(onHolder.body)).toBe(200);
    const remote = await run(A.url);
    expect(remote.status, `on A (held by C): ${JSON.stringify(remote.body)}`).toBe(200);
    const { output } = remote.body.outputs;
    expect(output.shape).toEqual(onHolder.body.outputs.output.shape);
    expect(Buffer.from(output.data).equals(Buffer.from(onHolder.body.outputs.output.data))).toBe(true);
  }, 120_000);
});

describe('a load lock left by a dead node whose clock was 40 s fast', () => {
  const LOCK_MS = 1500;

  it('is taken over within about lock_ms of the reader’s clock, and the model placed', async () => {
    const n = await nats();
    const { A } = await cluster(n.url, ['A'], null, [], { A: { cluster: { lock_ms: LOCK_MS } } });
    // The dead placer's lock as cluster/nats.ts writes it (bucket `<subject_prefix>_locks`, key
    // `load.<base64url of the id>`): its deadline by a clock 40 s ahead of this one, never renewed.
    const nc = await connect({ servers: n.url, timeout: 2000 });
    try {
      const locks = await new Kvm(nc).open('voxserve_locks');
      await locks.put(
        `load.${Buffer.from('silero-vad').toString('base64url')}`,
        JSON.stringify({ owner: 'fast', token: 'f00d', model: 'silero-vad', deadline: Date.now() + 40_000 + LOCK_MS }),
      );
    } finally {
      await nc.close();
    }
    const bound = 2 * LOCK_MS + 3000;
    const r = await runFile(A.url, 'silero-vad', SHORT_FILE, bound + 2000);
    expect(r.status, `a request for silero-vad on A: ${JSON.stringify(r.body)} after ${r.ms} ms`).toBe(200);
    expect(r.ms, 'ms to place silero-vad past the stale lock').toBeLessThan(bound);
    expect(await holders(A.url, 'silero-vad')).toEqual(['A']);
  }, 90_000);
});

describe('a model loaded with {"node": "c"} that only c registers', () => {
  it('is usable from every node, as every node lists it', async () => {
    const n = await nats();
    const nodes = await cluster(n.url, ['a', 'b', 'c'], null, []);
    // A tensor model id in no node's config or catalog (a file the server ships, so inside any
    // models_root): c registers it from the load's fields.
    const load = await post(
      `${nodes.a.url}/v1/models/load`,
      { id: 'mel-on-c', task: 'tensor', path: OWW_MELSPECTROGRAM, node: 'c' },
      60_000,
    );
    expect(load.status, JSON.stringify(load.body)).toBe(200);
    const input = Float32Array.from({ length: 1280 }, (_, i) => (i % 640) - 320);
    const body = JSON.stringify({
      model: 'mel-on-c',
      inputs: { input: { dtype: 'float32', shape: [1, input.length], data: [...input] } },
    });
    const run = (url: string): Promise<Answer> =>
      call(`${url}/v1/tasks/run`, { method: 'POST', headers: { 'content-type': 'application/json' }, body }, 30_000);
    const onC = await run(nodes.c.url);
    expect(onC.status, JSON.stringify(onC.body)).toBe(200);
    for (const x of [nodes.a, nodes.b]) {
      const listed = await eventually(async () => (await holders(x.url, 'mel-on-c')).join() === 'c', 5000);
      expect.soft(listed, `${x.name}'s GET /v1/models lists mel-on-c on c`).toBe(true);
      const r = await run(x.url);
      expect.soft(r.status, `mel-on-c on ${x.name}: ${JSON.stringify(r.body)}`).toBe(200);
      if (r.status === 200) expect.soft(r.body.outputs, `mel-on-c's outputs on ${x.name}`).toEqual(onC.body.outputs);
    }
  }, 120_000);
});

describe('a cluster-wide unload during a cold placement', () => {
  it('lets the request under way finish (200), then unloads, as on a single node', async () => {
    const n = await nats();
    // A group with 8 slot hosts in processes: a load that takes seconds. A refuses loads (its memory
    // guard: 10 TB free wanted), so A's request places it on B.
    const slow = { id: 'slow-jarvis', task: 'wakeword', heads: ['hey-jarvis'], slots: 8, isolation: 'process' };
    const { A, B } = await cluster(n.url, ['A', 'B'], null, [], {
      A: { models: [slow], min_free_memory_mb: 10_000_000, busy_timeout_ms: 60_000 },
      B: { models: [slow], busy_timeout_ms: 60_000 },
    });
    const request = runFile(A.url, 'slow-jarvis', WAKE_FILE, 60_000);
    // B is loading it for A's request.
    const loading = await eventually(async () => {
      const r = await call(`${B.url}/v1/models/slow-jarvis`, {}, 1000);
      return r.status === 200 && r.body.state === 'loading';
    }, 30_000);
    expect(loading, 'B starts loading slow-jarvis for A').toBe(true);
    const unload = await post(`${B.url}/v1/models/unload_all`, {}, 90_000);
    const r = await request;
    expect.soft(r.status, `the request under way: ${JSON.stringify(r.body)}`).toBe(200);
    if (r.status === 200) expect.soft(r.body.detections.length, 'its detections').toBeGreaterThan(0);
    expect.soft(unload.status, `the unload: ${JSON.stringify(unload.body)}`).toBe(200);
    // Then no node holds it.
    for (const x of [A, B]) {
      const gone = await eventually(async () => (await holders(x.url, 'slow-jarvis')).length === 0, 5 * HEARTBEAT_MS);
      expect.soft(gone, `${x.name} lists no holder of slow-jarvis: ${await holders(x.url, 'slow-jarvis')}`).toBe(true);
    }
  }, 150_000);
});

/** The compiled synthetic-model generator (tools/synth-model.ts): a Silero-shaped VAD model with a chosen run time per window. */
function slowModel(runMs: number): string {
  const out = join(dir, `slow-${runMs}.onnx`);
  const gen = fileURLToPath(new URL('../../dist/tools/synth-model.js', import.meta.url));
  const made = spawnSync(process.execPath, [gen, '--out', out, '--size-mib', '1', '--run-ms', String(runMs)]);
  if (made.status !== 0) throw new Error(`synth-model: ${made.stderr}`);
  return out;
}

describe('a remote job that runs longer than job_deadline_ms (a tester found it, issue 40)', () => {
  it('is answered once by its holder: the holder is not taken for gone while the job runs within its job timeout', async () => {
    const n = await nats();
    // About 1.8 s per job (44 windows of 40 ms), six times the ingress's job_deadline_ms.
    const slow = { id: 'slowvad', task: 'vad', path: slowModel(40) };
    const { A } = await cluster(n.url, ['A', 'B'], 'B', ['slowvad'], {
      A: { models: [slow], cluster: { job_deadline_ms: 300 } },
      B: { models: [slow] },
    });
    const r = await runFile(A.url, 'slowvad', SHORT_FILE, 30_000);
    expect(r.status, JSON.stringify(r.body)).toBe(200);
    expect(await metric(A.url, 'voxserve_remote_jobs_sent_total', { model: 'slowvad', outcome: 'gone' })).toBe(0);
    expect(await metric(A.url, 'voxserve_remote_failovers_total', { model: 'slowvad' })).toBe(0);
    expect(await metric(A.url, 'voxserve_remote_jobs_sent_total', { model: 'slowvad', outcome: 'ok' })).toBeGreaterThan(
      0,
    );
  }, 120_000);
});

describe('a client that leaves while its job waits at the holder (a tester found it, issue 40)', () => {
  it('the holder drops the job at once (it leaves the queue there) instead of running it for nobody', async () => {
    const n = await nats();
    // About 6.6 s per Front_Center run (44 windows of 150 ms); one lease at a time.
    const slow = { id: 'slowvad', task: 'vad', path: slowModel(150), max_streams: 1 };
    const { A, B } = await cluster(n.url, ['A', 'B'], 'B', ['slowvad'], {
      A: { models: [slow], busy_timeout_ms: 60_000, cluster: { job_deadline_ms: 30_000 } },
      B: { models: [slow], busy_timeout_ms: 60_000 },
    });
    const status = async (): Promise<{ active_leases: number; queued_requests: number }> =>
      (await call(`${B.url}/v1/models/slowvad`, {}, 2000)).body;
    // B's own request holds its only lease for seconds.
    let blockerDone = false;
    const blocker = runFile(B.url, 'slowvad', SHORT_FILE, 60_000).finally(() => (blockerDone = true));
    expect(await eventually(async () => (await status()).active_leases === 1, 10_000)).toBe(true);
    // A's client asks, its job queues at B, and the client leaves.
    const client = new AbortController();
    const left = fetch(`${A.url}/v1/tasks/run?model=slowvad`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: new Uint8Array(fixture(SHORT_FILE)),
      signal: client.signal,
    }).catch((e: Error) => e);
    expect(await eventually(async () => (await status()).queued_requests === 1, 10_000)).toBe(true);
    client.abort();
    await left;
    // Gone from B's queue while B's own run goes on (without the cancel it waits there, then runs for nobody).
    expect(await eventually(async () => (await status()).queued_requests === 0, 2000)).toBe(true);
    expect(blockerDone).toBe(false);
    expect((await blocker).status).toBe(200);
    await sleep(500);
    expect(await metric(B.url, 'voxserve_remote_jobs_served_total', { model: 'slowvad', outcome: 'cancelled' })).toBe(
      1,
    );
    expect(await metric(B.url, 'voxserve_remote_jobs_served_total', { model: 'slowvad', outcome: 'ok' })).toBe(0);
  }, 120_000);
});

describe('management with a node that does not answer (a tester found it, issue 40)', () => {
  it('a cluster-wide unload answers 503 node_unreachable naming it, not 200; node and replicas together are a 400', async () => {
    const n = await nats();
    const { A, B } = await cluster(n.url, ['A', 'B'], 'B', ['silero-vad']);
    const both = await post(`${A.url}/v1/models/load`, { id: 'silero-vad', node: 'B', replicas: 2 });
    expect(both.status).toBe(400);
    expect(both.body.error.message).toMatch(/replicas/);
    B.child.kill('SIGSTOP');
    const r = await post(`${A.url}/v1/models/unload_all`, {}, 30_000);
    expect(r.status, JSON.stringify(r.body)).toBe(503);
    expect(r.body.error.code).toBe('node_unreachable');
    expect(r.body.error.message).toMatch(/node B/);
    expect(r.ms).toBeLessThan(3 * HEARTBEAT_MS + 5000);
    B.child.kill('SIGCONT');
  }, 120_000);
});

describe('NATS frozen just as a cold request arrives (a breaker found it, issue 40)', () => {
  /**
   * A's busy timeout, ms: shorter than the load lock's two key-value timeouts with NATS frozen (3 s
   * each at `heartbeat_ms` 1000), longer than the time to notice the loss (3 missed pings, about 3.5 s).
   */
  const COLD_BUSY_MS = 5500;
  it('loads the model here once the loss is noticed: 200, not 503 cluster_load_timeout at the busy timeout', async () => {
    const n = await nats();
    const { A } = await cluster(n.url, ['A', 'C'], 'C', ['silero-vad'], { A: { busy_timeout_ms: COLD_BUSY_MS } });
    n.proc.kill('SIGSTOP');
    const r = await runFile(A.url, 'hey-jarvis', WAKE_FILE, COLD_BUSY_MS + 15_000);
    n.proc.kill('SIGCONT');
    expect(r.status, `${JSON.stringify(r.body)} after ${r.ms} ms`).toBe(200);
  }, 120_000);
});

describe('NATS lost after the only holder of a model died (a tester found it, issue 40)', () => {
  it('a request on the ingress loads it here and is answered at once, not 503 at the busy timeout', async () => {
    const n = await nats();
    const { A, B } = await cluster(n.url, ['A', 'B'], 'B', ['silero-vad'], { A: { busy_timeout_ms: 20_000 } });
    expect((await runFile(A.url, 'silero-vad', SHORT_FILE, 20_000)).status).toBe(200);
    B.child.kill('SIGKILL');
    expect(await eventually(async () => (await holders(A.url, 'silero-vad')).length === 0, 10_000)).toBe(true);
    n.proc.kill('SIGSTOP');
    expect(await eventually(async () => (await readyNats(A.url)) === 'disconnected', 15_000)).toBe(true);
    const r = await runFile(A.url, 'silero-vad', SHORT_FILE, 30_000);
    n.proc.kill('SIGCONT');
    expect(r.status, JSON.stringify(r.body)).toBe(200);
    expect(r.ms).toBeLessThan(3 * HEARTBEAT_MS + 5000);
  }, 120_000);
});
