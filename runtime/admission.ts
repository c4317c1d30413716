import { MAX_TIMEOUT_MS } from './config.js';
import { invalid, voxError } from './errors.js';

/** A granted admission: call `release()` once the response is fully written. Idempotent. */
export interface Lease {
  readonly exclusive: boolean;
  /** When it was granted, ms since the epoch. */
  readonly grantedAt: number;
  release(): void;
}

interface Waiter {
  exclusive: boolean;
  enqueuedAt: number;
  onRevoke?: (reason: Error) => void;
  grant: (lease: Lease) => void;
  reject: (err: Error) => void;
  timer?: NodeJS.Timeout;
  cleanup: () => void;
}

/** Options of one acquisition. */
export interface AcquireOptions {
  /** Exclusive (management) lease: granted only when no other lease is held. */
  exclusive?: boolean;
  /** Busy timeout, ms; 0 = wait without bound. */
  timeoutMs?: number;
  /** Aborting leaves the queue at once (the client went away). */
  signal?: AbortSignal;
  /**
   * Called with the reason if the lease is revoked while held (forced unload, shutdown): stop the work. The lease is
   * released right after.
   */
  onRevoke?: (reason: Error) => void;
}

/**
 * Effective busy timeout (DESIGN.md C3): the smallest of the non-zero values, 0 if all are 0
 * (unbounded) or undefined.
 * @throws VoxError `invalid_request_error` for a negative or non-integer request value.
 */
export function effectiveTimeout(request: number | undefined, model: number | undefined, server: number): number {
  if (request !== undefined && (!Number.isInteger(request) || request < 0 || request > MAX_TIMEOUT_MS)) {
    throw invalid('busy_timeout_ms', `must be an integer from 0 to ${MAX_TIMEOUT_MS}, got ${request}`);
  }
  const bounded = [request, model, server].filter((v): v is number => v !== undefined && v > 0);
  return bounded.length ? Math.min(...bounded) : 0;
}

/**
 * A model's admission queue: up to `places` leases at once, one FIFO shared by requests and
 * management (DESIGN.md C1-C3, C5). Dispatch walks from the head: a management head is granted
 * only when no lease is held, a request head takes a free place unless an exclusive lease is held,
 * and a blocked head stops dispatch (a waiting manager is a barrier).
 */
export class Admission {
  private active = 0;
  private exclusiveLease: Lease | null = null;
  private readonly queue: Waiter[] = [];
  private readonly revokers = new Map<Lease, (reason: Error) => void>();
  /**
   * Requests that may wait at once (`max_queued`; 0 = unbounded). A request that would queue
   * past it is refused at once; management waiters are never refused and do not count.
   */
  maxQueued = 0;

  /**
   * @param places max concurrent leases (the model's `max_streams`).
   * @param onChange called after every change of the leases held or the queue (grant, release,
   *   enqueue, leave): the model entry mirrors them into its chart.
   */
  constructor(
    private places: number,
    private readonly onChange: () => void = () => {},
  ) {}

  /** Leases held now. */
  get activeLeases(): number {
    return this.active;
  }

  /** Waiters in the queue. */
  get queued(): number {
    return this.queue.length;
  }

  /** Age of the oldest waiter, ms (0 when none). */
  oldestWaitMs(now = Date.now()): number {
    return this.queue.length ? now - this.queue[0].enqueuedAt : 0;
  }

  /** The exclusive (management) lease, if one is held. */
  get exclusive(): Lease | null {
    return this.exclusiveLease;
  }

  /** Changes the number of places (reconfiguration); dispatch runs again. */
  setPlaces(places: number): void {
    this.places = places;
    this.dispatch();
    this.onChange();
  }

  /**
   * Takes a lease, waiting in FIFO order if needed.
   * @throws VoxError `server_busy` (Retry-After 1 s) at once when `maxQueued` requests already
   *   wait, or once `timeoutMs` passes while queued; an `AbortError` DOMException if `signal`
   *   aborts while queued.
   */
  acquire(opts: AcquireOptions = {}): Promise<Lease> {
    const exclusive = opts.exclusive ?? false;
    if (opts.signal?.aborted) return Promise.reject(new DOMException('the client went away', 'AbortError'));
    if (this.queue.length === 0 && this.canGrant(exclusive)) {
      const lease = this.grant(exclusive, opts.onRevoke);
      this.onChange();
      return Promise.resolve(lease);
    }
    if (!exclusive && this.maxQueued > 0 && this.queue.filter((w) => !w.exclusive).length >= this.maxQueued) {
      return Promise.reject(voxError('queue_full', { max: this.maxQueued }));
    }
    return new Promise<Lease>((resolve, reject) => {
      const w: Waiter = {
        exclusive,
        onRevoke: opts.onRevoke,
        enqueuedAt: Date.now(),
        grant: resolve,
        reject,
        cleanup: () => {
          if (w.timer) clearTimeout(w.timer);
          opts.signal?.removeEventListener('abort', onAbort);
        },
      };
      const leave = (err: Error): void => {
        const i = this.queue.indexOf(w);
        if (i < 0) return;
        this.queue.splice(i, 1);
        w.cleanup();
        reject(err);
        this.dispatch();
        this.onChange();
      };
      const onAbort = (): void => leave(new DOMException('the client went away', 'AbortError'));
      if (opts.timeoutMs && opts.timeoutMs > 0) {
        w.timer = setTimeout(
          () => leave(voxError('busy_timeout', { what: 'lease', ms: opts.timeoutMs! })),
          opts.timeoutMs,
        );
      }
      opts.signal?.addEventListener('abort', onAbort, { once: true });
      this.queue.push(w);
      this.onChange();
    });
  }

  /** Takes a lease only if it can be granted now without waiting; otherwise null. */
  tryAcquire(exclusive = false): Lease | null {
    if (this.queue.length !== 0 || !this.canGrant(exclusive)) return null;
    const lease = this.grant(exclusive);
    this.onChange();
    return lease;
  }

  /**
   * Forced unload: every waiter is answered `err` and leaves the queue; every holder that gave
   * an `onRevoke` has it called and its lease released.
   */
  revokeAll(err: Error): void {
    for (const w of this.queue.splice(0)) {
      w.cleanup();
      w.reject(err);
    }
    this.onChange();
    for (const [lease, revoke] of [...this.revokers]) {
      revoke(err);
      lease.release();
    }
  }

  private canGrant(exclusive: boolean): boolean {
    if (this.exclusiveLease) return false;
    return exclusive ? this.active === 0 : this.active < this.places;
  }

  private grant(exclusive: boolean, onRevoke?: (reason: Error) => void): Lease {
    this.active++;
    let released = false;
    const lease: Lease = {
      exclusive,
      grantedAt: Date.now(),
      release: () => {
        if (released) return;
        released = true;
        this.active--;
        this.revokers.delete(lease);
        if (this.exclusiveLease === lease) this.exclusiveLease = null;
        this.dispatch();
        this.onChange();
      },
    };
    if (exclusive) this.exclusiveLease = lease;
    if (onRevoke) this.revokers.set(lease, onRevoke);
    return lease;
  }

  private dispatch(): void {
    while (this.queue.length && this.canGrant(this.queue[0].exclusive)) {
      const w = this.queue.shift()!;
      w.cleanup();
      w.grant(this.grant(w.exclusive, w.onRevoke));
    }
  }
}
