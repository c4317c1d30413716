/**
 * One voxserve node of a cluster (docs/cluster.md, DESIGN.md section 8): every node is an ingress
 * and may hold models. This module
 * - publishes the node's heartbeat into the registry bucket and keeps the view of the others;
 * - answers the node's subjects: jobs for the models it holds (admitted through the same model
 *   entry as local requests), slot info, load and unload;
 * - places cold loads (the model entry's `place` hook): here, or on the node with the most free
 *   memory, under a cluster-wide compare-and-set lock, and otherwise gives the entry a pool whose
 *   jobs go to the holders (the ingress keeps the socket actor, the lease and the stream's state).
 */
import { createHash, randomUUID } from 'node:crypto';
import { createInbox, type Msg, type Subscription } from '@nats-io/transport-node';
import type { KvEntry } from '@nats-io/kv';
import { Counter, Gauge, Histogram } from 'prom-client';
import type { Logger } from 'pino';
import type { Supervisor } from '../actors/supervisor.js';
import type { ModelEntry } from '../actors/model.js';
import type { ModelConfig, ServerConfig } from '../runtime/config.js';
import { fromWire, invalid, toVoxError, voxError, VoxError } from '../runtime/errors.js';
import type { LoadedModel } from '../runtime/loader.js';
import type { MemoryProbe } from '../runtime/memory.js';
import { SlotPool, type SlotHost } from '../runtime/slots.js';
import type { Job, JobResult, SlotInfo } from '../runtime/slot-protocol.js';
import {
  clusterSettings,
  connectNats,
  decodeMessage,
  encodeMessage,
  joinResults,
  lockKey,
  nodeKey,
  redact,
  splitJob,
  type ClusterSettings,
  type NatsLink,
  type RemoteJob,
  type RemoteReply,
} from './nats.js';

/** One model as a node reports it in its heartbeat. */
export interface HeldModel {
  task: string;
  /** `loading`, `ready`, `unloading`, `reconfiguring` (models held remotely or unloaded are not listed). */
  state: string;
  slots: number;
  free_slots: number;
  /** Requests waiting for a lease. */
  queued: number;
  active_leases: number;
  resident_bytes: number;
  /** The model's config as registered here, a fingerprint (12 hex digits of a SHA-256): holders with the same config report the same. */
  config: string;
}

/** A node's registry entry, written at every heartbeat. Times in ms since the epoch. */
export interface NodeRecord {
  node: string;
  /** The node's HTTP URL. */
  url: string | null;
  at: number;
  heartbeat_ms: number;
  /** Available memory (the node's memory probe), bytes. */
  free_bytes: number;
  draining: boolean;
  max_loaded_models: number;
  min_free_memory_mb: number;
  /** Models held here (a local pool), by id. */
  models: Record<string, HeldModel>;
  /**
   * This node's NATS session: changes when its connection to NATS came back (or the process
   * restarted). A request another node sent it before may have been lost with the connection, so
   * that node sends it again ({@link ClusterNode.ask}).
   */
  session?: string;
}

/** A registry entry plus when this node last heard of it (ms since the epoch, local clock). */
interface Seen {
  record: NodeRecord;
  seen: number;
}

/** A cold-load lock as a node loading under it names it: its key and the token of that taking (a take-over changes it). */
interface LockRef {
  key: string;
  token: string;
}

/** A cold-load lock this node holds ({@link ClusterNode.takeLock}). */
interface LoadLock {
  ref: LockRef;
  /**
   * Compare-and-set on the lock's revision (renewing it): false when another node has taken the
   * lock over since (this node was paused past its deadline); true when NATS cannot tell.
   */
  held(): Promise<boolean>;
  release(): Promise<void>;
}

/** Thrown inside a placement whose load lock another node took over: the placement is given up. */
const superseded = (id: string): Error =>
  Object.assign(new Error(`the load lock of ${id} was taken over by another node`), { superseded: true });

/** How one attempt at a remote job ended: its holder's reply, the holder known gone, or the reply lost with this node's NATS connection. */
type Attempt = { reply: RemoteReply } | { gone: string } | { lost: true };

/** A job attempt waiting for its reply: the holder it went to and how to settle it. */
interface Pending {
  node: string;
  settle: (a: Attempt) => void;
}

/** The most concurrent jobs one ingress sends to the holders of a model (its remote pool's size). */
const MAX_REMOTE_WINDOW = 32;
/** How often an ingress checks the nodes it has jobs in flight to (a ping; missed heartbeats), ms. */
const PROBE_MS = 50;
/** Pause before asking busy holders again, ms. */
const BUSY_RETRY_MS = 25;

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));
const is503 = (e: unknown): boolean => e instanceof VoxError && e.status === 503;
const encodeJson = (v: unknown): Uint8Array => new TextEncoder().encode(JSON.stringify(v));
/** A nats.js request error saying nobody listens on the subject. */
const isNoResponders = (e: unknown): boolean =>
  (e as Error)?.name === 'NoRespondersError' ||
  (e as { isNoResponders?: () => boolean })?.isNoResponders?.() === true ||
  ((e as { cause?: unknown })?.cause instanceof Error && (e as { cause: Error }).cause.name === 'NoRespondersError');

/** What a cluster node needs from the server that runs it. */
export interface ClusterNodeOptions {
  log: Logger;
  /** Available memory, bytes (the server's probe; tests give fakes). */
  memoryProbe: MemoryProbe;
  /** An open link to use instead of connecting to `cluster.nats` (tests give spec/cluster/fake-nats.ts's in-memory NATS). */
  link?: NatsLink;
}

/**
 * A node's membership in the cluster. Create it with {@link ClusterNode.connect} before the
 * supervisor (whose entries get {@link place}), then {@link attach} the supervisor.
 */
export class ClusterNode {
  readonly settings: ClusterSettings;
  private supervisor: Supervisor | null = null;
  private url: string | null = null;
  private readonly view = new Map<string, Seen>();
  private readonly subs: Subscription[] = [];
  private heartbeat: NodeJS.Timeout | null = null;
  private soon: NodeJS.Timeout | null = null;
  private draining = false;
  private closed = false;
  /** True while NATS is reachable. */
  connected = true;
  /**
   * Models this node was asked to hold itself (a placement or a `node` load): their next cold load
   * is local; a placement's load lock comes along, checked before the load counts ({@link fenced}).
   */
  private readonly pinned = new Map<string, LockRef | undefined>();
  /** Models whose entry here runs on a remote pool (not held here), with that pool's holders' job counts. */
  private readonly remote = new Map<string, true>();
  /** Jobs in flight from here to each node (spreads jobs between heartbeats). */
  private readonly inflight = new Map<string, number>();
  /**
   * Nodes known gone (no responders, no reply within the job deadline, or missed heartbeats), with
   * when this node learnt it (local clock): not live until a heartbeat is heard after that.
   */
  private readonly gone = new Map<string, number>();
  /** Job attempts in flight, by the last token of their reply subject (`<seq>.<attempt>`). */
  private readonly pending = new Map<string, Pending>();
  /** The reply subject prefix of this node's job attempts (`<inbox>.<seq>.<attempt>`). */
  private readonly jobInbox = createInbox();
  private probe: NodeJS.Timeout | null = null;
  /** When NATS was lost (local clock), while it is. */
  private disconnectedAt = 0;
  /** How often NATS came back (requests in flight meanwhile are sent again). */
  private reconnects = 0;
  /** Names this process's NATS sessions ({@link NodeRecord.session}: `<boot>.<reconnects>`). */
  private readonly boot = randomUUID().slice(0, 8);
  /**
   * Models run here on a remote pool whose holders all went: loaded here too, behind that pool
   * (its jobs and other nodes' run on it), so the streams on the pool go on (docs/cluster.md).
   */
  private readonly backing = new Map<string, LoadedModel>();
  private readonly adopting = new Map<string, Promise<void>>();
  /** Load and unload requests being served, by their body: a request sent again joins its first copy ({@link once}). */
  private readonly serving = new Map<string, Promise<Uint8Array>>();
  /** When this node last served another node's job, per model (local clock). */
  private readonly lastServed = new Map<string, number>();
  private seq = 0;
  private viewChanged: (() => void)[] = [];
  private metrics: {
    sent: Counter<'model' | 'node' | 'outcome'>;
    served: Counter<'model' | 'outcome'>;
    hop: Histogram<'model'>;
    nats: Gauge;
    late: Counter;
    failovers: Counter<'model' | 'why'>;
  } | null = null;

  private constructor(
    private readonly link: NatsLink,
    readonly config: ServerConfig,
    private readonly options: ClusterNodeOptions,
  ) {
    this.settings = clusterSettings(config.cluster!);
  }

  /**
   * Connects to NATS (failing at once, naming the URL, when it cannot) and starts watching the
   * registry.
   * @throws Error `cluster.nats: cannot connect to NATS at <url>: <why>`.
   */
  static async connect(config: ServerConfig, options: ClusterNodeOptions): Promise<ClusterNode> {
    const link = options.link ?? (await connectNats(clusterSettings(config.cluster!)));
    const node = new ClusterNode(link, config, options);
    await node.watch();
    void node.watchStatus();
    return node;
  }

  get name(): string {
    return this.settings.node;
  }

  private get log(): Logger {
    return this.options.log;
  }

  private subject(node: string, what: 'job' | 'info' | 'load' | 'unload' | 'ping'): string {
    return `${this.settings.subject_prefix}.node.${node}.${what}`;
  }

  /** Follows the registry bucket: every node's last heartbeat. */
  private async watch(): Promise<void> {
    const started = Date.now();
    const it = await this.link.nodes.watch({ key: 'node.>' });
    void (async () => {
      for await (const e of it) this.onRecord(e, started);
    })().catch((e) => this.closed || this.log.warn({ err: (e as Error).message }, 'cluster registry watch ended'));
  }

  private onRecord(e: KvEntry, started: number): void {
    const name = e.key.slice('node.'.length);
    if (e.operation !== 'PUT') this.view.delete(name);
    else {
      const created = e.created.getTime();
      this.view.set(name, { record: e.json<NodeRecord>(), seen: created < started ? created : Date.now() });
    }
    for (const f of this.viewChanged.splice(0)) f();
  }

  /** Reads every node's last heartbeat from the registry bucket itself (after a pause, the watch may lag behind it). */
  private async refreshView(): Promise<void> {
    try {
      const kv = this.link.nodes;
      for await (const key of await kv.keys('node.>')) {
        const e = await kv.get(key);
        if (!e || e.operation !== 'PUT') continue;
        const name = key.slice('node.'.length);
        const seen = e.created.getTime();
        if ((this.view.get(name)?.seen ?? -1) < seen) this.view.set(name, { record: e.json<NodeRecord>(), seen });
      }
    } catch (e) {
      this.log.debug({ err: (e as Error).message }, 'cluster: registry not read');
    }
    for (const f of this.viewChanged.splice(0)) f();
  }

  /** Logs and tracks losing and regaining NATS (the client reconnects by itself). */
  private async watchStatus(): Promise<void> {
    for await (const s of this.link.nc.status()) {
      if (s.type === 'disconnect' || s.type === 'reconnecting') {
        if (this.connected) {
          this.log.warn(
            { nats: redact(this.settings.nats, this.settings) },
            'cluster: lost NATS; serving the models held here, remote models wait',
          );
          this.disconnectedAt = Date.now();
        }
        this.connected = false;
      } else if (s.type === 'reconnect') {
        this.reconnected();
        this.log.info({ server: redact(String(s.server), this.settings) }, 'cluster: NATS reconnected');
        this.beat();
      }
      this.metrics?.nats.set(this.connected ? 1 : 0);
    }
  }

  /**
   * NATS is back. Nodes that were live when it went get 3 heartbeats from now to be heard again
   * (this node could not hear them: that is no sign they are gone), and every job attempt in flight
   * is sent again (its reply may have been lost with the connection; a late one is dropped).
   */
  private reconnected(): void {
    const now = Date.now();
    for (const v of this.view.values())
      if (v.seen >= this.disconnectedAt - 3 * v.record.heartbeat_ms) v.seen = Math.max(v.seen, now);
    this.connected = true;
    this.reconnects++;
    for (const f of this.viewChanged.splice(0)) f();
    for (const [token, p] of this.pending) {
      this.pending.delete(token);
      p.settle({ lost: true });
    }
  }

  /**
   * Starts serving: subscribes to this node's subjects and publishes heartbeats.
   * @param url this node's HTTP URL (published for clients and `/v1/cluster`).
   */
  async attach(supervisor: Supervisor, url: string): Promise<void> {
    this.supervisor = supervisor;
    this.url = url;
    const reg = supervisor.metrics.registry;
    this.metrics = {
      sent: new Counter({
        name: 'voxserve_remote_jobs_sent_total',
        help: 'Jobs this ingress sent to other nodes, by model, holder and outcome',
        labelNames: ['model', 'node', 'outcome'],
        registers: [reg],
      }),
      served: new Counter({
        name: 'voxserve_remote_jobs_served_total',
        help: 'Jobs other nodes sent here, by model and outcome',
        labelNames: ['model', 'outcome'],
        registers: [reg],
      }),
      hop: new Histogram({
        name: 'voxserve_remote_hop_seconds',
        help: 'A remote job round trip less its run time at the holder',
        labelNames: ['model'],
        buckets: [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1],
        registers: [reg],
      }),
      nats: new Gauge({ name: 'voxserve_nats_connected', help: '1 while NATS is reachable', registers: [reg] }),
      late: new Counter({
        name: 'voxserve_remote_late_replies_total',
        help: 'Replies to job attempts this ingress had already given up (holder taken for gone, or NATS lost): dropped',
        registers: [reg],
      }),
      failovers: new Counter({
        name: 'voxserve_remote_failovers_total',
        help: 'Job attempts sent again because their holder was taken for gone (why: no_responders, deadline, heartbeats) or NATS was lost (lost)',
        labelNames: ['model', 'why'],
        registers: [reg],
      }),
    };
    this.metrics.nats.set(this.connected ? 1 : 0);
    const nc = this.link.nc;
    const on = (what: 'job' | 'info' | 'load' | 'unload', handler: (m: Msg) => Promise<Uint8Array>): void => {
      this.subs.push(
        nc.subscribe(this.subject(this.name, what), {
          callback: (err, m) => {
            if (err) return;
            void handler(m).then(
              (reply) => m.respond(reply),
              (e) => {
                const v = toVoxError(e);
                m.respond(
                  encodeMessage({
                    type: 'error',
                    error: v.type,
                    code: v.code,
                    message: v.message,
                    retry_after_s: v.retryAfterS,
                  }),
                );
              },
            );
          },
        }),
      );
    };
    on('job', (m) => this.serveJob(m));
    on('info', (m) => this.serveInfo(m));
    on('load', (m) => this.once('load', m, () => this.serveLoad(m)));
    on('unload', (m) => this.once('unload', m, () => this.serveUnload(m)));
    this.subs.push(nc.subscribe(this.subject(this.name, 'ping'), { callback: (_e, m) => void m.respond() }));
    this.subs.push(nc.subscribe(`${this.jobInbox}.>`, { callback: (_e, m) => this.onJobReply(m) }));
    await nc.flush();
    await this.publish();
    this.heartbeat = setInterval(() => void this.publish(), this.settings.heartbeat_ms);
    this.heartbeat.unref();
    this.probe = setInterval(() => this.checkHolders(), PROBE_MS);
    this.probe.unref();
    this.log.info(
      { nats: redact(this.settings.nats, this.settings), heartbeat_ms: this.settings.heartbeat_ms },
      'cluster: joined',
    );
  }

  /** Publishes a heartbeat soon (after a model's state changed), at most one per 20 ms. */
  beat(): void {
    if (this.soon || !this.supervisor || this.closed) return;
    this.soon = setTimeout(() => {
      this.soon = null;
      void this.publish();
    }, 20);
  }

  /** This node's registry entry now. */
  record(): NodeRecord {
    const sup = this.supervisor!;
    const models: Record<string, HeldModel> = {};
    for (const s of sup.statuses()) {
      const backing = this.backing.get(s.id);
      if (backing && s.state === 'ready') {
        models[s.id] = {
          task: s.task,
          state: 'ready',
          slots: backing.pool.slots.length,
          free_slots: Math.max(0, backing.pool.slots.length - backing.pool.activeSlots),
          queued: 0,
          active_leases: 0,
          resident_bytes: backing.residentBytes,
          config: this.fingerprint(s.id),
        };
        continue;
      }
      if (s.state === 'unloaded' || this.remote.has(s.id)) continue;
      models[s.id] = {
        task: s.task,
        state: s.state,
        slots: s.slots,
        free_slots: Math.max(0, s.slots - s.active_slots),
        queued: s.queued_requests,
        active_leases: s.active_leases,
        resident_bytes: s.resident_bytes,
        config: this.fingerprint(s.id),
      };
    }
    return {
      node: this.name,
      url: this.url,
      at: Date.now(),
      heartbeat_ms: this.settings.heartbeat_ms,
      free_bytes: this.options.memoryProbe(),
      draining: this.draining || (sup.phase !== 'starting' && sup.phase !== 'running'), // a starting node is not draining
      max_loaded_models: this.config.max_loaded_models,
      min_free_memory_mb: this.config.min_free_memory_mb,
      models,
      session: `${this.boot}.${this.reconnects}`,
    };
  }

  /** The fingerprint of the config `id` is registered with here ({@link HeldModel.config}). */
  private fingerprint(id: string): string {
    const config = this.supervisor?.configOf(id);
    if (!config) return '';
    return createHash('sha256')
      .update(JSON.stringify(this.registrationOf(config)))
      .digest('hex')
      .slice(0, 12);
  }

  private async publish(): Promise<void> {
    if (!this.supervisor || this.closed || !this.connected) return;
    try {
      await this.link.nodes.put(nodeKey(this.name), encodeJson(this.record()));
    } catch (e) {
      this.log.debug({ err: (e as Error).message }, 'cluster: heartbeat not written');
    }
  }

  /** Live nodes: heard of within 3 of their heartbeats, and not known gone since. */
  nodes(now = Date.now()): NodeRecord[] {
    return [...this.view.values()]
      .filter((s) => now - s.seen <= 3 * s.record.heartbeat_ms && !((this.gone.get(s.record.node) ?? -1) >= s.seen))
      .map((s) => s.record);
  }

  // ---- holders gone ---------------------------------------------------------------------------

  /**
   * Takes `node` for gone (until a heartbeat of it is heard again): every job attempt in flight to
   * it ends and is sent again by {@link sendJob}.
   */
  private markGone(node: string, why: string): void {
    if (node === this.name) return;
    const now = Date.now();
    const fresh = !((this.gone.get(node) ?? -1) >= (this.view.get(node)?.seen ?? 0));
    this.gone.set(node, now);
    if (fresh) this.log.warn({ on: node, why }, 'cluster: node taken for gone; its jobs are sent again');
    for (const [token, p] of this.pending) {
      if (p.node !== node) continue;
      this.pending.delete(token);
      p.settle({ gone: why });
    }
    for (const f of this.viewChanged.splice(0)) f();
  }

  /**
   * Every {@link PROBE_MS}, for each node with jobs from here in flight: gone when missing from
   * the registry for 3 heartbeats, or when NATS says nobody listens on its subjects (a ping with no
   * responders: its process died and its connection closed). Not judged while NATS is away.
   */
  private checkHolders(): void {
    if (!this.connected || this.closed) return;
    const busy = new Set([...this.pending.values()].map((p) => p.node));
    if (!busy.size) return;
    const live = new Set(this.nodes().map((r) => r.node));
    for (const node of busy) {
      if (!live.has(node)) {
        this.markGone(node, `missed ${3} heartbeats`);
        continue;
      }
      // Not waiting for an earlier ping: one in flight when its node died is never answered (at most two per node at a time).
      this.link.nc
        // Short: an unanswered ping says nothing (a busy node), and a ping in flight when its node dies must not hold up the next.
        .request(this.subject(node, 'ping'), undefined, { timeout: 2 * PROBE_MS })
        .then(
          () => {},
          (e: Error) => {
            if (isNoResponders(e) && this.connected) this.markGone(node, 'no responders');
          },
        );
    }
  }

  /** A reply to a job attempt: settles it, or is dropped (and counted) when the attempt was given up. */
  private onJobReply(m: Msg): void {
    const token = m.subject.slice(this.jobInbox.length + 1);
    const p = this.pending.get(token);
    const noResponders = m.data.length === 0 && m.headers?.code === 503;
    if (!p) {
      if (!noResponders) {
        this.metrics?.late.inc();
        this.log.info({ token }, 'cluster: a late reply to a job attempt given up: dropped');
      }
      return;
    }
    if (noResponders) return this.markGone(p.node, 'no responders');
    this.pending.delete(token);
    try {
      p.settle({ reply: decodeMessage<RemoteReply>(m.data) });
    } catch (e) {
      p.settle({
        reply: { type: 'error', error: 'server_error', code: 'node_failed', message: (e as Error).message },
      });
    }
  }

  /**
   * Sends one attempt of a job to `node` and waits for how it ends: the holder's reply; `gone` when
   * the holder is taken for gone meanwhile (no responders, missed heartbeats) or no reply came
   * within `deadlineMs`; `lost` when this node's NATS connection dropped meanwhile.
   */
  private attempt(node: string, token: string, data: Uint8Array, deadlineMs: number): Promise<Attempt> {
    return new Promise((resolve) => {
      const timer = setTimeout(() => {
        const p = this.pending.get(token);
        if (!p) return;
        // Without NATS this node cannot tell: the attempt is lost (sent again once NATS is back, within the busy timeout).
        if (!this.connected) {
          this.pending.delete(token);
          p.settle({ lost: true });
        } else this.markGone(node, `no reply within the job deadline (${deadlineMs} ms)`);
      }, deadlineMs);
      this.pending.set(token, {
        node,
        settle: (a) => {
          clearTimeout(timer);
          resolve(a);
        },
      });
      try {
        this.link.nc.publish(this.subject(node, 'job'), data, { reply: `${this.jobInbox}.${token}` });
      } catch (e) {
        this.pending.delete(token);
        clearTimeout(timer);
        resolve({ lost: true });
        this.log.debug({ err: (e as Error).message }, 'cluster: job not sent');
      }
    });
  }

  /** Resolves once NATS is connected (now, or when it is back), or false at `end` (ms since the epoch). */
  private async connectedBy(end: number): Promise<boolean> {
    while (!this.connected) {
      if (Date.now() >= end || this.closed) return false;
      await sleep(Math.min(50, Math.max(1, end - Date.now())));
    }
    return true;
  }

  /** Live nodes other than this one that hold `model` ready, least loaded first (draining ones last). */
  holders(model: string): NodeRecord[] {
    const load = (r: NodeRecord): number => {
      const m = r.models[model];
      return (m.slots - m.free_slots + m.queued + (this.inflight.get(r.node) ?? 0)) / m.slots;
    };
    // A draining node still finishes work; it is asked only when no other node holds the model.
    return this.nodes()
      .filter((r) => r.node !== this.name && r.models[model]?.state === 'ready')
      .sort((a, b) => Number(a.draining) - Number(b.draining) || load(a) - load(b));
  }

  /** Resolves at the next registry change or after `ms`. */
  private changed(ms: number): Promise<void> {
    return new Promise((resolve) => {
      const t = setTimeout(done, ms);
      function done(): void {
        clearTimeout(t);
        resolve();
      }
      this.viewChanged.push(done);
    });
  }

  /** Waits up to `ms` for `pred` over the registry view. */
  private async until(pred: () => boolean, ms: number): Promise<boolean> {
    const end = Date.now() + ms;
    while (!pred()) {
      if (Date.now() >= end) return false;
      await this.changed(Math.min(100, end - Date.now()));
    }
    return true;
  }

  // ---- placement ---------------------------------------------------------------------------

  /**
   * The model entry's `place` hook. Local when NATS is unreachable or this node was asked to hold
   * the model; a remote pool when another node holds it ready; else a placement under the
   * model's cluster lock: the live nodes by most free memory first, each deciding by its own
   * guards (memory, `max_loaded_models`, LRU eviction), this node through `local`. Waiting for
   * another node's placement is bounded by the model's busy timeout.
   * @throws VoxError `insufficient_memory` (503) naming the cluster when every node refused;
   *   `server_busy` when another node's placement did not finish within the busy timeout.
   */
  readonly place = async (
    config: ModelConfig,
    signal: AbortSignal,
    local: () => Promise<LoadedModel>,
  ): Promise<LoadedModel> => {
    const id = config.id;
    if (!this.connected || !this.supervisor) return local();
    const timeout = this.busyTimeout(config);
    const end = timeout > 0 ? Date.now() + timeout : Infinity;
    for (;;) {
      signal.throwIfAborted();
      // Asked to hold it (by a placement elsewhere, or a load naming this node), also while waiting here.
      // The pin is for one load: a retry after it failed (a request of this node waiting) takes the lock.
      if (this.pinned.has(id)) {
        const ref = this.pinned.get(id);
        this.pinned.delete(id);
        return this.fenced(id, local, ref);
      }
      if (this.holders(id).length) {
        try {
          return await this.remotePool(config);
        } catch (e) {
          // No holder answered (dead since its last heartbeat: taken for gone, see remotePool): the
          // model is placed below, or its holders are asked again, within the busy timeout.
          if (!(e instanceof VoxError && e.code === 'no_holder') || Date.now() >= end) throw e;
          if (this.holders(id).length) {
            await this.changed(Math.min(this.settings.heartbeat_ms, end - Date.now()));
            continue;
          }
        }
      }
      const lock = await this.takeLock(id);
      if (lock) {
        let lost = false;
        try {
          // A placement that finished just before the lock was ours.
          if (this.holders(id).length) return this.remotePool(config);
          return await this.placeUnderLock(config, signal, local, lock);
        } catch (e) {
          if (!(e as { superseded?: boolean }).superseded) throw e;
          // Split brain: this node was paused past the lock's deadline and another took it over and
          // placed the model; this placement is given up and the other's is used.
          this.log.warn(
            { model: id },
            'cluster: the load lock was taken over while placing; using the other placement',
          );
          lost = true;
        } finally {
          await lock.release();
        }
        // The other placement is heard of at its holder's next heartbeat; this node was paused, so its
        // registry watch may lag: the registry is read afresh first.
        if (lost) {
          await this.refreshView();
          await this.until(() => this.holders(id).length > 0, 3 * this.settings.heartbeat_ms);
        }
      }
      if (Date.now() >= end) throw voxError('cluster_load_timeout', { id, ms: timeout });
      await this.changed(Math.min(this.settings.heartbeat_ms, end - Date.now()));
    }
  };

  private busyTimeout(config: ModelConfig): number {
    const values = [config.busy_timeout_ms ?? 0, this.config.busy_timeout_ms].filter((v) => v > 0);
    return values.length ? Math.min(...values) : 0;
  }

  /**
   * Loads here (`local`) for a placement, which counts only if its load lock (`ref`, when the load
   * comes with one) is still the one it was taken with: else (another node took the lock over
   * meanwhile, so its placement is the one that counts) the load is closed before it is ever
   * registered, and this throws.
   * @throws the placement's error; VoxError `no_holder` (503) when the lock was taken over.
   */
  private async fenced(id: string, local: () => Promise<LoadedModel>, ref?: LockRef): Promise<LoadedModel> {
    const m = await local();
    if (ref && !(await this.lockHolds(ref))) {
      await m.close();
      this.log.warn({ model: id }, 'cluster: the load lock of this placement was taken over; the load is given up');
      // A refusal (503) to the placing node, which then finds the other placement.
      throw voxError('no_holder', { message: `${this.name} gave up loading ${id}: ${superseded(id).message}` });
    }
    return m;
  }

  /** Whether the lock `ref` names is still that taking (its token); true when NATS cannot tell. */
  private async lockHolds(ref: LockRef): Promise<boolean> {
    let e: KvEntry | null;
    try {
      e = await this.link.locks.get(ref.key);
    } catch {
      return true;
    }
    return e?.operation === 'PUT' && e.json<{ token?: string }>().token === ref.token;
  }

  private async placeUnderLock(
    config: ModelConfig,
    signal: AbortSignal,
    local: () => Promise<LoadedModel>,
    lock: LoadLock,
  ): Promise<LoadedModel> {
    const id = config.id;
    const here = this.record();
    const candidates = [here, ...this.nodes().filter((r) => r.node !== this.name && !r.draining)].sort(
      (a, b) => b.free_bytes - a.free_bytes,
    );
    this.log.debug({ model: id, candidates: candidates.map((c) => [c.node, c.free_bytes]) }, 'cluster: placing');
    const refusals: string[] = [];
    let memory = true;
    for (const n of candidates) {
      signal.throwIfAborted();
      if (n.node === this.name) {
        try {
          this.log.info({ model: id, free_bytes: n.free_bytes }, 'cluster: placing here');
          const m = await local();
          // Compare-and-set on the lock before the load counts (split brain: see fenced()).
          if (await lock.held()) return m;
          await m.close();
          throw superseded(id);
        } catch (e) {
          if (!is503(e)) throw e;
          memory &&= (e as VoxError).type === 'insufficient_memory';
          refusals.push(`${n.node}: ${(e as Error).message}`);
          this.log.info({ model: id, on: n.node, why: (e as Error).message }, 'cluster: this node refused the load');
          continue;
        }
      }
      this.log.info({ model: id, on: n.node, free_bytes: n.free_bytes }, 'cluster: placing on another node');
      const reply = await this.ask<{ ok: true }>(
        n.node,
        'load',
        { id, config: this.registrationOf(config), lock: lock.ref },
        this.settings.lock_ms * 100,
      ).catch((e: unknown) => e as Error);
      if (reply instanceof Error) {
        if (!is503(reply) && !(reply instanceof VoxError && reply.type === 'not_found')) throw reply;
        memory &&= (reply as VoxError).type === 'insufficient_memory';
        refusals.push(`${n.node}: ${reply.message}`);
        this.log.info({ model: id, on: n.node, why: reply.message }, 'cluster: a node refused the load');
        continue;
      }
      await this.until(() => this.holders(id).some((h) => h.node === n.node), 3 * this.settings.heartbeat_ms);
      return this.remotePool(config);
    }
    // The nodes asked refuse a load whose lock was taken over (split brain): the other placement counts.
    if (!(await lock.held())) throw superseded(id);
    throw voxError(memory ? 'cluster_insufficient_memory' : 'cluster_full', {
      id,
      why: ` (${candidates.length} asked): ${refusals.join('; ')}`,
    });
  }

  /** The fields another node needs to register a model it does not know (its config minus server-filled paths of a group's heads). */
  private registrationOf(config: ModelConfig): Record<string, unknown> {
    return {
      ...config,
      heads: config.heads?.map((h) =>
        typeof h === 'string' ? h : { model: h.model, threshold: h.threshold, refractory_ms: h.refractory_ms },
      ),
    };
  }

  /**
   * Takes the model's cold-load lock: created if absent, taken over if its holder's deadline has
   * passed (compare-and-set on the revision both ways). The holder renews it every third of
   * `lock_ms` until released.
   * @returns the lock, or null when another node holds it.
   */
  private async takeLock(model: string): Promise<LoadLock | null> {
    const kv = this.link.locks;
    const key = lockKey(model);
    const token = randomUUID();
    const value = (): Uint8Array =>
      encodeJson({ owner: this.name, token, model, deadline: Date.now() + this.settings.lock_ms });
    let rev: number;
    try {
      rev = await kv.create(key, value());
    } catch {
      const e = await kv.get(key).catch(() => null);
      if (e && e.operation === 'PUT' && e.json<{ deadline: number }>().deadline > Date.now()) return null;
      try {
        rev = e ? await kv.update(key, value(), e.revision) : await kv.create(key, value());
        if (e?.operation === 'PUT')
          this.log.warn({ model, from: e.json<{ owner: string }>().owner }, 'cluster: took over an expired load lock');
      } catch {
        return null;
      }
    }
    let renewing: Promise<unknown> = Promise.resolve();
    const renew = setInterval(
      () => {
        renewing = kv.update(key, value(), rev).then(
          (r) => (rev = r),
          () => {},
        );
      },
      Math.max(50, this.settings.lock_ms / 3),
    );
    const ref = { key, token };
    return {
      ref,
      held: async () => {
        try {
          rev = await kv.update(key, value(), rev);
          return true;
        } catch {
          // A renewal raced this one, NATS is away, or the lock is another's now: its token tells.
          return this.lockHolds(ref);
        }
      },
      release: async () => {
        clearInterval(renew);
        // A renewal in flight changes the revision: the delete waits for it (else it fails and the lock stays until its deadline).
        await renewing;
        await kv.delete(key, { previousSeq: rev }).catch(() => {});
      },
    };
  }

  /**
   * A pool whose jobs run on the holders of `config.id`: a {@link SlotPool} of remote slots (a
   * window of jobs in flight), so FIFO order, the slot wait's busy timeout, stuck detection and
   * the batcher work as for local slots. Its `info` comes from a holder.
   */
  private async remotePool(config: ModelConfig): Promise<LoadedModel> {
    const id = config.id;
    const holders = this.holders(id);
    let info: SlotInfo | null = null;
    const why: string[] = [];
    for (const h of holders) {
      try {
        info = (await this.ask<{ info: SlotInfo }>(h.node, 'info', { model: id }, 10_000)).info;
        break;
      } catch (e) {
        why.push(`${h.node}: ${(e as Error).message}`);
        // Its process died since its last heartbeat (its subjects have no responders): gone now, not 3 heartbeats from now.
        if (isNoResponders((e as { cause?: unknown }).cause)) this.markGone(h.node, 'no responders');
      }
    }
    if (!info)
      throw voxError('no_holder', { message: `no holder of ${id} answered: ${why.join('; ') || 'none left'}` });
    const window = Math.max(2, Math.min(MAX_REMOTE_WINDOW, 2 * holders.reduce((n, h) => n + h.models[id].slots, 0)));
    const slotInfo = info;
    const pool = await SlotPool.start({ kind: 'vad', model: '' }, window, async () =>
      this.remoteSlot(config, slotInfo),
    );
    this.remote.set(id, true);
    this.log.info({ model: id, holders: holders.map((h) => h.node), window }, 'cluster: model served by other nodes');
    this.beat();
    return {
      pool,
      residentBytes: 0,
      close: async () => {
        this.remote.delete(id);
        const backing = this.backing.get(id);
        this.backing.delete(id);
        await pool.close();
        await backing?.close();
        this.beat();
      },
    };
  }

  /** One place in a remote pool's window: runs each job on the least loaded holder. */
  private remoteSlot(config: ModelConfig, info: SlotInfo): SlotHost {
    return {
      info,
      run: (job, waitUntil) => this.sendJob(config, job, waitUntil),
      close: async () => {},
      onExit: () => {},
      residentBytes: () => 0,
    };
  }

  /**
   * Sends one job to a holder, least loaded first, or runs it here on the model's backing pool
   * when this node holds it behind its remote pool. A holder that answers busy or no longer holds
   * the model is skipped; when all are busy (or none is live) the job waits and asks again, up to
   * the model's busy timeout. A holder taken for gone (no responders, missed heartbeats, no reply
   * within its wait plus `job_deadline_ms`) is skipped and the same job (same input, same state)
   * is sent again; when no node holds the model any more it is placed again (here or elsewhere,
   * under its lock) and the job runs there. Each attempt has its own reply subject
   * (`<seq>.<attempt>`): a reply to an attempt given up is dropped, so a job is answered once.
   * @param waitUntil the job's own end of waiting (its request's busy timeout), ms since the epoch.
   * @throws VoxError `no_holder` (503 `server_busy`, Retry-After 1 s) when no holder took the job
   *   within the busy timeout (every one busy or gone, or NATS away); the holder's error otherwise
   *   (e.g. `server_error` for a failed run).
   */
  private async sendJob(config: ModelConfig, job: Job, waitUntil?: number): Promise<JobResult> {
    const id = config.id;
    const timeout = this.busyTimeout(config);
    const end = Math.min(waitUntil ?? Infinity, timeout > 0 ? Date.now() + timeout : Infinity);
    const seq = ++this.seq;
    const jobId = `${this.name}:${seq}`;
    const deadline = this.settings.job_deadline_ms;
    const frame = (attempt: number, wait: number): Uint8Array =>
      encodeMessage({ type: 'job', id: `${jobId}#${attempt}`, model: id, wait_ms: wait, job });
    const maxPayload = this.link.nc.info?.max_payload ?? 1024 * 1024;
    const size = frame(0, deadline).length;
    if (size > maxPayload) {
      // A batch of many streams over NATS's max_payload goes as two jobs of half the streams each.
      const halves = splitJob(job);
      if (!halves) throw voxError('job_too_large', { id, bytes: size, max: maxPayload });
      const [a, b] = await Promise.all(halves.map((h) => this.sendJob(config, h, waitUntil)));
      return joinResults(a, b);
    }
    const skip = new Set<string>();
    let lastBusy = '';
    let lastGone = '';
    let replaced = 0;
    for (let attempt = 1; ; attempt++) {
      if (this.closed) throw voxError('shutting_down');
      const backing = this.backing.get(id);
      if (backing) return backing.pool.run(job, undefined, end === Infinity ? 0 : Math.max(1, end - Date.now()));
      if (!(await this.connectedBy(end)))
        throw voxError('no_holder', {
          message: `NATS (${redact(this.settings.nats, this.settings)}) was unreachable for the busy timeout; ${id} is held on other nodes`,
        });
      const holder = this.holders(id).find((h) => !skip.has(h.node));
      if (!holder) {
        // No node holds it any more (unloaded there, or its holders gone): placed again, once a few heartbeats.
        if (!this.holders(id).length && Date.now() - replaced > 3 * this.settings.heartbeat_ms) {
          replaced = Date.now();
          await this.replace(config).catch((e: Error) =>
            this.log.warn({ model: id, err: e.message }, 'cluster: could not place the model again'),
          );
          continue;
        }
        // Every holder busy, or none live just now (a late heartbeat): ask again until the busy timeout.
        if (Date.now() >= end) {
          throw voxError('no_holder', {
            message: lastBusy
              ? `every node holding ${id} is busy: ${lastBusy}`
              : `no node of the cluster holds ${id} ready${lastGone ? ` (${lastGone})` : ''}`,
          });
        }
        skip.clear();
        await this.changed(Math.min(BUSY_RETRY_MS, Math.max(1, end - Date.now())));
        continue;
      }
      const node = holder.node;
      // The holder waits for a lease and a slot at most the job deadline (then answers busy), so
      // silence past that wait plus the deadline means it is gone.
      const wait = end === Infinity ? deadline : Math.max(1, Math.min(deadline, end - Date.now()));
      this.inflight.set(node, (this.inflight.get(node) ?? 0) + 1);
      const t0 = performance.now();
      let outcome: Attempt;
      try {
        outcome = await this.attempt(node, `${seq}.${attempt}`, frame(attempt, wait), wait + deadline);
      } finally {
        this.inflight.set(node, (this.inflight.get(node) ?? 1) - 1);
      }
      if ('lost' in outcome) {
        this.metrics?.failovers.inc({ model: id, why: 'lost' });
        continue;
      }
      if ('gone' in outcome) {
        skip.add(node);
        lastGone = `${node}: ${outcome.gone}`;
        this.metrics?.sent.inc({ model: id, node, outcome: 'gone' });
        this.metrics?.failovers.inc({
          model: id,
          why: outcome.gone.startsWith('no responders')
            ? 'no_responders'
            : outcome.gone.startsWith('missed')
              ? 'heartbeats'
              : 'deadline',
        });
        this.log.info({ model: id, job: jobId, on: node, why: outcome.gone }, 'cluster: job sent again');
        continue;
      }
      const reply = outcome.reply;
      if (reply.type === 'result') {
        const rtt = performance.now() - t0;
        this.metrics?.sent.inc({ model: id, node, outcome: 'ok' });
        this.metrics?.hop.observe({ model: id }, Math.max(0, rtt - reply.ran_ms) / 1000);
        return reply.result;
      }
      if (reply.type !== 'error')
        throw voxError('node_failed', { message: `node ${node} answered a job with ${reply.type}` });
      this.metrics?.sent.inc({ model: id, node, outcome: reply.error });
      if (reply.error === 'not_held' || reply.error === 'server_busy' || reply.error === 'shutting_down') {
        if (reply.error === 'server_busy') lastBusy = `${node}: ${reply.message}`;
        skip.add(node);
        continue;
      }
      throw fromWire({ code: reply.code, message: `node ${node}: ${reply.message}` });
    }
  }

  /**
   * Places a model again for this node's remote pool when no node holds it any more (unloaded on
   * its holders, or its holders gone): under the model's lock, on the live nodes by most free
   * memory, this one included. A node that runs the model on a remote pool itself (this one, or
   * another ingress) loads it behind that pool ({@link adopt}), so its own streams go on.
   * @throws VoxError when every node refused.
   */
  private async replace(config: ModelConfig): Promise<void> {
    const id = config.id;
    const lock = await this.takeLock(id);
    if (!lock) return;
    try {
      // The registry itself, not the watch (it may lag): the previous lock holder may have placed it just now.
      await this.refreshView();
      if (this.holders(id).length || this.backing.has(id)) return;
      const refusals: string[] = [];
      const here = this.record();
      const candidates = [
        ...(here.draining ? [] : [here]),
        ...this.nodes().filter((r) => r.node !== this.name && !r.draining),
      ].sort((a, b) => b.free_bytes - a.free_bytes);
      for (const n of candidates) {
        try {
          this.log.info({ model: id, on: n.node }, 'cluster: no node holds the model any more; placing it again');
          if (n.node === this.name) {
            await this.adopt(id);
            // Registered before the lock is released, so the next node to take it finds this holder.
            return await this.publish();
          }
          await this.ask(
            n.node,
            'load',
            { id, config: this.registrationOf(config), adopt: true, lock: lock.ref },
            this.busyTimeout(config) || 3_600_000,
          );
          await this.until(() => this.holders(id).some((h) => h.node === n.node), 3 * this.settings.heartbeat_ms);
          return;
        } catch (e) {
          refusals.push(`${n.node}: ${(e as Error).message}`);
        }
      }
      throw voxError('cluster_insufficient_memory', {
        id,
        why: ` on another node: ${refusals.join('; ') || 'none is live'}`,
      });
    } finally {
      await lock.release();
    }
  }

  /**
   * Loads `id` here behind the remote pool this node runs it on (its holders are gone): the remote
   * pool's jobs, and other nodes' jobs, run on this backing pool from then on; it closes with the
   * remote pool. Guarded by this node's `min_free_memory_mb` only (it is not an entry of the
   * supervisor: no LRU eviction makes room for it, docs/cluster.md). Bounded like a local load by
   * the model's `load_timeout_ms` (else the server's; 0 = none): past it the load is abandoned (its
   * slot hosts killed through the loader's abort signal).
   * @throws VoxError `insufficient_memory` when the guard refuses, `load_timeout` past the load
   *   timeout; the loader's error.
   */
  private adopt(id: string): Promise<void> {
    const running = this.adopting.get(id);
    if (running) return running;
    const p = (async () => {
      const sup = this.supervisor!;
      const config = sup.configOf(id);
      if (!config || !this.remote.has(id) || this.backing.has(id)) return;
      const MB = 1024 * 1024;
      const free = this.options.memoryProbe();
      if (this.config.min_free_memory_mb > 0 && free < this.config.min_free_memory_mb * MB)
        throw voxError('insufficient_memory', {
          id,
          needed: 'its footprint',
          headroom: `${this.config.min_free_memory_mb} MB`,
          free: `${Math.round(free / MB)} MB`,
        });
      const m = await this.loadBounded(config);
      if (!this.remote.has(id)) return void (await m.close()); // its remote pool closed meanwhile
      m.pool.waitTimeoutMs = this.busyTimeout(config);
      this.backing.set(id, m);
      this.log.info({ model: id, slots: m.pool.slots.length }, 'cluster: holds the model here behind its remote pool');
      this.beat();
    })().finally(() => this.adopting.delete(id));
    this.adopting.set(id, p);
    return p;
  }

  /**
   * The supervisor's loader for `config`, abandoned past the model's `load_timeout_ms` (else the
   * server's; 0 = none) as a model entry abandons a local load: its abort signal kills the slot
   * hosts still loading, and a pool that comes up anyway is closed.
   * @throws VoxError `load_timeout`; the loader's error.
   */
  private loadBounded(config: ModelConfig): Promise<LoadedModel> {
    const ms = config.load_timeout_ms ?? this.config.load_timeout_ms;
    const ctl = new AbortController();
    const loading = this.supervisor!.loadPool(config, ctl.signal);
    if (!(ms > 0)) return loading;
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        ctl.abort();
        reject(voxError('load_timeout', { ms }));
        void loading.then(
          (late) => late.close(),
          () => {},
        );
      }, ms);
      loading.then(
        (m) => {
          clearTimeout(timer);
          resolve(m);
        },
        (e: unknown) => {
          clearTimeout(timer);
          reject(e);
        },
      );
    });
  }

  // ---- serving other nodes --------------------------------------------------------------------

  /**
   * Serves a load or unload request, or joins the same request still being served: the asking node
   * sends a request again when a NATS connection came back ({@link ask}), and a second copy served
   * on its own would queue behind the first (a full queue refuses it: the asking node would then
   * place the model elsewhere while this node still loads it).
   */
  private once(what: string, m: Msg, serve: () => Promise<Uint8Array>): Promise<Uint8Array> {
    const key = `${what} ${new TextDecoder().decode(m.data)}`;
    const running = this.serving.get(key);
    if (running) return running;
    const p = serve().finally(() => this.serving.delete(key));
    this.serving.set(key, p);
    return p;
  }

  /** The entry of a model held here ready (a local pool), else a `not_held` error. */
  private held(model: string): ModelEntry {
    const entry = this.supervisor?.getOrRegister(model);
    if (!entry || entry.state !== 'ready' || this.remote.has(model))
      throw Object.assign(new Error(`${this.name} does not hold ${model}`), { notHeld: true });
    return entry;
  }

  /**
   * A job from another node: admitted through the model entry like a local request (a lease in
   * FIFO order within the job's wait and the model's busy timeout, `max_queued`, stuck
   * detection), run on the model's slots, answered with its result.
   */
  private async serveJob(m: Msg): Promise<Uint8Array> {
    const msg = decodeMessage<RemoteJob>(m.data);
    let outcome = 'ok';
    try {
      const backing = this.remote.has(msg.model) ? this.backing.get(msg.model) : undefined;
      if (backing) {
        const result = await backing.pool.run(msg.job, undefined, msg.wait_ms);
        return encodeMessage({ type: 'result', result, ran_ms: result.ran ? result.ran[1] - result.ran[0] : 0 });
      }
      let entry;
      try {
        entry = this.held(msg.model);
      } catch (e) {
        outcome = 'not_held';
        return encodeMessage({ type: 'error', error: 'not_held', message: (e as Error).message });
      }
      const lease = await entry.admit({ requestTimeoutMs: msg.wait_ms });
      try {
        const { pool } = await entry.ensureReady();
        const result = await pool.run(msg.job, undefined, msg.wait_ms);
        return encodeMessage({ type: 'result', result, ran_ms: result.ran ? result.ran[1] - result.ran[0] : 0 });
      } finally {
        lease.release();
      }
    } catch (e) {
      const v = toVoxError(e);
      if (this.draining && v.status >= 500) {
        // A draining node unloading its models fails the jobs still on them: it holds the model no
        // more, so the ingress sends the job (which gave no result) to another holder.
        outcome = 'not_held';
        return encodeMessage({ type: 'error', error: 'not_held', message: `${this.name} is stopping: ${v.message}` });
      }
      outcome = v.type;
      return encodeMessage({
        type: 'error',
        error: v.type,
        code: v.code,
        message: v.message,
        retry_after_s: v.retryAfterS,
      });
    } finally {
      this.metrics?.served.inc({ model: msg.model, outcome });
      this.lastServed.set(msg.model, Date.now());
    }
  }

  /** What a holder's slots reported at load (heads, a stream's initial embedding history). */
  private async serveInfo(m: Msg): Promise<Uint8Array> {
    const { model } = JSON.parse(new TextDecoder().decode(m.data)) as { model: string };
    try {
      const backing = this.remote.has(model) ? this.backing.get(model) : undefined;
      if (backing) return encodeMessage({ type: 'info', info: backing.pool.info });
      const entry = this.held(model);
      const { pool } = await entry.ensureReady();
      return encodeMessage({ type: 'info', info: pool.info });
    } catch (e) {
      if ((e as { notHeld?: boolean }).notHeld)
        return encodeMessage({ type: 'error', error: 'not_held', message: (e as Error).message });
      throw e;
    }
  }

  /**
   * Load a model here (a placement or a management load naming this node): registered from the
   * catalog, or from the config sent along; an entry that runs on a remote pool gives it up first.
   */
  private async serveLoad(m: Msg): Promise<Uint8Array> {
    const body = JSON.parse(new TextDecoder().decode(m.data)) as {
      id: string;
      config?: Record<string, unknown>;
      fields?: Record<string, unknown>;
      /** A placement after the holders went: a node running the model on a remote pool loads it behind that pool. */
      adopt?: boolean;
      /** The placement's load lock: the load counts only while it is still that taking. */
      lock?: LockRef;
    };
    if (body.adopt && this.remote.has(body.id)) await this.adopt(body.id);
    else await this.loadHere(body.id, body.fields ?? {}, body.config, body.lock);
    return encodeMessage({ type: 'info', info: {} });
  }

  /**
   * Loads (or reconfigures) `id` on this node with a local pool.
   * @param fields management fields (`POST /v1/models/load` minus `node`, `replicas`).
   * @param registration a config to register the model with if this node does not know it.
   * @param lock the load lock of the placement asking for it: a cold load counts only while the
   *   lock is still that taking ({@link fenced}).
   */
  async loadHere(
    id: string,
    fields: Record<string, unknown>,
    registration?: Record<string, unknown>,
    lock?: LockRef,
  ): Promise<{ id: string; loaded: true; reconfigured: boolean }> {
    const sup = this.supervisor!;
    const timeout = this.config.busy_timeout_ms;
    const entry = sup.getOrRegister(id);
    if (!entry && registration) {
      // A model registered on another node: its config comes along (model files are the same paths on every node).
      this.pinned.set(id, lock);
      try {
        return await sup.load({ ...registration, ...fields, id }, timeout);
      } finally {
        this.pinned.delete(id);
        this.beat();
      }
    }
    if (!entry) throw voxError('model_not_found', { id, hint: `not on ${this.name}` });
    if (this.remote.has(id)) await entry.unload(timeout);
    this.pinned.set(id, lock);
    // A placement of this model waiting here (for the lock another node holds) loads it now.
    for (const f of this.viewChanged.splice(0)) f();
    try {
      if (Object.keys(fields).some((k) => k !== 'id')) return await sup.load({ ...fields, id }, timeout);
      // A load of it under way here (this node's own request's, which the pin above makes this
      // placement's) answers: a lease would queue behind this node's own requests on the model and,
      // past the busy timeout, refuse a load that is running, so the placing node would load it too.
      if (entry.state === 'loading') await entry.settledIn('ready', 'unloaded');
      if (entry.state === 'ready' && !this.remote.has(id)) return { id, loaded: true, reconfigured: false };
      // Nothing to reconfigure: a plain lease (not the exclusive one, which would wait for this
      // node's own requests waiting for the same load).
      const lease = await entry.admit({});
      try {
        await entry.ensureReady();
      } finally {
        lease.release();
      }
      return { id, loaded: true, reconfigured: false };
    } finally {
      this.pinned.delete(id);
      this.beat();
    }
  }

  private async serveUnload(m: Msg): Promise<Uint8Array> {
    const body = JSON.parse(new TextDecoder().decode(m.data)) as {
      ids?: string[];
      force?: boolean;
      remote_only?: boolean;
      except?: string[];
    };
    const r = await this.unloadHere(body.ids, body.force, body.remote_only, body.except);
    return encodeJson(r);
  }

  /**
   * Unloads models on this node (`ids` absent: every registered one).
   * @param remoteOnly only the models this node runs on a remote pool and does not hold behind it
   *   (the first phase of a cluster-wide unload: they wait for this node's own streams on them).
   * @param except ids left alone.
   * @throws VoxError `unload_timeout` naming the models still busy after the busy timeout.
   */
  async unloadHere(
    ids?: string[],
    force = false,
    remoteOnly = false,
    except: string[] = [],
  ): Promise<{ unloaded: string[]; not_found: string[]; busy?: string[] }> {
    const sup = this.supervisor!;
    let which = (ids ?? sup.registeredIds).filter((id) => !except.includes(id));
    if (remoteOnly) {
      // Each barrier placed in this same step (as unloadMany does); the ones still busy are named.
      // A model held here behind its remote pool is a holder: it unloads with the holders.
      which = which.filter((id) => this.remote.has(id) && !this.backing.has(id));
      const results = await Promise.allSettled(
        which.map((id) =>
          force ? sup.getOrRegister(id)!.forceUnload() : sup.unloadMany([id], this.config.busy_timeout_ms),
        ),
      );
      this.beat();
      return {
        unloaded: which.filter((_, i) => results[i].status === 'fulfilled'),
        not_found: [],
        busy: which.filter((_, i) => results[i].status === 'rejected'),
      };
    }
    if (force && ids) {
      for (const id of which) await sup.getOrRegister(id)?.forceUnload();
      return { unloaded: which.filter((id) => sup.configOf(id)), not_found: which.filter((id) => !sup.configOf(id)) };
    }
    try {
      return await sup.unloadMany(which, this.config.busy_timeout_ms);
    } finally {
      this.beat();
    }
  }

  /**
   * Sends a request to a node's subject and decodes its answer. Its answer is not waited for once
   * the node is no longer live (a dead node's load or unload would otherwise hold its caller, and a
   * placement's lock, for the whole timeout); the request is sent again when this node's NATS
   * connection comes back, and when the node's heartbeat shows that its own came back since the
   * request was sent ({@link NodeRecord.session}): the request or its answer may have been lost
   * with the connection (info, load and unload may be asked twice).
   * @throws VoxError the node's error (with its type), `server_busy` when nobody answers for it.
   */
  private async ask<T>(node: string, what: 'info' | 'load' | 'unload', body: unknown, timeoutMs: number): Promise<T> {
    let m: Msg;
    try {
      let sent = '';
      let reply!: Promise<Msg>;
      for (;;) {
        // This node's session and the node's as last heard: either changing may have lost the request.
        const session = `${this.reconnects}/${this.view.get(node)?.record.session}`;
        if (sent !== session) {
          if (sent)
            this.log.info({ on: node, what }, 'cluster: a NATS connection came back; the request is sent again');
          sent = session;
          reply = this.link.nc.request(this.subject(node, what), encodeJson(body), { timeout: timeoutMs });
        }
        const r = await Promise.race([reply, this.changed(this.settings.heartbeat_ms).then(() => null)]);
        if (r) {
          m = r;
          break;
        }
        if (this.connected && !this.nodes().some((n) => n.node === node))
          throw new Error('it left the cluster (no heartbeat heard)');
      }
    } catch (e) {
      throw voxError('node_unreachable', { node, reason: (e as Error).message, cause: e });
    }
    if (what === 'unload') {
      const text = new TextDecoder().decode(m.data);
      if (text.startsWith('{')) return JSON.parse(text) as T;
    }
    const r = decodeMessage<RemoteReply>(m.data);
    if (r.type === 'error')
      throw r.error === 'not_held'
        ? voxError('no_holder', { message: `node ${node}: ${r.message}` })
        : fromWire({ code: r.code, message: `node ${node}: ${r.message}` });
    return r as T;
  }

  // ---- management and status ------------------------------------------------------------------

  /**
   * `POST /v1/models/load` in a cluster. With `node`: that node loads it (this one, or another
   * over NATS). Else `replicas` (default 1) nodes must hold it: nodes already holding it are
   * reconfigured with the fields given; missing replicas are placed on the nodes with the most
   * free memory that do not hold it (each by its own guards).
   * @throws VoxError `invalid_request_error` (bad `node` or `replicas`, or the config: nothing is
   *   changed anywhere), `not_found` (unknown node), 503 when no node could load it.
   */
  async manageLoad(
    body: Record<string, unknown>,
    validate: (fields: Record<string, unknown>) => ModelConfig,
  ): Promise<Record<string, unknown>> {
    const { node, replicas, ...fields } = body;
    if (node !== undefined && (typeof node !== 'string' || !node))
      throw invalid('node', 'must be a node name (GET /v1/cluster lists them)');
    if (
      replicas !== undefined &&
      (!Number.isInteger(replicas) || (replicas as number) < 1 || (replicas as number) > 64)
    )
      throw invalid('replicas', 'must be an integer from 1 to 64');
    if (typeof fields.id !== 'string' || !fields.id) throw invalid('id', 'required, a model id string');
    const id = fields.id;
    // Validated here first: an invalid config changes nothing on any node.
    const config = validate(fields);
    if (node !== undefined) {
      if (node === this.name)
        return { ...(await this.loadHere(id, fields, this.registrationOf(config))), nodes: [node] };
      if (!this.nodes().some((r) => r.node === node)) throw voxError('node_not_found', { node });
      await this.ask(node, 'load', { id, fields, config: this.registrationOf(config) }, 3_600_000);
      await this.until(
        () => this.nodes().some((r) => r.node === node && r.models[id]?.state === 'ready'),
        3 * this.settings.heartbeat_ms,
      );
      return { id, loaded: true, reconfigured: false, nodes: [node] };
    }
    const want = (replicas as number | undefined) ?? 1;
    const holding = (): string[] =>
      this.nodes()
        .filter((r) => !r.draining && r.models[id] && r.models[id].state !== 'unloading')
        .map((r) => r.node);
    const done: string[] = [];
    const refusals: string[] = [];
    for (const n of holding().slice(0, want)) {
      // Already held: reconfigured where fields change, else nothing happens there.
      if (n === this.name) await this.loadHere(id, fields, this.registrationOf(config));
      else await this.ask(n, 'load', { id, fields, config: this.registrationOf(config) }, 3_600_000);
      done.push(n);
    }
    const others = this.nodes()
      .filter((r) => !r.draining && !done.includes(r.node))
      .sort((a, b) => b.free_bytes - a.free_bytes);
    for (const r of others) {
      if (done.length >= want) break;
      try {
        if (r.node === this.name) await this.loadHere(id, fields, this.registrationOf(config));
        else await this.ask(r.node, 'load', { id, fields, config: this.registrationOf(config) }, 3_600_000);
        done.push(r.node);
      } catch (e) {
        if (!is503(e)) throw e;
        refusals.push(`${r.node}: ${(e as Error).message}`);
      }
    }
    if (done.length === 0) throw voxError('cluster_insufficient_memory', { id, why: `: ${refusals.join('; ')}` });
    await this.until(
      () => done.every((n) => this.nodes().some((r) => r.node === n && r.models[id]?.state === 'ready')),
      3 * this.settings.heartbeat_ms,
    );
    return {
      id,
      loaded: true,
      reconfigured: false,
      nodes: done,
      ...(done.length < want ? { replicas: done.length, refused: refusals } : {}),
    };
  }

  /**
   * Unload in a cluster: on `node` only when given, else on every live node (this one included).
   * @returns per node what it unloaded; `unloaded` / `not_found` merged.
   */
  async manageUnload(
    ids: string[] | undefined,
    node: unknown,
    force = false,
  ): Promise<{ unloaded: string[]; not_found: string[]; nodes: Record<string, unknown> }> {
    if (node !== undefined && (typeof node !== 'string' || !node))
      throw invalid('node', 'must be a node name (GET /v1/cluster lists them)');
    const targets =
      node !== undefined ? [node as string] : [...new Set([this.name, ...this.nodes().map((r) => r.node)])];
    if (node !== undefined && node !== this.name && !this.nodes().some((r) => r.node === node))
      throw voxError('node_not_found', { node });
    const per: Record<string, unknown> = {};
    const unloaded = new Set<string>();
    let notFound: Set<string> | null = null;
    const onEvery = async (
      body: { remote_only?: boolean; except?: string[] },
      each: (n: string, r: { unloaded: string[]; not_found: string[]; busy?: string[] } | VoxError) => void,
    ): Promise<void> => {
      await Promise.all(
        targets.map(async (n) => {
          try {
            each(
              n,
              n === this.name
                ? await this.unloadHere(ids, force, body.remote_only, body.except)
                : await this.ask<{ unloaded: string[]; not_found: string[]; busy?: string[] }>(
                    n,
                    'unload',
                    { ids, force, ...body },
                    3_600_000,
                  ),
            );
          } catch (e) {
            each(n, toVoxError(e));
          }
        }),
      );
    };
    // Cluster-wide: first the nodes that run the models on remote pools, each waiting for its own
    // streams on them (as a single node's unload waits for its streams); then the holders. A
    // model still in use somewhere after the busy timeout stays loaded everywhere (unload_timeout),
    // as on a single node, instead of being placed again by the stream that still runs on it.
    const blocked = new Set<string>();
    if (node === undefined) {
      await onEvery({ remote_only: true }, (n, r) => {
        if (r instanceof VoxError) per[n] = { error: r.message };
        else for (const id of r.busy ?? []) blocked.add(id);
      });
    }
    await onEvery({ except: [...blocked] }, (n, r) => {
      if (r instanceof VoxError) {
        per[n] = { error: r.message };
        return;
      }
      per[n] = r;
      r.unloaded.forEach((id) => unloaded.add(id));
      const nf = new Set(r.not_found);
      notFound = notFound ? new Set([...notFound].filter((id) => nf.has(id))) : nf;
    });
    if (blocked.size) throw voxError('unload_timeout', { busy: [...blocked], unloaded: [...unloaded] });
    return { unloaded: [...unloaded], not_found: [...(notFound ?? [])].filter((id) => !unloaded.has(id)), nodes: per };
  }

  /** `GET /v1/cluster`: this node, NATS, and every live node with its free memory, models and draining flag. */
  status(): Record<string, unknown> {
    const now = Date.now();
    const live = new Map(this.nodes(now).map((r) => [r.node, r]));
    if (this.supervisor) live.set(this.name, this.record());
    return {
      node: this.name,
      nats: { url: redact(this.settings.nats, this.settings), connected: this.connected },
      heartbeat_ms: this.settings.heartbeat_ms,
      nodes: [...live.values()]
        .sort((a, b) => a.node.localeCompare(b.node))
        .map((r) => ({
          node: r.node,
          url: r.url,
          free_bytes: r.free_bytes,
          draining: r.draining,
          last_seen_ms: now - (this.view.get(r.node)?.seen ?? now),
          models: Object.keys(r.models).sort(),
          max_loaded_models: r.max_loaded_models,
        })),
    };
  }

  /** Per model id, the live nodes holding it and their figures (for `GET /v1/models`). */
  holdersByModel(): Map<string, ({ node: string } & HeldModel)[]> {
    const out = new Map<string, ({ node: string } & HeldModel)[]>();
    const live = new Map(this.nodes().map((r) => [r.node, r]));
    if (this.supervisor) live.set(this.name, this.record());
    for (const r of [...live.values()].sort((a, b) => a.node.localeCompare(b.node))) {
      for (const [id, m] of Object.entries(r.models)) {
        if (!out.has(id)) out.set(id, []);
        out.get(id)!.push({ node: r.node, ...m });
      }
    }
    return out;
  }

  /**
   * Marks this node draining at once (others stop sending it work, placements skip it) and hands
   * over the models only it holds that other nodes used in the last minute: each is placed on
   * another live node (by most free memory; an ingress running it on a remote pool loads it behind
   * that pool), so their jobs move there before this node unloads ({@link handedOver}).
   */
  drain(): void {
    if (this.draining) return;
    this.draining = true;
    void this.publish();
    if (this.supervisor && this.connected) this.handover = this.handOver();
  }

  /**
   * Resolves once the models this node handed over at {@link drain} are held elsewhere and the
   * other nodes have had a heartbeat to hear of it (or the hand-over gave up: it is bounded by the
   * drain deadline). The server awaits it before unloading its models.
   */
  handedOver(): Promise<void> {
    return this.handover;
  }

  private handover: Promise<void> = Promise.resolve();

  private async handOver(): Promise<void> {
    const sup = this.supervisor!;
    const bound = this.config.drain_timeout_ms || this.config.busy_timeout_ms || 60_000;
    const end = Date.now() + bound;
    const used = (id: string): boolean => Date.now() - (this.lastServed.get(id) ?? -Infinity) < 60_000;
    const sole = sup
      .statuses()
      .filter((m) => m.state === 'ready' && (!this.remote.has(m.id) || this.backing.has(m.id)) && used(m.id))
      .map((m) => m.id)
      .filter(
        (id) => !this.nodes().some((r) => r.node !== this.name && !r.draining && r.models[id]?.state === 'ready'),
      );
    const moved: string[] = [];
    await Promise.all(
      sole.map(async (id) => {
        const config = sup.configOf(id);
        if (!config) return;
        const lock = await this.takeLock(id);
        if (!lock) return;
        try {
          for (const n of this.nodes()
            .filter((r) => r.node !== this.name && !r.draining)
            .sort((a, b) => b.free_bytes - a.free_bytes)) {
            if (Date.now() >= end) return;
            try {
              this.log.info({ model: id, on: n.node }, 'cluster: draining; handing the model over');
              await this.ask(
                n.node,
                'load',
                { id, config: this.registrationOf(config), adopt: true, lock: lock.ref },
                Math.max(1, end - Date.now()),
              );
              if (await this.until(() => this.holders(id).some((h) => h.node === n.node), end - Date.now())) {
                moved.push(id);
                return;
              }
            } catch (e) {
              this.log.info({ model: id, on: n.node, why: (e as Error).message }, 'cluster: hand-over refused');
            }
          }
        } finally {
          await lock.release();
        }
      }),
    );
    // The other ingresses hear of the new holders at their heartbeat: one more before this node unloads.
    if (moved.length) await sleep(Math.min(this.settings.heartbeat_ms, Math.max(0, end - Date.now())));
    this.log.info({ moved, sole }, 'cluster: hand-over done');
  }

  /** Leaves the cluster: stops the heartbeat, removes this node's entry, closes the connection. */
  async close(): Promise<void> {
    if (this.closed) return;
    if (this.heartbeat) clearInterval(this.heartbeat);
    if (this.probe) clearInterval(this.probe);
    if (this.soon) clearTimeout(this.soon);
    try {
      if (this.connected) await this.link.nodes.delete(nodeKey(this.name)).catch(() => {});
    } finally {
      this.closed = true;
      // Jobs still waiting for a holder's reply end (their requests get 503 shutting_down).
      for (const [token, p] of this.pending) {
        this.pending.delete(token);
        p.settle({ lost: true });
      }
      for (const s of this.subs) s.unsubscribe();
      await this.link.nc.close().catch(() => {});
    }
  }
}
