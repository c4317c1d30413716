/**
 * Management across the cluster (docs/cluster.md "Managing models"): `POST /v1/models/load` with
 * `node` or `replicas`, cluster-wide unloads, and the hand-over of a draining node's models.
 */
import type { ModelConfig } from '../runtime/config.js';
import { invalid, toVoxError, VoxError, voxError } from '../runtime/errors.js';
import type { LoadLock } from './locks.js';
import { nextChange, until } from './membership.js';
import { encodeJson } from './nats.js';
import { decodeMessage, type RemoteReply, replyError } from './wire.js';
import type { ClusterNode } from './node.js';
import { withDeadline } from './remote.js';

/** A 503 (busy, insufficient memory, shutting down): a node refused, and the next may be asked. */
export const is503 = (e: unknown): boolean => e instanceof VoxError && e.status === 503;

/**
 * How long a node asked to load or unload a model may take to answer, ms: what it may wait for the
 * model's requests (the server's busy timeout; a single node's unload waits as long), plus `loadMs`
 * for a load (its load timeout), plus 3 heartbeats and 1 s (closing slot hosts, transit). Past it
 * the request or its answer is taken for lost in transit (core NATS delivers at most once): the
 * call answers 503 `node_unreachable`. A wait configured unbounded (0) is capped at an hour.
 */
export function answerWithin(n: ClusterNode, loadMs?: number): number {
  const waits = [n.config.busy_timeout_ms, ...(loadMs === undefined ? [] : [loadMs])];
  if (waits.includes(0)) return 3_600_000;
  return waits.reduce((a, b) => a + b, 0) + 3 * n.settings.heartbeat_ms + 1_000;
}

/** What a node answers a cluster unload with. */
type Unloaded = { unloaded: string[]; not_found: string[]; busy?: string[] };

/**
 * `POST /v1/models/load` in a cluster. With `node`: that node loads it (this one, or another over
 * NATS). Else `replicas` (default 1) nodes must hold it: nodes already holding it are reconfigured
 * with the fields given; missing replicas are placed on the nodes with the most free memory that do
 * not hold it (each by its own guards).
 * @throws VoxError `invalid_request_error` (bad `node` or `replicas`, or the config: nothing is
 *   changed anywhere), `not_found` (unknown node), 503 when no node could load it.
 */
export async function manageLoad(
  n: ClusterNode,
  body: Record<string, unknown>,
  validate: (fields: Record<string, unknown>) => ModelConfig,
): Promise<Record<string, unknown>> {
  const { node, replicas, ...fields } = body;
  if (node !== undefined && (typeof node !== 'string' || !node))
    throw invalid('node', 'must be a node name (GET /v1/cluster lists them)');
  if (replicas !== undefined && (!Number.isInteger(replicas) || (replicas as number) < 1 || (replicas as number) > 64))
    throw invalid('replicas', 'must be an integer from 1 to 64');
  if (node !== undefined && replicas !== undefined)
    throw invalid('replicas', 'give either node (that node loads it) or replicas (that many nodes hold it), not both');
  if (typeof fields.id !== 'string' || !fields.id) throw invalid('id', 'required, a model id string');
  const id = fields.id;
  // Validated here first: an invalid config changes nothing on any node.
  const config = validate(fields);
  const registration = n.registrationOf(config);
  const loadOn = async (at: string): Promise<void> => {
    if (at === n.name) await n.serving.loadHere(id, fields, registration);
    else
      await n.ask(
        at,
        'load',
        { id, fields, config: registration },
        answerWithin(n, config.load_timeout_ms ?? n.config.load_timeout_ms),
      );
  };
  const ready = (at: string[]): Promise<boolean> =>
    until(
      n.membership,
      () => at.every((a) => n.nodes().some((r) => r.node === a && r.models[id]?.state === 'ready')),
      3 * n.settings.heartbeat_ms,
    );
  if (node !== undefined) {
    if (node === n.name) return { ...(await n.serving.loadHere(id, fields, registration)), nodes: [node] };
    if (!n.nodes().some((r) => r.node === node)) throw voxError('node_not_found', { node });
    await loadOn(node as string);
    await ready([node as string]);
    return { id, loaded: true, reconfigured: false, nodes: [node] };
  }
  const want = (replicas as number | undefined) ?? 1;
  const holding = n
    .nodes()
    .filter((r) => !r.draining && r.models[id] && r.models[id].state !== 'unloading')
    .map((r) => r.node);
  const done: string[] = [];
  const refusals: string[] = [];
  // Already held: reconfigured where fields change, else nothing happens there.
  for (const at of holding.slice(0, want)) {
    await loadOn(at);
    done.push(at);
  }
  const others = n
    .nodes()
    .filter((r) => !r.draining && !done.includes(r.node))
    .sort((a, b) => b.free_bytes - a.free_bytes);
  for (const r of others) {
    if (done.length >= want) break;
    try {
      await loadOn(r.node);
      done.push(r.node);
    } catch (e) {
      if (!is503(e)) throw e;
      refusals.push(`${r.node}: ${(e as Error).message}`);
    }
  }
  if (done.length === 0) throw voxError('cluster_insufficient_memory', { id, why: `: ${refusals.join('; ')}` });
  await ready(done);
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
 * Cluster-wide, first the nodes that run the models on remote pools or are placing them, each
 * waiting for its own requests on them (as a single node's unload waits for its running
 * requests); then the holders. A model still in use somewhere after the busy timeout stays
 * loaded everywhere (`unload_timeout`), as on a single node.
 * @returns per node what it unloaded; `unloaded` / `not_found` merged.
 * @throws VoxError `invalid_request_error` (bad `node`), `not_found` (unknown node), `unload_timeout`.
 */
export async function manageUnload(
  n: ClusterNode,
  ids: string[] | undefined,
  node: unknown,
  force = false,
): Promise<{ unloaded: string[]; not_found: string[]; nodes: Record<string, unknown> }> {
  if (node !== undefined && (typeof node !== 'string' || !node))
    throw invalid('node', 'must be a node name (GET /v1/cluster lists them)');
  const targets = node !== undefined ? [node as string] : [...new Set([n.name, ...n.nodes().map((r) => r.node)])];
  if (node !== undefined && node !== n.name && !n.nodes().some((r) => r.node === node))
    throw voxError('node_not_found', { node });
  const per: Record<string, unknown> = {};
  const unloaded = new Set<string>();
  let notFound: Set<string> | null = null;
  const onEvery = async (
    body: { remote_only?: boolean; except?: string[] },
    each: (at: string, r: Unloaded | VoxError) => void,
  ): Promise<void> => {
    await Promise.all(
      targets.map(async (at) => {
        try {
          each(
            at,
            at === n.name
              ? await n.serving.unloadHere(ids, force, body.remote_only, body.except)
              : await n.ask<Unloaded>(at, 'unload', { ids, force, ...body }, answerWithin(n)),
          );
        } catch (e) {
          each(at, toVoxError(e));
        }
      }),
    );
  };
  const blocked = new Set<string>();
  /** Nodes that did not answer, or answered an error, with it (the last phase's, when both failed). */
  const failures = new Map<string, VoxError>();
  if (node === undefined) {
    await onEvery({ remote_only: true }, (at, r) => {
      if (r instanceof VoxError) {
        per[at] = { error: r.message };
        failures.set(at, r);
      } else for (const id of r.busy ?? []) blocked.add(id);
    });
  }
  await onEvery({ except: [...blocked] }, (at, r) => {
    if (r instanceof VoxError) {
      per[at] = { error: r.message };
      failures.set(at, r);
      return;
    }
    per[at] = r;
    failures.delete(at);
    for (const id of r.unloaded) unloaded.add(id);
    const nf = new Set(r.not_found);
    notFound = notFound ? new Set([...notFound].filter((id) => nf.has(id))) : nf;
  });
  if (blocked.size) throw voxError('unload_timeout', { busy: [...blocked], unloaded: [...unloaded] });
  // A node that did not answer may still hold the models: the unload is not done there (503, retry).
  const [failedAt, error] = [...failures][0] ?? [];
  if (failedAt && error)
    throw error.code === 'node_unreachable'
      ? error
      : voxError('node_unreachable', { node: failedAt, reason: error.message });
  return { unloaded: [...unloaded], not_found: [...(notFound ?? [])].filter((id) => !unloaded.has(id)), nodes: per };
}

/**
 * A draining node's hand-over: the models only it holds that other nodes used in the last minute
 * are each placed on another live node (by most free memory; an ingress running one on a remote
 * pool loads it behind that pool), so their jobs move there before this node unloads. Bounded by
 * the drain deadline; resolves once the other nodes have had a heartbeat to hear of the new holders.
 */
export async function handOver(n: ClusterNode): Promise<void> {
  const sup = n.supervisor!;
  const bound = n.config.drain_timeout_ms || n.config.busy_timeout_ms || 60_000;
  const end = Date.now() + bound;
  const used = (id: string): boolean => Date.now() - (n.serving.lastServed.get(id) ?? -Infinity) < 60_000;
  // Every wait within the deadline, the lock's take and release too: with NATS gone (stopped with the node), each
  // waits out its request's timeout, and the node exited seconds past `drain_timeout_ms`. A lock left so stands
  // until the node's leaving releases it, or until it expires.
  const left = (): number => Math.max(1, end - Date.now());
  const take = (id: string): Promise<LoadLock | null> => withDeadline(n.locks.take(id), left()).catch(() => null);
  const sole = sup
    .statuses()
    .filter((m) => m.state === 'ready' && (!n.runsRemotely(m.id) || n.backing.has(m.id)) && used(m.id))
    .map((m) => m.id)
    .filter((id) => !n.nodes().some((r) => r.node !== n.name && !r.draining && r.models[id]?.state === 'ready'));
  const moved: string[] = [];
  const to = new Set<string>();
  await Promise.all(
    sole.map(async (id) => {
      const config = sup.configOf(id);
      if (!config) return;
      // A placement of this node gives its lock back just after it answers (cluster/placement.ts),
      // another node's may hold it a moment: taken at a later change of membership, in the deadline.
      let lock = await take(id);
      while (!lock && Date.now() < end) {
        await nextChange(n.membership, Math.min(n.settings.heartbeat_ms, end - Date.now()));
        lock = await take(id);
      }
      if (!lock) return;
      try {
        // Placed on another node meanwhile.
        if (n.nodes().some((r) => r.node !== n.name && !r.draining && r.models[id]?.state === 'ready')) return;
        for (const r of n
          .nodes()
          .filter((r) => r.node !== n.name && !r.draining)
          .sort((a, b) => b.free_bytes - a.free_bytes)) {
          if (Date.now() >= end) return;
          try {
            n.log.info({ model: id, on: r.node }, 'cluster: draining; handing the model over');
            await n.ask(r.node, 'load', { id, config: n.registrationOf(config), adopt: true, lock: lock.ref }, left());
            if (await until(n.membership, () => n.holders(id).some((h) => h.node === r.node), end - Date.now())) {
              moved.push(id);
              to.add(r.node);
              return;
            }
          } catch (e) {
            n.log.info({ model: id, on: r.node, why: (e as Error).message }, 'cluster: hand-over refused');
          }
        }
      } finally {
        await withDeadline(lock.release(), left()).catch(() => {});
      }
    }),
  );
  // The other ingresses hear of the new holders at their heartbeat: this node waits until it has
  // heard the next heartbeat of each (the others hear it at the same time), within the deadline.
  const heard = new Map([...to].map((h) => [h, n.membership.getSnapshot().context.view.get(h)]));
  await until(
    n.membership,
    () => [...heard].every(([h, before]) => n.membership.getSnapshot().context.view.get(h) !== before),
    Math.max(0, Math.min(3 * n.settings.heartbeat_ms, end - Date.now())),
  );
  n.log.info({ moved, sole }, 'cluster: hand-over done');
}

/**
 * Sends a request to a node's subject and decodes its answer. Its answer is not waited for once
 * the node is no longer live; the request is sent again when this node's NATS connection comes
 * back, and when the node's heartbeat shows that its own came back since the request was sent
 * ({@link NodeRecord.session}): the request or its answer may have been lost with the connection.
 * It is sent again too after 3 heartbeats without an answer from a live node (core NATS delivers at
 * most once: a message may be lost in transit); the first answer to any copy counts (a node serves a
 * load or unload copy from the one it is serving, cluster/serve.ts). Nobody answers for it past
 * `timeoutMs` from the first copy, or once `signal` is aborted: `node_unreachable`.
 * @throws VoxError the node's error (with its type), `node_unreachable` when nobody answers for it.
 */
export async function ask<T>(
  n: ClusterNode,
  node: string,
  what: 'info' | 'load' | 'unload',
  body: unknown,
  timeoutMs: number,
  signal?: AbortSignal,
): Promise<T> {
  let data: Uint8Array;
  const end = Date.now() + timeoutMs;
  const silence = 3 * n.settings.heartbeat_ms;
  try {
    let sent = '';
    let sentAt = 0;
    let reply: Promise<{ data: Uint8Array }> | null = null;
    for (;;) {
      const ctx = n.membership.getSnapshot().context;
      const session = `${ctx.reconnects}/${ctx.view.get(node)?.record.session}`;
      const silent = reply !== null && Date.now() - sentAt >= silence;
      if (sent !== session || silent) {
        if (sent !== session && sent)
          n.log.info({ on: node, what }, 'cluster: a NATS connection came back; the request is sent again');
        else if (silent)
          n.log.info({ on: node, what }, 'cluster: no answer for 3 heartbeats; the request is sent again');
        const copy = n.link.nc.request(n.subject(node, what), encodeJson(body), {
          timeout: Math.max(1, end - Date.now()),
        });
        // A copy lost with a connection never answers; one lost in transit may still: either counts.
        reply = sent !== session || !reply ? copy : firstOf(reply, copy);
        sent = session;
        sentAt = Date.now();
      }
      const r = await Promise.race([reply, nextChange(n.membership, n.settings.heartbeat_ms).then(() => null)]);
      if (r) {
        data = r.data;
        break;
      }
      if (n.closed) throw new Error('this node is stopping');
      if (signal?.aborted) throw new Error(String(signal.reason));
      if (n.connected && !n.nodes().some((r) => r.node === node))
        throw new Error('it left the cluster (no heartbeat heard)');
    }
  } catch (e) {
    throw voxError('node_unreachable', { node, reason: (e as Error).message, cause: e });
  }
  if (what === 'unload') {
    const text = new TextDecoder().decode(data);
    if (text.startsWith('{')) return JSON.parse(text) as T;
  }
  const r = decodeMessage<RemoteReply>(data);
  if (r.type === 'error') throw replyError(node, r);
  return r as T;
}

/** The first answer of two copies of a request; once both failed, the later copy's error. */
const firstOf = <T>(a: Promise<T>, b: Promise<T>): Promise<T> =>
  Promise.any([a, b]).catch((e: AggregateError) => Promise.reject(e.errors[1]));
