import type { VadOptions } from '../config.js';
import { SILERO, type Job, type JobResult, type SlotInfo, type VadResult } from '../slot-protocol.js';
import { WindowedSession, type TaskEvent } from './task.js';

const RATE = 16_000;
const msOf = (samples: number): number => Math.round((samples * 1000) / RATE);

/** A detected speech segment; samples at 16 kHz, confidence = mean speech probability over it. */
export interface Segment {
  start_ms: number;
  end_ms: number;
  start_sample: number;
  end_sample: number;
  confidence: number;
}

/**
 * Silero VAD segmentation, streaming: the state machine of `get_speech_timestamps` in
 * silero-vad's utils_vad.py (threshold, neg_threshold, min_speech_duration_ms,
 * min_silence_duration_ms, speech_pad_ms; max_speech_duration_s is not supported, i.e. infinite),
 * fed one window probability at a time.
 *
 * Differences from the offline function, which sees the whole file: `speech_start` is emitted once
 * a segment is certain to be kept (longer than min_speech_duration_ms), and padding is applied as
 * segments close: a start is padded back by speech_pad_ms but never before the previous padded end.
 * With min_silence_duration_ms >= 2 x speech_pad_ms (the defaults) the result is Silero's exactly.
 */
export class VadSegmenter {
  /** The segments closed so far, when kept (see the constructor). */
  readonly segments: Segment[] = [];
  private readonly thr: number;
  private readonly neg: number;
  private readonly minSpeech: number;
  private readonly minSilence: number;
  private readonly pad: number;
  private triggered = false;
  private started = false;
  private start = 0;
  private tempEnd = 0;
  private probs: number[] = [];
  private prevEnd = 0;
  private index = 0;

  /** @param keep whether `segments` keeps each closed segment (a file's result), or stays empty (a stream). */
  constructor(
    o: VadOptions,
    private readonly keep = true,
  ) {
    this.thr = o.threshold;
    this.neg = o.neg_threshold ?? Math.max(o.threshold - 0.15, 0.01);
    this.minSpeech = (RATE * o.min_speech_duration_ms) / 1000;
    this.minSilence = (RATE * o.min_silence_duration_ms) / 1000;
    this.pad = Math.floor((RATE * o.speech_pad_ms) / 1000);
  }

  private paddedStart(): number {
    return Math.max(this.prevEnd, this.start - this.pad, 0);
  }

  /** Feeds the next window's probability; `processed` = samples processed so far. */
  push(p: number, processed: number): TaskEvent[] {
    const events: TaskEvent[] = [];
    const sample = SILERO.WINDOW * this.index++;
    if (p >= this.thr && this.tempEnd) this.tempEnd = 0;
    if (p >= this.thr && !this.triggered) {
      this.triggered = true;
      this.started = false;
      this.start = sample;
      this.probs = [p];
      return events;
    }
    if (!this.triggered) return events;
    this.probs.push(p);
    if (!this.started && (this.tempEnd || sample) - this.start > this.minSpeech) {
      this.started = true;
      events.push({ type: 'speech_start', at_ms: msOf(this.paddedStart()) });
    }
    if (p < this.neg) {
      if (!this.tempEnd) this.tempEnd = sample;
      if (sample - this.tempEnd >= this.minSilence) {
        if (this.tempEnd - this.start > this.minSpeech) events.push(...this.close(this.tempEnd, processed));
        this.triggered = false;
        this.tempEnd = 0;
      }
    }
    return events;
  }

  /** End of audio at `total` samples: closes an open segment long enough to keep. */
  finish(total: number): TaskEvent[] {
    if (!this.triggered || total - this.start <= this.minSpeech) return [];
    const events: TaskEvent[] = [];
    if (!this.started) events.push({ type: 'speech_start', at_ms: msOf(this.paddedStart()) });
    this.triggered = false;
    return [...events, ...this.close(total, total)];
  }

  private close(end: number, limit: number): TaskEvent[] {
    const windows = Math.max(1, Math.ceil((end - this.start) / SILERO.WINDOW));
    const used = this.probs.slice(0, windows);
    const confidence = Math.round((used.reduce((a, b) => a + b, 0) / used.length) * 1000) / 1000;
    const seg: Segment = {
      start_sample: this.paddedStart(),
      end_sample: Math.min(end + this.pad, limit),
      start_ms: 0,
      end_ms: 0,
      confidence,
    };
    seg.start_ms = msOf(seg.start_sample);
    seg.end_ms = msOf(seg.end_sample);
    this.prevEnd = seg.end_sample;
    if (this.keep) this.segments.push(seg);
    return [{ type: 'speech_end', start_ms: seg.start_ms, end_ms: seg.end_ms, confidence }];
  }
}

/** A VAD request or stream: 512-sample windows through Silero, segmented by {@link VadSegmenter}. */
export class VadSession extends WindowedSession {
  readonly segmenter: VadSegmenter;
  private state: Float32Array = new Float32Array(SILERO.STATE);
  private context: Float32Array = new Float32Array(SILERO.CONTEXT);
  private processed = 0;

  /** @param keepResults whether the segmenter keeps its segments (see {@link VadSegmenter}). */
  constructor(_info: SlotInfo, options: VadOptions, keepResults = true) {
    super(SILERO.WINDOW);
    this.segmenter = new VadSegmenter(options, keepResults);
  }

  get processedSamples(): number {
    return this.processed;
  }

  protected override closing(): TaskEvent[] {
    return this.segmenter.finish(this.received);
  }

  nextJob(maxSteps: number): Job | null {
    const w = this.takeWindows(maxSteps);
    return w && { kind: 'vad', windows: w.samples, state: this.state, context: this.context };
  }

  accept(result: JobResult): TaskEvent[] {
    const r = result as VadResult;
    this.inFlight = false;
    this.state = r.state;
    this.context = r.context;
    const events: TaskEvent[] = [];
    for (const p of r.probs) {
      this.processed = Math.min(this.processed + SILERO.WINDOW, this.received);
      events.push(...this.segmenter.push(p, this.processed));
    }
    if (this.finished) events.push(...this.closing());
    return events;
  }
}
