import { fromCallback, type InspectionEvent } from 'xstate';
import { checkFormat, PcmStreamDecoder } from '../runtime/audio/audio.js';
import { OWW_ABOUT, OWW_MODELS } from '../runtime/catalog.js';
import { headsOf, type Limits, type ModelConfig } from '../runtime/config.js';
import { invalid, toVoxError, voxError } from '../runtime/errors.js';
import { spellAsId } from '../runtime/names.js';
import { createTaskSession, type TaskEvent } from '../runtime/tasks/index.js';
import { RNNOISE } from '../runtime/slots/rnnoise.js';
import { ChainLink, JobPump, leaseGranted, type Granted, type LeaseHandle } from './lease.js';
import {
  createStreamSocket,
  MAX_PENDING_SAMPLES,
  StreamChannel,
  streamResources,
  type StreamInput,
  type StreamResources,
  type StreamSocketHandle,
  type WireEvent,
  type WorkEvent,
} from './stream.js';
import type { Supervisor } from './supervisor.js';

/**
 * The Wyoming wake-word service (https://github.com/rhasspy/wyoming, README "Wake Word" and
 * "Voice Activity Detection"): a connection is a stream socket actor (actors/stream.ts: the same
 * chart, deadlines, limits and drain as a WebSocket stream) whose `work` actor speaks Wyoming:
 * `detect {names}` chooses the wake words, `audio-start {rate, width, channels}` starts an audio
 * stream (resampled to 16 kHz), `audio-chunk` carries PCM, `audio-stop` ends it; the answers are
 * `detection {name, timestamp}` as they happen, `not-detected` at `audio-stop` when none fired,
 * and `voice-started` / `voice-stopped` when `detect` also names a VAD model (`silero-vad`).
 * A connection may carry several audio streams one after another. With `wyoming.denoise` set, the
 * audio goes through that denoise model first (a {@link ChainLink} under its own lease, as a
 * WebSocket stream's `denoise=`), and every model hears the denoised audio.
 */

/** A Wyoming event as parsed by the transport: type, data (header `data` merged with the data section) and payload. */
export interface WyomingEvent {
  type: string;
  data: Record<string, unknown>;
  payload: Buffer | null;
}

/** Bytes of audio-chunk payload a connection keeps while its lease or model is not ready, before it stops reading. */
const MAX_EARLY_BYTES = 4 * 1024 * 1024;

/** The data plane of a Wyoming connection: parsed events in (beside the chart, like PCM frames on a WebSocket). */
export class WyomingChannel extends StreamChannel {
  /** The `work` actor's event handler while it runs. */
  onEvent: ((e: WyomingEvent) => void) | null = null;

  /** An event other than `describe` / `ping` (which the transport answers itself). */
  event(e: WyomingEvent): void {
    this.heardAt = performance.now();
    this.onEvent?.(e);
  }
}

/**
 * A wake-word model id as wyoming-openwakeword names its models (its `Model` values and custom
 * file stems, which Home Assistant stores and sends back in `detect`): `hey-jarvis` -> `hey_jarvis`.
 */
export function wyomingName(id: string): string {
  return id.replace(/-/g, '_');
}

/** wyoming-openwakeword's `_get_phrase` (handler.py): `hey_jarvis` -> `Hey Jarvis`. */
function wyomingPhrase(name: string): string {
  return name
    .toLowerCase()
    .trim()
    .replace(/_/g, ' ')
    .split(/\s+/)
    .filter(Boolean)
    .map((w) => w[0].toUpperCase() + w.slice(1))
    .join(' ');
}

/**
 * The models a `detect` asks for: the wake-word model id (one id; a configured group asked for
 * alone is that group; else the heads of every name, `a,b` sorted; all wake models when `names`
 * is empty), a VAD model when one is named, and the name each head was asked by (a detection
 * carries it back, as wyoming-openwakeword's does).
 * @throws VoxError `not_found` naming an unknown name; `invalid_request_error` for a non-array or a second VAD model.
 */
export function resolveNames(
  registry: Supervisor,
  names: unknown,
): { wake: string | null; vad: string | null; asked: Map<string, string> } {
  if (names !== undefined && names !== null && (!Array.isArray(names) || !names.every((n) => typeof n === 'string')))
    throw invalid('detect.names', 'must be a list of strings');
  const wanted = (names as string[] | undefined | null) ?? [];
  const wake = new Set<string>();
  const asked = new Map<string, string>();
  const wakeIds = new Set<string>();
  let vad: string | null = null;
  for (const raw of wanted) {
    const id = registry.configOf(raw) ? raw : spellAsId(raw);
    const config = registry.configOf(id);
    if (!config)
      throw voxError('model_not_found', { id: raw, field: 'detect.names', hint: 'describe lists the wake words' });
    if (config.task !== 'vad' && config.task !== 'wakeword')
      throw invalid('detect.names', `'${raw}' is a ${config.task} model; detect takes wake-word and VAD models`);
    if (config.task === 'vad') {
      if (vad && vad !== id) throw invalid('detect.names', 'at most one VAD model');
      vad = id;
      continue;
    }
    wakeIds.add(id);
    if (config.heads) for (const h of config.heads) wake.add(typeof h === 'string' ? h : h.model);
    else {
      wake.add(id);
      asked.set(id, raw);
    }
  }
  if (wanted.length === 0 || (wake.size === 0 && !vad)) for (const c of registry.wakeModels()) wake.add(c.id);
  // A configured group asked for alone is that model, not a new combination of its heads.
  const [only] = wakeIds;
  if (wakeIds.size === 1 && registry.configOf(only)?.heads) return { wake: only, vad, asked };
  return { wake: wake.size ? [...wake].sort().join(',') : null, vad, asked };
}

/**
 * Checks `wyoming.denoise` at start: absent, or a denoise model the server knows (configured or
 * in the catalog), so that a typo is a configuration error, not every connection's failure.
 * @throws VoxError `invalid_request_error` naming `wyoming.denoise`.
 */
export function checkWyomingDenoise(registry: Supervisor): void {
  const id = registry.config.wyoming.denoise;
  if (id === undefined) return;
  const config = registry.configOf(id);
  if (!config) throw invalid('wyoming.denoise', `'${id}' is not a model this server knows; a denoise model: rnnoise`);
  if (config.task !== 'denoise')
    throw invalid('wyoming.denoise', `'${id}' is a ${config.task} model, not a denoise model (rnnoise)`);
}

/**
 * The `info` answer to `describe`: one wake program (voxserve) listing every single wake-word
 * model, named and phrased as wyoming-openwakeword lists its own (`hey_jarvis`, "Hey Jarvis").
 */
export function wyomingInfo(registry: Supervisor, version: string): Record<string, unknown> {
  const about = (c: ModelConfig): Record<string, unknown> => {
    const oww = c.path?.startsWith(OWW_MODELS);
    const name = wyomingName(c.id);
    const phrase = wyomingPhrase(name);
    return {
      name,
      description: `${c.phrase ?? phrase}${oww ? ` (openWakeWord pre-trained head, licence ${OWW_ABOUT.licence})` : ''}`,
      phrase,
      attribution: oww ? OWW_ABOUT.attribution : { name: 'configured in voxserve', url: '' },
      installed: true,
      languages: oww ? [...OWW_ABOUT.languages] : [],
      // The head file's version suffix (alexa_v0.1.onnx: "v0.1"), as wyoming-openwakeword gives its own.
      version: /_(v[0-9.]+)\.onnx$/.exec(c.path ?? '')?.[1] ?? null,
    };
  };
  return {
    wake: [
      {
        name: 'voxserve',
        description:
          'voxserve: openWakeWord heads served from one process (several wake words per stream share their features)',
        // The engine whose models it runs (voxserve has no public home to point to).
        attribution: OWW_ABOUT.attribution,
        installed: true,
        version,
        models: registry.wakeModels().map(about),
      },
    ],
  };
}

/**
 * The head each detection label of a wake-word model comes from: a single head's label is its
 * model id; a multi-class head's classes (`timer`: `1_minute_timer`, `5_minute_timer`, ...) are
 * the head's id (`timer`), the name `describe` lists and Home Assistant asks by.
 */
function headOfLabel(granted: Granted): Map<string, string> {
  const heads = headsOf(granted.config);
  const slotHeads = granted.info.heads ?? [{ window: 0, labels: ['@model'] }];
  const map = new Map<string, string>();
  slotHeads.forEach((h, i) => {
    for (const l of h.labels) if (l && heads[i]) map.set(l === '@model' ? heads[i].label : l, heads[i].label);
  });
  return map;
}

/** The PCM format an `audio-start` or `audio-chunk` declares: rate (Hz), width (bytes per sample), channels. */
interface PcmFormat {
  rate: number;
  width: number;
  channels: number;
}

/**
 * The format an `audio-start` or `audio-chunk` declares in its `rate`, `width` and `channels`; a
 * field a chunk leaves out is its audio stream's (`fallback`). Only 16-bit PCM (width 2).
 * @throws VoxError `invalid_field` naming the field (`audio-chunk.rate`, ...).
 */
function pcmFormat(
  kind: 'audio-start' | 'audio-chunk',
  data: Record<string, unknown>,
  fallback?: PcmFormat,
): PcmFormat {
  const field = (k: keyof PcmFormat): number => {
    const v = data[k] ?? fallback?.[k];
    if (typeof v !== 'number' || !Number.isInteger(v))
      throw invalid(`${kind}.${k}`, `required integer, got ${JSON.stringify(v)?.slice(0, 32)}`);
    return v;
  };
  const f = { rate: field('rate'), width: field('width'), channels: field('channels') };
  if (f.width !== 2) throw invalid(`${kind}.width`, `only 2 (16-bit PCM) is supported, got ${f.width}`);
  checkFormat(f.rate, f.channels, { rate: `${kind}.rate`, channels: `${kind}.channels` });
  return f;
}

/**
 * The `timestamp` an `audio-start` or `audio-chunk` carries, ms on the client's clock: absent
 * (undefined or null) when it gives none; else a finite number from 0 to 2^53 - 1 (a fraction is
 * kept, and detections echo it rounded to whole ms).
 * @throws VoxError `invalid_field` naming the field (`audio-chunk.timestamp`).
 */
function clientTimestamp(kind: 'audio-start' | 'audio-chunk', data: Record<string, unknown>): number | undefined {
  const v = data.timestamp;
  if (v === undefined || v === null) return undefined;
  if (typeof v !== 'number' || !Number.isFinite(v) || v < 0 || v > Number.MAX_SAFE_INTEGER)
    throw invalid(
      `${kind}.timestamp`,
      `must be a number of ms from 0 to ${Number.MAX_SAFE_INTEGER}, got ${JSON.stringify(v)?.slice(0, 32)}`,
    );
  return v;
}

/**
 * Where an audio stream's samples (16 kHz, after conversion) fall on the client's clock: each
 * `audio-chunk`'s first sample and its `timestamp`, ms. A chunk without one continues the
 * previous chunk's (the first: the `audio-start` timestamp, else 0), so a client that sends none
 * gets positions in its audio, ms.
 */
class ClientClock {
  /** Per chunk: its first sample, and its timestamp (ms); the oldest are dropped past {@link ClientClock.KEEP}. */
  private marks: { at: number; ts: number }[] = [];
  private samples = 0;
  /** Chunks remembered (about 7 minutes of 100 ms chunks); older positions are counted back from the oldest. */
  static readonly KEEP = 4096;

  /** @param base the `audio-start` timestamp, ms (0 when it has none). */
  constructor(private readonly base: number) {}

  /** The next chunk: `samples` 16 kHz samples, the client's `timestamp` (ms) when it gave one. */
  chunk(samples: number, timestamp: number | undefined): void {
    const last = this.marks.at(-1);
    const ts =
      timestamp !== undefined
        ? timestamp
        : last
          ? last.ts + (this.samples - last.at) / 16
          : this.base + this.samples / 16;
    if (this.marks.length >= 2 * ClientClock.KEEP) this.marks = this.marks.slice(ClientClock.KEEP);
    this.marks.push({ at: this.samples, ts });
    this.samples += samples;
  }

  /**
   * The client time of the audio up to `ms` (ms of 16 kHz audio since the stream's start).
   * `chunk`: the timestamp of the chunk that holds its last sample, as wyoming-openwakeword
   * gives a detection the timestamp of the chunk it came in (1.x: the chunk's own, 2.x: the
   * audio's position at the chunk's start); else that timestamp plus the offset into the chunk.
   */
  at(ms: number, chunk: boolean): number {
    const s = ms * 16;
    // The last chunk starting before sample s (s - 1 is the last sample the position covers).
    let lo = 0;
    let hi = this.marks.length - 1;
    if (hi < 0 || this.marks[0].at > s - 1) {
      const first = this.marks[0] ?? { at: 0, ts: this.base };
      return Math.round(first.ts + (s - first.at) / 16);
    }
    while (lo < hi) {
      const mid = (lo + hi + 1) >> 1;
      if (this.marks[mid].at <= s - 1) lo = mid;
      else hi = mid - 1;
    }
    const m = this.marks[lo];
    return Math.round(chunk ? m.ts : m.ts + (s - m.at) / 16);
  }
}

/** One model a connection holds a lease on, and its current audio stream's job pump. */
interface Lane {
  kind: 'wake' | 'vad';
  lease: LeaseHandle;
  granted: Granted;
  /** The current audio stream's session and pump (processing lag fed to the model's `processing_lag_ms`). */
  pump: JobPump | null;
}

/**
 * The current audio stream of a connection: its detections so far, its format (the decoder's), and the client's clock.
 */
interface AudioStream {
  detections: number;
  format: PcmFormat;
  clock: ClientClock;
}

/** What the `work` actor of a Wyoming connection receives from its chart. */
type WyomingWorkEvent = StreamInput | { type: 'CHECK_IDLE' };

/**
 * One Wyoming connection's work (see the module comment). Events are handled one at a time in
 * arrival order (`queue`); audio is decoded once and pushed to every lane's session, and each
 * lane pumps its jobs like a WebSocket stream. On `END` (the root's drain) the current audio
 * stream finishes as if `audio-stop` had come, then `DONE`. {@link close} releases every lease.
 */
class WyomingConnection {
  private stopped = false;
  private readonly t0 = performance.now();
  /** The names of the last `detect`. */
  private names: unknown;
  private lanes: Lane[] = [];
  private laneKey = '';
  /** `wyoming.denoise`'s model, under its lease (taken at the first audio stream, kept for the connection). */
  private chain: { lease: LeaseHandle; granted: Granted } | null = null;
  /** The current audio stream's first link when `chain` is set: the decoder's 48 kHz audio goes through it. */
  private link: ChainLink | null = null;
  /** The name each head was asked by in the last `detect` (detections carry it back). */
  private asked = new Map<string, string>();
  /** The head (model id) of each detection label of the wake lane. */
  private headOf = new Map<string, string>();
  private decoder: PcmStreamDecoder | null = null;
  private audio: AudioStream | null = null;
  private ready = false;
  private ended = false;
  private paused = false;
  /** Payload bytes of the events waiting in `queue`. */
  private queued = 0;
  private queue: Promise<void> = Promise.resolve();

  constructor(
    private readonly channel: WyomingChannel,
    private readonly registry: Supervisor,
    private readonly stats: StreamResources['stats'],
    private readonly send: (e: WorkEvent) => void,
  ) {
    channel.onEvent = (e) => this.enqueue(e);
  }

  /** A parsed event from the client: handled after every earlier one. */
  private enqueue(e: WyomingEvent): void {
    const bytes = e.payload?.length ?? 0;
    this.queued += bytes;
    this.backlog();
    this.queue = this.queue
      .then(() => this.handle(e))
      .catch(this.fail)
      .finally(() => {
        this.queued -= bytes;
        this.backlog();
      });
  }

  /** An event from the chart: the idle deadline's check, and `END` (the root's drain). */
  receive(e: WyomingWorkEvent): void {
    if (e.type === 'CHECK_IDLE') {
      this.send({ type: 'IDLE_REPORT', silentMs: performance.now() - this.channel.heardAt });
    } else if (e.type === 'END' && !this.ended) {
      this.queue = this.queue.then(() => this.end());
    }
  }

  /** The root's drain: finishes the current audio stream as if audio-stop had come, then `DONE`. */
  private async end(): Promise<void> {
    await this.stop(true).catch(this.fail);
    this.ended = true;
    if (this.stopped) return;
    const audioMs = this.stats.receivedSamples / 16;
    this.send({
      type: 'DONE',
      processed_ms: Math.round(audioMs),
      timing: {
        wall_ms: Math.round(performance.now() - this.t0),
        queue_ms: 0,
        audio_duration_ms: Math.round(audioMs),
        rtf: 0,
      },
    });
  }

  /** The actor stops: nothing more is sent, the decoder is freed, every lease released. */
  close(): void {
    this.channel.onEvent = null;
    this.stopped = true;
    this.decoder?.close();
    this.link?.close();
    for (const l of this.lanes) l.lease.release();
    this.chain?.lease.release();
  }

  private readonly fail = (e: unknown): void => {
    if (this.stopped) return;
    const err = toVoxError(e);
    this.stopped = true;
    this.send({ type: 'FAILED', error: err.toWire(), code: err.closeCode });
  };

  /** Pauses reading while too much is queued or a lane's session has too much audio waiting; resumes below. */
  private readonly backlog = (): void => {
    const p =
      this.queued > MAX_EARLY_BYTES ||
      this.lanes.some((l) => (l.pump?.session.pendingSamples ?? 0) > MAX_PENDING_SAMPLES) ||
      (this.link?.session.pendingSamples ?? 0) > MAX_PENDING_SAMPLES * (RNNOISE.RATE / 16_000);
    if (p !== this.paused) this.send({ type: p ? 'PAUSE' : 'RESUME' });
    this.paused = p;
  };

  /** A task event of the current audio stream, as its Wyoming event. */
  private readonly emit = (e: TaskEvent): void => {
    const audio = this.audio;
    if (!audio) return;
    if (e.type === 'detection') {
      audio.detections++;
      const head = this.headOf.get(e.label) ?? e.label;
      this.channel.write({
        type: 'detection',
        name: this.asked.get(head) ?? wyomingName(head),
        timestamp: audio.clock.at(e.at_ms, true),
      });
    } else if (e.type === 'speech_start')
      this.channel.write({ type: 'voice-started', timestamp: audio.clock.at(e.at_ms, false) });
    else if (e.type === 'speech_end')
      this.channel.write({ type: 'voice-stopped', timestamp: audio.clock.at(e.end_ms, false) });
  };

  private async handle(e: WyomingEvent): Promise<void> {
    if (this.stopped || this.ended) return;
    switch (e.type) {
      case 'detect':
        this.names = e.data.names;
        resolveNames(this.registry, this.names); // a bad name is an error now, not at audio-start
        return;
      case 'audio-start':
        return this.start('audio-start', e.data);
      case 'audio-chunk':
        // A client that sends chunks without audio-start: the chunk's own format starts the stream.
        if (!this.audio) await this.start('audio-chunk', e.data);
        return this.chunk(e);
      case 'audio-stop':
        return this.stop(true);
      default:
        // Unknown events are ignored, as the Wyoming README asks of peers.
        return;
    }
  }

  /** Takes the leases for what `names` asks (keeps them when unchanged); the models are loaded. */
  private async admit(): Promise<void> {
    const want = resolveNames(this.registry, this.names);
    this.asked = want.asked;
    const key = `${want.wake}|${want.vad}`;
    if (key === this.laneKey) return;
    for (const l of this.lanes) l.lease.release();
    this.lanes = [];
    this.laneKey = '';
    for (const [kind, mid] of [
      ['wake', want.wake],
      ['vad', want.vad],
    ] as const) {
      if (!mid) continue;
      // Closed while the previous lane's lease was awaited: close() released the lanes it saw; a
      // lease taken now would never be (found by the interleaving suite: FC_SEED=-43480333, a
      // connection on a wake word and a VAD model dropped while the wake word's slot died).
      if (this.stopped) return;
      const { handle, granted } = this.lease(mid);
      const lane = { kind, lease: handle } as Lane;
      this.lanes.push(lane);
      lane.granted = await granted;
      this.stats.model = this.stats.model ?? lane.granted.model;
      if (kind === 'wake') this.headOf = headOfLabel(lane.granted);
    }
    this.laneKey = key;
    const denoise = this.registry.config.wyoming.denoise;
    if (denoise && !this.chain && !this.stopped) {
      // The chain's first link: asked once the last models' leases are held, as a WebSocket stream's.
      const { handle, granted } = this.lease(denoise);
      this.chain = { lease: handle, granted: null as unknown as Granted };
      this.chain.granted = await granted;
    }
  }

  /** A lease on `model` for this connection; a revocation fails the connection. */
  private lease(model: string): { handle: LeaseHandle; granted: Promise<Granted> } {
    return leaseGranted(this.registry.requireForWork(model), { metrics: this.registry.metrics }, (e) => {
      if (this.stopped) return;
      this.stopped = true;
      this.send({ type: 'FAILED', error: e.error.toWire(), code: e.code });
    });
  }

  /** `audio-start` (or a first `audio-chunk`, which carries its format): a new audio stream. */
  private async start(kind: 'audio-start' | 'audio-chunk', data: Record<string, unknown>): Promise<void> {
    if (this.audio) await this.stop(false);
    const format = pcmFormat(kind, data);
    const base = clientTimestamp(kind, data) ?? 0;
    await this.admit();
    if (this.stopped) return;
    this.decoder?.close();
    this.decoder = null;
    const chain = this.chain?.granted;
    const next = await PcmStreamDecoder.create('s16le', format.rate, format.channels, chain ? RNNOISE.RATE : undefined);
    if (this.stopped) return next.close();
    this.decoder = next;
    this.link = chain
      ? await ChainLink.create(chain, 'wyoming.denoise', {
          out: (samples) => this.toLanes(samples, performance.now()),
          accepted: this.backlog,
          fail: this.fail,
        })
      : null;
    if (this.stopped) return this.link?.close();
    for (const l of this.lanes)
      l.pump = new JobPump(createTaskSession(l.granted.config, l.granted.info, undefined, false), l.granted, {
        emit: this.emit,
        accepted: this.backlog,
        fail: this.fail,
      });
    this.audio = { detections: 0, format, clock: new ClientClock(kind === 'audio-start' ? base : 0) };
    if (!this.ready) {
      this.ready = true;
      this.send({
        type: 'READY',
        model: this.lanes.map((l) => l.granted.model).join('+'),
        task: this.lanes[0]?.granted.config.task ?? 'wakeword',
      });
    }
  }

  /** `audio-stop`: the last partial step is processed, then `not-detected` if nothing fired (when `answer`). */
  private async stop(answer: boolean): Promise<void> {
    const current = this.audio;
    if (current) {
      const held = this.decoder?.end();
      if (held?.length) this.feed(held, undefined);
      // A chain's first link hands on all it holds before the models' sessions end.
      if (this.link) await this.link.end();
      await Promise.all(
        this.lanes.map((l) => {
          for (const e of l.pump!.session.end()) this.emit(e);
          return l.pump!.drained();
        }),
      );
      if (answer && current.detections === 0 && this.lanes.some((l) => l.kind === 'wake'))
        this.channel.write({ type: 'not-detected' });
    } else if (answer && resolveNames(this.registry, this.names).wake)
      // No audio stream: what the latest `detect` asks decides (not the last stream's lanes).
      this.channel.write({ type: 'not-detected' });
    this.audio = null;
    this.link?.close();
    this.link = null;
    for (const l of this.lanes) l.pump = null;
  }

  /**
   * Converted samples (mono; 16 kHz, or 48 kHz into a chain's first link) to every lane, or to the
   * link; `timestamp` is the client's for their chunk.
   */
  private feed(samples: Float32Array, timestamp: number | undefined): void {
    if (!this.audio) return;
    // The client's clock and the figures count 16 kHz samples, as the models hear them.
    const at16k = this.link ? samples.length * (16_000 / RNNOISE.RATE) : samples.length;
    this.audio.clock.chunk(at16k, timestamp);
    if (samples.length === 0) return;
    this.stats.receivedSamples += at16k;
    const at = performance.now();
    if (!this.link) return this.toLanes(samples, at);
    this.link.session.push(samples);
    this.link.pump.arrived(at);
    this.link.pump.pump();
    this.backlog();
  }

  /** 16 kHz samples, arrived at `at` (performance.now() ms), to every lane's session. */
  private toLanes(samples: Float32Array, at: number): void {
    for (const l of this.lanes) {
      l.pump!.session.push(samples);
      l.pump!.arrived(at);
      l.pump!.pump();
    }
    this.backlog();
  }

  /**
   * An `audio-chunk`, converted by its own `rate`, `width` and `channels` (as wyoming-openwakeword
   * converts each chunk): a chunk whose format differs from the stream's so far ends the old
   * stream of the converter (its held-back samples go on first) and re-initialises it for the
   * new format (no new converter: see {@link PcmStreamDecoder.reformat}).
   */
  private async chunk(e: WyomingEvent): Promise<void> {
    const decoder = this.decoder;
    if (!this.audio || !decoder) return;
    const format = pcmFormat('audio-chunk', e.data, this.audio.format);
    const timestamp = clientTimestamp('audio-chunk', e.data);
    if (format.rate !== this.audio.format.rate || format.channels !== this.audio.format.channels) {
      const held = decoder.end();
      if (held.length) this.feed(held, undefined);
      // The same converter, re-initialised for the new format: a new one is a WASM instance
      // (~15 ms of main-thread CPU), which a client switching format on every chunk could
      // make the server pay per chunk (#25).
      await decoder.reformat(format.rate, format.channels);
      if (this.stopped || !this.audio) return;
      this.audio.format = format;
    }
    this.feed(decoder.push(e.payload ?? Buffer.alloc(0)), timestamp);
  }
}

/** The `work` actor of a Wyoming connection: a {@link WyomingConnection} for as long as it runs. */
const wyomingWork = fromCallback<WyomingWorkEvent, { id: string }>(({ input: { id }, sendBack, receive }) => {
  const { channel, registry, stats } = streamResources(id)!;
  const connection = new WyomingConnection(channel as WyomingChannel, registry, stats, sendBack);
  receive((e) => connection.receive(e));
  return () => {
    channel.close();
    connection.close();
  };
});

/**
 * Creates the socket actor of one Wyoming connection (unstarted, as {@link createStreamSocket}).
 * Heartbeats are off (Wyoming has no ping the peers must answer) and the idle deadline is
 * `idleMs` (`wyoming.idle_ms`, default 0: none; a satellite may rightly be quiet for minutes);
 * the other limits are the server's.
 */
export function createWyomingSocket(
  input: { limits: Limits; registry: Supervisor; idleMs: number },
  inspect?: (e: InspectionEvent) => void,
): StreamSocketHandle & { channel: WyomingChannel } {
  const channel = new WyomingChannel(0, input.limits.send_timeout_ms);
  const limits = { ...input.limits, heartbeat_ms: 0, idle_ms: input.idleMs };
  const handle = createStreamSocket({ url: '', limits, registry: input.registry, route: 'wyoming' }, inspect, {
    work: wyomingWork,
    channel,
  });
  return { ...handle, channel };
}

export type { WireEvent };
