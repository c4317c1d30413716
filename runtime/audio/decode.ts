import { existsSync } from 'node:fs';
import { availableParallelism } from 'node:os';
import { fileURLToPath } from 'node:url';
import { Worker } from 'node:worker_threads';
import { MAX_AUDIO_SECONDS, MODEL_SAMPLE_RATE } from './audio.js';
import { fromWire, voxError, type WireError } from '../errors.js';

/** Audio containers and codecs accepted by `/v1/tasks/run` and `/v1/tasks/batch`. */
export const AUDIO_FORMATS = ['wav', 'mp3', 'ogg-vorbis', 'ogg-opus', 'flac', 'webm-opus'] as const;
export type AudioFormat = (typeof AUDIO_FORMATS)[number];

export const FORMAT_NAMES: Record<AudioFormat, string> = {
  wav: 'WAV',
  mp3: 'MP3',
  'ogg-vorbis': 'Ogg Vorbis',
  'ogg-opus': 'Ogg Opus',
  flac: 'FLAC',
  'webm-opus': 'WebM/Opus',
};

/** What the error for an unsupported format lists. */
export const ACCEPTED_FORMATS =
  'WAV (audio/wav), MP3 (audio/mpeg), Ogg Vorbis and Ogg Opus (audio/ogg), FLAC (audio/flac), WebM/Opus (audio/webm)';

/** Content types of a raw audio body and the container they name (`ogg` and `webm` are told apart by their content). */
const CONTENT_TYPES: Record<string, 'wav' | 'mp3' | 'ogg' | 'flac' | 'webm'> = {
  'audio/wav': 'wav',
  'audio/x-wav': 'wav',
  'audio/wave': 'wav',
  'audio/vnd.wave': 'wav',
  'audio/mpeg': 'mp3',
  'audio/mp3': 'mp3',
  'audio/ogg': 'ogg',
  'audio/opus': 'ogg',
  'application/ogg': 'ogg',
  'audio/flac': 'flac',
  'audio/x-flac': 'flac',
  'audio/webm': 'webm',
  'video/webm': 'webm',
};

/** True for a content type that a raw audio body may carry (`application/octet-stream`: by its bytes alone). */
export function isAudioContentType(type: string): boolean {
  return type.startsWith('audio/') || type in CONTENT_TYPES || type === 'application/octet-stream';
}

/** True if `b` holds the latin1 string `s` at byte `at`. */
export const ascii = (b: Uint8Array, at: number, s: string): boolean =>
  b.length >= at + s.length && Buffer.from(b.buffer, b.byteOffset + at, s.length).toString('latin1') === s;

/**
 * What the first bytes say (magic numbers): a supported format, the name of a recognised but
 * unsupported one, or null.
 */
function sniff(b: Uint8Array): AudioFormat | { unsupported: string } | null {
  if ((ascii(b, 0, 'RIFF') || ascii(b, 0, 'RIFX') || ascii(b, 0, 'RF64')) && ascii(b, 8, 'WAVE')) return 'wav';
  if (ascii(b, 0, 'fLaC')) return 'flac';
  if (ascii(b, 0, 'OggS')) {
    // The first page holds the codec's identification header (RFC 3533; RFC 7845 for Opus).
    const body = 27 + (b[26] ?? 0);
    if (ascii(b, body, 'OpusHead')) return 'ogg-opus';
    if (ascii(b, body, '\x01vorbis')) return 'ogg-vorbis';
    if (ascii(b, body, '\x7fFLAC')) return { unsupported: 'Ogg FLAC' };
    if (ascii(b, body, 'Speex')) return { unsupported: 'Ogg Speex' };
    return { unsupported: 'Ogg with an unknown codec' };
  }
  if (b[0] === 0x1a && b[1] === 0x45 && b[2] === 0xdf && b[3] === 0xa3) return 'webm-opus'; // EBML: the codec is checked when decoding
  if (ascii(b, 4, 'ftyp')) return { unsupported: 'MP4/M4A (AAC)' };
  if (ascii(b, 0, 'FORM') && (ascii(b, 8, 'AIFF') || ascii(b, 8, 'AIFC'))) return { unsupported: 'AIFF' };
  if (ascii(b, 0, 'caff')) return { unsupported: 'CAF' };
  if (ascii(b, 0, '#!AMR')) return { unsupported: 'AMR' };
  if (ascii(b, 0, 'ID3')) return 'mp3';
  // An MPEG audio frame sync: 11 set bits; layer bits 00 with the same sync are AAC's ADTS.
  if (b[0] === 0xff && (b[1] & 0xe0) === 0xe0) return (b[1] & 0x06) === 0 ? { unsupported: 'AAC (ADTS)' } : 'mp3';
  return null;
}

/**
 * What a file's first bytes look like, for a message: an audio format (`format`, its `name`), or
 * something else sent by mistake (JSON, an HTML page, a multipart form, text), with a `hint` that
 * names it and says what to do.
 */
export function describeBytes(b: Uint8Array): { format?: AudioFormat; name: string; hint: string } {
  const sniffed = sniff(b);
  if (typeof sniffed === 'string') {
    const name = FORMAT_NAMES[sniffed];
    const type = { wav: 'audio/wav', mp3: 'audio/mpeg', flac: 'audio/flac', 'webm-opus': 'audio/webm' }[
      sniffed as string
    ];
    return { format: sniffed, name, hint: `this looks like ${name}; send it as ${type ?? 'audio/ogg'}` };
  }
  if (sniffed)
    return {
      name: sniffed.unsupported,
      hint: `this looks like ${sniffed.unsupported}, which is not supported; accepted: ${ACCEPTED_FORMATS}`,
    };
  const head = Buffer.from(b.buffer, b.byteOffset, Math.min(b.length, 512)).toString('latin1');
  const text = head.trimStart();
  const quoted = JSON.stringify(text.slice(0, 24));
  if (/^[{[]/.test(text))
    return {
      name: 'JSON',
      hint: `this looks like JSON (${quoted}...); send JSON with content-type: application/json ({"model", "audio": <base64 WAV>})`,
    };
  if (/^<(!doctype|html|\?xml)/i.test(text))
    return {
      name: 'HTML',
      hint: `this looks like an HTML or XML page (${quoted}...), not audio: was an error page saved in place of the file?`,
    };
  if (/^--\S+\r?\n/.test(text) && /content-disposition: *form-data/i.test(head))
    return {
      name: 'a multipart form',
      hint: 'this looks like a multipart form (curl -F); send the file as the body (curl --data-binary @file.wav)',
    };
  if (b.length && /^[\t\n\r\x20-\x7e]*$/.test(head))
    return { name: 'text', hint: `this looks like text (${quoted}...), not audio` };
  return {
    name: 'unknown',
    hint: `its first bytes (${Buffer.from(b.subarray(0, 4)).toString('hex')}) are no audio format this server knows; accepted: ${ACCEPTED_FORMATS}`,
  };
}

/**
 * Chooses how to decode an audio file: by its magic bytes, else by its declared content type.
 * @param contentType the body's media type (lower case, no parameters), or undefined (base64
 *   with no `data:` prefix).
 * @throws VoxError `invalid_request_error` naming the format (or content type) when it is not
 *   one of {@link ACCEPTED_FORMATS}, or when the bytes are empty or unrecognised.
 */
export function audioFormat(bytes: Uint8Array, contentType?: string): AudioFormat {
  if (bytes.length === 0)
    throw voxError('invalid_audio', { problem: `empty body (no audio bytes); accepted: ${ACCEPTED_FORMATS}` });
  const sniffed = sniff(bytes);
  if (typeof sniffed === 'string') return sniffed;
  if (sniffed)
    throw voxError('unsupported_audio', {
      problem: `${sniffed.unsupported} is not supported; accepted: ${ACCEPTED_FORMATS}`,
    });
  const declared = contentType ? CONTENT_TYPES[contentType] : undefined;
  // Not a WAV, nor any audio this server knows: say what the bytes look like, and what to do.
  if (declared === 'wav' && !ascii(bytes, 0, 'RIFF') && !ascii(bytes, 0, 'RIFX') && !ascii(bytes, 0, 'RF64'))
    throw voxError('invalid_audio', {
      problem: `the body was sent as ${contentType} but is not a WAV file: ${describeBytes(bytes).hint}`,
    });
  // A declared format whose bytes do not start as expected goes to its decoder, which says what is wrong.
  if (declared === 'wav' || declared === 'mp3' || declared === 'flac') return declared;
  if (declared === 'ogg')
    throw voxError('invalid_audio', { problem: `not a readable Ogg file (no Ogg page at the start)` });
  if (declared === 'webm')
    throw voxError('invalid_audio', { problem: `not a readable WebM file (no EBML header at the start)` });
  if (contentType && contentType !== 'application/octet-stream')
    throw voxError('unsupported_audio', { problem: `${contentType} is not supported; accepted: ${ACCEPTED_FORMATS}` });
  throw voxError('invalid_audio', {
    problem: `unrecognised format (first bytes ${Buffer.from(bytes.subarray(0, 4)).toString('hex')}); accepted: ${ACCEPTED_FORMATS}`,
  });
}

/** A decode job's answer from the worker (a JSON job's: `value`). */
export type DecodeReply =
  | { id: number; samples: Float32Array; sourceRate: number }
  | { id: number; value: unknown }
  | { id: number; error: WireError };

/**
 * Parses a JSON object body; an empty body is `{}`. A body parsed on the main thread ({@link
 * OFF_THREAD_JSON_BYTES}) may carry the value parsed off it (`parsed`, {@link parseJsonOffThread}).
 * @throws VoxError `invalid_json`.
 */
export function parseJsonObject(body: Buffer & { parsed?: Record<string, unknown> }): Record<string, unknown> {
  if (body.parsed) return body.parsed;
  if (body.length === 0) return {};
  let v: unknown;
  try {
    v = JSON.parse(body.toString('utf8'));
  } catch (e) {
    throw voxError('invalid_json', { problem: `is not valid JSON: ${(e as Error).message}` });
  }
  if (!v || typeof v !== 'object' || Array.isArray(v))
    throw voxError('invalid_json', { problem: 'must be a JSON object' });
  return v as Record<string, unknown>;
}

/**
 * JSON bodies this large or larger are parsed in a decode worker, not on the event loop: 1 MiB,
 * about 5 ms of `JSON.parse` on the main thread (a 41 MB tensor body took over a second there).
 */
export const OFF_THREAD_JSON_BYTES = 1024 * 1024;

/** The compiled worker entry (under vitest, the sources use `dist/`, as slot hosts do: build first). */
function workerFile(): URL {
  const sibling = new URL('./decode-worker.js', import.meta.url);
  if (existsSync(fileURLToPath(sibling))) return sibling;
  return new URL('../../dist/runtime/audio/decode-worker.js', import.meta.url);
}

/**
 * Decode workers: one per core (at most 4), all started at once (module loading and WASM
 * compilation happen before the first request needs them), each running one decode at a time
 * (more wait in FIFO order). They are unref'd, so they never keep the process alive; a worker
 * that dies fails its job with a `server_error` and is replaced.
 */
class DecodePool {
  private readonly idle: Worker[] = [];
  private readonly waiting: ((w: Worker) => void)[] = [];
  private seq = 0;
  constructor(size: number) {
    for (let i = 0; i < size; i++) this.release(this.spawn());
  }

  private spawn(): Worker {
    const worker = new Worker(workerFile(), { workerData: { role: 'decode' } });
    worker.unref();
    return worker;
  }

  private acquire(): Promise<Worker> {
    const w = this.idle.pop();
    return w ? Promise.resolve(w) : new Promise((resolve) => this.waiting.push(resolve));
  }

  private release(w: Worker): void {
    const next = this.waiting.shift();
    if (next) next(w);
    else this.idle.push(w);
  }

  async run(
    bytes: Uint8Array,
    format: AudioFormat,
    maxSeconds: number,
    toHz: number,
  ): Promise<{ samples: Float32Array; sourceRate: number }>;
  async run(bytes: Uint8Array, format: 'json', maxSeconds: number, toHz: number): Promise<unknown>;
  async run(bytes: Uint8Array, format: AudioFormat | 'json', maxSeconds: number, toHz: number): Promise<unknown> {
    const worker = await this.acquire();
    const id = ++this.seq;
    // The worker gets its own copy of the bytes (the body buffer may be a slice of a shared pool);
    // a JSON body that is a whole buffer of its own is handed over as it is (not used here after).
    const whole = bytes.byteOffset === 0 && bytes.byteLength === bytes.buffer.byteLength;
    const copy = format === 'json' && whole ? bytes : new Uint8Array(bytes);
    return new Promise<unknown>((resolve, reject) => {
      const done = (): void => {
        worker.off('message', onMessage).off('error', onDied).off('exit', onDied);
      };
      const onMessage = (m: DecodeReply): void => {
        if (m.id !== id) return;
        done();
        this.release(worker);
        if ('error' in m) reject(fromWire(m.error));
        else resolve('samples' in m ? { samples: m.samples, sourceRate: m.sourceRate } : m.value);
      };
      const onDied = (e: unknown): void => {
        done();
        void worker.terminate();
        this.release(this.spawn());
        reject(voxError('decoder_failed', { reason: e instanceof Error ? e.message : `exit ${e}` }));
      };
      worker.on('message', onMessage).on('error', onDied).on('exit', onDied);
      worker.postMessage({ id, bytes: copy, format, maxSeconds, toHz }, [copy.buffer as ArrayBuffer]);
    });
  }
}

let pool: DecodePool | null = null;

/** Starts the decode workers if they are not running yet (the server does at start). */
export function startDecoders(): void {
  pool ??= new DecodePool(Math.max(1, Math.min(4, availableParallelism())));
}

/**
 * Decodes one audio file to mono float32 samples at 16 kHz in a decode worker thread (the
 * event loop stays free), after choosing the decoder with {@link audioFormat}.
 * @param contentType the declared media type, if any.
 * @param maxSeconds decoded-duration limit, s (default {@link MAX_AUDIO_SECONDS}).
 * @throws VoxError `invalid_request_error` for an unsupported, corrupt, truncated or too long
 *   file (the message names the format); `server_error` if the worker dies.
 */
export function decodeAudio(
  bytes: Uint8Array,
  contentType?: string,
  maxSeconds = MAX_AUDIO_SECONDS,
): Promise<Float32Array> {
  return decodeAudioAt(bytes, contentType, MODEL_SAMPLE_RATE, maxSeconds).then((d) => d.samples);
}

/**
 * Decodes one audio file to mono float32 samples at `toHz` in a decode worker thread, as
 * {@link decodeAudio} does for 16 kHz (a denoise model takes 48 kHz).
 * @returns the samples, and the file's own sample rate, Hz.
 * @throws VoxError as {@link decodeAudio}.
 */
export function decodeAudioAt(
  bytes: Uint8Array,
  contentType: string | undefined,
  toHz: number,
  maxSeconds = MAX_AUDIO_SECONDS,
): Promise<{ samples: Float32Array; sourceRate: number }> {
  const format = audioFormat(bytes, contentType);
  startDecoders();
  return pool!.run(bytes, format, maxSeconds, toHz);
}

/**
 * Parses a JSON object body in a decode worker thread, and reads the `data` of each tensor of its
 * `inputs` into a typed array there (as {@link parseJsonObject} and `readTensor` would on the main
 * thread), so that a large tensor request does not hold the event loop: the main thread then
 * only copies the typed arrays. `bytes`, when a whole buffer of its own, is handed to the worker
 * (detached here).
 * @throws VoxError `invalid_json`, `invalid_tensor` naming the field; `server_error` if the worker dies.
 */
export function parseJsonOffThread(bytes: Uint8Array): Promise<Record<string, unknown>> {
  startDecoders();
  return pool!.run(bytes, 'json', 0, 0) as Promise<Record<string, unknown>>;
}
