/**
 * The models in the registry (docs/cluster.md "Status"): what a node reports of the models it holds
 * in its heartbeat, and the cluster's view of them per model for `GET /v1/models` and `/debug`.
 */
import { fingerprint, type HeldModel } from './membership.js';
import type { ClusterNode } from './node.js';

/**
 * This node's entry's `models`: each it holds (loading, ready, unloading, reconfiguring) with its
 * figures; a model held behind a remote pool with its backing pool's (the jobs of its ingress and
 * of other nodes, for the holder picks of other ingresses). Unloaded models, models run on a remote
 * pool only, and placements under way are left out.
 */
export function heldModels(n: ClusterNode): Record<string, HeldModel> {
  const sup = n.supervisor!;
  const models: Record<string, HeldModel> = {};
  for (const id of sup.registeredIds) {
    const entry = sup.registered(id)!;
    const s = entry.figures();
    const backed = s.state === 'ready' ? n.backing.get(s.id) : undefined;
    if (!backed && (s.state === 'unloaded' || n.runsRemotely(s.id) || n.placement.placesOnly(s.id, s.state))) continue;
    const registration = n.registrationOf(entry.config);
    const pool = backed?.pool;
    models[s.id] = {
      task: s.task,
      state: s.state,
      slots: pool ? pool.slots.length : s.slots,
      free_slots: Math.max(0, pool ? pool.slots.length - pool.activeSlots : s.slots - s.active_slots),
      busy_ms: pool ? pool.busyMs() : entry.busyMs(),
      queued: pool ? pool.queued : s.queued_requests,
      active_leases: pool ? pool.inFlight : s.active_leases,
      resident_bytes: backed ? backed.residentBytes : s.resident_bytes,
      config: fingerprint(registration),
      registration,
    };
  }
  return models;
}

/** Per model id, the live nodes holding it (this one as of now) and their figures, by node name. */
export function holdersByModel(n: ClusterNode): Map<string, ({ node: string } & HeldModel)[]> {
  const out = new Map<string, ({ node: string } & HeldModel)[]>();
  const live = new Map(n.nodes().map((r) => [r.node, r]));
  if (n.supervisor) live.set(n.name, n.record());
  for (const r of [...live.values()].sort((a, b) => a.node.localeCompare(b.node))) {
    for (const [id, { registration: _, ...m }] of Object.entries(r.models)) {
      if (!out.has(id)) out.set(id, []);
      out.get(id)!.push({ node: r.node, ...m });
    }
  }
  return out;
}
