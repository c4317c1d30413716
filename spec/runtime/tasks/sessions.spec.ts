import { describe, expect, it } from 'vitest';
import { ModelConfig } from '../../../runtime/config.js';
import { OWW, SILERO, type Job, type JobResult } from '../../../runtime/slots/slot-protocol.js';
import { createTaskSession, drain, taskResult, type TaskEvent } from '../../../runtime/tasks/index.js';

/**
 * What a task session keeps: a file's session its segments or detections (the answer is built
 * from them), a stream's none, since its events carry them out as they come and a stream may
 * last for days. Slots are stood in for by results of known scores.
 */

const WAKE = ModelConfig.parse({ id: 'w', task: 'wakeword', path: '/w.onnx' });
const VAD = ModelConfig.parse({ id: 'v', task: 'vad', path: '/v.onnx' });
const INFO = { heads: [{ window: 16, labels: ['@model'] }], initialEmbeddings: new Float32Array(16 * OWW.EMBEDDING) };

/**
 * A slot's answer to `job`: every wake-word step scores 0.5; VAD windows alternate 20 of speech (0.9) and 10 of silence
 * (0.05).
 */
function answer(job: Job): JobResult {
  if (job.kind === 'wakeword')
    return {
      kind: 'wakeword',
      scores: new Float32Array((job.audio.length - OWW.LOOKBACK) / OWW.STEP).fill(0.5),
      mel: job.mel,
      embeddings: job.embeddings,
    };
  if (job.kind !== 'vad') throw new Error(`no answer for a ${job.kind} job`);
  const n = job.windows.length / SILERO.WINDOW;
  return {
    kind: 'vad',
    probs: Float32Array.from({ length: n }, () => (windows++ % 30 < 20 ? 0.9 : 0.05)),
    state: job.state,
    context: job.context,
  };
}
let windows = 0;

/** Runs `seconds` of audio through a session; returns its events and what it kept for a result. */
async function run(
  config: ModelConfig,
  options: object,
  seconds: number,
  keepResults: boolean,
): Promise<{ events: TaskEvent[]; kept: unknown[] }> {
  windows = 0;
  const session = createTaskSession(config, INFO, options, keepResults);
  const events: TaskEvent[] = [];
  const step = 16_000 * 60;
  for (let at = 0; at < seconds * 16_000; at += step) {
    session.push(new Float32Array(step));
    await drain(
      session,
      async (job) => answer(job),
      (e) => events.push(e),
      64,
    );
  }
  events.push(...session.end());
  await drain(
    session,
    async (job) => answer(job),
    (e) => events.push(e),
    64,
  );
  const result = taskResult(session);
  return { events, kept: (result.detections ?? result.segments) as unknown[] };
}

describe('task sessions keep their results for a file only', () => {
  it('wake word: an hour of a stream at threshold 1e-6 sends 45,000 detections and keeps none; a file keeps each', async () => {
    const loud = { threshold: 1e-6, refractory_ms: 0 };
    const stream = await run(WAKE, loud, 3600, false);
    // 3600 s / 80 ms = 45,000 steps, the first 5 never detect.
    expect(stream.events.filter((e) => e.type === 'detection')).toHaveLength(45_000 - 5);
    expect(stream.kept).toEqual([]);
    const file = await run(WAKE, loud, 60, true);
    expect(file.kept).toEqual(file.events.map(({ type: _, ...d }) => d));
  });

  it('vad: an hour of a stream of 640 ms segments sends each speech_end and keeps none; a file keeps each', async () => {
    const stream = await run(VAD, {}, 3600, false);
    expect(stream.events.filter((e) => e.type === 'speech_end').length).toBeGreaterThan(3000);
    expect(stream.kept).toEqual([]);
    const file = await run(VAD, {}, 60, true);
    const ends = file.events.filter((e) => e.type === 'speech_end');
    expect(ends.length).toBeGreaterThan(50);
    expect(file.kept).toHaveLength(ends.length);
  });
});
