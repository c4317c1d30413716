import { readdirSync, readFileSync } from 'node:fs';
import { basename, extname, join, relative, sep } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { ServerResponse } from 'node:http';
import { voxError } from '../runtime/errors.js';

/**
 * Where `npm run build` (vite, demo/vite.config.mjs) puts the /demo page: dist/demo (this file runs from
 * dist/transport, or from transport/ in tests).
 */
const up = fileURLToPath(new URL('..', import.meta.url));
const DEMO_DIR = basename(up) === 'dist' ? join(up, 'demo') : join(up, 'dist', 'demo');

const TYPES: Record<string, string> = {
  '.html': 'text/html; charset=utf-8',
  '.js': 'text/javascript; charset=utf-8',
  '.css': 'text/css; charset=utf-8',
  '.png': 'image/png',
  '.svg': 'image/svg+xml',
};

/**
 * The page may load only its own files and talk only to this server; WASM (the resampler) may
 * compile.
 */
const CSP =
  "default-src 'self'; script-src 'self' 'wasm-unsafe-eval'; connect-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'";

/** The built demo's files by URL path (`/demo`, `/demo/assets/...`), read once; empty when not built. */
function readDemo(): Map<string, { type: string; body: Buffer }> {
  const files = new Map<string, { type: string; body: Buffer }>();
  const walk = (dir: string): void => {
    let entries;
    try {
      entries = readdirSync(dir, { withFileTypes: true });
    } catch {
      return;
    }
    for (const e of entries) {
      const path = join(dir, e.name);
      if (e.isDirectory()) walk(path);
      else if (TYPES[extname(e.name)])
        files.set(`/demo/${relative(DEMO_DIR, path).split(sep).join('/')}`, {
          type: TYPES[extname(e.name)],
          body: readFileSync(path),
        });
    }
  };
  walk(DEMO_DIR);
  const index = files.get('/demo/index.html');
  if (index) files.set('/demo', index);
  return files;
}

/**
 * Serves `GET /demo` and its files from memory (read at server start).
 * @returns a handler that answers a `/demo` path.
 * @throws VoxError `not_found` for a file the demo does not have, or when it is off or not built.
 */
export function demoRoute(enabled: boolean): (path: string, res: ServerResponse) => void {
  const files = enabled ? readDemo() : new Map();
  return (path, res) => {
    if (!enabled) throw voxError('demo_disabled');
    if (!files.size) throw voxError('demo_not_built');
    const file = files.get(path);
    if (!file) throw voxError('route_not_found', { route: path, hint: 'the demo has no such file' });
    res.writeHead(200, {
      'content-type': file.type,
      'content-length': file.body.length,
      'cache-control': path.startsWith('/demo/assets/') ? 'max-age=31536000, immutable' : 'no-store',
      'x-content-type-options': 'nosniff',
      ...(file.type.startsWith('text/html') ? { 'content-security-policy': CSP } : {}),
    });
    res.end(file.body);
  };
}
