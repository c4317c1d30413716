/**
 * Property-based interleaving tests of the cluster (issue 19, docs/cluster.md): two nodes, each a
 * Supervisor and a ClusterNode, over an in-memory NATS (./fake-nats.ts) whose every message and
 * key-value operation, and every fake slot host's load, run and close, waits for fast-check's
 * scheduler. Time is controlled too (fake timers; `advance` is a command), so heartbeats, the
 * holder probe, job deadlines, lock renewals and deadlines, busy timeouts and load timeouts fire at
 * random points. Commands: file requests and streams on either node for a model held there, held
 * by the other node, or held nowhere (placement, remote load); a holder kept busy (`max_queued`);
 * a node killed (its subscriptions gone: "no responders") or cut off for a while (stalled, then
 * healed: its lock may expire meanwhile) or losing NATS for a while (`disconnect`, `reconnect`);
 * the next message of a kind lost in transit; a node's registry watch lagging; a node drained as
 * SIGTERM does (hand-over, stop, leave); management loads (`node`, `replicas` 1-2) and unloads
 * naming a node or not; the memory guard refusing; clients going away.
 *
 * Invariants: those of spec/actors/interleavings.spec.ts that apply per node (one load and one pool
 * of a model per node at a time, FIFO admission, nothing resident, leased or queued at the end, a
 * 500 only after an injected fault, an operation fails only with a VoxError); plus, cluster-wide: at
 * most one load of a model in flight at a time among nodes that take each other for live (excused
 * once a management load of it was asked for, which takes no lock, or its lock was taken over past
 * its deadline, or its node decided to load it while it had lost NATS: documented limits, docs/cluster.md); a load lock
 * is never written over by another node before its deadline; every
 * request and stream on a live node settles, with its own results or a definite wire error, once
 * the clock has run past every deadline (management calls included); no load lock left at the end;
 * a management load answers with at most `replicas` distinct nodes, each holding the model then
 * (fewer only when it says so); a drain in an undisturbed run leaves each model only it held that
 * another node used held elsewhere (docs/cluster.md "Drain").
 *
 * Switching the lock's compare-and-set off (`kv.put` for `kv.create` in `takeLock`) fails both
 * properties within 50 runs with two commands (a first request for one model on each of two nodes):
 * "two loads of a at once in the cluster", and "A took the load lock of a while B held it".
 *
 * A failure prints its seed and the scheduler's order of every step of the shrunk case. CI runs
 * seed 42 (`FC_SEED=random` explores). The runs are deterministic for a seed: `FC_SEED=<seed> npx vitest run
 * spec/cluster/interleavings.spec.ts`
 * reruns them and shrinks to the same counterexample; `FC_RUNS=<n>` sets the number of runs.
 */
import fc from 'fast-check';
import { pino } from 'pino';
import { afterEach, describe, expect, it, vi } from 'vitest';
import { createStreamSocket, type StreamOutput } from '../../actors/stream.js';
import { Supervisor } from '../../actors/supervisor.js';
import { validateModelConfig } from '../../actors/model.js';
import { ClusterNode } from '../../cluster/node.js';
import { Admission } from '../../runtime/admission.js';
import { ModelConfig, ServerConfig } from '../../runtime/config.js';
import { VoxError, voxError } from '../../runtime/errors.js';
import type { LoadedModel, ModelLoader } from '../../runtime/loader.js';
import type { Job, JobResult, LoadSpec, VadJob } from '../../runtime/slots/slot-protocol.js';
import { SlotPool, type SlotHost } from '../../runtime/slots/slots.js';
import { FakeNats } from './fake-nats.js';

/**
 * Runs per property: 1,000 (each of the two properties), with 5 x 1,600 in spec/actors/interleavings.spec.ts
 * 10,000 runs per CI in all (issue 44); 2 x 1,000 took 169 s for this file at load average 3-5 on a 2-core machine.
 */
const RUNS = Number(process.env.FC_RUNS ?? 1000);
/** Each property's time limit: the clock inside a run is fake, so it only guards against a hang. */
const RUN_TIMEOUT_MS = 600_000;
/**
 * The seed: fixed (42) unless `FC_SEED` says otherwise (`FC_SEED=random` for a new one each run), so
 * CI runs the same cases every time (a random seed's failure would make CI fail at random).
 * Seeds that found failures, settled since and worth replaying after a change:
 * `FC_SEED=-487407280 FC_RUNS=600` (2 nodes: a load decided offline, see {@link World.decidedOffline}),
 * `FC_SEED=-1056948768 FC_RUNS=600` (3 nodes: a request lost with its node's NATS connection).
 */
const SEED = process.env.FC_SEED === 'random' ? undefined : Number(process.env.FC_SEED ?? 42);
const replay =
  SEED === undefined
    ? {}
    : {
        seed: SEED,
        ...(process.env.FC_PATH ? { path: process.env.FC_PATH, endOnFailure: true } : {}),
      };

const HEARTBEAT_MS = 100;
const LOCK_MS = 400;
const BUSY_TIMEOUT_MS = 300;

type LoadFault = 'ok' | 'throws' | 'hangs';
type RunFault = 'ok' | 'throws';

/** One node of a run. */
interface Node {
  name: string;
  sup: Supervisor;
  cluster: ClusterNode;
  /** What its memory probe reports, bytes. */
  memory: number;
  /** Killed: its process is gone for the cluster (its requests are the clients' loss). */
  dead: boolean;
  /** Stopped by a drain (SIGTERM): later commands leave it alone; its requests must all have been answered. */
  stopped: boolean;
}

/** A model's load in flight on a node. */
interface Loading {
  node: string;
  model: string;
  /** The nodes its node took for live when it started (a placement decides on that view). */
  sees: Set<string>;
  /** It started while a management load of its model was in flight (that takes no lock). */
  managed: boolean;
  /**
   * Its node decided to load it while it had lost NATS (it then loads what its own requests need,
   * with no lock), even if NATS was back when the load started (it waited at the memory gate).
   */
  offline: boolean;
}

/** An operation of a run: a request, a stream, a management call. */
interface Op {
  name: string;
  node: string;
  /** A management call. */
  manage: boolean;
  done: boolean;
  promise: Promise<void>;
}

/** What one run observed. */
class World {
  readonly nodes: Node[] = [];
  /** Loads in flight, cluster-wide. */
  readonly loading = new Set<Loading>();
  /** Per `node/model`: pools resident, slots started and not closed. */
  readonly livePools = new Map<string, number>();
  readonly liveSlots = new Map<string, number>();
  /** Per `node/model`: pools whose load was abandoned after they were built, until they have closed. */
  readonly abandonedPools = new Map<string, number>();
  readonly violations: string[] = [];
  readonly grants = new Map<Admission, number[]>();
  readonly ops: Op[] = [];
  readonly controllers: AbortController[] = [];
  readonly sockets: ReturnType<typeof createStreamSocket>['actor'][] = [];
  /**
   * Models a management load was asked for in the run: it takes no lock, so a load beside it is no
   * violation; its request may reach the node it names late (the caller cut off, then healed), after
   * the call has ended, so the model is excused from then on.
   */
  readonly managed = new Set<string>();
  /** Nodes cut off (stalled) during the run: one that left meanwhile could not delete its load lock. */
  readonly cutOff = new Set<string>();
  /** Nodes that lost NATS during the run. */
  readonly lostNats = new Set<string>();
  /**
   * `node/model` of the loads a node's placement sent here while it had lost NATS, until they end.
   * Such a load may reach the loader only after NATS is back (it waits at the memory gate first), so
   * its node's state when the loader starts does not tell (FC_SEED=-487407280 FC_RUNS=600, 2 nodes:
   * A decided offline, waited for memory, loaded b after its reconnect while B's placement loaded it).
   */
  readonly decidedOffline = new Set<string>();
  /**
   * `node/model` of the loads a node's placement decided to make here, with the nodes it took for
   * live then, until they end: a node whose placement gave up on another node taken for gone (its
   * heartbeats late) loads it, while that node may still load it too (a documented limit,
   * docs/cluster.md), even if the late heartbeats arrive before the load starts (FC_SEED=42
   * FC_RUNS=750, 3 nodes).
   */
  readonly decidedSees = new Map<string, Set<string>>();
  /** Models whose load lock was taken over from another node (two loads may then overlap: a documented limit). */
  readonly takenOver = new Set<string>();
  /** How often the single-flight check was excused, and why (reported). */
  readonly excused = { managing: 0, takenOver: 0, gone: 0, offline: 0, draining: 0 };
  /** Load locks a node left standing as it left, lent to a load it had asked for (reported). */
  lentLocks = 0;
  faultsUsed = 0;
  /**
   * Commands that may keep a drain's hand-over from succeeding, or undo a management load, ran: a
   * node killed, cut off, losing NATS or a message, its watch lagging, its memory guard refusing, an
   * unload or a drain (a hand-over is then not checked, nor a load's holders).
   */
  disturbed = 0;
  /** `holder/model` of the jobs a holder ran for a request on another node (docs/cluster.md's "used" by other nodes). */
  readonly usedRemotely = new Set<string>();
  /** The node each request job was sent from, by its marker. */
  readonly jobFrom = new Map<number, string>();
  /** Nodes cut off or without NATS now, and `<node> lags` for a lagging watch. */
  readonly impaired = new Set<string>();
  /** Management unloads under way. */
  unloading = 0;
  /** Drains that handed over what they had to: reported. */
  handedOver = 0;
  takeovers = 0;
  private seq = 0;
  private jobSeq = 0;

  /** Faults are injected (not while the models held at the start load). */
  faulty = true;
  private readonly loadFaults: LoadFault[];
  private readonly runFaults: RunFault[];

  constructor(
    readonly s: fc.Scheduler,
    readonly bus: FakeNats,
    loadFaults: LoadFault[],
    runFaults: RunFault[],
  ) {
    // Copies: the generated values are printed as they were in a counterexample.
    this.loadFaults = [...loadFaults];
    this.runFaults = [...runFaults];
  }

  node(i: number): Node {
    return this.nodes[i % this.nodes.length];
  }
  nextSeq(): number {
    return ++this.seq;
  }
  nextJob(): number {
    return ++this.jobSeq;
  }
  loadFault(): LoadFault {
    const f = (this.faulty && this.loadFaults.shift()) || 'ok';
    if (f !== 'ok') this.faultsUsed++;
    return f;
  }
  runFault(): RunFault {
    const f = (this.faulty && this.runFaults.shift()) || 'ok';
    if (f !== 'ok') this.faultsUsed++;
    return f;
  }
  bump(map: Map<string, number>, key: string, by: number, limit: number, what: string): void {
    const n = (map.get(key) ?? 0) + by;
    map.set(key, n);
    if (n > limit) this.violations.push(`${what} for ${key}: ${n}`);
  }

  /**
   * A load of `model` starts on `node`: no other node it takes for live may be loading it (the
   * cluster lock's single flight). A node silent for 3 heartbeats (dead, cut off, or its heartbeats
   * late) is gone for the others, which place its models elsewhere, as they send its jobs elsewhere.
   */
  loadStarts(l: Loading): void {
    const others = [...this.loading].filter((o) => o.model === l.model && o.node !== l.node);
    this.loading.add(l);
    if (!others.length) return;
    const dead = (name: string): boolean => !!this.nodes.find((n) => n.name === name)?.dead;
    // A node told to stop refuses the loads other nodes ask of it (503 shutting_down) while one it
    // began for them is still being abandoned: they load it themselves meanwhile (FC_SEED=42
    // FC_RUNS=750, 2 nodes; docs/cluster.md).
    const stopping = (name: string): boolean => !!this.nodes.find((n) => n.name === name)?.stopped;
    // Both alive, and each took the other for live when its load started.
    const peers = (o: Loading): boolean => !dead(l.node) && !dead(o.node) && l.sees.has(o.node) && o.sees.has(l.node);
    const both = others.filter(peers);
    if (!both.length) this.excused.gone++;
    else if (l.managed || both.every((o) => o.managed)) this.excused.managing++;
    else if (l.offline || both.every((o) => o.offline)) this.excused.offline++;
    else if (this.takenOver.has(l.model)) this.excused.takenOver++;
    else if (stopping(l.node) || both.every((o) => stopping(o.node))) this.excused.draining++;
    else
      this.violations.push(
        `two loads of ${l.model} at once in the cluster: on ${l.node} while ${both.map((o) => o.node).join(', ')} loads it`,
      );
  }

  /**
   * Starts an operation on `node`; expected failures (a VoxError, AbortError) are fine, a 500 only
   * once a fault was injected, anything else is a violation.
   */
  launch(name: string, node: Node, op: () => Promise<unknown>, manage = false): void {
    const rec: Op = {
      name: `${name} on ${node.name}`,
      node: node.name,
      manage,
      done: false,
      promise: Promise.resolve(),
    };
    rec.promise = (async () => {
      try {
        await op();
      } catch (e) {
        const expected = e instanceof VoxError || (e instanceof DOMException && e.name === 'AbortError');
        if (!expected) this.violations.push(`${rec.name} threw ${(e as Error)?.stack ?? e}`);
        else if (
          e instanceof VoxError &&
          e.status === 500 &&
          this.faultsUsed === 0 &&
          !/load_timeout_ms/.test(e.message)
        )
          this.violations.push(`${rec.name}: 500 with no fault injected: ${e.message}`);
      } finally {
        rec.done = true;
      }
    })();
    this.ops.push(rec);
  }
}

/**
 * A loader over fake slots on `node`; every step waits for the scheduler. A slot's result carries its job's marker
 * back.
 */
function fakeLoader(w: World, node: string): ModelLoader {
  return async (config: ModelConfig, signal?: AbortSignal): Promise<LoadedModel> => {
    const id = config.id;
    const key = `${node}/${id}`;
    const self = w.nodes.find((n) => n.name === node);
    // While the nodes start, before the first command, the view is not there yet: every node is taken for live.
    const sees =
      w.decidedSees.get(key) ?? new Set(self ? self.cluster.nodes().map((r) => r.node) : w.nodes.map((n) => n.name));
    const loading: Loading = {
      node,
      model: id,
      sees,
      managed: w.managed.has(id),
      offline: (self ? !self.cluster.connected : false) || w.decidedOffline.has(key),
    };
    w.loadStarts(loading);
    // An abandoned load (the load timeout, an unload) is no longer the model's load: its process hosts are being
    // killed.
    const uncount = (): void => void w.loading.delete(loading);
    signal?.addEventListener('abort', uncount, { once: true });
    try {
      await w.s.schedule(Promise.resolve(), `load ${key}`);
      const fault = w.loadFault();
      if (fault === 'throws') throw new Error('loader threw');
      let made = 0;
      const factory = async (_spec: LoadSpec, signal?: AbortSignal): Promise<SlotHost> => {
        const n = made++;
        await w.s.schedule(Promise.resolve(), `slot ${key}#${n}`);
        // Until the load is abandoned (its load timeout; a load behind a remote pool too: cluster/node.ts `adopt`).
        if (fault === 'hangs' && n === 0)
          await new Promise((resolve) =>
            signal?.aborted ? resolve(null) : signal?.addEventListener('abort', resolve, { once: true }),
          );
        if (signal?.aborted) throw new Error('slot host was killed by SIGKILL');
        let closed = false;
        w.bump(w.liveSlots, key, 1, 16, 'too many slots');
        return {
          info: {},
          run: async (job: Job): Promise<JobResult> => {
            await w.s.schedule(Promise.resolve(), `run ${key}#${n}`);
            if (closed) throw voxError('slot_closed');
            if (w.runFault() === 'throws') throw voxError('inference_failed', { reason: 'injected' });
            const from = w.jobFrom.get((job as VadJob).state?.[0]);
            if (from && from !== node) w.usedRemotely.add(key);
            // As a slot host's answer, in buffers of its own: the state comes back (with its job's marker).
            const vad = job as VadJob;
            const rows = vad.counts?.length ?? 1;
            return {
              kind: 'vad',
              probs: new Float32Array(vad.windows.length / 512),
              state: vad.state.slice(),
              context: new Float32Array(64 * rows),
            };
          },
          close: async () => {
            if (closed) return;
            closed = true;
            await w.s.schedule(Promise.resolve(), `close ${key}#${n}`);
            w.bump(w.liveSlots, key, -1, 16, '');
          },
          onExit: () => {},
          residentBytes: () => 0,
        };
      };
      const pool = await SlotPool.start({ kind: 'vad', model: '/fake.onnx' }, config.slots, factory, { signal });
      w.bump(w.livePools, key, 1, 1, 'two pools resident');
      let closed = false;
      // A pool built but abandoned before its entry took it (the load timeout passed while its placement
      // still released the lock) is no longer the model's: it is closed in the background (reported).
      let owned = true;
      const disown = (): void => {
        if (!owned || closed) return;
        owned = false;
        w.bump(w.livePools, key, -1, 1, '');
        w.bump(w.abandonedPools, key, 1, 16, '');
      };
      signal?.addEventListener('abort', disown, { once: true });
      return {
        pool,
        residentBytes: 1000 * config.slots,
        close: async () => {
          await pool.close();
          if (!closed) w.bump(owned ? w.livePools : w.abandonedPools, key, -1, 16, '');
          closed = true;
        },
      };
    } finally {
      signal?.removeEventListener('abort', uncount);
      uncount();
    }
  };
}

/**
 * A one-window VAD job whose state carries `marker`: the fake slot returns it, so each answer can be matched to its
 * job.
 */
const job = (marker: number): VadJob => {
  const state = new Float32Array(256);
  state[0] = marker;
  return { kind: 'vad', windows: new Float32Array(512), state, context: new Float32Array(64) };
};

type Real = { w: World };
type Cmd = fc.AsyncCommand<object, Real, false>;

const IDS = ['a', 'b'] as const;
const idArb = fc.constantFrom(...IDS);
const nodeArb = fc.nat(5);
const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

/**
 * A file request on a node: a lease across `jobs` inferences, each answered with its own result,
 * then held `holdMs` more (a slow client: the holder's queue fills up behind it).
 */
class Request implements Cmd {
  constructor(
    readonly node: number,
    readonly id: string,
    readonly jobs: number,
    readonly holdMs: number,
  ) {}
  check = (): boolean => true;
  async run(_m: object, { w }: Real): Promise<void> {
    const n = w.node(this.node);
    if (n.dead || n.stopped) return;
    const ctl = new AbortController();
    w.controllers.push(ctl);
    w.launch(this.toString(), n, async () => {
      const entry = n.sup.require(this.id);
      const lease = await entry.admit({ signal: ctl.signal, onRevoke: () => ctl.abort() });
      try {
        const { pool, batcher } = await entry.ensureReady(ctl.signal);
        for (let i = 0; i < this.jobs && !ctl.signal.aborted; i++) {
          const marker = w.nextJob();
          w.jobFrom.set(marker, n.name);
          const r = await (batcher ? batcher.run(job(marker), ctl.signal) : pool.run(job(marker), ctl.signal)).catch(
            (e: Error) => {
              const closed =
                /model unloaded/.test(e.message) || (/slot is closed/.test(e.message) && w.faultsUsed === 0);
              if (closed && !ctl.signal.aborted)
                w.violations.push(`${this} on ${n.name}: pool closed under a held lease: ${e.message}`);
              if (ctl.signal.aborted) throw new DOMException('revoked', 'AbortError');
              throw e;
            },
          );
          const got = r.kind === 'vad' ? r.state[0] : Number.NaN;
          if (got !== marker) w.violations.push(`${this} on ${n.name}: job ${marker} answered with ${got}'s result`);
        }
        if (this.holdMs && !ctl.signal.aborted) await sleep(this.holdMs);
      } finally {
        lease.release();
      }
    });
  }
  toString = (): string => `request(${this.node}, ${this.id}, ${this.jobs} jobs, hold ${this.holdMs} ms)`;
}

class Disconnect implements Cmd {
  constructor(readonly index: number) {}
  check = (): boolean => true;
  async run(_m: object, { w }: Real): Promise<void> {
    w.controllers[this.index % Math.max(1, w.controllers.length)]?.abort();
  }
  toString = (): string => `disconnect(${this.index})`;
}

/** Stream deadlines short enough for `advance` to reach them. */
const STREAM_LIMITS = ServerConfig.parse({
  limits: { idle_ms: 200, heartbeat_ms: 150, send_timeout_ms: 100, total_ms: 800 },
}).limits;

/**
 * A stream socket actor on a node (its transport played here, as in spec/actors/interleavings):
 * `frames` frames of 512 samples, then `end`, a dropped connection, or nothing. It must release its
 * lease; a close 1011 only after an injected fault.
 */
class Stream implements Cmd {
  constructor(
    readonly node: number,
    readonly id: string,
    readonly frames: number,
    readonly ending: 'end' | 'drop' | 'none',
  ) {}
  check = (): boolean => true;
  async run(_m: object, { w }: Real): Promise<void> {
    const n = w.node(this.node);
    if (n.dead || n.stopped) return;
    const { actor, channel } = createStreamSocket({
      url: `/v1/stream?model=${this.id}`,
      limits: STREAM_LIMITS,
      registry: n.sup,
    });
    let release!: () => void;
    const released = new Promise<void>((r) => (release = r));
    const tell = (e: Parameters<typeof actor.send>[0]): void =>
      void (actor.getSnapshot().status === 'active' && actor.send(e));
    const later = (e: Parameters<typeof actor.send>[0]): void => queueMicrotask(() => tell(e));
    let reason = '';
    actor.on('*', (o: StreamOutput) => {
      if (o.type === 'close') reason = o.reason;
      if (o.type === 'released') release();
      else if (o.type === 'ping') later({ type: 'PONG' });
      else if (o.type === 'close' || o.type === 'terminate')
        later({ type: 'PEER_CLOSED', code: o.type === 'close' ? o.code : 1006 });
    });
    actor.subscribe({ error: (e) => w.violations.push(`${this} on ${n.name} errored: ${e}`) });
    actor.start();
    w.sockets.push(actor);
    w.launch(this.toString(), n, async () => {
      for (let i = 0; i < this.frames; i++) {
        await w.s.schedule(Promise.resolve(), `frame ${this}#${i}`);
        if (actor.getSnapshot().status === 'active') channel.push(Buffer.alloc(1024));
      }
      if (this.ending === 'end' && channel.heard()) tell({ type: 'END' });
      if (this.ending === 'drop') tell({ type: 'PEER_CLOSED', code: 1006 });
      await released;
      const code = actor.getSnapshot().context.code;
      if (code === 1011 && w.faultsUsed === 0 && !reason.includes('load_timeout_ms'))
        w.violations.push(`${this} on ${n.name} closed 1011 with no fault injected: ${reason}`);
    });
  }
  toString = (): string => `stream(${this.node}, ${this.id}, ${this.frames} frames, ${this.ending})`;
}

/** `POST /v1/models/load` on a node: placement (`replicas`), or naming the node to load it. */
class ManageLoad implements Cmd {
  constructor(
    readonly node: number,
    readonly id: string,
    readonly target: number | null,
    readonly replicas: number | undefined,
  ) {}
  check = (): boolean => true;
  async run(_m: object, { w }: Real): Promise<void> {
    const n = w.node(this.node);
    if (n.dead || n.stopped) return;
    const body: Record<string, unknown> = { id: this.id, slots: 1 };
    if (this.target !== null) body.node = w.node(this.target).name;
    if (this.replicas) body.replicas = this.replicas;
    w.managed.add(this.id);
    w.launch(
      this.toString(),
      n,
      async () => {
        // An unload under way (its second phase may come after this load) counts as a disturbance, and so
        // does a node's memory at 0: any load there evicts an idle model to make room, this one too (LRU,
        // as on a single node) (FC_SEED=-1771985523 FC_RUNS=994, 3 nodes).
        const disturbed = w.unloading || w.nodes.some((x) => x.memory === 0) ? -1 : w.disturbed;
        const r = (await n.cluster.manageLoad(body, (fields) => {
          const known = typeof fields.id === 'string' ? n.sup.configOf(fields.id) : undefined;
          return validateModelConfig(known ? { ...known, ...fields } : fields);
        })) as { nodes: string[]; replicas?: number };
        // docs/cluster.md: `replicas` nodes hold it (fewer only when the others refused or there are
        // no more), each listed once; with `node`, that node.
        const want = this.target !== null ? 1 : (this.replicas ?? 1);
        const bad = (why: string): void =>
          void w.violations.push(`${this} on ${n.name} answered ${JSON.stringify(r)}: ${why}`);
        if (new Set(r.nodes).size !== r.nodes.length) bad('a node listed twice');
        if (r.nodes.length > want) bad(`more holders than the ${want} asked for`);
        if (r.nodes.length < want && r.replicas !== r.nodes.length) bad('fewer holders than asked, unsaid');
        // Each listed node holds it ready when the answer comes, unless something since may have unloaded it.
        if (w.disturbed === disturbed)
          for (const name of r.nodes) {
            const at = w.nodes.find((x) => x.name === name)!;
            if (!at.dead && !at.stopped && at.sup.status(this.id)?.state !== 'ready')
              bad(`${name} does not hold it (${at.sup.status(this.id)?.state})`);
          }
      },
      true,
    );
  }
  toString = (): string =>
    `manageLoad(${this.node}, ${this.id}${this.target !== null ? `, node ${this.target}` : ''}${this.replicas ? `, replicas ${this.replicas}` : ''})`;
}

/** A cluster-wide unload (or on one node) from a node's management API. */
class ManageUnload implements Cmd {
  constructor(
    readonly node: number,
    readonly ids: string[] | undefined,
    readonly target: number | null,
    readonly force: boolean,
  ) {}
  check = (): boolean => true;
  async run(_m: object, { w }: Real): Promise<void> {
    const n = w.node(this.node);
    if (n.dead || n.stopped) return;
    const target = this.target !== null ? w.node(this.target).name : undefined;
    w.disturbed++;
    w.unloading++;
    w.launch(
      this.toString(),
      n,
      // An unload answered 503 node_unreachable is indeterminate (Jepsen's "info"): its request, delayed in
      // transit, may still unload the model later (FC_SEED=-1229188655 FC_RUNS=847, 3 nodes). It stays under
      // way for the rest of the run.
      () =>
        n.cluster.manageUnload(this.ids, target, this.force).then(
          (r) => {
            w.unloading--;
            return r;
          },
          (e: unknown) => {
            if (!(e instanceof VoxError && e.code === 'node_unreachable')) w.unloading--;
            throw e;
          },
        ),
      true,
    );
  }
  toString = (): string =>
    `manageUnload(${this.node}, ${this.ids ? JSON.stringify(this.ids) : 'all'}${this.target !== null ? `, node ${this.target}` : ''}${this.force ? ', force' : ''})`;
}

/** Moves the fake clock: heartbeats, the holder probe, job and lock deadlines, busy and load timeouts. */
class Advance implements Cmd {
  constructor(readonly ms: number) {}
  check = (): boolean => true;
  async run(): Promise<void> {
    await vi.advanceTimersByTimeAsync(this.ms);
  }
  toString = (): string => `advance(${this.ms} ms)`;
}

/** A node's memory probe's next readings (0: its memory guard refuses loads). */
class SetMemory implements Cmd {
  constructor(
    readonly node: number,
    readonly bytes: number,
  ) {}
  check = (): boolean => true;
  async run(_m: object, { w }: Real): Promise<void> {
    w.node(this.node).memory = this.bytes;
    if (this.bytes === 0) w.disturbed++;
  }
  toString = (): string => `memory(${this.node}, ${this.bytes})`;
}

/** A node dies: its NATS subscriptions are gone at once (no responders), nothing it sends arrives. */
class Kill implements Cmd {
  constructor(readonly node: number) {}
  check = (): boolean => true;
  async run(_m: object, { w }: Real): Promise<void> {
    const n = w.node(this.node);
    // One node stays alive: the cluster's answers are what is checked.
    if (n.dead || n.stopped || w.nodes.filter((x) => !x.dead && !x.stopped).length < 2) return;
    n.dead = true;
    w.disturbed++;
    w.bus.kill(n.name);
  }
  toString = (): string => `kill(${this.node})`;
}

/**
 * A node is cut off (a pause, a network cut): its traffic both ways waits until `heal`. With
 * `expire`, the clock then runs past a load lock's deadline, so a lock it holds can be taken over.
 */
class Stall implements Cmd {
  constructor(
    readonly node: number,
    readonly expire: boolean,
  ) {}
  check = (): boolean => true;
  async run(_m: object, { w }: Real): Promise<void> {
    const n = w.node(this.node);
    if (n.dead || n.stopped) return;
    w.bus.stall(n.name);
    w.cutOff.add(n.name);
    w.impaired.add(n.name);
    w.disturbed++;
    if (this.expire) await vi.advanceTimersByTimeAsync(LOCK_MS + 50);
  }
  toString = (): string => `stall(${this.node}${this.expire ? ', past the lock deadline' : ''})`;
}

/** NATS loses a node's connection (the client says `disconnect`) until `heal` (`reconnect`). */
class LoseNats implements Cmd {
  constructor(readonly node: number) {}
  check = (): boolean => true;
  async run(_m: object, { w }: Real): Promise<void> {
    const n = w.node(this.node);
    if (n.dead || n.stopped) return;
    w.bus.lose(n.name);
    w.impaired.add(n.name);
    w.disturbed++;
    w.lostNats.add(n.name);
  }
  toString = (): string => `loseNats(${this.node})`;
}

/**
 * The next message of a kind is lost in transit (core NATS delivers at most once): a management
 * call's request or reply, a job, a job's answer, a holder probe. Every call must still be
 * answered (a definite error within its bound), and every request too.
 */
class DropMessage implements Cmd {
  constructor(readonly kind: string) {}
  check = (): boolean => true;
  async run(_m: object, { w }: Real): Promise<void> {
    w.bus.dropNext(this.kind);
    w.disturbed++;
  }
  toString = (): string => `drop(next ${this.kind})`;
}

/**
 * A node's registry watch hears every write `ms` late (0: on time again): past 3 heartbeats it takes
 * the others for gone meanwhile (docs/cluster.md: a node silent for 3 heartbeats is gone).
 */
class WatchLag implements Cmd {
  constructor(
    readonly node: number,
    readonly ms: number,
  ) {}
  check = (): boolean => true;
  async run(_m: object, { w }: Real): Promise<void> {
    const n = w.node(this.node);
    if (n.dead || n.stopped) return;
    w.bus.lag(n.name, this.ms);
    if (this.ms) {
      w.disturbed++;
      w.impaired.add(`${n.name} lags`);
    } else w.impaired.delete(`${n.name} lags`);
  }
  toString = (): string => `watchLag(${this.node}, ${this.ms} ms)`;
}

/**
 * SIGTERM on a node, as transport/server.ts runs it in a cluster: it stops accepting and drains
 * (marked draining in the registry, its models handed over), what is left is revoked, it waits for
 * the hand-over, unloads and leaves. Every request on it is answered (its own result or 503
 * `shutting_down`); when nothing disturbed the run, each model only it held that another node ran
 * jobs of is held by another live node once the hand-over is done (docs/cluster.md, "Drain").
 */
class Drain implements Cmd {
  constructor(readonly node: number) {}
  check = (): boolean => true;
  async run(_m: object, { w }: Real): Promise<void> {
    const n = w.node(this.node);
    if (n.dead || n.stopped || w.nodes.filter((x) => !x.dead && !x.stopped).length < 2) return;
    n.stopped = true;
    const held = (at: Node, id: string): boolean => (w.livePools.get(`${at.name}/${id}`) ?? 0) > 0;
    // Ready here (a load still under way when the drain begins is not handed over: docs/cluster.md).
    const sole = IDS.filter(
      (id) =>
        held(n, id) &&
        n.sup.status(id)?.state === 'ready' &&
        w.usedRemotely.has(`${n.name}/${id}`) &&
        !w.nodes.some((o) => o !== n && held(o, id)),
    );
    // Checked only when nothing impairs the cluster when the drain begins (a node that lost NATS hands
    // nothing over) and nothing disturbs it meanwhile.
    const undisturbed =
      n.cluster.connected &&
      !w.impaired.size &&
      !w.unloading &&
      !w.bus.dropsPending &&
      w.nodes.every((o) => o.dead || o.memory > 0);
    const disturbed = w.disturbed;
    const faults = w.faultsUsed;
    w.disturbed++;
    w.launch(this.toString(), n, async () => {
      n.sup.beginShutdown();
      n.cluster.drain();
      await w.s.schedule(Promise.resolve(), `drain deadline of ${n.name}`);
      n.sup.revokeAll(voxError('shutting_down'));
      await n.cluster.handedOver();
      // Only this drain since the models were counted, and no fault injected.
      if (undisturbed && w.disturbed === disturbed + 1 && w.faultsUsed === faults) {
        const lost = sole.filter((id) => !w.nodes.some((o) => o !== n && !o.dead && !o.stopped && held(o, id)));
        if (lost.length) w.violations.push(`${this}: ${lost.join(', ')} held nowhere else after the hand-over`);
        else if (sole.length) w.handedOver++;
      }
      await n.sup.stop(0);
      await n.cluster.close();
    });
  }
  toString = (): string => `drain(${this.node})`;
}

class Heal implements Cmd {
  constructor(readonly node: number) {}
  check = (): boolean => true;
  async run(_m: object, { w }: Real): Promise<void> {
    w.bus.heal(w.node(this.node).name);
    w.impaired.delete(w.node(this.node).name);
  }
  toString = (): string => `heal(${this.node})`;
}

const commandArb = fc.oneof(
  {
    weight: 8,
    arbitrary: fc
      .tuple(nodeArb, idArb, fc.integer({ min: 1, max: 4 }), fc.constantFrom(0, 0, 40, 120))
      .map(([n, id, jobs, hold]) => new Request(n, id, jobs, hold) as Cmd),
  },
  {
    weight: 2,
    arbitrary: fc
      .tuple(nodeArb, idArb, fc.integer({ min: 0, max: 4 }), fc.constantFrom('end', 'drop', 'none'))
      .map(([n, id, f, e]) => new Stream(n, id, f, e as 'end') as Cmd),
  },
  { weight: 1, arbitrary: fc.nat(20).map((i) => new Disconnect(i) as Cmd) },
  {
    weight: 2,
    arbitrary: fc
      .tuple(nodeArb, idArb, fc.option(nodeArb, { nil: null }), fc.constantFrom(undefined, 1, 2))
      .map(([n, id, t, r]) => new ManageLoad(n, id, t, r) as Cmd),
  },
  {
    weight: 2,
    arbitrary: fc
      .tuple(
        nodeArb,
        fc.option(fc.subarray([...IDS, 'nope'], { minLength: 1 }), { nil: undefined }),
        fc.option(nodeArb, { nil: null }),
        fc.boolean(),
      )
      .map(([n, ids, t, f]) => new ManageUnload(n, ids, t, f) as Cmd),
  },
  // Shorter than 3 heartbeats: a node is taken for gone when the scheduler holds its heartbeats across moves, or it is
  // cut off.
  { weight: 4, arbitrary: fc.constantFrom(1, 20, 60, 120).map((ms) => new Advance(ms) as Cmd) },
  {
    weight: 1,
    arbitrary: fc.tuple(nodeArb, fc.constantFrom(3e12, 0)).map(([n, b]) => new SetMemory(n, b) as Cmd),
  },
  { weight: 1, arbitrary: nodeArb.map((n) => new Kill(n) as Cmd) },
  { weight: 1, arbitrary: fc.tuple(nodeArb, fc.boolean()).map(([n, e]) => new Stall(n, e) as Cmd) },
  { weight: 1, arbitrary: nodeArb.map((n) => new LoseNats(n) as Cmd) },
  { weight: 2, arbitrary: nodeArb.map((n) => new Heal(n) as Cmd) },
  {
    weight: 2,
    arbitrary: fc.constantFrom('unload', 'load', 'reply', 'job', 'ping', 'info').map((k) => new DropMessage(k) as Cmd),
  },
  // 40 ms: late within a heartbeat; 350 ms: past 3 heartbeats (the others taken for gone meanwhile).
  {
    weight: 1,
    arbitrary: fc.tuple(nodeArb, fc.constantFrom(0, 40, 350)).map(([n, ms]) => new WatchLag(n, ms) as Cmd),
  },
  { weight: 1, arbitrary: nodeArb.map((n) => new Drain(n) as Cmd) },
);

/** Records, per admission queue, the order in which acquisitions are granted (as spec/actors/interleavings does). */
function instrumentAdmission(w: () => World | null): () => void {
  const original = Admission.prototype.acquire;
  Admission.prototype.acquire = function (this: Admission, opts) {
    const world = w();
    const p = original.call(this, opts);
    if (world) {
      const seq = world.nextSeq();
      p.then(
        () => {
          const list = world.grants.get(this) ?? [];
          list.push(seq);
          world.grants.set(this, list);
        },
        () => {},
      );
    }
    return p;
  };
  return () => {
    Admission.prototype.acquire = original;
  };
}

/** Runs scheduled tasks until none is left, letting microtasks and immediates settle in between. */
async function settle(s: fc.Scheduler): Promise<void> {
  for (let i = 0, quiet = 0; i < 1000 && quiet < 5; i++) {
    await new Promise((r) => setImmediate(r));
    if (s.count() === 0) {
      quiet++;
      continue;
    }
    quiet = 0;
    await s.waitAll();
  }
}

/** Lets every timer up to `ms` from now fire, settling the scheduler between steps. */
async function runClock(s: fc.Scheduler, ms: number): Promise<void> {
  for (let t = 0; t < ms; t += 25) {
    await settle(s);
    await vi.advanceTimersByTimeAsync(25);
  }
  await settle(s);
}

/**
 * Model a admits one stream with one more queued (a busy holder answers busy at once past that);
 * model b two streams, unbounded queue. Both load one slot by default.
 */
const CATALOG: ModelConfig[] = [
  ModelConfig.parse({
    id: 'a',
    task: 'vad',
    path: '/fake.onnx',
    max_streams: 1,
    max_queued: 1,
    max_batch_delay_ms: 0,
  }),
  ModelConfig.parse({ id: 'b', task: 'vad', path: '/fake.onnx', max_streams: 2, max_batch_delay_ms: 0 }),
];

let current: World | null = null;
const restore = instrumentAdmission(() => current);
afterEach(() => {
  current = null;
});

/** The nodes' log lines of the current run (with `CLUSTER_LOG=<level>`, those of the last failing run are printed). */
let runLog: string[] = [];
let failedLog: string[] = [];
const log = pino({ level: process.env.CLUSTER_LOG ?? 'silent' }, { write: (line: string) => void runLog.push(line) });

/** Starts the nodes of a run over `bus`, formed (each has heard the others) before the scheduler takes over. */
async function startNodes(w: World, names: string[], memory: number[]): Promise<void> {
  for (const [i, name] of names.entries()) {
    const config = ServerConfig.parse({
      log_level: 'silent',
      busy_timeout_ms: BUSY_TIMEOUT_MS,
      // A hung load is abandoned within the clock moves of a run.
      load_timeout_ms: 200,
      // A job lost in transit is sent again within its wait, this and the job deadline (docs/cluster.md).
      job_timeout_ms: 300,
      // A drain's hand-over ends within the clock moves of a run.
      drain_timeout_ms: 1000,
      min_free_memory_mb: 1,
      models_root: false,
      cluster: {
        nats: 'nats://fake:4222',
        node: name,
        heartbeat_ms: HEARTBEAT_MS,
        lock_ms: LOCK_MS,
        job_deadline_ms: 100,
      },
    });
    const node = { name, memory: memory[i], dead: false, stopped: false } as Node;
    const nodeLog = log.child({ node: name });
    node.cluster = await ClusterNode.connect(config, {
      log: nodeLog,
      memoryProbe: () => node.memory,
      link: w.bus.connect(name),
    });
    node.sup = new Supervisor(config, {
      loader: fakeLoader(w, name),
      catalog: CATALOG,
      memoryProbe: () => node.memory,
      footprint: async (c) => c.slots * 1000,
      log: nodeLog,
      place: (c, signal, local) => {
        // A load this node decides while it has lost NATS (at the placement's first step, or while it
        // waited for another node's lock): a local load with no lock (a documented limit).
        const key = `${name}/${c.id}`;
        return node.cluster.place(c, signal, async () => {
          if (!node.cluster.connected) w.decidedOffline.add(key);
          // The nodes it took for live when it decided (the load may start later, at the memory gate).
          w.decidedSees.set(key, new Set(node.cluster.nodes().map((r) => r.node)));
          try {
            return await local();
          } finally {
            w.decidedOffline.delete(key);
            w.decidedSees.delete(key);
          }
        });
      },
    });
    await node.sup.start();
    w.nodes.push(node);
  }
  for (const n of w.nodes) await n.cluster.attach(n.sup, `http://${n.name}.invalid`);
}

/** Resolves with `p`, running the scheduler and the clock (10 ms at a time) until it has settled. */
async function drive<T>(s: fc.Scheduler, p: Promise<T>): Promise<T> {
  let done = false;
  p.then(
    () => (done = true),
    () => (done = true),
  );
  while (!done) {
    await settle(s);
    if (!done) await vi.advanceTimersByTimeAsync(10);
  }
  return p;
}

const fresh = () => ({
  runs: 0,
  commands: 0,
  steps: 0,
  /** Loads of one model on two nodes at once that were excused, by why (see World.loadStarts). */
  overlaps: { managing: 0, takenOver: 0, gone: 0, offline: 0, draining: 0 },
  /** Messages sent over the fake NATS, by kind (what the runs exercised). */
  sent: {} as Record<string, number>,
  /** Load locks taken over from another node (its deadline passed). */
  takeovers: 0,
  /** Load locks left lent by a node leaving (World.lentLocks). */
  lentLocks: 0,
  /** Drains whose hand-over was checked (nothing disturbed the run) and had models to hand over. */
  handedOver: 0,
  /** The nodes' cluster metrics summed over the runs: remote jobs served by outcome, job attempts sent again by why. */
  served: {} as Record<string, number>,
  failovers: {} as Record<string, number>,
});

/** Adds a counter's values, by `label`, from every node's registry into `into`. */
async function tally(w: World, metric: string, label: string, into: Record<string, number>): Promise<void> {
  for (const n of w.nodes) {
    const m = n.sup.metrics.registry.getSingleMetric(metric);
    if (!m) continue;
    for (const v of (await m.get()).values) {
      const k = String(v.labels[label]);
      into[k] = (into[k] ?? 0) + v.value;
    }
  }
}

/** One property: random commands, faults and clock moves against `names.length` nodes. */
async function checkCluster(names: string[]): Promise<void> {
  const totals = fresh();
  await fc
    .assert(
      fc.asyncProperty(
        fc.scheduler(),
        fc.commands([commandArb], { maxCommands: 16, size: '+1' }),
        fc.array(fc.constantFrom<LoadFault>('ok', 'ok', 'ok', 'throws', 'hangs'), { maxLength: 4 }),
        fc.array(fc.constantFrom<RunFault>('ok', 'ok', 'ok', 'ok', 'throws'), { maxLength: 6 }),
        fc.array(fc.constantFrom(1e12, 2e12, 3e12), { minLength: names.length, maxLength: names.length }),
        // Models held when the commands start: a on the first node, b on the second.
        fc.constantFrom(0, 1, 2),
        async (s, cmds, loadFaults, runFaults, memory, held) => {
          vi.useFakeTimers({
            toFake: ['setTimeout', 'clearTimeout', 'setInterval', 'clearInterval', 'Date', 'performance'],
          });
          let scheduled = false;
          runLog = [];
          const bus = new FakeNats((label) =>
            scheduled ? s.schedule(Promise.resolve(), label).then(() => {}) : Promise.resolve(),
          );
          const w = new World(s, bus, loadFaults, runFaults);
          current = w;
          bus.onWrite = ({ bucket, before, after, by }) => {
            // A lock written by a node over another node's live lock entry: a take-over.
            if (bucket !== 'locks' || after.operation !== 'PUT' || before?.operation !== 'PUT') return;
            const held = before.json<{ owner: string; model: string; deadline: number }>();
            if (held.owner === by) return;
            // Taken over only once its deadline has passed (its owner stalled or dead): else two nodes hold it.
            if (held.deadline > Date.now())
              return void w.violations.push(`${by} took the load lock of ${held.model} while ${held.owner} held it`);
            w.takenOver.add(held.model);
            w.takeovers++;
          };
          try {
            await startNodes(w, names, memory);
            w.faulty = false;
            for (const [i, id] of IDS.slice(0, held).entries())
              await drive(
                s,
                w.nodes[i].cluster.loadHere(id, {}).catch(() => {}),
              );
            // Every node hears the holders' heartbeats before the commands start.
            await vi.advanceTimersByTimeAsync(HEARTBEAT_MS);
            scheduled = true;
            w.faulty = true;
            await fc.scheduledModelRun(s, () => ({ model: {}, real: { w } }), cmds);
            // Cut-off nodes come back, memory comes back, open streams' clients go away, and the clock
            // runs past every deadline (busy timeouts, job deadlines, load timeouts, lock deadlines).
            bus.dropNone();
            for (const n of w.nodes) {
              bus.lag(n.name, 0);
              bus.heal(n.name);
              n.memory = 3e12;
            }
            await settle(s);
            for (const socket of w.sockets)
              if (socket.getSnapshot().status === 'active') socket.send({ type: 'PEER_CLOSED', code: 1006 });
            await runClock(s, 2000);
            // No job lost without an answer: every operation on a live node has settled.
            const hung = w.ops.filter((o) => !o.done && !w.nodes.find((n) => n.name === o.node)!.dead);
            if (hung.length && process.env.FC_DEBUG)
              console.log(
                'HUNG',
                hung.map((o) => o.name),
                s.count(),
                w.nodes.map((n) =>
                  n.sup.statuses().map((x) => `${n.name}/${x.id}:${x.state}:${x.active_leases}:${x.queued_requests}`),
                ),
                [...cmds].map(String),
              );
            expect(
              hung.map((o) => o.name),
              'operations still pending on live nodes',
            ).toEqual([]);
            // Everything is unloaded on every live node, then every node leaves (a dead one: as its process is gone).
            for (const n of w.nodes)
              if (!n.dead && !n.stopped) w.launch('unload_all', n, () => n.sup.unloadMany(n.sup.registeredIds, 0));
            await runClock(s, 200);
            for (const n of w.nodes) w.launch('leave', n, () => n.cluster.close());
            await runClock(s, 500);
            for (const n of w.nodes) {
              if (!n.dead) continue;
              n.sup.revokeAll(voxError('shutting_down'));
              w.launch('stop', n, () => n.sup.stop(0));
            }
            await runClock(s, 500);
            expect(
              w.ops.filter((o) => !o.done).map((o) => o.name),
              'operations still pending at the end',
            ).toEqual([]);
            expect(w.violations).toEqual([]);
            expect(bus.errors).toEqual([]);
            for (const n of w.nodes) {
              for (const id of n.dead ? [] : n.sup.registeredIds) {
                expect(n.sup.status(id), `status of ${id} on ${n.name}`).toMatchObject({
                  state: 'unloaded',
                  loaded: false,
                  resident_bytes: 0,
                  active_leases: 0,
                  queued_requests: 0,
                  active_slots: 0,
                });
              }
              for (const id of IDS) {
                expect(w.livePools.get(`${n.name}/${id}`) ?? 0, `pools of ${id} on ${n.name}`).toBe(0);
                expect(w.liveSlots.get(`${n.name}/${id}`) ?? 0, `slots of ${id} on ${n.name}`).toBe(0);
                expect(w.abandonedPools.get(`${n.name}/${id}`) ?? 0, `abandoned pools of ${id} on ${n.name}`).toBe(0);
              }
            }
            // No load lock left by a node that lived to leave, unless it lost NATS during the run (a
            // release it made meanwhile failed: the lock lasts until its deadline, by design), or it
            // was drained after being cut off (it may have left while cut off: the same), or it left
            // while a node it asked to load under the lock had not answered (`lent_to`: the lock
            // stands for that load until its deadline unless that node loads it; cluster/locks.ts), or
            // its releases when it left outlasted their bound (time moved on while they were under way:
            // NATS slow; the lock stands until its deadline, by design: `Locks.gaveUp`).
            const locks = [...bus.locks.entries.values()]
              .filter((e) => e.operation === 'PUT')
              .map((e) => e.json<{ owner: string; model: string; lent_to?: string }>())
              .filter((l) => !(l.lent_to && w.nodes.find((n) => n.name === l.owner)?.stopped && ++w.lentLocks))
              .filter(
                (l) =>
                  !w.nodes.find((n) => n.name === l.owner)?.dead &&
                  !w.lostNats.has(l.owner) &&
                  !w.nodes.find((n) => n.name === l.owner)?.cluster.locks.gaveUp &&
                  !(w.cutOff.has(l.owner) && w.nodes.find((n) => n.name === l.owner)?.stopped),
              );
            expect(locks, 'load locks left').toEqual([]);
            for (const order of w.grants.values()) expect(order).toEqual([...order].sort((x, y) => x - y));
            totals.runs++;
            totals.commands += [...cmds].length;
            totals.steps += s.report().length;
            totals.takeovers += w.takeovers;
            totals.lentLocks += w.lentLocks;
            totals.handedOver += w.handedOver;
            await tally(w, 'voxserve_remote_jobs_served_total', 'outcome', totals.served);
            await tally(w, 'voxserve_remote_failovers_total', 'why', totals.failovers);
            for (const k of Object.keys(w.excused) as (keyof World['excused'])[]) totals.overlaps[k] += w.excused[k];
            for (const [k, v] of Object.entries(bus.sent)) totals.sent[k] = (totals.sent[k] ?? 0) + v;
          } catch (e) {
            failedLog = runLog;
            throw e;
          } finally {
            vi.useRealTimers();
          }
        },
      ),
      { numRuns: RUNS, ...replay },
    )
    .catch((e) => {
      if (process.env.CLUSTER_LOG) console.log(`the last failing run's log:\n${failedLog.join('')}`);
      throw e;
    });
  console.log(
    `cluster interleavings (${names.length} nodes): ${totals.runs} runs, ${totals.commands} commands, ${totals.steps} scheduled steps in random order; messages ${JSON.stringify(totals.sent)}; overlapping loads excused ${JSON.stringify(totals.overlaps)}; ${totals.takeovers} lock take-overs; ${totals.lentLocks} lent locks left by a node leaving; ${totals.handedOver} drains handed models over; remote jobs served ${JSON.stringify(totals.served)}, sent again ${JSON.stringify(totals.failovers)}`,
  );
}

if (process.env.FC_DEBUG) process.on('unhandledRejection', (e) => console.log('UNHANDLED', (e as Error)?.stack));

describe('a cluster of nodes under random interleavings (fake NATS, fast-check scheduler, controlled time)', () => {
  it.each([{ nodes: ['A', 'B'] }, { nodes: ['A', 'B', 'C'] }])(
    `holds the contract invariants, one load per model in the cluster at a time, and answers every request ($nodes.length nodes, ${RUNS} runs)`,
    async ({ nodes }) => {
      await checkCluster(nodes);
    },
    RUN_TIMEOUT_MS,
  );
});

process.on('exit', restore);
