/**
 * The HTTP socket chart at shutdown: an idle keep-alive connection is not cut when the drain
 * begins (a request already on the wire would be lost), it answers what arrives and then closes.
 */
import { describe, expect, it } from 'vitest';
import { createActor, SimulatedClock } from 'xstate';
import { httpSocketMachine, type HttpOutput } from '../../actors/http.js';
import { Limits } from '../../runtime/config.js';
import type { Supervisor } from '../../actors/supervisor.js';

function start() {
  const actor = createActor(httpSocketMachine, {
    input: { limits: Limits.parse({ idle_ms: 0 }), registry: {} as Supervisor },
  });
  const out: HttpOutput[] = [];
  actor.on('*', (o: HttpOutput) => void out.push(o));
  actor.start();
  return { actor, closes: () => out.filter((o) => o.type === 'close').length };
}

describe('HTTP socket drain', () => {
  it('an idle connection lingers at DRAIN; a request that arrives is answered, then the connection closes', () => {
    const s = start();
    s.actor.send({ type: 'DRAIN' });
    expect(s.actor.getSnapshot().value).toBe('lingering');
    expect(s.closes()).toBe(0);
    s.actor.send({ type: 'REQUEST_STARTED', rid: 1, safe: true });
    expect(s.actor.getSnapshot().value).toBe('draining');
    expect(s.closes()).toBe(0);
    s.actor.send({ type: 'RESPONSE_CLOSED', rid: 1 });
    expect(s.actor.getSnapshot().status).toBe('done');
    expect(s.closes()).toBe(1);
  });

  it('a busy connection at DRAIN finishes its response, then closes', () => {
    const s = start();
    s.actor.send({ type: 'REQUEST_STARTED', rid: 1, safe: true });
    s.actor.send({ type: 'DRAIN' });
    expect(s.actor.getSnapshot().value).toBe('draining');
    s.actor.send({ type: 'RESPONSE_CLOSED', rid: 1 });
    expect(s.closes()).toBe(1);
  });
});

describe('HTTP socket pipelining and keep-alive (issue 25)', () => {
  function startWith(limits: Partial<Limits>, bytesRead: () => number = () => 0) {
    const clock = new SimulatedClock();
    const actor = createActor(httpSocketMachine, {
      input: { limits: Limits.parse(limits), registry: {} as Supervisor, bytesRead },
      clock,
    });
    const out: HttpOutput[] = [];
    actor.on('*', (o: HttpOutput) => void out.push(o));
    actor.start();
    const started = () => out.filter((o) => o.type === 'start').map((o) => (o as { rid: number }).rid);
    return { actor, clock, out, started, closes: () => out.filter((o) => o.type === 'close').length };
  }

  it('issue 25 item 6: pipelined requests start in arrival order; an unsafe one waits for every earlier one and holds back every later one (RFC 9112 9.3.2)', () => {
    const s = startWith({ idle_ms: 0 });
    // GET, GET, POST (load), POST (unload), GET pipelined on one connection.
    s.actor.send({ type: 'REQUEST_STARTED', rid: 1, safe: true });
    s.actor.send({ type: 'REQUEST_STARTED', rid: 2, safe: true });
    s.actor.send({ type: 'REQUEST_STARTED', rid: 3, safe: false });
    s.actor.send({ type: 'REQUEST_STARTED', rid: 4, safe: false });
    s.actor.send({ type: 'REQUEST_STARTED', rid: 5, safe: true });
    expect(s.started()).toEqual([1, 2]); // safe ones together
    s.actor.send({ type: 'RESPONSE_CLOSED', rid: 2 });
    expect(s.started()).toEqual([1, 2]); // the POST waits for 1 too
    s.actor.send({ type: 'RESPONSE_CLOSED', rid: 1 });
    expect(s.started()).toEqual([1, 2, 3]);
    s.actor.send({ type: 'RESPONSE_CLOSED', rid: 3 });
    expect(s.started()).toEqual([1, 2, 3, 4]); // the unload only after the load has answered
    s.actor.send({ type: 'RESPONSE_CLOSED', rid: 4 });
    expect(s.started()).toEqual([1, 2, 3, 4, 5]);
    s.actor.send({ type: 'RESPONSE_CLOSED', rid: 5 });
    expect(s.actor.getSnapshot().value).toBe('open');
  });

  it('issue 25 item 6: a waiting request whose response closes (the peer went away) leaves the line', () => {
    const s = startWith({ idle_ms: 0 });
    s.actor.send({ type: 'REQUEST_STARTED', rid: 1, safe: false });
    s.actor.send({ type: 'REQUEST_STARTED', rid: 2, safe: false });
    s.actor.send({ type: 'RESPONSE_CLOSED', rid: 2 });
    s.actor.send({ type: 'RESPONSE_CLOSED', rid: 1 });
    expect(s.started()).toEqual([1]);
    expect(s.actor.getSnapshot().value).toBe('open');
  });

  it('issue 25 item 7: a keep-alive connection whose next request headers are arriving is not closed at idle_ms; a silent one is', () => {
    let read = 100;
    const s = startWith({ idle_ms: 2000 }, () => read);
    s.actor.send({ type: 'REQUEST_STARTED', rid: 1, safe: true });
    s.actor.send({ type: 'RESPONSE_CLOSED', rid: 1 });
    // The next request's headers trickle in: a few bytes every second, for 5 s.
    for (let t = 0; t < 5; t++) {
      s.clock.increment(1000);
      read += 8;
    }
    expect(s.closes()).toBe(0);
    expect(s.actor.getSnapshot().value).toBe('open');
    s.actor.send({ type: 'REQUEST_STARTED', rid: 2, safe: true });
    s.actor.send({ type: 'RESPONSE_CLOSED', rid: 2 });
    // Then nothing arrives: closed after idle_ms.
    s.clock.increment(1999);
    expect(s.closes()).toBe(0);
    s.clock.increment(1);
    expect(s.closes()).toBe(1);
  });
});
