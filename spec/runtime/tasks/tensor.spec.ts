/**
 * readTensor's checks of a request's input tensor (issue 22; adversarial trial findings): the dtype
 * must be one of onnxruntime's names (not a name every object has), and `data` is either flat or
 * nested exactly as numpy's `tolist()` nests an array of that shape; a 0-d array's `tolist()` is
 * the bare value. The expected nestings are written out here from numpy's definition.
 */
import { describe, expect, it } from 'vitest';
import { readTensor } from '../../../runtime/tasks/tensor.js';
import { VoxError } from '../../../runtime/errors.js';

/** The VoxError readTensor throws, as `{code, message}`. */
function refusal(value: unknown): { code: string; message: string } {
  try {
    readTensor('x', value);
  } catch (e) {
    expect(e).toBeInstanceOf(VoxError);
    return { code: (e as VoxError).code, message: (e as VoxError).message };
  }
  throw new Error('accepted');
}

describe('readTensor', () => {
  it('a dtype that is a property every object has (__proto__, valueOf, constructor) is refused naming the field', () => {
    for (const dtype of ['__proto__', 'valueOf', 'constructor', 'toString']) {
      const r = refusal({ dtype, shape: [1], data: [1] });
      expect(r.code).toBe('invalid_tensor');
      expect(r.message).toMatch(/^inputs\.x\.dtype: must be one of float32, /);
    }
  });

  it('nested data as numpy tolist() gives it (shape [2, 3] -> [[a, b, c], [d, e, f]]) is read in row-major order', () => {
    const t = readTensor('x', {
      dtype: 'int32',
      shape: [2, 3],
      data: [
        [1, 2, 3],
        [4, 5, 6],
      ],
    });
    expect([...t.data]).toEqual([1, 2, 3, 4, 5, 6]);
    expect([...readTensor('x', { dtype: 'int32', shape: [2, 3], data: [1, 2, 3, 4, 5, 6] }).data]).toEqual([
      1, 2, 3, 4, 5, 6,
    ]);
  });

  it('ragged or mis-nested data is refused with the index where it is wrong, not reshaped', () => {
    const zeros = (n: number): number[] => new Array(n).fill(0);
    // shape [1, 512]: tolist() is one list of 512 values.
    expect(refusal({ dtype: 'float32', shape: [1, 512], data: [zeros(256), zeros(256)] }).message).toBe(
      'inputs.x.data: must be a list of 1 (dimension 0 of shape [1, 512]), got 2 values',
    );
    expect(refusal({ dtype: 'float32', shape: [1, 512], data: [...zeros(511), [0]] }).message).toMatch(
      /^inputs\.x\.data: must be a list of 1 \(dimension 0/,
    );
    expect(refusal({ dtype: 'float32', shape: [512], data: zeros(512).map((z) => [z]) }).message).toBe(
      'inputs.x.data[0]: nested deeper than shape [512]',
    );
    expect(refusal({ dtype: 'float32', shape: [2, 2], data: [[1, 2], [3]] }).message).toBe(
      'inputs.x.data[1]: must be a list of 2 (dimension 1 of shape [2, 2]), got 1 value',
    );
  });

  it('data nested 5000 deep is a 400, not a stack overflow', () => {
    let deep: unknown = 1;
    for (let i = 0; i < 5000; i++) deep = [deep];
    const r = refusal({ dtype: 'float32', shape: [1, 1], data: deep });
    expect(r.code).toBe('invalid_tensor');
    expect(r.message).toBe('inputs.x.data[0][0]: nested deeper than shape [1, 1]');
  });

  it('a float32 value past the largest float32 (3.4028234663852886e38) is refused naming the element, not made Infinity', () => {
    // 2^128 - 2^104 is float32's largest finite value (IEEE 754 binary32); 1e300 and -1e39 are past it.
    for (const big of [1e300, -1e39]) {
      const e = refusal({ dtype: 'float32', shape: [3], data: [0.5, big, 1] });
      expect(e.code).toBe('invalid_tensor');
      expect(e.message).toContain('inputs.x.data[1]');
      expect(e.message).toContain('float32');
    }
    expect([...readTensor('x', { dtype: 'float32', shape: [2], data: [3.4028234663852886e38, -0.5] }).data]).toEqual([
      2 ** 128 - 2 ** 104,
      -0.5,
    ]);
    // float64 holds 1e300 as it is.
    expect([...readTensor('x', { dtype: 'float64', shape: [1], data: [1e300] }).data]).toEqual([1e300]);
  });

  it("a 0-d tensor's data may be the bare value (numpy's tolist() of a 0-d array), or a list of one", () => {
    expect([...readTensor('sr', { dtype: 'int64', shape: [], data: 16000 }).data]).toEqual([16000n]);
    expect([...readTensor('sr', { dtype: 'int64', shape: [], data: '16000' }).data]).toEqual([16000n]);
    expect([...readTensor('sr', { dtype: 'int64', shape: [], data: [16000] }).data]).toEqual([16000n]);
    expect(refusal({ dtype: 'int64', shape: [1], data: 16000 }).message).toMatch(/^inputs\.x\.data: required/);
  });
});
