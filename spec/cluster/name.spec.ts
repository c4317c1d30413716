/**
 * A node's name in the registry (cluster/name.ts) over the in-memory NATS: its heartbeats are
 * compare-and-set writes on its own last revision, so two written at once (a placement's and the
 * membership chart's) must go one after the other, or the second fails the first's compare-and-set
 * and the node takes its own write for a lost registry (it opened the buckets again).
 */
import { createActor } from 'xstate';
import { describe, expect, it } from 'vitest';
import { membershipMachine } from '../../cluster/membership.js';
import { NodeName } from '../../cluster/name.js';
import { encodeJson } from '../../cluster/nats.js';
import { FakeNats } from './fake-nats.js';

describe('a node name', () => {
  it('writes two heartbeats asked for at once, both, in the order asked', async () => {
    const bus = new FakeNats();
    const link = bus.connect('A');
    const membership = createActor(membershipMachine, { input: { self: 'A', heartbeatMs: 1000 } });
    const name = new NodeName('A', () => link.nodes, membership);
    const record = (seq: number): Uint8Array => encodeJson({ node: 'A', session: `${name.boot}.0`, seq });
    expect(await name.write(record(1))).toBeNull();
    expect(await Promise.all([name.write(record(2)), name.write(record(3))])).toEqual([null, null]);
    expect((await link.nodes.get('node.A'))?.json<{ seq: number }>().seq).toBe(3);
  });
});
