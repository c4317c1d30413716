/**
 * The remote pool (docs/cluster.md "The request path across nodes"): a model held on other nodes
 * runs here on a {@link SlotPool} of remote slots, whose jobs go to the holders over NATS. This
 * module sends each job attempt and settles it when its reply comes, its holder is taken for gone
 * (the membership chart's `gone`), or NATS comes back (`back`): every wait ends by an event or a
 * deadline within the job's busy timeout, and at once when its client leaves.
 */
import { createInbox, type Msg } from '@nats-io/transport-node';
import type { ModelConfig } from '../runtime/config.js';
import { voxError } from '../runtime/errors.js';
import type { LoadedModel } from '../runtime/loader.js';
import { SlotPool, type SlotHost } from '../runtime/slots/slots.js';
import type { Job, JobResult, SlotInfo } from '../runtime/slots/slot-protocol.js';
import { nextChange, until } from './membership.js';
import { redact } from './nats.js';
import {
  Assembler,
  decodeMessage,
  encodeMessage,
  errorReply,
  publishInParts,
  replyError,
  runHalves,
  splitJob,
  type RemoteReply,
} from './wire.js';
import type { NodeRecord } from './membership.js';
import type { ClusterNode } from './node.js';

/**
 * How one attempt at a remote job ended: its holder's reply, the holder known gone, or the reply lost with this node's
 * NATS connection.
 */
type Attempt = { reply: RemoteReply } | { gone: string } | { lost: true };

/** The most concurrent jobs one ingress sends to the holders of a model (its remote pool's size). */
const MAX_REMOTE_WINDOW = 32;
/** Pause before asking busy holders again, ms. */
const BUSY_RETRY_MS = 25;

/** A nats.js request error saying nobody listens on the subject. */
export const isNoResponders = (e: unknown): boolean =>
  (e as Error)?.name === 'NoRespondersError' ||
  (e as { isNoResponders?: () => boolean })?.isNoResponders?.() === true ||
  ((e as { cause?: unknown })?.cause instanceof Error && (e as { cause: Error }).cause.name === 'NoRespondersError');

const aborted = (): Error => Object.assign(new Error('the request ended (its client left)'), { name: 'AbortError' });

/** The job attempts of one node in flight to other nodes, and their reply subjects. */
export class RemoteJobs {
  /** Job attempts in flight, by the last token of their reply subject (`<seq>.<attempt>`). */
  private readonly pending = new Map<string, { node: string; model: string; settle: (a: Attempt) => void }>();
  /** The reply subject prefix of this node's job attempts (`<inbox>.<seq>.<attempt>`). */
  readonly inbox = createInbox();
  /** Replies too large for one NATS message, arriving in parts. */
  private readonly parts = new Assembler();
  private seq = 0;

  constructor(private readonly n: ClusterNode) {
    n.membership.on('gone', (e) => this.settleWhere((p) => p.node === e.node, { gone: e.why }));
    n.membership.on('back', () => this.settleWhere(() => true, { lost: true }));
    // NATS lost: the attempts of a model held here too are run here at once, not waited for until NATS is back or
    // their job deadline (their holders' answers cannot come).
    n.membership.on('lost', () => this.settleWhere((p) => n.backing.has(p.model), { lost: true }));
  }

  /** Ends the attempts `which` picks with `a` (a late reply to one of them is dropped). */
  settleWhere(which: (p: { node: string; model: string }) => boolean, a: Attempt): void {
    for (const [token, p] of this.pending) {
      if (!which(p)) continue;
      this.pending.delete(token);
      p.settle(a);
    }
  }

  /**
   * Starts the membership chart's probe of holders when jobs are in flight and it is not probing.
   * It stops at the first probe that finds none ({@link probe}): jobs one after another cost no
   * event each.
   */
  private probing(): void {
    if (!this.pending.size) return;
    if (this.n.membership.getSnapshot().matches({ connected: { holders: 'probing' } })) return;
    this.n.membership.send({ type: 'PROBE.START' });
  }

  /**
   * The chart's `probe` action: for each node with jobs from here in flight, gone when missing from
   * the registry for 3 heartbeats, or when NATS says nobody listens on its subjects (a ping with
   * no responders: its process died and its connection closed).
   */
  probe(): void {
    const n = this.n;
    if (!this.pending.size) return void n.membership.send({ type: 'PROBE.STOP' });
    const busy = new Set([...this.pending.values()].map((p) => p.node));
    const live = new Set(n.nodes().map((r) => r.node));
    for (const node of busy) {
      if (!live.has(node)) {
        n.membership.send({ type: 'GONE', node, why: 'missed 3 heartbeats' });
        continue;
      }
      // Short: an unanswered ping says nothing (a busy node); one in flight when its node dies must not hold up the
      // next.
      n.link.nc.request(n.subject(node, 'ping'), undefined, { timeout: 100 }).then(
        () => {},
        (e: Error) => {
          if (isNoResponders(e) && n.connected) n.membership.send({ type: 'GONE', node, why: 'no responders' });
        },
      );
    }
  }

  /**
   * A reply (or part of one) to a job attempt: settles it, or is dropped (and counted) when the attempt was given up.
   */
  onReply(m: Msg): void {
    let subject = m.subject;
    let data = m.data;
    if (subject.endsWith('.part')) {
      subject = subject.slice(0, -'.part'.length);
      const whole = this.parts.add(data);
      if (!whole) return;
      data = whole;
    }
    const token = subject.slice(this.inbox.length + 1);
    const p = this.pending.get(token);
    const noResponders = data.length === 0 && m.headers?.code === 503;
    if (!p) {
      if (!noResponders) {
        this.n.metrics?.late.inc();
        this.n.log.info({ token }, 'cluster: a late reply to a job attempt given up: dropped');
      }
      return;
    }
    if (noResponders) return void this.n.membership.send({ type: 'GONE', node: p.node, why: 'no responders' });
    this.pending.delete(token);
    this.probing();
    try {
      p.settle({ reply: decodeMessage<RemoteReply>(data) });
    } catch (e) {
      p.settle({ reply: errorReply(voxError('node_failed', { message: (e as Error).message })) });
    }
  }

  /**
   * Sends one attempt of a job to `node` and waits for how it ends: the holder's reply; `gone` when
   * the holder is taken for gone meanwhile or no reply came within `deadlineMs`; `lost` when this
   * node's NATS connection dropped meanwhile.
   */
  private attempt(node: string, model: string, token: string, data: Uint8Array, deadlineMs: number): Promise<Attempt> {
    const n = this.n;
    return new Promise((resolve) => {
      const timer = setTimeout(() => {
        if (!this.pending.has(token)) return;
        // Without NATS this node cannot tell: the attempt is lost (sent again once NATS is back, within the busy
        // timeout).
        if (!n.connected) this.settleWhere((p) => p === entry, { lost: true });
        else n.membership.send({ type: 'GONE', node, why: `no reply within the job deadline (${deadlineMs} ms)` });
      }, deadlineMs);
      const entry = {
        node,
        model,
        settle: (a: Attempt) => {
          clearTimeout(timer);
          resolve(a);
        },
      };
      this.pending.set(token, entry);
      this.probing();
      try {
        publishInParts(n.link.nc, n.subject(node, 'job'), data, `${this.inbox}.${token}`);
      } catch (e) {
        this.settleWhere((p) => p === entry, { lost: true });
        n.log.debug({ err: (e as Error).message }, 'cluster: job not sent');
      }
    });
  }

  /**
   * A pool whose jobs run on the holders of `config.id`: a {@link SlotPool} of remote slots (a
   * window of jobs in flight), so FIFO order, the slot wait's busy timeout, stuck detection and the
   * batcher work as for local slots. Its `info` comes from a holder.
   * @throws VoxError `no_holder` when no holder answered.
   */
  async pool(config: ModelConfig): Promise<LoadedModel> {
    const n = this.n;
    const id = config.id;
    const holders = n.holders(id);
    let info: SlotInfo | null = null;
    const why: string[] = [];
    for (const h of holders) {
      try {
        // Within the busy timeout (at most 10 s): a request or an answer lost in transit is not waited for longer.
        const within = Math.min(10_000, n.busyTimeout(config) || 10_000);
        info = (await n.ask<{ info: SlotInfo }>(h.node, 'info', { model: id }, within)).info;
        break;
      } catch (e) {
        why.push(`${h.node}: ${(e as Error).message}`);
        // Its process died since its last heartbeat (its subjects have no responders): gone now, not 3 heartbeats from
        // now.
        if (isNoResponders((e as { cause?: unknown }).cause))
          n.membership.send({ type: 'GONE', node: h.node, why: 'no responders' });
      }
    }
    if (!info)
      throw voxError('no_holder', { message: `no holder of ${id} answered: ${why.join('; ') || 'none left'}` });
    // Twice the holders' slots (this node's own too, when it holds the model behind this pool: its jobs go through the
    // window as well), read at each dispatch: a replica placed later widens it (and one gone narrows it). Worked out
    // again only when the membership chart's context changes (a heartbeat heard), not per job.
    let seen: unknown;
    let width = 2;
    const window = (): number => {
      const ctx = n.membership.getSnapshot().context;
      if (ctx !== seen) {
        seen = ctx;
        const slots = n.holders(id).reduce((k, h) => k + h.models[id].slots, n.backing.get(id)?.pool.size ?? 0);
        width = Math.max(2, Math.min(MAX_REMOTE_WINDOW, 2 * slots));
      }
      return width;
    };
    const slot: SlotHost = {
      info,
      run: (job, waitUntil, signal) => this.send(config, job, waitUntil, signal),
      close: async () => {},
      onExit: () => {},
      residentBytes: () => 0,
    };
    // One object per place: the pool keeps free places by identity, and one object for all of them lost a place each
    // time two of its jobs ended together (after a while a single job in flight, whatever the window).
    const pool = await SlotPool.start({ kind: 'vad', model: '' }, MAX_REMOTE_WINDOW, async () => ({ ...slot }), {
      window,
    });
    n.log.info(
      { model: id, holders: holders.map((h) => h.node), window: window() },
      'cluster: model served by other nodes',
    );
    n.beat();
    return {
      pool,
      residentBytes: 0,
      close: async () => {
        // A load behind this pool under way finishes first (its model is closed with the pool, not leaked).
        await n.placement.adopted(id);
        const backing = n.backing.get(id);
        n.backing.delete(id);
        await pool.close();
        await backing?.close();
        n.beat();
      },
    };
  }

  /**
   * Sends one job to a holder picked by two random choices ({@link pickHolder}), or runs it here on the model's backing pool when
   * this node holds it behind its remote pool. A holder that answers busy or no longer holds the
   * model is skipped; when all are busy (or none is live) the job waits for the next change of the
   * membership chart and asks again, up to the busy timeout. A holder taken for gone is skipped and
   * the same job (same input, same state) is sent again; when no node holds the model any more it
   * is placed again (bounded by the same deadline). Each attempt has its own reply subject
   * (`<seq>.<attempt>`): a reply to an attempt given up is dropped, so a job is answered once. A
   * job larger than NATS's `max_payload` goes in parts (a batch is first split by rows).
   * @param waitUntil the job's own end of waiting (its request's busy timeout), ms since the epoch.
   * @param signal aborted when the job's client left: the job stops waiting at once.
   * @throws VoxError `no_holder` (503 `server_busy`, Retry-After 1 s) when no holder took the job
   *   within the busy timeout (every one busy or gone, or NATS away); the holder's error otherwise;
   *   `AbortError` when `signal` was aborted.
   */
  async send(config: ModelConfig, job: Job, waitUntil?: number, signal?: AbortSignal): Promise<JobResult> {
    const n = this.n;
    const id = config.id;
    const timeout = n.busyTimeout(config);
    const end = Math.min(waitUntil ?? Infinity, timeout > 0 ? Date.now() + timeout : Infinity);
    const left = (): number => (end === Infinity ? 3_600_000 : Math.max(1, end - Date.now()));
    const seq = ++this.seq;
    const jobId = `${n.name}:${seq}`;
    const deadline = n.settings.job_deadline_ms;
    // A job may run up to its job timeout at the holder (which kills it past that): silence within
    // that is no sign the holder is gone (dead or paused holders are found by the probe and the heartbeats).
    const runMs = config.job_timeout_ms ?? n.config.job_timeout_ms;
    const frame = (attempt: number, wait: number): Uint8Array =>
      encodeMessage({ type: 'job', id: `${jobId}#${attempt}`, model: id, wait_ms: wait, job });
    const maxPayload = n.link.nc.info?.max_payload ?? 1024 * 1024;
    // Its arrays' bytes (the frame's head is small): a frame over max_payload anyway goes in parts.
    const bytes = Object.values(job).reduce((k: number, v) => k + (ArrayBuffer.isView(v) ? v.byteLength : 0), 0);
    if (bytes > maxPayload) {
      // A batch of many streams goes as two jobs of half the streams each (they run on two slots); one row goes in
      // parts.
      const halves = splitJob(job);
      if (halves) {
        return runHalves(halves, (h) => this.send(config, h, waitUntil, signal));
      }
    }
    const skip = new Set<string>();
    let lastBusy = '';
    let lastGone = '';
    let replaced = 0;
    let adoptedOffline = false;
    for (let attempt = 1; ; attempt++) {
      if (signal?.aborted) throw aborted();
      if (n.closed) throw voxError('shutting_down');
      // Held here too (behind this pool): run here when NATS is away or when here is drawn and less loaded.
      const backing = n.backing.get(id)?.pool;
      let chosen: NodeRecord | undefined;
      if (backing) {
        const here = (backing.queued + backing.inFlight) / backing.size;
        const picked = n.connected ? pickHolder(id, n.holders(id), skip, n.inflight, Math.random, here) : 'here';
        if (picked === 'here' || !picked) return backing.run(job, signal, end === Infinity ? 0 : left());
        chosen = picked;
      }
      // NATS lost and no live holder known (their heartbeats unheard for 3 of them): no job can reach
      // one, so the model is loaded here behind this pool, as a cold load would be (no lock: the
      // documented overlap of loads decided while NATS is lost).
      if (!n.connected && !n.holders(id).length && Date.now() < end && !adoptedOffline) {
        adoptedOffline = true;
        await withDeadline(n.placement.adopt(id), left()).catch((e: Error) =>
          n.log.warn({ model: id, err: e.message }, 'cluster: NATS lost and no holder: not loaded here'),
        );
        continue;
      }
      // Waited for a heartbeat at a time: the holders known may go unheard meanwhile (then loaded here, above).
      const back = await until(
        n.membership,
        () => n.connected || n.closed || signal?.aborted === true,
        Math.min(left(), n.settings.heartbeat_ms),
      );
      if (!back && Date.now() < end) continue;
      if (!back)
        throw voxError('no_holder', {
          message: `NATS (${redact(n.settings.nats, n.settings)}) was unreachable for the busy timeout; ${id} is held on other nodes`,
        });
      if (signal?.aborted) throw aborted();
      // Without `here`, pickHolder picks a node record or none.
      const holder = chosen ?? (pickHolder(id, n.holders(id), skip, n.inflight) as NodeRecord | undefined);
      if (!holder) {
        const expired = Date.now() >= end;
        // No node holds it any more (unloaded there, or its holders gone): placed again, once a few heartbeats, within
        // the deadline.
        if (!expired && !n.holders(id).length && Date.now() - replaced > 3 * n.settings.heartbeat_ms) {
          replaced = Date.now();
          await withDeadline(n.placement.replace(config), left()).catch((e: Error) =>
            n.log.warn({ model: id, err: e.message }, 'cluster: could not place the model again'),
          );
          continue;
        }
        if (expired)
          throw voxError('no_holder', {
            message: lastBusy
              ? `every node holding ${id} is busy: ${lastBusy}`
              : `no node of the cluster holds ${id} ready${lastGone ? ` (${lastGone})` : ''}`,
          });
        // Every holder busy, or none live just now (a late heartbeat): ask again at the next change or shortly.
        skip.clear();
        await nextChange(n.membership, Math.min(BUSY_RETRY_MS, left()));
        continue;
      }
      const node = holder.node;
      // The holder waits for a lease and a slot at most the job deadline (then answers busy) and runs
      // the job at most its job timeout, so silence past both plus the deadline means it is gone.
      const wait = Math.min(deadline, left());
      n.inflight.set(node, (n.inflight.get(node) ?? 0) + 1);
      const t0 = performance.now();
      const token = `${seq}.${attempt}`;
      const stop = (): void => {
        this.settleWhere((p) => p === this.pending.get(token), { lost: true });
        // The client left: the holder drops the job too (it leaves the queue there, or gives its lease back).
        if (n.connected) n.link.nc.publish(n.subject(node, 'cancel'), new TextEncoder().encode(`${jobId}#${attempt}`));
      };
      signal?.addEventListener('abort', stop, { once: true });
      let outcome: Attempt;
      try {
        outcome = await this.attempt(node, id, token, frame(attempt, wait), wait + runMs + deadline);
      } finally {
        signal?.removeEventListener('abort', stop);
        n.inflight.set(node, (n.inflight.get(node) ?? 1) - 1);
      }
      if ('lost' in outcome) {
        if (!signal?.aborted) n.metrics?.failovers.inc({ model: id, why: 'lost' });
        continue;
      }
      if ('gone' in outcome) {
        skip.add(node);
        lastGone = `${node}: ${outcome.gone}`;
        n.metrics?.sent.inc({ model: id, node, outcome: 'gone' });
        const why = outcome.gone.startsWith('no responders')
          ? 'no_responders'
          : outcome.gone.startsWith('missed')
            ? 'heartbeats'
            : 'deadline';
        n.metrics?.failovers.inc({ model: id, why });
        n.log.info({ model: id, job: jobId, on: node, why: outcome.gone }, 'cluster: job sent again');
        continue;
      }
      const reply = outcome.reply;
      if (reply.type === 'result') {
        n.metrics?.sent.inc({ model: id, node, outcome: 'ok' });
        n.metrics?.hop.observe({ model: id }, Math.max(0, performance.now() - t0 - reply.ran_ms) / 1000);
        return reply.result;
      }
      if (reply.type !== 'error')
        throw voxError('node_failed', { message: `node ${node} answered a job with ${reply.type}` });
      n.metrics?.sent.inc({ model: id, node, outcome: reply.error });
      if (reply.error === 'not_held' || reply.error === 'server_busy' || reply.error === 'shutting_down') {
        if (reply.error === 'server_busy') lastBusy = `${node}: ${reply.message}`;
        skip.add(node);
        continue;
      }
      throw replyError(node, reply);
    }
  }

  /** Ends every attempt in flight (their requests get 503 `shutting_down`). */
  close(): void {
    this.settleWhere(() => true, { lost: true });
  }
}

/**
 * The holder a job goes to (the power of two choices, Mitzenmacher): of `holders` not in `skip`
 * (draining ones only when no other is left), two drawn at random, the less loaded: its queued
 * requests and active leases (from its heartbeat) plus the jobs this ingress has in flight to it
 * (`inflight`, by node), per slot; a tie goes to the first drawn. Unlike always the least loaded,
 * ingresses that heard the same heartbeats do not all pile onto one holder until the next.
 * @param random a number in [0, 1) (a spec gives a seeded one).
 * @param here this node's own load per slot when it holds the model too (behind its remote pool):
 *   it is one of the candidates, so a replica placed on an ingress shares that ingress's jobs with
 *   the other holders instead of taking them all.
 * @returns `'here'` when this node is picked; undefined when no holder is left.
 */
export function pickHolder(
  model: string,
  holders: NodeRecord[],
  skip: ReadonlySet<string>,
  inflight: ReadonlyMap<string, number>,
  random: () => number = Math.random,
  here?: number,
): NodeRecord | 'here' | undefined {
  const open = holders.filter((h) => !skip.has(h.node));
  const live = here !== undefined || open.some((h) => !h.draining) ? open.filter((h) => !h.draining) : open;
  const pool: (NodeRecord | 'here')[] = here === undefined ? live : ['here', ...live];
  if (pool.length <= 1) return pool[0];
  const i = Math.floor(random() * pool.length);
  const j = (i + 1 + Math.floor(random() * (pool.length - 1))) % pool.length;
  const load = (h: NodeRecord | 'here'): number => {
    if (h === 'here') return here!;
    const m = h.models[model];
    return (m.queued + m.active_leases + (inflight.get(h.node) ?? 0)) / Math.max(1, m.slots);
  };
  return load(pool[j]) < load(pool[i]) ? pool[j] : pool[i];
}

/** `p`, or a rejection after `ms` (p goes on; its outcome is dropped). */
export function withDeadline<T>(p: Promise<T>, ms: number): Promise<T> {
  return new Promise((resolve, reject) => {
    const t = setTimeout(() => reject(new Error(`no answer within ${ms} ms`)), ms);
    p.then(
      (v) => {
        clearTimeout(t);
        resolve(v);
      },
      (e: unknown) => {
        clearTimeout(t);
        reject(e);
      },
    );
  });
}
