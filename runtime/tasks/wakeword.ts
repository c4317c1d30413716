import type { ResolvedHead, WakewordOptions } from '../config.js';
import { OWW, type Job, type JobResult, type SlotInfo, type WakewordResult } from '../slots/slot-protocol.js';
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

/** One output column of a stream's heads: its label and detection settings, and its detection state. */
interface Column {
  /** '' for the "no wake word" column of a multi-class head (never reported). */
  label: string;
  threshold: number;
  refractoryMs: number;
  /** at_ms of its last detection. */
  lastAt: number;
}

/**
 * A wake-word request or stream: the openWakeWord streaming pipeline (openwakeword/utils.py
 * AudioFeatures._streaming_features) over 1280-sample steps, with one or more heads. Each step
 * computes the melspectrogram of its 1280 samples plus 480 of look-back (8 frames, transformed
 * x/10 + 2), the embedding of the last 76 frames, and every head over its last N embeddings. As
 * in openWakeWord the mel buffer starts as all ones, the embedding history as the embeddings of
 * 4 s of noise (here always the same noise), and the first 5 predictions are ignored.
 *
 * A detection is emitted for each step whose score reaches the label's `threshold`, except within
 * `refractory_ms` after that label's last detection (as wyoming-openwakeword's refractory
 * period): one utterance, whose score stays high for several steps, fires once.
 */
export class WakewordSession extends WindowedSession {
  /** The detections so far, when kept (`keepResults`: a file's result; a stream keeps none). */
  readonly detections: Detection[] = [];
  /** With the option `scores` and `keepResults` (a file's result): each step's score per label; else null. */
  readonly scoreTrace: { at_ms: number; scores: Record<string, number> }[] | null;
  /** The option `scores`: a `score` event per step. */
  private readonly withScores: boolean;
  private readonly columns: Column[];
  /**
   * The next job's audio: 480 samples of look-back, then its steps. Reused from job to job, as
   * are `mel` and `embeddings`: the job borrows them (a slot gets copies, see `Endpoint.send`)
   * and they change only in `accept`, once its result is back. Fewer large allocations on the
   * server's main thread mean fewer garbage collections there.
   */
  private audio: Float32Array = new Float32Array(OWW.LOOKBACK + OWW.STEP);
  /** Samples in the last job's audio: its last 480 are the next job's look-back (zeros at first). */
  private audioLength: number = OWW.LOOKBACK;
  private readonly mel: Float32Array = new Float32Array(OWW.MEL_FRAMES * OWW.MEL_BINS).fill(1);
  private readonly embeddings: Float32Array;
  private steps = 0;

  /**
   * @param info what the slots reported: per head, its window and column labels, in load order.
   * @param heads the model's heads in the same order (label = model id), with their own settings.
   * @param options the model's options with the request's on top; `override` fields win over each head's own.
   * @param override the request's own option fields (they apply to every head).
   * @param keepResults whether `detections` keeps each detection (a file), or stays empty (a stream: its events carry
   * them).
   */
  constructor(
    info: SlotInfo,
    heads: ResolvedHead[],
    options: WakewordOptions,
    override: { threshold?: number; refractory_ms?: number } = {},
    private readonly keepResults = true,
  ) {
    // openWakeWord's models read int16-scaled audio.
    super(OWW.STEP, 32767);
    this.withScores = options.scores;
    this.scoreTrace = options.scores && keepResults ? [] : null;
    const slotHeads = info.heads ?? [{ window: 16, labels: ['@model'] }];
    if (slotHeads.length !== heads.length)
      throw new Error(`slots report ${slotHeads.length} heads, the model has ${heads.length}`);
    this.columns = slotHeads.flatMap((h, i) =>
      h.labels.map((l) => ({
        label: l === '@model' ? heads[i].label : l,
        threshold: override.threshold ?? heads[i].threshold ?? options.threshold,
        refractoryMs: override.refractory_ms ?? heads[i].refractory_ms ?? options.refractory_ms,
        lastAt: -Infinity,
      })),
    );
    const window = Math.max(...slotHeads.map((h) => h.window));
    this.embeddings = new Float32Array(window * OWW.EMBEDDING);
    if (info.initialEmbeddings)
      this.embeddings.set(info.initialEmbeddings.subarray(info.initialEmbeddings.length - this.embeddings.length));
  }

  get processedSamples(): number {
    return Math.min(this.steps * OWW.STEP, this.received);
  }

  nextJob(maxSteps: number): Job | null {
    const w = this.takeWindows(maxSteps);
    if (!w) return null;
    const length = OWW.LOOKBACK + w.samples.length;
    const lookback = this.audio.subarray(this.audioLength - OWW.LOOKBACK, this.audioLength);
    if (length > this.audio.length) {
      const grown = new Float32Array(length);
      grown.set(lookback, 0);
      this.audio = grown;
    } else this.audio.copyWithin(0, this.audioLength - OWW.LOOKBACK, this.audioLength);
    this.audio.set(w.samples, OWW.LOOKBACK);
    this.audioLength = length;
    return { kind: 'wakeword', audio: this.audio.subarray(0, length), mel: this.mel, embeddings: this.embeddings };
  }

  accept(result: JobResult): TaskEvent[] {
    const r = result as WakewordResult;
    this.inFlight = false;
    this.mel.set(r.mel);
    this.embeddings.set(r.embeddings);
    const cols = this.columns.length;
    const events: TaskEvent[] = [];
    for (let s = 0; s < r.scores.length / cols; s++) {
      const step = this.steps++;
      if (step < WARMUP_STEPS) continue;
      const at = (step + 1) * STEP_MS;
      const scores: Record<string, number> | null = this.withScores ? {} : null;
      const first = events.length;
      for (let c = 0; c < cols; c++) {
        const col = this.columns[c];
        if (!col.label) continue;
        const score = r.scores[s * cols + c];
        if (scores) scores[col.label] = Math.round(score * 10_000) / 10_000;
        if (score >= col.threshold && at - col.lastAt >= col.refractoryMs) {
          col.lastAt = at;
          const d: Detection = { label: col.label, score: Math.round(score * 10_000) / 10_000, at_ms: at };
          if (this.keepResults) this.detections.push(d);
          events.push({ type: 'detection', ...d });
        }
      }
      if (scores) {
        if (this.scoreTrace) this.scoreTrace.push({ at_ms: at, scores });
        // Before the step's detections: a detection's score is the last one drawn.
        else events.splice(first, 0, { type: 'score', at_ms: at, scores });
      }
    }
    return events;
  }
}
