/**
 * Placement of cold loads (docs/cluster.md "Placement"): the model entry's `place` hook. Here,
 * on the node with the most free memory, or on a remote pool when another node holds the model,
 * under the model's cold-load lock (cluster/locks.ts). Every wait is bounded by the model's busy
 * timeout and ends at once when the request that caused the load leaves.
 */
import type { ModelConfig } from '../runtime/config.js';
import { VoxError, voxError } from '../runtime/errors.js';
import type { LoadedModel } from '../runtime/loader.js';
import { superseded, type LoadLock, type LockRef } from './locks.js';
import { createActor, fromPromise, toPromise, waitFor } from 'xstate';
import { nextChange, until } from './membership.js';
import { placementMachine } from './placement-chart.js';
import { is503 } from './manage.js';
import { withDeadline } from './remote.js';
import type { ClusterNode } from './node.js';

/**
 * Placements of one node: its `place` hook, placing again when a model's holders went, adopting behind a remote pool.
 */
export class Placement {
  /** Models this node is placing now (a request waits for the placement): a cluster-wide unload waits for them. */
  readonly placing = new Set<string>();
  private readonly adopting = new Map<string, Promise<void>>();

  constructor(private readonly n: ClusterNode) {}

  /**
   * Whether a model this node lists as `state` is only being placed from here (its request waits
   * for the lock or a holder elsewhere): not listed in this node's heartbeat, where `loading` means
   * a load here (the next node to take the lock waits for it).
   */
  placesOnly(id: string, state: string): boolean {
    return state === 'loading' && this.placing.has(id);
  }

  /**
   * The model entry's `place` hook. Local when NATS is unreachable or this node was asked to hold
   * the model; a remote pool when another node holds it ready; else a placement under the model's
   * cluster lock: the live nodes by most free memory first, each deciding by its own guards
   * (memory, `max_loaded_models`, LRU eviction), this node through `local`. Bounded by the model's
   * busy timeout; `signal` (the load abandoned) ends it at once.
   * @throws VoxError `insufficient_memory` (503) naming the cluster when every node refused;
   *   `cluster_load_timeout` when no placement finished within the busy timeout.
   */
  readonly place = async (
    config: ModelConfig,
    signal: AbortSignal,
    local: () => Promise<LoadedModel>,
  ): Promise<LoadedModel> => {
    const n = this.n;
    const id = config.id;
    if (!n.connected || !n.supervisor) return local();
    signal.throwIfAborted();
    const timeout = n.busyTimeout(config);
    const end = timeout > 0 ? Date.now() + timeout : Infinity;
    const left = (): number => (end === Infinity ? 3_600_000 : Math.max(1, end - Date.now()));
    // Placing elsewhere until this node decides to load it itself (then it is a holder, not an ingress).
    this.placing.add(id);
    const here = (): Promise<LoadedModel> => {
      this.placing.delete(id);
      return local();
    };
    // Here as one candidate of a placement: still placing while it loads (its memory guard may
    // refuse, and the placement asks another node), a holder once loaded.
    const tryHere = async (): Promise<LoadedModel> => {
      const m = await local();
      this.placing.delete(id);
      return m;
    };
    const noHolder = (e: unknown): boolean => e instanceof VoxError && e.code === 'no_holder';
    const chart = placementMachine.provide({
      actors: {
        // Asked to hold it (by a placement elsewhere, or a load naming this node): the pin is for one
        // load (a retry after it failed takes the lock), its lock fenced. Or NATS lost: loaded here.
        loadHere: fromPromise(async () => {
          if (!n.pinned.has(id)) return here();
          const ref = n.pinned.get(id);
          n.pinned.delete(id);
          return this.fenced(id, here, ref);
        }),
        join: fromPromise(() => n.jobs.pool(config)),
        // A lock that comes after the step was stopped (the deadline passed) is given back. Under
        // the lock the registry is read afresh: a placement that just gave the lock back wrote its
        // holder there first, which this node's registry watch may not show yet; a node still
        // loading the model is waited for as a lock held (then joined), not loaded beside.
        lock: fromPromise(async ({ signal: stopped }) => {
          const lock = await n.locks.take(id);
          if (lock && !stopped.aborted) await n.refreshView();
          const loading = n.nodes().some((r) => r.node !== n.name && r.models[id]?.state === 'loading');
          if (!lock || (!stopped.aborted && !loading)) return lock;
          await lock.release();
          return null;
        }),
        place: fromPromise(async ({ input }) => {
          let written: Promise<unknown> = Promise.resolve();
          try {
            // A placement that finished just before the lock was ours.
            if (n.holders(id).length) return await n.jobs.pool(config);
            return await this.underLock(config, signal, tryHere, input.lock, (w) => (written = w));
          } finally {
            // Given back once this node's entry says it loads the model (underLock), not waited for:
            // NATS frozen now delays no answer (the lock is renewed till then, or expires).
            void written.catch(() => {}).then(() => input.lock.release());
          }
        }),
        // Split brain: this node was paused past the lock's expiry and another took it over and placed
        // the model. The other placement is heard of at its holder's next heartbeat; this node was
        // paused, so its registry watch may lag: the registry is read afresh first.
        settle: fromPromise(async () => {
          n.log.warn({ model: id }, 'cluster: the load lock was taken over while placing; using the other placement');
          await n.refreshView();
          await until(n.membership, () => n.holders(id).length > 0, Math.min(3 * n.settings.heartbeat_ms, left()));
        }),
        change: fromPromise(() => nextChange(n.membership, Math.min(n.settings.heartbeat_ms, left()))),
      },
      guards: {
        pinned: () => n.pinned.has(id),
        offline: () => !n.connected,
        held: () => n.holders(id).length > 0,
        retryHolders: ({ event }) =>
          noHolder((event as { error?: unknown }).error) && Date.now() < end && n.holders(id).length > 0,
        placeAnew: ({ event }) => noHolder((event as { error?: unknown }).error) && Date.now() < end,
      },
    });
    const actor = createActor(chart, { input: { id, end }, inspect: n.options.inspect });
    const abort = (): void => actor.send({ type: 'ABORT', reason: signal.reason });
    const offline = n.membership.subscribe((s) => s.matches('connected') || actor.send({ type: 'OFFLINE' }));
    try {
      const done = toPromise(actor.start());
      signal.addEventListener('abort', abort, { once: true });
      const output = await done;
      if (actor.getSnapshot().value === 'timedOut') throw voxError('cluster_load_timeout', { id, ms: timeout });
      if ('error' in output) throw output.error;
      return output.model;
    } finally {
      signal.removeEventListener('abort', abort);
      offline.unsubscribe();
      this.placing.delete(id);
    }
  };

  /**
   * Loads here (`local`) for a placement, which counts only if its load lock (`ref`, when the load
   * comes with one) is still the one it was taken with: else (another node took the lock over
   * meanwhile, so its placement is the one that counts) the load is closed before it is ever
   * registered, and this throws.
   * @throws the placement's error; VoxError `no_holder` (503) when the lock was taken over.
   */
  private async fenced(id: string, local: () => Promise<LoadedModel>, ref?: LockRef): Promise<LoadedModel> {
    const m = await local();
    if (ref && !(await this.n.locks.holds(ref))) {
      await m.close();
      this.n.log.warn({ model: id }, 'cluster: the load lock of this placement was taken over; the load is given up');
      // A refusal (503) to the placing node, which then finds the other placement.
      throw voxError('no_holder', { message: `${this.n.name} gave up loading ${id}: ${superseded(id).message}` });
    }
    return m;
  }

  private async underLock(
    config: ModelConfig,
    signal: AbortSignal,
    local: () => Promise<LoadedModel>,
    lock: LoadLock,
    wrote: (registry: Promise<void>) => void,
  ): Promise<LoadedModel> {
    const n = this.n;
    const id = config.id;
    const here = n.record();
    const candidates = [here, ...n.nodes().filter((r) => r.node !== n.name && !r.draining)].sort(
      (a, b) => b.free_bytes - a.free_bytes,
    );
    n.log.debug({ model: id, candidates: candidates.map((c) => [c.node, c.free_bytes]) }, 'cluster: placing');
    const refusals: string[] = [];
    let memory = true;
    for (const c of candidates) {
      signal.throwIfAborted();
      if (c.node === n.name) {
        try {
          n.log.info({ model: id, free_bytes: c.free_bytes }, 'cluster: placing here');
          const m = await local();
          // Compare-and-set on the lock before the load counts (split brain: see fenced()); then
          // this node written as loading it before the lock is given back (the next node to take
          // the lock finds it).
          if (await lock.held()) {
            wrote(n.publish());
            return m;
          }
          await m.close();
          throw superseded(id);
        } catch (e) {
          if (!is503(e)) throw e;
          memory &&= (e as VoxError).type === 'insufficient_memory';
          refusals.push(`${c.node}: ${(e as Error).message}`);
          n.log.info({ model: id, on: c.node, why: (e as Error).message }, 'cluster: this node refused the load');
          continue;
        }
      }
      // NATS lost: no other node can be asked (this one is, in its turn), and one asked is not waited for.
      if (!n.connected) continue;
      n.log.info({ model: id, on: c.node, free_bytes: c.free_bytes }, 'cluster: placing on another node');
      lock.lent = c.node;
      const asking = new AbortController();
      waitFor(n.membership, (s) => !s.matches('connected'), { timeout: Infinity, signal: asking.signal }).then(
        () => asking.abort('this node lost NATS'),
        () => {},
      );
      const reply = await n
        .ask(
          c.node,
          'load',
          { id, config: n.registrationOf(config), lock: lock.ref },
          n.settings.lock_ms * 100,
          asking.signal,
        )
        .catch((e: unknown) => e as Error)
        .finally(() => {
          asking.abort();
          lock.lent = null;
        });
      if (reply instanceof Error) {
        if (!is503(reply) && !(reply instanceof VoxError && reply.type === 'not_found')) throw reply;
        memory &&= (reply as VoxError).type === 'insufficient_memory';
        refusals.push(`${c.node}: ${reply.message}`);
        n.log.info({ model: id, on: c.node, why: reply.message }, 'cluster: a node refused the load');
        continue;
      }
      await until(n.membership, () => n.holders(id).some((h) => h.node === c.node), 3 * n.settings.heartbeat_ms);
      return n.jobs.pool(config);
    }
    // The nodes asked refuse a load whose lock was taken over (split brain): the other placement counts.
    if (!(await lock.held())) throw superseded(id);
    throw voxError(memory ? 'cluster_insufficient_memory' : 'cluster_full', {
      id,
      why: ` (${candidates.length} asked): ${refusals.join('; ')}`,
    });
  }

  /**
   * Places a model again for this node's remote pool when no node holds it any more (unloaded on
   * its holders, or its holders gone): under the model's lock, on the live nodes by most free
   * memory, this one included. A node that runs the model on a remote pool itself (this one, or
   * another ingress) loads it behind that pool ({@link adopt}), so its own streams go on.
   * @throws VoxError when every node refused.
   */
  async replace(config: ModelConfig): Promise<void> {
    const n = this.n;
    const id = config.id;
    const lock = await n.locks.take(id);
    if (!lock) return;
    try {
      // The registry itself, not the watch (it may lag): the previous lock holder may have placed it just now.
      await n.refreshView();
      if (n.holders(id).length || n.backing.has(id)) return;
      const refusals: string[] = [];
      const here = n.record();
      const candidates = [
        ...(here.draining ? [] : [here]),
        ...n.nodes().filter((r) => r.node !== n.name && !r.draining),
      ].sort((a, b) => b.free_bytes - a.free_bytes);
      for (const c of candidates) {
        try {
          n.log.info({ model: id, on: c.node }, 'cluster: no node holds the model any more; placing it again');
          if (c.node === n.name) {
            await this.adopt(id);
            // Registered before the lock is released, so the next node to take it finds this holder.
            return await n.publish();
          }
          lock.lent = c.node;
          await n
            .ask(
              c.node,
              'load',
              { id, config: n.registrationOf(config), adopt: true, lock: lock.ref },
              // As long as the node is live (ask stops waiting once it is not): giving up on a load still
              // running there and asking the next node would load the model twice.
              n.settings.lock_ms * 100,
            )
            .finally(() => (lock.lent = null));
          await until(n.membership, () => n.holders(id).some((h) => h.node === c.node), 3 * n.settings.heartbeat_ms);
          return;
        } catch (e) {
          refusals.push(`${c.node}: ${(e as Error).message}`);
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

  /** Resolves once no load of `id` behind its remote pool is under way (whatever its outcome). */
  async adopted(id: string): Promise<void> {
    await this.adopting.get(id)?.catch(() => {});
  }

  /**
   * Loads `id` here behind the remote pool this node runs it on (its holders are gone): the remote
   * pool's jobs, and other nodes' jobs, run on this backing pool from then on; it closes with the
   * remote pool. Guarded by this node's `min_free_memory_mb` only (it is not an entry of the
   * supervisor: no LRU eviction makes room for it, docs/cluster.md). Bounded like a local load by
   * the model's `load_timeout_ms` (else the server's; 0 = none).
   * @throws VoxError `insufficient_memory` when the guard refuses, `load_timeout` past the load
   *   timeout; the loader's error.
   */
  adopt(id: string): Promise<void> {
    const n = this.n;
    const running = this.adopting.get(id);
    if (running) return running;
    const p = (async () => {
      const sup = n.supervisor!;
      const config = sup.configOf(id);
      if (!config || !n.runsRemotely(id) || n.backing.has(id)) return;
      const MB = 1024 * 1024;
      const free = n.options.memoryProbe();
      if (n.config.min_free_memory_mb > 0 && free < n.config.min_free_memory_mb * MB)
        throw voxError('insufficient_memory', {
          id,
          needed: 'its footprint',
          headroom: `${n.config.min_free_memory_mb} MB`,
          free: `${Math.round(free / MB)} MB`,
        });
      const m = await this.loadBounded(config);
      if (!n.runsRemotely(id)) return void (await m.close()); // its remote pool closed meanwhile
      m.pool.waitTimeoutMs = n.busyTimeout(config);
      n.backing.set(id, m);
      n.log.info({ model: id, slots: m.pool.slots.length }, 'cluster: holds the model here behind its remote pool');
      n.beat();
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
    const n = this.n;
    const ms = config.load_timeout_ms ?? n.config.load_timeout_ms;
    const ctl = new AbortController();
    const loading = n.supervisor!.loadPool(config, ctl.signal);
    if (!(ms > 0)) return loading;
    return withDeadline(loading, ms).catch((e: unknown) => {
      if (!(e instanceof Error) || !e.message.startsWith('no answer within')) throw e;
      ctl.abort();
      void loading.then(
        (late) => late.close(),
        () => {},
      );
      throw voxError('load_timeout', { ms });
    });
  }
}
