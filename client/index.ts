/**
 * The voxserve client (`voxserve/client`), for Node 20+ and browsers: live streams over
 * WebSocket (`GET /v1/stream`), files over HTTP (`POST /v1/tasks/run`, `/v1/tasks/batch`), and
 * model management. It imports nothing from Node: it uses the global `fetch` and a WebSocket
 * constructor (the global one in browsers; under Node the `voxserve/client` entry passes `ws`'s,
 * or pass your own as `WebSocket`).
 *
 * ```ts
 * const vox = new VoxClient({ url: 'http://127.0.0.1:8080' });
 * const stream = await vox.stream({ model: 'silero-vad', sampleRate: 16000 });
 * stream.on('speech_end', (e) => console.log(e.start_ms, e.end_ms));
 * for (const frame of frames) await stream.send(frame); // waits while the socket is behind
 * console.log(await stream.end()); // the `done` event
 * ```
 */
import { createParser, type EventSourceMessage } from 'eventsource-parser';
import { unpack } from 'msgpackr';
// Type-only: erased from the emitted JavaScript, so the browser path imports no server code.
import type { ModelStatus } from '../actors/model.js';
import type { ErrorCode, WireError as ServerWireError } from '../runtime/errors.js';
import type { Segment } from '../runtime/tasks/vad.js';
// The wire constants the server uses too (a module with no imports: bundled for the browser as is).
import {
  CLOSE,
  CLOSE_TYPE,
  ERROR_STATUS,
  KEY_PROTOCOL,
  SUBPROTOCOLS,
  typeOfStatus,
  type ErrorType,
} from '../runtime/wire.js';

/** Error types of the wire interface (`{"error":{"type","code","message"}}`, stream `error` events). */
export type WireErrorType = ErrorType;
export type { ErrorCode };
/** An error as the server sends it (`code` since 0.1: absent from older servers). */
export type WireError = Omit<ServerWireError, 'code'> & { code?: ErrorCode };

/** A wire error type, or `connection_error` when the server could not be reached or the connection dropped. */
export type ClientErrorType = WireErrorType | 'connection_error';

/**
 * Every failure the client reports. `type` is the wire error type (from the error body, the
 * stream's last `error` event, or else the HTTP status or close code), or `connection_error`.
 */
export class VoxClientError extends Error {
  readonly type: ClientErrorType;
  /** HTTP status of a refused request. */
  readonly status?: number;
  /** WebSocket close code of a failed stream (1008 bad parameters, 1013 busy, ...). */
  readonly closeCode?: number;
  /** `Retry-After` of a 503, s. */
  readonly retryAfterS?: number;
  /**
   * A stable code: the server's error code (docs/errors.md: `model_not_found`, `queue_full`, ...)
   * when it sent one, or the system error code of a connection failure (`ECONNREFUSED`, ...)
   * when the platform tells it (Node).
   */
  readonly code?: ErrorCode | (string & {});
  constructor(
    type: ClientErrorType,
    message: string,
    extra: { status?: number; closeCode?: number; retryAfterS?: number; code?: string; cause?: unknown } = {},
  ) {
    super(message, { cause: extra.cause });
    this.name = 'VoxClientError';
    this.type = type;
    this.status = extra.status;
    this.closeCode = extra.closeCode;
    this.retryAfterS = extra.retryAfterS;
    this.code = extra.code;
  }
}

/** `timing` of a result: wall and queue time, ms; audio duration, ms; rtf = wall / audio. */
export interface Timing {
  wall_ms: number;
  queue_ms: number;
  audio_duration_ms: number;
  rtf: number;
}

/**
 * A speech segment: ms and samples (16 kHz) from the start of the audio; `confidence` is the mean speech probability.
 */
export type { Segment };

export interface Detection {
  label: string;
  score: number;
  at_ms: number;
}

/** The result of one file (`run`, or one `result` of `batch`). */
export type TaskResult =
  | { model: string; task: 'vad'; sample_rate: number; segments: Segment[]; timing: Timing }
  | {
      model: string;
      task: 'wakeword';
      detections: Detection[];
      /** With the option `scores`: each 80 ms step's score per label, the step ending at `at_ms`. */
      scores?: { at_ms: number; scores: Record<string, number> }[];
      timing: Timing;
    };

/** Events of a live stream, as the server sends them. Times are ms from the stream's start. */
export type StreamEvent =
  /**
   * `window_ms` (from this version on): the model's window (Silero VAD 32), step (wake word 80) or frame (denoise 10),
   * ms: the grid from the session's start on which the model runs. A resumed stream starts on it.
   */
  | { type: 'ready'; session_id: string; model: string; task: string; sample_rate: number; window_ms?: number }
  | { type: 'speech_start'; at_ms: number }
  | { type: 'speech_end'; start_ms: number; end_ms: number; confidence: number }
  | { type: 'detection'; label: string; score: number; at_ms: number }
  /**
   * VAD streams opened with `probabilities` (docs/vad.md): the speech probability of the 32 ms
   * window starting at `at_ms`; with `probabilityIntervalMs`, those of the windows starting in one
   * span, in order from `at_ms`.
   */
  | { type: 'probability'; at_ms: number; p: number | number[] }
  /** Wake-word streams opened with `scores`: each 80 ms step's score per label, the step ending at `at_ms`. */
  | { type: 'score'; at_ms: number; scores: Record<string, number> }
  /** A bad control frame (the stream goes on), or the reason of the close that follows. */
  | { type: 'error'; error: WireError }
  /**
   * The stream's end. `checkpoint`: a draining node's `done` (close 1001 follows) on a VAD stream with checkpoints:
   * it stopped at its last whole window (`processed_ms`), for the stream to go on from there on another node.
   */
  | { type: 'done'; processed_ms: number; timing: Timing; checkpoint?: string }
  /**
   * A denoise stream (`model=rnnoise`, docs/websocket-api.md): the next chunk of denoised audio,
   * raw mono PCM in the stream's encoding and at its sample rate, in order (a binary frame under
   * the JSON subprotocol, an `audio` event under msgpack).
   */
  | { type: 'audio'; data: Uint8Array }
  /**
   * Streams with `resume` (they ask for it with `progress=true`): the server has processed the
   * audio up to `processed_ms` on the stream's clock, and every event of it before this one was sent.
   * `checkpoint` (VAD streams that asked with `checkpoints=true`, as `resume` does): where a new
   * session goes on from exactly, Silero's state and the segmenter's included (`resume_from`).
   */
  | { type: 'progress'; processed_ms: number; checkpoint?: string }
  /**
   * Made by the client, not sent by a server (streams with `resume`): the stream's node went away
   * and the stream goes on at `url` (new `session_id`). `gap`: the audio sent but not confirmed
   * by the old node (its events, if any, were lost with it); `resent`: what was sent again to the
   * new node, whose clock starts at `resent.start_ms` (`offset_ms`, or its checkpoint's); `dropped`: null (every
   * unconfirmed byte is kept; older clients reported here the part of a gap longer than
   * `bufferMs` they had let go). ms on the stream's clock.
   */
  | {
      type: 'resumed';
      url: string;
      previous_url: string;
      session_id: string;
      gap: { start_ms: number; end_ms: number };
      resent: { start_ms: number; end_ms: number };
      dropped: { start_ms: number; end_ms: number } | null;
    };

export type StreamEventOf<T extends StreamEvent['type']> = Extract<StreamEvent, { type: T }>;

/** How a stream ended: its close code and reason, and the error when it failed. */
export interface CloseInfo {
  code: number;
  reason: string;
  error?: VoxClientError;
}

/** Progress of a long file on `run`: audio processed so far and the file's duration, ms. */
export interface Progress {
  processed_ms: number;
  audio_duration_ms: number;
}

/** Events of `batch`, in the order the files finish. */
export type BatchEvent =
  | ({ type: 'result'; index: number } & TaskResult)
  | { type: 'error'; index: number; error: WireError }
  | { type: 'done'; files: number; failed: number; wall_ms: number; queue_ms: number; inference_ms: number };

/** A model's status (`GET /v1/models`), as the server's model entry reports it. */
export type { ModelStatus };

/** What a WebSocket must offer: the browser's, or `ws`'s (its EventTarget interface). */
export interface WebSocketLike {
  readonly readyState: number;
  readonly bufferedAmount: number;
  binaryType: string;
  /** The subprotocol the server chose (a denoise stream's binary frames are audio under `voxserve.v1.json`). */
  readonly protocol?: string;
  send(data: string | ArrayBuffer | ArrayBufferView): void;
  close(code?: number, reason?: string): void;
  // eslint-disable-next-line @typescript-eslint/no-explicit-any
  addEventListener(type: 'open' | 'message' | 'close' | 'error', listener: (event: any) => void): void;
  /** `ws` only (a browser's WebSocket cannot send pings): sends a ping frame. */
  ping?(): void;
  /** `ws` only: `pong` frames (answers to `ping`) and the server's own `ping` frames. */
  on?(type: 'pong' | 'ping', listener: () => void): unknown;
  /** `ws` only: drops the connection at once, without the closing handshake. */
  terminate?(): void;
}

/**
 * A WebSocket constructor; the third argument (headers, and the handshake's deadline in ms) is
 * used by `ws` and ignored by browsers.
 */
export type WebSocketConstructor = new (
  url: string,
  protocols: string | string[],
  options?: { headers?: Record<string, string>; handshakeTimeout?: number },
) => WebSocketLike;

/** Audio for `run` and `batch`: the bytes of a file (WAV, or a compressed format the server accepts). */
export type AudioInput = Uint8Array | ArrayBuffer | Blob;

export interface ClientOptions {
  /** Server URL, `http(s)://host:port`. Default: the page's origin in a browser, else `http://127.0.0.1:8080`. */
  url?: string;
  /**
   * Several nodes of one cluster (docs/cluster.md), instead of `url`: the client uses the first
   * that answers `GET /ready` with 200 (asked in this order) and asks again after a connection error.
   */
  urls?: string[];
  /**
   * The management token (`management.token`): sent as `Authorization: Bearer <token>` on status and management calls.
   */
  token?: string;
  /**
   * An API key (one of the server's `auth.api_keys`) for `run`, `batch` and streams: sent as
   * `Authorization: Bearer <key>` over HTTP; on a stream as that header under Node, and as the
   * WebSocket subprotocol `voxserve.key.<key>` in browsers, which cannot set headers on a
   * WebSocket (the server never echoes it back).
   */
  apiKey?: string;
  /** A fetch implementation (default: the global one). */
  fetch?: typeof fetch;
  /** A WebSocket constructor (default: the global one; the Node entry passes `ws`). */
  WebSocket?: WebSocketConstructor;
  /**
   * Heartbeat of a stream, ms (default {@link DEFAULT_HEARTBEAT_MS}, 10 s; 0 = off): a ping every
   * `heartbeatMs`, and a stream whose server has sent nothing (no pong, no event) for a whole
   * interval after a ping fails with `connection_error`, code `heartbeat_timeout`: `end()`, the
   * event iterator and waiting `send`s reject instead of waiting for ever on a server that is
   * frozen (SIGSTOP, a hung host) or cut off without a reset. So a dead server is noticed 10-20 s
   * after its last answer. It is also the deadline of the stream's opening handshake. Needs a
   * WebSocket that can ping (`ws`, the Node entry's); a browser's cannot, so there it is off.
   */
  heartbeatMs?: number;
}

/** A stream's heartbeat interval and answer deadline by default, ms (see {@link ClientOptions.heartbeatMs}). */
export const DEFAULT_HEARTBEAT_MS = 10_000;

export interface RunOptions {
  model: string;
  /** Task options (`threshold`, ...), checked by the server against the model's task. */
  options?: Record<string, unknown>;
  /** A chain: the denoise model (`rnnoise`) the audio goes through before a VAD or wake-word model. */
  denoise?: string;
  /** The request's own busy timeout, ms. */
  busyTimeoutMs?: number;
  /**
   * Content type of the bytes; default: `audio/wav` for a RIFF file, a Blob's own type, else
   * `application/octet-stream`.
   */
  contentType?: string;
  /** Asks for progress (server-sent events) and calls this as the file is processed. */
  onProgress?: (p: Progress) => void;
  signal?: AbortSignal;
}

export interface StreamOptions {
  model: string;
  /**
   * Sample rate of the PCM you send, Hz (8000-192000; the server resamples to 16 kHz). Default
   * 16000. Leave the format out when you send a WAV file ({@link VoxStream.sendFile}): its header
   * sets it (a format given here that the header contradicts fails the stream, saying so).
   */
  sampleRate?: number;
  /** `s16le` (default) or `f32le`. */
  encoding?: 's16le' | 'f32le';
  /** Interleaved channels (downmixed by the server). Default 1. */
  channels?: number;
  /** How events are encoded: `json` (`voxserve.v1.json`, default) or `msgpack` (`voxserve.v1.msgpack`). */
  protocol?: 'json' | 'msgpack';
  busyTimeoutMs?: number;
  /** Task options (`threshold`, `max_speech_duration_s`, ...), sent as query parameters. */
  options?: Record<string, string | number | boolean>;
  /**
   * VAD: send a `probability` event per 32 ms window (`true`), or one per this many ms carrying that span's windows
   * (32-60000).
   */
  probabilities?: boolean | number;
  /** Wake words: send a `score` event per 80 ms step with each label's score (the task option `scores`). */
  scores?: boolean;
  /** Bytes the socket may hold unsent before `send` waits. Default 256 KiB (8 s of 16 kHz s16le). */
  highWaterMark?: number;
  /**
   * Resume the stream on another node when its node goes away (the connection drops, close 1001,
   * or the heartbeat fails): `true`, or `{ bufferMs, timeoutMs }`; default `true` when the client
   * was given several `urls`, else off. The stream asks the server for `progress` events (with
   * `checkpoints`: a VAD stream then resumes from the model's state, `resume_from`), keeps
   * every byte the server has not confirmed (`send` waits once `bufferMs` of written audio,
   * default 30000, at least {@link MIN_RESUME_BUFFER_MS}, is unconfirmed), and on a loss opens the stream again on a node answering
   * `/ready` (each look-up bounded by `heartbeatMs`; the stream fails at `timeoutMs`, default
   * 30000, whatever the attempt is doing) with its clock at the confirmed audio (`offset_ms`),
   * re-sends the rest, and reports the gap as a `resumed` event (docs/client.md).
   */
  resume?: boolean | { bufferMs?: number; timeoutMs?: number };
}

/** Written, unconfirmed audio past which `send` waits on a resumable stream by default, ms. */
export const DEFAULT_RESUME_BUFFER_MS = 30_000;
/**
 * The least `resume.bufferMs`, ms: under it `send` would wait on audio the server cannot confirm yet (its last
 * partial window, or the frames of one job).
 */
export const MIN_RESUME_BUFFER_MS = 1000;
/** How long a stream tries to resume by default, ms. */
export const DEFAULT_RESUME_TIMEOUT_MS = 30_000;

const DEFAULT_URL = 'http://127.0.0.1:8080';
const SUBPROTOCOL = { json: SUBPROTOCOLS[0], msgpack: SUBPROTOCOLS[1] } as const;

/** Which credential a call carries: the management token (status, management) or the API key (inference). */
type Credential = 'token' | 'apiKey';

/** Parses a server URL. @throws TypeError naming what is wrong (and suggesting `http://`). */
function serverUrl(url: string): string {
  let u: URL | null = null;
  try {
    u = new URL(url);
  } catch {
    // below
  }
  if (!u || (u.protocol !== 'http:' && u.protocol !== 'https:')) {
    throw new TypeError(
      `url: '${url}' is not an http(s) URL${/^[\w.-]+:\d+/.test(url) ? `; did you mean http://${url}?` : ''}`,
    );
  }
  return u.origin + u.pathname.replace(/\/+$/, '');
}

function connectionError(url: string, e: unknown): VoxClientError {
  const cause = (e as { cause?: { code?: string; message?: string } }).cause;
  const code = cause?.code ?? (e as { code?: string }).code;
  const why = code ?? cause?.message ?? (e as Error).message;
  return new VoxClientError('connection_error', `cannot reach ${url}: ${why}`, { code, cause: e });
}

/** The `{"error":{type,code,message}}` of an error body, or `{}` when it is not one. */
function wireError(text: string): Partial<WireError> {
  try {
    return (JSON.parse(text) as { error?: Partial<WireError> }).error ?? {};
  } catch {
    return {};
  }
}

/** Turns an error response into a VoxClientError (its wire type and message when the body has them). */
async function responseError(res: Response): Promise<VoxClientError> {
  const text = await res.text().catch(() => '');
  const error = wireError(text);
  const retry = Number(res.headers.get('retry-after'));
  return new VoxClientError(error.type ?? typeOfStatus(res.status), error.message ?? (text || `HTTP ${res.status}`), {
    status: res.status,
    code: error.code,
    retryAfterS: Number.isFinite(retry) && retry > 0 ? retry : undefined,
  });
}

async function bytesOf(audio: AudioInput): Promise<Uint8Array> {
  if (audio instanceof Uint8Array) return audio;
  if (audio instanceof ArrayBuffer) return new Uint8Array(audio);
  return new Uint8Array(await audio.arrayBuffer());
}

function base64(bytes: Uint8Array): string {
  let s = '';
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(s);
}

const isRiff = (b: Uint8Array): boolean =>
  b.length >= 4 && b[0] === 0x52 && b[1] === 0x49 && b[2] === 0x46 && b[3] === 0x46;

/** Bytes per frame of {@link VoxStream.sendFile}. */
const FILE_FRAME_BYTES = 64 * 1024;

const hex = (b: Uint8Array): string => Array.from(b, (x) => x.toString(16).padStart(2, '0')).join('');
const text = (b: Uint8Array, at: number, n: number): string => String.fromCharCode(...b.subarray(at, at + n));

/** A WAV file's format and where its samples are, or null when the bytes do not start a WAV file. */
function wavHeader(
  b: Uint8Array,
): { tag: number; channels: number; sampleRate: number; bits: number; dataStart: number; dataBytes: number } | null {
  if (b.length < 12 || !['RIFF', 'RF64'].includes(text(b, 0, 4)) || text(b, 8, 4) !== 'WAVE') return null;
  const v = new DataView(b.buffer, b.byteOffset, b.byteLength);
  let fmt: { tag: number; channels: number; sampleRate: number; bits: number } | null = null;
  for (let at = 12; at + 8 <= b.length; ) {
    const id = text(b, at, 4);
    const size = v.getUint32(at + 4, true);
    if (id === 'fmt ' && at + 24 <= b.length) {
      let tag = v.getUint16(at + 8, true);
      if (tag === 0xfffe && size >= 26 && at + 34 <= b.length) tag = v.getUint16(at + 32, true);
      fmt = {
        tag,
        channels: v.getUint16(at + 10, true),
        sampleRate: v.getUint32(at + 12, true),
        bits: v.getUint16(at + 22, true),
      };
    }
    if (id === 'data') {
      if (!fmt) return null;
      const dataBytes = size === 0 || size === 0xffffffff ? b.length - at - 8 : Math.min(size, b.length - at - 8);
      return { ...fmt, dataStart: at + 8, dataBytes };
    }
    at += 8 + size + (size % 2);
  }
  return null;
}

/** The compressed formats (by {@link compressedName}) a stream takes whole, decoding them at `end` (MP3: with an ID3 tag). */
const STREAM_FILES = ['Ogg Opus', 'Ogg Vorbis', 'Ogg', 'FLAC', 'WebM', 'MP3'];

/** The name of a compressed audio format by its first bytes, or null. */
function compressedName(b: Uint8Array): string | null {
  if (text(b, 0, 4) === 'OggS') {
    const body = 27 + (b[26] ?? 0);
    return text(b, body, 8) === 'OpusHead' ? 'Ogg Opus' : text(b, body + 1, 6) === 'vorbis' ? 'Ogg Vorbis' : 'Ogg';
  }
  if (text(b, 0, 4) === 'fLaC') return 'FLAC';
  if (b[0] === 0x1a && b[1] === 0x45 && b[2] === 0xdf && b[3] === 0xa3) return 'WebM';
  if (text(b, 0, 3) === 'ID3' || (b[0] === 0xff && (b[1] & 0xe0) === 0xe0)) return 'MP3';
  if (text(b, 4, 4) === 'ftyp') return 'MP4/M4A';
  return null;
}

/** Server-sent events of a response body, with their data parsed as JSON. */
async function* sseEvents(res: Response): AsyncGenerator<{ event: string; data: unknown }> {
  const got: EventSourceMessage[] = [];
  const parser = createParser({ onEvent: (m) => got.push(m) });
  const reader = res.body!.getReader();
  const text = new TextDecoder();
  try {
    for (;;) {
      const { done, value } = await reader.read();
      if (done) return;
      parser.feed(text.decode(value, { stream: true }));
      while (got.length) {
        const m = got.shift()!;
        yield { event: m.event ?? 'message', data: JSON.parse(m.data) };
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

/** The error of an SSE `error` event (`{error:{type,message}}`). */
const sseError = (data: unknown): VoxClientError => {
  const e = (data as { error?: Partial<WireError> }).error;
  return new VoxClientError(e?.type ?? 'server_error', e?.message ?? 'the server reported an error', { code: e?.code });
};

/** A client of one voxserve. All methods throw {@link VoxClientError}. */
export class VoxClient {
  /** The server's base URL, `http(s)://host:port` (with `urls`: the node in use). */
  url: string;
  private readonly urls: string[];
  /** With `urls`: the node picked, until a connection error. */
  private picked: Promise<string> | null = null;
  private readonly token?: string;
  private readonly apiKey?: string;
  private readonly fetchImpl: typeof fetch;
  private readonly WS?: WebSocketConstructor;
  private readonly heartbeatMs: number;

  /**
   * @throws TypeError for a URL that is not http(s), an `apiKey` with characters a key cannot
   *   have, or a `heartbeatMs` that is not a non-negative number.
   */
  constructor(opts: ClientOptions = {}) {
    const origin = (globalThis as { location?: { origin?: string } }).location?.origin;
    this.urls = (opts.urls ?? []).map(serverUrl);
    this.url = this.urls[0] ?? serverUrl(opts.url ?? (origin && origin !== 'null' ? origin : DEFAULT_URL));
    if (opts.apiKey !== undefined && !/^[A-Za-z0-9._~-]+$/.test(opts.apiKey))
      throw new TypeError('apiKey: an API key has only the characters A-Z a-z 0-9 . _ ~ -');
    this.token = opts.token;
    this.apiKey = opts.apiKey;
    this.fetchImpl = opts.fetch ?? ((...a) => fetch(...a));
    this.WS = opts.WebSocket ?? (globalThis as { WebSocket?: WebSocketConstructor }).WebSocket;
    const heartbeat = opts.heartbeatMs ?? DEFAULT_HEARTBEAT_MS;
    if (typeof heartbeat !== 'number' || !(heartbeat >= 0) || heartbeat > 2_147_483_647)
      throw new TypeError(`heartbeatMs: a number of ms from 0 (off) to 2147483647, got ${String(heartbeat)}`);
    this.heartbeatMs = heartbeat;
  }

  private headers(credential: Credential, extra: Record<string, string> = {}): Record<string, string> {
    const secret = this[credential];
    return secret ? { authorization: `Bearer ${secret}`, ...extra } : extra;
  }

  /**
   * How a stream carries the API key: in browsers, which cannot set WebSocket headers, as the
   * subprotocol `voxserve.key.<key>` (the Node entry sends the `Authorization` header instead).
   */
  protected streamCredentials(apiKey: string): { protocols: string[]; headers?: Record<string, string> } {
    return { protocols: [`${KEY_PROTOCOL}${apiKey}`] };
  }

  /**
   * The base URL to use: `url`, or with several `urls` the first node answering `GET /ready` 200.
   * @throws VoxClientError `connection_error` when none does.
   */
  private node(): Promise<string> {
    if (this.urls.length < 2) return Promise.resolve(this.url);
    this.picked ??= this.firstReady(this.urls);
    return this.picked;
  }

  /**
   * Picks the first of `order` (the `urls`, in some order) answering `GET /ready` 200 as the node in use.
   * Each look-up is bounded by `heartbeatMs` (10 s when it is 0): a node that has not answered by then is passed over.
   * @throws VoxClientError `connection_error` when none does (and forgets the pick).
   */
  private async firstReady(order: string[]): Promise<string> {
    for (const u of order) {
      try {
        // Bounded: a frozen node (SIGSTOP, a hung host) accepts the connection and never answers.
        const signal = AbortSignal.timeout(this.heartbeatMs || DEFAULT_HEARTBEAT_MS);
        if ((await this.fetchImpl(`${u}/ready`, { signal })).ok) return (this.url = u);
      } catch {
        // not reachable: the next one
      }
    }
    this.picked = null;
    throw new VoxClientError('connection_error', `none of ${this.urls.join(', ')} answers GET /ready with 200`);
  }

  /** Fetches `path` with the given credential; a response that is not 2xx is thrown as its VoxClientError. */
  private async request(path: string, init: RequestInit = {}, credential: Credential = 'token'): Promise<Response> {
    let res: Response;
    const base = await this.node();
    try {
      res = await this.fetchImpl(`${base}${path}`, {
        ...init,
        headers: this.headers(credential, init.headers as Record<string, string>),
      });
    } catch (e) {
      if ((e as Error).name === 'AbortError') throw e;
      // With several nodes, the next call picks again.
      this.picked = null;
      throw connectionError(base, e);
    }
    if (!res.ok) throw await responseError(res);
    return res;
  }

  private async json<T>(path: string, body?: unknown): Promise<T> {
    const init: RequestInit =
      body === undefined
        ? {}
        : { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) };
    return (await (await this.request(path, init)).json()) as T;
  }

  /**
   * The `models` array of `GET /v1/models`: the registered models and the catalog models not yet used (see {@link
   * modelList}).
   */
  async models(): Promise<ModelStatus[]> {
    return (await this.modelList()).models;
  }

  /**
   * `GET /v1/models` as it is: `models`, and `failed_models` (configured models that failed to load, with the error).
   */
  modelList(): Promise<{ models: ModelStatus[]; failed_models: { id: string; error: string }[] }> {
    return this.json('/v1/models');
  }

  /** `GET /v1/models/{id}`. @throws VoxClientError `not_found`. */
  model(id: string): Promise<ModelStatus> {
    return this.json(`/v1/models/${encodeURIComponent(id)}`);
  }

  /**
   * `POST /v1/models/load`: registers and loads a model, or reconfigures an existing id with the
   * given fields. Needs the server's management routes (`forbidden` otherwise).
   */
  load(config: {
    id: string;
    task?: string;
    path?: string;
    [field: string]: unknown;
  }): Promise<{ id: string; loaded: true; reconfigured: boolean }> {
    return this.json('/v1/models/load', config);
  }

  /** `POST /v1/models/unload`; `force` does not wait for running work (streams close 1012). */
  unload(id: string, opts: { force?: boolean } = {}): Promise<{ id: string; loaded: false }> {
    return this.json('/v1/models/unload', { id, ...(opts.force ? { force: true } : {}) });
  }

  /** `POST /v1/models/unload_many`: idle models first; `not_found` lists the ids that do not exist. */
  unloadMany(ids: string[]): Promise<{ unloaded: string[]; not_found: string[] }> {
    return this.json('/v1/models/unload_many', { ids });
  }

  /** `POST /v1/models/unload_all`: every registered model. */
  unloadAll(): Promise<{ unloaded: string[] }> {
    return this.json('/v1/models/unload_all', {});
  }

  /**
   * `POST /v1/tasks/run`: one file in, its result out. The bytes are sent as they are (WAV or a
   * compressed format the server accepts); with `options`, as JSON with the audio in base64.
   * With `onProgress`, asks for server-sent progress events (`Accept: text/event-stream`).
   * A refusal the server gives before it reads the body (413, 401, 415, ...) is thrown as that
   * answer, not as a connection error: under Node the body waits for the server's `100 Continue`.
   * @throws VoxClientError with the wire type (`not_found`, `invalid_request_error`,
   *   `payload_too_large`, `unauthorized`, `server_busy`, ...) and the HTTP `status`.
   */
  async run(audio: AudioInput, opts: RunOptions): Promise<TaskResult> {
    const bytes = await bytesOf(audio);
    const accept = opts.onProgress ? 'text/event-stream' : 'application/json';
    let path = '/v1/tasks/run';
    let init: RequestInit;
    if (opts.options) {
      init = {
        headers: { 'content-type': 'application/json', accept },
        body: JSON.stringify({
          model: opts.model,
          audio: base64(bytes),
          options: opts.options,
          busy_timeout_ms: opts.busyTimeoutMs,
          denoise: opts.denoise,
        }),
      };
    } else {
      const q = new URLSearchParams({ model: opts.model });
      if (opts.busyTimeoutMs !== undefined) q.set('busy_timeout_ms', String(opts.busyTimeoutMs));
      if (opts.denoise !== undefined) q.set('denoise', opts.denoise);
      path += `?${q}`;
      const type =
        opts.contentType ??
        (isRiff(bytes) ? 'audio/wav' : (audio instanceof Blob && audio.type) || 'application/octet-stream');
      init = { headers: { 'content-type': type, accept }, body: bytes as BodyInit };
    }
    const res = await this.request(path, { ...init, method: 'POST', signal: opts.signal }, 'apiKey');
    if (!(res.headers.get('content-type') ?? '').startsWith('text/event-stream'))
      return (await res.json()) as TaskResult;
    for await (const { event, data } of sseEvents(res)) {
      if (event === 'progress') opts.onProgress?.(data as Progress);
      else if (event === 'result') return data as TaskResult;
      else if (event === 'error') throw sseError(data);
    }
    throw new VoxClientError('connection_error', 'the progress stream ended without a result');
  }

  /**
   * `POST /v1/tasks/run` on a denoise model (default `rnnoise`): the file denoised, as the bytes
   * of a 16-bit mono WAV file at the input's rate or at `sampleRate` (docs/http-api.md).
   * @throws VoxClientError for a refused request (its wire type: `invalid_request_error`, ...).
   */
  async denoise(
    audio: AudioInput,
    opts: {
      model?: string;
      sampleRate?: number;
      busyTimeoutMs?: number;
      contentType?: string;
      signal?: AbortSignal;
    } = {},
  ): Promise<Uint8Array> {
    const bytes = await bytesOf(audio);
    const q = new URLSearchParams({ model: opts.model ?? 'rnnoise' });
    if (opts.sampleRate !== undefined) q.set('sample_rate', String(opts.sampleRate));
    if (opts.busyTimeoutMs !== undefined) q.set('busy_timeout_ms', String(opts.busyTimeoutMs));
    const type =
      opts.contentType ??
      (isRiff(bytes) ? 'audio/wav' : (audio instanceof Blob && audio.type) || 'application/octet-stream');
    const res = await this.request(
      `/v1/tasks/run?${q}`,
      {
        method: 'POST',
        headers: { 'content-type': type, accept: 'audio/wav' },
        body: bytes as BodyInit,
        signal: opts.signal,
      },
      'apiKey',
    );
    // A model that is not a denoise model answers its JSON result: not audio, so not returned as if it were.
    if (!/^audio\/wav\b/.test(res.headers.get('content-type') ?? ''))
      throw new VoxClientError(
        'invalid_request_error',
        `model: '${opts.model ?? 'rnnoise'}' is not a denoise model (it answered ${res.headers.get('content-type')}, not audio): denoised audio comes from a denoise model such as rnnoise`,
      );
    return new Uint8Array(await res.arrayBuffer());
  }

  /**
   * `POST /v1/tasks/batch`: up to 256 files under one lease; yields each file's `result` (or its
   * `error`) as it finishes, then `done`.
   * @throws VoxClientError for a refused request, or when the batch is cut off (e.g. `shutting_down`).
   */
  async *batch(
    files: AudioInput[],
    opts: { model: string; options?: Record<string, unknown>; busyTimeoutMs?: number; signal?: AbortSignal },
  ): AsyncGenerator<BatchEvent> {
    const encoded = await Promise.all(files.map(async (f) => base64(await bytesOf(f))));
    const body = JSON.stringify({
      model: opts.model,
      files: encoded,
      options: opts.options,
      busy_timeout_ms: opts.busyTimeoutMs,
    });
    const res = await this.request(
      '/v1/tasks/batch',
      {
        method: 'POST',
        headers: { 'content-type': 'application/json', accept: 'text/event-stream' },
        body,
        signal: opts.signal,
      },
      'apiKey',
    );
    for await (const { event, data } of sseEvents(res)) {
      const d = data as Record<string, unknown>;
      if (event === 'error' && typeof d.index !== 'number') throw sseError(d);
      yield { type: event, ...d } as BatchEvent;
      if (event === 'done') return;
    }
  }

  /**
   * Opens a live stream (`GET /v1/stream`) and resolves once the server sent `ready` (the stream
   * holds its lease and the model is loaded).
   * @throws VoxClientError when the stream is refused (`not_found` for an unknown model,
   *   `invalid_request_error` for bad parameters, `unauthorized` without a valid `apiKey`,
   *   `server_busy`, `connection_error`; a browser is not told the status of a refused
   *   handshake, so there a 401 or 403 is a `connection_error` too);
   *   TypeError when there is no WebSocket constructor.
   */
  async stream(opts: StreamOptions): Promise<VoxStream> {
    if (!this.WS)
      throw new TypeError(
        'no WebSocket: pass { WebSocket } (e.g. from the ws package), or import voxserve/client under Node',
      );
    const q = new URLSearchParams({ model: opts.model });
    // Only the format the caller gives: a WAV header the stream receives (`sendFile`) sets the rest.
    if (opts.sampleRate !== undefined) q.set('sample_rate', String(opts.sampleRate));
    if (opts.encoding !== undefined) q.set('encoding', opts.encoding);
    if (opts.channels !== undefined) q.set('channels', String(opts.channels));
    if (opts.busyTimeoutMs !== undefined) q.set('busy_timeout_ms', String(opts.busyTimeoutMs));
    for (const [k, v] of Object.entries(opts.options ?? {})) q.set(k, String(v));
    if (opts.scores) q.set('scores', 'true');
    if (typeof opts.probabilities === 'number') q.set('probability_interval_ms', String(opts.probabilities));
    else if (opts.probabilities) q.set('probabilities', 'true');
    const resume = opts.resume ?? this.urls.length > 1;
    if (resume) {
      q.set('progress', 'true');
      q.set('checkpoints', 'true');
    }
    const open = (base: string, offsetMs: number, checkpoint?: string): WebSocketLike => {
      if (offsetMs && !checkpoint) q.set('offset_ms', String(offsetMs));
      else q.delete('offset_ms');
      if (checkpoint) q.set('resume_from', checkpoint);
      else q.delete('resume_from');
      const url = `${base.replace(/^http/, 'ws')}/v1/stream?${q}`;
      const auth = this.apiKey ? this.streamCredentials(this.apiKey) : { protocols: [] };
      const wsOptions = {
        ...(auth.headers ? { headers: auth.headers } : {}),
        ...(this.heartbeatMs ? { handshakeTimeout: this.heartbeatMs } : {}),
      };
      return new this.WS!(
        url,
        [SUBPROTOCOL[opts.protocol ?? 'json'], ...auth.protocols],
        Object.keys(wsOptions).length ? wsOptions : undefined,
      );
    };
    let plan: ResumePlan | undefined;
    if (resume) {
      const o = typeof resume === 'object' ? resume : {};
      const bufferMs = o.bufferMs ?? DEFAULT_RESUME_BUFFER_MS;
      const timeoutMs = o.timeoutMs ?? DEFAULT_RESUME_TIMEOUT_MS;
      for (const [name, v, min] of [
        ['resume.bufferMs', bufferMs, MIN_RESUME_BUFFER_MS],
        ['resume.timeoutMs', timeoutMs, 0],
      ] as const)
        if (typeof v !== 'number' || !(v >= min) || v > 2_147_483_647)
          throw new TypeError(`${name}: a number of ms from ${min} to 2147483647, got ${String(v)}`);
      plan = {
        bufferMs,
        timeoutMs,
        sampleRate: opts.sampleRate ?? 16000,
        frameBytes: (opts.channels ?? 1) * (opts.encoding === 'f32le' ? 4 : 2),
        reopen: async (offsetMs, refused, checkpoint) => {
          // The node in use went away: pick again among `urls`, the nodes that refused this resume last.
          if (this.urls.length > 1)
            this.picked = this.firstReady([
              ...this.urls.filter((u) => !refused.has(u)),
              ...this.urls.filter((u) => refused.has(u)),
            ]);
          const base = await this.node();
          return { ws: open(base, offsetMs, checkpoint), url: base };
        },
      };
    }
    const base = await this.node();
    const stream = new VoxStream(open(base, 0), base, opts.highWaterMark ?? 256 * 1024, this.heartbeatMs, plan);
    try {
      await stream.opened;
    } catch (e) {
      if (e instanceof VoxClientError && e.type === 'connection_error') this.picked = null;
      throw e;
    }
    return stream;
  }
}

type Listener = (e: never) => void;

/**
 * How a stream resumes on another node (see {@link StreamOptions.resume}); made by
 * {@link VoxClient.stream}. @internal
 */
export interface ResumePlan {
  /** Written, unconfirmed audio past which `send` waits for a `progress`, ms of the stream's audio. */
  bufferMs: number;
  /** How long to try nodes before the stream fails, ms. */
  timeoutMs: number;
  /** Frames per second of the PCM sent (`sampleRate`). */
  sampleRate: number;
  /** Bytes per frame: channels x 2 (s16le) or 4 (f32le). */
  frameBytes: number;
  /**
   * Opens the stream again on a node answering `/ready` (the nodes in `refused`, which refused this
   * resume, last): its clock starting at `offsetMs`, or from `checkpoint` (`resume_from`, whose clock it is).
   * @throws VoxClientError when no node answers.
   */
  reopen(
    offsetMs: number,
    refused: ReadonlySet<string>,
    checkpoint?: string,
  ): Promise<{ ws: WebSocketLike; url: string }>;
}

/**
 * Close codes after which a stream with `resume` tries another node: the server went away or the connection dropped.
 */
const RESUMABLE_CLOSE = new Set<number>([CLOSE.GOING_AWAY, CLOSE.ABNORMAL]);

/** A resume under way: where the new session starts, and what is reported once it does. */
interface Resuming {
  previousUrl: string;
  /** Where the new session's audio starts: byte of the PCM sent, and ms on the stream's clock. */
  byte: number;
  ms: number;
  /** The checkpoint at `ms` the new session goes on from (`resume_from`), or none (a fresh session at `ms`). */
  checkpoint?: string;
  gap: { start_ms: number; end_ms: number };
  deadline: number;
  /** Ends the resume at `deadline`, whatever the attempt under way is doing. */
  timer: ReturnType<typeof setTimeout>;
  /** The error of the last failed attempt. */
  error: VoxClientError;
  /** Nodes that refused an attempt (a handshake refused, or closed before `ready`): tried last. */
  refused: Set<string>;
}

const greatestCommonDivisor = (a: number, b: number): number => (b ? greatestCommonDivisor(b, a % b) : a);

/**
 * One live stream. Events come as an async iterator (`for await (const e of stream)`, from
 * `ready` to `done`; it throws the stream's VoxClientError if the stream fails) and as callbacks
 * (`on`). Events wait in memory until the iterator reads them.
 *
 * With a {@link ResumePlan} (`resume`), the stream outlives its connection: when the node goes
 * away (the connection drops, close 1001, or the heartbeat fails), it opens the stream again on a
 * node answering `/ready` from the last checkpoint (`resume_from`: a VAD stream's `progress`
 * carries one, the model's state included) or else with `offset_ms` at the audio the old one had
 * confirmed (`progress` events), re-sends the audio sent since, and reports the gap as a
 * `resumed` event. Events are handed on once a `progress` (or `done`) after them confirms them, so
 * an event whose confirmation was lost with the node is said once, by the new session.
 */
export class VoxStream implements AsyncIterable<StreamEvent> {
  /** The `ready` event (of the first session; a resumed one's is in its `resumed` event). */
  ready!: StreamEventOf<'ready'>;
  /** Resolves once `ready` came; rejects if the stream closed before. */
  readonly opened: Promise<void>;
  /** Resolves when the stream closed for good, with the code and, for a failure, the error. Never rejects. */
  readonly closed: Promise<CloseInfo>;
  private ws!: WebSocketLike;
  private url: string;
  private readonly queue: StreamEvent[] = [];
  private wake: (() => void) | null = null;
  private readonly listeners = new Map<string, Set<Listener>>();
  private last: StreamEvent | null = null;
  private doneEvent: StreamEventOf<'done'> | null = null;
  private info: CloseInfo | null = null;
  private tail: Promise<void> = Promise.resolve();
  private waiting = 0;
  private closedByUs = false;
  /** The socket's last `error` event; under Node a refused handshake's answer is in `error.body`. */
  private socketError: { message?: string; error?: { code?: string; body?: string } } | null = null;
  /** The heartbeat's verdict: the server did not answer a ping in time (the socket's error). */
  private silent: VoxClientError | null = null;
  /** The current socket's session sent `ready` and has not closed. */
  private connected = false;
  private readonly markOpened: () => void;
  private readonly markRefused: (e: VoxClientError) => void;
  private readonly markClosed: (c: CloseInfo) => void;
  // With `resume` only:
  /** Events received since the last confirmation (`progress`, `done`). */
  private held: StreamEvent[] = [];
  /** The stream's clock up to which the server has processed the audio, ms. */
  private confirmedMs = 0;
  /** The last checkpoint a `progress` carried (VAD), and the ms it is at. */
  private checkpoint: { ms: number; text: string } | null = null;
  /**
   * After a resume from a checkpoint before the confirmed audio: the events of the new session up to this ms were
   * handed on already (from the old one), and are dropped.
   */
  private repeatedUpToMs = -1;
  /** Bytes of PCM given to `send`, and written to the current socket. */
  private given = 0;
  private written = 0;
  /** The PCM not yet confirmed (copied), from byte `start` of the stream. */
  private chunks: { data: Uint8Array; start: number }[] = [];
  /** `end()` was called; the socket its frame was written to. */
  private ending = false;
  private endSentOn: WebSocketLike | null = null;
  /** The `done` of the current session, until its close says whether it is the last. */
  private pendingDone: StreamEventOf<'done'> | null = null;
  private resuming: Resuming | null = null;
  /**
   * ms per step at which a whole number of frames starts (1 at 16 kHz, 10 at 44.1 kHz) and, once `ready` named the
   * model's window (`window_ms`), a window starts too (32 for Silero VAD at 16 kHz): a resume starts on it. Its bytes.
   */
  private gridMs = 1;
  private gridBytes = 0;

  /** @internal use {@link VoxClient.stream}. */
  constructor(
    ws: WebSocketLike,
    url: string,
    /** Bytes the socket may hold unsent before `send` waits. */
    readonly highWaterMark: number,
    /** Ping interval and answer deadline, ms; 0 = none (see {@link ClientOptions.heartbeatMs}). */
    private readonly heartbeatMs = 0,
    private readonly plan?: ResumePlan,
  ) {
    this.url = url;
    let opened!: () => void;
    let refused!: (e: VoxClientError) => void;
    this.opened = new Promise((resolve, reject) => ((opened = resolve), (refused = reject)));
    this.opened.catch(() => {});
    this.markOpened = opened;
    this.markRefused = refused;
    let closed!: (c: CloseInfo) => void;
    this.closed = new Promise((resolve) => (closed = resolve));
    this.markClosed = closed;
    if (plan) {
      this.gridMs = 1000 / greatestCommonDivisor(plan.sampleRate, 1000);
      this.gridBytes = ((this.gridMs * plan.sampleRate) / 1000) * plan.frameBytes;
    }
    this.attach(ws);
  }

  /** Makes `ws` the stream's socket: its events are the stream's from now on (those of an earlier one are ignored). */
  private attach(ws: WebSocketLike): void {
    this.ws = ws;
    this.last = null;
    this.socketError = null;
    this.silent = null;
    this.connected = false;
    ws.binaryType = 'arraybuffer';
    ws.addEventListener('message', (m: { data: string | ArrayBuffer }) => {
      if (ws !== this.ws) return;
      let event: StreamEvent;
      try {
        event = (
          typeof m.data === 'string'
            ? JSON.parse(m.data)
            : ws.protocol === SUBPROTOCOL.msgpack
              ? unpack(new Uint8Array(m.data))
              : { type: 'audio', data: new Uint8Array(m.data) }
        ) as StreamEvent;
      } catch (e) {
        // Not an event of this protocol: the stream fails with server_error.
        this.last = {
          type: 'error',
          error: { type: 'server_error', message: `undecodable event frame: ${(e as Error).message}` },
        };
        return ws.close(CLOSE.PROTOCOL_ERROR, 'undecodable event frame');
      }
      this.last = event;
      this.received(event);
    });
    ws.addEventListener('error', (e: { message?: string; error?: { code?: string; body?: string } }) => {
      if (ws === this.ws) this.socketError = e;
    });
    const stopHeartbeat = this.heartbeat(ws, this.heartbeatMs);
    ws.addEventListener('close', (c: { code: number; reason: string }) => {
      stopHeartbeat();
      if (ws === this.ws) this.socketClosed(c);
    });
  }

  /** An event from the current socket. */
  private received(event: StreamEvent): void {
    if (event.type === 'ready') {
      this.connected = true;
      if (this.resuming) return this.resumed(event);
      if (this.plan) this.onWindowGrid(event.window_ms);
      this.ready = event;
      this.markOpened();
      return this.deliver(event);
    }
    if (!this.plan) {
      if (event.type === 'done') this.doneEvent = event;
      return this.deliver(event);
    }
    switch (event.type) {
      case 'progress':
        if (event.checkpoint) this.checkpoint = { ms: event.processed_ms, text: event.checkpoint };
        if (event.processed_ms <= this.repeatedUpToMs) {
          // Said already, by the session before the resume.
          this.held = [];
          return;
        }
        this.confirm(event.processed_ms);
        return this.deliver(event);
      case 'done':
        // The last event, or a draining node's (close 1001 follows): the socket's close tells.
        if (event.checkpoint) this.checkpoint = { ms: event.processed_ms, text: event.checkpoint };
        this.confirm(event.processed_ms);
        this.pendingDone = event;
        return;
      case 'error':
        // A resume attempt refused before its `ready` (a node with no holder yet, busy): the close that
        // follows decides whether another attempt comes; the application sees it only if the resume fails.
        if (this.resuming && !this.connected) return;
        // A bad control frame's (the stream goes on), or the reason of the close that follows: in order.
        for (const e of this.held.splice(0)) this.deliver(e);
        return this.deliver(event);
      default:
        this.held.push(event);
    }
  }

  /**
   * Puts the resume grid on the model's windows of `windowMs` (a whole number of ms; a server before `window_ms`
   * sends none, and the grid stays on whole samples): the least multiple of both.
   */
  private onWindowGrid(windowMs: number | undefined): void {
    if (!windowMs || !Number.isInteger(windowMs) || windowMs < 1) return;
    const times = windowMs / greatestCommonDivisor(this.gridMs, windowMs);
    this.gridMs *= times;
    this.gridBytes *= times;
  }

  /**
   * The server processed the audio up to `ms` on the stream's clock: the events before are handed on, the audio before
   * is let go.
   */
  private confirm(ms: number): void {
    this.confirmedMs = ms;
    for (const e of this.held.splice(0)) this.deliver(e);
    const upTo = Math.min(Math.floor(ms / this.gridMs) * this.gridBytes, this.written);
    let n = 0;
    while (n < this.chunks.length && this.chunks[n].start + this.chunks[n].data.byteLength <= upTo) n++;
    if (n) this.chunks.splice(0, n);
    // A frame confirmed in part keeps its rest only: a frame longer than bufferMs must not hold `send` back.
    const c = this.chunks[0];
    if (c && c.start < upTo) this.chunks[0] = { data: c.data.subarray(upTo - c.start), start: upTo };
  }

  private deliver(event: StreamEvent): void {
    this.queue.push(event);
    this.notify(event.type, event);
  }

  /** The current socket closed: the end of the stream, or (with `resume`) a resume, or the next attempt of one. */
  private socketClosed(c: { code: number; reason: string }): void {
    // Already over (a resume that timed out drops its attempt).
    if (this.info) return;
    const wasReady = this.connected;
    this.connected = false;
    const done = this.pendingDone;
    this.pendingDone = null;
    if (this.plan && !this.closedByUs) {
      // The node that drained has processed every sample sent: its done is the stream's.
      const finished =
        done && (c.code === CLOSE.NORMAL || (this.ending && done.processed_ms >= this.msOf(this.given) - 1));
      if (this.resuming && !wasReady) {
        const error = this.silent ?? this.failure(c.code, c.reason, false);
        this.resuming.error = error;
        this.resuming.refused.add(this.url);
        if (retryable(error) && Date.now() < this.resuming.deadline) return void this.retry();
        const failed = retryable(error) ? this.resumeFailed(this.resuming) : error;
        return this.finish({ code: c.code, reason: c.reason, error: failed });
      }
      // A stream that never opened fails as without `resume` (the client picked a node that answered /ready).
      if (this.ready && !finished && (this.silent || RESUMABLE_CLOSE.has(c.code))) return this.resume();
      if (done) this.doneEvent = done;
    }
    const info: CloseInfo = { code: c.code, reason: c.reason };
    if (this.silent) info.error = this.silent;
    else if (!this.doneEvent && !this.closedByUs) info.error = this.failure(c.code, c.reason, !this.ready);
    this.finish(info, this.doneEvent && this.plan ? this.doneEvent : undefined);
  }

  /** The stream is over: held events (and a last `done`) are handed on, then the close. */
  private finish(info: CloseInfo, done?: StreamEventOf<'done'>): void {
    if (this.info) return;
    for (const e of this.held.splice(0)) this.deliver(e);
    if (done) this.deliver(done);
    this.info = info;
    if (this.resuming) clearTimeout(this.resuming.timer);
    this.resuming = null;
    if (info.error) this.markRefused(info.error);
    this.notify('close', info);
    this.markClosed(info);
  }

  /** ms on the stream's clock of byte `b` of the PCM sent. */
  private msOf(b: number): number {
    return (b / this.plan!.frameBytes / this.plan!.sampleRate) * 1000;
  }

  /**
   * The node went away: starts a resume from the confirmed audio (the held events are dropped: the new session says
   * them again).
   */
  private resume(): void {
    const plan = this.plan!;
    this.held = [];
    const head = this.chunks[0]?.start ?? this.given;
    // At the last step of the grid (whole frames, and the model's windows) at or before the confirmed ms.
    const k = Math.max(Math.floor(this.confirmedMs / this.gridMs), Math.ceil(head / this.gridBytes));
    let byte = Math.max(head, Math.min(k * this.gridBytes, this.given));
    let ms = k * this.gridMs;
    // From the last checkpoint, when its audio is still here and starts on a whole frame: the new session goes on
    // exactly as the old one would have.
    const cp = this.checkpoint;
    const frames = cp ? (cp.ms * plan.sampleRate) / 1000 : Number.NaN;
    const fromCheckpoint =
      cp !== null &&
      Number.isInteger(frames) &&
      frames * plan.frameBytes >= head &&
      frames * plan.frameBytes <= this.given;
    if (fromCheckpoint) {
      byte = frames * plan.frameBytes;
      ms = cp.ms;
    }
    this.repeatedUpToMs = fromCheckpoint ? this.confirmedMs : -1;
    const sentMs = Math.round(this.msOf(this.given));
    this.resuming = {
      previousUrl: this.url,
      byte,
      ms,
      checkpoint: fromCheckpoint ? cp.text : undefined,
      gap: { start_ms: this.confirmedMs, end_ms: Math.max(sentMs, this.confirmedMs) },
      deadline: Date.now() + plan.timeoutMs,
      timer: setTimeout(() => this.resumeExpired(), plan.timeoutMs),
      error: new VoxClientError('connection_error', `the stream on ${this.url} was lost`),
      // The node that went away is tried after the others.
      refused: new Set([this.url]),
    };
    void this.retry(true);
  }

  /**
   * The resume's `timeoutMs` has passed: the stream fails, and the attempt under way (a look-up or a handshake
   * that a frozen node never answers) is dropped.
   */
  private resumeExpired(): void {
    if (!this.resuming || this.info) return;
    const attempt = this.ws;
    this.finish({ code: CLOSE.ABNORMAL, reason: '', error: this.resumeFailed(this.resuming) });
    if (attempt.terminate) attempt.terminate();
    else attempt.close(CLOSE.NORMAL, 'resume timed out');
  }

  /** One attempt to open the stream on a node (after a pause, but for the first). */
  private async retry(first = false): Promise<void> {
    const r = this.resuming!;
    if (!first) await new Promise((res) => setTimeout(res, 250));
    while (!this.closedByUs && !this.info) {
      try {
        const { ws, url } = await this.plan!.reopen(r.ms, r.refused, r.checkpoint);
        if (this.closedByUs || this.info) {
          // Not attached: its handshake's error would have no listener.
          ws.addEventListener('error', () => {});
          return ws.close(CLOSE.NORMAL, 'client closed');
        }
        this.url = url;
        return this.attach(ws);
      } catch (e) {
        r.error = e instanceof VoxClientError ? e : new VoxClientError('connection_error', String(e), { cause: e });
      }
      if (Date.now() >= r.deadline) break;
      await new Promise((res) => setTimeout(res, 250));
    }
    this.finish({ code: CLOSE.ABNORMAL, reason: '', error: this.resumeFailed(r) });
  }

  private resumeFailed(r: Resuming): VoxClientError {
    return new VoxClientError(
      r.error.type,
      `the stream on ${r.previousUrl} was lost and could not be resumed within ${this.plan!.timeoutMs} ms: ${r.error.message}`,
      { closeCode: r.error.closeCode, status: r.error.status, code: r.error.code, cause: r.error },
    );
  }

  /** The new session is ready: say so, and send it the audio from where it starts. */
  private resumed(ready: StreamEventOf<'ready'>): void {
    const r = this.resuming!;
    this.resuming = null;
    clearTimeout(r.timer);
    const end = Math.max(r.gap.end_ms, r.ms);
    this.deliver({
      type: 'resumed',
      url: this.url,
      previous_url: r.previousUrl,
      session_id: ready.session_id,
      gap: r.gap,
      resent: { start_ms: r.ms, end_ms: end },
      dropped: r.ms > r.gap.start_ms ? { start_ms: r.gap.start_ms, end_ms: Math.min(r.ms, end) } : null,
    });
    this.confirmedMs = r.ms;
    this.written = r.byte;
    this.writeUpTo(this.given);
    if (this.ending) this.writeEnd();
  }

  /**
   * Pings the server on `ws` every `ms` once it is open; when a whole interval after a ping
   * passes with nothing from the server (no pong, no ping, no event), the socket is dropped and it
   * fails with `connection_error` `heartbeat_timeout`. A no-op (returns a no-op) when `ms`
   * is 0 or the WebSocket cannot ping (a browser's). @returns what stops it.
   */
  private heartbeat(ws: WebSocketLike, ms: number): () => void {
    if (!ms || typeof ws.ping !== 'function' || typeof ws.on !== 'function') return () => {};
    /** A ping is out and nothing has come from the server since. */
    let waiting = false;
    let timer: ReturnType<typeof setInterval> | null = null;
    const heard = (): void => void (waiting = false);
    ws.on('pong', heard);
    // A server that has paused reading (backpressure) cannot read our pings, but pings us (its beacon).
    ws.on('ping', heard);
    ws.addEventListener('message', heard);
    ws.addEventListener('open', () => {
      timer = setInterval(() => {
        if (this.info || ws !== this.ws || this.silent) return;
        if (!waiting) {
          waiting = true;
          try {
            ws.ping!();
          } catch {
            // Not open any more: its close event follows.
          }
          return;
        }
        // Closed by the caller: it ends without an error, only sooner.
        if (!this.closedByUs)
          this.silent = new VoxClientError(
            'connection_error',
            `no answer from ${this.url} for ${ms} ms after a ping (heartbeatMs): the server is frozen or unreachable`,
            { code: 'heartbeat_timeout' },
          );
        if (ws.terminate) ws.terminate();
        else ws.close(4000, 'heartbeat timeout');
      }, ms);
    });
    return () => {
      if (timer) clearInterval(timer);
    };
  }

  /**
   * The error a close stands for: the `error` event just before it, else the handshake's HTTP
   * status, else the close code. `handshake`: the socket never opened a session (`ready`).
   */
  private failure(code: number, reason: string, handshake: boolean): VoxClientError {
    if (this.last?.type === 'error')
      return new VoxClientError(this.last.error.type, this.last.error.message, {
        closeCode: code,
        code: this.last.error.code,
      });
    const status = /Unexpected server response: (\d+)/.exec(this.socketError?.message ?? '')?.[1];
    if (status) {
      const error = wireError(this.socketError?.error?.body ?? '');
      return new VoxClientError(
        error.type ?? typeOfStatus(Number(status)),
        error.message ?? `the server refused the stream: HTTP ${status}`,
        { status: Number(status), closeCode: code, code: error.code },
      );
    }
    if (code === CLOSE.ABNORMAL && handshake) {
      const sys = this.socketError?.error?.code;
      // The system code (ECONNREFUSED, ...), else what the socket said (`ws`: 'Opening handshake has timed out').
      const why = sys ?? this.socketError?.message;
      return new VoxClientError('connection_error', `cannot reach ${this.url}${why ? `: ${why}` : ''}`, {
        closeCode: code,
        code: sys,
      });
    }
    return new VoxClientError(CLOSE_TYPE[code] ?? 'server_error', reason || `stream closed ${code}`, {
      closeCode: code,
    });
  }

  private notify(type: string, payload: unknown): void {
    for (const fn of this.listeners.get(type) ?? []) (fn as (p: unknown) => void)(payload);
    this.wake?.();
  }

  /** Calls `fn` for each event of this type (`close` with {@link CloseInfo} when the stream closes for good). */
  on<T extends StreamEvent['type']>(type: T, fn: (e: StreamEventOf<T>) => void): this;
  on(type: 'close', fn: (c: CloseInfo) => void): this;
  on(type: string, fn: Listener): this {
    if (!this.listeners.has(type)) this.listeners.set(type, new Set());
    this.listeners.get(type)!.add(fn);
    return this;
  }

  /** Removes a callback added with `on`. */
  off(type: string, fn: Listener): this {
    this.listeners.get(type)?.delete(fn);
    return this;
  }

  /** Bytes the socket holds unsent. */
  get bufferedAmount(): number {
    return this.ws.bufferedAmount;
  }

  /** The server the stream is on (with `resume`, the node it resumed on). */
  get serverUrl(): string {
    return this.url;
  }

  /**
   * Under Node (the `voxserve/client` entry sets it): reads a file by its path, for
   * {@link VoxStream.sendFile}. Browsers have no paths: give them the bytes or a Blob (a File).
   */
  static readPath?: (path: string) => Promise<Uint8Array>;

  /**
   * Sends a whole audio file in frames of 64 KiB, each awaited as {@link VoxStream.send} is. A WAV
   * file (PCM 8/16/24/32-bit, float, mu-law or A-law; any rate and channel count) goes header
   * included: the server reads the header and takes the stream's format from it, so open the
   * stream without `sampleRate`, `encoding` and `channels` (given ones that the header
   * contradicts fail the stream, saying so). A compressed file the server decodes (Ogg Opus, Ogg
   * Vorbis, FLAC, WebM/Opus, MP3 with an ID3 tag) goes as it is: the server keeps it until `end()`
   * and decodes it whole then, as `run` does, so its events come after `end()` (the stream's
   * format options do not apply to it). Call `end()` after it for the `done`.
   * @param file a path (under Node), or the file's bytes or Blob.
   * @throws VoxClientError `invalid_request_error` when the bytes are neither a WAV file nor a
   *   compressed file the stream takes (an MP3 without an ID3 tag, or another format, is named:
   *   send it with {@link VoxClient.run}), or, on a stream with `resume`, when the file is
   *   compressed (a resumed stream re-sends samples, and a compressed file cannot be cut) or its
   *   WAV header's format is not the one the stream was opened with; as `send` once the stream has closed.
   */
  async sendFile(file: string | AudioInput): Promise<void> {
    let bytes: Uint8Array;
    if (typeof file === 'string') {
      if (!VoxStream.readPath)
        throw new TypeError('sendFile(path) needs Node (voxserve/client): in a browser give the bytes or a Blob');
      bytes = await VoxStream.readPath(file);
    } else bytes = await bytesOf(file);
    const header = wavHeader(bytes);
    const looks = header ? null : compressedName(bytes);
    const whole = looks !== null && STREAM_FILES.includes(looks) && (looks !== 'MP3' || text(bytes, 0, 3) === 'ID3');
    if (!header && !whole)
      throw new VoxClientError(
        'invalid_request_error',
        looks
          ? `this looks like ${looks === 'MP3' ? 'MP3 without an ID3 tag' : looks}: a stream takes WAV, Ogg, FLAC, WebM, MP3 with an ID3 tag or raw PCM; send it with run() (POST /v1/tasks/run decodes it), or convert it to WAV`
          : `not a WAV file (it starts with ${hex(bytes.subarray(0, 4))}); a stream takes WAV, Ogg, FLAC, WebM, MP3 or raw PCM (send)`,
      );
    if (whole && this.plan)
      throw new VoxClientError(
        'invalid_request_error',
        `sendFile on a stream with resume: ${looks} cannot be resumed part way (a resumed stream re-sends samples); send it with run(), or convert it to WAV`,
      );
    let body = bytes;
    if (this.plan && header) {
      // A resumed stream re-sends samples only: the format must be the stream's own.
      const encoding = header.tag === 1 && header.bits === 16 ? 2 : header.tag === 3 && header.bits === 32 ? 4 : 0;
      if (header.sampleRate !== this.plan.sampleRate || encoding * header.channels !== this.plan.frameBytes)
        throw new VoxClientError(
          'invalid_request_error',
          `sendFile on a stream with resume: the file is ${header.sampleRate} Hz, ${header.channels} channel(s), format ${header.tag}/${header.bits}-bit; open the stream with that sampleRate, channels and encoding (s16le or f32le)`,
        );
      body = bytes.subarray(header.dataStart, header.dataStart + header.dataBytes);
    }
    for (let off = 0; off < body.length; off += FILE_FRAME_BYTES)
      await this.send(body.subarray(off, off + FILE_FRAME_BYTES));
  }

  /**
   * Sends a frame of PCM in the stream's encoding (a frame may end mid-sample). Resolves at once
   * while the socket holds less than `highWaterMark` unsent; otherwise it waits until it drains
   * below (frames keep their order); with `resume`, also while the stream resumes on another
   * node, and while `bufferMs` of written audio waits for the server's `progress`. Await it: that
   * is what bounds memory. With `resume`, the frame is copied (kept until the server confirms
   * it), so the caller may reuse its buffer.
   * @throws VoxClientError once the stream has closed.
   */
  send(pcm: ArrayBuffer | ArrayBufferView): Promise<void> {
    if (this.info || this.closedByUs) return Promise.reject(this.afterClose());
    if (this.plan) {
      const bytes = ArrayBuffer.isView(pcm)
        ? new Uint8Array(pcm.buffer, pcm.byteOffset, pcm.byteLength)
        : new Uint8Array(pcm);
      this.chunks.push({ data: bytes.slice(), start: this.given });
      this.given += bytes.byteLength;
      const end = this.given;
      if (this.waiting === 0 && this.connected && this.ws.bufferedAmount < this.highWaterMark && this.roomToKeep()) {
        this.writeUpTo(end);
        return Promise.resolve();
      }
      return this.enqueue(() => this.writeUpTo(end), true);
    }
    if (this.waiting === 0 && this.ws.bufferedAmount < this.highWaterMark) {
      this.ws.send(pcm);
      return Promise.resolve();
    }
    return this.enqueue(() => this.ws.send(pcm));
  }

  /** Writes the kept PCM from `written` up to byte `end` to the current socket. */
  private writeUpTo(end: number): void {
    for (const c of this.chunks) {
      const cEnd = c.start + c.data.byteLength;
      if (cEnd <= this.written) continue;
      if (c.start >= end) break;
      const from = Math.max(this.written, c.start) - c.start;
      const to = Math.min(end, cEnd) - c.start;
      this.ws.send(from === 0 && to === c.data.byteLength ? c.data : c.data.subarray(from, to));
      this.written = c.start + to;
    }
  }

  /**
   * Whether the next frame may be written: the PCM written and not yet confirmed is under `bufferMs`. Every byte
   * not confirmed is kept (a resume re-sends it), so past that `send` waits for the server's `progress`.
   */
  private roomToKeep(): boolean {
    const head = this.chunks[0]?.start ?? this.written;
    return this.written - head < (this.plan!.bufferMs * this.plan!.sampleRate * this.plan!.frameBytes) / 1000;
  }

  /**
   * Why a send cannot go: the stream's failure; else, when the server closed a stream that had
   * finished (a shutdown drain ends a stream with `done`, then close 1001), that close with its
   * type (`shutting_down`, ...); else (this side closed or ended it) `invalid_request_error`.
   */
  private afterClose(): VoxClientError {
    const info = this.info;
    if (info?.error) return info.error;
    if (info && !this.closedByUs && info.code !== CLOSE.NORMAL) {
      return new VoxClientError(
        CLOSE_TYPE[info.code] ?? 'server_error',
        `the server closed the stream (${info.code}${info.reason ? `: ${info.reason}` : ''}) before all audio was sent`,
        { closeCode: info.code },
      );
    }
    return new VoxClientError('invalid_request_error', 'send after the stream closed');
  }

  /**
   * Runs `write` after every earlier waiting send, once the socket is below its high-water mark (and, with `resume`,
   * connected, and for PCM (`keeps`) once less than `bufferMs` is unconfirmed).
   */
  private enqueue(write: () => void, keeps = false): Promise<void> {
    this.waiting++;
    const p = this.tail.then(async () => {
      try {
        while (
          !this.info &&
          ((this.plan && (!this.connected || (keeps && !this.roomToKeep()))) ||
            this.ws.bufferedAmount >= this.highWaterMark)
        )
          await new Promise((r) => setTimeout(r, 10));
        if (this.info) throw this.afterClose();
        write();
      } finally {
        this.waiting--;
      }
    });
    this.tail = p.catch(() => {});
    return p;
  }

  /** Writes `{"type":"end"}` to the current socket, once. */
  private writeEnd(): void {
    if (this.endSentOn === this.ws) return;
    this.endSentOn = this.ws;
    this.ws.send('{"type":"end"}');
  }

  /**
   * Sends `{"type":"end"}` after every frame sent so far; resolves with `done` once the server
   * processed everything. @throws VoxClientError if the stream fails first.
   */
  async end(): Promise<StreamEventOf<'done'>> {
    this.ending = true;
    if (!this.info) {
      const ended = this.enqueue(() => (this.plan ? this.writeEnd() : this.ws.send('{"type":"end"}')));
      // With `resume`, a resumed session is sent `end` as it opens: its `done` may come before this turn.
      await (this.plan ? ended.catch((e) => (this.info ? undefined : Promise.reject(e))) : ended);
    }
    const info = this.info ?? (await this.closed);
    if (this.doneEvent) return this.doneEvent;
    throw (
      info.error ??
      new VoxClientError('connection_error', `stream closed ${info.code} before done`, { closeCode: info.code })
    );
  }

  /** Closes the stream from this side (no `done`); the iterator ends without an error. */
  close(code: number = CLOSE.NORMAL, reason = 'client closed'): void {
    this.closedByUs = true;
    if (this.resuming) this.finish({ code, reason });
    this.ws.close(code, reason);
  }

  async *[Symbol.asyncIterator](): AsyncGenerator<StreamEvent> {
    for (;;) {
      if (this.queue.length) {
        yield this.queue.shift()!;
        continue;
      }
      if (this.info) {
        if (this.info.error) throw this.info.error;
        return;
      }
      await new Promise<void>((r) => (this.wake = r));
      this.wake = null;
    }
  }
}

/** Whether a failed resume attempt is worth another: the node could not be reached, was busy or going away. */
const retryable = (e: VoxClientError): boolean =>
  e.type === 'connection_error' || ERROR_STATUS[e.type] === 503 || e.status === 503;
