/**
 * The stream channel's coalescing, under real time: the turn's end is an immediate (a spec file of
 * its own: fake timers elsewhere would hold that immediate back).
 */
import { describe, expect, it } from 'vitest';
import { StreamChannel } from '../../actors/stream.js';

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
