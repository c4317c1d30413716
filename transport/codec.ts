import { pack } from 'msgpackr';

/** WebSocket subprotocols; the first is the default when the client asks for none. */
export const SUBPROTOCOLS = ['voxserve.v1.json', 'voxserve.v1.msgpack'] as const;
export type Subprotocol = (typeof SUBPROTOCOLS)[number];

/** Encodes a server event for the chosen subprotocol: a JSON text frame or a msgpack binary frame. */
export function encodeEvent(protocol: Subprotocol, event: Record<string, unknown>): string | Buffer {
  return protocol === 'voxserve.v1.msgpack' ? pack(event) : JSON.stringify(event);
}
