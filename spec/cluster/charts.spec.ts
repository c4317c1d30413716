/**
 * The cluster's charts alone (issue 40): the membership chart and a placement chart, each created
 * with XState's SimulatedClock and no ClusterNode, no Supervisor. The membership chart's registry
 * view is fed from the in-memory NATS's bucket watch (./fake-nats.ts); a placement's steps are
 * fakes. What each asserts is the chart's documented behaviour (cluster/membership.ts,
 * cluster/placement-chart.ts, docs/cluster.md): heartbeats as delays, NATS lost and back, nodes
 * gone until heard of again, the probe only while jobs are in flight; placements bounded by the
 * busy timeout, waiting for another node's lock, given up after a take-over, ended by ABORT; the
 * buckets opened at join, tried again until the connect timeout.
 */
import { createActor, fromPromise, SimulatedClock } from 'xstate';
import { describe, expect, it } from 'vitest';
import { liveNodes, membershipMachine, recordEvent, type NodeRecord } from '../../cluster/membership.js';
import { placementMachine, type PlacementOutput } from '../../cluster/placement-chart.js';
import { lockMachine, type LoadLock } from '../../cluster/locks.js';
import type { LoadedModel } from '../../runtime/loader.js';
import { FakeNats } from './fake-nats.js';
import { openingMachine } from '../../cluster/nats.js';
import type { KV } from '@nats-io/kv';

const HEARTBEAT_MS = 1000;
const flush = (): Promise<void> => new Promise((r) => setImmediate(r));

function membership() {
  const clock = new SimulatedClock();
  const calls = { publish: 0, probe: 0 };
  const actor = createActor(
    membershipMachine.provide({ actions: { publish: () => void calls.publish++, probe: () => void calls.probe++ } }),
    { clock, input: { self: 'A', heartbeatMs: HEARTBEAT_MS } },
  );
  const emitted: string[] = [];
  actor.on('*', (e) => emitted.push(e.type === 'gone' ? `gone ${e.node}` : e.type));
  actor.start();
  return { actor, clock, calls, emitted };
}

const record = (node: string, heartbeat_ms = HEARTBEAT_MS): NodeRecord => ({
  node,
  url: `http://${node}`,
  at: 0,
  heartbeat_ms,
  free_bytes: 1,
  draining: false,
  max_loaded_models: 0,
  min_free_memory_mb: 0,
  models: {},
});

describe('the membership chart alone (SimulatedClock, in-memory NATS)', () => {
  it('publishes a heartbeat on joining and then every heartbeat_ms, sooner after BEAT, never while disconnected', () => {
    const { actor, clock, calls } = membership();
    expect(actor.getSnapshot().matches('connected')).toBe(true);
    expect(calls.publish).toBe(1);
    clock.increment(HEARTBEAT_MS - 1);
    expect(calls.publish).toBe(1);
    clock.increment(1);
    expect(calls.publish).toBe(2);
    actor.send({ type: 'BEAT' });
    clock.increment(20);
    expect(calls.publish).toBe(3);
    actor.send({ type: 'NATS.LOST' });
    expect(actor.getSnapshot().value).toBe('disconnected');
    clock.increment(5 * HEARTBEAT_MS);
    expect(calls.publish).toBe(3);
    actor.send({ type: 'NATS.BACK' });
    expect(actor.getSnapshot().matches('connected')).toBe(true);
    expect(calls.publish).toBe(4);
    expect(actor.getSnapshot().context.reconnects).toBe(1);
    actor.send({ type: 'CLOSE' });
    expect(actor.getSnapshot().status).toBe('done');
  });

  it('follows the registry bucket; a node taken for gone is not live until a newer heartbeat of it is heard', async () => {
    const { actor, emitted } = membership();
    const bus = new FakeNats(async () => {});
    const link = bus.connect('A');
    const it = await link.nodes.watch({ key: 'node.>' });
    void (async () => {
      for await (const e of it) actor.send(recordEvent(e, 0));
    })();
    const enc = (r: NodeRecord): Uint8Array => new TextEncoder().encode(JSON.stringify(r));
    await link.nodes.put('node.B', enc(record('B')));
    await link.nodes.put('node.C', enc(record('C')));
    await flush();
    const live = (): string[] => liveNodes(actor.getSnapshot().context).map((r) => r.node);
    expect(live()).toEqual(['B', 'C']);
    actor.send({ type: 'GONE', node: 'B', why: 'no responders' });
    expect(emitted).toContain('gone B');
    expect(live()).toEqual(['C']);
    // Its own name is never taken for gone.
    actor.send({ type: 'GONE', node: 'A', why: 'x' });
    expect(emitted).not.toContain('gone A');
    await new Promise((r) => setTimeout(r, 2));
    await link.nodes.put('node.B', enc(record('B')));
    await flush();
    expect(live()).toEqual(['B', 'C']);
    // Missed heartbeats: not live 3 heartbeats after it was last heard of.
    expect(liveNodes(actor.getSnapshot().context, Date.now() + 3 * HEARTBEAT_MS + 50)).toEqual([]);
    await link.nodes.delete('node.C');
    await flush();
    expect(live()).toEqual(['B']);
    it.stop();
  });

  it('NATS back: nodes live when it went get 3 heartbeats afresh, and the chart emits back', async () => {
    const { actor, emitted } = membership();
    const heard = Date.now();
    actor.send({ type: 'RECORD', node: 'B', record: record('B'), seen: heard });
    actor.send({ type: 'NATS.LOST' });
    await new Promise((r) => setTimeout(r, 20));
    actor.send({ type: 'NATS.BACK' });
    expect(emitted).toContain('back');
    expect(actor.getSnapshot().context.view.get('B')!.seen).toBeGreaterThan(heard);
  });

  it("keeps a process's newest record: an older one (a lagging watch's, after a read of the registry) is not taken back", () => {
    const { actor } = membership();
    const at = (seq: number, session = 'boot1.0', models = {}): NodeRecord => ({
      ...record('B'),
      seq,
      session,
      models,
    });
    const held = {
      a: {
        task: 'vad',
        state: 'ready',
        slots: 1,
        free_slots: 1,
        queued: 0,
        active_leases: 0,
        resident_bytes: 0,
        config: 'x',
      },
    };
    const seqOf = (): number | undefined => actor.getSnapshot().context.view.get('B')?.record.seq;
    actor.send({ type: 'RECORD', node: 'B', record: at(5, 'boot1.0', held), seen: 100 });
    actor.send({ type: 'RECORD', node: 'B', record: at(4), seen: 200 });
    expect(seqOf()).toBe(5);
    expect(actor.getSnapshot().context.view.get('B')!.record.models).toHaveProperty('a');
    // A reconnect of the same process counts on; a restarted process (another boot) counts afresh.
    actor.send({ type: 'RECORD', node: 'B', record: at(6, 'boot1.1'), seen: 300 });
    expect(seqOf()).toBe(6);
    actor.send({ type: 'RECORD', node: 'B', record: at(1, 'boot2.0'), seen: 400 });
    expect(seqOf()).toBe(1);
    // A record with no count (an earlier version's node) is taken as it comes.
    actor.send({ type: 'RECORD', node: 'B', record: { ...record('B'), session: 'boot2.0' }, seen: 500 });
    expect(seqOf()).toBeUndefined();
  });

  it('probes holders every 50 ms only between PROBE.START and PROBE.STOP', () => {
    const { actor, clock, calls } = membership();
    clock.increment(500);
    expect(calls.probe).toBe(0);
    actor.send({ type: 'PROBE.START' });
    clock.increment(50);
    clock.increment(50);
    clock.increment(50);
    expect(calls.probe).toBe(3);
    actor.send({ type: 'PROBE.STOP' });
    clock.increment(500);
    expect(calls.probe).toBe(3);
  });
});

const model = { pool: {}, residentBytes: 0, close: async () => {} } as unknown as LoadedModel;
const lock: LoadLock = { ref: { key: 'k', token: 't' }, held: async () => true, lent: null, release: async () => {} };

/** A placement chart with fake steps (`steps` overrides) and guards; its output, or null while it runs. */
function placement(
  steps: Partial<Record<'lock' | 'place' | 'join' | 'loadHere' | 'change' | 'settle', () => Promise<unknown>>>,
  guards: Partial<Record<'pinned' | 'offline' | 'held', () => boolean>> = {},
  busyMs = 3000,
) {
  const clock = new SimulatedClock();
  const step = <T, I = unknown>(name: keyof typeof steps, fallback: () => Promise<T>) =>
    fromPromise<T, I>(() => (steps[name] as (() => Promise<T>) | undefined)?.() ?? fallback());
  const chart = placementMachine.provide({
    actors: {
      lock: step<LoadLock | null>('lock', async () => lock),
      place: step<LoadedModel, { lock: LoadLock }>('place', async () => model),
      join: step<LoadedModel>('join', async () => model),
      loadHere: step<LoadedModel>('loadHere', async () => model),
      change: step<void>('change', () => new Promise(() => {})),
      settle: step<void>('settle', async () => {}),
    },
    guards: {
      pinned: () => guards.pinned?.() ?? false,
      offline: () => guards.offline?.() ?? false,
      held: () => guards.held?.() ?? false,
    },
  });
  const actor = createActor(chart, { clock, input: { id: 'm', end: Date.now() + busyMs } });
  const states: string[] = [];
  actor.subscribe((s) => states.push(String(s.value)));
  actor.start();
  const output = (): PlacementOutput | null =>
    actor.getSnapshot().status === 'done' ? actor.getSnapshot().output! : null;
  return { actor, clock, states, output };
}

describe('a placement chart alone (SimulatedClock, fake steps)', () => {
  it('free: takes the lock and places under it', async () => {
    const p = placement({});
    await flush();
    expect(p.output()).toEqual({ model });
    expect(p.states).toEqual(expect.arrayContaining(['locking', 'placing', 'placed']));
  });

  it('held elsewhere: joins the holders; pinned or offline: loads here, no lock taken', async () => {
    let locks = 0;
    for (const guards of [{ held: () => true }, { pinned: () => true }, { offline: () => true }]) {
      const p = placement({ lock: async () => (locks++, lock) }, guards);
      await flush();
      expect(p.output()).toEqual({ model });
    }
    expect(locks).toBe(0);
  });

  it('another node holds the lock past the busy timeout: waits, then times out at the busy timeout', async () => {
    const p = placement({ lock: async () => null }, {}, 3000);
    await flush();
    expect(p.actor.getSnapshot().value).toBe('waiting');
    // The deadline is the input's `end` on the real clock: a few real ms have passed since.
    p.clock.increment(2900);
    await flush();
    expect(p.output()).toBeNull();
    p.clock.increment(150);
    await flush();
    expect(p.actor.getSnapshot().value).toBe('timedOut');
  });

  it('the lock taken over while placing: settles on the other placement, then joins it', async () => {
    let held = false;
    const p = placement(
      {
        place: async () => {
          throw Object.assign(new Error('taken over'), { superseded: true });
        },
        settle: async () => void (held = true),
      },
      { held: () => held },
    );
    await flush();
    await flush();
    expect(p.states).toEqual(expect.arrayContaining(['placing', 'superseded', 'joining', 'placed']));
    expect(p.output()).toEqual({ model });
  });

  it("OFFLINE (NATS lost) while the lock is being taken: decides again and loads here, not after the lock's timeouts", async () => {
    let offline = false;
    let here = 0;
    const p = placement(
      { lock: () => new Promise(() => {}), loadHere: async () => (here++, model) },
      { offline: () => offline },
      60_000,
    );
    await flush();
    expect(p.actor.getSnapshot().value).toBe('locking');
    offline = true;
    p.actor.send({ type: 'OFFLINE' });
    await flush();
    expect(p.output()).toEqual({ model });
    expect(here).toBe(1);
    expect(p.states).toEqual(['locking', 'loadingHere', 'placed']);
  });

  it('ABORT (the request left) ends a waiting placement with its reason; a refusal fails it with the error', async () => {
    const p = placement({ lock: async () => null });
    await flush();
    const reason = new Error('client left');
    p.actor.send({ type: 'ABORT', reason });
    expect(p.output()).toEqual({ error: reason });
    const refused = new Error('insufficient memory');
    const q = placement({
      place: async () => {
        throw refused;
      },
    });
    await flush();
    expect(q.output()).toEqual({ error: refused });
  });
});

describe('a load lock chart alone (SimulatedClock)', () => {
  it('renews at every renew delay while held, and never after RELEASE', () => {
    const clock = new SimulatedClock();
    let renewals = 0;
    const lock = createActor(
      lockMachine.provide({ actions: { renew: () => void renewals++ }, delays: { renew: 300 } }),
      { clock },
    ).start();
    clock.increment(299);
    expect(renewals).toBe(0);
    clock.increment(1);
    clock.increment(300);
    expect(renewals).toBe(2);
    lock.send({ type: 'RELEASE' });
    expect(lock.getSnapshot().status).toBe('done');
    clock.increment(3000);
    expect(renewals).toBe(2);
  });
});

describe('the bucket opening chart alone (SimulatedClock)', () => {
  // docs/cluster.md `connect_timeout_ms`: a NATS cluster just started has no JetStream leader for a
  // moment; the node tries again until the connect timeout, then fails with the last refusal.
  const opening = (answers: (() => Promise<[KV, KV]>)[], timeoutMs: number) => {
    const clock = new SimulatedClock();
    let tries = 0;
    const open = (): Promise<[KV, KV]> => answers[Math.min(tries++, answers.length - 1)]();
    const actor = createActor(openingMachine, { clock, input: { open, timeoutMs } }).start();
    return { actor, clock, tries: () => tries };
  };
  const refused = (): Promise<[KV, KV]> => Promise.reject(new Error('no JetStream leader'));
  const buckets = [{}, {}] as [KV, KV];

  it('refused twice, then opened: tried again 250 ms after each refusal, opened with the buckets', async () => {
    const { actor, clock, tries } = opening([refused, refused, () => Promise.resolve(buckets)], 5000);
    await flush();
    expect(tries()).toBe(1);
    expect(actor.getSnapshot().value).toEqual({ trying: 'waiting' });
    clock.increment(249);
    await flush();
    expect(tries()).toBe(1);
    clock.increment(1);
    await flush();
    clock.increment(250);
    await flush();
    expect(tries()).toBe(3);
    expect(actor.getSnapshot().value).toBe('opened');
    expect(actor.getSnapshot().context.buckets).toBe(buckets);
  });

  it('refused until the connect timeout: failed then with the last refusal, and no try after it', async () => {
    const { actor, clock, tries } = opening([refused], 1000);
    for (let t = 0; t < 1000; t += 250) {
      await flush();
      clock.increment(250);
    }
    await flush();
    expect(actor.getSnapshot().value).toBe('failed');
    expect((actor.getSnapshot().context.error as Error).message).toBe('no JetStream leader');
    const n = tries();
    expect(n).toBe(4);
    clock.increment(5000);
    await flush();
    expect(tries()).toBe(n);
  });
});
