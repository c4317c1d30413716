import { createHash } from 'node:crypto';
import { z } from 'zod';
import type { VadOptions } from '../config.js';
import { invalid } from '../errors.js';
import { SILERO, type Job, type JobResult, type SlotInfo, type VadResult } from '../slots/slot-protocol.js';
import { WindowedSession, type TaskEvent } from './task.js';

const RATE = 16_000;
const msOf = (samples: number): number => Math.round((samples * 1000) / RATE);
/** Probabilities a segmenter keeps outside a segment before it lets them go (see `settle`). */
const PROBS_KEPT = 64;

/** A detected speech segment; samples at 16 kHz, confidence = mean speech probability over it. */
export interface Segment {
  start_ms: number;
  end_ms: number;
  start_sample: number;
  end_sample: number;
  confidence: number;
}

/** A kept segment whose end padding waits for the start of the next kept segment. */
interface Closed {
  start_sample: number;
  end: number;
  confidence: number;
}

/**
 * Silero VAD segmentation, streaming: the state machine of `get_speech_timestamps` in
 * silero-vad's utils_vad.py (threshold, neg_threshold, min_speech_duration_ms,
 * min_silence_duration_ms, speech_pad_ms, max_speech_duration_s, min_silence_at_max_speech,
 * use_max_poss_sil_at_max_speech; same names, defaults and rules), fed one window probability at
 * a time.
 *
 * `max_speech_duration_s`: a segment that grows past it (less one window and both paddings, as in
 * Silero) is split, at the longest silence over `min_silence_at_max_speech` (98 ms) inside it
 * (`use_max_poss_sil_at_max_speech`, Silero's default) or at the last such silence (false); with
 * none, it is cut where it stands.
 *
 * The segments are Silero's exactly; only their timing differs from the offline function, which
 * sees the whole file: `speech_start` is emitted once a segment is certain to be kept, and
 * `speech_end` once its end padding is known: Silero pads each end by speech_pad_ms, or by half
 * the gap to the next segment when that gap is under 2 x speech_pad_ms, so a closed segment waits
 * until no kept segment can start within 2 x speech_pad_ms of its end. With the defaults
 * (min_silence_duration_ms 100 >= 2 x speech_pad_ms 30) that is at once, except after a cut.
 */
export class VadSegmenter {
  /** The segments finished so far, when kept (see the constructor). */
  readonly segments: Segment[] = [];
  private readonly thr: number;
  private readonly neg: number;
  private readonly minSpeech: number;
  private readonly minSilence: number;
  private readonly pad: number;
  private readonly maxSpeech: number;
  private readonly minSilenceAtMax: number;
  private readonly useMaxPoss: boolean;
  // Silero's state, named as in get_speech_timestamps (samples).
  private triggered = false;
  private start = 0;
  private tempEnd = 0;
  private prevEnd = 0;
  private nextStart = 0;
  private possibleEnds: [end: number, silence: number][] = [];
  // The streaming layer.
  /** speech_start was sent for the current segment (it is certain to be kept). */
  private started = false;
  /** The current segment's padded start, once started. */
  private startPadded = 0;
  /** Unpadded end of the last kept segment (for the next one's start padding). */
  private lastEnd: number | null = null;
  private closed: Closed | null = null;
  /**
   * Window probabilities from window `probsBase` on (the current segment's and later; outside one, up to {@link
   * PROBS_KEPT} recent).
   */
  private probs: number[] = [];
  private probsBase = 0;
  private index = 0;

  /** @param keep whether `segments` keeps each finished segment (a file's result), or stays empty (a stream). */
  constructor(
    o: VadOptions,
    private readonly keep = true,
  ) {
    this.thr = o.threshold;
    this.neg = o.neg_threshold ?? Math.max(o.threshold - 0.15, 0.01);
    this.minSpeech = (RATE * o.min_speech_duration_ms) / 1000;
    this.minSilence = (RATE * o.min_silence_duration_ms) / 1000;
    this.pad = Math.floor((RATE * o.speech_pad_ms) / 1000);
    this.maxSpeech =
      o.max_speech_duration_s === undefined ? Infinity : RATE * o.max_speech_duration_s - SILERO.WINDOW - 2 * this.pad;
    this.minSilenceAtMax = (RATE * o.min_silence_at_max_speech) / 1000;
    this.useMaxPoss = o.use_max_poss_sil_at_max_speech;
  }

  /** Feeds the next window's probability; `processed` = samples processed so far (this window included). */
  push(p: number, processed: number): TaskEvent[] {
    const events: TaskEvent[] = [];
    const cur = SILERO.WINDOW * this.index++;
    this.probs.push(p);
    if (p >= this.thr && this.tempEnd) {
      const silence = cur - this.tempEnd;
      if (silence > this.minSilenceAtMax) this.possibleEnds.push([this.tempEnd, silence]);
      this.tempEnd = 0;
      if (this.nextStart < this.prevEnd) this.nextStart = cur;
    }
    if (p >= this.thr && !this.triggered) {
      this.triggered = true;
      this.begin(cur);
      return this.settle(cur, processed, events);
    }
    if (this.triggered && cur - this.start > this.maxSpeech) {
      if (this.useMaxPoss && this.possibleEnds.length) {
        // The longest silence; the first of equals, as Python's max().
        const [end, silence] = this.possibleEnds.reduce((a, b) => (b[1] > a[1] ? b : a));
        this.cut(end, events);
        this.nextStart = end + silence;
        if (this.nextStart < end + cur) this.begin(this.nextStart);
        else this.triggered = false;
      } else if (this.prevEnd) {
        this.cut(this.prevEnd, events);
        if (this.nextStart < this.prevEnd) this.triggered = false;
        else this.begin(this.nextStart);
      } else {
        this.cut(cur, events);
        this.triggered = false;
        this.prevEnd = this.nextStart = this.tempEnd = 0;
        this.possibleEnds = [];
        return this.settle(cur, processed, events);
      }
      this.prevEnd = this.nextStart = this.tempEnd = 0;
      this.possibleEnds = [];
    }
    if (p < this.neg && this.triggered) {
      if (!this.tempEnd) this.tempEnd = cur;
      const silence = cur - this.tempEnd;
      if (!this.useMaxPoss && silence > this.minSilenceAtMax) this.prevEnd = this.tempEnd;
      if (silence >= this.minSilence) {
        if (this.tempEnd - this.start > this.minSpeech) this.cut(this.tempEnd, events);
        this.prevEnd = this.nextStart = this.tempEnd = 0;
        this.triggered = false;
        this.possibleEnds = [];
      }
    }
    return this.settle(cur, processed, events);
  }

  /** The segmenter's state (not its options, nor the segments kept), for {@link VadSession.checkpoint}. */
  snapshot(): SegmenterState {
    return {
      triggered: this.triggered,
      start: this.start,
      tempEnd: this.tempEnd,
      prevEnd: this.prevEnd,
      nextStart: this.nextStart,
      possibleEnds: this.possibleEnds.map(([e, s]) => [e, s]),
      started: this.started,
      startPadded: this.startPadded,
      lastEnd: this.lastEnd,
      closed: this.closed && { ...this.closed },
      probs: [...this.probs],
      probsBase: this.probsBase,
      index: this.index,
    };
  }

  /** Takes on a state {@link snapshot} gave (of a segmenter with the same options). */
  restore(s: SegmenterState): void {
    Object.assign(this, {
      ...s,
      possibleEnds: s.possibleEnds.map(([e, x]) => [e, x]),
      closed: s.closed && { ...s.closed },
      probs: [...s.probs],
    });
  }

  /** End of audio at `total` samples: keeps an open segment long enough, and finishes the last one. */
  finish(total: number): TaskEvent[] {
    const events: TaskEvent[] = [];
    if (this.triggered && total - this.start > this.minSpeech) this.cut(total, events);
    this.triggered = false;
    if (this.closed) events.push(this.finishClosed(null, total));
    return events;
  }

  /** A new current segment starts at `start` (not yet certain to be kept). */
  private begin(start: number): void {
    this.start = start;
    this.started = false;
    const drop = start / SILERO.WINDOW - this.probsBase;
    if (drop > 0) this.probs.splice(0, drop);
    this.probsBase = start / SILERO.WINDOW;
  }

  /** The current segment is certain to be kept: the one before it is finished, and speech_start sent. */
  private confirm(events: TaskEvent[]): void {
    if (this.closed) events.push(this.finishClosed(this.start - this.closed.end, Infinity));
    const gap = this.lastEnd === null ? Infinity : this.start - this.lastEnd;
    this.startPadded = gap < 2 * this.pad ? this.start - Math.floor(gap / 2) : Math.max(0, this.start - this.pad);
    this.started = true;
    events.push({ type: 'speech_start', at_ms: msOf(this.startPadded) });
  }

  /** Keeps the current segment, ending at `end` (unpadded); it finishes once its end padding is known. */
  private cut(end: number, events: TaskEvent[]): void {
    if (!this.started) this.confirm(events);
    const windows = Math.max(1, Math.ceil((end - this.start) / SILERO.WINDOW));
    const used = this.probs.slice(this.start / SILERO.WINDOW - this.probsBase).slice(0, windows);
    const confidence = Math.round((used.reduce((a, b) => a + b, 0) / used.length) * 1000) / 1000;
    this.closed = { start_sample: this.startPadded, end, confidence };
    this.lastEnd = end;
    this.started = false;
  }

  /** Emits what is due after a window: a speech_start now certain, a closed segment whose padding is now known. */
  private settle(cur: number, processed: number, events: TaskEvent[]): TaskEvent[] {
    if (this.triggered && !this.started && (this.tempEnd || cur) - this.start > this.minSpeech) this.confirm(events);
    // The earliest start a later kept segment can have: the current (unconfirmed) one's, else past what was processed.
    if (this.closed && (this.triggered ? this.start : processed) - this.closed.end >= 2 * this.pad)
      events.push(this.finishClosed(null, Infinity));
    // Outside a segment the probabilities are not needed; they are let go in blocks, not every
    // window (emptying the array frees its backing store, and the next push allocates another).
    if (!this.triggered && this.probs.length >= PROBS_KEPT) {
      this.probs.length = 0;
      this.probsBase = this.index;
    }
    return events;
  }

  /**
   * Finishes the closed segment: end padded by half of `gap` to the next segment when under 2 x pad, else by pad (at
   * most `limit`).
   */
  private finishClosed(gap: number | null, limit: number): TaskEvent {
    const c = this.closed!;
    this.closed = null;
    const end = gap !== null && gap < 2 * this.pad ? c.end + Math.floor(gap / 2) : Math.min(limit, c.end + this.pad);
    const seg: Segment = {
      start_sample: c.start_sample,
      end_sample: end,
      start_ms: msOf(c.start_sample),
      end_ms: msOf(end),
      confidence: c.confidence,
    };
    if (this.keep) this.segments.push(seg);
    return { type: 'speech_end', start_ms: seg.start_ms, end_ms: seg.end_ms, confidence: c.confidence };
  }
}

/** A {@link VadSegmenter}'s state (samples, window indexes and probabilities), as `snapshot` gives it. */
export type SegmenterState = Omit<z.infer<typeof segmenterNumbers>, 'probs'> & { probs: number[] };

/** The most samples a checkpoint counts: a week of 16 kHz audio, as `offset_ms` allows. */
const MAX_SAMPLES = 7 * 24 * 3600 * RATE;
const sample = z.number().int().min(0).max(MAX_SAMPLES);
/** The segmenter's state in a checkpoint's header: its window probabilities as their count (they follow as float32). */
const segmenterNumbers = z
  .object({
    triggered: z.boolean(),
    start: sample,
    tempEnd: sample,
    prevEnd: sample,
    nextStart: sample,
    possibleEnds: z.array(z.tuple([sample, sample])).max(100_000),
    started: z.boolean(),
    startPadded: sample,
    lastEnd: sample.nullable(),
    closed: z.object({ start_sample: sample, end: sample, confidence: z.number().min(0).max(1) }).nullable(),
    probs: z.number().int().min(0),
    probsBase: sample,
    index: sample,
  })
  .strict();

/**
 * Where a VAD stream resumes from: its model and options (a fingerprint), its clock's start, the samples processed,
 * Silero's state and the segmenter's.
 */
export interface VadCheckpoint {
  /** The model's id. */
  model: string;
  /** The task options' fingerprint ({@link optionsFingerprint}). */
  options: string;
  /** The stream's clock at its sample 0, ms (its `offset_ms`). */
  baseMs: number;
  /** Samples processed (16 kHz), a whole number of windows. */
  processed: number;
  state: Float32Array;
  context: Float32Array;
  segmenter: SegmenterState;
}

/** The longest checkpoint a VAD stream gives, characters: it fits a URL (a `resume_from`) with room to spare. */
export const MAX_CHECKPOINT_CHARS = 8192;

const checkpointHeader = z
  .object({
    v: z.literal(1),
    model: z.string().max(256),
    options: z.string().regex(/^[0-9a-f]{16}$/),
    base_ms: z.number().int().min(0).max(604_800_000),
    processed: sample.refine((n) => n % SILERO.WINDOW === 0, 'a whole number of windows'),
    segmenter: segmenterNumbers,
  })
  .strict();

/** Bytes of SHA-256 that end a checkpoint: an integrity check (a checkpoint cut or edited), not a signature. */
const CHECK_BYTES = 8;
const digest = (b: Uint8Array): Buffer => createHash('sha256').update(b).digest().subarray(0, CHECK_BYTES);

/** 16 hex digits of SHA-256 over VAD task options (as parsed: the schema's key order). */
const optionsFingerprint = (o: VadOptions): string =>
  createHash('sha256').update(JSON.stringify(o)).digest('hex').slice(0, 16);

/**
 * Encodes a checkpoint as base64url of: a little-endian uint32 (the JSON header's bytes), the JSON
 * header (version, model, options' fingerprint, clock, samples, the segmenter's numbers), float32s
 * (Silero's state (256), its context (64) and the segmenter's window probabilities; float32 because
 * the model gives float32: every value comes back bit for bit), then the first 8 bytes of SHA-256
 * over all that.
 */
function encodeCheckpoint(c: VadCheckpoint): string {
  const { probs, ...rest } = c.segmenter;
  const head = Buffer.from(
    JSON.stringify({
      v: 1,
      model: c.model,
      options: c.options,
      base_ms: c.baseMs,
      processed: c.processed,
      segmenter: { ...rest, probs: probs.length },
    }),
  );
  const floats = new Float32Array(SILERO.STATE + SILERO.CONTEXT + probs.length);
  floats.set(c.state);
  floats.set(c.context, SILERO.STATE);
  floats.set(probs, SILERO.STATE + SILERO.CONTEXT);
  const size = 4 + head.length + floats.byteLength;
  const out = Buffer.alloc(size + CHECK_BYTES);
  out.writeUInt32LE(head.length, 0);
  head.copy(out, 4);
  Buffer.from(floats.buffer).copy(out, 4 + head.length);
  digest(out.subarray(0, size)).copy(out, size);
  return out.toString('base64url');
}

/**
 * Reads a checkpoint a VAD stream gave (its `progress` event's `checkpoint`).
 * @throws VoxError `invalid_field` naming `resume_from`: not base64url, not a checkpoint of this
 *   version, cut or edited (its SHA-256 check), inconsistent (window counts, lengths), or a value out of
 *   range (a probability outside 0..1, a state value not finite).
 */
export function parseCheckpoint(text: string): VadCheckpoint {
  const bad = (problem: string) => invalid('resume_from', `not a VAD stream's checkpoint: ${problem}`);
  if (text.length > MAX_CHECKPOINT_CHARS || !/^[A-Za-z0-9_-]+$/.test(text))
    throw bad(`base64url of at most ${MAX_CHECKPOINT_CHARS} characters expected`);
  const all = Buffer.from(text, 'base64url');
  const bytes = all.subarray(0, Math.max(0, all.length - CHECK_BYTES));
  if (all.length <= CHECK_BYTES || !digest(bytes).equals(all.subarray(bytes.length)))
    throw bad('its integrity check fails (cut short or edited)');
  const headLength = bytes.length >= 4 ? bytes.readUInt32LE(0) : Infinity;
  if (4 + headLength > bytes.length) throw bad('too short');
  let head: z.infer<typeof checkpointHeader>;
  try {
    const parsed = checkpointHeader.safeParse(JSON.parse(bytes.subarray(4, 4 + headLength).toString('utf8')));
    if (!parsed.success)
      throw new Error(parsed.error.issues.map((i) => `${i.path.join('.')}: ${i.message}`).join('; '));
    head = parsed.data;
  } catch (e) {
    throw bad((e as Error).message.slice(0, 200));
  }
  const n = head.segmenter.probs;
  const rest = bytes.subarray(4 + headLength);
  if (rest.length !== 4 * (SILERO.STATE + SILERO.CONTEXT + n)) throw bad('its float32 part has the wrong length');
  const floats = new Float32Array(rest.length / 4);
  Buffer.from(floats.buffer).set(rest);
  if (!floats.every(Number.isFinite)) throw bad('a value is not finite');
  const probs = [...floats.subarray(SILERO.STATE + SILERO.CONTEXT)];
  if (probs.some((p) => p < 0 || p > 1)) throw bad('a probability outside 0..1');
  const g: SegmenterState = { ...head.segmenter, probs };
  if (g.index * SILERO.WINDOW !== head.processed || g.probsBase + n !== g.index)
    throw bad('its window counts disagree');
  // Positions as the segmenter makes them: window starts (but the padded ones), none past the audio processed.
  const starts = [g.start, g.tempEnd, g.prevEnd, g.nextStart, ...g.possibleEnds.map(([e]) => e)];
  const ends = [g.startPadded, g.lastEnd ?? 0, g.closed?.start_sample ?? 0, g.closed?.end ?? 0];
  if (
    starts.some((x) => x % SILERO.WINDOW) ||
    [...starts, ...ends].some((x) => x > head.processed) ||
    (g.closed && g.closed.start_sample > g.closed.end)
  )
    throw bad("the segmenter's positions disagree with each other");
  return {
    model: head.model,
    options: head.options,
    baseMs: head.base_ms,
    processed: head.processed,
    state: floats.slice(0, SILERO.STATE),
    context: floats.slice(SILERO.STATE, SILERO.STATE + SILERO.CONTEXT),
    segmenter: g,
  };
}

/**
 * A stream's opt-in speech probabilities: one `probability` event per 32 ms window
 * (`intervalMs` 0), or one per `intervalMs` span of stream time carrying the windows that start
 * in it (`p` a list). Values are the model's, rounded to 1e-6.
 */
export interface ProbabilityStream {
  intervalMs: number;
}

const WINDOW_MS = (SILERO.WINDOW * 1000) / RATE;

/** A VAD request or stream: 512-sample windows through Silero, segmented by {@link VadSegmenter}. */
export class VadSession extends WindowedSession {
  readonly segmenter: VadSegmenter;
  private state: Float32Array = new Float32Array(SILERO.STATE);
  private context: Float32Array = new Float32Array(SILERO.CONTEXT);
  private processed = 0;

  /** Windows whose probabilities have been accepted. */
  private windows = 0;
  /** The current span's probabilities (with `probabilities.intervalMs`), and its first window. */
  private span: number[] = [];
  private spanStart = 0;

  /**
   * @param keepResults whether the segmenter keeps its segments (see {@link VadSegmenter}).
   * @param probabilities whether (and how) `probability` events are emitted; absent: never.
   */
  constructor(
    _info: SlotInfo,
    options: VadOptions,
    keepResults = true,
    private readonly probabilities?: ProbabilityStream,
  ) {
    super(SILERO.WINDOW);
    this.segmenter = new VadSegmenter(options, keepResults);
    this.options = optionsFingerprint(options);
  }

  /** The task options' fingerprint, in checkpoints. */
  private readonly options: string;

  get processedSamples(): number {
    return this.processed;
  }

  protected override closing(): TaskEvent[] {
    return [...this.flushSpan(), ...this.segmenter.finish(this.received)];
  }

  /** The `probability` events due for the window just accepted, whose probability is `p`. */
  private probability(p: number): TaskEvent[] {
    const at = this.windows * WINDOW_MS;
    const value = Math.round(p * 1e6) / 1e6;
    if (!this.probabilities!.intervalMs) return [{ type: 'probability', at_ms: at, p: value }];
    if (!this.span.length) this.spanStart = at;
    this.span.push(value);
    // The span is complete once the next window starts in the next one.
    const interval = this.probabilities!.intervalMs;
    return Math.floor((at + WINDOW_MS) / interval) > Math.floor(at / interval) ? this.flushSpan() : [];
  }

  private flushSpan(): TaskEvent[] {
    if (!this.span.length) return [];
    const e: TaskEvent = { type: 'probability', at_ms: this.spanStart, p: this.span };
    this.span = [];
    return [e];
  }

  /**
   * Where a stream resumes from after the audio processed so far (see {@link parseCheckpoint} for the
   * form; a `progress` event's `checkpoint`, docs/websocket-api.md): a session restored from it gives
   * the events this one would have given, bit for bit. `model`: the model's id; `baseMs`: the stream's
   * clock at sample 0. Null while a job is out, after the last (padded) window, with `probability`
   * events (their span is not kept), or past {@link MAX_CHECKPOINT_CHARS} (a segment of about 35 s
   * or more under way).
   */
  checkpoint(model: string, baseMs: number): string | null {
    if (this.inFlight || this.probabilities || this.processed % SILERO.WINDOW) return null;
    const text = encodeCheckpoint({
      model,
      options: this.options,
      baseMs,
      processed: this.processed,
      state: this.state,
      context: this.context,
      segmenter: this.segmenter.snapshot(),
    });
    return text.length <= MAX_CHECKPOINT_CHARS ? text : null;
  }

  /**
   * Continues from `c` ({@link parseCheckpoint}), a checkpoint of `model` with this session's options,
   * before any audio is pushed. The audio pushed next is the audio from sample `c.processed` of the stream on.
   * @throws VoxError `invalid_field` naming `resume_from` when the checkpoint is another model's or
   *   was taken with other task options. Error when audio was pushed already, or with `probability` events.
   */
  restore(c: VadCheckpoint, model: string): void {
    if (this.received || this.probabilities) throw new Error('restore: only a fresh session without probabilities');
    if (c.model !== model)
      throw invalid('resume_from', `a checkpoint of model '${c.model.slice(0, 64)}', not of '${model}'`);
    if (c.options !== this.options)
      throw invalid('resume_from', 'a checkpoint taken with other task options: give the same ones (threshold, ...)');
    this.state.set(c.state);
    this.context.set(c.context);
    this.segmenter.restore(c.segmenter);
    this.received = this.processed = c.processed;
    this.windows = c.processed / SILERO.WINDOW;
  }

  nextJob(maxSteps: number): Job | null {
    const w = this.takeWindows(maxSteps);
    return w && { kind: 'vad', windows: w.samples, state: this.state, context: this.context };
  }

  accept(result: JobResult): TaskEvent[] {
    const r = result as VadResult;
    this.inFlight = false;
    // Copied, not kept: a result's arrays are views into a receive buffer the next result reuses.
    this.state.set(r.state);
    this.context.set(r.context);
    const events: TaskEvent[] = [];
    for (const p of r.probs) {
      this.processed = Math.min(this.processed + SILERO.WINDOW, this.received);
      if (this.probabilities) events.push(...this.probability(p));
      this.windows++;
      events.push(...this.segmenter.push(p, this.processed));
    }
    if (this.finished) events.push(...this.closing());
    return events;
  }
}
