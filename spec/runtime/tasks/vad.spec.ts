import { describe, expect, it } from 'vitest';
import { VadOptions } from '../../../runtime/config.js';
import { VadSegmenter } from '../../../runtime/tasks/vad.js';
import type { TaskEvent } from '../../../runtime/tasks/task.js';
import { getSpeechTimestamps } from '../../helpers.js';

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

  it('item 13 (#25): equals get_speech_timestamps (written out in spec/helpers.ts) on 3,000 random probability sequences, pads 0-1,500 ms with any min_silence_duration_ms', () => {
    // A seeded linear congruential generator: the same cases on every run.
    let seed = 7;
    const rnd = (): number => {
      seed = (seed * 1103515245 + 12345) % 2 ** 31;
      return seed / 2 ** 31;
    };
    const pick = <T>(xs: T[]): T => xs[Math.floor(rnd() * xs.length)];
    for (let t = 0; t < 3000; t++) {
      // Runs of speech and silence, with probabilities between the thresholds too.
      const n = 5 + Math.floor(rnd() * 150);
      const probs: number[] = [];
      let speech = rnd() < 0.5;
      for (let i = 0; i < n; i++) {
        if (rnd() < 0.15) speech = !speech;
        probs.push(speech ? 0.5 + rnd() * 0.5 : rnd() * 0.5);
      }
      const length = n * W - Math.floor(rnd() * W);
      const params = {
        speech_pad_ms: pick([0, 30, 100, 200, 500, 1000, 1500]),
        min_silence_duration_ms: pick([0, 50, 100, 300]),
        min_speech_duration_ms: pick([0, 100, 250]),
        ...(rnd() < 0.3 ? { max_speech_duration_s: pick([0.5, 1, 2.5]) } : {}),
        use_max_poss_sil_at_max_speech: rnd() < 0.5,
      };
      const seg = new VadSegmenter(VadOptions.parse(params));
      probs.forEach((p, i) => seg.push(p, Math.min((i + 1) * W, length)));
      seg.finish(length);
      const got = seg.segments.map((s) => ({ start: s.start_sample, end: s.end_sample }));
      expect(got, JSON.stringify({ params, length, probs })).toEqual(getSpeechTimestamps(probs, length, params));
    }
  });

  it("item 13 (#25), streams: a segment's speech_end waits until 2 x speech_pad_ms of audio past its end (a segment starting within that would halve its padding)", () => {
    // pad 500 ms = 8000 samples; speech in windows 30-49, silence after: the segment ends at
    // window 50 (sample 25600), is closed after min_silence_duration_ms (100 ms: window 54), and
    // its end padding is known once 2 x 500 ms = 16000 samples past its end are processed.
    const seg = new VadSegmenter(VadOptions.parse({ speech_pad_ms: 500 }));
    const probs = [...repeat(0.05, 30), ...repeat(0.9, 20), ...repeat(0.05, 60)];
    const at: number[] = [];
    probs.forEach((p, i) => {
      if (seg.push(p, (i + 1) * W).some((e) => e.type === 'speech_end')) at.push((i + 1) * W);
    });
    expect(at).toHaveLength(1);
    expect(at[0]).toBeGreaterThanOrEqual(50 * W + 16000);
    expect(at[0]).toBeLessThan(50 * W + 16000 + W);
    expect(seg.segments[0]).toMatchObject({ start_sample: 30 * W - 8000, end_sample: 50 * W + 8000 });
  });
});
