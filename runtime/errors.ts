/**
 * The error types of the wire interface (DESIGN.md section 4) and their HTTP status codes.
 * Every error a client can see is a {@link VoxError}; anything else is reported as `server_error`.
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

export type ErrorType = keyof typeof ERROR_STATUS;

/** An error with a wire type. `retryAfterS` (seconds) is sent as `Retry-After` on 503s. */
export class VoxError extends Error {
  readonly type: ErrorType;
  readonly retryAfterS?: number;
  constructor(type: ErrorType, message: string, options: { retryAfterS?: number; cause?: unknown } = {}) {
    super(message, { cause: options.cause });
    this.name = 'VoxError';
    this.type = type;
    this.retryAfterS = options.retryAfterS;
  }
  /** HTTP status code for this error's type. */
  get status(): number {
    return ERROR_STATUS[this.type];
  }
}

/** Shorthand for a 400 `invalid_request_error`. */
export function invalid(message: string): VoxError {
  return new VoxError('invalid_request_error', message);
}

/** Wraps anything thrown into a VoxError (unknown errors become `server_error`, message kept). */
export function toVoxError(err: unknown): VoxError {
  if (err instanceof VoxError) return err;
  const message = err instanceof Error ? err.message : String(err);
  return new VoxError('server_error', message, { cause: err });
}

/** The wire body of an error: `{"error":{"type","message"}}`. */
export function errorBody(err: VoxError): { error: { type: ErrorType; message: string } } {
  return { error: { type: err.type, message: err.message } };
}
