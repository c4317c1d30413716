import { randomUUID } from 'node:crypto';
import type { IncomingMessage } from 'node:http';
import type { WebSocket } from 'ws';
import type { Supervisor } from '../actors/supervisor.js';
import type { Lease } from '../runtime/admission.js';
import { checkFormat, PCM_ENCODINGS, PcmStreamDecoder, type PcmEncoding } from '../runtime/audio.js';
import type { ServerConfig } from '../runtime/config.js';
import { invalid, toVoxError, VoxError } from '../runtime/errors.js';
import { createTaskSession, drain, type TaskEvent, type TaskSession } from '../runtime/tasks/index.js';
import type { LoadedModel } from '../runtime/loader.js';
import { encodeEvent, type Subprotocol } from './codec.js';

/** WebSocket close codes (DESIGN.md section 4). */
export const CLOSE = { NORMAL: 1000, GOING_AWAY: 1001, POLICY: 1008, TOO_LARGE: 1009, INTERNAL: 1011, FORCE_UNLOAD: 1012, BUSY: 1013 } as const;

interface StreamParams {
  model: string;
  sampleRate: number;
  encoding: PcmEncoding;
  channels: number;
  busyTimeoutMs?: number;
}

function intParam(url: URL, name: string, dflt: number | undefined): number | undefined {
  const raw = url.searchParams.get(name);
  if (raw === null || raw === '') return dflt;
  if (!/^\d+$/.test(raw)) throw invalid(`${name}: must be a non-negative integer, got '${raw}'`);
  return Number(raw);
}

/** @throws VoxError `invalid_request_error` naming the bad query parameter. */
export function parseStreamParams(url: URL): StreamParams {
  const model = url.searchParams.get('model');
  if (!model) throw invalid('model: required query parameter');
  const encoding = url.searchParams.get('encoding') ?? 's16le';
  if (!(PCM_ENCODINGS as readonly string[]).includes(encoding)) throw invalid(`encoding: must be one of ${PCM_ENCODINGS.join(', ')}, got '${encoding}'`);
  const params = {
    model,
    encoding: encoding as PcmEncoding,
    sampleRate: intParam(url, 'sample_rate', 16_000)!,
    channels: intParam(url, 'channels', 1)!,
    busyTimeoutMs: intParam(url, 'busy_timeout_ms', undefined),
  };
  checkFormat(params.sampleRate, params.channels);
  return params;
}

/** Close reasons are limited to 123 bytes by the WebSocket protocol. */
function reason(text: string): string {
  return Buffer.byteLength(text) <= 123 ? text : Buffer.from(text).subarray(0, 120).toString('utf8') + '...';
}

/**
 * One live stream on `/v1/stream`: open -> streaming -> draining -> closed. It takes its lease
 * before preparing anything and holds it until the socket has closed; audio is decoded, windowed
 * and sent to the model's slots as it arrives, and events go out as soon as they exist.
 */
export class StreamConnection {
  readonly id = randomUUID();
  state: 'open' | 'streaming' | 'draining' | 'closed' = 'open';
  private lease: Lease | null = null;
  private session: TaskSession | null = null;
  private decoder: PcmStreamDecoder | null = null;
  private loaded: LoadedModel | null = null;
  private readonly early: { data: Buffer; binary: boolean }[] = [];
  private readonly gone = new AbortController();
  private pumping = false;
  private readonly t0 = performance.now();
  private queueMs = 0;

  constructor(
    private readonly ws: WebSocket,
    private readonly protocol: Subprotocol,
    private readonly supervisor: Supervisor,
    private readonly config: ServerConfig,
    private readonly onClosed: (c: StreamConnection) => void,
  ) {
    ws.on('error', () => this.finish());
    ws.on('close', () => this.finish());
    ws.on('message', (data: Buffer, binary: boolean) => {
      if (this.state === 'open') this.early.push({ data, binary });
      else if (this.state === 'streaming') this.onMessage(data, binary);
    });
  }

  /** Validates the request, takes the lease, loads the model if needed, then sends `ready`. */
  async start(req: IncomingMessage): Promise<void> {
    let params: StreamParams;
    try {
      params = parseStreamParams(new URL(req.url ?? '/', 'http://x'));
      const entry = this.supervisor.require(params.model);
      this.lease = await entry.admit({
        requestTimeoutMs: params.busyTimeoutMs,
        signal: this.gone.signal,
        onRevoke: () => this.fail(new VoxError('server_busy', `model ${entry.id} was unloaded (force)`), CLOSE.FORCE_UNLOAD),
      });
      if (this.closed) return this.lease.release();
      this.queueMs = performance.now() - this.t0;
      this.decoder = await PcmStreamDecoder.create(params.encoding, params.sampleRate, params.channels);
      this.loaded = await entry.ensureReady(this.gone.signal);
      this.session = createTaskSession(entry.config, this.loaded.pool.info, undefined);
      if (this.closed) return;
      this.state = 'streaming';
      this.send({ type: 'ready', session_id: this.id, model: entry.id, task: entry.config.task, sample_rate: 16_000 });
      for (const m of this.early.splice(0)) this.onMessage(m.data, m.binary);
    } catch (e) {
      if (this.closed) return;
      const err = toVoxError(e);
      const code = err.type === 'invalid_request_error' || err.type === 'not_found' ? CLOSE.POLICY : err.status === 503 ? CLOSE.BUSY : CLOSE.INTERNAL;
      this.fail(err, code);
    }
  }

  private get closed(): boolean {
    return this.state === 'closed';
  }

  private send(event: Record<string, unknown>): void {
    if (this.ws.readyState === this.ws.OPEN) this.ws.send(encodeEvent(this.protocol, event));
  }

  private emit = (e: TaskEvent): void => this.send({ ...e });

  private onMessage(data: Buffer, binary: boolean): void {
    if (binary) {
      if (this.state !== 'streaming') return;
      this.session!.push(this.decoder!.push(data));
      void this.pump();
      return;
    }
    let msg: unknown;
    try {
      msg = JSON.parse(data.toString('utf8'));
    } catch {
      return this.send({ type: 'error', error: { type: 'invalid_request_error', message: 'control frame is not valid JSON; expected {"type":"end"}' } });
    }
    if (msg && typeof msg === 'object' && (msg as { type?: unknown }).type === 'end') {
      if (this.state !== 'streaming') return;
      this.state = 'draining';
      for (const e of this.session!.end()) this.emit(e);
      void this.pump();
      return;
    }
    this.send({ type: 'error', error: { type: 'invalid_request_error', message: `unknown control message type ${JSON.stringify((msg as { type?: unknown })?.type)}; expected "end"` } });
  }

  /** Runs every ready job, one at a time, in order; after `end`, sends `done` and closes. */
  private async pump(): Promise<void> {
    if (this.pumping) return;
    this.pumping = true;
    try {
      const pool = this.loaded!.pool;
      await drain(this.session!, (job) => pool.run(job, this.gone.signal), this.emit, Number.MAX_SAFE_INTEGER);
    } catch (e) {
      if (!this.gone.signal.aborted) this.fail(toVoxError(e), CLOSE.INTERNAL);
      return;
    } finally {
      this.pumping = false;
    }
    if (this.state === 'draining' && this.session!.finished) {
      const wallMs = performance.now() - this.t0;
      const audioMs = this.session!.receivedSamples / 16;
      this.send({
        type: 'done',
        processed_ms: Math.round(audioMs),
        timing: { wall_ms: Math.round(wallMs), queue_ms: Math.round(this.queueMs), audio_duration_ms: Math.round(audioMs), rtf: audioMs ? Math.round((wallMs / audioMs) * 10_000) / 10_000 : 0 },
      });
      this.ws.close(CLOSE.NORMAL, 'done');
    }
  }

  /** Sends an `error` event, then closes with `code`; pending inference is dropped. */
  fail(err: VoxError, code: number): void {
    if (this.closed) return;
    this.send({ type: 'error', error: { type: err.type, message: err.message } });
    this.state = 'draining';
    this.gone.abort();
    this.ws.close(code, reason(err.message));
  }

  /** Closes with 1001 (server shutting down). */
  goAway(): void {
    if (this.state === 'closed') return;
    this.ws.close(CLOSE.GOING_AWAY, 'server shutting down');
  }

  private finish(): void {
    if (this.state === 'closed') return;
    this.state = 'closed';
    this.gone.abort();
    this.decoder?.close();
    this.lease?.release();
    this.onClosed(this);
  }
}
