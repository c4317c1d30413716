/**
 * The cluster's NATS side (docs/cluster.md): the connection with NATS's own auth and TLS options,
 * the two key-value buckets (the node registry and the cold-load locks), and the wire form of
 * jobs and results. Nothing here knows the model entries: cluster/node.ts does.
 */
import { readFileSync } from 'node:fs';
import { hostname } from 'node:os';
import {
  connect,
  credsAuthenticator,
  nkeyAuthenticator,
  type NatsConnection,
  type NodeConnectionOptions,
} from '@nats-io/transport-node';
import { jetstream, jetstreamManager, type JetStreamManager } from '@nats-io/jetstream';
import { Kvm, type KV } from '@nats-io/kv';
import type { Logger } from 'pino';
import { assign, createActor, fromPromise, setup, waitFor } from 'xstate';
import type { ClusterConfig } from '../runtime/config.js';
import { fromWire, voxError, type VoxError } from '../runtime/errors.js';
import {
  decodeFrame,
  encodeFrame,
  OWW,
  SILERO,
  type FromSlot,
  type Job,
  type JobResult,
  type ToSlot,
} from '../runtime/slots/slot-protocol.js';

/** The settings of a cluster node with every default applied. */
export interface ClusterSettings extends ClusterConfig {
  node: string;
}

/** Fills in the node name: the config's, else the host name and process id (subject-safe). */
export function clusterSettings(config: ClusterConfig): ClusterSettings {
  const node =
    config.node ??
    `${hostname()
      .replace(/[^A-Za-z0-9_-]/g, '-')
      .slice(0, 48)}-${process.pid}`;
  return { ...config, node };
}

/** The NATS URLs of `nats` (comma-separated; a bare host:port gets `nats://`). */
export function natsServers(nats: string): string[] {
  return nats
    .split(',')
    .map((u) => u.trim())
    .filter(Boolean)
    .map((u) => (u.includes('://') ? u : `nats://${u}`));
}

/**
 * `text` with NATS credentials hidden: the user-info part of every URL (`nats://user:pass@host`,
 * `nats://token@host`) and the literal `token` and `pass` of the settings become `***`. Every
 * message and log line that names the NATS URL goes through it.
 */
export function redact(text: string, s?: Pick<ClusterConfig, 'token' | 'pass'>): string {
  let out = text.replace(/([a-z][a-z0-9+.-]*:\/\/)[^@/\s,]+@/gi, '$1***@');
  for (const secret of [s?.token, s?.pass]) if (secret) out = out.split(secret).join('***');
  return out;
}

/**
 * nats.js connection options from the cluster config: user/pass, token, nkey seed file, creds
 * file, TLS CA/cert/key files. The client reconnects by itself for as long as the node runs.
 */
export function natsOptions(s: ClusterSettings): NodeConnectionOptions {
  const opts: NodeConnectionOptions = {
    servers: natsServers(s.nats),
    name: `voxserve ${s.node}`,
    timeout: s.connect_timeout_ms,
    maxReconnectAttempts: -1,
    reconnectTimeWait: 500,
    // A frozen server or a cut link is noticed within about 3 heartbeats (nats.js's default is two minutes).
    pingInterval: Math.max(500, s.heartbeat_ms),
    maxPingOut: 3,
  };
  if (s.user) opts.user = s.user;
  if (s.pass) opts.pass = s.pass;
  if (s.token) opts.token = s.token;
  if (s.creds_file) opts.authenticator = credsAuthenticator(readFileSync(s.creds_file));
  else if (s.nkey_seed_file)
    opts.authenticator = nkeyAuthenticator(new TextEncoder().encode(readFileSync(s.nkey_seed_file, 'utf8').trim()));
  if (s.tls) opts.tls = { caFile: s.tls.ca_file, certFile: s.tls.cert_file, keyFile: s.tls.key_file };
  return opts;
}

/** A connected node's NATS handles. */
export interface NatsLink {
  nc: NatsConnection;
  /** The registry: one key per node (`node.<name>`), its last heartbeat. */
  nodes: KV;
  /** Cold-load locks: one key per model being placed. */
  locks: KV;
  /**
   * Opens the buckets again, creating them if NATS lost them (a server restarted without its
   * JetStream store); `nodes` and `locks` then name the new ones. Absent on the in-memory NATS.
   * @throws Error when JetStream does not answer within its timeout.
   */
  reopen?(): Promise<void>;
  /**
   * How many servers hold a copy of each bucket (its stream's replicas), as last opened; absent on
   * the in-memory NATS.
   */
  replicas?: BucketReplicas;
}

/** The replicas of the two buckets' streams (1, or 3 on a NATS cluster of 3 or more servers). */
export interface BucketReplicas {
  nodes: number;
  locks: number;
}

/**
 * The replicas the buckets should have on the NATS that `nc` is connected to: 3 when the server's
 * INFO names a cluster of 3 or more servers (`connect_urls`, which the servers gossip as routes
 * form), else 1 (JetStream refuses 3 replicas on fewer servers).
 */
export function wantedReplicas(nc: NatsConnection): number {
  return (nc.info?.connect_urls?.length ?? 1) >= 3 ? 3 : 1;
}

/**
 * The NATS side of `GET /v1/cluster` (docs/http-api.md): the configured URL(s) with credentials
 * hidden, the name of the server this node is connected to (null when none), the servers of the
 * NATS cluster as that server names them (`host:port`; the configured URLs when it names none),
 * and each bucket's replicas (null on the in-memory NATS).
 */
export function natsSide(
  link: NatsLink,
  s: ClusterSettings,
): { url: string; server: string | null; servers: string[]; replicas: BucketReplicas | null } {
  const urls = link.nc.info?.connect_urls;
  const servers = urls?.length ? [...urls].sort() : natsServers(s.nats).map((u) => redact(u, s));
  return {
    url: redact(s.nats, s),
    server: link.nc.info?.server_name ?? null,
    servers,
    replicas: link.replicas ?? null,
  };
}

/**
 * Raises the replicas of bucket `bucket`'s stream (`KV_<bucket>`) to `want` when it has fewer (a
 * bucket created on one server that became a cluster of three, or by an older voxserve);
 * nats-server 2.9 moves the data itself. When NATS refuses, a warning names the bucket and the
 * command that does it, and the bucket goes on with the replicas it has.
 * @returns the stream's replicas after the attempt.
 */
async function ensureReplicas(jsm: JetStreamManager, bucket: string, want: number, log?: Logger): Promise<number> {
  const stream = `KV_${bucket}`;
  const info = await jsm.streams.info(stream);
  const has = info.config.num_replicas || 1;
  if (has >= want) return has;
  try {
    const updated = await jsm.streams.update(stream, { ...info.config, num_replicas: want });
    log?.info({ bucket, replicas: want }, 'cluster: NATS bucket scaled up to the NATS cluster');
    return updated.config.num_replicas;
  } catch (e) {
    log?.warn(
      { bucket, replicas: has, want, err: (e as Error).message },
      `cluster: NATS bucket ${bucket} has ${has} replica(s) on a cluster of ${want} or more servers; ` +
        `losing the server that holds it stops placement: run \`nats stream edit ${stream} --replicas ${want}\``,
    );
    return has;
  }
}

/**
 * How long a registry entry outlives its last heartbeat in the bucket, ms (liveness is judged by heartbeats, not by
 * this).
 */
const NODES_MAX_AGE_MS = 60_000;
/**
 * How long a lock entry outlives its last renewal in the bucket, ms (a lock's own deadline decides; this only sweeps).
 */
const LOCKS_MAX_AGE_MS = 600_000;

/**
 * Connects to NATS and opens (creating if needed) the registry and lock buckets, with 3 replicas on
 * a NATS cluster of 3 or more servers ({@link wantedReplicas}; buckets found with fewer are scaled
 * up, or a warning on `log` says what to do), else 1. {@link NatsLink.reopen} follows the same rule.
 * @throws Error naming the URL when NATS cannot be reached or refuses the credentials.
 */
export async function connectNats(s: ClusterSettings, log?: Logger): Promise<NatsLink> {
  let nc: NatsConnection;
  try {
    nc = await connect(natsOptions(s));
  } catch (e) {
    throw new Error(redact(`cluster.nats: cannot connect to NATS at ${s.nats}: ${(e as Error).message}`, s));
  }
  // Key-value operations answer within a few heartbeats or fail: no wait in the cluster outlasts a busy timeout.
  const timeout = Math.min(5000, Math.max(1000, 3 * s.heartbeat_ms));
  const kvm = new Kvm(jetstream(nc, { timeout }));
  const replicas: BucketReplicas = { nodes: 1, locks: 1 };
  const bucket = async (which: keyof BucketReplicas, ttl: number): Promise<KV> => {
    const name = `${s.subject_prefix}_${which}`;
    const want = wantedReplicas(nc);
    const kv = await kvm.create(name, { history: 1, ttl, replicas: want });
    replicas[which] = await ensureReplicas(await jetstreamManager(nc, { timeout }), name, want, log);
    return kv;
  };
  const open = async (): Promise<[KV, KV]> => [
    await bucket('nodes', NODES_MAX_AGE_MS),
    await bucket('locks', LOCKS_MAX_AGE_MS),
  ];
  // A NATS cluster that has just started elects its JetStream leader after a moment: tried again until the connect timeout.
  const opening = createActor(openingMachine, { input: { open, timeoutMs: s.connect_timeout_ms } }).start();
  const done = await waitFor(opening, (o) => o.status === 'done');
  const [nodes, locks] = done.context.buckets ?? [];
  if (nodes && locks) {
    const link: NatsLink = {
      nc,
      nodes,
      locks,
      replicas,
      reopen: async () => {
        [link.nodes, link.locks] = await open();
      },
    };
    return link;
  }
  await nc.close().catch(() => {});
  const why = done.context.error
    ? (done.context.error as Error).message
    : `no answer within ${s.connect_timeout_ms} ms`;
  throw new Error(
    redact(
      `cluster.nats: NATS at ${s.nats} has no usable JetStream key-value store (start nats-server with -js): ${why}`,
      s,
    ),
  );
}

/**
 * Opening the buckets at join: `opening` (one try), `waiting` (250 ms after a refusal: a NATS
 * cluster just started has no JetStream leader yet, and NATS raises no event when it has one),
 * until `timeoutMs` ends it in `failed` with the last error. Every wait a delay of the chart.
 */
export const openingMachine = setup({
  types: {
    input: {} as { open: () => Promise<[KV, KV]>; timeoutMs: number },
    context: {} as { open: () => Promise<[KV, KV]>; timeoutMs: number; buckets?: [KV, KV]; error?: unknown },
  },
  actors: { open: fromPromise<[KV, KV], () => Promise<[KV, KV]>>(({ input }) => input()) },
  delays: { retry: 250, deadline: ({ context }) => context.timeoutMs },
}).createMachine({
  id: 'opening',
  context: ({ input }) => input,
  initial: 'trying',
  states: {
    trying: {
      initial: 'opening',
      after: { deadline: 'failed' },
      states: {
        opening: {
          invoke: {
            src: 'open',
            input: ({ context }) => context.open,
            onDone: { target: '#opening.opened', actions: assign({ buckets: ({ event }) => event.output }) },
            onError: { target: 'waiting', actions: assign({ error: ({ event }) => event.error }) },
          },
        },
        waiting: { after: { retry: 'opening' } },
      },
    },
    opened: { type: 'final' },
    failed: { type: 'final' },
  },
});

/** A message of the cluster's job subjects: the slot-host protocol's `run` plus what a holder needs. */
export interface RemoteJob {
  type: 'job';
  /** `<ingress node>:<seq>`: names the job in logs; a re-sent job keeps it. */
  id: string;
  model: string;
  /** How long the job may wait at the holder for a lease and a slot, ms (0 = unbounded). */
  wait_ms: number;
  job: Extract<ToSlot, { type: 'run' }>['job'];
}

/** A holder's answer to a job or an info request. */
export type RemoteReply =
  | { type: 'result'; result: Extract<FromSlot, { type: 'result' }>['result']; ran_ms: number }
  | { type: 'info'; info: Extract<FromSlot, { type: 'loaded' }>['info'] }
  /**
   * `not_held`: the node does not hold the model ready (any more). Else a VoxError's type, and its `code`
   * (docs/errors.md).
   */
  | { type: 'error'; error: string; message: string; retry_after_s?: number; code?: string };

/** A peer's error reply. */
export type ErrorReply = Extract<RemoteReply, { type: 'error' }>;

/** The one encoding of an error for a peer: the VoxError's type and code (docs/errors.md) and its Retry-After. */
export function errorReply(v: VoxError): ErrorReply {
  return { type: 'error', error: v.type, code: v.code, message: v.message, retry_after_s: v.retryAfterS };
}

/** The reply of a node that does not hold the model ready (any more): its ingress sends the job elsewhere. */
export function notHeld(message: string): ErrorReply {
  return { type: 'error', error: 'not_held', message };
}

/**
 * The one decoding of a peer's error reply: the VoxError it stands for (by its code), its message prefixed with the
 * node; `not_held` is 503 `no_holder`.
 */
export function replyError(node: string, r: ErrorReply): VoxError {
  const message = `node ${node}: ${r.message}`;
  return r.error === 'not_held' ? voxError('no_holder', { message }) : fromWire({ code: r.code, message });
}

/** Encodes a job or reply as one binary frame (the slot-host frame: JSON head, Float32Arrays as raw bytes). */
export function encodeMessage(msg: RemoteJob | RemoteReply): Uint8Array {
  return Buffer.concat(encodeFrame(msg as unknown as ToSlot));
}

/**
 * Decodes {@link encodeMessage}'s frame, copied once so that its arrays are aligned views of their own buffer.
 * @param into where to copy it (its first `data.length` bytes; from {@link FrameBuffers}); absent: a new buffer.
 */
export function decodeMessage<T extends RemoteJob | RemoteReply>(data: Uint8Array, into?: Uint8Array): T {
  const own = into ? into.subarray(0, data.length) : new Uint8Array(data.length);
  own.set(data);
  return decodeFrame(own) as T;
}

/**
 * Buffers a holder decodes its peers' jobs into, kept from job to job. Each job's bytes were copied into a new buffer
 * before: V8 counts the bytes of every new ArrayBuffer towards its next mark-compact, and a holder receiving ~10 MB of
 * jobs a second ran one every ~0.85 s (docs/cluster.md "Benchmark").
 */
export class FrameBuffers {
  private readonly free: Uint8Array[] = [];
  /** @param keep the most free buffers kept (more jobs than that at once allocate, as before): at most 8 MiB. */
  constructor(private readonly keep = 8) {}

  /** A buffer of at least `bytes` (a power of two, at least 64 KiB), the caller's until {@link give}n back. */
  take(bytes: number): Uint8Array {
    const i = this.free.findIndex((b) => b.byteLength >= bytes);
    if (i >= 0) return this.free.splice(i, 1)[0];
    return new Uint8Array(Math.max(65_536, 2 ** Math.ceil(Math.log2(bytes))));
  }

  /** Gives `b` (taken here) back: nothing reads the views decoded from it any more. One over 1 MiB is not kept. */
  give(b: Uint8Array): void {
    if (this.free.length < this.keep && b.byteLength <= 1 << 20) this.free.push(b);
  }
}

/**
 * Publishes `data` on `subject`, in parts when it is larger than the server's `max_payload`: each
 * part goes to `<subject>.part` as `[u32 head length][head JSON {id, i, n}][bytes]`, in order (NATS
 * keeps one connection's messages to one subscription in order), the last with the reply
 * subject. An {@link Assembler} on the other side joins them.
 */
export function publishInParts(nc: NatsConnection, subject: string, data: Uint8Array, reply?: string): void {
  const max = nc.info?.max_payload ?? 1024 * 1024;
  if (data.length <= max) return nc.publish(subject, data, reply ? { reply } : undefined);
  const size = max - 256;
  const n = Math.ceil(data.length / size);
  const id = `${Date.now().toString(36)}.${Math.random().toString(36).slice(2)}`;
  for (let i = 0; i < n; i++) {
    const head = Buffer.from(JSON.stringify({ id, i, n }));
    const len = Buffer.alloc(4);
    len.writeUInt32LE(head.length);
    const part = Buffer.concat([len, head, data.subarray(i * size, (i + 1) * size)]);
    nc.publish(`${subject}.part`, part, i === n - 1 && reply ? { reply } : undefined);
  }
}

/** Joins the parts {@link publishInParts} sent. Parts of a message not completed within a minute are dropped. */
export class Assembler {
  private readonly open = new Map<string, { parts: Uint8Array[]; at: number }>();

  /**
   * Adds one part. @returns the whole message once its last part came, else null (also for a part
   * that is not one {@link publishInParts} sends: dropped, never thrown into the NATS client,
   * which would close the connection).
   */
  add(part: Uint8Array): Uint8Array | null {
    const buf = Buffer.from(part.buffer, part.byteOffset, part.byteLength);
    let head: { id?: unknown; i?: unknown; n?: unknown } | null;
    let len: number;
    try {
      len = buf.readUInt32LE(0);
      head = JSON.parse(buf.subarray(4, 4 + len).toString());
    } catch {
      return null;
    }
    if (typeof head?.id !== 'string' || !Number.isInteger(head.n) || !Number.isInteger(head.i)) return null;
    const { id, i, n } = head as { id: string; i: number; n: number };
    if (n < 1 || i < 0 || i >= n) return null;
    const now = Date.now();
    for (const [k, v] of this.open) if (now - v.at > 60_000) this.open.delete(k);
    const entry = this.open.get(id) ?? { parts: [], at: now };
    entry.parts[i] = buf.subarray(4 + len);
    this.open.set(id, entry);
    if (entry.parts.filter(Boolean).length < n) return null;
    this.open.delete(id);
    return Buffer.concat(entry.parts);
  }
}

/** `v` as JSON bytes (registry entries, locks, requests between nodes). */
export const encodeJson = (v: unknown): Uint8Array => new TextEncoder().encode(JSON.stringify(v));

/** The registry key of a node. */
export const nodeKey = (node: string): string => `node.${node}`;

/** A lock key for a model id (ids may hold commas, which keys may not): base64url. */
export const lockKey = (model: string): string => `load.${Buffer.from(model).toString('base64url')}`;

/**
 * Splits a job of several rows (a batch of streams, `counts`) into two jobs of about half the
 * rows each, for a frame over NATS's `max_payload`. Rows are independent and laid out row after
 * row in every field (slot-protocol.ts), so each half is a valid job and the halves' results,
 * concatenated field by field ({@link joinResults}), are the whole job's result.
 * @returns the two halves, or null for a single row (it cannot be split).
 */
export function splitJob(job: Job): [Job, Job] | null {
  // Only the row layouts below are known here; any other job goes in parts (publishInParts).
  if (job.kind !== 'vad' && job.kind !== 'wakeword') return null;
  const counts = job.counts;
  if (!counts || counts.length < 2) return null;
  const k = Math.floor(counts.length / 2);
  const [c1, c2] = [counts.slice(0, k), counts.slice(k)];
  const sum = (c: number[]): number => c.reduce((a, b) => a + b, 0);
  if (job.kind === 'vad') {
    const w = sum(c1) * SILERO.WINDOW;
    const s = k * SILERO.STATE;
    const c = k * SILERO.CONTEXT;
    return [
      {
        kind: 'vad',
        counts: c1,
        windows: job.windows.subarray(0, w),
        state: job.state.subarray(0, s),
        context: job.context.subarray(0, c),
      },
      {
        kind: 'vad',
        counts: c2,
        windows: job.windows.subarray(w),
        state: job.state.subarray(s),
        context: job.context.subarray(c),
      },
    ];
  }
  const a = c1.length * OWW.LOOKBACK + sum(c1) * OWW.STEP;
  const m = (job.mel.length / counts.length) * k;
  const e = (job.embeddings.length / counts.length) * k;
  return [
    {
      kind: 'wakeword',
      counts: c1,
      audio: job.audio.subarray(0, a),
      mel: job.mel.subarray(0, m),
      embeddings: job.embeddings.subarray(0, e),
    },
    {
      kind: 'wakeword',
      counts: c2,
      audio: job.audio.subarray(a),
      mel: job.mel.subarray(m),
      embeddings: job.embeddings.subarray(e),
    },
  ];
}

/**
 * Runs the two halves of a split job ({@link splitJob}) with `run`, at once, and joins their results
 * ({@link joinResults}). Each half's result is copied as it comes: a local process slot's answer is a view into a
 * buffer reused `SLOT_DEPTH` (2) answers later (runtime/slots/slots.ts, `processSlots`), and other jobs' answers may
 * come between the halves' (a model held here behind its remote pool: the first half's rows took a later job's
 * probabilities and states).
 */
export async function runHalves(halves: [Job, Job], run: (half: Job) => Promise<JobResult>): Promise<JobResult> {
  const own = (r: JobResult): JobResult => {
    const out: Record<string, unknown> = { ...r };
    for (const [k, v] of Object.entries(r)) if (v instanceof Float32Array) out[k] = v.slice();
    return out as unknown as JobResult;
  };
  const [a, b] = await Promise.all(halves.map((h) => run(h).then(own)));
  return joinResults(a, b);
}

/** The result of a job split by {@link splitJob}: its halves' results, each field concatenated. */
export function joinResults(a: JobResult, b: JobResult): JobResult {
  const cat = (x: Float32Array, y: Float32Array): Float32Array => {
    const out = new Float32Array(x.length + y.length);
    out.set(x);
    out.set(y, x.length);
    return out;
  };
  const ran: [number, number] | undefined =
    a.ran && b.ran ? [Math.min(a.ran[0], b.ran[0]), Math.max(a.ran[1], b.ran[1])] : undefined;
  if (a.kind === 'vad' && b.kind === 'vad')
    return {
      kind: 'vad',
      probs: cat(a.probs, b.probs),
      state: cat(a.state, b.state),
      context: cat(a.context, b.context),
      ran,
    };
  if (a.kind === 'wakeword' && b.kind === 'wakeword')
    return {
      kind: 'wakeword',
      scores: cat(a.scores, b.scores),
      mel: cat(a.mel, b.mel),
      embeddings: cat(a.embeddings, b.embeddings),
      ran,
    };
  throw new Error('joinResults: results of different kinds');
}
