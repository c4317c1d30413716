/**
 * Scripted cluster faults over the in-memory NATS (./fake-nats.ts, every step at once) with a fake
 * clock: each test plays one sequence that the interleaving suite (./interleavings.spec.ts) found
 * or that it cannot reach, and checks that the cluster settles it within a bound tied to its
 * heartbeats and timeouts (docs/cluster.md, issue 20 follow-ups).
 */
import { pino } from 'pino';
import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest';
import { validateModelConfig } from '../../actors/model.js';
import { Supervisor } from '../../actors/supervisor.js';
import { answerWithin } from '../../cluster/manage.js';
import { encodeJson, lockKey } from '../../cluster/nats.js';
import { ClusterNode } from '../../cluster/node.js';
import { ModelConfig, ServerConfig } from '../../runtime/config.js';
import { VoxError, voxError } from '../../runtime/errors.js';
import type { LoadedModel, ModelLoader } from '../../runtime/loader.js';
import type { Job, JobResult, VadJob } from '../../runtime/slots/slot-protocol.js';
import { SlotPool, type SlotHost } from '../../runtime/slots/slots.js';
import { FakeNats } from './fake-nats.js';

const HEARTBEAT_MS = 100;
const BUSY_TIMEOUT_MS = 300;
const LOAD_TIMEOUT_MS = 200;

const CATALOG: ModelConfig[] = [
  ModelConfig.parse({ id: 'a', task: 'vad', path: '/fake.onnx', max_batch_delay_ms: 0 }),
  // One stream at a time, and a load that may take longer than the busy timeout.
  ModelConfig.parse({
    id: 'c',
    task: 'vad',
    path: '/fake.onnx',
    max_batch_delay_ms: 0,
    max_streams: 1,
    load_timeout_ms: 1000,
  }),
];

interface TestNode {
  name: string;
  sup: Supervisor;
  cluster: ClusterNode;
  /** Loads (pools started) on this node, and those resident now. */
  loads: number;
  resident: number;
  /** The next loads' slot hosts never come up (until the load's signal aborts them). */
  hang: boolean;
  /** What its memory probe reports, bytes (placements go to the most free first). */
  memory: number;
}

/** A loader of instant fake slots (a job's result is its state, so an answer can be matched to its job). */
function loader(n: TestNode): ModelLoader {
  return async (config: ModelConfig, signal?: AbortSignal): Promise<LoadedModel> => {
    n.loads++;
    const hang = n.hang;
    const host = async (): Promise<SlotHost> => {
      if (hang)
        await new Promise<void>((resolve) =>
          signal?.aborted ? resolve() : signal?.addEventListener('abort', () => resolve(), { once: true }),
        );
      if (signal?.aborted) throw new Error('slot host was killed by SIGKILL');
      return {
        info: {},
        run: async (job: Job): Promise<JobResult> => {
          const vad = job as VadJob;
          return { kind: 'vad', probs: new Float32Array(1), state: vad.state.slice(), context: new Float32Array(64) };
        },
        close: async () => {},
        onExit: () => {},
        residentBytes: () => 0,
      };
    };
    const pool = await SlotPool.start({ kind: 'vad', model: '/fake.onnx' }, config.slots, host, { signal });
    n.resident++;
    return {
      pool,
      residentBytes: 1000,
      close: async () => {
        await pool.close();
        n.resident--;
      },
    };
  };
}

const log = pino({ level: process.env.CLUSTER_LOG ?? 'silent' });

async function startNodes(
  bus: FakeNats,
  names: string[],
  memory: number[] = [],
  busyMs = BUSY_TIMEOUT_MS,
): Promise<TestNode[]> {
  const nodes: TestNode[] = [];
  for (const [i, name] of names.entries()) {
    const config = ServerConfig.parse({
      log_level: 'silent',
      busy_timeout_ms: busyMs,
      load_timeout_ms: LOAD_TIMEOUT_MS,
      models_root: false,
      cluster: { nats: 'nats://fake:4222', node: name, heartbeat_ms: HEARTBEAT_MS, lock_ms: 400, job_deadline_ms: 100 },
    });
    const n = { name, loads: 0, resident: 0, hang: false, memory: memory[i] ?? 3e12 } as TestNode;
    n.cluster = await ClusterNode.connect(config, {
      log: log.child({ node: name }),
      memoryProbe: () => n.memory,
      link: bus.connect(name),
    });
    n.sup = new Supervisor(config, {
      loader: loader(n),
      catalog: CATALOG,
      memoryProbe: () => n.memory,
      footprint: async () => 1000,
      log: log.child({ node: name }),
      place: n.cluster.place,
    });
    await n.sup.start();
    nodes.push(n);
  }
  for (const n of nodes) await n.cluster.attach(n.sup, `http://${n.name}.invalid`);
  await vi.advanceTimersByTimeAsync(HEARTBEAT_MS);
  return nodes;
}

/** How `p` ended by now: its value, its error, or 'pending'. */
function watch<T>(p: Promise<T>): () => { value?: T; error?: unknown } | 'pending' {
  let out: { value?: T; error?: unknown } | 'pending' = 'pending';
  p.then(
    (value) => (out = { value }),
    (error) => (out = { error }),
  );
  return () => out;
}

/** One file request's lease and job on `n` for model `id`: resolves with the job's result state marker. */
async function request(n: TestNode, id: string, marker: number): Promise<number> {
  const entry = n.sup.require(id);
  const lease = await entry.admit({});
  try {
    const { pool } = await entry.ensureReady();
    const state = new Float32Array(256);
    state[0] = marker;
    const r = await pool.run({ kind: 'vad', windows: new Float32Array(512), state, context: new Float32Array(64) });
    return r.kind === 'vad' ? r.state[0] : Number.NaN;
  } finally {
    lease.release();
  }
}

let bus: FakeNats;
let nodes: TestNode[] = [];

beforeEach(() => {
  vi.useFakeTimers({ toFake: ['setTimeout', 'clearTimeout', 'setInterval', 'clearInterval', 'Date', 'performance'] });
  bus = new FakeNats();
});

afterEach(async () => {
  for (const n of nodes) {
    if (bus.alive(n.name)) await n.cluster.close();
    if (n.sup.phase === 'stopped') continue;
    n.sup.revokeAll(voxError('shutting_down'));
    const stopped = n.sup.stop(0);
    await vi.advanceTimersByTimeAsync(1000);
    await stopped;
  }
  nodes = [];
  vi.useRealTimers();
});

describe('cluster faults, scripted over the in-memory NATS', () => {
  it('a request to a node whose NATS drops and comes back is sent again at its next heartbeat (not waited for an hour)', async () => {
    nodes = await startNodes(bus, ['A', 'B']);
    const [a, b] = nodes;
    // A is cut off: B's load request reaches NATS and waits for A; then NATS loses A's connection
    // (the request is lost with it) and A reconnects at once, so B keeps taking A for live.
    bus.stall('A');
    const load = watch(
      b.cluster.manageLoad({ id: 'a', node: 'A' }, (fields) => validateModelConfig({ ...CATALOG[0], ...fields })),
    );
    await vi.advanceTimersByTimeAsync(10);
    bus.lose('A');
    await vi.advanceTimersByTimeAsync(10);
    bus.heal('A');
    // Answered within a few heartbeats of A's return (before: after an hour, the management timeout).
    await vi.advanceTimersByTimeAsync(5 * HEARTBEAT_MS);
    expect(load()).toEqual({ value: { id: 'a', loaded: true, reconfigured: false, nodes: ['A'] } });
    expect(a.sup.status('a')?.state).toBe('ready');
  });

  it('a model loaded behind a remote pool after its holder died is abandoned at its load_timeout_ms', async () => {
    nodes = await startNodes(bus, ['A', 'B']);
    const [a, b] = nodes;
    await b.cluster.loadHere('a', {});
    await vi.advanceTimersByTimeAsync(2 * HEARTBEAT_MS);
    // A runs a on a remote pool (B holds it).
    expect(await request(a, 'a', 1)).toBe(1);
    expect(a.loads).toBe(0);
    // B dies; A's next job finds no holder and loads a behind its remote pool, whose slot host hangs.
    bus.kill('B');
    a.hang = true;
    const job = watch(request(a, 'a', 2));
    await vi.advanceTimersByTimeAsync(LOAD_TIMEOUT_MS + BUSY_TIMEOUT_MS + 4 * HEARTBEAT_MS);
    // The load was abandoned at load_timeout_ms, and the job failed definitely within the busy timeout.
    expect(a.loads).toBe(1);
    const r = job();
    expect(r).not.toBe('pending');
    expect((r as { error?: VoxError }).error).toBeInstanceOf(VoxError);
    expect(a.resident).toBe(0);
    // With the load coming up again, the next job loads it behind the remote pool and runs there.
    a.hang = false;
    const next = watch(request(a, 'a', 3));
    await vi.advanceTimersByTimeAsync(4 * HEARTBEAT_MS);
    expect(next()).toEqual({ value: 3 });
    expect(a.resident).toBe(1);
  });

  it('NATS lost while a job of a model held here too waits on another holder: it runs here at once (not at NATS back or its job deadline)', async () => {
    nodes = await startNodes(bus, ['A', 'B', 'C']);
    const [a, b, c] = nodes;
    await b.cluster.loadHere('a', {});
    await vi.advanceTimersByTimeAsync(2 * HEARTBEAT_MS);
    expect(await request(a, 'a', 1)).toBe(1);
    // B dies: A loads the model behind its remote pool; then C holds it too.
    bus.kill('B');
    const adopted = watch(request(a, 'a', 2));
    await vi.advanceTimersByTimeAsync(4 * HEARTBEAT_MS);
    expect(adopted()).toEqual({ value: 2 });
    expect(a.resident).toBe(1);
    await c.cluster.loadHere('a', {});
    await vi.advanceTimersByTimeAsync(2 * HEARTBEAT_MS);
    // C hears nothing more (its messages held); a tie between here and C goes to C: the first job waits on C.
    bus.stall('C');
    vi.spyOn(Math, 'random').mockReturnValue(0.99);
    const jobs = [3, 4, 5].map((k) => watch(request(a, 'a', k)));
    await vi.advanceTimersByTimeAsync(1);
    vi.mocked(Math.random).mockRestore();
    expect(jobs.map((j) => j())).toContain('pending');
    // A loses NATS: the job waiting on C runs here within a heartbeat.
    bus.lose('A');
    await vi.advanceTimersByTimeAsync(HEARTBEAT_MS);
    expect(jobs.map((j) => j())).toEqual([{ value: 3 }, { value: 4 }, { value: 5 }]);
    bus.heal('A');
    bus.heal('C');
    await vi.advanceTimersByTimeAsync(2 * HEARTBEAT_MS);
  });

  it('a first request on a node for a model whose only holder just died places it at once (not no_holder until the holder misses 3 heartbeats)', async () => {
    nodes = await startNodes(bus, ['A', 'B']);
    const [a, b] = nodes;
    await b.cluster.loadHere('a', {});
    await vi.advanceTimersByTimeAsync(2 * HEARTBEAT_MS);
    // B dies (with its ingress's streams); A still lists it as a holder for up to 3 heartbeats.
    bus.kill('B');
    const job = watch(request(a, 'a', 7));
    await vi.advanceTimersByTimeAsync(HEARTBEAT_MS);
    // Placed here within a heartbeat (before: 503 no_holder "no holder of a answered" at once).
    expect(job()).toEqual({ value: 7 });
    expect(a.loads).toBe(1);
  });

  it("an ingress keeps its whole window of jobs in flight to a holder, round after round (a remote pool's places lost one each time two jobs ended together)", async () => {
    nodes = await startNodes(bus, ['A', 'B']);
    const [a, b] = nodes;
    await b.cluster.loadHere('a', {});
    await vi.advanceTimersByTimeAsync(2 * HEARTBEAT_MS);
    const entry = a.sup.require('a');
    const lease = await entry.admit({});
    try {
      const { pool } = await entry.ensureReady();
      const job = (): Job => ({
        kind: 'vad',
        windows: new Float32Array(512),
        state: new Float32Array(256),
        context: new Float32Array(64),
      });
      // B holds it with 1 slot: A's window is 2 jobs in flight, every round (before: a place lost per round, 1 once they ran out).
      for (let round = 0; round < 40; round++) {
        const runs = [pool.run(job()), pool.run(job()), pool.run(job())];
        expect([pool.inFlight, pool.queued], `round ${round}`).toEqual([2, 1]);
        await vi.advanceTimersByTimeAsync(HEARTBEAT_MS);
        await Promise.all(runs);
      }
    } finally {
      lease.release();
    }
  });

  it('a node asked to load a model it is loading for its own request answers with that load, not busy (no second load elsewhere)', async () => {
    nodes = await startNodes(bus, ['A', 'C'], [1e12, 2e12]);
    const [a, c] = nodes;
    c.hang = true;
    // A's first request takes c's load lock and asks C (the most free memory); C, cut off, has a
    // request of its own for c waiting for that lock, holding c's only lease.
    bus.stall('C');
    const mine = watch(request(c, 'c', 1));
    const theirs = watch(request(a, 'c', 2));
    await vi.advanceTimersByTimeAsync(10);
    bus.heal('C');
    // C loads c for both (its slot host hangs, up to c's load timeout of 1 s): past the busy timeout
    // A must still wait for C's answer (before: C answered busy, the lease being taken, and A loaded c too).
    await vi.advanceTimersByTimeAsync(BUSY_TIMEOUT_MS + 2 * HEARTBEAT_MS);
    expect(c.loads).toBe(1);
    expect(a.loads).toBe(0);
    expect(mine()).toBe('pending');
    expect(theirs()).toBe('pending');
  });

  it('a management load whose answer arrives after the supervisor stopped is refused there as shutting down (no TypeError)', async () => {
    nodes = await startNodes(bus, ['A', 'B'], [1e12, 2e12]);
    const [a] = nodes;
    // A asks B (the most free memory) first to load a; B answers only after A's supervisor has stopped; A then loads
    // its own
    // replica (replicas: 2), on a stopped supervisor.
    bus.stall('B');
    const load = watch(
      a.cluster.manageLoad({ id: 'a', replicas: 2 }, (fields) => validateModelConfig({ ...CATALOG[0], ...fields })),
    );
    await vi.advanceTimersByTimeAsync(10);
    const stopped = a.sup.stop(0);
    await vi.advanceTimersByTimeAsync(10);
    await stopped;
    bus.heal('B');
    await vi.advanceTimersByTimeAsync(5 * HEARTBEAT_MS);
    // B holds it; A's own replica is refused as shutting down (before: a TypeError in getOrRegister).
    expect(load()).toMatchObject({
      value: { nodes: ['B'], replicas: 1, refused: [expect.stringMatching(/^A: .*shutting down/i)] },
    });
  });

  it.each(['unload', 'reply'])(
    'an unload whose %s is lost in transit is sent again after 3 heartbeats of silence and answered (not waited for an hour)',
    async (kind) => {
      nodes = await startNodes(bus, ['A', 'B']);
      const [a, b] = nodes;
      await b.cluster.loadHere('a', {});
      await vi.advanceTimersByTimeAsync(2 * HEARTBEAT_MS);
      bus.dropNext(kind);
      const unload = watch(a.cluster.manageUnload(['a'], 'B'));
      // Both nodes stay live and connected: only the silence tells.
      await vi.advanceTimersByTimeAsync(5 * HEARTBEAT_MS);
      expect(bus.sent[`dropped ${kind}`]).toBe(1);
      expect(unload()).toMatchObject({ value: { unloaded: ['a'], nodes: { B: { unloaded: ['a'] } } } });
      expect(b.sup.status('a')?.state).toBe('unloaded');
    },
  );

  it('a management call no answer of which ever arrives is answered 503 node_unreachable within its bound (the busy timeout and a margin)', async () => {
    nodes = await startNodes(bus, ['A', 'B']);
    const [a, b] = nodes;
    await b.cluster.loadHere('a', {});
    await vi.advanceTimersByTimeAsync(2 * HEARTBEAT_MS);
    // Every answer from B is lost (its copies sent again every 3 heartbeats included).
    for (let i = 0; i < 50; i++) bus.dropNext('reply');
    const bound = answerWithin(a.cluster);
    // The bound from docs/cluster.md: the busy timeout, 3 heartbeats and 1 s.
    expect(bound).toBe(BUSY_TIMEOUT_MS + 3 * HEARTBEAT_MS + 1000);
    const unload = watch(a.cluster.manageUnload(['a'], 'B'));
    await vi.advanceTimersByTimeAsync(bound - 50);
    expect(unload()).toBe('pending');
    await vi.advanceTimersByTimeAsync(100);
    const r = unload();
    expect(r).not.toBe('pending');
    expect((r as { error?: VoxError }).error).toMatchObject({ code: 'node_unreachable', status: 503 });
  });

  it('a node leaving the cluster releases the load locks its abandoned placements still hold (not left until their deadline)', async () => {
    nodes = await startNodes(bus, ['A', 'B']);
    const [a] = nodes;
    // A placement holding a's lock is abandoned with the node: its release would come after the connection closed.
    const lock = await a.cluster.locks.take('a');
    expect(lock).not.toBeNull();
    await a.cluster.close();
    const live = [...bus.locks.entries.values()].filter((e) => e.operation === 'PUT');
    expect(live.map((e) => e.key)).toEqual([]);
    // Its placement's own release later is a no-op.
    await lock!.release();
  });

  it('a node whose registry watch lags takes the load lock right after another node loaded the model on itself: it uses that holder, no second load', async () => {
    // A has the most free memory as A sees it, so A's first request loads a on A. B's registry
    // watch lags (a write reaches it 10 heartbeats late), and B reports more free memory than A by
    // the time of B's own first request, right after A's placement gave the lock back.
    nodes = await startNodes(bus, ['A', 'B'], [2e12, 1e12]);
    const [a, b] = nodes;
    bus.lag('B', 10 * HEARTBEAT_MS);
    b.memory = 3e12;
    expect(await request(a, 'a', 1)).toBe(1);
    expect(a.loads).toBe(1);
    const theirs = watch(request(b, 'a', 2));
    await vi.advanceTimersByTimeAsync(BUSY_TIMEOUT_MS);
    // Before: B took the free lock, saw no holder (its view of A predates A's load) and loaded a
    // on itself (most free memory): two holders from one first request each.
    expect(theirs()).toEqual({ value: 2 });
    expect(b.loads).toBe(0);
    expect(a.loads).toBe(1);
  });

  it("first requests on two nodes at once while a dead node's load lock stands: one takes it over and loads, the other joins it", async () => {
    // Each node's model entry is loading while its placement waits for the lock; a node only
    // placing must not be taken for one loading it (else whoever takes the lock over waits for the
    // other, and both answer 503 at their busy timeout: a breaker found it).
    nodes = await startNodes(bus, ['A', 'B'], [2e12, 1e12], 3000);
    const [a, b] = nodes;
    const ghost = bus.connect('ghost');
    await ghost.locks.create(lockKey('a'), encodeJson({ owner: 'ghost', token: 'x', model: 'a', deadline: 0 }));
    bus.kill('ghost');
    const mine = watch(request(a, 'a', 1));
    const theirs = watch(request(b, 'a', 2));
    await vi.advanceTimersByTimeAsync(400 + 10 * HEARTBEAT_MS);
    expect(mine()).toEqual({ value: 1 });
    expect(theirs()).toEqual({ value: 2 });
    expect(a.loads + b.loads).toBe(1);
  });

  it('NATS lost while the lock holder waits for another node to load: it loads here within the busy timeout', async () => {
    nodes = await startNodes(bus, ['A', 'B'], [1e12, 2e12], 3000);
    const [a, b] = nodes;
    // B (the most free memory) is asked to load and does not answer; then A loses NATS.
    bus.stall('B');
    const mine = watch(request(a, 'a', 1));
    await vi.advanceTimersByTimeAsync(10);
    bus.lose('A');
    await vi.advanceTimersByTimeAsync(2900);
    expect(mine()).toEqual({ value: 1 });
    expect(a.loads).toBe(1);
    expect(b.loads).toBe(0);
    bus.heal('A');
    bus.heal('B');
    await vi.advanceTimersByTimeAsync(5 * HEARTBEAT_MS);
  });
});
