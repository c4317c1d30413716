/**
 * Replicas that follow load (docs/cluster.md "Replicas that follow load"): for each model with an
 * `autoscale` config, every node serving it reports its wait in its heartbeat ({@link report});
 * the live holder with the lowest name decides, running the model's scaler chart
 * (cluster/autoscale-chart.ts) fed at each heartbeat heard. Its steps: one more replica placed
 * under the model's cold-load lock on the node with the most free memory that does not hold it;
 * one replica drained and unloaded (the jobs on it answered `not_held` and sent again to another
 * holder by the ingress: nothing lost).
 */
import { type Actor, createActor, fromPromise } from 'xstate';
import type { Autoscale } from '../runtime/config.js';
import { voxError } from '../runtime/errors.js';
import { answerWithin, is503 } from './manage.js';
import { until, type NodeRecord } from './membership.js';
import { type ReplicaChange, type ScaleSample, scalerMachine } from './autoscale-chart.js';
import type { ClusterNode } from './node.js';

/** The window of stream lags a node's reported wait is the p95 of, ms. */
export const WAIT_WINDOW_MS = 2_000;

/** What a node reports in its heartbeat for an autoscaled model it serves (held here or on a remote pool). */
export interface AutoscaleReport {
  /** The higher of the oldest queued request's wait and the stream lag p95 of the last {@link WAIT_WINDOW_MS}, ms. */
  wait_ms: number;
  /** The last change of the replicas this node decided, when it decides for the model. */
  last_change?: ReplicaChange;
}

type Scaler = Actor<typeof scalerMachine>;

/** The scalers of the autoscaled models this node decides for, and the reports for its heartbeat. */
export class Autoscaler {
  private readonly scalers = new Map<string, Scaler>();
  /** The last change decided here per model, kept when this node stops deciding (shown until a newer one). */
  private readonly changes = new Map<string, ReplicaChange>();
  /** Per model decided here, the holders' busy slots averaged over the heartbeats. */
  private readonly busy = new Map<string, number>();
  /** Per model and holder (`<model>\n<node>`), its last record's `at` and `busy_ms` heard, and the busy slots since the one before. */
  private readonly busyRead = new Map<string, { at: number; busy_ms: number; rate: number }>();

  constructor(private readonly n: ClusterNode) {}

  /**
   * This node's heartbeat's `autoscale`: per autoscaled model it serves ready, its wait and, when it
   * decides, its last change; `{}` (no field) when it serves none.
   */
  report(): { autoscale?: Record<string, AutoscaleReport> } {
    const sup = this.n.supervisor;
    const out: Record<string, AutoscaleReport> = {};
    if (!sup) return {};
    for (const id of sup.registeredIds) {
      const entry = sup.registered(id)!;
      if (entry.state !== 'ready' || !entry.config.autoscale) continue;
      const change = this.scalers.get(id)?.getSnapshot().context.last_change ?? this.changes.get(id);
      out[id] = {
        wait_ms: Math.round(entry.recentWaitMs(WAIT_WINDOW_MS)),
        ...(change ? { last_change: change } : {}),
      };
    }
    return Object.keys(out).length ? { autoscale: out } : {};
  }

  /**
   * At each heartbeat heard: for each autoscaled model this node holds, starts its scaler when this
   * node is the live holder with the lowest name (stops it otherwise) and feeds it the sample.
   */
  heard(): void {
    const n = this.n;
    const sup = n.supervisor;
    if (!sup || n.closed || n.draining) return this.stop();
    // This node's own figures as of now (its entry in the view is as of its last heartbeat).
    const nodes = [...n.nodes().filter((r) => r.node !== n.name), n.record()];
    for (const id of new Set([...this.scalers.keys(), ...sup.registeredIds])) {
      const autoscale = sup.configOf(id)?.autoscale;
      const holders = replicasOf(nodes, id);
      // The lowest-named holder decides, also when it holds the model behind its remote pool (an ingress the scaler
      // placed a replica on): left out, no node decided once that replica came, and the replicas never went down.
      const decides = autoscale && holders[0]?.node === n.name;
      // The latest change any node reported is kept: shown when its node has gone, and not logged again here.
      const last = this.lastChange(id);
      if (last) this.changes.set(id, last);
      let scaler = this.scalers.get(id);
      if (!decides || !autoscale) {
        // A step under way finishes first (its change recorded and reported): stopped mid-step, a replica placed was
        // never recorded when the node it went to took the decisions over.
        if (scaler && !scaler.getSnapshot().matches('scalingUp') && !scaler.getSnapshot().matches('scalingDown'))
          this.stopOne(id);
        continue;
      }
      if (!scaler) {
        scaler = this.start(id, autoscale);
      }
      // Busy slots: each holder's average over its last heartbeat interval (its `busy_ms` grown, over the time
      // between), not an instant's (which catches a short job by chance: a light stream's one job in a heartbeat read
      // as a busy slot, and reset the count to a scale-down), then averaged over the heartbeats (each weighing 0.3).
      const sample = sampleOf(nodes, id);
      const now = holders.reduce((k, r) => k + this.busyOf(id, r), 0);
      const busy = 0.7 * (this.busy.get(id) ?? now) + 0.3 * now;
      this.busy.set(id, busy);
      scaler.send({ type: 'SAMPLE', ...sample, busy_slots: Math.round(busy * 100) / 100 });
    }
  }

  /**
   * Holder `r`'s slots of `id` busy on average between its last two records heard (ms of `busy_ms` per ms of `at`,
   * at most its slots); the instant's busy slots until two are heard, or when its pool started again.
   */
  private busyOf(id: string, r: NodeRecord): number {
    const m = r.models[id];
    const key = `${id}\n${r.node}`;
    const seen = this.busyRead.get(key);
    if (m.busy_ms === undefined) return m.slots - m.free_slots;
    if (!seen || r.at > seen.at) {
      const rate =
        seen && m.busy_ms >= seen.busy_ms ? (m.busy_ms - seen.busy_ms) / (r.at - seen.at) : m.slots - m.free_slots;
      this.busyRead.set(key, { at: r.at, busy_ms: m.busy_ms, rate: Math.min(m.slots, Math.max(0, rate)) });
    }
    return this.busyRead.get(key)!.rate;
  }

  /** The latest change of `id`'s replicas any live node reports, or null. */
  lastChange(id: string): ReplicaChange | null {
    let last: ReplicaChange | null = this.changes.get(id) ?? null;
    for (const r of this.n.nodes()) {
      const c = r.autoscale?.[id]?.last_change;
      if (c && (!last || c.at > last.at)) last = c;
    }
    const here = this.scalers.get(id)?.getSnapshot().context.last_change;
    return here && (!last || here.at >= last.at) ? here : last;
  }

  /**
   * `GET /v1/models`'s `autoscale` of a model: its replicas (live nodes holding it ready), the
   * highest wait the nodes report (ms, as of their last heartbeats) and the last change; undefined when the model is not autoscaled (here, nor by any node's report).
   */
  status(id: string): { replicas: number; wait_ms: number; last_change: ReplicaChange | null } | undefined {
    const nodes = this.n.nodes();
    if (!this.n.supervisor?.configOf(id)?.autoscale && !nodes.some((r) => r.autoscale?.[id])) return undefined;
    const { replicas, wait_ms } = sampleOf(nodes, id);
    return { replicas, wait_ms, last_change: this.lastChange(id) };
  }

  /** Stops every scaler (the node drains or leaves). */
  stop(): void {
    for (const id of [...this.scalers.keys()]) this.stopOne(id);
  }

  private stopOne(id: string): void {
    const scaler = this.scalers.get(id)!;
    const change = scaler.getSnapshot().context.last_change;
    if (change) this.changes.set(id, change);
    scaler.stop();
    this.scalers.delete(id);
    this.busy.delete(id);
    for (const key of this.busyRead.keys()) if (key.startsWith(`${id}\n`)) this.busyRead.delete(key);
  }

  private start(id: string, autoscale: Autoscale): Scaler {
    const n = this.n;
    const scaler = createActor(
      scalerMachine.provide({
        actors: {
          addReplica: fromPromise(({ input }) => this.addReplica(input.id)),
          removeReplica: fromPromise(({ input }) => this.removeReplica(input.id)),
        },
        actions: {
          failed: (_, { error }) =>
            n.log.info(
              { model: id, err: (error as Error).message },
              'cluster: autoscale step failed; tried again later',
            ),
        },
      }),
      { input: { id, autoscale, last_change: this.lastChange(id) }, inspect: n.options.inspect },
    );
    scaler.subscribe({ error: (e) => n.log.error({ model: id, err: (e as Error).message }, 'cluster: scaler failed') });
    // Only the changes this scaler makes are logged: not the one it starts from (another node's, or this node's before
    // it stopped deciding), nor a newer one heard meanwhile (compared with `changes`, which heard() keeps up to date,
    // its own start would be logged again at each heartbeat, each log a heartbeat more: a breaker saw 30 a second).
    let own = scaler.getSnapshot().context.last_change;
    scaler.subscribe((s) => {
      const c = s.context.last_change;
      if (c && c !== own) {
        own = c;
        this.changes.set(id, c);
        n.log.info({ model: id, ...c }, 'cluster: autoscale changed the replicas');
        n.beat();
      }
    });
    this.scalers.set(id, scaler.start());
    return scaler;
  }

  /**
   * One more replica of `id`, under its cold-load lock: asked of the live nodes that do not hold it
   * by most free memory, those serving it on a remote pool last (it would run their jobs only).
   * @returns the node that loaded it.
   * @throws Error when the lock is held elsewhere (a placement under way) or every node refused.
   */
  private async addReplica(id: string): Promise<string> {
    const n = this.n;
    const config = n.supervisor!.configOf(id);
    if (!config) throw new Error(`${id} is no longer registered here`);
    const lock = await n.locks.take(id);
    if (!lock) throw new Error('its load lock is held by another node');
    const refused: string[] = [];
    try {
      const ingress = (r: NodeRecord): number => Number(r.autoscale?.[id] !== undefined);
      const candidates = n
        .nodes()
        .filter((r) => !r.draining && !r.models[id])
        .sort((a, b) => ingress(a) - ingress(b) || b.free_bytes - a.free_bytes);
      for (const r of candidates) {
        try {
          n.log.info({ model: id, on: r.node }, 'cluster: autoscale: placing one more replica');
          const loadMs = config.load_timeout_ms ?? n.config.load_timeout_ms;
          await n.ask(
            r.node,
            'load',
            { id, config: n.registrationOf(config), adopt: true, lock: lock.ref },
            answerWithin(n, loadMs),
          );
          await until(n.membership, () => n.holders(id).some((h) => h.node === r.node), 3 * n.settings.heartbeat_ms);
          return r.node;
        } catch (e) {
          if (!is503(e)) throw e;
          refused.push(`${r.node}: ${(e as Error).message}`);
        }
      }
      throw voxError('cluster_insufficient_memory', { id, why: `: ${refused.join('; ') || 'no other live node'}` });
    } finally {
      await lock.release();
    }
  }

  /**
   * Drains one replica of `id` other than this node's: the least loaded (queued requests and active
   * leases), under the model's cold-load lock; it unloads within the busy timeout.
   * @returns the node that held it.
   * @throws Error when the lock is held elsewhere, or the unload did not finish (`unload_timeout`).
   */
  private async removeReplica(id: string): Promise<string> {
    const n = this.n;
    const lock = await n.locks.take(id);
    if (!lock) throw new Error('its load lock is held by another node');
    try {
      const load = (r: NodeRecord): number => r.models[id].queued + r.models[id].active_leases;
      const victim = replicasOf(n.nodes(), id)
        .filter((r) => r.node !== n.name)
        .sort((a, b) => load(a) - load(b) || b.node.localeCompare(a.node))[0];
      if (!victim) throw new Error('no other replica to drain');
      n.log.info({ model: id, on: victim.node }, 'cluster: autoscale: draining one replica');
      const r = await n.ask<{ unloaded: string[] }>(victim.node, 'unload', { ids: [id] }, answerWithin(n));
      if (!r.unloaded.includes(id)) throw new Error(`${victim.node} did not unload ${id}`);
      return victim.node;
    } finally {
      await lock.release();
    }
  }
}

/** The live nodes holding `id` ready and not draining, by name. */
export function replicasOf(nodes: NodeRecord[], id: string): NodeRecord[] {
  return nodes
    .filter((r) => !r.draining && r.models[id]?.state === 'ready')
    .sort((a, b) => a.node.localeCompare(b.node));
}

/** The scaler's sample from the heartbeats heard: replicas, the highest reported wait, busy and all slots. */
export function sampleOf(nodes: NodeRecord[], id: string): ScaleSample {
  const holders = replicasOf(nodes, id);
  return {
    replicas: holders.length,
    wait_ms: Math.max(0, ...nodes.map((r) => r.autoscale?.[id]?.wait_ms ?? 0)),
    busy_slots: holders.reduce((k, r) => k + r.models[id].slots - r.models[id].free_slots, 0),
    slots: holders.reduce((k, r) => k + r.models[id].slots, 0),
  };
}
