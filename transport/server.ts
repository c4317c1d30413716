import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import { WebSocketServer } from 'ws';
import { Supervisor } from '../actors/supervisor.js';
import type { ServerConfig } from '../runtime/config.js';
import { invalid, VoxError } from '../runtime/errors.js';
import type { ModelLoader } from '../runtime/loader.js';
import type { MemoryProbe } from '../runtime/memory.js';
import type { ModelConfig } from '../runtime/config.js';
import { SUBPROTOCOLS, type Subprotocol } from './codec.js';
import { handleRun, parseJsonObject, readBody, sendError, sendJson } from './http.js';
import { StreamConnection } from './stream.js';

/** A running voxserve: HTTP + WebSocket listener over a supervisor. */
export interface VoxServer {
  readonly supervisor: Supervisor;
  readonly http: Server;
  /** `http://host:port` once listening. */
  readonly url: string;
  /** Live WebSocket streams. */
  readonly streams: ReadonlySet<StreamConnection>;
  /**
   * Shuts down: stop accepting (`/ready` 503), close streams with 1001, close the listener and
   * idle connections, unload every model (waiting up to `drain_timeout_ms` for running requests).
   */
  close(): Promise<void>;
}

/** Test seams: a loader (fake slots), the catalog of lazily registered models, the memory probe. */
export interface ServerOptions {
  loader?: ModelLoader;
  catalog?: ModelConfig[];
  memoryProbe?: MemoryProbe;
}

const MANAGEMENT = ['/v1/models/load', '/v1/models/unload', '/v1/models/unload_many', '/v1/models/unload_all'];

function managementAllowed(config: ServerConfig, req: IncomingMessage): void {
  if (!config.management.enabled) {
    throw new VoxError('forbidden', 'management routes are disabled; start the server with --management');
  }
  const token = config.management.token;
  if (token && req.headers.authorization !== `Bearer ${token}`) throw new VoxError('forbidden', 'management routes need Authorization: Bearer <token>');
}

/**
 * Creates the server, starts listening on `config.host:config.port` (port 0 picks a free one),
 * and loads the config's non-lazy models. Resolves once listening; `/ready` turns 200 when the
 * eager loads are done.
 */
export async function startServer(config: ServerConfig, options: ServerOptions = {}): Promise<VoxServer> {
  const supervisor = new Supervisor(config, options);
  const streams = new Set<StreamConnection>();

  const route = async (req: IncomingMessage, res: ServerResponse): Promise<void> => {
    const url = new URL(req.url ?? '/', 'http://localhost');
    const path = url.pathname.replace(/\/+$/, '') || '/';
    const method = req.method ?? 'GET';
    const timeout = config.busy_timeout_ms;
    if (method === 'GET' && path === '/health') return sendJson(res, 200, { status: 'ok', models: supervisor.statuses().length });
    if (method === 'GET' && path === '/ready') {
      return supervisor.accepting ? sendJson(res, 200, { status: 'ready' }) : sendJson(res, 503, { status: supervisor.actor.getSnapshot().value });
    }
    if (method === 'GET' && path === '/v1/models') return sendJson(res, 200, { models: supervisor.statuses() });
    const one = /^\/v1\/models\/([^/]+)$/.exec(path);
    if (method === 'GET' && one) {
      const id = decodeURIComponent(one[1]);
      const status = supervisor.status(id);
      if (!status) throw new VoxError('not_found', `model '${id}' does not exist`);
      return sendJson(res, 200, status);
    }
    if (method === 'POST' && MANAGEMENT.includes(path)) {
      managementAllowed(config, req);
      if (!supervisor.accepting) throw new VoxError('shutting_down', 'the server is shutting down', { retryAfterS: 5 });
      const body = parseJsonObject(await readBody(req, 1024 * 1024));
      if (path === '/v1/models/load') return sendJson(res, 200, await supervisor.load(body, timeout));
      if (path === '/v1/models/unload') {
        if (typeof body.id !== 'string' || !body.id) throw invalid('id: required, a model id string');
        if (body.force !== undefined && typeof body.force !== 'boolean') throw invalid('force: must be a boolean');
        const entry = supervisor.require(body.id);
        await (body.force ? entry.forceUnload() : entry.unload(timeout));
        return sendJson(res, 200, { id: body.id, loaded: false });
      }
      if (path === '/v1/models/unload_many') {
        if (!Array.isArray(body.ids) || !body.ids.every((x) => typeof x === 'string')) throw invalid('ids: required, an array of model id strings');
        return sendJson(res, 200, await supervisor.unloadMany(body.ids as string[], timeout));
      }
      const { unloaded } = await supervisor.unloadMany(supervisor.registeredIds, timeout);
      return sendJson(res, 200, { unloaded });
    }
    if (method === 'POST' && path === '/v1/tasks/run') {
      if (!supervisor.accepting) throw new VoxError('shutting_down', 'the server is shutting down', { retryAfterS: 5 });
      return handleRun(supervisor, config, req, res, url);
    }
    const known = ['/health', '/ready', '/v1/models', ...MANAGEMENT, '/v1/tasks/run', '/v1/stream'];
    if (known.includes(path) || one) throw new VoxError('invalid_request_error', `method ${method} is not allowed on ${path}`);
    throw new VoxError('not_found', `no route ${method} ${path}`);
  };

  const http = createServer({ maxHeaderSize: 16 * 1024, requestTimeout: 60_000, headersTimeout: 10_000 }, (req, res) => {
    route(req, res).catch((err) => {
      sendError(res, err);
      // A body we did not read (e.g. over the size limit) must not be parsed as the next request.
      if (!req.complete) res.once('finish', () => req.socket.destroy());
    });
  });

  const wss = new WebSocketServer({
    noServer: true,
    maxPayload: config.limits.ws_max_frame_bytes,
    handleProtocols: (offered) => SUBPROTOCOLS.find((p) => offered.has(p)) ?? false,
  });
  http.on('upgrade', (req, socket, head) => {
    socket.on('error', () => socket.destroy());
    const path = new URL(req.url ?? '/', 'http://localhost').pathname;
    const refuse = (status: number, text: string): void => {
      socket.end(`HTTP/1.1 ${status} ${text}\r\nConnection: close\r\nContent-Length: 0\r\n\r\n`);
    };
    if (path !== '/v1/stream') return refuse(404, 'Not Found');
    if (!supervisor.accepting) return refuse(503, 'Service Unavailable');
    if (streams.size >= config.limits.max_ws_connections) return refuse(503, 'Service Unavailable');
    wss.handleUpgrade(req, socket, head, (ws) => {
      const protocol = (ws.protocol || SUBPROTOCOLS[0]) as Subprotocol;
      const conn = new StreamConnection(ws, protocol, supervisor, config, (c) => streams.delete(c));
      streams.add(conn);
      void conn.start(req);
    });
  });

  await new Promise<void>((resolve, reject) => {
    http.once('error', reject);
    http.listen(config.port, config.host, () => {
      http.off('error', reject);
      resolve();
    });
  });
  const addr = http.address() as AddressInfo;
  const host = addr.family === 'IPv6' ? `[${addr.address}]` : addr.address;
  void supervisor.start();

  let closing: Promise<void> | null = null;
  return {
    supervisor,
    http,
    url: `http://${host}:${addr.port}`,
    streams,
    close: () =>
      (closing ??= (async () => {
        supervisor.beginShutdown();
        for (const s of streams) s.goAway();
        const closed = new Promise<void>((resolve) => http.close(() => resolve()));
        http.closeIdleConnections();
        await supervisor.stop(config.drain_timeout_ms);
        http.closeAllConnections();
        for (const c of wss.clients) c.terminate();
        await closed;
      })()),
  };
}
