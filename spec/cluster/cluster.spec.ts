/**
 * Cluster on NATS (issue 19, docs/cluster.md): three voxserve nodes (A, B, C, in this process,
 * each with its own memory probe) and one nats-server on loopback; once, a 3-server NATS cluster.
 * Expected results come from a single node without a cluster (S) running the same recordings.
 */
import { spawn } from 'node:child_process';
import { Kvm } from '@nats-io/kv';
import { connect } from '@nats-io/transport-node';
import { unpack } from 'msgpackr';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import WebSocket from 'ws';
import { VoxClient } from '../../client/node.js';
import { decodeMessage, type RemoteReply } from '../../cluster/wire.js';
import { ServerConfig } from '../../runtime/config.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { fixture, until, WaveFile } from '../helpers.js';
import { freePort, startNats, type NatsServer } from './nats-server.js';
import { wyomingSession } from './wyoming-client.js';

const GB = 1024 ** 3;
const HEARTBEAT_MS = 500;

/** A node of a cluster on `nats`, with a memory probe reading `free[name]`. */
function node(
  nats: string,
  name: string,
  free: Record<string, number>,
  extra: Record<string, unknown> = {},
): Promise<VoxServer> {
  return startServer(
    ServerConfig.parse({
      log_level: (process.env.CLUSTER_LOG as 'info') ?? 'silent',
      port: 0,
      isolation: 'thread',
      management: { enabled: true },
      cluster: { nats, node: name, heartbeat_ms: HEARTBEAT_MS },
      ...extra,
    }),
    { memoryProbe: () => free[name] },
  );
}

async function json(url: string, init?: RequestInit): Promise<{ status: number; body: any; headers: Headers }> {
  const res = await fetch(url, init);
  return { status: res.status, body: await res.json(), headers: res.headers };
}

const post = (url: string, body: unknown): Promise<{ status: number; body: any; headers: Headers }> =>
  json(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });

/** `POST /v1/tasks/run` of a fixture. */
function runFile(
  server: VoxServer,
  model: string,
  file: string,
  query = '',
): Promise<{ status: number; body: any; headers: Headers }> {
  return json(`${server.url}/v1/tasks/run?model=${model}${query}`, {
    method: 'POST',
    headers: { 'content-type': 'audio/wav' },
    body: new Uint8Array(fixture(file)),
  });
}

/**
 * Streams a fixture in 100 ms frames with `protocol`; resolves with every event but `ready` and `done` (their ids and
 * timings differ).
 */
function streamEvents(
  server: VoxServer,
  model: string,
  file: string,
  protocol = 'voxserve.v1.json',
): Promise<Record<string, unknown>[]> {
  const w = new WaveFile(fixture(file));
  const { sampleRate } = w.fmt as { sampleRate: number };
  const pcm = Buffer.from((w.data as { samples: Uint8Array }).samples);
  const frame = (sampleRate / 10) * 2;
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(
      `${server.url.replace('http', 'ws')}/v1/stream?model=${model}&sample_rate=${sampleRate}`,
      protocol,
    );
    const events: Record<string, unknown>[] = [];
    ws.on('error', reject);
    ws.on('message', (d: Buffer) => {
      const e = protocol.endsWith('msgpack') ? unpack(d) : JSON.parse(d.toString());
      if (e.type === 'error') reject(new Error(JSON.stringify(e)));
      if (e.type === 'ready') {
        for (let o = 0; o < pcm.length; o += frame) ws.send(pcm.subarray(o, o + frame));
        ws.send(JSON.stringify({ type: 'end' }));
      } else if (e.type !== 'done') events.push(e);
    });
    ws.on('close', (code) => (code === 1000 ? resolve(events) : reject(new Error(`closed ${code}`))));
  });
}

/** The nodes holding `model` as `GET /v1/models` on `server` reports them. */
async function holders(server: VoxServer, model: string): Promise<string[]> {
  const { body } = await json(`${server.url}/v1/models`);
  return (body.models.find((m: { id: string }) => m.id === model)?.nodes ?? [])
    .filter((n: { state: string }) => n.state === 'ready')
    .map((n: { node: string }) => n.node);
}

/** A counter's value in a node's `/metrics` (summed over the series matching every label given). */
async function metric(server: VoxServer, name: string, labels: Record<string, string>): Promise<number> {
  const text = await (await fetch(`${server.url}/metrics`)).text();
  let sum = 0;
  for (const line of text.split('\n')) {
    if (!line.startsWith(`${name}{`)) continue;
    if (Object.entries(labels).every(([k, v]) => line.includes(`${k}="${v}"`))) sum += Number(line.split(' ').pop());
  }
  return sum;
}

let single: VoxServer;
beforeAll(async () => {
  single = await startServer(
    ServerConfig.parse({ log_level: 'silent', port: 0, isolation: 'thread', wyoming: { enabled: true, port: 0 } }),
  );
});
afterAll(async () => {
  await single?.close();
});

describe('three nodes and one NATS server', () => {
  let nats: NatsServer;
  const free: Record<string, number> = { A: 4 * GB, B: 6 * GB, C: 16 * GB };
  let A: VoxServer;
  let B: VoxServer;
  let C: VoxServer;
  const all = (): VoxServer[] => [A, B, C];

  beforeAll(async () => {
    nats = await startNats();
    // B's memory guard asks for 4 GB of headroom: it refuses a load when it reports less than that free.
    [A, B, C] = await Promise.all([
      node(nats.url, 'A', free, { min_free_memory_mb: 100, wyoming: { enabled: true, port: 0 } }),
      node(nats.url, 'B', free, { min_free_memory_mb: 4000 }),
      node(nats.url, 'C', free, { min_free_memory_mb: 100 }),
    ]);
    await until(async () => (await json(`${A.url}/v1/cluster`)).body.nodes.length === 3, 5000);
  });
  afterAll(async () => {
    await Promise.all([A, B, C].map((s) => s?.close()));
    await nats?.stop();
  });

  it('GET /v1/cluster lists the three nodes with their free memory, on every node', async () => {
    for (const s of all()) {
      const { body } = await json(`${s.url}/v1/cluster`);
      expect(body.nats.connected).toBe(true);
      expect(body.nodes.map((n: { node: string }) => n.node)).toEqual(['A', 'B', 'C']);
      expect(body.nodes.map((n: { free_bytes: number }) => n.free_bytes)).toEqual([free.A, free.B, free.C]);
    }
    expect((await json(`${A.url}/ready`)).body).toMatchObject({
      status: 'ready',
      cluster: { node: 'A', nats: 'connected' },
    });
  });

  it('VoxClient given several node URLs uses the first that answers /ready', async () => {
    const dead = `http://127.0.0.1:${await freePort()}`;
    const vox = new VoxClient({ urls: [dead, B.url, C.url] });
    const models = await vox.models();
    expect(models.some((m) => m.id === 'silero-vad')).toBe(true);
    expect(vox.url).toBe(B.url);
  });

  it('a first request on A for a model nobody holds loads it on C (most free memory); A runs it there', async () => {
    const r = await runFile(A, 'silero-vad', 'silero_test.wav');
    expect(r.status, JSON.stringify(r.body)).toBe(200);
    expect(r.body.segments).toEqual((await runFile(single, 'silero-vad', 'silero_test.wav')).body.segments);
    await until(async () => (await holders(A, 'silero-vad')).join() === 'C', 2000);
    expect(
      await metric(A, 'voxserve_remote_jobs_sent_total', { model: 'silero-vad', node: 'C', outcome: 'ok' }),
    ).toBeGreaterThan(0);
    expect(
      await metric(C, 'voxserve_remote_jobs_served_total', { model: 'silero-vad', outcome: 'ok' }),
    ).toBeGreaterThan(0);
    expect(await metric(A, 'voxserve_loads_total', { model: 'silero-vad' })).toBe(0);
  });

  it("a holder that served only other nodes' jobs collects its garbage once idle, as after its own requests (issue 45)", async () => {
    // Past any collection earlier work on C may still be due (the collector runs 5 s after work ends).
    await new Promise((r) => setTimeout(r, 6500));
    const base = C.idleGc.runs;
    const r = await runFile(A, 'silero-vad', 'silero_test.wav');
    expect(r.status, JSON.stringify(r.body)).toBe(200);
    expect(await holders(A, 'silero-vad')).toEqual(['C']);
    // The collector samples once a second and runs after 5 s without work (runtime/memory.ts).
    await until(async () => C.idleGc.runs > base, 9000);
  }, 20_000);

  it.each(['voxserve.v1.json', 'voxserve.v1.msgpack'])(
    "a VAD stream on A held only by C gives the single node's events and file segments (%s)",
    async (protocol) => {
      const [remote, local, file] = await Promise.all([
        streamEvents(A, 'silero-vad', 'silero_test.wav', protocol),
        streamEvents(single, 'silero-vad', 'silero_test.wav', protocol),
        runFile(single, 'silero-vad', 'silero_test.wav'),
      ]);
      expect(remote).toEqual(local);
      const ends = remote
        .filter((e) => e.type === 'speech_end')
        .map((e) => ({ start_ms: e.start_ms, end_ms: e.end_ms }));
      expect(ends.length).toBeGreaterThan(2);
      expect(ends).toEqual(
        file.body.segments.map((s: { start_ms: number; end_ms: number }) => ({
          start_ms: s.start_ms,
          end_ms: s.end_ms,
        })),
      );
      expect(await holders(B, 'silero-vad')).toEqual(['C']);
    },
  );

  it("a wake-word stream and a Wyoming session on A for hey-jarvis held only by C give the single node's detections", async () => {
    const file = 'espeak_hey_jarvis_22k.wav';
    const want = (await runFile(single, 'hey-jarvis', file)).body.detections;
    expect(want.length).toBeGreaterThan(0);
    const remote = await streamEvents(A, 'hey-jarvis', file);
    expect(await holders(A, 'hey-jarvis')).toEqual(['C']);
    expect(remote).toEqual(await streamEvents(single, 'hey-jarvis', file));
    expect(remote.filter((e) => e.type === 'detection').map(({ type: _t, ...d }) => d)).toEqual(want);
    // Wyoming on A, against Wyoming on the single node.
    const [wa, ws] = await Promise.all([
      wyomingSession(A.wyoming!.port, file),
      wyomingSession(single.wyoming!.port, file),
    ]);
    expect(wa.some((e) => e.type === 'detection')).toBe(true);
    expect(wa).toEqual(ws);
  });

  it('concurrent first requests for one model on all three nodes: one load in the cluster, every request answered', async () => {
    const rs = await Promise.all(all().map((s) => runFile(s, 'silero-vad-v5', 'silero_test.wav')));
    const want = (await runFile(single, 'silero-vad-v5', 'silero_test.wav')).body.segments;
    for (const r of rs) {
      expect(r.status, JSON.stringify(r.body)).toBe(200);
      expect(r.body.segments).toEqual(want);
    }
    const loads = await Promise.all(all().map((s) => metric(s, 'voxserve_loads_total', { model: 'silero-vad-v5' })));
    expect(loads.reduce((a, b) => a + b, 0)).toBe(1);
    await until(async () => (await holders(A, 'silero-vad-v5')).length === 1, 2000);
  });

  it('replicas: 2 keeps two holders, and jobs from the third node spread over both', async () => {
    const r = await post(`${A.url}/v1/models/load`, { id: 'hey-mycroft', replicas: 2 });
    expect(r.status, JSON.stringify(r.body)).toBe(200);
    expect(r.body.nodes.sort()).toEqual(['B', 'C']);
    for (const s of all()) await until(async () => (await holders(s, 'hey-mycroft')).sort().join() === 'B,C', 2000);
    const rs = await Promise.all(Array.from({ length: 6 }, () => runFile(A, 'hey-mycroft', 'espeak_sentence_16k.wav')));
    for (const x of rs) expect(x.status).toBe(200);
    expect(
      await metric(B, 'voxserve_remote_jobs_served_total', { model: 'hey-mycroft', outcome: 'ok' }),
    ).toBeGreaterThan(0);
    expect(
      await metric(C, 'voxserve_remote_jobs_served_total', { model: 'hey-mycroft', outcome: 'ok' }),
    ).toBeGreaterThan(0);
  });

  it('management on one node acts on the holders; status on every node agrees within a heartbeat', async () => {
    const r = await post(`${A.url}/v1/models/unload`, { id: 'hey-mycroft' });
    expect(r.status, JSON.stringify(r.body)).toBe(200);
    expect(B.supervisor.status('hey-mycroft')!.state).toBe('unloaded');
    expect(C.supervisor.status('hey-mycroft')!.state).toBe('unloaded');
    await new Promise((res) => setTimeout(res, 2 * HEARTBEAT_MS));
    const views = await Promise.all(
      all().map(async (s) =>
        (await json(`${s.url}/v1/models`)).body.models
          .map((m: { id: string; nodes: { node: string }[] }) => [m.id, m.nodes.map((n) => n.node)])
          .sort(),
      ),
    );
    expect(views[1]).toEqual(views[0]);
    expect(views[2]).toEqual(views[0]);
    expect(Object.fromEntries(views[0])['hey-mycroft']).toEqual([]);
    // An invalid reconfiguration changes nothing anywhere.
    const bad = await post(`${A.url}/v1/models/load`, { id: 'silero-vad', slots: 99 });
    expect(bad.status).toBe(400);
    expect(bad.body.error.message).toMatch(/slots/);
    expect(C.supervisor.status('silero-vad')!.slots).toBe(1);
  });

  it('busy holder: with max_queued reached on C, A answers 503 with Retry-After within the busy timeout, then uses B once B holds it too', async () => {
    let r = await post(`${A.url}/v1/models/load`, { id: 'alexa', node: 'C', max_streams: 1, max_queued: 1 });
    expect(r.status, JSON.stringify(r.body)).toBe(200);
    const entry = C.supervisor.getOrRegister('alexa')!;
    // One lease held and one waiting: C's queue for alexa is full.
    const held = await entry.admission.acquire({});
    const waiting = entry.admission.acquire({});
    try {
      const t0 = Date.now();
      r = await runFile(A, 'alexa', 'espeak_alexa_16k.wav', '&busy_timeout_ms=400');
      expect(r.status, JSON.stringify(r.body)).toBe(503);
      expect(r.body.error.type).toBe('server_busy');
      expect(r.headers.get('retry-after')).toBeTruthy();
      expect(Date.now() - t0).toBeLessThan(3000);
      expect(
        await metric(A, 'voxserve_remote_jobs_sent_total', { model: 'alexa', node: 'C', outcome: 'server_busy' }),
      ).toBeGreaterThan(0);
      r = await post(`${A.url}/v1/models/load`, { id: 'alexa', node: 'B' });
      expect(r.status, JSON.stringify(r.body)).toBe(200);
      r = await runFile(A, 'alexa', 'espeak_alexa_16k.wav', '&busy_timeout_ms=5000');
      expect(r.status, JSON.stringify(r.body)).toBe(200);
      expect(r.body.detections).toEqual((await runFile(single, 'alexa', 'espeak_alexa_16k.wav')).body.detections);
      expect(await metric(B, 'voxserve_remote_jobs_served_total', { model: 'alexa', outcome: 'ok' })).toBeGreaterThan(
        0,
      );
    } finally {
      held.release();
      (await waiting).release();
    }
  });

  it('a model unloaded on every holder while A still runs it remotely is placed again on the next request', async () => {
    for (const n of ['B', 'C']) {
      const u = await post(`${A.url}/v1/models/unload`, { id: 'alexa', node: n });
      expect(u.status, JSON.stringify(u.body)).toBe(200);
    }
    expect(A.supervisor.status('alexa')!.state).toBe('ready');
    await until(async () => (await holders(A, 'alexa')).length === 0, 3000);
    const r = await runFile(A, 'alexa', 'espeak_alexa_16k.wav', '&busy_timeout_ms=20000');
    expect(r.status, JSON.stringify(r.body)).toBe(200);
    expect(r.body.detections).toEqual((await runFile(single, 'alexa', 'espeak_alexa_16k.wav')).body.detections);
    expect((await holders(A, 'alexa')).length).toBe(1);
  });

  describe("placement by free memory and each node's own guards", () => {
    it('B reports the most free memory: B loads', async () => {
      Object.assign(free, { A: 1 * GB, B: 8 * GB, C: 2 * GB });
      await new Promise((res) => setTimeout(res, 2 * HEARTBEAT_MS));
      const r = await runFile(A, 'timer', 'espeak_sentence_16k.wav');
      expect(r.status, JSON.stringify(r.body)).toBe(200);
      expect(await holders(A, 'timer')).toEqual(['B']);
    });

    it("B's memory guard refuses: the next node by free memory (C) loads", async () => {
      Object.assign(free, { A: 1 * GB, B: 3.5 * GB, C: 2 * GB });
      await new Promise((res) => setTimeout(res, 2 * HEARTBEAT_MS));
      const r = await runFile(A, 'weather', 'espeak_sentence_16k.wav');
      expect(r.status, JSON.stringify(r.body)).toBe(200);
      expect(await holders(A, 'weather')).toEqual(['C']);
    });

    it('every node refuses: 503 insufficient_memory naming the cluster', async () => {
      // Nothing resident anywhere (else each node would first evict its idle models to make room).
      const u = await post(`${B.url}/v1/models/unload_all`, {});
      expect(u.status, JSON.stringify(u.body)).toBe(200);
      for (const s of all()) expect(s.supervisor.statuses().filter((m) => m.state !== 'unloaded')).toEqual([]);
      Object.assign(free, { A: 0.05 * GB, B: 0.05 * GB, C: 0.05 * GB });
      await new Promise((res) => setTimeout(res, 2 * HEARTBEAT_MS));
      const r = await runFile(A, 'hey-rhasspy', 'espeak_sentence_16k.wav');
      Object.assign(free, { A: 4 * GB, B: 6 * GB, C: 16 * GB });
      expect(r.status, JSON.stringify(r.body)).toBe(503);
      expect(r.body.error.type).toBe('insufficient_memory');
      expect(r.body.error.message).toMatch(/no node of the cluster could load hey-rhasspy \(3 asked\)/);
      expect(await holders(A, 'hey-rhasspy')).toEqual([]);
    });
  });

  it("malformed messages on a node's subjects and malformed registry entries: every node stays up, connected, and hears the others", async () => {
    // Anyone who can publish on NATS can send these (a breaker did): before, the first killed B, the
    // second closed C's NATS connection, the third ended every node's registry watch for good.
    const nc = await connect({ servers: nats.url });
    const enc = (t: string): Uint8Array => new TextEncoder().encode(t);
    try {
      for (const body of ['not json', 'null', '[]']) {
        const r = await nc.request('voxserve.node.B.load', enc(body), { timeout: 5000 });
        expect(decodeMessage<RemoteReply>(r.data).type, body).toBe('error');
      }
      for (const part of ['garbage', '\u00ff\u00ff\u00ff\u007fxx', '\u0004\u0000\u0000\u0000null'])
        nc.publish('voxserve.node.C.job.part', enc(part));
      const kv = await new Kvm(nc).open('voxserve_nodes');
      await kv.put('node.x', enc('not json'));
      await kv.put('node.y', enc('{"node":"y"}'));
      await kv.put('node.z', enc('[]'));
      await new Promise((res) => setTimeout(res, 4 * HEARTBEAT_MS));
      for (const s of all()) {
        const { body } = await json(`${s.url}/v1/cluster`);
        expect(body.nats.connected).toBe(true);
        expect(body.nodes.map((n: { node: string }) => n.node)).toEqual(['A', 'B', 'C']);
        // Heard within the last heartbeats: the registry watch goes on.
        for (const n of body.nodes) expect(n.last_seen_ms, n.node).toBeLessThan(3 * HEARTBEAT_MS);
      }
      for (const k of ['node.x', 'node.y', 'node.z']) await kv.delete(k);
      const r = await runFile(A, 'silero-vad-v5', 'silero_test.wav');
      expect(r.status, JSON.stringify(r.body)).toBe(200);
    } finally {
      await nc.close();
    }
  });

  it('losing NATS: /ready says so, and a node keeps serving the models it holds', async () => {
    const r0 = await runFile(C, 'silero-vad-v5', 'silero_test.wav');
    expect(r0.status).toBe(200);
    await nats.stop();
    await until(async () => (await json(`${C.url}/ready`)).body.cluster?.nats === 'disconnected', 5000);
    expect((await json(`${C.url}/ready`)).status).toBe(200);
    // C loads locally what it needs while NATS is away.
    const r = await runFile(C, 'silero-vad', 'silero_test.wav');
    expect(r.status, JSON.stringify(r.body)).toBe(200);
    expect(r.body.segments).toEqual((await runFile(single, 'silero-vad', 'silero_test.wav')).body.segments);
  });
});

describe('NATS credentials and reachability', () => {
  it('a node with the wrong token is refused, naming the URL; the right token joins', async () => {
    const nats = await startNats(['--auth', 's3cret-token']);
    try {
      const config = (token: string): ServerConfig =>
        ServerConfig.parse({
          log_level: 'silent',
          port: 0,
          cluster: { nats: nats.url, node: 'X', token, connect_timeout_ms: 2000 },
        });
      await expect(startServer(config('wrong-token'))).rejects.toThrow(
        new RegExp(`cannot connect to NATS at ${nats.url}.*[Aa]uthorization`),
      );
      await expect(startServer(config('wrong-token'))).rejects.not.toThrow(/wrong-token/);
      const ok = await startServer(config('s3cret-token'));
      expect((await json(`${ok.url}/v1/cluster`)).body.nodes.map((n: { node: string }) => n.node)).toEqual(['X']);
      await ok.close();
    } finally {
      await nats.stop();
    }
  });

  it('serve --cluster with no NATS listening exits 1 naming the URL', async () => {
    const port = await freePort();
    const child = spawn(
      process.execPath,
      ['dist/tools/cli.js', 'serve', '--port', '0', '--cluster', `nats://127.0.0.1:${port}`, '--node', 'lonely'],
      { stdio: ['ignore', 'pipe', 'pipe'] },
    );
    let err = '';
    child.stderr.on('data', (d) => (err += d));
    const code = await new Promise<number | null>((r) => child.on('exit', (c) => r(c)));
    expect(code).toBe(1);
    expect(err).toContain(`cannot connect to NATS at nats://127.0.0.1:${port}`);
  });

  it('credentials in the NATS URL or the config never appear in a start-up error', async () => {
    const port = await freePort();
    const child = spawn(
      process.execPath,
      [
        'dist/tools/cli.js',
        'serve',
        '--port',
        '0',
        '--cluster',
        `nats://tok-s3cret@127.0.0.1:${port},nats://bob:pw-s3cret@127.0.0.1:${port}`,
        '--node',
        'lonely',
      ],
      { stdio: ['ignore', 'pipe', 'pipe'] },
    );
    let out = '';
    child.stderr.on('data', (d) => (out += d));
    child.stdout.on('data', (d) => (out += d));
    expect(await new Promise<number | null>((r) => child.on('exit', (c) => r(c)))).toBe(1);
    expect(out).toContain(`cannot connect to NATS at nats://***@127.0.0.1:${port},nats://***@127.0.0.1:${port}`);
    expect(out).not.toMatch(/s3cret/);
  });
});

describe('a 3-server NATS cluster', () => {
  it('nodes on different NATS servers place and run a model across them', async () => {
    const [p1, p2, p3, c1, c2, c3] = await Promise.all(Array.from({ length: 6 }, () => freePort()));
    const routes = `nats://127.0.0.1:${c1},nats://127.0.0.1:${c2},nats://127.0.0.1:${c3}`;
    const servers = await Promise.all(
      [
        [p1, c1, 'n1'],
        [p2, c2, 'n2'],
        [p3, c3, 'n3'],
      ].map(([p, c, n]) =>
        startNats(
          ['-n', String(n), '--cluster_name', 'vox', '--cluster', `nats://127.0.0.1:${c}`, '--routes', routes],
          p as number,
        ),
      ),
    );
    const free = { A: 1 * GB, C: 8 * GB };
    let A: VoxServer | undefined;
    let C: VoxServer | undefined;
    try {
      [A, C] = await Promise.all([
        node(servers[0].url, 'A', free, {
          cluster: { nats: servers[0].url, node: 'A', heartbeat_ms: HEARTBEAT_MS, connect_timeout_ms: 20_000 },
        }),
        node(servers[2].url, 'C', free, {
          cluster: { nats: servers[2].url, node: 'C', heartbeat_ms: HEARTBEAT_MS, connect_timeout_ms: 20_000 },
        }),
      ]);
      // Both nodes see each other with fresh heartbeats (a new NATS cluster settles its JetStream placement first).
      const settled = async (): Promise<boolean> => {
        for (const s of [A!, C!]) {
          const { body } = await json(`${s.url}/v1/cluster`);
          if (
            body.nodes.length !== 2 ||
            body.nodes.some((n: { last_seen_ms: number }) => n.last_seen_ms > HEARTBEAT_MS)
          )
            return false;
        }
        return true;
      };
      await until(settled, 20_000);
      await new Promise((res) => setTimeout(res, 2 * HEARTBEAT_MS));
      await until(settled, 20_000);
      const r = await runFile(A, 'silero-vad', 'silero_test.wav');
      expect(r.status, JSON.stringify(r.body)).toBe(200);
      expect(r.body.segments).toEqual((await runFile(single, 'silero-vad', 'silero_test.wav')).body.segments);
      expect(await holders(A, 'silero-vad')).toEqual(['C']);
    } finally {
      await Promise.all([A?.close(), C?.close()]);
      await Promise.all(servers.map((s) => s.stop()));
    }
  });
});
