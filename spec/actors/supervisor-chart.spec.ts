/**
 * The supervisor chart on its own (no Supervisor class): created with `createActor`, its live
 * dependencies given as input (a fake room measurement, XState's SimulatedClock), every path
 * through the cold-load gate (DESIGN.md C11-C13).
 */
import { describe, expect, it } from 'vitest';
import { createActor, fromCallback, SimulatedClock, type AnyActorRef } from 'xstate';
import { supervisorMachine, type PendingLoad, type RoomFigures } from '../../actors/supervisor.js';
import type { modelMachine } from '../../actors/model.js';

/** What the fake measurement reports; candidates that refused are left out, as the real one does. */
interface Room {
  max_loaded: number;
  resident: string[];
  retiring: string[];
  candidates: string[];
  headroom: number;
  free: number | null;
}

function gate(guarded: boolean, room: Room) {
  const clock = new SimulatedClock();
  const measured: string[][] = [];
  const measure = (target: PendingLoad, refused: string[]): RoomFigures => {
    measured.push([...refused]);
    return {
      target: target.id,
      needed_bytes: target.needed_bytes,
      headroom_bytes: room.headroom,
      free_bytes: room.free,
      max_loaded: room.max_loaded,
      resident: room.resident.filter((id) => id !== target.id),
      retiring: room.retiring,
      candidates: room.candidates.filter((id) => !refused.includes(id)),
    };
  };
  const actor = createActor(supervisorMachine, { clock, input: { guarded, measure, now: () => clock.now() } });
  actor.start();
  /** Victims registered as `model:<id>`: they answer EVICT as `answers[id]` says, and record what they were asked. */
  const asked: { id: string; reason: string }[] = [];
  const answers: Record<string, 'EVICTED' | 'EVICT_REFUSED' | 'silent'> = {};
  const victim = (id: string) =>
    fromCallback<{ type: 'EVICT'; reason: 'lru' | 'memory'; replyTo: AnyActorRef }>(({ receive }) => {
      receive((e) => {
        asked.push({ id, reason: e.reason });
        const answer = answers[id] ?? 'EVICTED';
        if (answer !== 'silent')
          e.replyTo.send(
            answer === 'EVICTED'
              ? { type: 'EVICTED', id, reason: e.reason }
              : { type: 'EVICT_REFUSED', id, reason: e.reason, state: 'ready' },
          );
      });
    });
  for (const id of ['a', 'b', 'c'])
    actor.send({ type: 'REGISTER', id, logic: victim(id) as unknown as typeof modelMachine, input: {} as never });
  /** A model's `residency` actor at the gate: records the answers it gets. */
  const requester = (id: string, needed_bytes = 0, timeout_ms = 0) => {
    const got: { type: string; error?: { type: string; message: string } }[] = [];
    const ref = createActor(fromCallback(({ receive }) => receive((e: { type: string }) => void got.push(e))));
    ref.start();
    actor.send({ type: 'LOAD_REQUESTED', id, needed_bytes, timeout_ms, replyTo: ref });
    return got;
  };
  const state = (): string => actor.getSnapshot().value as string;
  return { actor, clock, asked, answers, requester, state, measured };
}

const open = (): Room => ({ max_loaded: 0, resident: [], retiring: [], candidates: [], headroom: 0, free: null });

describe('supervisor chart (createActor, SimulatedClock, no Supervisor class)', () => {
  it('unguarded: every load is granted at once, in parallel, and the gate stays idle', () => {
    const g = gate(false, { ...open(), max_loaded: 1, resident: ['a'] });
    const x = g.requester('x');
    const y = g.requester('y');
    expect(x).toEqual([{ type: 'LOAD_GRANTED' }]);
    expect(y).toEqual([{ type: 'LOAD_GRANTED' }]);
    expect(g.state()).toBe('idle');
    expect(g.measured).toEqual([]);
  });

  it('room: granted, and the gate stays closed (FIFO) until LOAD_FINISHED of that load', () => {
    const g = gate(true, { ...open(), max_loaded: 2 });
    const x = g.requester('x');
    const y = g.requester('y');
    expect(x).toEqual([{ type: 'LOAD_GRANTED' }]);
    expect(g.state()).toBe('loading');
    expect(y).toEqual([]);
    g.actor.send({ type: 'LOAD_FINISHED', id: 'y' }); // not the current load: it leaves the queue
    expect(g.actor.getSnapshot().context.pending).toEqual([]);
    const z = g.requester('z');
    g.actor.send({ type: 'LOAD_FINISHED', id: 'x' });
    expect(z).toEqual([{ type: 'LOAD_GRANTED' }]);
    expect(y).toEqual([]);
  });

  it('over max_loaded_models: the first LRU candidate is asked to EVICT (lru), then the load waits for its release', () => {
    const room = { ...open(), max_loaded: 1, resident: ['a'], candidates: ['a'] };
    const g = gate(true, room);
    const x = g.requester('x', 0, 1000);
    expect(g.asked).toEqual([{ id: 'a', reason: 'lru' }]);
    expect(g.state()).toBe('waitingForRelease');
    expect(x).toEqual([]);
    // The victim's pool closes: the model changed, room is measured again.
    room.resident = [];
    room.candidates = [];
    g.actor.send({ type: 'MODEL_CHANGED' });
    expect(x).toEqual([{ type: 'LOAD_GRANTED' }]);
    expect(g.state()).toBe('loading');
  });

  it('a victim that refuses (it turned busy) is left out of the next measurement; the next candidate is asked', () => {
    const g = gate(true, { ...open(), max_loaded: 2, resident: ['a', 'b'], candidates: ['a', 'b'] });
    g.answers.a = 'EVICT_REFUSED';
    g.requester('x', 0, 1000);
    expect(g.asked).toEqual([
      { id: 'a', reason: 'lru' },
      { id: 'b', reason: 'lru' },
    ]);
    expect(g.measured).toEqual([[], ['a']]);
    expect(g.state()).toBe('waitingForRelease');
    // After a change, every candidate may be asked again: a first.
    g.actor.send({ type: 'MODEL_CHANGED' });
    expect(g.measured.slice(2)).toEqual([[], ['a']]);
    expect(g.asked.slice(2).map((a) => a.id)).toEqual(['a', 'b']);
  });

  it('a model already retiring covers the need: no eviction, the load waits for its release', () => {
    const g = gate(true, { ...open(), max_loaded: 1, resident: ['a'], retiring: ['a'], candidates: ['b'] });
    g.requester('x', 0, 1000);
    expect(g.asked).toEqual([]);
    expect(g.state()).toBe('waitingForRelease');
  });

  it('no room within the busy timeout: LOAD_REFUSED server_busy at the deadline, not before', () => {
    const g = gate(true, { ...open(), max_loaded: 1, resident: ['a'] });
    const x = g.requester('x', 0, 500);
    expect(g.state()).toBe('waitingForRelease');
    g.clock.increment(499);
    expect(x).toEqual([]);
    g.clock.increment(1);
    expect(x).toMatchObject([
      {
        type: 'LOAD_REFUSED',
        error: { type: 'server_busy', message: expect.stringContaining('max_loaded_models (1) reached') },
      },
    ]);
    expect(g.state()).toBe('idle');
  });

  it('a victim evicted for the load but still unloading at the deadline: refused for what it was evicted for (lru: server_busy naming it; memory: insufficient_memory)', () => {
    // A breaker's case: a memory eviction whose unload outlasted a 45 ms busy timeout answered no_room, "max_loaded_models
    // (0) reached and no model became idle to evict".
    const lru = gate(true, { ...open(), max_loaded: 1, resident: ['a'], candidates: ['a'] });
    const x = lru.requester('x', 0, 50);
    expect(lru.state()).toBe('waitingForRelease');
    lru.clock.increment(50);
    expect(x).toMatchObject([
      {
        type: 'LOAD_REFUSED',
        error: {
          type: 'server_busy',
          message: expect.stringContaining(
            'a, evicted for it, had not finished unloading within the busy timeout (50 ms)',
          ),
        },
      },
    ]);
    const memory = gate(true, { ...open(), resident: ['a'], candidates: ['a'], headroom: 100, free: 150 });
    const y = memory.requester('y', 100, 50);
    expect(memory.asked).toEqual([{ id: 'a', reason: 'memory' }]);
    memory.clock.increment(50);
    expect(y).toMatchObject([{ type: 'LOAD_REFUSED', error: { type: 'insufficient_memory' } }]);
  });

  it('the victim is settled (its pending idle turn told) before it is asked to EVICT', () => {
    const order: string[] = [];
    const clock = new SimulatedClock();
    const actor = createActor(supervisorMachine, {
      clock,
      input: {
        guarded: true,
        now: () => clock.now(),
        settle: (id) => order.push(`settle ${id}`),
        measure: (target) => ({
          target: target.id,
          needed_bytes: 0,
          headroom_bytes: 0,
          free_bytes: null,
          max_loaded: 1,
          resident: ['a'],
          retiring: [],
          candidates: ['a'],
        }),
      },
    });
    actor.start();
    const victim = fromCallback(({ receive }) => receive((e: { type: string }) => void order.push(e.type)));
    actor.send({ type: 'REGISTER', id: 'a', logic: victim as unknown as typeof modelMachine, input: {} as never });
    const ref = createActor(fromCallback(() => {}));
    ref.start();
    actor.send({ type: 'LOAD_REQUESTED', id: 'x', needed_bytes: 0, timeout_ms: 1000, replyTo: ref });
    expect(order).toEqual(['settle a', 'EVICT']);
  });

  it('with no busy timeout (0) the load waits without bound', () => {
    const g = gate(true, { ...open(), max_loaded: 1, resident: ['a'] });
    const x = g.requester('x', 0, 0);
    g.clock.increment(3_600_000);
    expect(x).toEqual([]);
    expect(g.state()).toBe('waitingForRelease');
  });

  it('memory short and an idle model resident: it is asked to EVICT (memory)', () => {
    const g = gate(true, { ...open(), resident: ['a'], candidates: ['a'], headroom: 100, free: 150 });
    g.requester('x', 100, 1000);
    expect(g.asked).toEqual([{ id: 'a', reason: 'memory' }]);
    expect(g.state()).toBe('waitingForRelease');
  });

  it('memory short and nothing resident: LOAD_REFUSED insufficient_memory at once, with the figures', () => {
    const g = gate(true, { ...open(), headroom: 100 * 2 ** 20, free: 150 * 2 ** 20 });
    const x = g.requester('x', 60 * 2 ** 20, 1000);
    expect(x).toMatchObject([
      {
        type: 'LOAD_REFUSED',
        error: {
          type: 'insufficient_memory',
          message: expect.stringContaining(
            'needs about 60 MiB plus 100 MiB of headroom (min_free_memory_mb), but only 150 MiB is available',
          ),
        },
      },
    ]);
    expect(g.state()).toBe('idle');
  });

  it('memory short, others resident but none evictable: measured again every 250 ms, granted once memory is free', () => {
    const room = { ...open(), resident: ['a'], headroom: 100, free: 150 };
    const g = gate(true, room);
    const x = g.requester('x', 100, 0);
    expect(g.state()).toBe('waitingForMemory');
    expect(g.measured.length).toBe(1);
    g.clock.increment(249);
    expect(g.measured.length).toBe(1);
    g.clock.increment(1);
    expect(g.measured.length).toBe(2);
    room.free = 1000;
    g.clock.increment(250);
    expect(x).toEqual([{ type: 'LOAD_GRANTED' }]);
    expect(g.state()).toBe('loading');
  });

  it('memory short until the deadline: LOAD_REFUSED insufficient_memory', () => {
    const g = gate(true, { ...open(), resident: ['a'], headroom: 100, free: 150 });
    const x = g.requester('x', 100, 600);
    g.clock.increment(599);
    expect(x).toEqual([]);
    g.clock.increment(1);
    expect(x).toMatchObject([{ type: 'LOAD_REFUSED', error: { type: 'insufficient_memory' } }]);
    expect(g.state()).toBe('idle');
  });

  it('a load whose requester goes away while the gate works for it (LOAD_FINISHED) frees the gate for the next', () => {
    const g = gate(true, { ...open(), max_loaded: 1, resident: ['a'] });
    g.requester('x', 0, 0);
    const y = g.requester('y', 0, 0);
    expect(g.state()).toBe('waitingForRelease');
    g.actor.send({ type: 'LOAD_FINISHED', id: 'x' });
    // y is now the current load, still without room.
    expect(g.actor.getSnapshot().context.current?.id).toBe('y');
    expect(y).toEqual([]);
  });

  it('DRAIN (shutdown) reaches every model chart, and a model registered afterwards starts draining (its input says so)', () => {
    const actor = createActor(supervisorMachine, { input: { guarded: false, measure: () => ({}) as RoomFigures } });
    actor.start();
    const heard: { id: string; type?: string; draining?: boolean }[] = [];
    const model = (id: string) =>
      fromCallback<{ type: string }, { draining?: boolean }>(({ input, receive }) => {
        heard.push({ id, draining: input.draining });
        receive((e) => void heard.push({ id, type: e.type }));
      }) as unknown as typeof modelMachine;
    actor.send({ type: 'REGISTER', id: 'a', logic: model('a'), input: {} as never });
    actor.send({ type: 'REGISTER', id: 'b', logic: model('b'), input: {} as never });
    expect(actor.getSnapshot().context.draining).toBe(false);
    actor.send({ type: 'DRAIN' });
    actor.send({ type: 'REGISTER', id: 'c', logic: model('c'), input: {} as never });
    expect(heard).toEqual([
      { id: 'a', draining: undefined },
      { id: 'b', draining: undefined },
      { id: 'a', type: 'DRAIN' },
      { id: 'b', type: 'DRAIN' },
      { id: 'c', draining: true },
    ]);
    expect(actor.getSnapshot().context.draining).toBe(true);
  });
});
