/**
 * Cold-load locks (cluster/locks.ts) over the in-memory NATS, with chosen orders of the bucket's
 * operations: a lock given back is gone from the bucket whatever is in flight when it is given back
 * (docs/cluster.md "Placement": a node leaves no lock behind it; another node would wait `lock_ms`
 * for it). Both orders were found by the interleaving suite with random seeds (the seeds are named
 * in cluster/locks.ts).
 */
import pino from 'pino';
import { describe, expect, it } from 'vitest';
import { Locks } from '../../cluster/locks.js';
import { lockKey } from '../../cluster/nats.js';
import { FakeNats } from './fake-nats.js';

/**
 * A frozen server as the client sees it, over the in-memory NATS: node A's locks bucket, whose
 * operations named in `lost` are carried out but answered with a timeout while `frozen()` holds.
 */
function frozenLocks(lost: string[], frozen: () => boolean) {
  const nats = new FakeNats(() => Promise.resolve());
  const kv = new Proxy(nats.connect('A').locks, {
    get(target, prop, receiver) {
      const real = Reflect.get(target, prop, receiver) as (...a: unknown[]) => Promise<unknown>;
      if (typeof real !== 'function') return real;
      return async (...args: unknown[]) => {
        const answer = await real.apply(target, args);
        if (frozen() && lost.includes(String(prop))) throw new Error('TIMEOUT');
        return answer;
      };
    },
  });
  return { nats, locks: new Locks(() => kv, 'A', 60_000, pino({ level: 'silent' })) };
}

/** A bus whose operations matching `hold` wait until the test lets them through (`let(label)`). */
function bus() {
  const waiting = new Map<string, () => void>();
  let hold: RegExp | null = null;
  const nats = new FakeNats((label) =>
    hold?.test(label) ? new Promise<void>((r) => void waiting.set(label, r)) : Promise.resolve(),
  );
  const link = nats.connect('A');
  const locks = new Locks(() => link.locks, 'A', 60_000, pino({ level: 'silent' }));
  const settle = (): Promise<void> => new Promise((r) => setTimeout(r, 5));
  return {
    nats,
    locks,
    settle,
    holdOps: (re: RegExp | null) => void (hold = re),
    waiting: () => [...waiting.keys()],
    /** Lets the waiting operation whose label matches `re` go on. */
    pass: (re: RegExp) => {
      const label = [...waiting.keys()].find((l) => re.test(l));
      if (!label) throw new Error(`no operation waiting for ${re}; waiting: ${[...waiting.keys()].join(', ')}`);
      waiting.get(label)!();
      waiting.delete(label);
    },
    /** The lock entry of `model` in the bucket: 'PUT', 'DEL' or absent. */
    entry: (model: string) => nats.locks.entries.get(lockKey(model))?.operation,
  };
}

describe('cold-load locks', () => {
  it('a lock released while a held() check is renewing it is deleted, not left on the old revision', async () => {
    const b = bus();
    const lock = (await b.locks.take('m'))!;
    expect(lock).not.toBeNull();
    expect(b.entry('m')).toBe('PUT');
    b.holdOps(/kv locks (update|delete)/);
    const check = lock.held();
    await b.settle();
    expect(b.waiting()).toEqual([expect.stringMatching(/update load\.\S+@1$/)]);
    const release = lock.release();
    await b.settle();
    // The renewal goes through first: its revision moves on under the release.
    b.pass(/update/);
    expect(await check).toBe(true);
    await b.settle();
    if (b.waiting().length) b.pass(/delete/);
    await release;
    expect(b.entry('m')).toBe('DEL');
  });

  it('a node leaving while a take is under way leaves no lock: the taking is given back', async () => {
    const b = bus();
    b.holdOps(/kv locks create/);
    const taking = b.locks.take('m');
    await b.settle();
    expect(b.waiting()).toEqual([expect.stringMatching(/create load\./)]);
    b.holdOps(null);
    const leaving = b.locks.releaseAll();
    await b.settle();
    b.pass(/create/);
    await leaving;
    expect(await taking).toBeNull();
    expect(b.entry('m')).toBe('DEL');
    // And nothing is taken once the node is leaving.
    expect(await b.locks.take('n')).toBeNull();
    expect(b.entry('n')).toBeUndefined();
  });

  it('a create whose answer was lost (NATS frozen) but which NATS wrote after is deleted at the next heartbeat', async () => {
    let frozen = true;
    // As a frozen server: the create is written, yet the client hears no answer, nor to the get after it.
    const { nats, locks } = frozenLocks(['create', 'get'], () => frozen);
    expect(await locks.take('m')).toBeNull();
    expect(nats.locks.entries.get(lockKey('m'))?.operation).toBe('PUT');
    await locks.sweep(); // still frozen: kept for the next heartbeat
    expect(nats.locks.entries.get(lockKey('m'))?.operation).toBe('PUT');
    frozen = false;
    await locks.sweep();
    expect(nats.locks.entries.get(lockKey('m'))?.operation).toBe('DEL');
    // A lock taken afterwards is this node's again, and a sweep leaves it alone.
    const lock = (await locks.take('m'))!;
    expect(lock).not.toBeNull();
    await locks.sweep();
    expect(nats.locks.entries.get(lockKey('m'))?.operation).toBe('PUT');
    await lock.release();
  });

  it('a release that fails because an update whose answer was lost was written after all is deleted at the next heartbeat', async () => {
    let frozen = false;
    // As a frozen server: an update is written, yet the client hears no answer, nor to a get.
    const { nats, locks } = frozenLocks(['update', 'get'], () => frozen);
    const lock = (await locks.take('m'))!;
    expect(lock).not.toBeNull();
    frozen = true;
    // The compare-and-set before a load counts: written, its answer lost; NATS cannot tell whose the lock is.
    expect(await lock.held()).toBe(true);
    // The release's delete on the revision it knows fails: the lock stands.
    await lock.release();
    expect(nats.locks.entries.get(lockKey('m'))?.operation).toBe('PUT');
    frozen = false;
    await locks.sweep();
    expect(nats.locks.entries.get(lockKey('m'))?.operation).toBe('DEL');
  });
});
