import { readdirSync, readFileSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { ERRORS, VoxError, errorBody, fromWire, toVoxError, voxError, type ErrorCode } from '../../runtime/errors.js';
import { CLOSE, ERROR_STATUS } from '../../runtime/wire.js';

const root = join(import.meta.dirname, '..', '..');

/** The codes of docs/errors.md: the first cell of each table row, `` | `code` | ``. */
function documentedCodes(): string[] {
  const text = readFileSync(join(root, 'docs', 'errors.md'), 'utf8');
  return [...text.matchAll(/^\| `([a-z_]+)` \|/gm)].map((m) => m[1]);
}

/** Every TypeScript source file of the server and client (not specs, not the catalogue itself). */
function sources(): string[] {
  const out: string[] = [];
  const walk = (dir: string): void => {
    for (const name of readdirSync(dir)) {
      const path = join(dir, name);
      if (statSync(path).isDirectory()) walk(path);
      else if (name.endsWith('.ts') && !name.endsWith('.d.ts')) out.push(path);
    }
  };
  for (const dir of ['actors', 'cluster', 'runtime', 'transport', 'tools', 'client']) walk(join(root, dir));
  return out.filter((p) => !p.endsWith(join('runtime', 'errors.ts')));
}

/** The shorthands of runtime/errors.ts and the code each creates. */
const SHORTHANDS = { invalid: 'invalid_field', toVoxError: 'internal_error' } as const;

/**
 * Codes the sources create: every quoted word in the first argument of `voxError(` (a ternary names several), and the
 * shorthands' codes.
 */
function thrownCodes(): Set<string> {
  const codes = new Set<string>();
  for (const file of sources()) {
    const text = readFileSync(file, 'utf8');
    for (const call of text.matchAll(/voxError\(([^,)]*)/g)) {
      for (const word of call[1].matchAll(/'([a-z_]+)'/g)) codes.add(word[1]);
    }
    for (const [fn, code] of Object.entries(SHORTHANDS)) if (new RegExp(`\\b${fn}\\(`).test(text)) codes.add(code);
  }
  return codes;
}

describe('error catalogue', () => {
  it('docs/errors.md documents every code, once, and nothing else', () => {
    const documented = documentedCodes();
    expect(documented.length).toBeGreaterThan(0);
    expect(new Set(documented).size).toBe(documented.length);
    expect([...documented].sort()).toEqual(Object.keys(ERRORS).sort());
  });

  it('every code is created somewhere in the sources (none documented but unused)', () => {
    const thrown = thrownCodes();
    expect(Object.keys(ERRORS).filter((c) => !thrown.has(c))).toEqual([]);
    // And nothing creates a code the catalogue lacks (the type checker says so too).
    expect([...thrown].filter((c) => !(c in ERRORS))).toEqual([]);
  });

  it('docs/errors.md gives each code the status and Retry-After the catalogue has', () => {
    const text = readFileSync(join(root, 'docs', 'errors.md'), 'utf8');
    for (const code of Object.keys(ERRORS) as ErrorCode[]) {
      const row = new RegExp(`^\\| \`${code}\` \\| (\\d+) \\|(?: (\\d+) \\|)?`, 'm').exec(text);
      expect(row, code).not.toBeNull();
      const e = new VoxError(code, 'x');
      expect(Number(row![1]), code).toBe(e.status);
      if (e.status === 503) expect(Number(row![2]), code).toBe(e.retryAfterS);
    }
  });

  it('an error carries its code, type, status and rendered message on the wire', () => {
    const e = voxError('model_not_found', { id: 'nope' });
    expect(e.status).toBe(404);
    expect(errorBody(e)).toEqual({
      error: {
        type: 'not_found',
        code: 'model_not_found',
        message: "model 'nope' does not exist; GET /v1/models lists the models",
      },
    });
    const busy = voxError('queue_full', { max: 3 });
    expect([busy.type, busy.status, busy.retryAfterS, busy.closeCode]).toEqual(['server_busy', 503, 1, CLOSE.BUSY]);
    expect(voxError('invalid_field', { field: 'sample_rate', problem: 'too low' }).message).toBe(
      'sample_rate: too low',
    );
    expect(voxError('method_not_allowed', { method: 'PUT', path: '/health' }).status).toBe(405);
    expect(voxError('shutting_down').type).toBe('shutting_down');
    // RFC 6455 7.4.1: 1008 policy (the client's mistake), 1011 internal, 1013 try again later.
    expect(voxError('invalid_field', { field: 'a', problem: 'b' }).closeCode).toBe(1008);
    expect(voxError('model_not_found', { id: 'x' }).closeCode).toBe(1008);
    expect(voxError('load_timeout', { ms: 1 }).closeCode).toBe(1011);
    expect(voxError('insufficient_memory', { id: 'm', needed: '1', headroom: '2', free: '3' }).closeCode).toBe(1013);
  });

  it('each type keeps the status the wire interface gives it (DESIGN.md section 4)', () => {
    expect(ERROR_STATUS).toEqual({
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
    });
  });

  it('unknown throws become internal_error with their message; a wire error comes back with its code', () => {
    const e = toVoxError(new RangeError('boom'));
    expect([e.code, e.type, e.status, e.message]).toEqual(['internal_error', 'server_error', 500, 'boom']);
    expect(e.cause).toBeInstanceOf(RangeError);
    const back = fromWire(voxError('audio_too_long', { problem: 'x' }).toWire());
    expect([back.code, back.type, back.message]).toEqual(['audio_too_long', 'invalid_request_error', 'audio: x']);
    expect(fromWire({ code: 'no_such_code', message: 'm' }).code).toBe('internal_error');
  });
});
