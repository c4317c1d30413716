/** The system root's chart on its own, with XState's SimulatedClock: shutdown's phases and deadline. */
import { createActor, fromCallback, SimulatedClock } from 'xstate';
import { describe, expect, it } from 'vitest';
import { systemMachine } from '../../actors/system.js';

const DRAIN_MS = 5000;
const LINGER_MS = 1000;

/** A root with a do-nothing supervisor, the drain deadline at 5 s, and what it emitted. */
function root() {
  const clock = new SimulatedClock();
  const machine = systemMachine.provide({
    actors: { supervisor: fromCallback(() => {}) },
    delays: { drainTimeout: DRAIN_MS, idleLinger: LINGER_MS },
  });
  const actor = createActor(machine, { clock, input: {} });
  const emitted: string[] = [];
  for (const type of ['drain', 'linger', 'cut'] as const) actor.on(type, () => emitted.push(type));
  actor.start();
  actor.send({ type: 'STARTED' });
  return { actor, clock, emitted, state: () => actor.getSnapshot().value };
}

describe('system chart', () => {
  it('SHUTDOWN drains; at drain_timeout_ms what is left is cut, whatever still runs', () => {
    const r = root();
    r.actor.send({ type: 'SHUTDOWN' });
    expect(r.state()).toEqual({ draining: 'finishing' });
    expect(r.emitted).toEqual(['drain']);
    r.clock.increment(DRAIN_MS - 1);
    expect(r.state()).toEqual({ draining: 'finishing' });
    r.clock.increment(1);
    expect(r.state()).toBe('closing');
    expect(r.emitted).toEqual(['drain', 'cut']);
    r.actor.send({ type: 'STOPPED' });
    expect(r.actor.getSnapshot().status).toBe('done');
  });

  it('drained early: it lingers for idle connections until they are gone (IDLE) or for idleLinger, never past the deadline', () => {
    const idle = root();
    idle.actor.send({ type: 'SHUTDOWN' });
    idle.actor.send({ type: 'DRAINED' });
    expect(idle.state()).toEqual({ draining: 'lingering' });
    expect(idle.emitted).toEqual(['drain', 'linger']);
    idle.actor.send({ type: 'IDLE' });
    expect(idle.state()).toBe('closing');

    const linger = root();
    linger.actor.send({ type: 'SHUTDOWN' });
    linger.actor.send({ type: 'DRAINED' });
    linger.clock.increment(LINGER_MS);
    expect(linger.state()).toBe('closing');

    // Drained 4.5 s in: the linger ends at the deadline, 0.5 s later, not 1 s later.
    const late = root();
    late.actor.send({ type: 'SHUTDOWN' });
    late.clock.increment(DRAIN_MS - 500);
    late.actor.send({ type: 'DRAINED' });
    late.clock.increment(500);
    expect(late.state()).toBe('closing');
    expect(late.emitted).toEqual(['drain', 'linger', 'cut']);
  });

  it('DESTROY cuts at once: while draining, and before any shutdown (no drain then)', () => {
    const draining = root();
    draining.actor.send({ type: 'SHUTDOWN' });
    draining.actor.send({ type: 'DESTROY' });
    expect(draining.state()).toBe('closing');
    expect(draining.emitted).toEqual(['drain', 'cut']);

    const running = root();
    running.actor.send({ type: 'DESTROY' });
    expect(running.state()).toBe('closing');
    expect(running.emitted).toEqual(['cut']);
    // A later SHUTDOWN (close() after destroy()) changes nothing.
    running.actor.send({ type: 'SHUTDOWN' });
    expect(running.state()).toBe('closing');
  });

  it('STOPPED while draining (a supervisor stopped directly) ends it without a cut', () => {
    const r = root();
    r.actor.send({ type: 'SHUTDOWN' });
    r.actor.send({ type: 'STOPPED' });
    expect(r.actor.getSnapshot().status).toBe('done');
    r.clock.increment(DRAIN_MS);
    expect(r.emitted).toEqual(['drain']);
  });
});
