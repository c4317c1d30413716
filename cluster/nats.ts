/**
 * The cluster's NATS side (docs/cluster.md): the connection with NATS's own auth and TLS options,
 * the two key-value buckets (the node registry and the cold-load locks) and their keys. The work nodes send each
 * other is in cluster/wire.ts. Nothing here knows the model entries: cluster/node.ts does.
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

/** `v` as JSON bytes (registry entries, locks, requests between nodes). */
export const encodeJson = (v: unknown): Uint8Array => new TextEncoder().encode(JSON.stringify(v));

/** The registry key of a node. */
export const nodeKey = (node: string): string => `node.${node}`;

/** A lock key for a model id (ids may hold commas, which keys may not): base64url. */
export const lockKey = (model: string): string => `load.${Buffer.from(model).toString('base64url')}`;
