import { readdirSync, readFileSync } from 'node:fs';
import type { ServerResponse } from 'node:http';
import { basename, join } from 'node:path';
import { fileURLToPath } from 'node:url';

/** The package's folder: this file runs from dist/transport, or from transport/ in tests. */
const up = fileURLToPath(new URL('..', import.meta.url));
const packageDir = basename(up) === 'dist' ? join(up, '..') : up;
const { version } = JSON.parse(readFileSync(join(packageDir, 'package.json'), 'utf8')) as { version: string };

/** The reference pages shipped with voxserve (`docs/*.md` in its package and repository), read once. */
const DOCS = (() => {
  try {
    return readdirSync(join(packageDir, 'docs'))
      .filter((f) => f.endsWith('.md'))
      .map((f) => f.slice(0, -3));
  } catch {
    return [];
  }
})();

const page = (title: string, body: string): string => `<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>${title}</title>
<style>body { font: 15px system-ui, sans-serif; margin: 2em auto; max-width: 46em; color: #222; line-height: 1.45; } code { font-size: 13px; background: #f3f3f3; padding: 0 3px; }</style>
</head><body>
${body}
</body></html>`;

/**
 * `GET /`: a small index page for a person who opens the server's address in a browser: what it
 * is, its pages and status routes (the demo and `/debug` only as this server has them), and where
 * the documentation is.
 * @param demo whether `/demo` is served. @param debug whether `/debug` is (management on).
 */
export function homePage(demo: boolean, debug: boolean): string {
  const item = (href: string, what: string): string => `<li><a href="${href}">${href}</a>: ${what}</li>`;
  return page(
    'voxserve',
    `<h1>voxserve ${version}</h1>
<p>Voice models (Silero VAD, openWakeWord, RNNoise) over HTTP, WebSocket and Wyoming.</p>
<ul>
${demo ? item('/demo', 'talk into your microphone and see speech and wake words live') : '<li><code>/demo</code> is off on this server (<code>demo.enabled</code> in the config turns it on)</li>'}
${debug ? item('/debug', 'the state charts of the running server') : item('/debug', 'the state charts (off here: it says how to turn it on)')}
${item('/v1/models', 'the models and their state (JSON)')}
${item('/ready', 'readiness, and models that failed to load')}
${item('/metrics', 'Prometheus metrics')}
</ul>
<p>Find the speech in a file: <code>curl -s -X POST -H 'content-type: audio/wav' --data-binary @speech.wav 'http://HOST:PORT/v1/tasks/run?model=silero-vad'</code>, or <code>voxserve run silero-vad speech.wav</code>.</p>
<p>Documentation: <code>README.md</code> and <code>docs/</code> in the voxserve package (${DOCS.map((d) => `<code>docs/${d}.md</code>`).join(', ')}); <code>voxserve --help</code> for the command line.</p>`,
  );
}

/** `GET /debug` on a server without management: how to turn it on, instead of a bare 403. */
export const DEBUG_OFF_PAGE = page(
  'voxserve /debug is off',
  `<h1>/debug is off on this server</h1>
<p>The state-chart page shows what the server is doing inside, so it is gated like model management. Start the server with</p>
<pre><code>voxserve serve --management --inspect</code></pre>
<p>(<code>--inspect</code> also records every transition). On an address other than loopback, management needs a token:
set <code>management.token</code> in the config and open <code>/debug?token=&lt;token&gt;</code>. See <code>docs/operations.md</code>.</p>
<p><a href="/">voxserve</a></p>`,
);

/** Writes an HTML page with its status. */
export function sendHtml(res: ServerResponse, status: number, html: string): void {
  res.writeHead(status, { 'content-type': 'text/html; charset=utf-8', 'cache-control': 'no-store' });
  res.end(html);
}
