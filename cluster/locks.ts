/**
 * Cold-load locks (docs/cluster.md "Placement"): one key per model being placed in the lock
 * bucket, taken by compare-and-set. A lock's expiry is judged by the node that waits for it, on
 * its own clock: a lock whose revision has not changed for `lock_ms` since this node first saw
 * that revision is taken over (its holder renews it every third of `lock_ms`). No two machines'
 * clocks are ever compared (a holder whose clock runs 40 s fast does not hold others for 40 s).
 */
import { randomUUID } from 'node:crypto';
import type { KV, KvEntry } from '@nats-io/kv';
import type { Logger } from 'pino';
import { createActor, setup } from 'xstate';
import { lockKey, encodeJson } from './nats.js';

/**
 * A cold-load lock as a node loading under it names it: its key and the token of that taking (a take-over changes it).
 */
export interface LockRef {
  key: string;
  token: string;
}

/** A cold-load lock this node holds ({@link Locks.take}). */
export interface LoadLock {
  ref: LockRef;
  /**
   * Compare-and-set on the lock's revision (renewing it): false when another node has taken the
   * lock over since (this node was paused past `lock_ms`); true when NATS cannot tell.
   */
  held(): Promise<boolean>;
  /**
   * The node asked to load under this lock, while it has not answered (else null). A node leaving
   * then does not delete the lock: that load may be under way, and another node taking the lock
   * meanwhile would load the model a second time at once (FC_SEED=-329688292 FC_RUNS=591, 3 nodes).
   * It rewrites the lock with `lent_to` naming that node, which gives it back once it holds the
   * model ({@link Locks.clear}); if that node never loads it (the request lost, its load failed),
   * or had loaded it before (its answer in transit), the lock stands until it expires (`lock_ms`).
   */
  lent: string | null;
  release(): Promise<void>;
}

/** Thrown inside a placement whose load lock another node took over: the placement is given up. */
export const superseded = (id: string): Error =>
  Object.assign(new Error(`the load lock of ${id} was taken over by another node`), { superseded: true });

/** A lock this node holds: `held`, renewed at every `renew` delay (its `renew` action), until `RELEASE`. */
export const lockMachine = setup({
  types: { events: {} as { type: 'RELEASE' } },
  actions: { renew: () => {} },
  delays: { renew: 1000 },
}).createMachine({
  id: 'lock',
  initial: 'held',
  states: {
    held: {
      after: { renew: { target: 'held', reenter: true, actions: 'renew' } },
      on: { RELEASE: 'released' },
    },
    released: { type: 'final' },
  },
});

/** One node's view of the lock bucket: taking, renewing, judging expiry, checking a taking still holds. */
export class Locks {
  /** Each lock key held by another node: the revision this node last saw and since when (this node's clock). */
  private readonly seen = new Map<string, { rev: number; since: number }>();
  /** The locks this node holds now (taken, and not yet deleted from the bucket). */
  private readonly live = new Set<LoadLock>();
  /** Takings under way: a node leaving waits for them ({@link releaseAll}). */
  private readonly taking = new Set<Promise<LoadLock | null>>();
  /**
   * Lock keys whose create had no answer, or whose release was not deleted, with the token written:
   * NATS may write the create (or an update) after this node gave up (a freeze), and nothing would
   * delete it before it expires (a breaker saw the next cold request 503 at its busy timeout).
   */
  private readonly unsure = new Map<string, string>();
  /**
   * Set when the node left before {@link releaseAll} ended (NATS slower than the node's bound for
   * it, 3 heartbeats): the locks not released stand until they expire (`lock_ms`).
   */
  gaveUp = false;
  /** Set by {@link releaseAll}: the node is leaving and takes no lock any more. */
  private leaving = false;

  /**
   * @param kv the lock bucket.
   * @param owner this node's name (written into the lock, for logs).
   * @param lockMs how long a lock may go unrenewed before another node takes it over, ms.
   */
  constructor(
    private readonly kv: () => KV,
    private readonly owner: string,
    private readonly lockMs: number,
    private readonly log: Logger,
  ) {}

  /**
   * Takes the model's cold-load lock: created if absent, taken over once its revision has stood
   * still for `lock_ms` of this node's clock (compare-and-set on the revision both ways). The
   * holder renews it every third of `lock_ms` until released.
   * @returns the lock, or null when another node holds it (or NATS did not answer), or this node is leaving.
   */
  async take(model: string): Promise<LoadLock | null> {
    if (this.leaving) return null;
    const taking = this.takeNow(model);
    this.taking.add(taking);
    try {
      const lock = await taking;
      // Taken while the node began to leave: given back at once (its release is the one releaseAll waits for).
      if (lock && this.leaving) {
        await lock.release();
        return null;
      }
      return lock;
    } finally {
      this.taking.delete(taking);
    }
  }

  private async takeNow(model: string): Promise<LoadLock | null> {
    const key = lockKey(model);
    const token = randomUUID();
    // `deadline` is the writer's clock, for people reading the bucket: no other node reads it.
    const fields = (): Record<string, unknown> => ({
      owner: this.owner,
      token,
      model,
      deadline: Date.now() + this.lockMs,
    });
    const value = (): Uint8Array => encodeJson(fields());
    let rev: number;
    try {
      rev = await this.kv().create(key, value());
    } catch {
      let e: KvEntry | null;
      try {
        e = await this.kv().get(key);
      } catch {
        // The create's answer was lost (NATS frozen): it may still be written. Deleted by {@link sweep}.
        this.unsure.set(key, token);
        return null;
      }
      if (e && e.operation === 'PUT') {
        const now = Date.now();
        const s = this.seen.get(key);
        if (!s || s.rev !== e.revision) {
          this.seen.set(key, { rev: e.revision, since: now });
          return null;
        }
        if (now - s.since < this.lockMs) return null;
      }
      try {
        rev = e ? await this.kv().update(key, value(), e.revision) : await this.kv().create(key, value());
        if (e?.operation === 'PUT')
          this.log.warn({ model, from: e.json<{ owner: string }>().owner }, 'cluster: took over an expired load lock');
      } catch {
        return null;
      }
    }
    this.seen.delete(key);
    /** Every compare-and-set update under way (renewals and `held` checks): a release waits for them. */
    let renewing: Promise<unknown> = Promise.resolve();
    const update = (): Promise<number> => {
      const p = this.kv()
        .update(key, value(), rev)
        .then((r) => (rev = r));
      renewing = Promise.all([renewing, p.catch(() => {})]);
      return p;
    };
    // An update in flight (a renewal, or a `held` check) changes the revision: a release waits for every one
    // (else it fails on the old revision and the lock stays until it expires: FC_SEED=-367663738 FC_RUNS=282).
    const settled = async (): Promise<void> => {
      for (let under = renewing; ; under = renewing) {
        await under;
        if (under === renewing) break;
      }
    };
    // The lock stays this node's while it places: a renewal every third of `lock_ms`, a delay of its chart.
    const renewal = createActor(
      lockMachine.provide({
        actions: {
          renew: () => {
            update().catch(() => {});
          },
        },
        delays: { renew: Math.max(50, this.lockMs / 3) },
      }),
    ).start();
    const ref = { key, token };
    let released: Promise<void> | null = null;
    const lock: LoadLock = {
      ref,
      held: async () => {
        try {
          await update();
          return true;
        } catch {
          // A renewal raced this one, NATS is away, or the lock is another's now: its token tells.
          return this.holds(ref);
        }
      },
      lent: null,
      // Once: a lock released by releaseAll (this node leaving) is not deleted again by its placement.
      release: () =>
        (released ??= (async () => {
          renewal.send({ type: 'RELEASE' });
          if (this.leaving && lock.lent) {
            await settled();
            await this.kv()
              .update(key, encodeJson({ ...fields(), lent_to: lock.lent }), rev)
              .catch(() => {});
            this.live.delete(lock);
            return;
          }
          await settled();
          // Not deleted (NATS away, or an update whose answer was lost written after all, so the
          // revision moved): deleted by {@link sweep} if still this taking's.
          await this.kv()
            .delete(key, { previousSeq: rev })
            .catch(() => this.unsure.set(key, token));
          // Counted until deleted: a node leaving waits for a release under way too.
          this.live.delete(lock);
        })()),
    };
    this.live.add(lock);
    return lock;
  }

  /**
   * Releases every lock this node holds (a lent one is left to the node loading under it:
   * {@link LoadLock.lent}): it is leaving the cluster, and a placement abandoned with it would
   * release its lock only after the connection has closed (the lock then stands until its
   * deadline, and other nodes wait that long to load the model).
   */
  async releaseAll(): Promise<void> {
    this.leaving = true;
    // A taking under way when the node began to leave ends first (else its lock, written after, stays until it
    // expires: FC_SEED=1750973698 FC_RUNS=644, 3 nodes).
    await Promise.all([...this.taking]);
    await Promise.all([...this.live].map((l) => l.release()));
  }

  /**
   * Deletes the lock `ref` names if its placing node left it lent to this node ({@link LoadLock.lent}:
   * still that taking, with `lent_to` naming this node; compare-and-set on its revision): called
   * once this node holds the model it loaded under it, so the lock does not stand until it expires.
   * A lock not lent is left to its placing node, still placing under it (deleting it would let a
   * third node load the model while that node falls back to loading it itself: FC_SEED=-1995412418
   * FC_RUNS=468, 3 nodes). Never throws (NATS away: the lock expires).
   */
  async clear(ref: LockRef): Promise<void> {
    try {
      const e = await this.kv().get(ref.key);
      const v = e?.operation === 'PUT' ? e.json<{ token?: string; lent_to?: string }>() : null;
      if (e && v?.token === ref.token && v.lent_to === this.owner)
        await this.kv().delete(ref.key, { previousSeq: e.revision });
    } catch {
      // Taken over, or NATS away: left to its expiry.
    }
  }

  /**
   * Deletes the locks whose create had no answer or whose release failed ({@link unsure}) if NATS wrote them and
   * no taking of this node holds them; called after each heartbeat NATS acknowledged. Never throws
   * (NATS away again: tried at the next heartbeat).
   */
  async sweep(): Promise<void> {
    for (const [key, token] of this.unsure) {
      try {
        const e = await this.kv().get(key);
        const live = [...this.live].some((l) => l.ref.key === key && l.ref.token === token);
        if (e?.operation === 'PUT' && e.json<{ token?: string }>().token === token && !live)
          await this.kv().delete(key, { previousSeq: e.revision });
        this.unsure.delete(key);
      } catch {
        // Not now: at the next heartbeat.
      }
    }
  }

  /** Whether the lock `ref` names is still that taking (its token); true when NATS cannot tell. */
  async holds(ref: LockRef): Promise<boolean> {
    let e: KvEntry | null;
    try {
      e = await this.kv().get(ref.key);
    } catch {
      return true;
    }
    return e?.operation === 'PUT' && e.json<{ token?: string }>().token === ref.token;
  }
}
