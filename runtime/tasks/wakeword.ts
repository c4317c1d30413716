import type { WakewordOptions } from '../config.js';
import { OWW, type Job, type JobResult, type SlotInfo, type WakewordResult } from '../slot-protocol.js';
import { WindowedSession, type TaskEvent } from './task.js';

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
export class WakewordSession extends WindowedSession {
  readonly detections: Detection[] = [];
  private readonly labels: string[];
  private readonly armed: boolean[];
  private lookback: Float32Array = new Float32Array(OWW.LOOKBACK);
  private mel: Float32Array = new Float32Array(OWW.MEL_FRAMES * OWW.MEL_BINS).fill(1);
  private embeddings: Float32Array;
  private steps = 0;

  /** @param modelLabel the label of a single-output head (the model id). */
  constructor(info: SlotInfo, private readonly options: WakewordOptions, modelLabel: string) {
    // openWakeWord's models read int16-scaled audio.
    super(OWW.STEP, 32767);
    const window = info.headWindow ?? 16;
    this.labels = (info.labels ?? ['@model']).map((l) => (l === '@model' ? modelLabel : l));
    this.armed = this.labels.map(() => true);
    this.embeddings = new Float32Array(window * OWW.EMBEDDING);
    const init = info.initialEmbedding ?? new Float32Array(OWW.EMBEDDING);
    for (let i = 0; i < window; i++) this.embeddings.set(init, i * OWW.EMBEDDING);
  }

  get processedSamples(): number {
    return Math.min(this.steps * OWW.STEP, this.received);
  }

  nextJob(maxSteps: number): Job | null {
    const w = this.takeWindows(maxSteps);
    if (!w) return null;
    const audio = new Float32Array(OWW.LOOKBACK + w.samples.length);
    audio.set(this.lookback, 0);
    audio.set(w.samples, OWW.LOOKBACK);
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
