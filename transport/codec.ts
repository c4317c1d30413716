import { pack } from 'msgpackr';
import type { Subprotocol } from '../runtime/wire.js';

/** Encodes a server event for the chosen subprotocol: a JSON text frame or a msgpack binary frame. */
export function encodeEvent(protocol: Subprotocol, event: Record<string, unknown>): string | Buffer {
  return protocol === 'voxserve.v1.msgpack' ? pack(event) : JSON.stringify(event);
}
