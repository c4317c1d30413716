import { createRequire } from 'node:module';
import { createServer, type AddressInfo, type Server, type Socket } from 'node:net';
import type { InspectionEvent } from 'xstate';
import { drainOnShutdown } from '../actors/system.js';
import type { StreamInput, StreamOutput, StreamSocket, WireEvent } from '../actors/stream.js';
import { CLOSE } from '../runtime/wire.js';
import type { Supervisor } from '../actors/supervisor.js';
import { createWyomingSocket, wyomingInfo, type WyomingChannel, type WyomingEvent } from '../actors/wyoming.js';
import type { ServerConfig } from '../runtime/config.js';
import { voxError } from '../runtime/errors.js';

/** voxserve's version, from package.json (one level up from the sources, two from dist/). */
const VERSION = ((): string => {
  const require = createRequire(import.meta.url);
  for (const p of ['../package.json', '../../package.json']) {
    try {
      const pkg = require(p) as { name?: string; version?: string };
      if (pkg.name === 'voxserve' && pkg.version) return pkg.version;
    } catch {
      // not there
    }
  }
  return 'unknown';
})();

/** A Wyoming connection's TCP keep-alive delay: idle time before the first probe, ms. */
const KEEPALIVE_MS = 30_000;

/** Malformed Wyoming input: the connection gets an `error` event and is closed. */
export class WyomingFramingError extends Error {}

const isObject = (v: unknown): v is Record<string, unknown> => typeof v === 'object' && v !== null && !Array.isArray(v);

/**
 * Splits a byte stream into Wyoming events (https://github.com/rhasspy/wyoming README "Format"):
 * a JSON header line (`type`, optional `data`, `data_length`, `payload_length`), then exactly
 * `data_length` bytes of JSON merged over the header's `data`, then `payload_length` bytes of
 * payload. Blank lines between events are skipped.
 *
 * Each byte is looked at once and copied at most once, however the stream is cut into segments:
 * the pieces of a header line or of an event's body are kept as they came and joined once, when
 * the last one is there (1 MB in 50-byte pieces costs what 1 MB at once does, not 20,000 joins of
 * everything buffered so far).
 */
export class WyomingParser {
  /** Pieces of the current header line (no newline yet), and their length. */
  private line: Buffer[] = [];
  private lineBytes = 0;
  /** The current event's header once its line is complete, and the pieces of its body so far. */
  private header: { type: string; data: Record<string, unknown>; dataLength: number; payloadLength: number } | null =
    null;
  private body: Buffer[] = [];
  private bodyBytes = 0;
  /** Bytes copied so far (joining pieces, or copying a payload out of a segment): linear in the input. */
  copiedBytes = 0;

  /**
   * @param maxHeaderBytes longest header line, and the largest data section, bytes.
   * @param maxPayloadBytes largest payload, bytes.
   */
  constructor(
    private readonly maxHeaderBytes: number,
    private readonly maxPayloadBytes: number,
  ) {}

  /** Bytes of an event begun and not finished (a header line without its newline, or a body not all here). */
  get partialBytes(): number {
    return this.lineBytes + (this.header ? this.bodyBytes + 1 : 0);
  }

  /**
   * Takes the next bytes; returns the events they complete, in order.
   * @throws WyomingFramingError naming what is wrong (bad JSON, a header over the limit, a
   *   `payload_length` over the frame limit, `data` that is not an object, ...).
   */
  push(chunk: Buffer): WyomingEvent[] {
    const out: WyomingEvent[] = [];
    let at = 0;
    while (
      at < chunk.length ||
      (this.header && this.bodyBytes === this.header.dataLength + this.header.payloadLength)
    ) {
      if (!this.header) {
        const nl = chunk.indexOf(10, at);
        const end = nl < 0 ? chunk.length : nl;
        if (this.lineBytes + end - at > this.maxHeaderBytes)
          throw new WyomingFramingError(`header line over ${this.maxHeaderBytes} bytes`);
        this.line.push(chunk.subarray(at, end));
        this.lineBytes += end - at;
        at = end;
        if (nl < 0) break;
        at++; // the newline
        const line = this.join(this.line, this.lineBytes).toString('utf8');
        this.line = [];
        this.lineBytes = 0;
        if (line.trim()) this.header = this.parseHeader(line);
        continue;
      }
      const { type, dataLength, payloadLength } = this.header;
      const take = Math.min(dataLength + payloadLength - this.bodyBytes, chunk.length - at);
      if (take > 0) {
        this.body.push(chunk.subarray(at, at + take));
        this.bodyBytes += take;
        at += take;
      }
      if (this.bodyBytes < dataLength + payloadLength) break;
      // The body as one buffer of its own (a copy: the segments are not kept alive by the payload).
      const body = this.join(this.body, this.bodyBytes, true);
      this.body = [];
      this.bodyBytes = 0;
      let data = this.header.data;
      if (dataLength > 0) {
        let extra: unknown;
        try {
          extra = JSON.parse(body.subarray(0, dataLength).toString('utf8'));
        } catch {
          throw new WyomingFramingError(`${type}: the data section is not valid JSON`);
        }
        if (!isObject(extra)) throw new WyomingFramingError(`${type}: the data section must be a JSON object`);
        data = { ...data, ...extra };
      }
      out.push({ type, data, payload: payloadLength > 0 ? body.subarray(dataLength) : null });
      this.header = null;
    }
    return out;
  }

  /** The pieces as one buffer: a view when there is one piece (unless `copy`), else one join. */
  private join(pieces: Buffer[], bytes: number, copy = false): Buffer {
    if (pieces.length === 1 && !copy) return pieces[0];
    this.copiedBytes += bytes;
    return pieces.length === 1 ? Buffer.from(pieces[0]) : Buffer.concat(pieces, bytes);
  }

  private parseHeader(line: string): NonNullable<WyomingParser['header']> {
    let h: unknown;
    try {
      h = JSON.parse(line);
    } catch {
      throw new WyomingFramingError('header line is not valid JSON');
    }
    if (!isObject(h)) throw new WyomingFramingError('header line must be a JSON object');
    if (typeof h.type !== 'string' || !h.type) throw new WyomingFramingError('header.type: required, a string');
    if (h.data !== undefined && h.data !== null && !isObject(h.data))
      throw new WyomingFramingError(`${h.type}: header.data must be a JSON object`);
    const length = (name: 'data_length' | 'payload_length', max: number): number => {
      const v = h[name] ?? 0;
      if (typeof v !== 'number' || !Number.isInteger(v) || v < 0)
        throw new WyomingFramingError(`${h.type}: header.${name} must be a non-negative integer`);
      if (v > max) throw new WyomingFramingError(`${h.type}: header.${name} ${v} is over the limit of ${max} bytes`);
      return v;
    };
    return {
      type: h.type,
      data: (h.data as Record<string, unknown>) ?? {},
      dataLength: length('data_length', this.maxHeaderBytes),
      payloadLength: length('payload_length', this.maxPayloadBytes),
    };
  }
}

/** One Wyoming event as bytes: the header line, then the data section (as wyoming's Python writer does). */
export function encodeWyoming(type: string, data?: Record<string, unknown>): Buffer {
  if (!data || Object.keys(data).length === 0) return Buffer.from(`${JSON.stringify({ type })}\n`);
  const body = Buffer.from(JSON.stringify(data));
  return Buffer.concat([
    Buffer.from(`${JSON.stringify({ type, data_length: body.length, payload_length: 0 })}\n`),
    body,
  ]);
}

/** A stream event as a Wyoming event; null for events Wyoming has no place for (`ready`, `done`). */
function toWyoming(event: WireEvent): Buffer | null {
  const { type, ...rest } = event;
  if (type === 'ready' || type === 'done') return null;
  if (type === 'error') {
    const e = (rest.error ?? {}) as { type?: string; message?: string };
    return encodeWyoming('error', { text: e.message ?? 'error', code: e.type ?? 'server_error' });
  }
  return encodeWyoming(type, rest);
}

/** A live Wyoming connection as the transport sees it. */
export interface WyomingLink {
  readonly actor: StreamSocket;
  readonly socket: Socket;
  /** Resolves once its leases are released (the socket may still be closing). */
  readonly released: Promise<void>;
}

/**
 * Binds a TCP connection to its socket actor: bytes become Wyoming events (to the channel;
 * `describe` and `ping` are answered here), what the actor emits is written as Wyoming events.
 * Malformed input gets an `error` event and the connection is cut (close code 1008 in the log).
 * Starts the actor.
 */
export function bindWyoming(
  socket: Socket,
  { actor, channel }: { actor: StreamSocket; channel: WyomingChannel },
  config: ServerConfig,
  registry: Supervisor,
): WyomingLink {
  const limits = config.limits;
  const tell = (e: StreamInput | { type: 'CUT'; code: number; reason: string }): void => {
    if (actor.getSnapshot().status === 'active') actor.send(e as StreamInput);
  };
  let release!: () => void;
  const released = new Promise<void>((r) => (release = r));
  const write = (bytes: Buffer): void => {
    if (socket.destroyed || !socket.writable) return;
    if (socket.writableLength > limits.ws_max_buffered_bytes) return tell({ type: 'SEND_BLOCKED' });
    socket.write(bytes, channel.writing());
  };
  channel.onSendExpired = (waitingMs) => tell({ type: 'SEND_EXPIRED', waitingMs });
  channel.write = (event) => {
    const bytes = toWyoming(event);
    if (bytes) write(bytes);
  };
  actor.on('*', (o: StreamOutput) => {
    switch (o.type) {
      case 'send':
        return channel.write(o.event);
      case 'close':
        return void socket.end();
      case 'pause':
        channel.readingPaused(true);
        return void socket.pause();
      case 'resume':
        channel.readingPaused(false);
        return void (parser && socket.resume());
      case 'terminate':
        return void socket.destroy();
      case 'released':
        return release();
    }
  });
  let parser: WyomingParser | null = new WyomingParser(limits.max_header_bytes, limits.ws_max_frame_bytes);
  /** Nothing more is read from a peer that broke the framing: error event, then the close. */
  const framingError = (reason: string): void => {
    parser = null;
    clearTimeout(unfinished);
    socket.pause();
    channel.write({ type: 'error', error: voxError('invalid_framing', { reason }).toWire() });
    tell({ type: 'CUT', code: CLOSE.POLICY, reason });
  };
  // An event begun and not finished (part of a header line, or of a body) has a deadline even
  // with no idle deadline (wyoming.idle_ms 0): a quiet satellite between events stays, but a
  // half-sent event holds its bytes (up to a frame) until the peer goes on. Not counted while
  // the server itself has paused reading (back-pressure).
  const eventMs = config.wyoming.event_timeout_ms;
  let unfinished: NodeJS.Timeout | undefined;
  const checkUnfinished = (): void => {
    unfinished = undefined;
    if (!parser || !parser.partialBytes) return;
    if (socket.isPaused()) return void (unfinished = setTimeout(checkUnfinished, eventMs));
    framingError(
      `an event begun was not finished within wyoming.event_timeout_ms (${eventMs} ms): ${parser.partialBytes} bytes of it received`,
    );
  };
  socket.on('data', (chunk: Buffer) => {
    if (!parser) return;
    let events: WyomingEvent[];
    try {
      events = parser.push(chunk);
    } catch (e) {
      return framingError(e instanceof WyomingFramingError ? e.message : String(e));
    }
    if (eventMs > 0) {
      if (!parser.partialBytes) {
        clearTimeout(unfinished);
        unfinished = undefined;
      } else if (!unfinished || events.length) {
        // The deadline runs from the start of the unfinished event.
        clearTimeout(unfinished);
        unfinished = setTimeout(checkUnfinished, eventMs);
      }
    }
    for (const e of events) {
      if (e.type === 'describe') {
        channel.heard();
        write(encodeWyoming('info', wyomingInfo(registry, VERSION)));
      } else if (e.type === 'ping') {
        channel.heard();
        write(encodeWyoming('pong', typeof e.data.text === 'string' ? { text: e.data.text } : undefined));
      } else channel.event(e);
    }
  });
  socket.on('error', () => {});
  socket.on('close', () => {
    clearTimeout(unfinished);
    parser = null;
    tell({ type: 'PEER_CLOSED', code: 1006 });
  });
  socket.setNoDelay(true);
  // The liveness bound of a quiet connection (there is no idle deadline by default): TCP
  // keep-alive. After 30 s without a packet the kernel probes the peer; Node 20 sets the probes
  // 1 s apart and gives up after 10 (TCP_KEEPINTVL 1, TCP_KEEPCNT 10), so a satellite that
  // vanished without closing is dropped about 40 s after its last packet, and a quiet one that
  // is still there (its kernel answers) never is.
  socket.setKeepAlive(true, KEEPALIVE_MS);
  actor.subscribe({ error: () => {} });
  actor.start();
  return { actor, socket, released };
}

/** The Wyoming listener of a server: its live connections, and how it stops. */
export interface WyomingService {
  readonly server: Server;
  /** `tcp://host:port` once listening. */
  readonly uri: string;
  readonly port: number;
  readonly links: ReadonlySet<WyomingLink>;
  /** Every open TCP connection (refused ones and closing ones included): destroyed at the end of shutdown. */
  readonly sockets: ReadonlySet<Socket>;
}

/**
 * Listens for Wyoming connections on `config.wyoming.host:port` (port 0 picks a free one). Over
 * `limits.max_ws_connections` connections, or while the server is not accepting work, a new
 * connection gets an `error` event and is closed.
 */
export async function startWyoming(
  config: ServerConfig,
  registry: Supervisor,
  inspect?: (e: InspectionEvent) => void,
): Promise<WyomingService> {
  const links = new Set<WyomingLink>();
  const sockets = new Set<Socket>();
  const server = createServer((socket) => {
    sockets.add(socket);
    socket.once('close', () => sockets.delete(socket));
    socket.on('error', () => socket.destroy());
    const refuse = (code: string, text: string): void => void socket.end(encodeWyoming('error', { text, code }));
    if (!registry.accepting) {
      const e = registry.notAccepting();
      return refuse(e.type, e.message);
    }
    if (links.size >= config.limits.max_ws_connections) {
      const e = voxError('too_many_streams', { max: config.limits.max_ws_connections });
      return refuse(e.type, e.message);
    }
    const handle = createWyomingSocket({ limits: config.limits, registry, idleMs: config.wyoming.idle_ms }, inspect);
    drainOnShutdown(registry.root, handle.actor);
    const link = bindWyoming(socket, handle, config, registry);
    links.add(link);
    void link.released.then(() => links.delete(link));
  });
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(config.wyoming.port, config.wyoming.host, () => {
      server.off('error', reject);
      resolve();
    });
  });
  const addr = server.address() as AddressInfo;
  const host = addr.family === 'IPv6' ? `[${addr.address}]` : addr.address;
  return { server, links, sockets, port: addr.port, uri: `tcp://${host}:${addr.port}` };
}
