/**
 * The HTTP socket chart at shutdown: an idle keep-alive connection is not cut when the drain
 * begins (a request already on the wire would be lost), it answers what arrives and then closes.
 */
import { describe, expect, it } from 'vitest';
import { createActor } from 'xstate';
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
    s.actor.send({ type: 'REQUEST_STARTED', rid: 1 });
    expect(s.actor.getSnapshot().value).toBe('draining');
    expect(s.closes()).toBe(0);
    s.actor.send({ type: 'RESPONSE_CLOSED', rid: 1 });
    expect(s.actor.getSnapshot().status).toBe('done');
    expect(s.closes()).toBe(1);
  });

  it('a busy connection at DRAIN finishes its response, then closes', () => {
    const s = start();
    s.actor.send({ type: 'REQUEST_STARTED', rid: 1 });
    s.actor.send({ type: 'DRAIN' });
    expect(s.actor.getSnapshot().value).toBe('draining');
    s.actor.send({ type: 'RESPONSE_CLOSED', rid: 1 });
    expect(s.closes()).toBe(1);
  });
});
