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
});
