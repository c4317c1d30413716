import type { DenoiseResult, Job, JobResult, SlotInfo } from '../slots/slot-protocol.js';
import { RNNOISE } from '../slots/rnnoise.js';
import { WindowedSession, type TaskEvent } from './task.js';

/**
 * A denoise request or stream (RNNoise): 48 kHz mono audio in [-1, 1], in 480-sample frames
 * through the slots, the state carried from job to job; the denoised audio comes out in order,
 * as many samples as went in (the zeros that pad the last frame at `end()` are cut off).
 * The caller converts its audio to 48 kHz mono before `push` and back after {@link takeOutput}.
 */
export class DenoiseSession extends WindowedSession {
  private readonly state: Float32Array;
  private processed = 0;
  /** Denoised audio not taken yet, [-1, 1]. */
  private output: Float32Array[] = [];
  /** Each frame's speech probability, when kept (a file's JSON answer). */
  readonly probabilities: number[] = [];

  /** @param keepProbabilities keep each frame's speech probability ({@link probabilities}). */
  constructor(
    info: SlotInfo,
    private readonly keepProbabilities = true,
  ) {
    super(RNNOISE.FRAME, RNNOISE.SCALE);
    this.state = Float32Array.from(info.denoiseState ?? new Float32Array(RNNOISE.STATE_FLOATS));
  }

  override get rate(): number {
    return RNNOISE.RATE;
  }

  get processedSamples(): number {
    return this.processed;
  }

  nextJob(maxSteps: number): Job | null {
    const w = this.takeWindows(maxSteps);
    return w && { kind: 'denoise', audio: w.samples, state: this.state };
  }

  accept(result: JobResult): TaskEvent[] {
    const r = result as DenoiseResult;
    this.inFlight = false;
    // Copied, not kept: a result's arrays are views into a receive buffer the next result reuses.
    this.state.set(r.state);
    const n = Math.min(r.audio.length, this.received - this.processed);
    const out = new Float32Array(n);
    for (let i = 0; i < n; i++) out[i] = r.audio[i] / RNNOISE.SCALE;
    this.output.push(out);
    this.processed += n;
    if (this.keepProbabilities) for (const p of r.probs) this.probabilities.push(p);
    return [];
  }

  /** The denoised audio accepted since the last call, in order ([-1, 1], 48 kHz). */
  takeOutput(): Float32Array {
    const parts = this.output;
    this.output = [];
    if (parts.length === 1) return parts[0];
    let n = 0;
    for (const p of parts) n += p.length;
    const out = new Float32Array(n);
    n = 0;
    for (const p of parts) {
      out.set(p, n);
      n += p.length;
    }
    return out;
  }
}

/** Float samples in [-1, 1] as 16-bit PCM (rounded, clipped): how a denoised answer is encoded. */
export function toS16(samples: Float32Array): Int16Array {
  const out = new Int16Array(samples.length);
  for (let i = 0; i < samples.length; i++) {
    const v = Math.round(samples[i] * 32_768);
    out[i] = Math.min(32_767, Math.max(-32_768, v));
  }
  return out;
}

/** A mono 16-bit PCM WAV file of `samples` ([-1, 1]) at `rate` Hz. */
export function wavBytes(samples: Float32Array, rate: number): Buffer {
  const pcm = toS16(samples);
  const out = Buffer.alloc(44 + pcm.byteLength);
  out.write('RIFF', 0, 'latin1');
  out.writeUInt32LE(36 + pcm.byteLength, 4);
  out.write('WAVEfmt ', 8, 'latin1');
  out.writeUInt32LE(16, 16);
  out.writeUInt16LE(1, 20); // PCM
  out.writeUInt16LE(1, 22); // mono
  out.writeUInt32LE(rate, 24);
  out.writeUInt32LE(rate * 2, 28);
  out.writeUInt16LE(2, 32);
  out.writeUInt16LE(16, 34);
  out.write('data', 36, 'latin1');
  out.writeUInt32LE(pcm.byteLength, 40);
  Buffer.from(pcm.buffer, pcm.byteOffset, pcm.byteLength).copy(out, 44);
  return out;
}
