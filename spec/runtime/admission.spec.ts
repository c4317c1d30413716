import { describe, expect, it } from 'vitest';
import { Admission, effectiveTimeout } from '../../runtime/admission.js';
import { VoxError } from '../../runtime/errors.js';

const tick = (): Promise<void> => new Promise((r) => setImmediate(r));

describe('Admission', () => {
  it('admits up to `places` leases at once, then queues in FIFO order', async () => {
    const a = new Admission(2);
    const l1 = await a.acquire();
    const l2 = await a.acquire();
    const order: number[] = [];
    const p3 = a.acquire().then((l) => (order.push(3), l));
    const p4 = a.acquire().then((l) => (order.push(4), l));
    await tick();
    expect(a.activeLeases).toBe(2);
    expect(a.queued).toBe(2);
    l2.release();
    l1.release();
    await Promise.all([p3, p4]);
    expect(order).toEqual([3, 4]);
    expect(a.activeLeases).toBe(2);
  });

  it('grants an exclusive lease only when no lease is held, and it is a barrier for later requests', async () => {
    const a = new Admission(4);
    const req = await a.acquire();
    let managed = false;
    const mgr = a.acquire({ exclusive: true }).then((l) => ((managed = true), l));
    let later = false;
    const after = a.acquire().then((l) => ((later = true), l));
    await tick();
    expect(managed).toBe(false);
    expect(later).toBe(false); // places are free, but nothing overtakes the waiting manager
    req.release();
    const m = await mgr;
    await tick();
    expect(later).toBe(false);
    m.release();
    (await after).release();
    expect(a.activeLeases).toBe(0);
  });

  it('answers a waiter past its busy timeout with 503 server_busy and Retry-After', async () => {
    const a = new Admission(1);
    const held = await a.acquire();
    const err = await a.acquire({ timeoutMs: 20 }).catch((e) => e);
    expect(err).toBeInstanceOf(VoxError);
    expect(err.type).toBe('server_busy');
    expect(err.status).toBe(503);
    expect(err.retryAfterS).toBe(1);
    expect(a.queued).toBe(0);
    held.release();
  });

  it('removes a waiter whose client went away and dispatches the next', async () => {
    const a = new Admission(1);
    const held = await a.acquire();
    const gone = new AbortController();
    const p = a.acquire({ signal: gone.signal });
    const next = a.acquire();
    gone.abort();
    await expect(p).rejects.toThrow(/went away/);
    expect(a.queued).toBe(1);
    held.release();
    (await next).release();
    expect(a.activeLeases).toBe(0);
  });

  it('release is idempotent', async () => {
    const a = new Admission(1);
    const l = await a.acquire();
    l.release();
    l.release();
    expect(a.activeLeases).toBe(0);
  });
});

describe('effectiveTimeout', () => {
  it('takes the smallest non-zero value, 0 meaning unbounded', () => {
    expect(effectiveTimeout(undefined, undefined, 300000)).toBe(300000);
    expect(effectiveTimeout(50, 1000, 300000)).toBe(50);
    expect(effectiveTimeout(0, 1000, 300000)).toBe(1000);
    expect(effectiveTimeout(0, 0, 0)).toBe(0);
  });
  it('rejects a negative request value with 400', () => {
    expect(() => effectiveTimeout(-1, undefined, 0)).toThrow(/busy_timeout_ms/);
  });
});
