/**
 * Constants of the wire interface (DESIGN.md section 4) shared by the server and the client
 * (`client/index.ts`). The client is bundled for the browser too: this module imports nothing,
 * Node or otherwise.
 */

/**
 * Error types of the wire interface and the HTTP status each stands for (a code may override it: see
 * `runtime/errors.ts`).
 */
export const ERROR_STATUS = {
  invalid_request_error: 400,
  unauthorized: 401,
  forbidden: 403,
  not_found: 404,
  payload_too_large: 413,
  unsupported_media_type: 415,
  server_busy: 503,
  insufficient_memory: 503,
  shutting_down: 503,
  server_error: 500,
} as const;

/** A wire error type (`{"error":{"type",...}}`). */
export type ErrorType = keyof typeof ERROR_STATUS;

/**
 * The error type an HTTP status stands for when a body does not say (the first type with that
 * status: 503 is `server_busy`); another 4xx is `invalid_request_error`, anything else `server_error`.
 */
export function typeOfStatus(status: number): ErrorType {
  const type = (Object.keys(ERROR_STATUS) as ErrorType[]).find((t) => ERROR_STATUS[t] === status);
  return type ?? (status >= 400 && status < 500 ? 'invalid_request_error' : 'server_error');
}

/** WebSocket close codes of `/v1/stream` (RFC 6455 section 7.4.1). */
export const CLOSE = {
  NORMAL: 1000,
  GOING_AWAY: 1001,
  /** A frame the endpoint cannot decode (the client sends it for an undecodable event frame). */
  PROTOCOL_ERROR: 1002,
  /** The peer vanished (no close frame). Never sent, only seen. */
  ABNORMAL: 1006,
  /** Not valid UTF-8 in a text frame (sent by `ws`). */
  INVALID_DATA: 1007,
  POLICY: 1008,
  TOO_LARGE: 1009,
  INTERNAL: 1011,
  /** The stream's lease was revoked (a forced unload). */
  FORCE_UNLOAD: 1012,
  BUSY: 1013,
} as const;

/** The error type a close code stands for when no `error` event came before the close. */
export const CLOSE_TYPE: Readonly<Record<number, ErrorType | 'connection_error'>> = {
  [CLOSE.GOING_AWAY]: 'shutting_down',
  [CLOSE.ABNORMAL]: 'connection_error',
  [CLOSE.INVALID_DATA]: 'invalid_request_error',
  [CLOSE.POLICY]: 'invalid_request_error',
  [CLOSE.TOO_LARGE]: 'payload_too_large',
  [CLOSE.INTERNAL]: 'server_error',
  [CLOSE.FORCE_UNLOAD]: 'server_error',
  [CLOSE.BUSY]: 'server_busy',
};

/** Subprotocols of `/v1/stream`: events as JSON text or MessagePack binary frames (the first is the default). */
export const SUBPROTOCOLS = ['voxserve.v1.json', 'voxserve.v1.msgpack'] as const;
export type Subprotocol = (typeof SUBPROTOCOLS)[number];

/**
 * Subprotocol prefix that carries an API key on a stream (`voxserve.key.<key>`), for browsers, which cannot set
 * headers.
 */
export const KEY_PROTOCOL = 'voxserve.key.';
