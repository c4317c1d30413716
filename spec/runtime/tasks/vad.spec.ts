import { describe, expect, it } from 'vitest';
import { VadOptions } from '../../../runtime/config.js';
import { VadSegmenter } from '../../../runtime/tasks/vad.js';
import type { TaskEvent } from '../../../runtime/tasks/task.js';

const W = 512;
const defaults = VadOptions.parse({});

/** Feeds window probabilities; returns all events including the end-of-audio ones. */
function run(probs: number[], options = defaults): { events: TaskEvent[]; seg: VadSegmenter } {
  const seg = new VadSegmenter(options);
  const events: TaskEvent[] = [];
  probs.forEach((p, i) => events.push(...seg.push(p, (i + 1) * W)));
  events.push(...seg.finish(probs.length * W));
  return { events, seg };
}

const repeat = (p: number, n: number): number[] => Array(n).fill(p);

describe('VadSegmenter (Silero get_speech_timestamps)', () => {
  it('finds one padded segment in silence-speech-silence', () => {
    // 10 windows silence, 20 speech (640 ms), 10 silence.
    const { seg } = run([...repeat(0.05, 10), ...repeat(0.9, 20), ...repeat(0.05, 10)]);
    expect(seg.segments).toHaveLength(1);
    const s = seg.segments[0];
    expect(s.start_sample).toBe(10 * W - 480); // speech_pad_ms 30 = 480 samples
    expect(s.end_sample).toBe(30 * W + 480);
    expect(s.confidence).toBeCloseTo(0.9, 3);
  });

  it('drops speech shorter than min_speech_duration_ms', () => {
    const { seg, events } = run([...repeat(0.05, 10), ...repeat(0.9, 5), ...repeat(0.05, 10)]); // 160 ms
    expect(seg.segments).toHaveLength(0);
    expect(events).toHaveLength(0);
  });

  it('bridges pauses shorter than min_silence_duration_ms', () => {
    // 2 windows (64 ms) of silence inside speech: under 100 ms, one segment.
    const { seg } = run([
      ...repeat(0.05, 5),
      ...repeat(0.9, 10),
      ...repeat(0.05, 2),
      ...repeat(0.9, 10),
      ...repeat(0.05, 10),
    ]);
    expect(seg.segments).toHaveLength(1);
  });

  it('splits on pauses of min_silence_duration_ms or more', () => {
    const { seg } = run([
      ...repeat(0.05, 5),
      ...repeat(0.9, 10),
      ...repeat(0.05, 6),
      ...repeat(0.9, 10),
      ...repeat(0.05, 10),
    ]);
    expect(seg.segments).toHaveLength(2);
    expect(seg.segments[0].end_sample).toBe(15 * W + 480);
    expect(seg.segments[1].start_sample).toBe(21 * W - 480);
  });

  it('keeps speech between neg_threshold and threshold as speech (hysteresis)', () => {
    const { seg } = run([
      ...repeat(0.05, 5),
      ...repeat(0.9, 10),
      ...repeat(0.4, 10),
      ...repeat(0.9, 5),
      ...repeat(0.05, 10),
    ]);
    expect(seg.segments).toHaveLength(1);
  });

  it('closes speech running to the end of the audio at the audio length', () => {
    const { seg } = run([...repeat(0.05, 5), ...repeat(0.9, 20)]);
    expect(seg.segments).toEqual([expect.objectContaining({ start_sample: 5 * W - 480, end_sample: 25 * W })]);
  });

  it('emits speech_start once a segment is certain, before it ends, and speech_end with the segment', () => {
    const seg = new VadSegmenter(defaults);
    const first: TaskEvent[] = [];
    [...repeat(0.05, 5), ...repeat(0.9, 9)].forEach((p, i) => first.push(...seg.push(p, (i + 1) * W)));
    expect(first).toEqual([{ type: 'speech_start', at_ms: Math.round(((5 * W - 480) * 1000) / 16000) }]);
    const rest: TaskEvent[] = [];
    repeat(0.05, 10).forEach((p, i) => rest.push(...seg.push(p, (15 + i) * W)));
    expect(rest).toEqual([{ type: 'speech_end', start_ms: 130, end_ms: 478, confidence: 0.9 }]);
  });

  it('honours threshold and min_speech_duration_ms overrides', () => {
    const o = VadOptions.parse({ threshold: 0.95, min_speech_duration_ms: 50 });
    expect(run([...repeat(0.05, 5), ...repeat(0.9, 20), ...repeat(0.05, 10)], o).seg.segments).toHaveLength(0);
    const short = VadOptions.parse({ min_speech_duration_ms: 50 });
    expect(run([...repeat(0.05, 10), ...repeat(0.9, 5), ...repeat(0.05, 10)], short).seg.segments).toHaveLength(1);
  });
});
