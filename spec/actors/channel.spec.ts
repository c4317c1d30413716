/**
 * The stream channel's coalescing, under real time: the turn's end is an immediate (a spec file of
 * its own: fake timers elsewhere would hold that immediate back).
 */
import { describe, expect, it } from 'vitest';
import { StreamChannel, TurnSlices } from '../../actors/stream.js';

describe('the stream channel', () => {
  it("hands a turn's frames to work as one chunk at the turn's end, each channel its own, and a control message flushes first", async () => {
    const turn = (): Promise<void> => new Promise((r) => setImmediate(r));
    const got: string[] = [];
    const sink = (name: string) => (frames: readonly Buffer[], count: number) =>
      void got.push(`${name}:${frames.slice(0, count).join(',')}`);
    const a = new StreamChannel();
    const b = new StreamChannel();
    a.sink = sink('a');
    b.sink = sink('b');
    a.push(Buffer.from('1'));
    b.push(Buffer.from('x'));
    a.push(Buffer.from('2'));
    expect(got).toEqual([]);
    await turn();
    expect(got).toEqual(['a:1,2', 'b:x']);
    a.push(Buffer.from('3'));
    expect(a.heard()).toBe(true);
    expect(got).toEqual(['a:1,2', 'b:x', 'a:3']);
    a.push(Buffer.from('4'));
    b.push(Buffer.from('y'));
    await turn();
    expect(got).toEqual(['a:1,2', 'b:x', 'a:3', 'a:4', 'b:y']);
  });
});

describe('TurnSlices', () => {
  it("runs queued work in order, a slice of main-thread time per turn of the event loop, with the turn's other work between slices", async () => {
    let clock = 0;
    const slices = new TurnSlices(2, () => clock);
    const order: string[] = [];
    for (let i = 0; i < 5; i++)
      slices.run(() => {
        order.push(`t${i}`);
        clock += 1; // each task takes 1 ms
      });
    // Other work of the turn (an immediate queued behind the first slice's).
    setImmediate(() => order.push('io'));
    while (order.length < 6) await new Promise((r) => setImmediate(r));
    expect(order).toEqual(['t0', 't1', 'io', 't2', 't3', 't4']);
    // A task longer than the slice still runs, alone.
    slices.run(() => {
      order.push('long');
      clock += 10;
    });
    slices.run(() => order.push('after'));
    await new Promise((r) => setImmediate(r));
    expect(order.slice(6)).toEqual(['long']);
    await new Promise((r) => setImmediate(r));
    expect(order.slice(6)).toEqual(['long', 'after']);
    // drain(): what is queued runs now, in order (a shutdown's cut comes after every finished stream's `done`).
    for (const name of ['d1', 'd2', 'd3']) slices.run(() => order.push(name));
    slices.drain();
    expect(order.slice(8)).toEqual(['d1', 'd2', 'd3']);
    await new Promise((r) => setImmediate(r));
    expect(order).toHaveLength(11);
  });
});
