import { createServer, ServerResponse, STATUS_CODES, type IncomingMessage, type Server } from 'node:http';
import type { Socket } from 'node:net';
import { Server as NetServer, type AddressInfo } from 'node:net';
import { WebSocketServer } from 'ws';
import { Supervisor, type SupervisorOptions } from '../actors/supervisor.js';
import { createInspection } from '../actors/inspection.js';
import { drainOnShutdown } from '../actors/system.js';
import { queryOptions, type ServerConfig } from '../runtime/config.js';
import { startDecoders } from '../runtime/decode.js';
import { errorBody, invalid, toVoxError, VoxError } from '../runtime/errors.js';
import { CHARTS, DEBUG_PAGE, debugState, ELK_SCRIPT, streamActors } from './debug.js';
import { SUBPROTOCOLS, type Subprotocol } from './codec.js';
import { createHttpSocket } from '../actors/http.js';
import { bindHttp, errorHeaders, parseBatchRequest, parseJsonObject, parseRunRequest, readBody, requireMediaType, requireRunMediaType, sendError, sendJson, type HttpLink } from './http.js';
import { createAccess, isLoopback } from './access.js';
import { createStreamSocket, STREAM_QUERY } from '../actors/stream.js';
import { bindStream, type StreamLink } from './stream.js';
import { demoRoute } from './demo.js';
import { DEBUG_OFF_PAGE, homePage, sendHtml } from './home.js';
import { startWyoming, type WyomingService } from './wyoming.js';
import { ClusterNode } from '../cluster/node.js';
import { clusterSettings } from '../cluster/nats.js';
import { createLogger } from '../runtime/telemetry.js';
import { availableMemory } from '../runtime/memory.js';
import { validateModelConfig } from '../actors/model.js';

/** A running voxserve: HTTP + WebSocket listener over a supervisor. */
export interface VoxServer {
  readonly supervisor: Supervisor;
  readonly http: Server;
  /** `http://host:port` once listening. */
  readonly url: string;
  /** Live WebSocket streams (until their lease is released). */
  readonly streams: ReadonlySet<StreamLink>;
  /** HTTP requests being handled. */
  readonly inflight: ReadonlySet<Promise<void>>;
  /** The Wyoming listener, when `wyoming.enabled`. */
  readonly wyoming: WyomingService | null;
  /** This node's cluster membership, when `cluster` is configured. */
  readonly cluster: ClusterNode | null;
  /**
   * Shuts down in phases (C15): stop accepting (`/ready` and new work 503 `shutting_down`);
   * let running requests finish and finish every stream (last events, `done`, close 1001) for
   * up to `drain_timeout_ms`; then close what is left (streams 1001 with a reason, queued and
   * running HTTP requests 503) and every connection; then unload every model. Resolves when no
   * handler or callback runs any more. A second call skips what is left of the drain.
   */
  close(): Promise<void>;
}

/** Test seams: a loader (fake slots), the catalog of lazily registered models, the memory probe, a logger. */
export type ServerOptions = Pick<SupervisorOptions, 'loader' | 'catalog' | 'memoryProbe' | 'log'>;

const MANAGEMENT = ['/v1/models/load', '/v1/models/unload', '/v1/models/unload_many', '/v1/models/unload_all'];

/** After an error answered before its request body was read, how long the rest is read and discarded before the connection is cut, ms. */
const LINGER_MS = 5000;

/** Answers on a raw socket that is not (or no longer) an HTTP response: a JSON body, then the connection closes. */
function endWithJson(socket: { end(data: string): void }, status: number, body: unknown, headers: Record<string, string> = {}): void {
  const text = JSON.stringify(body);
  const extra = Object.entries(headers).map(([k, v]) => `${k}: ${v}\r\n`).join('');
  socket.end(`HTTP/1.1 ${status} ${STATUS_CODES[status]}\r\nContent-Type: application/json\r\n${extra}Connection: close\r\nContent-Length: ${Buffer.byteLength(text)}\r\n\r\n${text}`);
}

/**
 * At shutdown, once the drain is done, how long idle keep-alive connections are left for their
 * clients' next request (answered 503 with `Connection: close`) before they are closed, ms.
 */
const IDLE_LINGER_MS = 1000;

/**
 * Creates the server, starts listening on `config.host:config.port` (port 0 picks a free one),
 * and loads the config's non-lazy models. Resolves once listening; `/ready` turns 200 when the
 * eager loads are done.
 */
export async function startServer(config: ServerConfig, options: ServerOptions = {}): Promise<VoxServer> {
  if (config.management.enabled && !config.management.token && !isLoopback(config.host)) {
    throw new Error(`refusing to listen on ${config.host} with management enabled and no management.token: anyone who can reach it could load and unload models`);
  }
  startDecoders();
  const access = createAccess(config);
  const inspected = await createInspection(config);
  // Cluster mode: NATS first (a node that cannot reach it fails here, naming the URL); logs carry the node name.
  const baseLog = config.cluster ? (options.log ?? createLogger(config.log_level)).child({ node: clusterSettings(config.cluster).node }) : options.log;
  const cluster = config.cluster ? await ClusterNode.connect(config, { log: baseLog!, memoryProbe: options.memoryProbe ?? availableMemory }) : null;
  const supervisor = new Supervisor(config, { ...options, log: baseLog, inspect: inspected.inspect, place: cluster?.place });
  const { log, metrics } = supervisor;
  const sse = new Set<ServerResponse>();
  const streams = new Set<StreamLink>();
  const inflight = new Set<Promise<void>>();

  const demoOn = config.demo.enabled ?? isLoopback(config.host);
  const demo = demoRoute(demoOn);

  const route = async (req: IncomingMessage, res: ServerResponse, link: HttpLink, rid: number): Promise<void> => {
    const url = new URL(req.url ?? '/', 'http://localhost');
    const path = url.pathname.replace(/\/+$/, '') || '/';
    const method = req.method ?? 'GET';
    const timeout = config.busy_timeout_ms;
    access.host(req);
    const preflight = method === 'OPTIONS';
    for (const [k, v] of Object.entries(access.origin(req, preflight))) res.setHeader(k, v);
    if (preflight) {
      res.writeHead(204, { allow: 'GET, POST, OPTIONS' });
      return void res.end();
    }
    if (method === 'GET' && path === '/') return sendHtml(res, 200, homePage(demoOn, config.management.enabled));
    if (method === 'GET' && path === '/debug' && !config.management.enabled) return sendHtml(res, 403, DEBUG_OFF_PAGE);
    if (method === 'GET' && path === '/health') return sendJson(res, 200, { status: 'ok', models: supervisor.statuses().length });
    if (method === 'GET' && path === '/ready') {
      if (!supervisor.accepting) return sendJson(res, 503, { status: supervisor.phase });
      const failed = supervisor.failedModels();
      // Still ready (the other models serve), but a configured model that failed to load is named.
      const clustered = cluster ? { cluster: { node: cluster.name, nats: cluster.connected ? 'connected' : 'disconnected' } } : {};
      return sendJson(res, 200, failed.length ? { status: 'ready', failed_models: failed, ...clustered } : { status: 'ready', ...clustered });
    }
    if (method === 'GET' && path === '/v1/models') return sendJson(res, 200, { models: withNodes(supervisor.statuses()), failed_models: supervisor.failedModels() });
    if (method === 'GET' && path === '/v1/cluster') {
      if (!cluster) throw new VoxError('not_found', 'this server is not part of a cluster (start it with --cluster <nats-url>)');
      return sendJson(res, 200, cluster.status());
    }
    if (method === 'GET' && path === '/metrics') {
      for (const m of supervisor.statuses()) {
        metrics.queued.set({ model: m.id }, m.queued_requests);
        metrics.activeSlots.set({ model: m.id }, m.active_slots);
        metrics.resident.set({ model: m.id }, m.resident_bytes);
      }
      metrics.wsConnections.set(streams.size);
      metrics.wsBuffered.set([...streams].reduce((n, s) => n + s.ws.bufferedAmount, 0));
      const text = await metrics.registry.metrics();
      res.writeHead(200, { 'content-type': metrics.registry.contentType });
      return void res.end(text);
    }
    if (method === 'GET' && (path === '/debug' || path.startsWith('/debug/'))) {
      // The page and its layout script hold no data.
      access.management(req, path === '/debug' || path === '/debug/elk.js');
      if (path === '/debug/elk.js') {
        res.writeHead(200, { 'content-type': 'text/javascript; charset=utf-8', 'cache-control': 'max-age=3600' });
        return void res.end(ELK_SCRIPT);
      }
      if (path === '/debug/charts') return sendJson(res, 200, CHARTS);
      if (path === '/debug') {
        res.writeHead(200, { 'content-type': 'text/html; charset=utf-8', 'cache-control': 'no-store' });
        return void res.end(DEBUG_PAGE);
      }
      if (path === '/debug/state') return sendJson(res, 200, debugState(supervisor, streams, inspected.log));
      if (path === '/debug/actors') return streamActors(res, inspected.log, sse);
    }
    if ((method === 'GET' || method === 'HEAD') && (path === '/demo' || path.startsWith('/demo/'))) return demo(path, res);
    const one = /^\/v1\/models\/([^/]+)$/.exec(path);
    if (method === 'GET' && one) {
      let id: string;
      try {
        id = decodeURIComponent(one[1]);
      } catch {
        throw invalid(`model id in the path is not valid percent-encoding: ${one[1].slice(0, 64)}`);
      }
      const status = supervisor.status(id);
      if (!status) throw supervisor.unknownModel(id);
      return sendJson(res, 200, cluster ? withNodes([status])[0] : status);
    }
    if (method === 'POST' && MANAGEMENT.includes(path)) {
      access.management(req);
      requireMediaType(req, ['application/json']);
      if (!supervisor.accepting) throw supervisor.notAccepting();
      const body = parseJsonObject(await readBody(req, res, 1024 * 1024, config.limits.idle_ms));
      // A manager whose client goes away leaves the model's queue.
      const gone = new AbortController();
      res.on('close', () => res.writableFinished || gone.abort());
      if (cluster) return sendJson(res, 200, await manageCluster(cluster, path, body));
      if (path === '/v1/models/load') {
        return sendJson(res, 200, await supervisor.load(body, timeout, gone.signal));
      }
      if (path === '/v1/models/unload') {
        if (typeof body.id !== 'string' || !body.id) throw invalid('id: required, a model id string');
        if (body.force !== undefined && typeof body.force !== 'boolean') throw invalid('force: must be a boolean');
        const entry = supervisor.require(body.id);
        await (body.force ? entry.forceUnload() : entry.unload(timeout, gone.signal));
        return sendJson(res, 200, { id: body.id, loaded: false });
      }
      if (path === '/v1/models/unload_many') {
        if (!Array.isArray(body.ids) || !body.ids.every((x) => typeof x === 'string')) throw invalid('ids: required, an array of model id strings');
        return sendJson(res, 200, await supervisor.unloadMany(body.ids as string[], timeout, gone.signal));
      }
      const { unloaded } = await supervisor.unloadMany(supervisor.registeredIds, timeout, gone.signal);
      return sendJson(res, 200, { unloaded });
    }
    if (method === 'POST' && (path === '/v1/tasks/run' || path === '/v1/tasks/batch')) {
      access.apiKey(req);
      if (path === '/v1/tasks/run') requireRunMediaType(req);
      else requireMediaType(req, ['application/json']);
      if (!supervisor.accepting) throw supervisor.notAccepting();
      // Transport parses; the connection's socket actor runs the task in an exchange that holds the lease.
      const t0 = performance.now();
      const body = await readBody(req, res, config.limits.max_body_bytes, config.limits.idle_ms);
      const request = path === '/v1/tasks/run' ? parseRunRequest(req, url, body, t0) : parseBatchRequest(url, body, t0);
      return link.tell({ type: 'TASK', rid, request });
    }
    const known = ['/health', '/ready', '/metrics', '/demo', '/debug', '/debug/state', '/debug/actors', '/debug/charts', '/debug/elk.js', '/v1/models', ...MANAGEMENT, '/v1/tasks/run', '/v1/tasks/batch', '/v1/stream'];
    if (known.includes(path) || one) throw new VoxError('invalid_request_error', `method ${method} is not allowed on ${path}`);
    throw new VoxError('not_found', `no route ${method} ${path}`);
  };

  /** In a cluster, each model's status gains the nodes holding it; models held only elsewhere are listed too. */
  const withNodes = <T extends { id: string }>(list: T[]): (T & { nodes?: unknown[] })[] => {
    if (!cluster) return list;
    const held = cluster.holdersByModel();
    const out: (T & { nodes?: unknown[] })[] = list.map((m) => ({ ...m, nodes: held.get(m.id) ?? [] }));
    for (const [id, nodes] of held) if (!list.some((m) => m.id === id)) out.push({ id, task: nodes[0].task, state: 'unloaded', loaded: false, nodes } as unknown as T & { nodes: unknown[] });
    return out;
  };

  /** Management routes in a cluster: load by placement (`node`, `replicas`), unloads on every node unless `node`. */
  const manageCluster = async (c: ClusterNode, path: string, body: Record<string, unknown>): Promise<unknown> => {
    if (path === '/v1/models/load') {
      return c.manageLoad(body, (fields) => {
        const known = typeof fields.id === 'string' ? supervisor.configOf(fields.id) : undefined;
        return validateModelConfig(known ? { ...known, ...fields } : fields);
      });
    }
    if (body.force !== undefined && typeof body.force !== 'boolean') throw invalid('force: must be a boolean');
    if (path === '/v1/models/unload') {
      if (typeof body.id !== 'string' || !body.id) throw invalid('id: required, a model id string');
      const r = await c.manageUnload([body.id], body.node, body.force === true);
      if (r.not_found.includes(body.id)) throw new VoxError('not_found', `model '${body.id}' does not exist`);
      return { id: body.id, loaded: false, nodes: r.nodes };
    }
    if (path === '/v1/models/unload_many') {
      if (!Array.isArray(body.ids) || !body.ids.every((x) => typeof x === 'string')) throw invalid('ids: required, an array of model id strings');
      return c.manageUnload(body.ids as string[], body.node);
    }
    const { unloaded, nodes } = await c.manageUnload(undefined, body.node);
    return { unloaded, nodes };
  };

  const headersTimeout = config.limits.headers_timeout_ms;
  const http = createServer(
    {
      maxHeaderSize: config.limits.max_header_bytes,
      headersTimeout: headersTimeout || undefined,
      requestTimeout: 0, // bodies have their own idle deadline (readBody)
      keepAliveTimeout: 0, // an idle keep-alive connection is closed by its socket actor (limits.idle_ms)
      // How often node checks the headers deadline (its default, 30 s, would make it useless).
      connectionsCheckingInterval: headersTimeout ? Math.max(50, Math.min(1000, headersTimeout / 4)) : undefined,
    },
    (req, res) => handle(req, res),
  );
  // `Expect: 100-continue` is answered by readBody once every check has passed, not at once.
  http.on('checkContinue', (req, res) => handle(req, res));
  /** Open HTTP connections (upgraded ones leave): at shutdown, idle ones are given time to close by themselves. */
  const connections = new Set<Socket>();
  http.on('connection', (socket: Socket) => {
    connections.add(socket);
    socket.once('close', () => connections.delete(socket));
  });
  /** Each connection's HTTP socket actor, created with its first request (a WebSocket upgrade never needs one). */
  const links = new WeakMap<object, HttpLink>();
  const linkOf = (socket: Socket): HttpLink => {
    let link = links.get(socket);
    if (link) return link;
    const actor = createHttpSocket({ limits: config.limits, registry: supervisor }, inspected.inspect);
    link = bindHttp(socket, actor);
    links.set(socket, link);
    drainOnShutdown(supervisor.root, actor);
    const peerGone = (): void => link!.tell({ type: 'PEER_CLOSED' });
    if (socket.destroyed) peerGone();
    else socket.once('close', peerGone);
    return link;
  };
  function handle(req: IncomingMessage, res: ServerResponse): void {
    if (!supervisor.accepting) res.setHeader('connection', 'close');
    const link = linkOf(req.socket);
    const rid = link.begin(res);
    // In flight until the response has closed (task responses are written after `route` returns).
    const closed = new Promise<void>((resolve) => res.once('close', resolve));
    const handled: Promise<void> = route(req, res, link, rid)
      .catch((err) => {
        sendError(res, err);
        // A body we did not read (e.g. over the size limit) is read and discarded after the
        // answer, for a while: closing with unread data would reset the connection, and the
        // client could lose the answer while it still uploads.
        if (!req.complete && !req.destroyed) {
          req.resume();
          const cut = setTimeout(() => req.socket?.destroy(), LINGER_MS);
          req.once('end', () => clearTimeout(cut)).once('close', () => clearTimeout(cut));
        }
      })
      .then(() => closed)
      .finally(() => inflight.delete(handled));
    inflight.add(handled);
  }
  http.on('clientError', (err: NodeJS.ErrnoException, socket) => {
    // Garbage request lines, oversized headers, header timeouts: answer if the socket can still take it.
    if (!socket.writable) return socket.destroy();
    const status = err.code === 'HPE_HEADER_OVERFLOW' ? 431 : err.code === 'ERR_HTTP_REQUEST_TIMEOUT' ? 408 : 400;
    endWithJson(socket, status, { error: { type: 'invalid_request_error', message: `malformed request: ${err.code ?? err.message}` } });
  });

  const wss = new WebSocketServer({
    noServer: true,
    maxPayload: config.limits.ws_max_frame_bytes,
    handleProtocols: (offered) => SUBPROTOCOLS.find((p) => offered.has(p)) ?? false,
  });
  http.on('upgrade', (req, socket, head) => {
    socket.on('error', () => socket.destroy());
    connections.delete(socket as Socket);
    // The connection leaves HTTP: a stream socket actor (or this handler's answer) owns it now.
    if ((req.headers.upgrade ?? '').toLowerCase() === 'websocket') links.get(socket)?.tell({ type: 'UPGRADED' });
    const target = new URL(req.url ?? '/', 'http://localhost');
    const path = target.pathname;
    const refuse = (e: VoxError): void => endWithJson(socket, e.status, errorBody(e), errorHeaders(e));
    if ((req.headers.upgrade ?? '').toLowerCase() !== 'websocket') {
      // Another protocol (e.g. curl's h2c offer): answer a body-less request over HTTP/1.1 as usual.
      if (req.method !== 'GET' && req.method !== 'HEAD') return refuse(invalid(`Upgrade: ${req.headers.upgrade} is not supported`));
      const res = new ServerResponse(req);
      res.assignSocket(socket as Socket);
      res.shouldKeepAlive = false;
      res.on('finish', () => socket.end());
      return handle(req, res);
    }
    try {
      access.host(req);
      access.origin(req);
      if (path.replace(/\/+$/, '') !== '/v1/stream') throw new VoxError('not_found', `no WebSocket route ${path}; streams are at /v1/stream`);
      access.apiKey(req, (req.headers['sec-websocket-protocol'] ?? '').split(',').map((p) => p.trim()));
      // An unknown query parameter (a typo such as `samplerate`) is refused before the upgrade;
      // bad values of known ones are reported on the open stream (error event, close 1008).
      queryOptions(target.searchParams, STREAM_QUERY);
      if (!supervisor.accepting) throw supervisor.notAccepting();
      if (streams.size >= config.limits.max_ws_connections) throw new VoxError('server_busy', `limits.max_ws_connections (${config.limits.max_ws_connections}) reached`);
    } catch (e) {
      return refuse(toVoxError(e));
    }
    if (socket.destroyed) return;
    wss.handleUpgrade(req, socket, head, (ws) => {
      const protocol = (ws.protocol || SUBPROTOCOLS[0]) as Subprotocol;
      const socketActor = createStreamSocket({ url: req.url ?? '/', limits: config.limits, registry: supervisor }, inspected.inspect);
      drainOnShutdown(supervisor.root, socketActor.actor);
      const link = bindStream(ws, socketActor, protocol, config.limits);
      streams.add(link);
      void link.released.then(() => streams.delete(link));
    });
  });

  await new Promise<void>((resolve, reject) => {
    http.once('error', reject);
    http.listen(config.port, config.host, () => {
      http.off('error', reject);
      resolve();
    });
  }).catch(async (e) => {
    await cluster?.close();
    throw e;
  });
  const addr = http.address() as AddressInfo;
  const host = addr.family === 'IPv6' ? `[${addr.address}]` : addr.address;
  let wyoming: WyomingService | null = null;
  if (config.wyoming.enabled) {
    try {
      wyoming = await startWyoming(config, supervisor, inspected.inspect);
    } catch (e) {
      http.close();
      throw e;
    }
    log.info({ uri: wyoming.uri }, 'wyoming listening');
  }
  /** Wyoming connections count as streams in the drain. */
  const wyomingLinks = (): { released: Promise<void>; actor: { send: (e: { type: 'GO_AWAY'; reason: string }) => void } }[] => [...(wyoming?.links ?? [])];
  if (cluster) {
    try {
      await cluster.attach(supervisor, `http://${host}:${addr.port}`);
    } catch (e) {
      http.close();
      await cluster.close();
      throw e;
    }
  }
  void supervisor.start();

  let closing: Promise<void> | null = null;
  let skipDrain = (): void => {};
  const close = async (): Promise<void> => {
    // Phase 1: stop accepting work. The listener stays up, so /ready answers 503 and new
    // requests get 503 shutting_down (with Connection: close) while the drain lasts.
    supervisor.beginShutdown();
    cluster?.drain();
    log.info({ drain_timeout_ms: config.drain_timeout_ms, streams: streams.size, wyoming: wyoming?.links.size, requests: inflight.size }, 'shutting down');
    for (const res of sse) res.end();
    const deadline = performance.now() + config.drain_timeout_ms;
    let skipped = false;
    // Phase 2 (the root's `drain`, sent by beginShutdown): running work finishes; streams get their last events and `done`.
    const drained = Promise.all([...[...streams, ...wyomingLinks()].map((s) => s.released), ...inflight]);
    let timer: NodeJS.Timeout | undefined;
    await Promise.race([
      drained,
      new Promise<void>((resolve) => {
        skipDrain = () => {
          skipped = true;
          resolve();
        };
        timer = setTimeout(resolve, config.drain_timeout_ms);
      }),
    ]);
    clearTimeout(timer);
    // Phase 3: the listener closes (new connections are refused). An idle keep-alive connection
    // is closed only after its client had a chance to send its next request and get the 503
    // with `Connection: close` (up to IDLE_LINGER_MS, within the drain deadline): closing it
    // while a request is on its way resets that request. Then what is left is cut off.
    // (net.Server's close: http.Server's would close the idle connections at once.)
    const listenerClosed = new Promise<void>((resolve) => NetServer.prototype.close.call(http, () => resolve()));
    const lingerEnd = Math.min(deadline, performance.now() + IDLE_LINGER_MS);
    while (connections.size > 0 && !skipped && performance.now() < lingerEnd) await new Promise((r) => setTimeout(r, 20));
    http.closeIdleConnections();
    for (const s of [...streams, ...wyomingLinks()]) s.actor.send({ type: 'GO_AWAY', reason: 'server shutting down: drain deadline passed' });
    supervisor.revokeAll(supervisor.notAccepting());
    const wyomingClosed = wyoming ? new Promise<void>((resolve) => wyoming!.server.close(() => resolve())) : Promise.resolve();
    await Promise.all([...[...streams, ...wyomingLinks()].map((s) => s.released), ...inflight]);
    http.closeAllConnections();
    for (const c of wss.clients) c.terminate();
    for (const socket of wyoming?.sockets ?? []) socket.destroy();
    // Phase 4: unload every model.
    await supervisor.stop(0);
    await cluster?.close();
    await listenerClosed;
    await wyomingClosed;
    inspected.stop();
    log.info('stopped');
    log.flush();
  };
  return {
    supervisor,
    http,
    url: `http://${host}:${addr.port}`,
    streams,
    inflight,
    wyoming,
    cluster,
    close: () => {
      if (closing) {
        skipDrain();
        return closing;
      }
      return (closing = close());
    },
  };
}
