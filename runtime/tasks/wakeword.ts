import type { WakewordOptions } from '../config.js';
import { OWW, type Job, type JobResult, type SlotInfo, type WakewordResult } from '../slot-protocol.js';
import { SampleBuffer, type TaskEvent, type TaskSession } from './task.js';

/** openWakeWord zeroes the first 5 predictions of a stream while its buffers fill (openwakeword/model.py). */
const WARMUP_STEPS = 5;
const STEP_MS = (OWW.STEP * 1000) / 16_000;

/** A wake-word detection: the step (80 ms) at which the score first reached the threshold. */
export interface Detection {
  label: string;
  score: number;
  at_ms: number;
}

/**
 * A wake-word request or stream: the openWakeWord streaming pipeline (openwakeword/utils.py
 * AudioFeatures._streaming_features) over 1280-sample steps. Each step computes the
 * melspectrogram of its 1280 samples plus 480 of look-back (8 frames, transformed x/10 + 2),
 * the embedding of the last 76 frames, and the head over the last N embeddings. As in
 * openWakeWord the mel buffer starts as all ones; the embedding history starts as N copies of
 * the embedding of that buffer (openWakeWord uses random noise there), and the first 5
 * predictions are ignored.
 *
 * A detection is emitted when a label's score reaches `threshold`; that label re-arms once its
 * score falls below the threshold again.
 */
export class WakewordSession implements TaskSession {
  readonly detections: Detection[] = [];
  private readonly labels: string[];
  private readonly armed: boolean[];
  private readonly pending = new SampleBuffer();
  private lookback: Float32Array = new Float32Array(OWW.LOOKBACK);
  private mel: Float32Array = new Float32Array(OWW.MEL_FRAMES * OWW.MEL_BINS).fill(1);
  private embeddings: Float32Array;
  private steps = 0;
  private received = 0;
  private ended = false;
  private inFlight = false;

  /** @param modelLabel the label of a single-output head (the model id). */
  constructor(info: SlotInfo, private readonly options: WakewordOptions, modelLabel: string) {
    const window = info.headWindow ?? 16;
    this.labels = (info.labels ?? ['@model']).map((l) => (l === '@model' ? modelLabel : l));
    this.armed = this.labels.map(() => true);
    this.embeddings = new Float32Array(window * OWW.EMBEDDING);
    const init = info.initialEmbedding ?? new Float32Array(OWW.EMBEDDING);
    for (let i = 0; i < window; i++) this.embeddings.set(init, i * OWW.EMBEDDING);
  }

  get receivedSamples(): number {
    return this.received;
  }

  get pendingSamples(): number {
    return this.pending.length;
  }

  get processedSamples(): number {
    return Math.min(this.steps * OWW.STEP, this.received);
  }

  readonly step = OWW.STEP;

  get finished(): boolean {
    return this.ended && !this.inFlight && this.pending.length === 0;
  }

  push(samples: Float32Array): void {
    // openWakeWord's models read int16-scaled audio.
    this.pending.push(samples, 32767);
    this.received += samples.length;
  }

  end(): TaskEvent[] {
    if (this.ended) return [];
    this.ended = true;
    const partial = this.pending.length % OWW.STEP;
    if (partial) this.pending.push(new Float32Array(OWW.STEP - partial));
    return [];
  }

  nextJob(maxSteps: number): Job | null {
    const k = Math.min(maxSteps, Math.floor(this.pending.length / OWW.STEP));
    if (this.inFlight || k === 0) return null;
    this.inFlight = true;
    const audio = new Float32Array(OWW.LOOKBACK + k * OWW.STEP);
    audio.set(this.lookback, 0);
    audio.set(this.pending.take(k * OWW.STEP), OWW.LOOKBACK);
    this.lookback = audio.slice(audio.length - OWW.LOOKBACK);
    return { kind: 'wakeword', audio, mel: this.mel, embeddings: this.embeddings };
  }

  accept(result: JobResult): TaskEvent[] {
    const r = result as WakewordResult;
    this.inFlight = false;
    this.mel = r.mel;
    this.embeddings = r.embeddings;
    const cols = this.labels.length;
    const events: TaskEvent[] = [];
    for (let s = 0; s < r.scores.length / cols; s++) {
      const step = this.steps++;
      if (step < WARMUP_STEPS) continue;
      for (let c = 0; c < cols; c++) {
        if (!this.labels[c]) continue; // the "no wake word" column of a multi-class head
        const score = r.scores[s * cols + c];
        if (score < this.options.threshold) {
          this.armed[c] = true;
        } else if (this.armed[c]) {
          this.armed[c] = false;
          const d: Detection = { label: this.labels[c], score: Math.round(score * 1000) / 1000, at_ms: (step + 1) * STEP_MS };
          this.detections.push(d);
          events.push({ type: 'detection', ...d });
        }
      }
    }
    return events;
  }
}
