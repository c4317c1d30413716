/**
 * Serving other nodes (docs/cluster.md "The request path across nodes"): a peer's job enters the
 * holder through the same lease path as a local request ({@link leaseGranted}: admission, FIFO,
 * busy timeout, revocation and metrics written once); info, load and unload requests likewise go
 * through the model entries.
 */
import { leaseGranted } from '../actors/lease.js';
import type { ModelEntry } from '../actors/model.js';
import { toVoxError, voxError } from '../runtime/errors.js';
import type { LockRef } from './locks.js';
import { encodeJson } from './nats.js';
import {
  Assembler,
  decodeMessage,
  FrameBuffers,
  encodeMessage,
  errorReply,
  notHeld,
  publishInParts,
  type RemoteJob,
} from './wire.js';
import type { ClusterNode } from './node.js';

/** What one node serves to the others on its subjects. */
export class Serving {
  /** Load and unload requests being served, by their body: a request sent again joins its first copy ({@link once}). */
  private readonly serving = new Map<string, Promise<Uint8Array>>();
  /** When this node last served another node's job, per model (this node's clock). */
  readonly lastServed = new Map<string, number>();
  private readonly parts = new Assembler();
  /** Where peers' jobs are decoded, buffer by buffer, kept from job to job. */
  private readonly buffers = new FrameBuffers();
  /** Peers' jobs being served here, by their id (`<ingress>:<seq>#<attempt>`): a cancel aborts one. */
  private readonly running = new Map<string, AbortController>();
  /** Peers' jobs this node has started serving, ever. */
  private started = 0;

  constructor(private readonly n: ClusterNode) {}

  /**
   * Whether this node served other nodes' work since `since` (a {@link Serving.jobsStarted} read earlier), or serves
   * some now: work for the server's idle collection, as its own requests and streams are.
   */
  servedSince(since: number): boolean {
    return this.started !== since || this.running.size > 0;
  }

  /** Peers' jobs this node has started serving, ever (for {@link Serving.servedSince}). */
  get jobsStarted(): number {
    return this.started;
  }

  /** Subscribes to this node's subjects (job, job parts, info, load, unload, ping). */
  subscribe(): void {
    const n = this.n;
    const nc = n.link.nc;
    const on = (subject: string, handler: (data: Uint8Array) => Promise<Uint8Array>, parts = false): void => {
      n.subs.push(
        nc.subscribe(subject, {
          callback: (err, m) => {
            if (err) return;
            let data = m.data;
            if (parts) {
              const whole = this.parts.add(data);
              if (!whole) return;
              data = whole;
            }
            const respond = (reply: Uint8Array): void => {
              if (!m.reply) return;
              try {
                // A job's reply may be larger than max_payload (a tensor's output): its ingress joins the parts.
                if (subject.includes('.job')) publishInParts(nc, m.reply, reply);
                else m.respond(reply);
              } catch {
                // This node has left (its connection closed while it served): the answer is lost, as a
                // dead node's; the asking node sends the job again or answers node_unreachable.
              }
            };
            void handler(data).then(respond, (e) => respond(encodeMessage(errorReply(toVoxError(e)))));
          },
        }),
      );
    };
    on(n.subject(n.name, 'job'), (d) => this.job(d));
    on(`${n.subject(n.name, 'job')}.part`, (d) => this.job(d), true);
    on(n.subject(n.name, 'info'), (d) => this.info(d));
    on(n.subject(n.name, 'load'), (d) => this.once('load', d, () => this.load(d)));
    on(n.subject(n.name, 'unload'), (d) => this.once('unload', d, () => this.unload(d)));
    n.subs.push(nc.subscribe(n.subject(n.name, 'ping'), { callback: (_e, m) => void m.respond() }));
    // The job's client left (its ingress stopped waiting): the job leaves the queue or gives its lease back.
    n.subs.push(
      nc.subscribe(n.subject(n.name, 'cancel'), {
        callback: (_e, m) => this.running.get(new TextDecoder().decode(m.data))?.abort(),
      }),
    );
    n.subs.push(nc.subscribe(`${n.jobs.inbox}.>`, { callback: (_e, m) => n.jobs.onReply(m) }));
  }

  /**
   * Serves a load or unload request, or joins the same request still being served: the asking node
   * sends a request again when a NATS connection came back or after 3 heartbeats without an answer
   * (cluster/manage.ts `ask`), and a second copy served on its own would queue behind the first. A
   * placement's load (it carries its lock, unique to that placement) is answered from the first
   * copy for 4 heartbeats more: a late copy would load the model again after the placing node took
   * the first answer and moved on (two loads at once in the cluster).
   */
  private once(what: string, data: Uint8Array, serve: () => Promise<Uint8Array>): Promise<Uint8Array> {
    const text = new TextDecoder().decode(data);
    const key = `${what} ${text}`;
    const running = this.serving.get(key);
    if (running) return running;
    const p = serve();
    const keep = what === 'load' && withLock(text) ? 4 * this.n.settings.heartbeat_ms : 0;
    const forget = (): void => {
      if (!keep) return void this.serving.delete(key);
      setTimeout(() => this.serving.get(key) === p && this.serving.delete(key), keep).unref?.();
    };
    p.then(forget, forget);
    this.serving.set(key, p);
    return p;
  }

  /** The entry of a model held here ready (a local pool), else null. */
  private held(model: string): ModelEntry | null {
    const entry = this.n.supervisor?.getOrRegister(model);
    return entry && entry.state === 'ready' && !this.n.runsRemotely(model) ? entry : null;
  }

  /**
   * A job from another node: a lease like a local request's (FIFO within the job's wait and the
   * model's busy timeout, `max_queued`, stuck detection), run on the model's slots, answered
   * with its result.
   */
  private async job(data: Uint8Array): Promise<Uint8Array> {
    const n = this.n;
    // Given back once the job's run has settled: no slot reads the job's arrays after that.
    const buffer = this.buffers.take(data.length);
    const msg = decodeMessage<RemoteJob>(data, buffer);
    this.started++;
    let outcome = 'ok';
    /** The lease was revoked under the job (a forced unload): the model is not held here any more. */
    let revoked = false;
    const cancel = new AbortController();
    this.running.set(msg.id, cancel);
    try {
      const backing = n.runsRemotely(msg.model) ? n.backing.get(msg.model) : undefined;
      if (backing) {
        try {
          const result = await backing.pool.run(msg.job, cancel.signal, msg.wait_ms);
          return encodeMessage({ type: 'result', result, ran_ms: result.ran ? result.ran[1] - result.ran[0] : 0 });
        } catch (e) {
          // Its remote pool was unloaded under the job (the backing pool closes with it): not held
          // here any more, so the ingress sends the job (which gave no result) to another holder.
          if (n.backing.get(msg.model) === backing) throw e;
          outcome = 'not_held';
          return encodeMessage(notHeld(`${n.name} no longer holds ${msg.model}`));
        }
      }
      const entry = this.held(msg.model);
      if (!entry) {
        outcome = 'not_held';
        return encodeMessage(notHeld(`${n.name} does not hold ${msg.model}`));
      }
      const { handle, granted } = leaseGranted(
        entry,
        { requestTimeoutMs: msg.wait_ms, metrics: n.supervisor!.metrics },
        () => void (revoked = true),
      );
      cancel.signal.addEventListener('abort', () => handle.release(), { once: true });
      try {
        const result = await (await granted).run(msg.job, msg.wait_ms);
        return encodeMessage({ type: 'result', result, ran_ms: result.ran ? result.ran[1] - result.ran[0] : 0 });
      } finally {
        handle.release();
      }
    } catch (e) {
      const v = toVoxError(e);
      if (cancel.signal.aborted) {
        outcome = 'cancelled'; // nobody waits for the reply
        return encodeMessage(errorReply(v));
      }
      if (revoked || (v.status >= 500 && (n.draining || !this.held(msg.model)))) {
        // A draining node unloading its models, an unload (an autoscaler draining a replica), or a
        // forced unload, fails the jobs still on them: it
        // holds the model no more, so the ingress sends the job (which gave no result) to another holder.
        outcome = 'not_held';
        const why = revoked ? `${msg.model} was unloaded (forced)` : n.draining ? 'is stopping' : 'unloaded it';
        return encodeMessage(notHeld(`${n.name}: ${why}: ${v.message}`));
      }
      outcome = v.type;
      return encodeMessage(errorReply(v));
    } finally {
      // A job already running when its client left ends as it runs; nobody takes its reply.
      if (cancel.signal.aborted) outcome = 'cancelled';
      this.running.delete(msg.id);
      this.buffers.give(buffer);
      n.metrics?.served.inc({ model: msg.model, outcome });
      this.lastServed.set(msg.model, Date.now());
    }
  }

  /** What a holder's slots reported at load (heads, a stream's initial embedding history). */
  private async info(data: Uint8Array): Promise<Uint8Array> {
    const { model } = JSON.parse(new TextDecoder().decode(data)) as { model: string };
    const backing = this.n.runsRemotely(model) ? this.n.backing.get(model) : undefined;
    if (backing) return encodeMessage({ type: 'info', info: backing.pool.info });
    const entry = this.held(model);
    if (!entry) return encodeMessage(notHeld(`${this.n.name} does not hold ${model}`));
    const { pool } = await entry.ensureReady();
    return encodeMessage({ type: 'info', info: pool.info });
  }

  /**
   * Load a model here (a placement or a management load naming this node): registered from the
   * catalog, or from the config sent along; an entry that runs on a remote pool gives it up first.
   */
  private async load(data: Uint8Array): Promise<Uint8Array> {
    const body = JSON.parse(new TextDecoder().decode(data)) as {
      id: string;
      config?: Record<string, unknown>;
      fields?: Record<string, unknown>;
      /** A placement after the holders went: a node running the model on a remote pool loads it behind that pool. */
      adopt?: boolean;
      /** The placement's load lock: the load counts only while it is still that taking. */
      lock?: LockRef;
    };
    if (body.adopt && this.n.runsRemotely(body.id)) await this.n.placement.adopt(body.id);
    else await this.loadHere(body.id, body.fields ?? {}, body.config, body.lock);
    if (body.lock) {
      // Registered as the holder first (the next node to take the lock finds it), then the lock is
      // given back from here: its placing node may have left meanwhile, the lock lent to this load.
      await this.n.publish();
      await this.n.locks.clear(body.lock);
    }
    return encodeMessage({ type: 'info', info: {} });
  }

  /**
   * Loads (or reconfigures) `id` on this node with a local pool.
   * @param fields management fields (`POST /v1/models/load` minus `node`, `replicas`).
   * @param registration a config to register the model with if this node does not know it.
   * @param lock the load lock of the placement asking for it: a cold load counts only while the
   *   lock is still that taking.
   * @throws VoxError `model_not_found` when neither this node nor `registration` knows it; the load's error.
   */
  async loadHere(
    id: string,
    fields: Record<string, unknown>,
    registration?: Record<string, unknown>,
    lock?: LockRef,
  ): Promise<{ id: string; loaded: true; reconfigured: boolean }> {
    const n = this.n;
    const sup = n.supervisor!;
    const timeout = n.config.busy_timeout_ms;
    const entry = sup.getOrRegister(id);
    if (!entry && registration) {
      // A model registered on another node: its config comes along (model files are the same paths on every node).
      n.pinned.set(id, lock);
      try {
        return await sup.load({ ...registration, ...fields, id }, timeout);
      } finally {
        n.pinned.delete(id);
        n.beat();
      }
    }
    if (!entry) throw voxError('model_not_found', { id, hint: `not on ${n.name}` });
    // A placement of it under way here may have chosen another node before the pin below: its load
    // ends in a remote pool, which is given up and loaded here in a second round (the pin is set by then).
    for (let round = 0; ; round++) {
      if (n.runsRemotely(id)) await entry.unload(timeout);
      const loaded = await this.loadPinned(entry, id, fields, lock);
      if (!n.runsRemotely(id) || round === 1) return loaded;
    }
  }

  /** {@link loadHere}'s load with the pin set: a placement of `id` starting here loads it here. */
  private async loadPinned(
    entry: ModelEntry,
    id: string,
    fields: Record<string, unknown>,
    lock?: LockRef,
  ): Promise<{ id: string; loaded: true; reconfigured: boolean }> {
    const n = this.n;
    const sup = n.supervisor!;
    const timeout = n.config.busy_timeout_ms;
    n.pinned.set(id, lock);
    // A placement of this model waiting here (for the lock another node holds) loads it now: the beat wakes it.
    n.beat();
    try {
      if (Object.keys(fields).some((k) => k !== 'id')) return await sup.load({ ...fields, id }, timeout);
      // A load of it under way here (this node's own request's, which the pin above makes this
      // placement's) answers: a lease would queue behind this node's own requests on the model.
      if (entry.state === 'loading') await entry.settledIn('ready', 'unloaded');
      if (entry.state === 'ready' && !n.runsRemotely(id)) return { id, loaded: true, reconfigured: false };
      // Nothing to reconfigure: a plain lease (not the exclusive one, which would wait for this
      // node's own requests waiting for the same load).
      const { handle, granted } = leaseGranted(entry, {}, () => {});
      try {
        await granted;
      } catch (e) {
        // Refused or revoked (a forced unload) while the load runs: answered once that load has
        // ended, so the placing node does not start another load of it meanwhile (one in flight).
        await entry.settledIn('ready', 'unloaded');
        throw e;
      } finally {
        handle.release();
      }
      return { id, loaded: true, reconfigured: false };
    } finally {
      n.pinned.delete(id);
      n.beat();
    }
  }

  private async unload(data: Uint8Array): Promise<Uint8Array> {
    const body = JSON.parse(new TextDecoder().decode(data)) as {
      ids?: string[];
      force?: boolean;
      remote_only?: boolean;
      except?: string[];
    };
    return encodeJson(await this.unloadHere(body.ids, body.force, body.remote_only, body.except));
  }

  /**
   * Unloads models on this node (`ids` absent: every registered one).
   * @param remoteOnly only the models this node runs on a remote pool (and does not hold behind it)
   *   or is placing now: the first phase of a cluster-wide unload, which waits for this node's own
   *   requests on them, as a single node's unload waits for its running requests.
   * @param except ids left alone.
   * @throws VoxError `unload_timeout` naming the models still busy after the busy timeout.
   */
  async unloadHere(
    ids?: string[],
    force = false,
    remoteOnly = false,
    except: string[] = [],
  ): Promise<{ unloaded: string[]; not_found: string[]; busy?: string[] }> {
    const n = this.n;
    const sup = n.supervisor!;
    let which = (ids ?? sup.registeredIds).filter((id) => !except.includes(id));
    if (remoteOnly) {
      // Each barrier placed in this same step (as unloadMany does); the ones still busy are named.
      which = which.filter((id) => (n.runsRemotely(id) || n.placement.placing.has(id)) && !n.backing.has(id));
      const results = await Promise.allSettled(
        which.map((id) =>
          force ? sup.getOrRegister(id)!.forceUnload() : sup.unloadMany([id], n.config.busy_timeout_ms),
        ),
      );
      n.beat();
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
      return await sup.unloadMany(which, n.config.busy_timeout_ms);
    } finally {
      n.beat();
    }
  }
}

/** Whether a load request carries a placement's lock; false for a body that is not JSON (its load answers the error). */
function withLock(text: string): boolean {
  try {
    return !!(JSON.parse(text) as { lock?: unknown } | null)?.lock;
  } catch {
    return false;
  }
}
