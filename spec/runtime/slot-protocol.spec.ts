import { describe, expect, it } from 'vitest';
import { decodeFrame, encodeFrame, type ToSlot } from '../../runtime/slots/slot-protocol.js';

/** One frame's bytes in a buffer of their own (as the channel's `pread` gives them), at offset 0. */
const bytes = (parts: Buffer[]): Uint8Array => new Uint8Array(Buffer.concat(parts));

describe('the job channel frame (encodeFrame / decodeFrame)', () => {
  it('gives back every field as it was sent: typed arrays of each kind (also views at an offset, in objects and lists), lists of numbers and strings, nulls; the message sent is not changed', () => {
    const under = new Float32Array([9, 1.5, -2.25, 3, 9]);
    const msg = {
      type: 'run',
      seq: 7,
      job: {
        kind: 'tensor',
        inputs: {
          // A model input may carry any name, the codec's own markers included.
          $f32: { dtype: 'float32', shape: [3], data: under.subarray(1, 4) },
          ids: { dtype: 'int64', shape: [2], data: new BigInt64Array([-(2n ** 40n), 5n]) },
          mask: { dtype: 'bool', shape: [3], data: new Uint8Array([1, 0, 1]) },
          words: { dtype: 'string', shape: [2], data: ['a', 'b c'] },
        },
        outputs: ['y', 'z'],
      },
      extra: {
        list: [new Int8Array([-1, 2, 3]), 4, null, 'x', [new Float64Array([0.1]), new Int16Array([-300])]],
        counts: [3, 3, 4],
        more: [
          new Uint16Array([65535]),
          new Int32Array([-7]),
          new Uint32Array([2 ** 32 - 1]),
          new BigUint64Array([2n ** 64n - 1n]),
        ],
        none: null,
      },
    };
    const before = structuredClone(msg);
    const out = decodeFrame(bytes(encodeFrame(msg as unknown as ToSlot)));
    // toStrictEqual compares typed arrays by type and element; the expected value is the message itself.
    expect(out).toStrictEqual(before);
    expect(msg).toStrictEqual(before);
    expect(msg.job.inputs.$f32.data.buffer).toBe(under.buffer);
  });

  it('puts each array that is not float32 at an 8-aligned offset, so its view can be made without a copy', () => {
    const msg = {
      type: 'run',
      seq: 1,
      job: { a: new Uint8Array([1, 2, 3]), b: new BigInt64Array([1n]), c: new Float64Array([2]) },
    };
    const frame = bytes(encodeFrame(msg as unknown as ToSlot));
    const out = decodeFrame(frame) as { job: { a: Uint8Array; b: BigInt64Array; c: Float64Array } };
    for (const v of [out.job.a, out.job.b, out.job.c]) {
      expect(v.buffer).toBe(frame.buffer);
      expect(v.byteOffset % 8).toBe(0);
    }
    expect([...out.job.b, ...out.job.c]).toEqual([1n, 2]);
  });
});
