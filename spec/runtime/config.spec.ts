import { describe, expect, it } from 'vitest';
import { parseWith, ServerConfig } from '../../runtime/config.js';

describe('ServerConfig models (found by spec/fuzz)', () => {
  const model = { task: 'vad', path: '/models/silero_vad.onnx' };

  it('refuses model options invalid for the task, naming the field (the server started and blamed every client)', () => {
    expect(() => parseWith(ServerConfig, { models: [{ ...model, id: 'a', options: { neg_threshold: 0 } }] })).toThrow(
      /^models\.0\.options\.neg_threshold: Too small/,
    );
    expect(() =>
      parseWith(ServerConfig, {
        models: [{ ...model, id: 'a', task: 'wakeword', options: { min_speech_duration_ms: 100 } }],
      }),
    ).toThrow(/^models\.0\.options: Unrecognized key: "min_speech_duration_ms"/);
    expect(
      parseWith(ServerConfig, { models: [{ ...model, id: 'a', options: { threshold: 0.3 } }] }).models[0].options,
    ).toEqual({ threshold: 0.3 });
  });

  it('refuses two models with one id (the second silently replaced the first)', () => {
    expect(() =>
      parseWith(ServerConfig, {
        models: [
          { ...model, id: 'a' },
          { ...model, id: 'b' },
          { ...model, id: 'a' },
        ],
      }),
    ).toThrow(/^models\.2\.id: 'a' is already the id of another model/);
  });

  it("validates a model's autoscale, naming the field", () => {
    const as = (autoscale: unknown) => parseWith(ServerConfig, { models: [{ ...model, id: 'a', autoscale }] });
    expect(() => as({ max_replicas: 3 })).toThrow(/^models\.0\.autoscale\.target_wait_ms: /);
    expect(() => as({ max_replicas: 0, target_wait_ms: 200 })).toThrow(
      /^models\.0\.autoscale\.max_replicas: Too small/,
    );
    expect(() => as({ min_replicas: 3, max_replicas: 2, target_wait_ms: 200 })).toThrow(
      /^models\.0\.autoscale\.max_replicas: must be at least min_replicas \(3\)/,
    );
    expect(() => as({ max_replicas: 2, target_wait_ms: 200, scale_up_ms: 1 })).toThrow(
      /^models\.0\.autoscale: Unrecognized key: "scale_up_ms"/,
    );
    expect(as({ max_replicas: 3, target_wait_ms: 200 }).models[0].autoscale).toEqual({
      min_replicas: 1,
      max_replicas: 3,
      target_wait_ms: 200,
      scale_up_after_ms: 30_000,
      scale_down_after_ms: 300_000,
    });
  });
});
