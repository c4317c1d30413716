import { createRequire } from 'node:module';
import { invalid, voxError } from '../errors.js';

const require = createRequire(import.meta.url);
// Both packages ship CommonJS/UMD bundles; require keeps their types usable under NodeNext.
const { WaveFile } = require('wavefile') as typeof import('wavefile');
const LibSampleRate = require('@alexanderolsen/libsamplerate-js') as typeof import('@alexanderolsen/libsamplerate-js');

/** The sample rate every bundled model runs at, Hz. */
export const MODEL_SAMPLE_RATE = 16_000;
/** Accepted input sample rates, Hz (inclusive). */
export const MIN_SAMPLE_RATE = 8_000;
export const MAX_SAMPLE_RATE = 192_000;
/** Accepted channel counts. */
export const MAX_CHANNELS = 32;
/** Longest audio file accepted (decoded duration), s. */
export const MAX_AUDIO_SECONDS = 1800;

/**
 * Float samples from a client: NaN becomes 0 and values outside [-1, 1] are clipped, so one bad
 * sample cannot poison a model's recurrent state or a score. In place.
 */
export function sanitize(x: Float32Array): void {
  for (let i = 0; i < x.length; i++) {
    const v = x[i];
    if (!(v >= -1 && v <= 1)) x[i] = v > 1 ? 1 : v < -1 ? -1 : 0;
  }
}

type SRC = Awaited<ReturnType<typeof LibSampleRate.create>>;

/** Mono float32 audio in [-1, 1] at `sampleRate` Hz. */
export interface MonoAudio {
  samples: Float32Array;
  sampleRate: number;
}

const WAV_FORMATS: Record<number, string> = { 1: 'PCM', 3: 'IEEE float', 6: 'A-law', 7: 'mu-law', 65534: 'extensible' };

/**
 * Decodes a WAV file (PCM 8/16/24/32-bit, float32/64, or 8-bit mu-law or A-law; any rate, any
 * channel count) with the `wavefile` library and downmixes it to mono by averaging channels.
 * @param bytes the whole file.
 * @returns mono float32 samples in [-1, 1] at the file's own sample rate.
 * @throws VoxError `invalid_request_error` if the bytes are not a WAV file, are truncated (a
 *   `fmt ` or `data` chunk declares more bytes than present), use a compressed encoding, have no
 *   samples, or declare a sample rate or channel count out of range.
 */
export function decodeWav(bytes: Uint8Array): MonoAudio {
  if (bytes.length === 0) throw voxError('invalid_audio', { problem: 'empty body, expected a WAV file' });
  const chunks = audioChunks(bytes);
  const wav = new WaveFile();
  try {
    wav.fromBuffer(chunks);
  } catch (e) {
    throw voxError('invalid_audio', { problem: `not a readable WAV file (${(e as Error).message})` });
  }
  let fmt = wav.fmt as { audioFormat: number; numChannels: number; sampleRate: number; bitsPerSample: number };
  if (!(fmt.audioFormat in WAV_FORMATS)) {
    throw voxError('unsupported_audio', {
      problem: `unsupported WAV encoding (format code ${fmt.audioFormat}); send PCM, float, mu-law or A-law`,
    });
  }
  // G.711 (telephone audio): 8-bit mu-law or A-law, expanded to 16-bit PCM by wavefile's codecs (alawmulaw).
  if (fmt.audioFormat === 6 || fmt.audioFormat === 7) {
    if (fmt.bitsPerSample !== 8)
      throw voxError('unsupported_audio', {
        problem: `unsupported bit depth ${fmt.bitsPerSample} for ${WAV_FORMATS[fmt.audioFormat]} samples; expected 8`,
      });
    checkFormat(fmt.sampleRate, fmt.numChannels);
    // Judged before the expansion doubles the samples' size.
    const seconds = (wav.data as { samples: Uint8Array }).samples.length / fmt.numChannels / fmt.sampleRate;
    if (seconds > MAX_AUDIO_SECONDS)
      throw voxError('audio_too_long', {
        problem: `${Math.round(seconds)} s is longer than the limit of ${MAX_AUDIO_SECONDS} s per file`,
      });
    try {
      if (fmt.audioFormat === 7) wav.fromMuLaw();
      else wav.fromALaw();
    } catch (e) {
      throw voxError('invalid_audio', {
        problem: `not a readable ${WAV_FORMATS[fmt.audioFormat]} WAV file (${(e as Error).message})`,
      });
    }
    fmt = wav.fmt as typeof fmt;
  }
  const float = fmt.audioFormat === 3 || (fmt.audioFormat === 65534 && isFloatExtensible(wav));
  if (float ? ![32, 64].includes(fmt.bitsPerSample) : ![8, 16, 24, 32].includes(fmt.bitsPerSample)) {
    throw voxError('unsupported_audio', {
      problem: `unsupported bit depth ${fmt.bitsPerSample} for ${float ? 'float' : 'PCM'} samples; expected ${float ? '32 or 64' : '8, 16, 24 or 32'}`,
    });
  }
  const { numChannels: channels, sampleRate } = fmt;
  checkFormat(sampleRate, channels);
  const dataBytes = (wav.data as { samples: Uint8Array }).samples.length;
  const seconds = dataBytes / ((fmt.bitsPerSample / 8) * channels) / sampleRate;
  if (seconds > MAX_AUDIO_SECONDS)
    throw voxError('audio_too_long', {
      problem: `${Math.round(seconds)} s is longer than the limit of ${MAX_AUDIO_SECONDS} s per file`,
    });
  // wavefile unpacks the samples as stored (integers for PCM); scale them to [-1, 1].
  const interleaved = wav.getSamples(true, Float32Array) as unknown as Float32Array;
  if (float) sanitize(interleaved);
  else {
    const bits = fmt.bitsPerSample;
    const offset = bits === 8 ? 128 : 0; // 8-bit WAV is unsigned
    const scale = 1 / 2 ** (bits - 1);
    for (let i = 0; i < interleaved.length; i++) interleaved[i] = (interleaved[i] - offset) * scale;
  }
  const frames = Math.floor(interleaved.length / channels);
  if (frames === 0) throw voxError('invalid_audio', { problem: 'the WAV file holds no samples' });
  return { samples: downmix(interleaved, channels, frames), sampleRate };
}

/** The chunks {@link decodeWav} reads: the format, the samples, and RF64's sizes. */
const AUDIO_CHUNKS = new Set(['fmt ', 'data', 'ds64']);

/**
 * `bytes` (a RIFF, RIFX or RF64 file) with only the {@link AUDIO_CHUNKS}, in their order; other
 * input is returned as is. wavefile 11 parses every chunk it knows, looping over counts and sizes
 * it reads from the file before checking them against its length: a 100-byte `cue ` or `smpl`
 * chunk claiming 4 billion entries, or an `iXML`, `bext` or `_PMX` chunk claiming 4 GiB, blocks
 * the event loop until the process runs out of memory. Those chunks carry nothing decodeWav needs.
 * @throws VoxError `invalid_request_error` "truncated WAV file" when a `fmt ` or `data` chunk
 *   declares more bytes than the file holds (a declared 0xFFFFFFFF means "unknown": read to the end).
 */
function audioChunks(bytes: Uint8Array): Uint8Array {
  const buf = Buffer.from(bytes.buffer, bytes.byteOffset, bytes.length);
  const container = buf.toString('latin1', 0, 4);
  if (buf.length < 12 || !['RIFF', 'RIFX', 'RF64'].includes(container)) return bytes;
  const parts: Buffer[] = [buf.subarray(0, 12)];
  let dropped = false;
  for (let at = 12; at + 8 <= buf.length; ) {
    const id = buf.toString('latin1', at, at + 4);
    const size = container === 'RIFX' ? buf.readUInt32BE(at + 4) : buf.readUInt32LE(at + 4);
    // 0xFFFFFFFF is "size unknown" (a WAV streamed as it was written, or RF64's placeholder): read to the end.
    if ((id === 'fmt ' || id === 'data') && size !== 0xffffffff && at + 8 + size > buf.length) {
      throw voxError('invalid_audio', {
        problem: `truncated WAV file (its '${id.trim()}' chunk declares ${size} bytes, ${buf.length - at - 8} present)`,
      });
    }
    const end = Math.min(buf.length, at + 8 + size + (size % 2)); // chunks are padded to even sizes
    if (AUDIO_CHUNKS.has(id)) parts.push(buf.subarray(at, end));
    else dropped = true;
    at = end;
  }
  return dropped ? Buffer.concat(parts) : bytes;
}

/**
 * Checks a declared sample rate (Hz) and channel count.
 * @param fields the names the caller's input gives the two (a Wyoming event's are `audio-chunk.rate`, ...).
 * @throws VoxError `invalid_request_error` naming the field.
 */
export function checkFormat(
  sampleRate: number,
  channels: number,
  fields: { rate: string; channels: string } = { rate: 'sample_rate', channels: 'channels' },
): void {
  if (!Number.isInteger(sampleRate) || sampleRate < MIN_SAMPLE_RATE || sampleRate > MAX_SAMPLE_RATE) {
    throw invalid(fields.rate, `${sampleRate} Hz is out of range ${MIN_SAMPLE_RATE}-${MAX_SAMPLE_RATE}`);
  }
  if (!Number.isInteger(channels) || channels < 1 || channels > MAX_CHANNELS) {
    throw invalid(fields.channels, `${channels} is out of range 1-${MAX_CHANNELS}`);
  }
}

/** WAVE_FORMAT_EXTENSIBLE with the IEEE float sub-format GUID (starts 03 00). */
function isFloatExtensible(wav: { fmt: object }): boolean {
  const sub = (wav.fmt as { subformat?: number[] }).subformat;
  return Array.isArray(sub) && sub[0] === 3;
}

function downmix(interleaved: Float32Array, channels: number, frames: number): Float32Array {
  if (channels === 1) return interleaved.length === frames ? interleaved : interleaved.slice(0, frames);
  const out = new Float32Array(frames);
  for (let f = 0; f < frames; f++) {
    let sum = 0;
    for (let c = 0; c < channels; c++) sum += interleaved[f * channels + c];
    out[f] = sum / channels;
  }
  return out;
}

/**
 * Converters of closed {@link Resampler}s, for the next ones to take (at most {@link SPARE_CONVERTERS}
 * per thread): a new converter is a WASM module instance of its own (with a 25 MB memory),
 * 6-9 ms of main-thread CPU on the machines measured (a whole 16 kHz stream's open and close is
 * about 1 ms), which every stream of telephone (8 kHz) or 48 kHz audio paid when it opened. Each
 * kept converter holds 2-10 MB resident.
 */
const spare: SRC[] = [];
/** Converters kept for reuse, at most, per thread. */
export const SPARE_CONVERTERS = 4;

/**
 * Re-initialises `src` for `fromHz` -> `toHz` (fresh filter state: libsamplerate's src_delete +
 * src_new, by the library's rate setters). The setters leave the library's `ratio`, which sizes
 * its calls, at the rates the converter was made for: set here too (a converter made for 48 kHz
 * and set to 8 kHz otherwise cut a large call's output short).
 */
function retune(src: SRC, fromHz: number, toHz: number): void {
  if (src.outputSampleRate !== toHz) src.outputSampleRate = toHz;
  src.inputSampleRate = fromHz;
  src.ratio = toHz / fromHz;
}

/**
 * Output samples one call into a converter may give, at most: its output buffer holds 1,008,000,
 * and past that the library splits the call itself, in chunks of a tenth of a second, which are
 * not whole samples at rates not divisible by 10 (a RangeError at 11025 Hz). Larger inputs are
 * split here instead.
 */
const MAX_CALL_OUT = 500_000;

/**
 * Streaming resampler (libsamplerate's SINC_FASTEST converter, compiled to WASM by
 * `@alexanderolsen/libsamplerate-js`). Keeps filter state across `push` calls; `flush` ends the
 * signal so that, over the whole stream, exactly round(input samples x toHz / fromHz) samples
 * come out, the same count as {@link resample} gives for the whole signal at once. A
 * pass-through when the rates are equal. Call `close()` once done: its converter goes to the next
 * resampler created (re-initialised: fresh filter state), or is freed.
 */
export class Resampler {
  /** Samples pushed in, and samples given out, so far. */
  private inCount = 0;
  private outCount = 0;
  /**
   * libsamplerate converters created in this process so far. Each is its own WASM module
   * instance (6-9 ms of main-thread CPU), so a stream that changes format reuses its converter
   * ({@link Resampler.reset}), and a new resampler takes a closed one's; tests count creations here.
   */
  static created = 0;
  private closed = false;

  private constructor(
    private src: SRC | null,
    private fromHz: number,
    private readonly toHz: number,
  ) {}

  /** @param fromHz input rate, Hz. @param toHz output rate, Hz. */
  static async create(fromHz: number, toHz: number = MODEL_SAMPLE_RATE): Promise<Resampler> {
    if (fromHz === toHz) return new Resampler(null, fromHz, toHz);
    return new Resampler(await Resampler.converter(fromHz, toHz), fromHz, toHz);
  }

  /** A spare converter re-initialised for `fromHz` -> `toHz` ({@link retune}), or a new one. */
  private static converter(fromHz: number, toHz: number): Promise<SRC> {
    const src = spare.pop();
    if (src) {
      retune(src, fromHz, toHz);
      return Promise.resolve(src);
    }
    Resampler.created++;
    return LibSampleRate.create(1, fromHz, toHz, { converterType: LibSampleRate.ConverterType.SRC_SINC_FASTEST });
  }

  /**
   * Starts a new stream at `fromHz` (call {@link Resampler.flush} first for the old one's held-back
   * samples): the converter is re-initialised in place (libsamplerate's src_delete + src_new in the
   * same WASM instance, microseconds) rather than a new WASM instance created; one is created only
   * when this resampler had none (it began at `toHz`), and kept from then on.
   * @throws Error once closed.
   */
  async reset(fromHz: number): Promise<void> {
    this.assertOpen();
    this.inCount = 0;
    this.outCount = 0;
    if (fromHz !== this.toHz) {
      if (!this.src) this.src = await Resampler.converter(fromHz, this.toHz);
      else retune(this.src, fromHz, this.toHz);
    }
    this.fromHz = fromHz;
  }

  /** Resamples the next chunk of a stream (mono float32). @throws Error once closed. */
  push(samples: Float32Array): Float32Array {
    this.assertOpen();
    this.inCount += samples.length;
    if (!this.src || this.fromHz === this.toHz || samples.length === 0) return samples;
    const step = Math.floor(MAX_CALL_OUT / Math.max(1, this.toHz / this.fromHz));
    if (samples.length <= step) return this.take(this.src.full(samples));
    const parts: Float32Array[] = [];
    let n = 0;
    for (let at = 0; at < samples.length; at += step) {
      parts.push(this.src.full(samples.subarray(at, at + step)));
      n += parts[parts.length - 1].length;
    }
    const out = new Float32Array(n);
    n = 0;
    for (const p of parts) {
      out.set(p, n);
      n += p.length;
    }
    return this.take(out);
  }

  /**
   * The end of the stream: the samples the converter still holds back (its filter delay), cut so
   * that the stream's total output is round(input x toHz / fromHz) samples. Call once, last.
   * @throws Error once closed.
   */
  flush(): Float32Array {
    this.assertOpen();
    if (!this.src || this.fromHz === this.toHz) return new Float32Array(0);
    // 20 ms of silence pushes out the filter delay (a few ms at SINC_FASTEST).
    return this.take(this.src.full(new Float32Array(Math.ceil(this.fromHz / 50))));
  }

  /** Passes `out` on, cut so that the total given out never exceeds the signal's length at `toHz`. */
  private take(out: Float32Array): Float32Array {
    const room = Math.max(0, Math.round((this.inCount * this.toHz) / this.fromHz) - this.outCount);
    const kept = out.length <= room ? out : out.subarray(0, room);
    this.outCount += kept.length;
    return kept;
  }

  /** Done with: the converter goes to the spares (or is freed when they are full). Idempotent. */
  close(): void {
    const src = this.src;
    this.src = null;
    this.closed = true;
    if (!src) return;
    if (spare.length < SPARE_CONVERTERS) spare.push(src);
    else src.destroy();
  }

  /** A closed resampler's converter may be another's by now: using it would mix two streams. */
  private assertOpen(): void {
    if (this.closed) throw new Error('resampler is closed');
  }
}

/**
 * Resamples a whole mono signal given chunk by chunk (a decoder's output) from `fromHz` to
 * `toHz` with a {@link Resampler}, keeping only the converted samples: `finish()` flushes the
 * converter ({@link Resampler.flush}) and returns exactly round(n x toHz / fromHz) samples for n in.
 */
export class WholeResampler {
  private readonly parts: Float32Array[] = [];
  private received = 0;
  private constructor(
    private readonly r: Resampler,
    private readonly fromHz: number,
    private readonly toHz: number,
  ) {}

  /** @param fromHz input rate, Hz. @param toHz output rate, Hz. */
  static async create(fromHz: number, toHz: number = MODEL_SAMPLE_RATE): Promise<WholeResampler> {
    return new WholeResampler(await Resampler.create(fromHz, toHz), fromHz, toHz);
  }

  /** Converts the next chunk (mono float32 at `fromHz`). */
  push(chunk: Float32Array): void {
    this.received += chunk.length;
    this.parts.push(this.r.push(chunk));
  }

  /** The whole signal at `toHz` (call once, then `close()`). */
  finish(): Float32Array {
    this.parts.push(this.r.flush());
    const out = new Float32Array(Math.round((this.received * this.toHz) / this.fromHz));
    let o = 0;
    for (const p of this.parts) {
      if (o >= out.length) break;
      out.set(p.subarray(0, out.length - o), o);
      o += p.length;
    }
    this.parts.length = 0;
    return out;
  }

  /** Frees the converter's WASM memory. */
  close(): void {
    this.r.close();
  }
}

/**
 * Resamples a whole mono signal from `fromHz` to `toHz` (libsamplerate, streaming API), in
 * chunks of 10 s of input, yielding to the event loop between chunks so that a long file does
 * not stall other clients. Gives round(samples x toHz / fromHz) samples.
 */
export async function resample(
  samples: Float32Array,
  fromHz: number,
  toHz: number = MODEL_SAMPLE_RATE,
): Promise<Float32Array> {
  if (fromHz === toHz) return samples;
  const r = await WholeResampler.create(fromHz, toHz);
  try {
    const chunk = fromHz * 10;
    for (let at = 0; at < samples.length; at += chunk) {
      r.push(samples.subarray(at, at + chunk));
      if (at + chunk < samples.length) await new Promise((resolve) => setImmediate(resolve));
    }
    return r.finish();
  } finally {
    r.close();
  }
}

const EMPTY = Buffer.alloc(0);

/**
 * Mono float samples in [-1, 1] as raw little-endian PCM in `encoding` (s16le rounded and clipped;
 * f32le as they are): how a denoise stream's audio goes back to its client.
 */
export function encodePcm(samples: Float32Array, encoding: PcmEncoding): Buffer {
  if (encoding === 'f32le') return Buffer.from(Float32Array.from(samples).buffer);
  const out = Buffer.alloc(samples.length * 2);
  for (let i = 0; i < samples.length; i++)
    out.writeInt16LE(Math.min(32_767, Math.max(-32_768, Math.round(samples[i] * 32_768))), i * 2);
  return out;
}

/** Raw PCM encodings accepted on `/v1/stream`. */
export const PCM_ENCODINGS = ['s16le', 'f32le'] as const;
export type PcmEncoding = (typeof PCM_ENCODINGS)[number];

/**
 * Sample encodings a stream's decoder reads: the wire's {@link PCM_ENCODINGS}, and those a WAV
 * header at the start of a stream may declare (8-bit unsigned, 24/32-bit integer, float64,
 * G.711 mu-law and A-law).
 */
export type SampleEncoding = PcmEncoding | 'u8' | 's24le' | 's32le' | 'f64le' | 'mulaw' | 'alaw';

const SAMPLE_BYTES: Record<SampleEncoding, number> = {
  u8: 1,
  s16le: 2,
  s24le: 3,
  s32le: 4,
  f32le: 4,
  f64le: 8,
  mulaw: 1,
  alaw: 1,
};

/** G.711 mu-law byte -> 16-bit linear (ITU-T G.711, as Sun's g711.c). */
function ulawToLinear(byte: number): number {
  const u = ~byte & 0xff;
  const t = (((u & 0x0f) << 3) + 0x84) << ((u & 0x70) >> 4);
  return u & 0x80 ? 0x84 - t : t - 0x84;
}

/** G.711 A-law byte -> 16-bit linear (ITU-T G.711, as Sun's g711.c). */
function alawToLinear(byte: number): number {
  const a = byte ^ 0x55;
  const seg = (a & 0x70) >> 4;
  let t = (a & 0x0f) << 4;
  if (seg === 0) t += 8;
  else t = (t + 0x108) << (seg - 1);
  return a & 0x80 ? t : -t;
}

const ULAW = Float32Array.from({ length: 256 }, (_, i) => ulawToLinear(i) / 32768);
const ALAW = Float32Array.from({ length: 256 }, (_, i) => alawToLinear(i) / 32768);

/**
 * Turns a stream of raw interleaved PCM byte chunks (frames may split a sample anywhere) into
 * mono float32 samples at {@link MODEL_SAMPLE_RATE}.
 */
export class PcmStreamDecoder {
  private remainder: Buffer = Buffer.alloc(0);
  private frameBytes: number;
  /** The decoded samples of the last chunk, reused from chunk to chunk (grown to the largest). */
  private scratch = new Float32Array(0);

  private constructor(
    private encoding: SampleEncoding,
    private channels: number,
    private readonly resampler: Resampler,
  ) {
    this.frameBytes = SAMPLE_BYTES[encoding] * channels;
  }

  /**
   * @param encoding the samples' encoding. @param sampleRate input rate, Hz. @param channels
   *   interleaved channel count.
   * @param toHz the rate it gives, Hz (a denoise model's 48 kHz; default the 16 kHz of the others).
   * @throws VoxError `invalid_request_error` for a rate or channel count out of range.
   */
  static async create(
    encoding: SampleEncoding,
    sampleRate: number,
    channels: number,
    toHz: number = MODEL_SAMPLE_RATE,
  ): Promise<PcmStreamDecoder> {
    checkFormat(sampleRate, channels);
    return new PcmStreamDecoder(encoding, channels, await Resampler.create(sampleRate, toHz));
  }

  /**
   * Decodes one chunk; bytes of an incomplete frame are kept for the next call.
   * @returns mono samples at 16 kHz, valid until the next call (a view of a buffer reused from
   *   chunk to chunk: a new array per chunk costs the server more in garbage collection than the
   *   decoding): copy what you keep.
   */
  push(chunk: Buffer): Float32Array {
    const buf = this.remainder.length ? Buffer.concat([this.remainder, chunk]) : chunk;
    const frames = Math.floor(buf.length / this.frameBytes);
    const rest = buf.length - frames * this.frameBytes;
    this.remainder = rest ? Buffer.from(buf.subarray(frames * this.frameBytes)) : EMPTY;
    const n = frames * this.channels;
    if (this.scratch.length < n) this.scratch = new Float32Array(Math.max(n, 2 * this.scratch.length));
    const interleaved = this.scratch.subarray(0, n);
    const encoding = this.encoding;
    if (encoding === 's16le' || encoding === 'f32le') {
      // Aligned little-endian views (this machine and every Node target is little-endian); a
      // frame that starts at an odd offset inside ws's receive buffer is copied once.
      const bytes = SAMPLE_BYTES[encoding];
      const aligned = buf.byteOffset % bytes === 0 ? buf : Buffer.from(buf);
      if (encoding === 's16le') {
        // The conversion to float is set's (native); scaling by 2^-15 is exact, as dividing by 32768 is.
        interleaved.set(new Int16Array(aligned.buffer, aligned.byteOffset, n));
        for (let i = 0; i < n; i++) interleaved[i] *= 1 / 32768;
      } else {
        interleaved.set(new Float32Array(aligned.buffer, aligned.byteOffset, n));
        sanitize(interleaved);
      }
    } else {
      decodeSamples(encoding, buf, interleaved);
    }
    return this.resampler.push(downmix(interleaved, this.channels, frames));
  }

  /**
   * The end of the stream: the resampler's held-back samples (see {@link Resampler.flush}); bytes
   * of an incomplete frame are dropped.
   */
  end(): Float32Array {
    this.remainder = Buffer.alloc(0);
    return this.resampler.flush();
  }

  /**
   * Starts a new stream in another format, reusing this decoder's converter ({@link Resampler.reset}):
   * call {@link PcmStreamDecoder.end} first for the old stream's held-back samples.
   * @param encoding the new format's encoding (default: the current one).
   * @throws VoxError `invalid_request_error` for a rate or channel count out of range.
   */
  async reformat(sampleRate: number, channels: number, encoding: SampleEncoding = this.encoding): Promise<void> {
    checkFormat(sampleRate, channels);
    this.remainder = EMPTY;
    this.channels = channels;
    this.encoding = encoding;
    this.frameBytes = SAMPLE_BYTES[encoding] * channels;
    await this.resampler.reset(sampleRate);
  }

  /** Frees the resampler. */
  close(): void {
    this.resampler.close();
  }
}

/** Decodes `out.length` samples of `buf` in one of the encodings a WAV header may declare to [-1, 1]. */
function decodeSamples(encoding: SampleEncoding, buf: Buffer, out: Float32Array): void {
  const n = out.length;
  switch (encoding) {
    case 'u8':
      for (let i = 0; i < n; i++) out[i] = (buf[i] - 128) / 128;
      return;
    case 'mulaw':
      for (let i = 0; i < n; i++) out[i] = ULAW[buf[i]];
      return;
    case 'alaw':
      for (let i = 0; i < n; i++) out[i] = ALAW[buf[i]];
      return;
    case 's24le':
      for (let i = 0; i < n; i++) out[i] = buf.readIntLE(i * 3, 3) / 8388608;
      return;
    case 's32le':
      for (let i = 0; i < n; i++) out[i] = buf.readInt32LE(i * 4) / 2147483648;
      return;
    case 'f64le':
      for (let i = 0; i < n; i++) out[i] = buf.readDoubleLE(i * 8);
      sanitize(out);
      return;
    default:
      throw new Error(`decodeSamples: ${encoding} has its own path`);
  }
}

/** The format a WAV header at the start of a stream declares. */
export interface WavStreamFormat {
  sampleRate: number;
  channels: number;
  encoding: SampleEncoding;
  /** As a person reads it: `44100 Hz, 2 channels, 16-bit PCM`. */
  description: string;
}

/**
 * The first bytes of a compressed audio file a stream takes whole ({@link WavStreamSniffer}): Ogg,
 * FLAC, WebM (EBML) and MP3 with an ID3 tag. Each is 3-4 bytes that a stream of raw PCM all but
 * never starts with (an MP3 without an ID3 tag starts with an 11-bit frame sync, which raw PCM
 * can: it is not taken on a stream).
 */
const FILE_MAGIC = ['OggS', 'fLaC', '\x1a\x45\xdf\xa3', 'ID3'];

/** A WAV header longer than this (its chunks before `data`) is refused on a stream, bytes. */
const MAX_STREAM_HEADER_BYTES = 1024 * 1024;

/**
 * Finds a WAV header at the start of a stream's bytes (RIFF or RF64, WAVE, chunks up to `data`):
 * a client that sends a whole WAV file on a stream (`VoxStream.sendFile`) need not tell the
 * stream its format, the header does. Feed it the stream's frames until it has decided; then it
 * passes the `data` chunk's bytes on (and drops what follows that chunk, such as a `LIST` chunk).
 * A stream that starts as a compressed file ({@link FILE_MAGIC}) is said to be one (`file`): its
 * bytes are passed on as they are, for the stream to decode whole at its end.
 */
export class WavStreamSniffer {
  /** Bytes held while undecided. */
  private head: Buffer = EMPTY;
  private decided = false;
  /** Bytes of the data chunk still to pass on; null: to the end (a plain PCM stream, or a size not known). */
  private left: number | null = null;

  /**
   * Takes one frame of the stream.
   * @returns the bytes to decode (possibly none), and `format` on the call that read a WAV header,
   *   or `file` on the call that found a compressed file's start.
   * @throws VoxError `invalid_request_error` for a WAV header that is broken or declares an
   *   encoding a stream cannot read.
   */
  feed(frame: Buffer): { bytes: Buffer; format?: WavStreamFormat; file?: true } {
    if (this.decided) return { bytes: this.cap(frame) };
    const buf = this.head.length ? Buffer.concat([this.head, frame]) : frame;
    const found = readWavHeader(buf);
    if (found === 'more') {
      this.head = Buffer.from(buf);
      return { bytes: EMPTY };
    }
    this.decided = true;
    this.head = EMPTY;
    if (found === 'pcm') return { bytes: buf };
    if (found === 'file') return { bytes: buf, file: true };
    this.left = found.dataBytes;
    return { bytes: this.cap(buf.subarray(found.headerBytes)), format: found.format };
  }

  /** The end of the stream: what is held undecided (fewer bytes than a header), as samples. */
  flush(): Buffer {
    const rest = this.head;
    this.head = EMPTY;
    this.decided = true;
    return rest;
  }

  private cap(frame: Buffer): Buffer {
    if (this.left === null) return frame;
    const take = Math.min(this.left, frame.length);
    this.left -= take;
    return take === frame.length ? frame : frame.subarray(0, take);
  }
}

const startsWithAscii = (buf: Buffer, at: number, text: string): boolean => {
  for (let i = 0; i < text.length && at + i < buf.length; i++) if (buf[at + i] !== text.charCodeAt(i)) return false;
  return true;
};

/**
 * Reads a WAV header at the start of `buf`: `pcm` when the bytes are not a WAV file's start,
 * `more` when they may be one but its header is not complete yet, `file` for a compressed file's
 * start ({@link FILE_MAGIC}).
 * @throws VoxError `invalid_audio` / `unsupported_audio` for a header a stream cannot use.
 */
function readWavHeader(
  buf: Buffer,
): 'pcm' | 'more' | 'file' | { format: WavStreamFormat; headerBytes: number; dataBytes: number | null } {
  const magic = FILE_MAGIC.find((m) => startsWithAscii(buf, 0, m));
  if (magic) return buf.length < magic.length ? 'more' : 'file';
  if (!(startsWithAscii(buf, 0, 'RIFF') || startsWithAscii(buf, 0, 'RF64'))) return 'pcm';
  if (buf.length < 12) return 'more';
  if (!startsWithAscii(buf, 8, 'WAVE')) return 'pcm';
  const more = (): 'more' => {
    if (buf.length > MAX_STREAM_HEADER_BYTES)
      throw voxError('invalid_audio', {
        problem: `the WAV header at the start of the stream is longer than ${MAX_STREAM_HEADER_BYTES} bytes`,
      });
    return 'more';
  };
  let fmt: WavStreamFormat | null = null;
  for (let at = 12; ; ) {
    if (at + 8 > buf.length) return more();
    const id = buf.toString('latin1', at, at + 4);
    const size = buf.readUInt32LE(at + 4);
    if (id === 'data') {
      if (!fmt)
        throw voxError('invalid_audio', { problem: "the WAV header at the start of the stream has no 'fmt ' chunk" });
      // 0 and 0xFFFFFFFF: a WAV written as it was recorded (size unknown); RF64 keeps the size in ds64.
      const unknown = size === 0 || size === 0xffffffff || startsWithAscii(buf, 0, 'RF64');
      return { format: fmt, headerBytes: at + 8, dataBytes: unknown ? null : size };
    }
    if (id === 'fmt ') {
      if (at + 8 + Math.max(size, 16) > buf.length) return more();
      fmt = wavStreamFormat(buf.subarray(at + 8, at + 8 + size));
    }
    at += 8 + size + (size % 2);
  }
}

/** The stream format a WAV `fmt ` chunk declares. @throws VoxError for one a stream cannot read. */
function wavStreamFormat(fmt: Buffer): WavStreamFormat {
  if (fmt.length < 16) throw voxError('invalid_audio', { problem: "the WAV header's 'fmt ' chunk is too short" });
  let tag = fmt.readUInt16LE(0);
  const channels = fmt.readUInt16LE(2);
  const sampleRate = fmt.readUInt32LE(4);
  const bits = fmt.readUInt16LE(14);
  // WAVE_FORMAT_EXTENSIBLE: the real format is the first two bytes of the sub-format GUID.
  if (tag === 0xfffe && fmt.length >= 26) tag = fmt.readUInt16LE(24);
  const encodings: Record<string, SampleEncoding> = {
    '1/8': 'u8',
    '1/16': 's16le',
    '1/24': 's24le',
    '1/32': 's32le',
    '3/32': 'f32le',
    '3/64': 'f64le',
    '6/8': 'alaw',
    '7/8': 'mulaw',
  };
  const encoding = encodings[`${tag}/${bits}`];
  const kind = { 1: 'PCM', 3: 'float', 6: 'A-law', 7: 'mu-law' }[tag as 1 | 3 | 6 | 7];
  if (!encoding)
    throw voxError('unsupported_audio', {
      problem: kind
        ? `unsupported bit depth ${bits} for ${kind} samples in the stream's WAV header`
        : `unsupported WAV encoding (format code ${tag}) in the stream's WAV header; send PCM, float, mu-law or A-law`,
    });
  checkFormat(sampleRate, channels);
  return {
    sampleRate,
    channels,
    encoding,
    description: `${sampleRate} Hz, ${channels} channel${channels === 1 ? '' : 's'}, ${tag === 6 || tag === 7 ? kind : `${bits}-bit ${kind}`}`,
  };
}
