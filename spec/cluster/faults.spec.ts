/**
 * Cluster faults (issue 20, docs/cluster.md "What survives what"): real `voxserve serve --cluster`
 * processes and one nats-server on loopback; a holder is killed (SIGKILL) or paused (SIGSTOP)
 * mid-work, NATS is stopped and started again. Expected events come from a single node without a
 * cluster (this process) running the same recordings, and the VAD segments also from
 * spec/fixtures/REFERENCE.jsonl.
 */
import type { ChildProcess } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Kvm } from '@nats-io/kv';
import { connect } from '@nats-io/transport-node';
import WebSocket from 'ws';
import { ServerConfig } from '../../runtime/config.js';
import { spawnServer } from '../../tools/spawn-server.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { expectSegments, fixture, reference, until, WaveFile } from '../helpers.js';
import { startNats, type NatsServer } from './nats-server.js';

const HEARTBEAT_MS = 500;
const VAD_FILE = 'silero_test.wav';
const WAKE_FILE = 'espeak_hey_jarvis_22k.wav';

type Event = Record<string, unknown>;
interface Node {
  name: string;
  url: string;
  child: ChildProcess;
}

const dir = mkdtempSync(join(tmpdir(), 'voxserve-faults-'));
const children: ChildProcess[] = [];

/** `voxserve serve --cluster` as a child process named `name` (threads for slots: a killed node leaves no orphan). */
async function startNode(nats: string, name: string, extra: Record<string, unknown> = {}): Promise<Node> {
  const file = join(dir, `${name}.json`);
  writeFileSync(
    file,
    JSON.stringify({
      port: 0,
      log_level: process.env.CLUSTER_LOG ?? 'warn',
      isolation: 'thread',
      management: { enabled: true },
      limits: { max_ws_connections: 100 },
      cluster: { nats, node: name, heartbeat_ms: HEARTBEAT_MS, job_deadline_ms: 3000 },
      ...extra,
    }),
  );
  const { child, url } = await spawnServer(['--config', file]);
  children.push(child);
  if (process.env.CLUSTER_LOG) child.stderr!.on('data', (d) => process.stderr.write(`[${name}] ${d}`));
  return { name, url, child };
}

async function json(url: string, init?: RequestInit): Promise<{ status: number; body: any }> {
  const res = await fetch(url, init);
  return { status: res.status, body: await res.json() };
}

const post = (url: string, body: unknown): Promise<{ status: number; body: any }> =>
  json(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });

/** `POST /v1/tasks/run` of a fixture. */
const runFile = (url: string, model: string, file: string): Promise<{ status: number; body: any }> =>
  json(`${url}/v1/tasks/run?model=${model}`, {
    method: 'POST',
    headers: { 'content-type': 'audio/wav' },
    body: new Uint8Array(fixture(file)),
  });

/** Frames sent by the streams of this file, for waiting until they are under way. */
let framesSent = 0;

/**
 * Streams a fixture in 100 ms frames, one every `gapMs` (faster than real time), then `end`.
 * Resolves with every event but `ready` and `done` (ids and timings differ) and how it closed.
 */
function stream(
  url: string,
  model: string,
  file: string,
  gapMs: number,
): Promise<{ events: Event[]; done: boolean; code: number }> {
  const w = new WaveFile(fixture(file));
  const { sampleRate } = w.fmt as { sampleRate: number };
  const pcm = Buffer.from((w.data as { samples: Uint8Array }).samples);
  const frame = (sampleRate / 10) * 2;
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(`${url.replace('http', 'ws')}/v1/stream?model=${model}&sample_rate=${sampleRate}`);
    const events: Event[] = [];
    let done = false;
    let timer: NodeJS.Timeout | undefined;
    ws.on('error', reject);
    ws.on('message', (d: Buffer) => {
      const e = JSON.parse(d.toString());
      if (e.type === 'ready') {
        let o = 0;
        const next = (): void => {
          if (ws.readyState !== WebSocket.OPEN) return;
          if (o >= pcm.length) return void ws.send(JSON.stringify({ type: 'end' }));
          ws.send(pcm.subarray(o, o + frame));
          o += frame;
          framesSent++;
          timer = setTimeout(next, gapMs);
        };
        next();
      } else if (e.type === 'done') done = true;
      else events.push(e);
    });
    ws.on('close', (code) => {
      clearTimeout(timer);
      resolve({ events, done, code });
    });
  });
}

/** The nodes holding `model` ready as `GET /v1/models` on `url` reports them. */
async function holders(url: string, model: string): Promise<string[]> {
  const { body } = await json(`${url}/v1/models`);
  return (body.models.find((m: { id: string }) => m.id === model)?.nodes ?? [])
    .filter((n: { state: string }) => n.state === 'ready')
    .map((n: { node: string }) => n.node)
    .sort();
}

/** A metric's value in a node's `/metrics`, summed over the series matching every label given. */
async function metric(url: string, name: string, labels: Record<string, string> = {}): Promise<number> {
  const text = await (await fetch(`${url}/metrics`)).text();
  let sum = 0;
  for (const line of text.split('\n')) {
    if (!line.startsWith(`${name}{`) && !line.startsWith(`${name} `)) continue;
    if (Object.entries(labels).every(([k, v]) => line.includes(`${k}="${v}"`))) sum += Number(line.split(' ').pop());
  }
  return sum;
}

const speechEnds = (events: Event[]): { start_ms: unknown; end_ms: unknown }[] =>
  events.filter((e) => e.type === 'speech_end').map((e) => ({ start_ms: e.start_ms, end_ms: e.end_ms }));

let single: VoxServer;
/** The single node's stream events and file results: what every stream and request must give. */
const want: { vad: Event[]; wake: Event[]; vadFile: unknown; wakeFile: unknown } = {
  vad: [],
  wake: [],
  vadFile: null,
  wakeFile: null,
};

beforeAll(async () => {
  single = await startServer(ServerConfig.parse({ log_level: 'silent', port: 0, isolation: 'thread' }));
  const [vad, wake, vadFile, wakeFile] = await Promise.all([
    stream(single.url, 'silero-vad', VAD_FILE, 0),
    stream(single.url, 'hey-jarvis', WAKE_FILE, 0),
    runFile(single.url, 'silero-vad', VAD_FILE),
    runFile(single.url, 'hey-jarvis', WAKE_FILE),
  ]);
  want.vad = vad.events;
  want.wake = wake.events;
  want.vadFile = vadFile.body.segments;
  want.wakeFile = wakeFile.body.detections;
  // The single node itself agrees with the independent reference (REFERENCE.jsonl).
  expectSegments(vadFile.body.segments, reference(VAD_FILE).segments_v6, 40);
  expect(speechEnds(want.vad)).toEqual(
    vadFile.body.segments.map((x: { start_ms: number; end_ms: number }) => ({
      start_ms: x.start_ms,
      end_ms: x.end_ms,
    })),
  );
  expect(wakeFile.body.detections.length).toBeGreaterThan(0);
}, 120_000);

afterAll(async () => {
  await single?.close();
  for (const c of children) if (c.exitCode === null && c.signalCode === null) c.kill('SIGKILL');
  rmSync(dir, { recursive: true, force: true });
});

describe('a holder dies (SIGKILL) mid-work', () => {
  let nats: NatsServer;
  let A: Node;
  let B: Node;
  let C: Node;

  beforeAll(async () => {
    nats = await startNats();
    [A, B, C] = await Promise.all(['A', 'B', 'C'].map((n) => startNode(nats.url, n)));
    for (const model of ['silero-vad', 'hey-jarvis']) {
      const r = await post(`${A.url}/v1/models/load`, { id: model, node: 'C' });
      expect(r.status, JSON.stringify(r.body)).toBe(200);
    }
    for (const n of [A, B]) await until(async () => (await holders(n.url, 'hey-jarvis')).join() === 'C', 5000);
  }, 120_000);
  afterAll(async () => {
    for (const n of [A, B, C]) n?.child.kill('SIGKILL');
    await nats?.stop();
  });

  it('streams on A and B through C and file requests in flight give the single node results when C is killed', async () => {
    // Warm: each ingress has its remote pool to C.
    for (const n of [A, B]) {
      expect((await runFile(n.url, 'silero-vad', 'Front_Center.wav')).status).toBe(200);
      expect((await runFile(n.url, 'hey-jarvis', 'Front_Center.wav')).status).toBe(200);
    }
    framesSent = 0;
    const vad = Array.from({ length: 16 }, (_, i) => stream([A, B][i % 2].url, 'silero-vad', VAD_FILE, 12));
    const wake = Array.from({ length: 4 }, (_, i) => stream([A, B][i % 2].url, 'hey-jarvis', WAKE_FILE, 40));
    // The streams are under way (about a fifth of their audio sent) and their jobs run on C.
    await until(() => framesSent > 20 * 120, 30_000);
    expect(await metric(C.url, 'voxserve_remote_jobs_served_total', { model: 'silero-vad' })).toBeGreaterThan(0);
    const files = Array.from({ length: 10 }, (_, i) =>
      i % 2 ? runFile(B.url, 'silero-vad', VAD_FILE) : runFile(A.url, 'hey-jarvis', WAKE_FILE),
    );
    await new Promise((r) => setTimeout(r, 100));
    C.child.kill('SIGKILL');
    const [v, k, f] = await Promise.all([Promise.all(vad), Promise.all(wake), Promise.all(files)]);
    for (const s of [...v, ...k]) {
      expect(s.code).toBe(1000);
      expect(s.done).toBe(true);
    }
    for (const s of v) expect(s.events).toEqual(want.vad);
    for (const s of k) expect(s.events).toEqual(want.wake);
    f.forEach((r, i) => {
      expect(r.status, JSON.stringify(r.body)).toBe(200);
      expect(i % 2 ? r.body.segments : r.body.detections).toEqual(i % 2 ? want.vadFile : want.wakeFile);
    });
    // The jobs C had were sent again (C taken for gone), and one surviving node holds each model now.
    const failovers =
      (await metric(A.url, 'voxserve_remote_failovers_total')) +
      (await metric(B.url, 'voxserve_remote_failovers_total'));
    expect(failovers).toBeGreaterThan(0);
    for (const model of ['silero-vad', 'hey-jarvis']) {
      const h = await holders(A.url, model);
      expect(h.length).toBe(1);
      expect(['A', 'B']).toContain(h[0]);
      expect(await holders(B.url, model)).toEqual(h);
    }
  }, 120_000);
});

describe('no node can take the model when its holder dies', () => {
  let nats: NatsServer;
  let A: Node;
  let C: Node;

  beforeAll(async () => {
    nats = await startNats();
    // A's memory guard refuses any load (1 TB of headroom): when C dies, nobody can hold silero-vad.
    [A, C] = await Promise.all([
      startNode(nats.url, 'A', { min_free_memory_mb: 1_000_000, busy_timeout_ms: 3000 }),
      startNode(nats.url, 'C'),
    ]);
    const r = await post(`${A.url}/v1/models/load`, { id: 'silero-vad', node: 'C' });
    expect(r.status, JSON.stringify(r.body)).toBe(200);
    await until(async () => (await holders(A.url, 'silero-vad')).join() === 'C', 5000);
  }, 120_000);
  afterAll(async () => {
    for (const n of [A, C]) n?.child.kill('SIGKILL');
    await nats?.stop();
  });

  it('streams get an error event and close 1013, file requests 503, within the busy timeout', async () => {
    expect((await runFile(A.url, 'silero-vad', 'Front_Center.wav')).status).toBe(200);
    framesSent = 0;
    const streams = Array.from({ length: 4 }, () => stream(A.url, 'silero-vad', VAD_FILE, 12));
    await until(() => framesSent > 4 * 60, 30_000);
    C.child.kill('SIGKILL');
    const t0 = Date.now();
    const [s, f] = await Promise.all([Promise.all(streams), runFile(A.url, 'silero-vad', VAD_FILE)]);
    // The busy timeout (3 s) plus the time to learn C is gone and to try A: never the old ~300 s hang.
    expect(Date.now() - t0).toBeLessThan(15_000);
    for (const x of s) {
      expect(x.code).toBe(1013);
      const err = x.events.find((e) => e.type === 'error') as { error: { type: string; message: string } } | undefined;
      expect(err, JSON.stringify(x.events.slice(-2))).toBeDefined();
      expect(err!.error.type).toBe('server_busy');
      expect(err!.error.message).toMatch(/silero-vad/);
    }
    expect(f.status, JSON.stringify(f.body)).toBe(503);
    expect(f.body.error.message).toMatch(/silero-vad/);
    // Nothing is left behind: no lease held on A.
    await until(async () => {
      const { body } = await json(`${A.url}/v1/models`);
      return body.models.find((m: { id: string }) => m.id === 'silero-vad').active_leases === 0;
    }, 5000);
  }, 120_000);
});

describe('a holder paused (SIGSTOP) past its heartbeats, then resumed (SIGCONT)', () => {
  let nats: NatsServer;
  let A: Node;
  let B: Node;
  let D: Node;

  beforeAll(async () => {
    nats = await startNats();
    [A, B, D] = await Promise.all(['A', 'B', 'D'].map((n) => startNode(nats.url, n)));
    const r = await post(`${A.url}/v1/models/load`, { id: 'silero-vad', node: 'D' });
    expect(r.status, JSON.stringify(r.body)).toBe(200);
    for (const n of [A, B]) await until(async () => (await holders(n.url, 'silero-vad')).join() === 'D', 5000);
  }, 120_000);
  afterAll(async () => {
    for (const n of [A, B, D]) {
      n?.child.kill('SIGCONT');
      n?.child.kill('SIGKILL');
    }
    await nats?.stop();
  });

  it("the streams go on elsewhere with the single node's events; D's late replies are dropped; the registry converges", async () => {
    for (const n of [A, B]) expect((await runFile(n.url, 'silero-vad', 'Front_Center.wav')).status).toBe(200);
    framesSent = 0;
    const streams = Array.from({ length: 8 }, (_, i) => stream([A, B][i % 2].url, 'silero-vad', VAD_FILE, 12));
    await until(() => framesSent > 8 * 120, 30_000);
    D.child.kill('SIGSTOP');
    // Past D's 3 heartbeats (1.5 s): its jobs are sent again and the model is held by A or B.
    await until(async () => (await holders(A.url, 'silero-vad')).some((n) => n !== 'D'), 15_000);
    await new Promise((r) => setTimeout(r, 500));
    D.child.kill('SIGCONT');
    const s = await Promise.all(streams);
    for (const x of s) {
      expect(x.code).toBe(1000);
      expect(x.done).toBe(true);
      expect(x.events).toEqual(want.vad);
    }
    // D answered the jobs it had when it stopped; nobody was waiting for them any more.
    await until(
      async () =>
        (await metric(A.url, 'voxserve_remote_late_replies_total')) +
          (await metric(B.url, 'voxserve_remote_late_replies_total')) >
        0,
      10_000,
    );
    // Every node sees the same holders (D back, and the node that took over) within a heartbeat or two.
    await until(async () => {
      const views = await Promise.all([A, B, D].map((n) => holders(n.url, 'silero-vad')));
      return views.every((v) => v.join() === views[0].join()) && views[0].includes('D');
    }, 5000);
  }, 120_000);

  it('a cluster-wide unload waits for a stream still open on another node, then nothing holds the model', async () => {
    // D alone holds silero-vad again.
    let r = await post(`${A.url}/v1/models/unload`, { id: 'silero-vad' });
    expect(r.status, JSON.stringify(r.body)).toBe(200);
    r = await post(`${A.url}/v1/models/load`, { id: 'silero-vad', node: 'D' });
    expect(r.status, JSON.stringify(r.body)).toBe(200);
    for (const n of [A, B]) await until(async () => (await holders(n.url, 'silero-vad')).join() === 'D', 5000);
    const pcm = Buffer.from((new WaveFile(fixture('Front_Center.wav')).data as { samples: Uint8Array }).samples);
    const ws = new WebSocket(`${B.url.replace('http', 'ws')}/v1/stream?model=silero-vad&sample_rate=48000`);
    const events: Event[] = [];
    const closed = new Promise<number>((r) => ws.on('close', (c) => r(c)));
    ws.on('message', (d: Buffer) => events.push(JSON.parse(d.toString())));
    await until(() => events.some((e) => e.type === 'ready'), 10_000);
    ws.send(pcm.subarray(0, pcm.length / 2));
    const loads = async (): Promise<number> =>
      (await Promise.all([A, B, D].map((n) => metric(n.url, 'voxserve_loads_total', { model: 'silero-vad' })))).reduce(
        (a, b) => a + b,
      );
    const before = await loads();
    let answered = false;
    const unload = post(`${A.url}/v1/models/unload`, { id: 'silero-vad' }).finally(() => (answered = true));
    // The stream on B still runs on the holders, which wait for it as a single node's unload does.
    await new Promise((r) => setTimeout(r, 3 * HEARTBEAT_MS));
    expect(answered).toBe(false);
    expect(await holders(A.url, 'silero-vad')).toEqual(['D']);
    ws.send(pcm.subarray(pcm.length / 2));
    ws.send(JSON.stringify({ type: 'end' }));
    expect(await closed).toBe(1000);
    // Front_Center.wav's two segments (REFERENCE.jsonl).
    expectSegments(
      speechEnds(events) as { start_ms: number; end_ms: number }[],
      reference('Front_Center.wav').segments_v6,
      40,
    );
    r = await unload;
    expect(r.status, JSON.stringify(r.body)).toBe(200);
    // Not placed again by anyone: nothing holds it, and no load happened meanwhile.
    await new Promise((res) => setTimeout(res, 3 * HEARTBEAT_MS));
    for (const n of [A, B, D]) expect(await holders(n.url, 'silero-vad')).toEqual([]);
    expect(await loads()).toBe(before);
  }, 60_000);
});

describe('NATS stopped for 5 s and started again under load', () => {
  let nats: NatsServer;
  let A: Node;
  let C: Node;

  beforeAll(async () => {
    nats = await startNats();
    [A, C] = await Promise.all(['A', 'C'].map((n) => startNode(nats.url, n)));
    const r = await post(`${A.url}/v1/models/load`, { id: 'silero-vad', node: 'C' });
    expect(r.status, JSON.stringify(r.body)).toBe(200);
    await until(async () => (await holders(A.url, 'silero-vad')).join() === 'C', 5000);
  }, 120_000);
  afterAll(async () => {
    for (const n of [A, C]) n?.child.kill('SIGKILL');
    await nats?.stop();
  });

  it("local work goes on, remote work resumes with the single node's events, and no lease or lock is left", async () => {
    expect((await runFile(A.url, 'silero-vad', 'Front_Center.wav')).status).toBe(200);
    framesSent = 0;
    // Remote: streams on A whose jobs run on C. Local: streams on C itself.
    const remote = Array.from({ length: 4 }, () => stream(A.url, 'silero-vad', VAD_FILE, 12));
    const local = Array.from({ length: 4 }, () => stream(C.url, 'silero-vad', VAD_FILE, 12));
    await until(() => framesSent > 8 * 100, 30_000);
    // Killed: what it had in flight (jobs, replies) is lost with it.
    await nats.halt('SIGKILL');
    const down = Date.now();
    // While NATS is away, a file request on the holder is served at once.
    const during = await runFile(C.url, 'silero-vad', 'Front_Center.wav');
    expect(during.status).toBe(200);
    expectSegments(during.body.segments, reference('Front_Center.wav').segments_v6, 40);
    expect(Date.now() - down).toBeLessThan(5000);
    const l = await Promise.all(local);
    await new Promise((r) => setTimeout(r, Math.max(0, 5000 - (Date.now() - down))));
    await nats.restart();
    const r = await Promise.all(remote);
    for (const x of [...l, ...r]) {
      expect(x.code).toBe(1000);
      expect(x.events).toEqual(want.vad);
    }
    // After the outage: every lease given back, and no load lock held.
    for (const n of [A, C])
      await until(async () => {
        const { body } = await json(`${n.url}/v1/models`);
        return body.models.every((m: { active_leases: number }) => m.active_leases === 0);
      }, 5000);
    // The registry is back: each node hears the other's heartbeats again.
    for (const n of [A, C])
      await until(async () => {
        const { body } = await json(`${n.url}/v1/cluster`);
        return (
          body.nats.connected === true &&
          body.nodes.length === 2 &&
          body.nodes.every((x: { last_seen_ms: number }) => x.last_seen_ms <= 2 * HEARTBEAT_MS)
        );
      }, 10_000);
    // No load lock is held (a lock left by the outage would have a deadline still ahead).
    const nc = await connect({ servers: nats.url });
    try {
      const locks = await new Kvm(nc).open('voxserve_locks');
      for await (const key of await locks.keys()) {
        const e = await locks.get(key);
        if (e?.operation === 'PUT') expect(e.json<{ deadline: number }>().deadline).toBeLessThan(Date.now());
      }
    } finally {
      await nc.close();
    }
    const after = await runFile(A.url, 'silero-vad', VAD_FILE);
    expect(after.status).toBe(200);
    expect(after.body.segments).toEqual(want.vadFile);
  }, 120_000);
});

describe('SIGTERM on the only holder (a step of a rolling restart)', () => {
  let nats: NatsServer;
  let A: Node;
  let B: Node;
  let C: Node;

  beforeAll(async () => {
    nats = await startNats();
    [A, B, C] = await Promise.all(['A', 'B', 'C'].map((n) => startNode(nats.url, n)));
    const r = await post(`${A.url}/v1/models/load`, { id: 'silero-vad', node: 'C' });
    expect(r.status, JSON.stringify(r.body)).toBe(200);
    for (const n of [A, B]) await until(async () => (await holders(n.url, 'silero-vad')).join() === 'C', 5000);
  }, 120_000);
  afterAll(async () => {
    for (const n of [A, B, C]) n?.child.kill('SIGKILL');
    await nats?.stop();
  });

  it('hands its model over before it exits: the streams go on with no job sent again', async () => {
    for (const n of [A, B]) expect((await runFile(n.url, 'silero-vad', 'Front_Center.wav')).status).toBe(200);
    framesSent = 0;
    const streams = Array.from({ length: 8 }, (_, i) => stream([A, B][i % 2].url, 'silero-vad', VAD_FILE, 12));
    await until(() => framesSent > 8 * 120, 30_000);
    const exited = new Promise<number | null>((r) => C.child.once('exit', (code) => r(code)));
    C.child.kill('SIGTERM');
    // Draining at once in the registry.
    await until(async () => {
      const { body } = await json(`${A.url}/v1/cluster`);
      return body.nodes.find((n: { node: string }) => n.node === 'C')?.draining === true;
    }, 2 * HEARTBEAT_MS);
    expect(await exited).toBe(0);
    const s = await Promise.all(streams);
    for (const x of s) {
      expect(x.code).toBe(1000);
      expect(x.events).toEqual(want.vad);
    }
    const h = await holders(A.url, 'silero-vad');
    expect(h.length).toBe(1);
    expect(['A', 'B']).toContain(h[0]);
    // The model was held elsewhere before C unloaded: no job met a gone or unloaded holder.
    for (const n of [A, B]) {
      expect(await metric(n.url, 'voxserve_remote_failovers_total')).toBe(0);
      expect(await metric(n.url, 'voxserve_remote_jobs_sent_total', { outcome: 'not_held' })).toBe(0);
    }
  }, 120_000);
});
