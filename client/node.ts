/**
 * The Node entry of `voxserve/client` (package `exports` condition `node`): the same client,
 * with the `ws` package as its default WebSocket (Node 20 has no global WebSocket), the API key
 * sent on streams as a header, and uploads that wait for the server's `100 Continue`.
 */
import { request as httpRequest, type IncomingMessage } from 'node:http';
import { request as httpsRequest } from 'node:https';
import { Readable } from 'node:stream';
import WebSocket from 'ws';
import { readFile } from 'node:fs/promises';
import { VoxClient as BrowserClient, VoxStream, type ClientOptions, type WebSocketConstructor } from './index.js';

export * from './index.js';

// `stream.sendFile(path)`: under Node a file is read by its path.
VoxStream.readPath = async (path: string) => new Uint8Array(await readFile(path));

/**
 * How long an upload waits for `100 Continue` before it sends its body anyway (RFC 9110, 10.1.1: servers that never
 * answer it), ms.
 */
const CONTINUE_WAIT_MS = 1000;

/**
 * `fetch` for the client under Node. A request with a body is sent with `Expect: 100-continue`
 * (RFC 9110, 10.1.1) over `node:http(s)`: the body goes out only once the server says
 * `100 Continue` (or after {@link CONTINUE_WAIT_MS} without any answer), so a refusal given on
 * the headers (voxserve's 413, 401, 403, 415; a proxy's 413) reaches the caller as a response
 * even when the server then closes the connection. `fetch` (undici) cannot send that header and,
 * still uploading when such a server closes, loses the answer to `ECONNRESET`. Requests without
 * a body go to the global `fetch`.
 * @param init `body` must be a string or a `Uint8Array` (what the client sends); `headers` a plain object.
 * @throws TypeError `fetch failed` with the system error as `cause` when no answer arrived;
 *   the signal's AbortError once it aborts.
 */
export function continueFetch(input: string | URL | Request, init: RequestInit = {}): Promise<Response> {
  if (init.body == null || typeof input !== 'string') return fetch(input, init);
  const body =
    typeof init.body === 'string'
      ? Buffer.from(init.body)
      : Buffer.from(
          (init.body as Uint8Array).buffer,
          (init.body as Uint8Array).byteOffset,
          (init.body as Uint8Array).byteLength,
        );
  const url = new URL(input);
  const headers = {
    ...(init.headers as Record<string, string>),
    'content-length': String(body.length),
    expect: '100-continue',
  };
  return new Promise((resolve, reject) => {
    let answered = false;
    const req = (url.protocol === 'https:' ? httpsRequest : httpRequest)(
      url,
      { method: init.method ?? 'POST', headers, signal: init.signal ?? undefined },
      (res: IncomingMessage) => {
        answered = true;
        clearTimeout(impatient);
        // Answered before the body went out: the connection cannot carry another request.
        if (!req.writableEnded) res.once('end', () => req.destroy());
        const status = res.statusCode ?? 502;
        const h = new Headers();
        for (const [k, v] of Object.entries(res.headers))
          for (const one of Array.isArray(v) ? v : v === undefined ? [] : [v]) h.append(k, one);
        const empty = status === 204 || status === 304 || init.method === 'HEAD';
        resolve(
          new Response(empty ? null : (Readable.toWeb(res) as ReadableStream<Uint8Array>), {
            status,
            statusText: res.statusMessage,
            headers: h,
          }),
        );
      },
    );
    const send = (): void => {
      clearTimeout(impatient);
      if (!answered && !req.writableEnded && !req.destroyed) req.end(body);
    };
    const impatient = setTimeout(send, CONTINUE_WAIT_MS);
    req.on('continue', send);
    req.on('error', (e) => {
      clearTimeout(impatient);
      // An answer that has arrived wins over a later write error.
      if (answered) return;
      reject(e.name === 'AbortError' ? e : new TypeError('fetch failed', { cause: e }));
    });
    req.flushHeaders();
  });
}

/**
 * `ws` that keeps the answer of a refused handshake (401, 403, ...): its socket `error` carries
 * the status in its message (`Unexpected server response: 401`, as `ws` says it) and the
 * `{"error":...}` body as `body`, so the stream's VoxClientError has the server's type and message.
 */
class NodeWebSocket extends WebSocket {
  constructor(url: string, protocols: string | string[], options?: WebSocket.ClientOptions) {
    super(url, protocols, options);
    this.once('unexpected-response', (req, res) => {
      let body = '';
      res.setEncoding('utf8');
      res.on('data', (c: string) => (body = (body + c).slice(0, 64 * 1024)));
      res.on('error', () => {}); // a body cut short: the status is still the answer
      res.on('close', () =>
        req.destroy(Object.assign(new Error(`Unexpected server response: ${res.statusCode}`), { body })),
      );
    });
  }
}

/** {@link BrowserClient} whose default WebSocket is `ws`'s and default fetch {@link continueFetch}. */
export class VoxClient extends BrowserClient {
  constructor(opts: ClientOptions = {}) {
    super({
      WebSocket: NodeWebSocket as unknown as WebSocketConstructor,
      fetch: continueFetch as typeof fetch,
      ...opts,
    });
  }

  /** Under Node the API key goes on the handshake as `Authorization: Bearer <key>`. */
  protected override streamCredentials(apiKey: string): { protocols: string[]; headers?: Record<string, string> } {
    return { protocols: [], headers: { authorization: `Bearer ${apiKey}` } };
  }
}
