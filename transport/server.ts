import type { InspectionEvent } from 'xstate';
import { createServer, ServerResponse, STATUS_CODES, type IncomingMessage, type Server } from 'node:http';
import type { Socket } from 'node:net';
import type { Duplex } from 'node:stream';
import { Server as NetServer, type AddressInfo } from 'node:net';
import { WebSocketServer } from 'ws';
import { Supervisor, type SupervisorOptions } from '../actors/supervisor.js';
import { createInspection, type Inspection } from '../actors/inspection.js';
import { drainOnShutdown, type SystemEvent } from '../actors/system.js';
import { queryOptions, type ServerConfig } from '../runtime/config.js';
import { startDecoders } from '../runtime/audio/decode.js';
import { errorBody, toVoxError, voxError, type VoxError } from '../runtime/errors.js';
import { SUBPROTOCOLS, type Subprotocol } from '../runtime/wire.js';
import { createHttpSocket } from '../actors/http.js';
import { bindHttp, errorHeaders, requestUrl, sendError, type HttpLink } from './http.js';
import { createAccess, isLoopback, type Access } from './access.js';
import { createStreamSocket, finishWaiting, STREAM_QUERY, streamSocketMachine } from '../actors/stream.js';
import { ActorDirectory } from './debug.js';
import { bindStream, type StreamLink } from './stream.js';
import { createDispatch, type Dispatch } from './routes.js';
import { startWyoming, type WyomingService } from './wyoming.js';
import { checkWyomingDenoise } from '../actors/wyoming.js';
import { membershipMachine } from '../cluster/membership.js';
import { announceWyoming, zeroconfWanted, type Announcement } from './zeroconf.js';
import { ClusterNode } from '../cluster/node.js';
import { placementMachine } from '../cluster/placement-chart.js';
import { clusterSettings } from '../cluster/nats.js';
import { createLogger } from '../runtime/telemetry.js';
import { availableMemory, IdleCollector } from '../runtime/memory.js';
import { checkWakewordDir } from '../runtime/wakeword/wakeword-dir.js';

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
  /** The Wyoming listener's zeroconf announcement (`_wyoming._tcp`), when made (`wyoming.zeroconf`). */
  readonly zeroconf: Announcement | null;
  /** This node's cluster membership, when `cluster` is configured. */
  readonly cluster: ClusterNode | null;
  /** The collection of garbage once the server idles (runtime/memory.ts): `runs` counts those done. */
  readonly idleGc: Pick<IdleCollector, 'runs'>;
  /**
   * Shuts down in phases (C15), as the system chart (actors/system.ts) says: stop accepting
   * (`/ready` and new work 503 `shutting_down`); let running requests finish and finish every
   * stream (last events, `done`, close 1001) for up to `drain_timeout_ms`; then close what is
   * left (streams 1001 with a reason, queued and running HTTP requests 503) and every
   * connection; then unload every model. Resolves when no handler or callback runs any more.
   * Calling it again returns the same promise.
   */
  close(): Promise<void>;
  /**
   * Shuts down at once: what runs is cut off as at the drain deadline (streams 1001 "server
   * shutting down: drain cut short", requests 503), then connections close and models unload.
   * During a `close()` it cuts the drain short. Resolves when `close()` would.
   */
  destroy(): Promise<void>;
}

/** Test seams: a loader (fake slots), the catalog of lazily registered models, the memory probe, a logger. */
export type ServerOptions = Pick<SupervisorOptions, 'loader' | 'catalog' | 'memoryProbe' | 'log'>;

/** Methods RFC 9110 section 9.2.1 calls safe: pipelined, they may be handled together (RFC 9112 section 9.3.2). */
const SAFE_METHODS = ['GET', 'HEAD', 'OPTIONS', 'TRACE'];

/**
 * After an error answered before its request body was read, how long the rest is read and discarded before the
 * connection is cut, ms.
 */
const LINGER_MS = 5000;

/** Answers on a raw socket that is not (or no longer) an HTTP response: a JSON body, then the connection closes. */
function endWithJson(
  socket: { end(data: string): void },
  status: number,
  body: unknown,
  headers: Record<string, string> = {},
): void {
  const text = JSON.stringify(body);
  const extra = Object.entries(headers)
    .map(([k, v]) => `${k}: ${v}\r\n`)
    .join('');
  socket.end(
    `HTTP/1.1 ${status} ${STATUS_CODES[status]}\r\nContent-Type: application/json\r\n${extra}Connection: close\r\nContent-Length: ${Buffer.byteLength(text)}\r\n\r\n${text}`,
  );
}

/** What the pieces of one running server share. */
interface Running {
  readonly config: ServerConfig;
  readonly supervisor: Supervisor;
  readonly access: Access;
  readonly inspected: Inspection;
  readonly cluster: ClusterNode | null;
  /** Open `/debug/actors` event streams. */
  readonly sse: Set<ServerResponse>;
  readonly streams: Set<StreamLink>;
  readonly inflight: Set<Promise<void>>;
  /** Open HTTP connections (upgraded ones leave): at shutdown, idle ones are given time to close by themselves. */
  readonly connections: Set<Socket>;
  /** Each connection's HTTP socket actor, created with its first request (a WebSocket upgrade never needs one). */
  readonly links: WeakMap<object, HttpLink>;
  readonly idleGc: IdleCollector;
  /** The Wyoming listener, once started (`wyoming.enabled`). */
  wyoming: WyomingService | null;
  /** Every actor `/debug` shows: the root's tree, and each socket actor. */
  readonly actors: ActorDirectory;
  /** Its zeroconf announcement (`wyoming.zeroconf`), once made. */
  zeroconf?: Announcement;
  /** Tells the system root an event, unless it has stopped. */
  tell(event: SystemEvent): void;
}

/** Refuses a management API open to the network without a token. @throws Error naming the host. */
function refuseOpenManagement(config: ServerConfig): void {
  if (config.management.enabled && !config.management.token && !isLoopback(config.host)) {
    throw new Error(
      `refusing to listen on ${config.host} with management enabled and no management.token: anyone who can reach it could load and unload models`,
    );
  }
}

/** Cluster mode: NATS first (a node that cannot reach it fails here, naming the URL); logs carry the node name. */
async function joinCluster(
  config: ServerConfig,
  options: ServerOptions,
  inspect?: (e: InspectionEvent) => void,
): Promise<{ log: ServerOptions['log']; cluster: ClusterNode | null }> {
  if (!config.cluster) return { log: options.log, cluster: null };
  const log = (options.log ?? createLogger(config.log_level)).child({ node: clusterSettings(config.cluster).node });
  const cluster = await ClusterNode.connect(config, {
    log,
    memoryProbe: options.memoryProbe ?? availableMemory,
    inspect,
  });
  return { log, cluster };
}

/** The HTTP server with the request deadlines of `config.limits`; `handle` answers every request. */
function createListener(
  config: ServerConfig,
  handle: (req: IncomingMessage, res: ServerResponse) => void,
): { http: Server; headersTimeout: number; requestTimeout: number } {
  const headersTimeout = config.limits.headers_timeout_ms;
  // node refuses a headers deadline past the whole request's: the request's is raised to the headers'.
  const requestTimeout = config.limits.request_timeout_ms && Math.max(config.limits.request_timeout_ms, headersTimeout);
  const shortest = Math.min(...[headersTimeout, requestTimeout].filter((ms) => ms > 0));
  const http = createServer(
    {
      maxHeaderSize: config.limits.max_header_bytes,
      headersTimeout: headersTimeout || undefined,
      // The whole request's deadline (a body also has its idle deadline, readBody): answered 408 on 'clientError'.
      requestTimeout,
      keepAliveTimeout: 0, // an idle keep-alive connection is closed by its socket actor (limits.idle_ms)
      // How often node checks these deadlines (its default, 30 s, would make short ones useless).
      connectionsCheckingInterval: Number.isFinite(shortest) ? Math.max(50, Math.min(1000, shortest / 4)) : undefined,
    },
    handle,
  );
  // `Expect: 100-continue` is answered by readBody once every check has passed, not at once.
  http.on('checkContinue', handle);
  return { http, headersTimeout, requestTimeout };
}

/** A connection's HTTP socket actor, created and bound with its first request. */
function linkOf(run: Running, socket: Socket): HttpLink {
  const link = run.links.get(socket);
  if (link) return link;
  const { config, supervisor, inspected } = run;
  const actor = createHttpSocket(
    { limits: config.limits, registry: supervisor, bytesRead: () => socket.bytesRead },
    inspected.inspect,
  );
  const bound = bindHttp(socket, actor);
  run.links.set(socket, bound);
  // Listed at /debug (a management route): tracked only when management is on.
  if (config.management.enabled) run.actors.add(actor);
  drainOnShutdown(supervisor.root, actor);
  const peerGone = (): void => bound.tell({ type: 'PEER_CLOSED' });
  if (socket.destroyed) peerGone();
  else socket.once('close', peerGone);
  return bound;
}

/**
 * Handles one HTTP request: it waits for its turn on the connection (pipelining), is answered by
 * `dispatch`, and counts as in flight until its response has closed. An error is answered.
 */
function requestHandler(run: Running, dispatch: Dispatch): (req: IncomingMessage, res: ServerResponse) => void {
  return (req, res) => {
    if (!run.supervisor.accepting) res.setHeader('connection', 'close');
    const link = linkOf(run, req.socket);
    const { rid, started } = link.begin(res, SAFE_METHODS.includes(req.method ?? ''));
    // In flight until the response has closed (task responses are written after `route` returns).
    const closed = new Promise<void>((resolve) => res.once('close', resolve));
    // Pipelined requests are handled when the connection's socket actor says (RFC 9112 section 9.3.2).
    const handled: Promise<void> = started
      .then((go) => (go ? dispatch(req, res, link, rid) : undefined))
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
      .finally(() => run.inflight.delete(handled));
    run.inflight.add(handled);
  };
}

/**
 * Answers what node's parser refuses (garbage request lines, oversized headers, deadlines) if the socket can still take
 * it.
 */
function clientErrorHandler(headersTimeout: number, requestTimeout: number) {
  return (err: NodeJS.ErrnoException, socket: Duplex): void => {
    if (!socket.writable) return void socket.destroy();
    // Past limits.request_timeout_ms with the headers in and the body still arriving: the request's
    // own response answers 408, and the connection closes (the rest of the body is not read).
    const res = (socket as { _httpMessage?: ServerResponse | null })._httpMessage;
    if (err.code === 'ERR_HTTP_REQUEST_TIMEOUT' && res?.req && !res.req.complete) {
      if (res.headersSent) return void socket.destroy();
      res.shouldKeepAlive = false;
      return sendError(res, voxError('request_timeout', { ms: requestTimeout }));
    }
    const reason = err.code ?? err.message;
    const e =
      err.code === 'ERR_HTTP_REQUEST_TIMEOUT'
        ? voxError('headers_timeout', { ms: headersTimeout })
        : voxError(err.code === 'HPE_HEADER_OVERFLOW' ? 'headers_too_large' : 'malformed_request', { reason });
    endWithJson(socket, e.status, errorBody(e));
  };
}

/**
 * The checks a WebSocket upgrade passes before it becomes a stream: Host, Origin, path, API key,
 * query parameter names, accepting work, the stream limit.
 * @throws VoxError the refusal.
 */
function checkStreamUpgrade(run: Running, req: IncomingMessage, target: URL): void {
  const { access, supervisor, config } = run;
  const path = target.pathname;
  access.host(req);
  access.origin(req);
  if (path.replace(/\/+$/, '') !== '/v1/stream')
    throw voxError('route_not_found', { route: `WebSocket ${path}`, hint: 'streams are at /v1/stream' });
  access.apiKey(
    req,
    (req.headers['sec-websocket-protocol'] ?? '').split(',').map((p) => p.trim()),
  );
  // An unknown query parameter (a typo such as `samplerate`) is refused before the upgrade;
  // bad values of known ones are reported on the open stream (error event, close 1008).
  queryOptions(target.searchParams, STREAM_QUERY);
  if (!supervisor.accepting) throw supervisor.notAccepting();
  if (run.streams.size >= config.limits.max_ws_connections)
    throw voxError('too_many_streams', { max: config.limits.max_ws_connections });
}

/**
 * Handles `upgrade`: a WebSocket to `/v1/stream` that passes {@link checkStreamUpgrade} becomes a
 * stream socket actor; another protocol's upgrade of a body-less request is answered over HTTP/1.1.
 */
function upgradeHandler(
  run: Running,
  wss: WebSocketServer,
  handle: (req: IncomingMessage, res: ServerResponse) => void,
) {
  const { config, supervisor, inspected, streams } = run;
  return (req: IncomingMessage, socket: Duplex, head: Buffer): void => {
    socket.on('error', () => socket.destroy());
    run.connections.delete(socket as Socket);
    // The connection leaves HTTP: a stream socket actor (or this handler's answer) owns it now.
    if ((req.headers.upgrade ?? '').toLowerCase() === 'websocket') run.links.get(socket)?.tell({ type: 'UPGRADED' });
    const refuse = (e: VoxError): void => endWithJson(socket, e.status, errorBody(e), errorHeaders(e));
    if ((req.headers.upgrade ?? '').toLowerCase() !== 'websocket') {
      // Another protocol (e.g. curl's h2c offer): answer a body-less request over HTTP/1.1 as usual.
      if (req.method !== 'GET' && req.method !== 'HEAD')
        return refuse(voxError('upgrade_not_supported', { upgrade: String(req.headers.upgrade) }));
      const res = new ServerResponse(req);
      res.assignSocket(socket as Socket);
      res.shouldKeepAlive = false;
      res.on('finish', () => socket.end());
      return handle(req, res);
    }
    try {
      checkStreamUpgrade(run, req, requestUrl(req));
    } catch (e) {
      return refuse(toVoxError(e));
    }
    if (socket.destroyed) return;
    wss.handleUpgrade(req, socket, head, (ws) => {
      const protocol = (ws.protocol || SUBPROTOCOLS[0]) as Subprotocol;
      const socketActor = createStreamSocket(
        { url: req.url ?? '/', limits: config.limits, registry: supervisor },
        inspected.inspect,
      );
      drainOnShutdown(supervisor.root, socketActor.actor);
      const link = bindStream(ws, socketActor, protocol, config.limits);
      streams.add(link);
      run.idleGc.touch();
      void link.released.then(() => streams.delete(link));
    });
  };
}

/** Listens on `config.host:config.port`; a failure closes the cluster membership first. @returns the URL. */
async function listen(http: Server, config: ServerConfig, cluster: ClusterNode | null): Promise<string> {
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
  return `http://${host}:${addr.port}`;
}

/**
 * Starts what runs beside the HTTP listener: Wyoming (`wyoming.enabled`), then cluster membership; a failure closes the
 * listener.
 */
async function startServices(run: Running, http: Server, url: string): Promise<void> {
  const { config, supervisor, cluster } = run;
  if (config.wyoming.enabled) {
    try {
      run.wyoming = await startWyoming(config, supervisor, run.inspected.inspect);
    } catch (e) {
      http.close();
      throw e;
    }
    supervisor.log.info({ uri: run.wyoming.uri }, 'wyoming listening');
    if (zeroconfWanted(config)) run.zeroconf = announceWyoming(config, run.wyoming.port, supervisor.log);
  }
  if (cluster) {
    try {
      await cluster.attach(supervisor, url);
    } catch (e) {
      http.close();
      await cluster.close();
      throw e;
    }
  }
}

/**
 * The shutdown phases (C15) around the system chart: stop accepting; drain until the chart emits
 * `cut` (everything finished, the drain deadline, or `destroy()`); cut what is left; unload.
 * @returns `close(destroy?)`: the first call shuts down, later ones return the same promise;
 *   with `destroy` (`destroy()`), the drain is cut short first (the chart's `DESTROY`), and streams
 *   still open are told so in their close reason.
 */
function shutdownOf(run: Running, http: Server, wss: WebSocketServer): (destroy?: boolean) => Promise<void> {
  const { config, supervisor, cluster, streams, inflight, connections, tell } = run;
  const { log, root } = supervisor;
  /** Wyoming connections count as streams in the drain. */
  const wyomingLinks = (): {
    released: Promise<void>;
    actor: { send: (e: { type: 'GO_AWAY'; reason: string }) => void };
  }[] => [...(run.wyoming?.links ?? [])];
  /**
   * Phase 2 is over: the listener closes (new connections are refused); the idle ones linger (the chart's `lingering`).
   */
  let listenerClosed: Promise<void> | null = null;
  const closeListener = (): Promise<void> =>
    // net.Server's close: http.Server's would close the idle connections at once.
    (listenerClosed ??= new Promise<void>((resolve) => NetServer.prototype.close.call(http, () => resolve())));
  root.on('linger', () => {
    void closeListener();
    if (connections.size === 0) tell({ type: 'IDLE' });
  });
  const cut = new Promise<void>((resolve) => root.on('cut', () => resolve()));
  /** Why phase 3 came: what a stream still open is told in its close reason. */
  let drained = false;
  let destroyed = false;

  const shutDown = async (): Promise<void> => {
    const { wyoming } = run;
    // Phase 1: stop accepting work. The listener stays up, so /ready answers 503 and new
    // requests get 503 shutting_down (with Connection: close) while the drain lasts.
    supervisor.beginShutdown();
    cluster?.drain();
    // Home Assistant stops being pointed here at once.
    const unannounced = run.zeroconf?.stop();
    log.info(
      {
        drain_timeout_ms: config.drain_timeout_ms,
        streams: streams.size,
        wyoming: wyoming?.links.size,
        requests: inflight.size,
      },
      'shutting down',
    );
    for (const res of run.sse) res.end();
    // Phase 2 (the root's `draining`, which emitted `drain`): running work finishes; streams get
    // their last events and `done`. The chart moves on when it has (`DRAINED`, then a linger for
    // idle keep-alive connections), at the drain deadline, or on `destroy()`: it emits `cut`.
    void Promise.all([...[...streams, ...wyomingLinks()].map((s) => s.released), ...inflight]).then(() => {
      drained = true;
      tell({ type: 'DRAINED' });
    });
    await cut;
    // Phase 3: what is left is cut off.
    void closeListener();
    http.closeIdleConnections();
    const reason = destroyed
      ? 'server shutting down: drain cut short'
      : drained
        ? 'server shutting down'
        : 'server shutting down: drain deadline passed';
    // Streams already finished say `done` first; the rest is cut off.
    finishWaiting();
    for (const s of [...streams, ...wyomingLinks()]) s.actor.send({ type: 'GO_AWAY', reason });
    supervisor.revokeAll(supervisor.notAccepting());
    const wyomingClosed = wyoming
      ? new Promise<void>((resolve) => wyoming.server.close(() => resolve()))
      : Promise.resolve();
    await Promise.all([...[...streams, ...wyomingLinks()].map((s) => s.released), ...inflight]);
    http.closeAllConnections();
    for (const c of wss.clients) c.terminate();
    for (const socket of wyoming?.sockets ?? []) socket.destroy();
    // Phase 4: unload every model (in a cluster, once the models only this node held are held elsewhere).
    await cluster?.handedOver();
    await supervisor.stop(0);
    await cluster?.close();
    await closeListener();
    await wyomingClosed;
    await unannounced;
    run.inspected.stop();
    run.idleGc.stop();
    log.info('stopped');
    log.flush();
  };
  let closing: Promise<void> | null = null;
  return (destroy = false) => {
    if (destroy) {
      destroyed = true;
      tell({ type: 'DESTROY' });
    }
    return (closing ??= shutDown());
  };
}

/**
 * Creates the server, starts listening on `config.host:config.port` (port 0 picks a free one),
 * and loads the config's non-lazy models. Resolves once listening; `/ready` turns 200 when the
 * eager loads are done.
 */
export async function startServer(config: ServerConfig, options: ServerOptions = {}): Promise<VoxServer> {
  refuseOpenManagement(config);
  // A configuration mistake is said before the server listens, not as a crash after it.
  if (config.wakeword_dir) await checkWakewordDir(config.wakeword_dir);
  startDecoders();
  const access = createAccess(config);
  const inspected = await createInspection(config);
  // Every actor /debug shows. The cluster's charts are roots of their own: with management on,
  // its inspector adds each one to the directory as it is made.
  const actors = new ActorDirectory();
  const { log, cluster } = await joinCluster(
    config,
    options,
    config.management.enabled ? actors.watch(inspected.inspect) : inspected.inspect,
  );
  const supervisor = new Supervisor(config, {
    ...options,
    log,
    inspect: inspected.inspect,
    place: cluster?.place,
    elsewhere: cluster?.registeredElsewhere,
  });
  // Before anything listens: a Wyoming chain naming no denoise model is a configuration mistake.
  checkWyomingDenoise(supervisor);
  const { root } = supervisor;
  const streams = new Set<StreamLink>();
  const inflight = new Set<Promise<void>>();
  actors.add(root);
  if (cluster) {
    // Drawn also while no placement is under way.
    actors.declare('membership', membershipMachine);
    actors.declare('placement', placementMachine);
  }
  actors.source(() => [...streams].map((s) => s.actor));
  if (config.wyoming.enabled) {
    actors.declare('wyoming', streamSocketMachine);
    actors.source(() => [...(run.wyoming?.links ?? [])].map((l) => l.actor), 'wyoming');
  }
  /** Other nodes' jobs this node had started serving when the idle collection last looked. */
  let jobsSeen = 0;
  const run: Running = {
    config,
    supervisor,
    access,
    inspected,
    cluster,
    sse: new Set(),
    streams,
    inflight,
    connections: new Set(),
    links: new WeakMap(),
    // Off-heap garbage left by streams, requests and other nodes' jobs is collected once the server idles (issue 25
    // item 14; a holder serving only other nodes' jobs never did, issue 45).
    idleGc: new IdleCollector(() => {
      const seen = jobsSeen;
      jobsSeen = cluster?.serving.jobsStarted ?? 0;
      return (
        streams.size > 0 ||
        inflight.size > 0 ||
        (run.wyoming?.links.size ?? 0) > 0 ||
        (cluster?.serving.servedSince(seen) ?? false)
      );
    }),
    wyoming: null,
    actors,
    tell: (event) => {
      if (root.getSnapshot().status === 'active') root.send(event);
    },
  };
  const dispatch = createDispatch({
    config,
    supervisor,
    access,
    streams,
    sse: run.sse,
    inspected,
    cluster,
    actors,
    demo: config.demo.enabled ?? isLoopback(config.host),
    // A probe polled more often than the idle time must not hold the collection off.
    onWork: () => run.idleGc.touch(),
  });
  const handle = requestHandler(run, dispatch);
  const { http, headersTimeout, requestTimeout } = createListener(config, handle);
  http.on('connection', (socket: Socket) => {
    run.connections.add(socket);
    socket.once('close', () => {
      // The last one gone while the root lingers for them: the drain is over.
      if (run.connections.delete(socket) && run.connections.size === 0) run.tell({ type: 'IDLE' });
    });
  });
  http.on('clientError', clientErrorHandler(headersTimeout, requestTimeout));
  const wss = new WebSocketServer({
    noServer: true,
    maxPayload: config.limits.ws_max_frame_bytes,
    handleProtocols: (offered) => SUBPROTOCOLS.find((p) => offered.has(p)) ?? false,
  });
  http.on('upgrade', upgradeHandler(run, wss, handle));

  const url = await listen(http, config, cluster);
  // The log's own record of the address (the CLI also tells the person at the terminal, on stderr).
  supervisor.log.info({ url }, 'listening');
  await startServices(run, http, url);
  void supervisor.start();
  const close = shutdownOf(run, http, wss);
  return {
    supervisor,
    http,
    url,
    streams,
    inflight,
    wyoming: run.wyoming,
    zeroconf: run.zeroconf ?? null,
    cluster,
    idleGc: run.idleGc,
    close: () => close(),
    destroy: () => close(true),
  };
}
