/**
 * Cluster membership as a chart (DESIGN.md section 8, docs/cluster.md): the NATS link's states,
 * the heartbeat as a delayed transition, the registry view as context, and "node gone" and "NATS
 * back" as events that the remote jobs of cluster/remote.ts react to. One actor per node, with
 * `systemId: 'cluster'`, created by cluster/node.ts and drawn by `/debug`.
 */
import { createHash } from 'node:crypto';
import type { KvEntry } from '@nats-io/kv';
import { assign, emit, setup, waitFor, type Actor } from 'xstate';
import { z } from 'zod';
import type { AutoscaleReport } from './autoscale.js';

/** One model as a node reports it in its heartbeat. */
export interface HeldModel {
  task: string;
  /** `loading`, `ready`, `unloading`, `reconfiguring` (models held remotely or unloaded are not listed). */
  state: string;
  slots: number;
  free_slots: number;
  /**
   * Time its slots have spent running jobs since its pool started, summed over the slots, ms (SlotPool `busyMs`, as of
   * the record's `at`): the autoscaler divides its growth between two heartbeats by their interval.
   */
  busy_ms?: number;
  /** Requests waiting for a lease. */
  queued: number;
  active_leases: number;
  resident_bytes: number;
  /**
   * The model's config as registered here, a fingerprint (12 hex digits of a SHA-256): holders with the same config
   * report the same.
   */
  config: string;
  /** The config itself (as another node registers it): a model loaded here by name is known to every node from it. */
  registration?: Record<string, unknown>;
}

/**
 * A node's registry entry, written at every heartbeat. Times in ms since the epoch (the writer's clock: shown, never
 * compared).
 */
export interface NodeRecord {
  node: string;
  /** The node's HTTP URL. */
  url: string | null;
  at: number;
  heartbeat_ms: number;
  /** Available memory (the node's memory probe), bytes. */
  free_bytes: number;
  draining: boolean;
  max_loaded_models: number;
  min_free_memory_mb: number;
  /** Models held here (a local pool), by id. */
  models: Record<string, HeldModel>;
  /** Per autoscaled model this node serves: its wait and the last change it decided (cluster/autoscale.ts). */
  autoscale?: Record<string, AutoscaleReport>;
  /**
   * This node's NATS session (`<boot>.<reconnects>`): changes when its connection to NATS came back
   * (or the process restarted). A request another node sent it before may have been lost with the
   * connection, so that node sends it again (cluster/manage.ts `ask`).
   */
  session?: string;
  /**
   * This process's records counted from 1 (one per write): of two records of one process, the
   * higher is the newer, whichever way each came (the registry watch, which may lag, or a read of
   * the registry). Absent from nodes of earlier versions.
   */
  seq?: number;
}

/**
 * Whether `next` is not newer than `known`: both written by the same process (the boot part of
 * `session`) and `next`'s `seq` no higher. A lagging registry watch then cannot take a node's view
 * back to a heartbeat older than one read from the registry. False when either has no `seq`.
 */
export function notNewer(known: NodeRecord | undefined, next: NodeRecord): boolean {
  const boot = (r: NodeRecord): string | undefined => r.session?.split('.')[0];
  return known?.seq !== undefined && next.seq !== undefined && boot(known) === boot(next) && next.seq <= known.seq;
}

/**
 * Whether a record read from the registry (written at `seen`, ms since the epoch) is newer than the
 * view's `known`: by its writer's count ({@link notNewer}) when both have one, else heard of later.
 */
export const readIsNewer = (known: Seen | undefined, record: NodeRecord, seen: number): boolean =>
  record.seq !== undefined && known?.record.seq !== undefined
    ? !notNewer(known.record, record)
    : (known?.seen ?? -1) < seen;

/** A registry entry plus when this node last heard of it (ms since the epoch, this node's clock). */
export interface Seen {
  record: NodeRecord;
  seen: number;
}

/** The membership chart's context. */
export interface MembershipContext {
  /** This node's name (its own record is not judged). */
  self: string;
  heartbeatMs: number;
  /** Every node's last heartbeat as heard here. */
  view: ReadonlyMap<string, Seen>;
  /** Nodes taken for gone, with when (this node's clock): not live until heard of after that. */
  gone: ReadonlyMap<string, number>;
  /** How often NATS came back (part of this node's session name). */
  reconnects: number;
  /** When NATS was lost (this node's clock), while it is. */
  disconnectedAt: number;
}

/** Events of the membership chart. */
export type MembershipEvent =
  /** A registry entry written (`record`) or deleted (null); `seen` on this node's clock. */
  | { type: 'RECORD'; node: string; record: NodeRecord | null; seen: number }
  /** nats.js reported the connection lost (`disconnect`, `reconnecting`, or missed pings). */
  | { type: 'NATS.LOST' }
  /** nats.js reconnected. */
  | { type: 'NATS.BACK' }
  /** A node is taken for gone (no responders, no reply within the job deadline, missed heartbeats). */
  | { type: 'GONE'; node: string; why: string }
  /** Publish a heartbeat now (a model's state changed). */
  | { type: 'BEAT' }
  /** Jobs are in flight to other nodes (`START`: probe their holders every `probe` delay) or none is (`STOP`). */
  | { type: 'PROBE.START' }
  | { type: 'PROBE.STOP' }
  | { type: 'CLOSE' };

/**
 * What the chart emits: `gone` (jobs in flight to the node are sent again), `back` (every request in flight is sent
 * again), `lost` (NATS lost: jobs in flight of a model this node holds too run here).
 */
export type MembershipEmitted = { type: 'gone'; node: string; why: string } | { type: 'back' } | { type: 'lost' };

/** How often an ingress checks the nodes it has jobs in flight to (a ping; missed heartbeats), ms. */
export const PROBE_MS = 50;

/** Nodes heard of within 3 of their heartbeats, and not taken for gone since, at `now` (this node's clock). */
export function liveNodes(ctx: MembershipContext, now = Date.now()): NodeRecord[] {
  return [...ctx.view.values()]
    .filter((s) => now - s.seen <= 3 * s.record.heartbeat_ms && !((ctx.gone.get(s.record.node) ?? -1) >= s.seen))
    .map((s) => s.record);
}

/**
 * The membership chart: `connected` (heartbeats published every `heartbeat` delay, and sooner
 * after `BEAT`; while jobs are in flight, their holders probed every `probe` delay) and `disconnected` (nothing
 * published; remote work
 * waits within its busy timeout), then `closed`. The registry view follows `RECORD` in either
 * state. Going back to `connected` gives the nodes that were live when NATS went 3 heartbeats from
 * now to be heard again (this node could not hear them: no sign they are gone) and emits `back`.
 * Actions `publish` and `probe` are provided by cluster/node.ts (a spec gives fakes).
 */
export const membershipMachine = setup({
  types: {
    context: {} as MembershipContext,
    events: {} as MembershipEvent,
    emitted: {} as MembershipEmitted,
    input: {} as { self: string; heartbeatMs: number },
  },
  actions: {
    /** Writes this node's registry entry (cluster/node.ts). */
    publish: () => {},
    /** Pings the nodes jobs are in flight to (cluster/remote.ts). */
    probe: () => {},
  },
  delays: {
    heartbeat: ({ context }) => context.heartbeatMs,
    probe: PROBE_MS,
    /** Several model changes in a row make one heartbeat. */
    soon: 20,
  },
}).createMachine({
  id: 'membership',
  context: ({ input }) => ({
    self: input.self,
    heartbeatMs: input.heartbeatMs,
    view: new Map(),
    gone: new Map(),
    reconnects: 0,
    disconnectedAt: 0,
  }),
  initial: 'connected',
  on: {
    RECORD: {
      guard: ({ context, event }) => !event.record || !notNewer(context.view.get(event.node)?.record, event.record),
      actions: assign({
        view: ({ context, event }) => {
          const view = new Map(context.view);
          if (event.record) view.set(event.node, { record: event.record, seen: event.seen });
          else view.delete(event.node);
          return view;
        },
      }),
    },
    CLOSE: '.closed',
  },
  states: {
    connected: {
      entry: 'publish',
      type: 'parallel',
      on: {
        'NATS.LOST': {
          target: 'disconnected',
          actions: [assign({ disconnectedAt: () => Date.now() }), emit({ type: 'lost' as const })],
        },
        GONE: {
          guard: ({ context, event }) => event.node !== context.self,
          actions: [
            assign({ gone: ({ context, event }) => new Map(context.gone).set(event.node, Date.now()) }),
            emit(({ event }) => ({ type: 'gone' as const, node: event.node, why: event.why })),
          ],
        },
      },
      states: {
        heartbeat: {
          initial: 'waiting',
          states: {
            waiting: {
              after: { heartbeat: { target: 'waiting', reenter: true, actions: 'publish' } },
              on: { BEAT: 'soon' },
            },
            soon: { after: { soon: { target: 'waiting', actions: 'publish' } } },
          },
        },
        holders: {
          initial: 'idle',
          states: {
            idle: { on: { 'PROBE.START': 'probing' } },
            probing: {
              after: { probe: { target: 'probing', reenter: true, actions: 'probe' } },
              on: { 'PROBE.STOP': 'idle' },
            },
          },
        },
      },
    },
    disconnected: {
      on: {
        'NATS.BACK': {
          target: 'connected',
          actions: [
            assign(({ context }) => {
              const now = Date.now();
              const view = new Map<string, Seen>();
              for (const [k, v] of context.view)
                view.set(
                  k,
                  v.seen >= context.disconnectedAt - 3 * v.record.heartbeat_ms
                    ? { ...v, seen: Math.max(v.seen, now) }
                    : v,
                );
              return { view, reconnects: context.reconnects + 1 };
            }),
            emit({ type: 'back' as const }),
          ],
        },
      },
    },
    closed: { type: 'final' },
  },
});

/** A running membership chart. */
export type Membership = Actor<typeof membershipMachine>;

/**
 * The `RECORD` event for a registry entry: `seen` is its write time when written before `started` (read at join), else
 * now.
 */
export function recordEvent(e: KvEntry, started: number): MembershipEvent {
  const node = e.key.slice('node.'.length);
  const record = e.operation === 'PUT' ? parseRecord(e) : null;
  if (!record) return { type: 'RECORD', node, record: null, seen: 0 };
  const created = e.created.getTime();
  return { type: 'RECORD', node, record, seen: created < started ? created : Date.now() };
}

const finite = z.number().finite();
/** The fields of a registry entry the cluster reads (others are kept as they are). */
const recordSchema = z.looseObject({
  node: z.string(),
  url: z.string().nullable(),
  at: finite,
  heartbeat_ms: finite.positive(),
  free_bytes: finite,
  draining: z.boolean(),
  max_loaded_models: finite,
  min_free_memory_mb: finite,
  models: z.record(
    z.string(),
    z.looseObject({
      task: z.string(),
      state: z.string(),
      slots: finite.int().positive(),
      free_slots: finite,
      busy_ms: finite.optional(),
      queued: finite,
      active_leases: finite,
      resident_bytes: finite,
      config: z.string(),
    }),
  ),
  session: z.string().optional(),
  seq: finite.int().optional(),
});

/**
 * A registry entry's record, or null when it is not one a node writes (not JSON, or a field
 * missing or of the wrong type: anyone who can write to the bucket could put it there). Such an
 * entry counts as no node, and following the registry goes on (before, one ended every node's
 * watch for good).
 */
export function parseRecord(e: KvEntry): NodeRecord | null {
  try {
    const r = recordSchema.safeParse(e.json());
    return r.success && r.data.node === e.key.slice('node.'.length) ? (r.data as unknown as NodeRecord) : null;
  } catch {
    return null;
  }
}

/**
 * Resolves at the chart's next change (a registry entry, a node gone, NATS lost or back) or after
 * `ms`, whichever comes first: an event-driven wait, never a poll.
 */
export function nextChange(m: Membership, ms: number): Promise<void> {
  return new Promise((resolve) => {
    const first = m.getSnapshot();
    const value = JSON.stringify(first.value);
    const done = (): void => {
      clearTimeout(timer);
      sub.unsubscribe();
      resolve();
    };
    const timer = setTimeout(done, Math.max(0, ms));
    const sub = m.subscribe((s) => {
      if (s.context !== first.context || s.status !== first.status || JSON.stringify(s.value) !== value) done();
    });
  });
}

/** Waits up to `ms` for `pred` (re-judged at each change of the chart). @returns whether it held. */
export async function until(m: Membership, pred: () => boolean, ms: number): Promise<boolean> {
  if (pred()) return true;
  if (!(ms > 0)) return false;
  try {
    await waitFor(m, () => pred(), { timeout: ms });
    return true;
  } catch {
    return pred();
  }
}

/**
 * A registration's fingerprint (12 hex digits of a SHA-256): holders with the same config report the same ({@link
 * HeldModel.config}).
 */
export function fingerprint(registration: Record<string, unknown> | undefined): string {
  if (!registration) return '';
  return createHash('sha256').update(JSON.stringify(registration)).digest('hex').slice(0, 12);
}
