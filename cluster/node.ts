/**
 * One voxserve node of a cluster (docs/cluster.md, DESIGN.md section 8): every node is an ingress
 * and may hold models. This class is the handle the server holds; the behaviour lives in
 * - membership.ts: the membership chart (NATS link states, heartbeat, registry view, nodes gone);
 * - placement.ts: cold loads placed here or on another node under the load lock (locks.ts);
 * - remote.ts: the remote pool, whose jobs go to the holders and fail over (metrics.ts: the counters);
 * - serve.ts: what this node serves to the others (jobs through the shared lease path);
 * - manage.ts: management loads and unloads across nodes, and a draining node's hand-over;
 * - name.ts: the node's name in the registry, claimed at join and held by compare-and-set heartbeats.
 */
import type { Subscription } from '@nats-io/transport-node';
import type { Logger } from 'pino';
import { createActor, type InspectionEvent } from 'xstate';
import { busyTimeoutOf } from '../actors/model.js';
import type { Supervisor } from '../actors/supervisor.js';
import type { ModelConfig, ServerConfig } from '../runtime/config.js';
import { type VoxError } from '../runtime/errors.js';
import type { LoadedModel } from '../runtime/loader.js';
import type { MemoryProbe } from '../runtime/memory.js';
import { Autoscaler } from './autoscale.js';
import { Locks, type LockRef } from './locks.js';
import { ask, handOver, manageLoad, manageUnload } from './manage.js';
import {
  liveNodes,
  membershipMachine,
  parseRecord,
  readIsNewer,
  recordEvent,
  type HeldModel,
  type Membership,
  type NodeRecord,
} from './membership.js';
import {
  clusterSettings,
  connectNats,
  natsSide,
  wantedReplicas,
  nodeKey,
  redact,
  type ClusterSettings,
  type NatsLink,
  encodeJson,
} from './nats.js';
import { heldModels, holdersByModel } from './held.js';
import { Placement } from './placement.js';
import { type ClusterMetrics, clusterMetrics } from './metrics.js';
import { RemoteJobs, withDeadline } from './remote.js';
import { NodeName } from './name.js';
import { Serving } from './serve.js';

export type { HeldModel, NodeRecord };

/** What a cluster node needs from the server that runs it. */
export interface ClusterNodeOptions {
  log: Logger;
  /** Available memory, bytes (the server's probe; tests give fakes). */
  memoryProbe: MemoryProbe;
  /**
   * An open link to use instead of connecting to `cluster.nats` (tests give spec/cluster/fake-nats.ts's in-memory
   * NATS).
   */
  link?: NatsLink;
  /** The actor system's inspection observer (the membership chart is drawn by `/debug`). */
  inspect?: (e: InspectionEvent) => void;
}

/**
 * A node's membership in the cluster. Create it with {@link ClusterNode.connect} before the
 * supervisor (whose entries get {@link place}), then {@link attach} the supervisor.
 */
export class ClusterNode {
  readonly settings: ClusterSettings;
  /** The membership chart (`systemId` `cluster`). */
  readonly membership: Membership;
  readonly locks: Locks;
  readonly jobs: RemoteJobs;
  readonly placement: Placement;
  readonly serving: Serving;
  readonly autoscaler = new Autoscaler(this);
  supervisor: Supervisor | null = null;
  private url: string | null = null;
  readonly subs: Subscription[] = [];
  draining = false;
  closed = false;
  /**
   * Models this node was asked to hold itself (a placement or a `node` load): their next cold load
   * is local; a placement's load lock comes along, checked before the load counts.
   */
  readonly pinned = new Map<string, LockRef | undefined>();
  /** Jobs in flight from here to each node (spreads jobs between heartbeats). */
  readonly inflight = new Map<string, number>();
  /**
   * Models run here on a remote pool whose holders all went: loaded here too, behind that pool
   * (its jobs and other nodes' run on it), so the streams on the pool go on (docs/cluster.md).
   */
  readonly backing = new Map<string, LoadedModel>();
  /** This node's name in the registry, held by compare-and-set heartbeats. */
  private readonly nodeName: NodeName;
  /** Told once when another process took this node's name ({@link publish}); the CLI drains and exits 1. */
  onNameLost: (error: VoxError) => void = () => {};
  private stopWatch: (() => void) | null = null;
  private reopening: Promise<void> | null = null;
  private watchedAt = 0; // when the registry watch was last made, ms since the epoch
  private written = 0; // records written, the last one's `seq`
  private handover: Promise<void> = Promise.resolve();
  metrics: ClusterMetrics | null = null;

  private constructor(
    readonly link: NatsLink,
    readonly config: ServerConfig,
    readonly options: ClusterNodeOptions,
  ) {
    this.settings = clusterSettings(config.cluster!);
    this.membership = createActor(
      membershipMachine.provide({
        actions: { publish: () => void this.publish(), probe: () => this.jobs.probe() },
      }),
      {
        input: { self: this.settings.node, heartbeatMs: this.settings.heartbeat_ms },
        systemId: 'cluster',
        inspect: options.inspect,
      },
    );
    this.locks = new Locks(() => this.link.locks, this.settings.node, this.settings.lock_ms, options.log);
    this.nodeName = new NodeName(this.settings.node, () => this.link.nodes, this.membership);
    this.jobs = new RemoteJobs(this);
    this.placement = new Placement(this);
    this.serving = new Serving(this);
    this.membership.subscribe({
      error: (e) => options.log.error({ err: (e as Error).message }, 'cluster: membership chart failed'),
    });
    this.membership.subscribe((s) => this.metrics?.nats.set(s.matches('connected') ? 1 : 0));
    this.membership.start();
  }

  /**
   * Connects to NATS (failing at once, naming the URL, when it cannot) and starts watching the
   * registry.
   * @throws Error `cluster.nats: cannot connect to NATS at <url>: <why>`.
   */
  static async connect(config: ServerConfig, options: ClusterNodeOptions): Promise<ClusterNode> {
    const link = options.link ?? (await connectNats(clusterSettings(config.cluster!), options.log));
    const node = new ClusterNode(link, config, options);
    await node.watch();
    void node.watchStatus();
    return node;
  }

  get name(): string {
    return this.settings.node;
  }

  get log(): Logger {
    return this.options.log;
  }

  /** True while NATS is reachable (the membership chart is `connected`). */
  get connected(): boolean {
    return this.membership.getSnapshot().matches('connected');
  }

  /** The node's subject for `what`. */
  subject(node: string, what: 'job' | 'cancel' | 'info' | 'load' | 'unload' | 'ping'): string {
    return `${this.settings.subject_prefix}.node.${node}.${what}`;
  }

  /** Follows the registry bucket (every node's last heartbeat) into the membership chart. */
  private async watch(): Promise<void> {
    this.stopWatch?.();
    const started = Date.now();
    const it = await this.link.nodes.watch({ key: 'node.>' });
    // Only a watch made counts: one that failed is tried again at the next heartbeat, not 3 later.
    this.watchedAt = started;
    this.stopWatch = () => it.stop();
    void (async () => {
      for await (const e of it) this.membership.send(recordEvent(e, started));
    })().catch((e) => this.closed || this.log.warn({ err: (e as Error).message }, 'cluster registry watch ended'));
  }

  /** Reads every node's last heartbeat from the registry bucket itself (after a pause, the watch may lag behind it). */
  async refreshView(): Promise<void> {
    try {
      const kv = this.link.nodes;
      for await (const key of await kv.keys('node.>')) {
        const e = await kv.get(key);
        const record = e?.operation === 'PUT' ? parseRecord(e) : null;
        const seen = e?.created.getTime() ?? 0;
        const name = key.slice('node.'.length);
        if (record && readIsNewer(this.membership.getSnapshot().context.view.get(name), record, seen))
          this.membership.send({ type: 'RECORD', node: name, record, seen });
      }
    } catch (e) {
      this.log.debug({ err: (e as Error).message }, 'cluster: registry not read');
    }
  }

  /**
   * Tells the membership chart of losing and regaining NATS (the client reconnects by itself; missed pings count as
   * lost).
   */
  private async watchStatus(): Promise<void> {
    for await (const s of this.link.nc.status()) {
      if (s.type === 'disconnect' || s.type === 'reconnecting' || s.type === 'staleConnection') {
        if (this.connected)
          this.log.warn(
            { nats: redact(this.settings.nats, this.settings) },
            'cluster: lost NATS; serving the models held here, remote models wait',
          );
        this.membership.send({ type: 'NATS.LOST' });
      } else if (s.type === 'reconnect') {
        this.log.info({ server: redact(String(s.server), this.settings) }, 'cluster: NATS reconnected');
        this.membership.send({ type: 'NATS.BACK' });
        // A server restarted without its store lost the buckets: they are created again, and the registry followed
        // anew.
        void this.reopen();
      } else if (s.type === 'update' && this.link.replicas && this.link.replicas.nodes < wantedReplicas(this.link.nc)) {
        // The NATS cluster grew to 3 servers (its routes formed after this node joined): the buckets are scaled up.
        void this.reopen();
      }
    }
  }

  /**
   * Follows the registry anew on the buckets as open (a watch whose consumer went with a NATS server). Unlike
   * {@link reopen} it asks nothing of JetStream's meta leader, which may still be electing when the bucket's own new
   * leader already serves it (nats-server 2.9.10: reopening timed out for 10 s more). A bucket NATS lost fails the next
   * heartbeat's write, which reopens it.
   */
  private rewatch(): Promise<void> {
    return this.inTurn(() => this.watch(), 'cluster: the registry watch could not be made again');
  }

  /** Opens the buckets again (created if NATS lost them) and follows the registry anew. */
  private reopen(): Promise<void> {
    const reopen = this.link.reopen;
    if (!reopen) return Promise.resolve();
    return this.inTurn(
      () => reopen().then(() => this.watch()),
      'cluster: the registry buckets could not be opened again',
    );
  }

  /**
   * Runs `step` then a heartbeat, once at a time ({@link rewatch} and {@link reopen} share the turn); a failure is
   * logged as `failed`.
   */
  private inTurn(step: () => Promise<void>, failed: string): Promise<void> {
    if (this.closed) return Promise.resolve();
    this.reopening ??= step()
      .then(() => this.publish())
      .catch((e: Error) => this.log.warn({ err: e.message }, failed))
      .finally(() => (this.reopening = null));
    return this.reopening;
  }

  /**
   * Starts serving: refuses a node name another live process holds, subscribes to this node's
   * subjects and publishes heartbeats.
   * @param url this node's HTTP URL (published for clients and `/v1/cluster`).
   * @throws VoxError `node_name_taken` naming the other process's URL.
   */
  async attach(supervisor: Supervisor, url: string): Promise<void> {
    await this.nodeName.claim();
    this.supervisor = supervisor;
    this.url = url;
    this.metrics = clusterMetrics(supervisor.metrics.registry);
    this.metrics.nats.set(this.connected ? 1 : 0);
    this.serving.subscribe();
    await this.link.nc.flush();
    await this.publish();
    this.log.info(
      { nats: redact(this.settings.nats, this.settings), heartbeat_ms: this.settings.heartbeat_ms },
      'cluster: joined',
    );
  }

  /** Publishes a heartbeat soon (after a model's state changed). */
  beat(): void {
    if (this.supervisor && !this.closed) this.membership.send({ type: 'BEAT' });
  }

  /** This node's registry entry now. */
  record(): NodeRecord {
    const sup = this.supervisor!;
    return {
      node: this.name,
      url: this.url,
      at: Date.now(),
      heartbeat_ms: this.settings.heartbeat_ms,
      free_bytes: this.options.memoryProbe(),
      draining: this.draining || (sup.phase !== 'starting' && sup.phase !== 'running'), // a starting node is not draining
      max_loaded_models: this.config.max_loaded_models,
      min_free_memory_mb: this.config.min_free_memory_mb,
      models: heldModels(this),
      session: `${this.nodeName.boot}.${this.membership.getSnapshot().context.reconnects}`,
      ...this.autoscaler.report(),
    };
  }

  /**
   * Writes this node's registry entry (the membership chart's `publish`; a compare-and-set, {@link NodeName.write});
   * a lost bucket is created again; a name another process took is given up ({@link yieldName}).
   */
  async publish(): Promise<void> {
    if (!this.supervisor || this.closed || !this.connected || this.nodeName.lost) return;
    this.autoscaler.heard();
    const failed = await this.nodeName.write(encodeJson({ ...this.record(), seq: ++this.written }));
    // A registry watch whose consumer went with a NATS server hears nothing, not even this node's heartbeats: made anew.
    const heard = Math.max(this.watchedAt, this.membership.getSnapshot().context.view.get(this.name)?.seen ?? 0);
    if (!failed && Date.now() - heard > 3 * this.settings.heartbeat_ms && !this.reopening) {
      this.log.warn({ silent_ms: Date.now() - heard }, 'cluster: the registry watch is silent; made again');
      void this.rewatch();
    }
    if (!failed) return void this.locks.sweep();
    if (failed.taken) return this.yieldName(failed.taken);
    this.log.debug({ err: failed.error.message }, 'cluster: heartbeat not written');
    if (this.connected && !this.reopening) void this.reopen();
  }

  /**
   * Gives the node's name up to the process that took it: stops serving this name's subjects and writing its entry (the
   * entry is the other's now: {@link close} leaves it), then tells {@link onNameLost} (the CLI exits 1).
   */
  private yieldName(error: VoxError): void {
    if (this.nodeName.lost) return;
    this.nodeName.lost = true;
    this.log.error({ err: error.message }, 'cluster: node name taken over, leaving the cluster');
    for (const s of this.subs.splice(0)) s.unsubscribe();
    this.onNameLost(error);
  }

  /**
   * Whether this node's entry for `id` runs on a remote pool now (the model chart says: {@link
   * ModelEntry.runsRemotely}).
   */
  runsRemotely(id: string): boolean {
    return this.supervisor?.registered(id)?.runsRemotely === true;
  }

  /** The config another node registered `id` with, from its heartbeat (a model loaded there by name), or undefined. */
  readonly registeredElsewhere = (id: string): Record<string, unknown> | undefined => {
    for (const r of this.nodes())
      if (r.node !== this.name && r.models[id]?.registration) return r.models[id].registration;
    return undefined;
  };

  /** Live nodes: heard of within 3 of their heartbeats, and not taken for gone since. */
  nodes(now = Date.now()): NodeRecord[] {
    return liveNodes(this.membership.getSnapshot().context, now);
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

  /** The model's busy timeout here (the model chart's {@link busyTimeoutOf}: min(its own, the server's)), ms; 0 = none. */
  busyTimeout(config: ModelConfig): number {
    return busyTimeoutOf({ config, serverBusyTimeoutMs: this.config.busy_timeout_ms });
  }

  /**
   * The fields another node needs to register a model it does not know (its config minus server-filled paths of a
   * group's heads).
   */
  registrationOf(config: ModelConfig): Record<string, unknown> {
    return {
      ...config,
      heads: config.heads?.map((h) =>
        typeof h === 'string' ? h : { model: h.model, threshold: h.threshold, refractory_ms: h.refractory_ms },
      ),
    };
  }

  /** The model entry's `place` hook (cluster/placement.ts). */
  get place(): Placement['place'] {
    return this.placement.place;
  }

  /** A request to another node's subject (cluster/manage.ts {@link ask}). */
  ask<T>(node: string, what: 'info' | 'load' | 'unload', body: unknown, ms: number, signal?: AbortSignal): Promise<T> {
    return ask<T>(this, node, what, body, ms, signal);
  }

  /** Loads (or reconfigures) `id` on this node with a local pool (cluster/serve.ts). */
  loadHere(
    id: string,
    fields: Record<string, unknown>,
    registration?: Record<string, unknown>,
  ): ReturnType<Serving['loadHere']> {
    return this.serving.loadHere(id, fields, registration);
  }

  /** `POST /v1/models/load` in a cluster (cluster/manage.ts). */
  manageLoad(
    body: Record<string, unknown>,
    validate: (fields: Record<string, unknown>) => ModelConfig,
  ): Promise<Record<string, unknown>> {
    return manageLoad(this, body, validate);
  }

  /** Unload in a cluster (cluster/manage.ts). */
  manageUnload(ids: string[] | undefined, node: unknown, force = false): ReturnType<typeof manageUnload> {
    return manageUnload(this, ids, node, force);
  }

  /** `GET /v1/cluster`: this node, NATS, and every live node with its free memory, models and draining flag. */
  status(): Record<string, unknown> {
    const now = Date.now();
    const view = this.membership.getSnapshot().context.view;
    const live = new Map(this.nodes(now).map((r) => [r.node, r]));
    if (this.supervisor) live.set(this.name, this.record());
    return {
      node: this.name,
      nats: { ...natsSide(this.link, this.settings), connected: this.connected },
      heartbeat_ms: this.settings.heartbeat_ms,
      nodes: [...live.values()]
        .sort((a, b) => a.node.localeCompare(b.node))
        .map((r) => ({
          node: r.node,
          url: r.url,
          free_bytes: r.free_bytes,
          draining: r.draining,
          last_seen_ms: now - (view.get(r.node)?.seen ?? now),
          models: Object.keys(r.models).sort(),
          max_loaded_models: r.max_loaded_models,
        })),
    };
  }

  /** Per model id, the live nodes holding it and their figures (for `GET /v1/models`). */
  holdersByModel(): Map<string, ({ node: string } & HeldModel)[]> {
    return holdersByModel(this);
  }

  /**
   * Marks this node draining at once (others stop sending it work, placements skip it) and hands
   * over the models only it holds that other nodes used in the last minute (cluster/manage.ts).
   */
  drain(): void {
    if (this.draining) return;
    this.draining = true;
    this.autoscaler.stop();
    void this.publish();
    if (this.supervisor && this.connected) this.handover = handOver(this);
  }

  /** Resolves once the hand-over begun at {@link drain} is done or gave up (bounded by the drain deadline). */
  handedOver(): Promise<void> {
    return this.handover;
  }

  /** Leaves the cluster: stops the heartbeat, removes this node's entry, closes the connection. */
  async close(): Promise<void> {
    if (this.closed) return;
    this.autoscaler.stop();
    try {
      if (this.connected && this.supervisor) {
        const bound = 3 * this.settings.heartbeat_ms;
        await withDeadline(this.locks.releaseAll(), bound).catch(() => (this.locks.gaveUp = true));
        // A name another process took is its entry now: left as it is.
        if (!this.nodeName.lost) await withDeadline(this.link.nodes.delete(nodeKey(this.name)), bound).catch(() => {});
      }
    } finally {
      this.closed = true;
      this.membership.send({ type: 'CLOSE' });
      this.stopWatch?.();
      // Jobs still waiting for a holder's reply end (their requests get 503 shutting_down).
      this.jobs.close();
      for (const s of this.subs) s.unsubscribe();
      await this.link.nc.close().catch(() => {});
    }
  }
}
