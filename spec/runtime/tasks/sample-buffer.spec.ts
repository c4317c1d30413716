import { describe, expect, it } from 'vitest';
import { SampleBuffer } from '../../../runtime/tasks/task.js';

/**
 * A SampleBuffer lends the samples a job takes as a view, and moves samples to make room while
 * that view is still read (a slot host may not have run the job yet): the view must keep the
 * samples it was given. Checked against a plain array, over random pushes, takes and releases.
 */
describe('SampleBuffer', () => {
  it('keeps a lent view unchanged while pushes make room, and gives the samples in order', () => {
    let seed = 7;
    const rnd = (n: number): number => {
      seed = (seed * 1103515245 + 12345) & 0x7fffffff;
      return seed % n;
    };
    const buffer = new SampleBuffer();
    const reference: number[] = [];
    let next = 0;
    let lent: { view: Float32Array; expected: number[] } | null = null;
    for (let step = 0; step < 1500; step++) {
      const op = rnd(10);
      if (op < 5) {
        const chunk = Float32Array.from({ length: rnd(1500) }, () => next++);
        buffer.push(chunk);
        reference.push(...chunk);
      } else if (op < 8 && !lent && reference.length) {
        const n = 1 + rnd(reference.length);
        lent = { view: buffer.take(n), expected: reference.splice(0, n) };
      } else if (lent) {
        expect(Array.from(lent.view)).toEqual(lent.expected);
        buffer.release();
        lent = null;
      }
      if (buffer.length !== reference.length) expect(buffer.length).toBe(reference.length);
    }
    expect(Array.from(buffer.take(buffer.length))).toEqual(reference);
  });

  it('moves samples clear of a lent view that starts at the front of the buffer', () => {
    const buffer = new SampleBuffer();
    const ramp = (from: number, n: number): Float32Array => Float32Array.from({ length: n }, (_, i) => from + i);
    buffer.push(ramp(0, 4000));
    buffer.push(ramp(4000, 3000));
    const view = buffer.take(6000);
    // 1,000 samples left and 1,500 more: room is made while the view is still lent.
    buffer.push(ramp(7000, 1500));
    expect(Array.from(view)).toEqual(Array.from(ramp(0, 6000)));
    buffer.release();
    expect(Array.from(buffer.take(2500))).toEqual(Array.from(ramp(6000, 2500)));
  });

  it('makes few new arrays for a stream falling behind slowly: a buffer that grows at least doubles', () => {
    // A stream's 20 ms frames (320 samples) come in two a step while its jobs take 632 a step, one job lent at a time:
    // its unprocessed samples grow by 8 a step, to 32,000, at a new high every time room is made. Room for twice
    // that (at most 64,640) from 4,096 takes at most 4 growths that each at least double (4,096 x 2^4 = 65,536), and
    // the buffer a view is lent from needs a second array of each size: at most 2 x 5 arrays. Growing to just twice
    // what is needed made a new array each time room was made (175 arrays lent here).
    const buffer = new SampleBuffer();
    const arrays = new Set<ArrayBufferLike>();
    let next = 0;
    let want = 0;
    for (let step = 0; step < 4000; step++) {
      buffer.push(Float32Array.from({ length: 320 }, () => next++));
      const view = buffer.take(632);
      arrays.add(view.buffer);
      buffer.push(Float32Array.from({ length: 320 }, () => next++));
      if (view[0] !== want || view[631] !== want + 631) expect([view[0], view[631]]).toEqual([want, want + 631]);
      want += 632;
      buffer.release();
    }
    expect(buffer.length).toBe(4000 * 8);
    expect(arrays.size).toBeLessThanOrEqual(10);
  });

  it('scales what it is given', () => {
    const buffer = new SampleBuffer();
    buffer.push(Float32Array.of(0.5, -1), 32767);
    expect(Array.from(buffer.take(2))).toEqual([16383.5, -32767]);
  });
});
