/**
 * An in-memory NATS for the cluster's interleaving suite (spec/cluster/interleavings.spec.ts): only
 * what cluster/node.ts uses of a {@link NatsLink}, with every message and key-value operation taking
 * one `step` (fast-check's scheduler there), so their order is explored. Time is the caller's
 * (vi fake timers: request timeouts, `created` dates).
 *
 * - Core: `subscribe` (exact subjects and `prefix.>`), `publish` (with a reply subject), `request`
 *   (a timeout), `flush`, `close`, `status` (no events: the connection never drops by itself), `info`.
 *   Messages from one connection reach one subscription in the order they were sent. A message
 *   with a reply subject that nobody subscribes to is answered on that subject by a no-responders
 *   status (empty data, header code 503), as nats-server does for clients with headers on; a
 *   `request` then fails at once with nats.js's `RequestError` whose cause is `NoRespondersError`.
 * - Key-value buckets (`nodes`, `locks`): `put`, `get`, `keys`, `create` and `update` (compare-and-set on the
 *   key's last revision; `create` succeeds on an absent or deleted key), `delete` (with
 *   `previousSeq`: compare-and-set too), `watch` (the last entry per key, then every write, in
 *   order). Revisions are one sequence per bucket, as in JetStream.
 * - Faults: {@link FakeNats.stall} holds a connection's traffic both ways (a paused process or a
 *   network cut: the server keeps its subscriptions, so senders get no "no responders"; its
 *   operations go through in order when {@link FakeNats.heal}ed); {@link FakeNats.kill} ends it as a
 *   dead process's connection (its subscriptions gone, its messages dropped, its key-value
 *   operations failing); {@link FakeNats.dropNext} loses the next message of a kind in transit (core
 *   NATS delivers at most once: a slow consumer's overflow, a route cut between servers), its sender
 *   none the wiser; {@link FakeNats.lag} delays a connection's watches.
 */
import type { KvEntry } from '@nats-io/kv';
import { createInbox, errors, type Msg } from '@nats-io/transport-node';
import type { NatsLink } from '../../cluster/nats.js';

/** Waits for one step's turn (the suite passes fast-check's scheduler; `label` names it in a counterexample). */
export type Step = (label: string) => Promise<void>;

type Callback = (err: Error | null, m: Msg) => void;

/** One client connection. */
class Conn {
  /** `lost`: NATS lost it (see {@link FakeNats.lose}). */
  state: 'up' | 'stalled' | 'lost' | 'dead' | 'closed' = 'up';
  /** Its key-value watches hear each write this long after it was made, ms ({@link FakeNats.lag}). */
  lagMs = 0;
  /** Bumped when the connection is lost: messages routed to it before are dropped. */
  epoch = 0;
  /** Status events not yet read, and the reader waiting for one. */
  private readonly events: { type: string; server?: string }[] = [];
  private wakeStatus: (() => void) | null = null;
  /** Traffic held while stalled, released in order by `heal`. */
  held: (() => void)[] = [];
  /** The connection's outgoing messages, in order. */
  out: Promise<void> = Promise.resolve();
  readonly subs = new Set<Sub>();
  readonly watchers = new Set<Watcher>();
  /** Requests waiting for a reply: a closed connection fails them (as nats.js does). */
  readonly requests = new Set<(e: Error) => void>();
  private ended!: () => void;
  readonly closedP = new Promise<void>((r) => (this.ended = r));

  constructor(readonly name: string) {}

  /** Resolves once the connection is not stalled. */
  async gate(): Promise<void> {
    while (this.state === 'stalled' || this.state === 'lost') await new Promise<void>((r) => this.held.push(r));
  }
  /** A status event for `status()` (nats.js: `disconnect`, `reconnect`). */
  emit(e: { type: string; server?: string }): void {
    this.events.push(e);
    this.wakeStatus?.();
  }
  /** The next status event, or null once the connection has closed. */
  async nextStatus(): Promise<{ type: string; server?: string } | null> {
    for (;;) {
      const e = this.events.shift();
      if (e) return e;
      if (this.state === 'dead' || this.state === 'closed') return null;
      await Promise.race([new Promise<void>((r) => (this.wakeStatus = r)), this.closedP]);
    }
  }
  end(): void {
    this.ended();
  }
}

interface Sub {
  conn: Conn;
  subject: string;
  callback: Callback;
  /** Deliveries to it, in order. */
  chain: Promise<void>;
  closed: boolean;
}

const matches = (pattern: string, subject: string): boolean =>
  pattern === subject || (pattern.endsWith('.>') && subject.startsWith(pattern.slice(0, -1)));

const empty = new Uint8Array(0);
/** A subject for a step's label: inbox names are random, so they are left out (a replay's labels are the same). */
const short = (subject: string): string => subject.replace(/^_INBOX\.[A-Za-z0-9]+/, 'inbox');

/** An async iterator of one watch: entries pushed in order, ended with its connection. */
class Watcher implements AsyncIterableIterator<KvEntry> {
  private readonly buffer: KvEntry[] = [];
  private wake: (() => void) | null = null;
  private done = false;
  chain: Promise<void> = Promise.resolve();

  constructor(
    readonly conn: Conn,
    /** The bucket's name. */
    readonly bucket: string,
    /** The watched keys: a key or `prefix.>`. */
    readonly key: string,
  ) {}
  push(e: KvEntry): void {
    if (this.done) return;
    this.buffer.push(e);
    this.wake?.();
  }
  stop(): void {
    this.done = true;
    this.wake?.();
  }
  async next(): Promise<IteratorResult<KvEntry>> {
    while (!this.buffer.length && !this.done) await new Promise<void>((r) => (this.wake = r));
    this.wake = null;
    const e = this.buffer.shift();
    return e ? { value: e, done: false } : { value: undefined, done: true };
  }
  async return(): Promise<IteratorResult<KvEntry>> {
    this.stop();
    return { value: undefined, done: true };
  }
  [Symbol.asyncIterator](): this {
    return this;
  }
}

/** A write to a bucket, as the suite observes it. */
export interface KvWrite {
  bucket: string;
  key: string;
  /** The key's entry before the write (undefined: never written). */
  before: KvEntry | undefined;
  after: KvEntry;
  /** The writing connection's name. */
  by: string;
}

/** One key-value bucket. */
class Bucket {
  private seq = 0;
  readonly entries = new Map<string, KvEntry>();

  constructor(
    readonly name: string,
    private readonly bus: FakeNats,
  ) {}

  write(by: Conn, key: string, value: Uint8Array, operation: 'PUT' | 'DEL'): number {
    const revision = ++this.seq;
    const text = new TextDecoder().decode(value);
    const after: KvEntry = {
      bucket: this.name,
      key,
      value,
      created: new Date(),
      revision,
      operation,
      length: value.length,
      rawKey: key,
      json: <T>() => JSON.parse(text) as T,
      string: () => text,
    };
    const before = this.entries.get(key);
    this.entries.set(key, after);
    this.bus.onWrite?.({ bucket: this.name, key, before, after, by: by.name });
    for (const c of this.bus.conns)
      for (const w of c.watchers) if (w.bucket === this.name && matches(w.key, key)) this.bus.toWatcher(w, after);
    return revision;
  }

  /** The bucket as one connection sees it: every operation is a step, held while the connection is stalled. */
  view(conn: Conn): unknown {
    const op = async <T>(label: string, apply: () => T): Promise<T> => {
      if (conn.state !== 'lost') await conn.gate();
      await this.bus.step(`${conn.name} kv ${this.name} ${label}`);
      if (conn.state === 'dead' || conn.state === 'closed') throw new errors.ClosedConnectionError();
      if (conn.state === 'lost') throw new errors.TimeoutError();
      this.bus.count(`${this.name} ${label.split(' ')[0]}`);
      return apply();
    };
    const last = (key: string): number => this.entries.get(key)?.revision ?? 0;
    const isLive = (key: string): boolean => this.entries.get(key)?.operation === 'PUT';
    return {
      put: (key: string, value: Uint8Array) => op(`put ${key}`, () => this.write(conn, key, value, 'PUT')),
      get: (key: string) => op(`get ${key}`, () => this.entries.get(key) ?? null),
      keys: (filter: string) =>
        op(`keys ${filter}`, () =>
          [...this.entries.values()].filter((e) => e.operation === 'PUT' && matches(filter, e.key)).map((e) => e.key),
        ),
      create: (key: string, value: Uint8Array) =>
        op(`create ${key}`, () => {
          if (isLive(key)) throw new Error(`wrong last sequence: ${last(key)}`);
          return this.write(conn, key, value, 'PUT');
        }),
      update: (key: string, value: Uint8Array, version: number) =>
        op(`update ${key}@${version}`, () => {
          if (last(key) !== version) throw new Error(`wrong last sequence: ${last(key)}`);
          return this.write(conn, key, value, 'PUT');
        }),
      delete: (key: string, opts?: { previousSeq?: number }) =>
        op(`delete ${key}${opts?.previousSeq !== undefined ? `@${opts.previousSeq}` : ''}`, () => {
          if (opts?.previousSeq !== undefined && last(key) !== opts.previousSeq)
            throw new Error(`wrong last sequence: ${last(key)}`);
          this.write(conn, key, empty, 'DEL');
        }),
      watch: (opts: { key: string }) =>
        op(`watch ${opts.key}`, () => {
          const w = new Watcher(conn, this.name, opts.key);
          conn.watchers.add(w);
          for (const e of this.entries.values()) if (matches(opts.key, e.key)) w.push(e);
          return w;
        }),
    };
  }
}

/** The in-memory NATS server: {@link connect} gives a node its link. */
export class FakeNats {
  readonly conns = new Set<Conn>();
  readonly nodes = new Bucket('nodes', this);
  readonly locks = new Bucket('locks', this);
  /** What subscription callbacks threw (a violation for the suite: nats.js would log and go on). */
  readonly errors: unknown[] = [];
  /**
   * Messages routed, by kind: the last token of a node subject (`job`, `load`, `ping`, ...), `reply`,
   * `no responders`, and key-value operations by bucket and name (`locks create`, ...).
   */
  readonly sent: Record<string, number> = {};
  /** Kinds (as counted in {@link sent}) whose next message is lost in transit, see {@link dropNext}. */
  private readonly toDrop: string[] = [];
  /** Called on every key-value write (the suite records lock take-overs). */
  onWrite?: (w: KvWrite) => void;

  constructor(readonly step: Step = async () => {}) {}

  /** A connection named `name` (a node's name): the link cluster/node.ts takes instead of connecting. */
  connect(name: string): NatsLink {
    const conn = new Conn(name);
    this.conns.add(conn);
    const nc = {
      info: { max_payload: 1024 * 1024 },
      subscribe: (subject: string, opts: { callback: Callback }) => {
        const sub: Sub = { conn, subject, callback: opts.callback, chain: Promise.resolve(), closed: false };
        if (conn.state !== 'dead' && conn.state !== 'closed') conn.subs.add(sub);
        return {
          unsubscribe: () => {
            sub.closed = true;
            conn.subs.delete(sub);
          },
        };
      },
      publish: (subject: string, data?: Uint8Array, opts?: { reply?: string }) => {
        if (conn.state === 'closed') throw new errors.ClosedConnectionError();
        this.send(conn, subject, data ?? empty, opts?.reply);
      },
      request: (subject: string, data: Uint8Array | undefined, opts: { timeout: number }) =>
        new Promise<Msg>((resolve, reject) => {
          if (conn.state === 'closed') return reject(new errors.ClosedConnectionError());
          const inbox = createInbox();
          const sub = nc.subscribe(inbox, {
            callback: (_e, m) => {
              finish();
              if (m.data.length === 0 && m.headers?.code === 503)
                reject(
                  new errors.RequestError(`no responders: '${subject}'`, {
                    cause: new errors.NoRespondersError(subject),
                  }),
                );
              else resolve(m);
            },
          });
          const timer = setTimeout(() => {
            finish();
            reject(new errors.TimeoutError());
          }, opts.timeout);
          const fail = (e: Error): void => {
            finish();
            reject(e);
          };
          const finish = (): void => {
            clearTimeout(timer);
            sub.unsubscribe();
            conn.requests.delete(fail);
          };
          conn.requests.add(fail);
          this.send(conn, subject, data ?? empty, inbox);
        }),
      flush: async () => {
        await conn.gate();
        await this.step(`${conn.name} flush`);
      },
      close: async () => {
        if (conn.state === 'closed') return;
        this.drop(conn);
        conn.state = 'closed';
        for (const fail of [...conn.requests]) fail(new errors.ClosedConnectionError());
      },
      // `disconnect` when it is lost, `reconnect` when it is back; the iteration ends when it closes.
      status: () => ({
        [Symbol.asyncIterator]: () => ({
          next: async () => {
            const e = await conn.nextStatus();
            return e ? { value: e, done: false } : { value: undefined, done: true };
          },
        }),
      }),
    };
    return {
      nc: nc as unknown as NatsLink['nc'],
      nodes: this.nodes.view(conn) as NatsLink['nodes'],
      locks: this.locks.view(conn) as NatsLink['locks'],
    };
  }

  /** Holds every message to and from `name`, and its key-value operations, until {@link heal}. */
  stall(name: string): void {
    for (const c of this.conns) if (c.name === name && c.state === 'up') c.state = 'stalled';
  }

  /**
   * NATS loses `name`'s connection (a server restart, a cut noticed by the client): the client
   * says `disconnect`; its subscriptions are gone from the server meanwhile (requests to them get
   * "no responders", messages to them are lost), what it sends waits in its buffer, its key-value
   * operations fail, and its watches resume where they were when it is back ({@link heal}).
   */
  lose(name: string): void {
    for (const c of this.conns) {
      if (c.name !== name || (c.state !== 'up' && c.state !== 'stalled')) continue;
      c.state = 'lost';
      c.epoch++;
      c.emit({ type: 'disconnect' });
    }
  }

  /** Lets a stalled or lost connection's traffic go, in the order it was held (a lost one says `reconnect` first). */
  heal(name: string): void {
    for (const c of this.conns) {
      if (c.name !== name || (c.state !== 'stalled' && c.state !== 'lost')) continue;
      if (c.state === 'lost') c.emit({ type: 'reconnect', server: 'nats://fake:4222' });
      c.state = 'up';
      for (const go of c.held.splice(0)) go();
    }
  }

  /** Ends `name`'s connection as its process's death does: no goodbye, its subscriptions gone at once. */
  kill(name: string): void {
    for (const c of this.conns) {
      if (c.name !== name || c.state === 'dead' || c.state === 'closed') continue;
      this.drop(c);
      c.state = 'dead';
      for (const go of c.held.splice(0)) go();
    }
  }

  /**
   * The next message of `kind` routed is lost (counted as `dropped <kind>` in {@link sent}): `reply` a
   * reply to a request, else the last token of a node subject (`load`, `unload`, `job`, `part`, `info`,
   * `ping`). Nobody is told: a request waits for its timeout, as over nats-server.
   */
  dropNext(kind: string): void {
    this.toDrop.push(kind);
  }

  /**
   * `name`'s key-value watches hear each later write `ms` after it was made (0: at once), in order: a
   * registry watch lagging behind (a slow consumer, a far JetStream replica).
   */
  lag(name: string, ms: number): void {
    for (const c of this.conns) if (c.name === name) c.lagMs = ms;
  }

  /** How many losses asked for by {@link dropNext} are still to come. */
  get dropsPending(): number {
    return this.toDrop.length;
  }

  /** Messages are no longer lost: the losses asked for by {@link dropNext} and not yet made are forgotten. */
  dropNone(): void {
    this.toDrop.length = 0;
  }

  /** Whether `name`'s connection is up or stalled (not killed or closed). */
  alive(name: string): boolean {
    return [...this.conns].some((c) => c.name === name && c.state !== 'dead' && c.state !== 'closed');
  }

  private drop(conn: Conn): void {
    for (const s of conn.subs) s.closed = true;
    conn.subs.clear();
    for (const w of conn.watchers) w.stop();
    conn.watchers.clear();
    conn.end();
  }

  /** A message from `from` (one step, in the sender's order), routed when it reaches the server. */
  private send(from: Conn, subject: string, data: Uint8Array, reply?: string): void {
    if (from.state === 'dead') return;
    from.out = from.out
      .then(() => from.gate())
      .then(() => this.step(`${from.name} -> ${short(subject)}${reply ? ` (reply ${short(reply)})` : ''}`))
      .then(() => {
        if (from.state !== 'dead' && from.state !== 'closed') this.route(subject, data, reply);
      });
  }

  count(kind: string): void {
    this.sent[kind] = (this.sent[kind] ?? 0) + 1;
  }

  private route(subject: string, data: Uint8Array, reply?: string, headers?: { code: number }): void {
    const targets = [...this.conns]
      .filter((c) => c.state !== 'lost')
      .flatMap((c) => [...c.subs].filter((s) => matches(s.subject, subject)));
    const kind = headers ? 'no responders' : subject.startsWith('_INBOX.') ? 'reply' : subject.split('.').pop()!;
    const drop = this.toDrop.indexOf(kind);
    if (drop >= 0) {
      this.toDrop.splice(drop, 1);
      return this.count(`dropped ${kind}`);
    }
    this.count(kind);
    if (!targets.length) {
      // nats-server answers a request nobody listens to with a 503 status on its reply subject.
      if (reply && !headers) this.route(reply, empty, undefined, { code: 503 });
      return;
    }
    for (const sub of targets) {
      const text = (): string => new TextDecoder().decode(data);
      const msg = {
        subject,
        sid: 0,
        reply,
        data,
        headers,
        respond: (payload?: Uint8Array) => {
          if (!reply || sub.conn.state === 'dead' || sub.conn.state === 'closed') return false;
          this.send(sub.conn, reply, payload ?? empty);
          return true;
        },
        json: <T>() => JSON.parse(text()) as T,
        string: text,
      } as unknown as Msg;
      const epoch = sub.conn.epoch;
      sub.chain = sub.chain
        .then(() => sub.conn.gate())
        .then(() => {
          // Lost with the connection if it dropped meanwhile.
          if (!sub.closed && sub.conn.epoch === epoch) sub.callback(null, msg);
        })
        .catch((e: unknown) => void this.errors.push(e));
    }
  }

  /** A bucket write reaching one watcher: a step of its own, in the watcher's order. */
  toWatcher(w: Watcher, e: KvEntry): void {
    const due = Date.now() + w.conn.lagMs;
    w.chain = w.chain
      .then(() => (Date.now() < due ? new Promise<void>((r) => setTimeout(r, due - Date.now())) : undefined))
      .then(() => w.conn.gate())
      .then(() => this.step(`${w.conn.name} hears ${e.bucket} ${e.operation} ${e.key}`))
      .then(() => w.push(e));
  }
}
