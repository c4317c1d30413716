import { createRequire } from 'node:module';
import { parentPort, workerData } from 'node:worker_threads';
import { FLACDecoder } from '@wasm-audio-decoders/flac';
import { OggVorbisDecoder } from '@wasm-audio-decoders/ogg-vorbis';
import { MPEGDecoder } from 'mpg123-decoder';
import { OggOpusDecoder } from 'ogg-opus-decoder';
import { OpusDecoder } from 'opus-decoder';
import {
  checkFormat,
  decodeWav,
  MAX_AUDIO_SECONDS,
  MODEL_SAMPLE_RATE,
  resample,
  sanitize,
  WholeResampler,
} from './audio.js';
import {
  ACCEPTED_FORMATS,
  ascii,
  type AudioFormat,
  type DecodeReply,
  FORMAT_NAMES,
  parseJsonObject,
} from './decode.js';
import { toVoxError, voxError } from '../errors.js';
import { readTensor } from '../tasks/tensor.js';

/**
 * The decode worker (a worker thread started by {@link decodeAudio} in decode.ts): compressed
 * and WAV files are decoded and resampled here, off the main thread.
 */

const require = createRequire(import.meta.url);
/** node-ebml's streaming EBML reader (no types shipped); used synchronously, see {@link webmOpusPackets}. */
const { Decoder: EbmlDecoder } = require('ebml') as { Decoder: new () => EbmlReader };
interface EbmlTag {
  name: string;
  value?: unknown;
  data?: Uint8Array;
  payload?: Uint8Array;
  track?: number;
}
interface EbmlReader {
  on(event: 'data', cb: (chunk: ['start' | 'end' | 'tag', EbmlTag]) => void): void;
  on(event: 'error', cb: (e: Error) => void): void;
  write(chunk: Uint8Array): boolean;
  /** Bytes consumed so far (internal to ebml 3.0.0, pinned): less than the input means an element was cut off. */
  mTotal: number;
}

/** One decoded chunk as the eshaz decoders return it. */
interface Decoded {
  channelData: Float32Array[];
  samplesDecoded: number;
  sampleRate: number;
  errors: { message: string; frameNumber?: number }[];
}

/** Input bytes handed to a decoder at a time: the duration limit is checked between chunks. */
const CHUNK_BYTES = 64 * 1024;

/**
 * Takes decoded chunks, averages their channels to mono (clipped to [-1, 1]) and resamples them to
 * 16 kHz as they come (only the 16 kHz signal is kept), enforcing the decoded-duration limit.
 */
class MonoCollector {
  /** Frames decoded so far, at {@link rate}. */
  frames = 0;
  rate = 0;
  private resampler: WholeResampler | null = null;
  constructor(
    private readonly name: string,
    private readonly maxSeconds: number,
    private readonly toHz: number = MODEL_SAMPLE_RATE,
  ) {}

  async add(d: Decoded): Promise<void> {
    if (d.errors.length) {
      const e = d.errors[0];
      throw voxError('invalid_audio', {
        problem: `not a readable ${this.name} file (${e.message}${e.frameNumber !== undefined ? ` at frame ${e.frameNumber}` : ''})`,
      });
    }
    if (d.samplesDecoded === 0) return;
    // (ogg-vorbis gives a negative count for some damaged input, such as many Ogg files joined end to end.)
    if (!Number.isSafeInteger(d.samplesDecoded) || d.samplesDecoded < 0)
      throw voxError('invalid_audio', {
        problem: `not a readable ${this.name} file (its decoder reported ${d.samplesDecoded} samples for a chunk)`,
      });
    if (this.rate === 0) {
      checkFormat(d.sampleRate, d.channelData.length);
      this.rate = d.sampleRate;
      this.resampler = await WholeResampler.create(this.rate, this.toHz);
    } else if (d.sampleRate !== this.rate)
      throw voxError('invalid_audio', {
        problem: `the ${this.name} file changes sample rate (${this.rate} -> ${d.sampleRate} Hz)`,
      });
    const n = d.samplesDecoded;
    const mono = new Float32Array(n);
    for (const ch of d.channelData) for (let i = 0; i < n; i++) mono[i] += ch[i] / d.channelData.length;
    sanitize(mono);
    this.resampler!.push(mono);
    this.frames += n;
    if (this.frames > this.maxSeconds * this.rate)
      throw voxError('audio_too_long', {
        problem: `longer than the limit of ${this.maxSeconds} s per file (stopped decoding at ${this.maxSeconds} s)`,
      });
  }

  /** The whole file at 16 kHz. */
  samples(): Float32Array {
    if (!this.resampler)
      throw voxError('invalid_audio', { problem: `not a readable ${this.name} file (no audio decoded)` });
    return this.resampler.finish();
  }

  /** Frees the resampler (after an error too). */
  close(): void {
    this.resampler?.close();
  }
}

/**
 * The last page of an Ogg stream (RFC 3533 section 6): whether it is whole and flagged
 * end-of-stream (header type bit 0x04; page length = 27 + segment count + the segment table's
 * sum), and its granule position (for Vorbis the total samples per channel, for Opus the total
 * at 48 kHz plus the pre-skip). A file cut short has no such page.
 */
function oggEnd(b: Uint8Array): { complete: boolean; granule: number } {
  const from = Math.max(0, b.length - 65_307); // the largest page: 27 + 255 + 255 * 255 bytes
  for (let p = b.length - 27; p >= from; p--) {
    if (b[p] !== 0x4f || !ascii(b, p, 'OggS')) continue;
    const segs = b[p + 26];
    let size = 27 + segs;
    for (let i = 0; i < segs; i++) size += b[p + 27 + i] ?? 0;
    const granule = Number(Buffer.from(b.buffer, b.byteOffset + p + 6, 8).readBigInt64LE(0));
    return { complete: (b[p + 5] & 0x04) !== 0 && p + size === b.length, granule };
  }
  return { complete: false, granule: -1 };
}

/** Opus's pre-skip, 48 kHz samples (OpusHead in the first Ogg page, RFC 7845 section 5.1). */
function oggOpusPreSkip(b: Uint8Array): number {
  const head = 27 + b[26];
  return b[head + 10] | (b[head + 11] << 8);
}

/** FLAC's STREAMINFO total samples per channel (36 bits; 0 = unknown), RFC 9639 section 8.2. */
function flacTotalSamples(b: Uint8Array): number {
  if (b.length < 26) return 0;
  return (b[21] & 0x0f) * 2 ** 32 + Buffer.from(b.buffer, b.byteOffset + 22, 4).readUInt32BE(0);
}

/** The Opus packets of a WebM file's first Opus track, with its OpusHead (`CodecPrivate`). */
function webmOpusPackets(b: Uint8Array): { head: Uint8Array; packets: Uint8Array[] } {
  const reader = new EbmlDecoder();
  const tracks: { number?: number; codec?: string; private?: Uint8Array }[] = [];
  const blocks: EbmlTag[] = [];
  let error: Error | null = null;
  reader.on('error', (e) => (error = e));
  reader.on('data', ([kind, tag]) => {
    if (kind === 'start' && tag.name === 'TrackEntry') tracks.push({});
    else if (kind === 'tag' && tag.name === 'TrackNumber') tracks.at(-1)!.number = Number(tag.value);
    else if (kind === 'tag' && tag.name === 'CodecID') tracks.at(-1)!.codec = String(tag.value);
    else if (kind === 'tag' && tag.name === 'CodecPrivate') tracks.at(-1)!.private = tag.data;
    else if (kind === 'tag' && (tag.name === 'SimpleBlock' || tag.name === 'Block')) blocks.push(tag);
  });
  // node-ebml emits synchronously as it reads; a cut-off element is left unconsumed.
  try {
    reader.write(Buffer.from(b.buffer, b.byteOffset, b.length));
  } catch (e) {
    error = e as Error;
  }
  if (error) throw voxError('invalid_audio', { problem: `not a readable WebM file (${(error as Error).message})` });
  if (reader.mTotal < b.length)
    throw voxError('invalid_audio', {
      problem: `truncated WebM file (an element is cut off at byte ${reader.mTotal} of ${b.length})`,
    });
  const opus = tracks.find((t) => t.codec === 'A_OPUS');
  if (!opus) {
    const codecs = tracks.map((t) => t.codec).filter(Boolean);
    throw voxError('unsupported_audio', {
      problem: `WebM ${codecs.length ? `with ${codecs.join(', ')}` : 'with no audio track'} is not supported (only Opus audio); accepted: ${ACCEPTED_FORMATS}`,
    });
  }
  if (!opus.private || !ascii(opus.private, 0, 'OpusHead'))
    throw voxError('invalid_audio', { problem: 'not a readable WebM file (the Opus track has no OpusHead)' });
  const packets = blocks.filter((x) => x.track === opus.number && x.payload).map((x) => x.payload!);
  return { head: opus.private, packets };
}

/**
 * Decodes a whole audio file to mono float32 at 16 kHz: WAV with `wavefile`, MP3 with
 * `mpg123-decoder`, Ogg Opus with `ogg-opus-decoder`, Ogg Vorbis and FLAC with
 * `@wasm-audio-decoders/*`, WebM/Opus with `ebml` (demuxing) and `opus-decoder` (all WASM builds
 * of the reference C decoders); channels are averaged, then resampled with libsamplerate.
 * CPU-bound: call it in a worker thread ({@link decodeAudio} does).
 * @param maxSeconds the decoded-duration limit, s, checked every 64 KiB of input as it decodes.
 * @throws VoxError `invalid_request_error` for a corrupt, truncated (Ogg with no end-of-stream
 *   page, FLAC shorter than its STREAMINFO, WebM with a cut-off element) or too long file, or a
 *   sample rate or channel count out of range.
 */
export async function decodeToModelRate(
  bytes: Uint8Array,
  format: AudioFormat,
  maxSeconds = MAX_AUDIO_SECONDS,
): Promise<Float32Array> {
  return (await decodeToRate(bytes, format, MODEL_SAMPLE_RATE, maxSeconds)).samples;
}

/**
 * {@link decodeToModelRate} to any rate (a denoise model's 48 kHz).
 * @returns the samples at `toHz`, and the file's own rate, Hz.
 */
export async function decodeToRate(
  bytes: Uint8Array,
  format: AudioFormat,
  toHz: number,
  maxSeconds = MAX_AUDIO_SECONDS,
): Promise<{ samples: Float32Array; sourceRate: number }> {
  if (format === 'wav') {
    const audio = decodeWav(bytes);
    return { samples: await resample(audio.samples, audio.sampleRate, toHz), sourceRate: audio.sampleRate };
  }
  const out = new MonoCollector(FORMAT_NAMES[format], maxSeconds, toHz);
  try {
    await decodeCompressed(bytes, format, out);
    return { samples: out.samples(), sourceRate: out.rate };
  } finally {
    out.close();
  }
}

/** Decodes a compressed file into `out`, with the format's completeness checks. */
async function decodeCompressed(
  bytes: Uint8Array,
  format: Exclude<AudioFormat, 'wav'>,
  out: MonoCollector,
): Promise<void> {
  const name = FORMAT_NAMES[format];
  if (format === 'webm-opus') {
    const { head, packets } = webmOpusPackets(bytes);
    // OpusHead (RFC 7845 section 5.1): channel count at byte 9, pre-skip (48 kHz samples) at 10-11.
    const decoder = new OpusDecoder({ channels: head[9], preSkip: head[10] | (head[11] << 8) });
    await decoder.ready;
    try {
      for (let i = 0; i < packets.length; i += 256) await out.add(decoder.decodeFrames(packets.slice(i, i + 256)));
    } finally {
      decoder.free();
    }
    return;
  }
  const ogg = format === 'ogg-opus' || format === 'ogg-vorbis' ? oggEnd(bytes) : null;
  if (ogg && !ogg.complete)
    throw voxError('invalid_audio', {
      problem: `truncated ${name} file (it does not end with a whole end-of-stream page)`,
    });
  const decoder =
    format === 'mp3'
      ? new MPEGDecoder()
      : format === 'ogg-opus'
        ? new OggOpusDecoder()
        : format === 'ogg-vorbis'
          ? new OggVorbisDecoder()
          : new FLACDecoder();
  await decoder.ready;
  try {
    for (let at = 0; at < bytes.length; at += CHUNK_BYTES)
      await out.add(await decoder.decode(bytes.subarray(at, at + CHUNK_BYTES)));
    if ('flush' in decoder) await out.add(await decoder.flush());
  } finally {
    decoder.free();
  }
  if (ogg) {
    // The decoders resynchronise past damaged data without an error: the sample count then
    // differs from what the last page's granule position declares (by more than 20 ms).
    const expected = format === 'ogg-opus' ? ogg.granule - oggOpusPreSkip(bytes) : ogg.granule;
    if (Math.abs(out.frames - expected) > out.rate / 50)
      throw voxError('invalid_audio', {
        problem: `corrupt ${name} file (${out.frames} samples decoded where its last page declares ${expected})`,
      });
  }
  if (format === 'flac') {
    const total = flacTotalSamples(bytes);
    if (total > out.frames)
      throw voxError('invalid_audio', {
        problem: `truncated FLAC file (${out.frames} of the ${total} samples its STREAMINFO declares)`,
      });
  }
}

/**
 * A JSON body, parsed here (off the main thread), with the `data` of each tensor of its `inputs`
 * read into a typed array of its dtype ({@link readTensor}; a string tensor stays a list).
 * @returns the value and the buffers to transfer.
 * @throws VoxError `invalid_json`, or `invalid_tensor` naming the field.
 */
function parseJson(bytes: Uint8Array): { value: unknown; buffers: ArrayBuffer[] } {
  const value = parseJsonObject(Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength));
  const buffers: ArrayBuffer[] = [];
  const inputs = value.inputs;
  if (inputs && typeof inputs === 'object' && !Array.isArray(inputs))
    for (const [name, t] of Object.entries(inputs)) {
      const read = readTensor(name, t);
      (inputs as Record<string, unknown>)[name] = read;
      if (ArrayBuffer.isView(read.data)) buffers.push(read.data.buffer as ArrayBuffer);
    }
  return { value, buffers };
}

if (parentPort && (workerData as { role?: string } | null)?.role === 'decode') {
  const port = parentPort;
  port.on(
    'message',
    (m: { id: number; bytes: Uint8Array; format: AudioFormat | 'json'; maxSeconds: number; toHz: number }) => {
      if (m.format === 'json') {
        try {
          const { value, buffers } = parseJson(m.bytes);
          port.postMessage({ id: m.id, value } satisfies DecodeReply, buffers);
        } catch (e) {
          port.postMessage({ id: m.id, error: toVoxError(e).toWire() } satisfies DecodeReply);
        }
        return;
      }
      decodeToRate(m.bytes, m.format, m.toHz, m.maxSeconds).then(
        ({ samples, sourceRate }) =>
          port.postMessage({ id: m.id, samples, sourceRate } satisfies DecodeReply, [samples.buffer as ArrayBuffer]),
        (e) => {
          port.postMessage({ id: m.id, error: toVoxError(e).toWire() } satisfies DecodeReply);
        },
      );
    },
  );
}
