import type { WebSocket } from 'ws';
import type { StreamInput, StreamOutput, StreamSocket, StreamSocketHandle } from '../actors/stream.js';
import type { Limits } from '../runtime/config.js';
import { voxError, type WireError } from '../runtime/errors.js';
import type { Subprotocol } from '../runtime/wire.js';
import { encodeEvent } from './codec.js';

/** A live stream as the transport sees it: its socket actor and the WebSocket it writes to. */
export interface StreamLink {
  readonly actor: StreamSocket;
  readonly ws: WebSocket;
  /** Resolves once the stream's lease is released (its socket may still be closing). */
  readonly released: Promise<void>;
}

/** The control text frame a client may send. */
const END = /^\s*\{\s*"type"\s*:\s*"end"\s*\}\s*$/;

/** Parses a text frame into an event for the socket actor: `END`, or `BAD_CONTROL` with the reason. */
function controlEvent(text: string): { type: 'END' } | { type: 'BAD_CONTROL'; error: WireError } {
  if (END.test(text)) return { type: 'END' };
  let msg: unknown;
  try {
    msg = JSON.parse(text);
  } catch {
    return { type: 'BAD_CONTROL', error: voxError('invalid_control_message', { json: false }).toWire() };
  }
  if (msg && typeof msg === 'object' && (msg as { type?: unknown }).type === 'end') return { type: 'END' };
  return {
    type: 'BAD_CONTROL',
    error: voxError('invalid_control_message', { json: true, type: (msg as { type?: unknown })?.type }).toWire(),
  };
}

/**
 * Binds a WebSocket to its stream socket actor, bytes to events and back: binary frames go to its
 * channel, text frames become `END` or `BAD_CONTROL`, pongs `PONG`, the close `PEER_CLOSED`, a
 * client over `limits.ws_max_messages_per_s` (the channel counts every message) `FLOODED`; what
 * the actor emits and what its channel carries out is written (events encoded for the
 * subprotocol; a client holding more than `limits.ws_max_buffered_bytes` unread gets
 * `SEND_BLOCKED` instead). Starts the actor.
 */
export function bindStream(
  ws: WebSocket,
  { actor, channel }: StreamSocketHandle,
  protocol: Subprotocol,
  limits: Limits,
): StreamLink {
  /** Socket events after the actor's final state (a late close) have no one to hear them. */
  const tell = (e: StreamInput): void => {
    if (actor.getSnapshot().status === 'active') actor.send(e);
  };
  let release!: () => void;
  const released = new Promise<void>((r) => (release = r));
  /** Writes one event; the channel keeps since when writes have waited to flush (the send deadline). */
  channel.write = (event) => {
    if (ws.readyState !== ws.OPEN) return;
    if (ws.bufferedAmount > limits.ws_max_buffered_bytes) return tell({ type: 'SEND_BLOCKED' });
    // A denoise stream's audio: a binary frame of raw PCM under JSON (events are text frames), an `audio` event under
    // msgpack.
    if (event.type === 'audio' && protocol !== 'voxserve.v1.msgpack')
      return ws.send(event.data as Buffer, { binary: true }, channel.writing());
    ws.send(encodeEvent(protocol, event), channel.writing());
  };
  channel.onSendExpired = (waitingMs) => tell({ type: 'SEND_EXPIRED', waitingMs });
  actor.on('*', (o: StreamOutput) => {
    switch (o.type) {
      case 'send':
        return channel.write(o.event);
      case 'close':
        return ws.close(o.code, o.reason);
      case 'pause':
        channel.readingPaused(true);
        return ws.pause();
      case 'resume':
        channel.readingPaused(false);
        return ws.resume();
      case 'ping':
        return ws.ping();
      case 'terminate':
        return ws.terminate();
      case 'released':
        return release();
    }
  });
  // ws emits 'close' after every 'error' (with the code it closed with: 1009, 1007, 1006 ...).
  ws.on('error', () => {});
  ws.on('close', (code) => tell({ type: 'PEER_CLOSED', code }));
  ws.on('ping', () => channel.control());
  ws.on('pong', () => {
    channel.control();
    tell({ type: 'PONG' });
  });
  ws.on('message', (data: Buffer, binary: boolean) => {
    if (binary) return channel.push(data);
    if (channel.heard()) tell(controlEvent(data.toString('utf8')));
  });
  channel.onFlood = () => tell({ type: 'FLOODED' });
  actor.subscribe({ error: () => {} });
  actor.start();
  return { actor, ws, released };
}
