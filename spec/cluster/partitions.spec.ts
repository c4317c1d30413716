/**
 * Partitions on real links (issue 41, "Done when": nodes in separate namespaces, a partition of the
 * holder for 10 s under load, then healed, and one of a non-holder; the checker passes). Three
 * nats-servers (one JetStream cluster) and three `voxserve serve --cluster` nodes (the compiled CLI:
 * `npm run build` first), each in its own network namespace on one bridge (spec/cluster/netns.ts);
 * a partition sets a node's link down, so it loses NATS, the other nodes and the test alike.
 * Runs: (a) the holder partitioned for 10 s, (b) a non-holder, (c) the holder paused (SIGSTOP)
 * 10 s, (d) a nats-server holding neither bucket killed and started again 10 s later.
 * Load, through the nodes that stay connected: 4 live VAD streams at all times (a 5.8 s recording
 * sent in real time, 100 ms frames) and a file request every 200 ms; and one stream through the
 * node the fault takes away, with `VoxClient` given every node's URL (it resumes on another node
 * from its last checkpoint, so all its events must still equal a single node's). Everything is recorded as a
 * history (spec/cluster/history.ts) and checked after each run; the expected results are a single
 * node's (no cluster, in this process) for the same recordings. Loads are read from the nodes'
 * logs (`model state`), lock operations from a watch of the lock bucket (`voxserve_locks`), and
 * slot host processes from /proc (the nodes run process hosts, the default). The buckets have 3
 * replicas (3 nats-servers); no nats-server is partitioned here. Needs root and `ip netns`: without them
 * the suite fails saying so. `CLUSTER_LOG=1` prints the nodes' logs.
 */
import { readdirSync, readFileSync } from 'node:fs';
import { Kvm } from '@nats-io/kv';
import { jetstreamManager } from '@nats-io/jetstream';
import { connect, type NatsConnection } from '@nats-io/transport-node';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import WebSocket from 'ws';
import { type StreamEvent, VoxClient } from '../../client/node.js';
import { ServerConfig } from '../../runtime/config.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { fixture, WaveFile } from '../helpers.js';
import { check, type Event, type Final, figures, fromLog, MARGIN_MS } from './history.js';
import {
  cleanStale,
  MANAGEMENT_TOKEN,
  type NatsHost,
  Net,
  natsCluster,
  requireNetns,
  type VoxHost,
  voxNode,
} from './netns.js';

const HEARTBEAT_MS = 1000;
/** Every node's busy timeout, ms: an error answer must come within it plus the checker's margin. */
const BUSY_MS = 10_000;
const MODEL = 'silero-vad';
const STREAM_FILE = 'espeak_sentence_16k.wav';
const FILE = 'Front_Center.wav';
const STREAMS = 4;
/** How long a fault lasts, ms. */
const FAULT_MS = 10_000;

let net: Net;
let nats: NatsHost[];
const nodes: Record<string, VoxHost> = {};
let single: VoxServer;
let lockNc: NatsConnection | undefined;
/** The lock bucket's operations as the watch saw them (every run's; each run takes its own from its start). */
const lockOps: Event[] = [];
const expected: Record<string, unknown> = {};

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

/** GET/POST `url` as JSON, bounded by `ms`; status 0 when no answer came (the body then says why). */
async function call(url: string, init: RequestInit = {}, ms = 5000): Promise<{ status: number; body: any }> {
  try {
    const res = await fetch(url, { ...init, signal: AbortSignal.timeout(ms) });
    const text = await res.text();
    let body: unknown = text;
    try {
      body = JSON.parse(text);
    } catch {
      // not JSON
    }
    return { status: res.status, body };
  } catch (e) {
    return { status: 0, body: (e as Error).message };
  }
}

const manage = (v: VoxHost, path: string, body: unknown, ms = 60_000) =>
  call(
    `${v.url}${path}`,
    {
      method: 'POST',
      headers: { 'content-type': 'application/json', authorization: `Bearer ${MANAGEMENT_TOKEN}` },
      body: JSON.stringify(body),
    },
    ms,
  );

/** The ready holders of MODEL that `v` lists (sorted), or null when it does not answer. */
async function holders(v: VoxHost): Promise<string[] | null> {
  const r = await call(`${v.url}/v1/models`, {}, 2000);
  if (r.status !== 200) return null;
  return (r.body.models.find((m: { id: string }) => m.id === MODEL)?.nodes ?? [])
    .filter((n: { state: string }) => n.state === 'ready')
    .map((n: { node: string }) => n.node)
    .sort();
}

/** The active leases of MODEL `v` lists, its own and those the registry shows on each holder (summed); -1 when it does not answer. */
async function activeLeases(v: VoxHost): Promise<number> {
  const r = await call(`${v.url}/v1/models`, {}, 2000);
  if (r.status !== 200) return -1;
  const m = r.body.models.find((x: { id: string }) => x.id === MODEL);
  return (
    (m?.active_leases ?? 0) +
    (m?.nodes ?? []).reduce((s: number, n: { active_leases: number }) => s + n.active_leases, 0)
  );
}

/** Polls `pred` every 100 ms until it holds or `ms` passed; whether it held (test-side wait, bounded). */
async function eventually(pred: () => Promise<boolean>, ms: number): Promise<boolean> {
  const end = Date.now() + ms;
  for (;;) {
    if (await pred().catch(() => false)) return true;
    if (Date.now() > end) return false;
    await sleep(100);
  }
}

/** The pids of `v`'s child processes (its slot hosts: `ip netns exec` became the node itself). */
function children(v: VoxHost): number[] {
  const pid = v.child.pid!;
  const out: number[] = [];
  for (const t of readdirSync(`/proc/${pid}/task`))
    out.push(...readFileSync(`/proc/${pid}/task/${t}/children`, 'utf8').split(' ').filter(Boolean).map(Number));
  return out;
}

const pcm16k = (file: string): Buffer =>
  Buffer.from((new WaveFile(fixture(file)).data as { samples: Uint8Array }).samples);

/**
 * Streams STREAM_FILE to `base` in real time; resolves with the outcome: its events (without
 * `ready`; `done` as its `processed_ms`, so a stream cut short differs) on close 1000, else the close code and error code. Bounded: the recording's
 * length plus BUSY_MS, MARGIN_MS and 30 s (then status 0).
 */
function streamOnce(
  base: string,
): Promise<{ ok: true; events: unknown[] } | { ok: false; status: number; error: string }> {
  const pcm = pcm16k(STREAM_FILE);
  const frame = 1600 * 2;
  return new Promise((resolve) => {
    const ws = new WebSocket(
      `${base.replace('http', 'ws')}/v1/stream?model=${MODEL}&sample_rate=16000`,
      'voxserve.v1.json',
    );
    const events: unknown[] = [];
    let error = '';
    let timer: NodeJS.Timeout | undefined;
    const bound = setTimeout(
      () => {
        ws.terminate();
        finish({ ok: false, status: 0, error: '' });
      },
      5800 + BUSY_MS + MARGIN_MS + 30_000,
    );
    let done = false;
    const finish = (r: Parameters<typeof resolve>[0]): void => {
      if (done) return;
      done = true;
      clearTimeout(bound);
      clearInterval(timer);
      resolve(r);
    };
    ws.on('error', (e) => {
      error ||= `socket: ${e.message}`;
    });
    ws.on('message', (d: Buffer) => {
      const e = JSON.parse(d.toString());
      if (e.type === 'error') error = String(e.code ?? e.message);
      else if (e.type === 'ready') {
        let o = 0;
        timer = setInterval(() => {
          if (ws.readyState !== WebSocket.OPEN) return clearInterval(timer);
          if (o < pcm.length) ws.send(pcm.subarray(o, o + frame));
          else {
            ws.send(JSON.stringify({ type: 'end' }));
            clearInterval(timer);
          }
          o += frame;
        }, 100);
      } else if (e.type === 'done') events.push({ type: 'done', processed_ms: e.processed_ms });
      else events.push(e);
    });
    ws.on('close', (code) =>
      finish(
        code === 1000 && !error
          ? { ok: true, events }
          : { ok: false, status: code, error: error.startsWith('socket') ? '' : error },
      ),
    );
  });
}

/**
 * Streams STREAM_FILE in real time (100 ms frames) with `VoxClient` given `urls` (the first is the
 * node in use), so it resumes on another node when that one goes away (heartbeat 2 s, resume
 * bounded by 20 s); resolves with its events (without `ready`, `progress` and `resumed`; `done` as its `processed_ms`)
 * and the gap of its `resumed` event, or the error it failed with. Bounded like {@link streamOnce}.
 */
async function resumableStream(
  urls: string[],
): Promise<
  | { ok: true; events: unknown[]; gap?: { from_ms: number; to_ms: number; checkpoint: boolean } }
  | { ok: false; status: number; error: string }
> {
  const pcm = pcm16k(STREAM_FILE);
  const frame = 1600 * 2;
  const events: StreamEvent[] = [];
  const run = async () => {
    const vox = new VoxClient({ urls, heartbeatMs: 2000 });
    const stream = await vox.stream({ model: MODEL, sampleRate: 16_000, resume: { timeoutMs: 20_000 } });
    const reading = (async () => {
      for await (const e of stream) events.push(e);
    })();
    for (let o = 0; o < pcm.length; o += frame) {
      await stream.send(pcm.subarray(o, o + frame));
      await sleep(100);
    }
    await stream.end();
    await reading;
  };
  let timer: NodeJS.Timeout | undefined;
  const bound = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error('no end within the bound')), 5800 + BUSY_MS + MARGIN_MS + 30_000);
  });
  try {
    await Promise.race([run(), bound]);
  } catch (e) {
    const err = e as { code?: string; message: string };
    return { ok: false, status: 0, error: String(err.code ?? err.message) };
  } finally {
    clearTimeout(timer);
  }
  const resumed = events.flatMap((e) => (e.type === 'resumed' ? [e] : []));
  return {
    ok: true,
    events: events
      .filter((e) => !['ready', 'progress', 'resumed'].includes(e.type))
      .map((e) => (e.type === 'done' ? { type: 'done', processed_ms: e.processed_ms } : e)),
    // A VAD stream resumes from its last checkpoint (`resume_from`), or at 0 before the first one: exact either way.
    ...(resumed.length
      ? { gap: { from_ms: resumed[0].gap.start_ms, to_ms: resumed.at(-1)!.gap.end_ms, checkpoint: true } }
      : {}),
  };
}

/**
 * Runs the load on `ingress` (round robin) until `stop()`: STREAMS streams at all times and a
 * file request every 200 ms, each recorded in `history`. `stop` resolves once every request is answered.
 */
function load(ingress: VoxHost[], history: Event[], via?: VoxHost): () => Promise<void> {
  let stopping = false;
  let seq = 0;
  const pending = new Set<Promise<void>>();
  const track = (p: Promise<void>): void => {
    pending.add(p);
    p.finally(() => pending.delete(p));
  };
  const next = (): VoxHost => ingress[seq % ingress.length];
  const oneStream = async (): Promise<void> => {
    while (!stopping) {
      const v = next();
      const id = `s${seq++}`;
      history.push({
        type: 'invoke',
        id,
        op: 'stream',
        node: v.name,
        model: MODEL,
        input: STREAM_FILE,
        at: Date.now(),
        busy_ms: BUSY_MS,
      });
      const r = await streamOnce(v.url);
      history.push(
        r.ok
          ? { type: 'ok', id, at: Date.now(), result: r.events }
          : { type: 'fail', id, at: Date.now(), status: r.status, error: r.error },
      );
    }
  };
  for (let i = 0; i < STREAMS; i++) track(oneStream());
  if (via) {
    const id = `r${seq++}`;
    history.push({
      type: 'invoke',
      id,
      op: 'stream',
      node: via.name,
      model: MODEL,
      input: STREAM_FILE,
      at: Date.now(),
      busy_ms: BUSY_MS,
    });
    track(
      resumableStream([via.url, ...ingress.filter((v) => v !== via).map((v) => v.url)]).then((r) => {
        history.push(
          r.ok
            ? { type: 'ok', id, at: Date.now(), result: r.events, ...(r.gap ? { gap: r.gap } : {}) }
            : { type: 'fail', id, at: Date.now(), status: r.status, error: r.error },
        );
      }),
    );
  }
  const body = new Uint8Array(fixture(FILE));
  const files = setInterval(() => {
    const v = next();
    const id = `f${seq++}`;
    history.push({
      type: 'invoke',
      id,
      op: 'file',
      node: v.name,
      model: MODEL,
      input: FILE,
      at: Date.now(),
      busy_ms: BUSY_MS,
    });
    track(
      call(
        `${v.url}/v1/tasks/run?model=${MODEL}`,
        { method: 'POST', headers: { 'content-type': 'audio/wav' }, body },
        BUSY_MS + MARGIN_MS + 30_000,
      ).then((r) => {
        history.push(
          r.status === 200
            ? { type: 'ok', id, at: Date.now(), result: r.body.segments }
            : {
                type: 'fail',
                id,
                at: Date.now(),
                status: r.status,
                error: r.status ? String(r.body?.error?.code ?? r.body?.error ?? '') : '',
              },
        );
      }),
    );
  }, 200);
  return async () => {
    stopping = true;
    clearInterval(files);
    while (pending.size) await Promise.all([...pending]);
  };
}

/**
 * After a run: waits (bounded: 20 s) until every node answers, lists the same holders and no
 * active lease, takes
 * their `GET /v1/models`, unloads everything (`unload_all`), waits (bounded: 15 s) for the slot
 * hosts to exit and reads what is left: slot host processes, lock bucket keys.
 */
async function settle(): Promise<Final> {
  const all = Object.values(nodes);
  // The registry is written every heartbeat (a lease's end alone writes nothing): a heartbeat or two after the last request, it says the end state.
  await eventually(async () => {
    const views = await Promise.all(all.map(holders));
    const leases = await Promise.all(all.map(activeLeases));
    return (
      views.every((h) => h !== null && h.length > 0 && h.join() === views[0]!.join()) && leases.every((n) => n === 0)
    );
  }, 20_000);
  const final: Final = { nodes: [], locks: [] };
  for (const v of all) {
    const r = await call(`${v.url}/v1/models`, {}, 5000);
    final.nodes.push({
      node: v.name,
      models: r.status === 200 ? r.body.models.filter((m: { id: string }) => m.id === MODEL) : [],
      slot_hosts: [],
    });
  }
  // Asked of a node that answers; one it cannot reach keeps its model and its slot hosts, which the checker reports.
  const reachable = all.filter((v) => v.host.up);
  const u = await manage(reachable[reachable.length - 1], '/v1/models/unload_all', {});
  if (u.status !== 200) console.log(`unload_all: ${u.status} ${JSON.stringify(u.body)}`);
  await eventually(async () => all.every((v) => children(v).length === 0), 15_000);
  for (const [i, v] of all.entries()) final.nodes[i].slot_hosts = children(v);
  const kv = await new Kvm(lockNc!).open('voxserve_locks');
  for await (const k of await kv.keys()) final.locks.push(k);
  return final;
}

/** The history's loads and unloads from every node's log, and its lock operations, from `since`. */
function fromLogs(since: number): Event[] {
  return [
    ...Object.values(nodes).flatMap((v) =>
      fromLog(
        v.name,
        v.log.filter((l) => (l.line.time as number) >= since),
      ),
    ),
    ...lockOps.filter((e) => e.type === 'lock' && e.at >= since),
  ];
}

beforeAll(async () => {
  requireNetns();
  cleanStale();
  net = new Net();
  nats = await natsCluster(net, 3);
  const urls = nats.map((n) => n.url);
  const started = await Promise.all(
    ['a', 'b', 'c'].map((n) =>
      voxNode(net, net.host(n), n, urls, {
        busy_timeout_ms: BUSY_MS,
        cluster: { heartbeat_ms: HEARTBEAT_MS, connect_timeout_ms: 30_000, job_deadline_ms: 3000 },
      }),
    ),
  );
  for (const v of started) nodes[v.name] = v;
  for (const v of started)
    if (!(await eventually(async () => (await call(`${v.url}/v1/cluster`)).body.nodes?.length === 3, 30_000)))
      throw new Error(`setup: ${v.name} does not list the 3 nodes after 30 s`);
  lockNc = await connect({ servers: urls });
  const kv = await new Kvm(lockNc).open('voxserve_locks');
  const watch = await kv.watch({ key: '>' });
  (async () => {
    for await (const e of watch)
      lockOps.push({
        type: 'lock',
        model: e.key,
        op: e.operation === 'PUT' ? 'put' : 'delete',
        owner: e.operation === 'PUT' ? (e.json<{ owner?: string }>().owner ?? '') : undefined,
        at: Date.now(),
      });
  })().catch(() => {});
  single = await startServer(ServerConfig.parse({ log_level: 'silent', port: 0, isolation: 'thread' }));
  const file = await call(
    `${single.url}/v1/tasks/run?model=${MODEL}`,
    { method: 'POST', headers: { 'content-type': 'audio/wav' }, body: new Uint8Array(fixture(FILE)) },
    60_000,
  );
  expected[`file:${MODEL}:${FILE}`] = file.body.segments;
  const s = await streamOnce(single.url);
  if (!s.ok) throw new Error(`setup: the single node's stream failed: ${JSON.stringify(s)}`);
  expected[`stream:${MODEL}:${STREAM_FILE}`] = s.events;
}, 240_000);

afterAll(async () => {
  await lockNc?.close().catch(() => {});
  await single?.close();
  await net?.close();
}, 60_000);

/** Places MODEL on `holder` alone (management load) and waits until every node lists it. */
async function placeOn(holder: string): Promise<void> {
  const r = await manage(nodes.a, '/v1/models/load', { id: MODEL, node: holder });
  expect(r.status, JSON.stringify(r.body)).toBe(200);
  for (const v of Object.values(nodes))
    expect(
      await eventually(async () => (await holders(v))?.join() === holder, 10_000),
      `${v.name} sees ${holder}`,
    ).toBe(true);
}

/** A fault of a run: `start` at 3 s into the load, `end` FAULT_MS later; `node` the voxserve node it takes away, if any. */
interface Fault {
  node?: string;
  start(): void | Promise<void>;
  end(): void | Promise<void>;
}

/** `name`'s link down, then up. */
const partition = (name: string): Fault => ({
  node: name,
  start: () => net.down(nodes[name].host),
  end: () => net.up(nodes[name].host),
});

/**
 * One run: MODEL on `holder`, load through `ingress`, the fault after 3 s for FAULT_MS, then 8 s
 * more load; then the history is checked and the figures printed (requests, answers, failures by
 * kind, the time from the fault to a new holder that every ingress lists when the fault took the
 * holder away, the loads with their node and start from the fault).
 */
async function run(name: string, holder: string, ingress: string[], fault: Fault): Promise<void> {
  await placeOn(holder);
  const since = Date.now();
  const history: Event[] = [];
  // One stream through the node the fault takes away (else the first ingress): it resumes elsewhere.
  const stop = load(
    ingress.map((n) => nodes[n]),
    history,
    nodes[fault.node ?? ingress[0]],
  );
  await sleep(3000);
  const faultAt = Date.now();
  await fault.start();
  let replacedMs: number | null = null;
  if (fault.node === holder) {
    const replaced = await eventually(async () => {
      const views = await Promise.all(ingress.map((n) => holders(nodes[n])));
      return views.every((h) => h?.some((x) => x !== holder));
    }, FAULT_MS);
    if (replaced) replacedMs = Date.now() - faultAt;
  }
  await sleep(Math.max(0, faultAt + FAULT_MS - Date.now()));
  await fault.end();
  await sleep(8000);
  await stop();
  const final = await settle();
  const all = [...history, ...fromLogs(since)];
  const violations = check(all, final, expected);
  const loads = all.flatMap((e) => (e.type === 'load' ? [`${e.node}@${e.start - faultAt}ms`] : []));
  const resumed = history.flatMap((e) => (e.type === 'ok' && e.gap ? [e.gap] : []));
  console.log(
    `${name}: ${JSON.stringify({ ...figures(history), time_to_replace_ms: replacedMs, loads, lock_ops: all.filter((e) => e.type === 'lock').length, resumed })}`,
  );
  expect(violations).toEqual([]);
  if (fault.node === holder) expect(replacedMs, 'a node left holds the model within the fault').not.toBeNull();
}

describe('partitions on real links (3 nats-servers, 3 nodes, each in its own namespace)', () => {
  it('(a) the holder partitioned for 10 s under load, then healed: the history checks', async () => {
    await run('(a) holder a partitioned', 'a', ['b', 'c'], partition('a'));
  }, 180_000);

  it('(b) a non-holder partitioned for 10 s under load, then healed: the history checks', async () => {
    // c runs the model on a remote pool before it is cut off
    await placeOn('b');
    const r = await call(
      `${nodes.c.url}/v1/tasks/run?model=${MODEL}`,
      { method: 'POST', headers: { 'content-type': 'audio/wav' }, body: new Uint8Array(fixture(FILE)) },
      30_000,
    );
    expect(r.status).toBe(200);
    await run('(b) non-holder c partitioned', 'b', ['a', 'b'], partition('c'));
  }, 180_000);

  it('(c) the holder paused (SIGSTOP) for 10 s, past its heartbeats, under load, then resumed: the history checks', async () => {
    await run('(c) holder c paused', 'c', ['a', 'b'], {
      node: 'c',
      start: () => {
        nodes.c.child.kill('SIGSTOP');
      },
      end: () => {
        nodes.c.child.kill('SIGCONT');
      },
    });
  }, 180_000);

  it('(d) a nats-server that holds neither bucket killed under load, restarted 10 s later: the history checks', async () => {
    const jsm = await jetstreamManager(lockNc!);
    const leaders = new Set<string>();
    for (const b of ['voxserve_nodes', 'voxserve_locks'])
      leaders.add(String((await jsm.streams.info(`KV_${b}`)).cluster?.leader));
    const victim = nats.find((n) => !leaders.has(n.host.name))!;
    expect(victim, `a nats-server holding no bucket (leaders: ${[...leaders]})`).toBeDefined();
    await run(`(d) ${victim.host.name} killed`, 'a', ['b', 'c'], {
      start: () => victim.kill(),
      end: () => victim.restart(),
    });
  }, 180_000);
});
