import { headsOf, parseTaskOptions, type ModelConfig } from '../config.js';
import { invalid, voxError } from '../errors.js';
import type { SlotInfo } from '../slots/slot-protocol.js';
import type { TaskSession } from './task.js';
import { DenoiseSession } from './denoise.js';
import { VadSession, type ProbabilityStream } from './vad.js';
import { WakewordSession } from './wakeword.js';

export type { TaskEvent, TaskSession } from './task.js';
export type { ProbabilityStream } from './vad.js';
export { drain } from './task.js';
export { DenoiseSession, toS16, wavBytes } from './denoise.js';
export { readTensorRequest, tensorJob, tensorOutputs, type TensorRequest } from './tensor.js';

/**
 * Creates the task session for one request or stream of a model. Request `options` override the
 * model's configured ones field by field.
 * @param keepResults a file's session keeps its segments or detections for {@link taskResult}; a
 *   stream's sends them as events and keeps none (they would grow with the stream: an hour at
 *   `threshold` 1e-6 with six heads is 270,000 detections, about 20 MiB).
 * @param probabilities a VAD stream's `probability` events (see {@link ProbabilityStream}); absent: none.
 * @throws VoxError `invalid_request_error` naming the bad `options.*` field, or `probabilities` asked of a model that
 * is not VAD;
 *   `wrong_task` for a `tensor` model (it takes tensors, not audio).
 */
export function createTaskSession(
  config: ModelConfig,
  info: SlotInfo,
  options: unknown,
  keepResults: boolean,
  probabilities?: ProbabilityStream,
): TaskSession {
  if (config.task === 'tensor')
    throw voxError('wrong_task', {
      id: config.id,
      task: 'tensor',
      problem: 'it takes named tensors, not audio: POST /v1/tasks/run with {"model", "inputs"} (docs/models.md)',
    });
  if (probabilities && config.task !== 'vad')
    throw invalid(
      'probabilities',
      `only VAD models stream speech probabilities; '${config.id}' is a ${config.task} model`,
    );
  if (options !== undefined && (typeof options !== 'object' || options === null || Array.isArray(options))) {
    parseTaskOptions(config.task, options); // throws the schema's message for a non-object
  }
  const merged = { ...config.options, ...(options as object | undefined) };
  if (config.task === 'denoise') {
    parseTaskOptions('denoise', merged);
    return new DenoiseSession(info, keepResults);
  }
  if (config.task === 'vad') return new VadSession(info, parseTaskOptions('vad', merged), keepResults, probabilities);
  const opts = parseTaskOptions('wakeword', merged);
  // The request's own fields apply to every head; the model's configured ones only where a head has none.
  const given = (options ?? {}) as Record<string, unknown>;
  const override = {
    threshold: 'threshold' in given ? opts.threshold : undefined,
    refractory_ms: 'refractory_ms' in given ? opts.refractory_ms : undefined,
  };
  return new WakewordSession(info, headsOf(config), opts, override, keepResults);
}

/** The task-specific part of a `/v1/tasks/run` result. */
export function taskResult(session: TaskSession): Record<string, unknown> {
  if (session instanceof VadSession) return { task: 'vad', sample_rate: 16_000, segments: session.segmenter.segments };
  if (session instanceof WakewordSession)
    return session.scoreTrace
      ? { task: 'wakeword', detections: session.detections, scores: session.scoreTrace }
      : { task: 'wakeword', detections: session.detections };
  if (session instanceof DenoiseSession)
    return {
      task: 'denoise',
      sample_rate: 48_000,
      frame_ms: 10,
      probabilities: session.probabilities.map((p) => Math.round(p * 1e6) / 1e6),
    };
  throw new Error('unknown task session');
}
