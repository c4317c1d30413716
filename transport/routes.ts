import { readFileSync } from 'node:fs';
import type { IncomingMessage, ServerResponse } from 'node:http';
import type { TaskRequest } from '../actors/http.js';
import type { Inspection } from '../actors/inspection.js';
import type { Supervisor } from '../actors/supervisor.js';
import { validateModelConfig } from '../actors/model.js';
import type { ClusterNode } from '../cluster/node.js';
import { leaseGranted } from '../actors/lease.js';
import type { ServerConfig } from '../runtime/config.js';
import { OFF_THREAD_JSON_BYTES, parseJsonOffThread } from '../runtime/audio/decode.js';
import { INFERENCE_HEADER, readV2Infer, splitBinaryBody, v2TensorMeta } from '../runtime/oip.js';
import { invalid, voxError, type VoxError } from '../runtime/errors.js';
import type { Access } from './access.js';
import { type ActorDirectory, CHARTS, DEBUG_PAGE, debugState, ELK_SCRIPT, streamActors } from './debug.js';
import { demoRoute } from './demo.js';
import { DEBUG_OFF_PAGE, homePage, sendHtml } from './home.js';
import {
  parseBatchRequest,
  parseJsonObject,
  MSGPACK_TYPES,
  mediaType,
  parseMultipartRun,
  parseRunRequest,
  readBody,
  requireMediaType,
  requireRunMediaType,
  requestUrl,
  sendJson,
  type HttpLink,
} from './http.js';
import type { StreamLink } from './stream.js';

/**
 * The HTTP routes as a declared table: each route says in one place its method, path, who may
 * call it, the body types it takes and how its body is read and validated, then handles the
 * request. 404 (no route has the path) and 405 (a route has the path, not the method) come from
 * the table ({@link findRoute}). About twenty routes with one path parameter: a list scanned in order is all it takes
 * (a router library such as find-my-way would add a dependency and still leave 405 to us).
 */

/**
 * Who may call a route: anyone, an API key holder (inference), the manager (management token), or anyone when
 * management is on (debug pages: they hold no data).
 */
export type RouteAuth = 'none' | 'apiKey' | 'management' | 'managementPage';

/** What a handler gets: the request, its response, the parsed URL and path parameters, and the body its route read. */
export interface RouteRequest<B> {
  readonly req: IncomingMessage;
  readonly res: ServerResponse;
  readonly url: URL;
  /** The path without trailing slashes. */
  readonly path: string;
  /** Path parameters by name (`/v1/models/:id` -> `id`), percent-decoded. */
  readonly params: Readonly<Record<string, string>>;
  readonly body: B;
  /** The connection's HTTP socket actor and this request's number on it (a task runs there). */
  readonly link: HttpLink;
  readonly rid: number;
}

/** One route. */
export interface Route<B = undefined> {
  readonly method: 'GET' | 'HEAD' | 'POST';
  /** `/v1/models`, `/v1/models/:id` (one segment), or `/demo/*` (anything below). */
  readonly path: string;
  readonly auth: RouteAuth;
  /** Body media types it takes, checked before the body is read (415 otherwise); a function for a rule of its own. */
  readonly accepts?: readonly string[] | ((req: IncomingMessage) => void);
  /**
   * A page for a person with a browser: the HTML answered (403) instead of the JSON error when management is off (auth
   * `managementPage`).
   */
  readonly offPage?: string;
  /** Work that a server that does not accept work (starting, draining) refuses with 503. */
  readonly work?: boolean;
  /** Reads and validates the body (the route's schema); `undefined` for a route without one. */
  readonly body?: (req: IncomingMessage, res: ServerResponse, url: URL) => Promise<B>;
  readonly handle: (r: RouteRequest<B>) => void | Promise<void>;
}

/** Declares a route, its body type inferred from its `body` reader. */
export function route<B = undefined>(r: Route<B>): Route<unknown> {
  return r as Route<unknown>;
}

/** A route matched to a path, with its parameters. */
export interface Match {
  readonly route: Route<unknown>;
  readonly params: Record<string, string>;
}

/**
 * Matches `path` against one route pattern: its parameters, or null. @throws VoxError `invalid_field` for a parameter
 * that is not valid percent-encoding.
 */
function matchPath(pattern: string, path: string): Record<string, string> | null {
  if (pattern.endsWith('/*')) {
    const base = pattern.slice(0, -2);
    return path.startsWith(`${base}/`) ? {} : null;
  }
  const want = pattern.split('/');
  const got = path.split('/');
  if (want.length !== got.length) return null;
  const params: Record<string, string> = {};
  for (let i = 0; i < want.length; i++) {
    if (want[i].startsWith(':')) {
      if (!got[i]) return null;
      params[want[i].slice(1)] = got[i];
    } else if (want[i] !== got[i]) return null;
  }
  for (const [name, raw] of Object.entries(params)) {
    try {
      params[name] = decodeURIComponent(raw);
    } catch {
      throw voxError('invalid_field', {
        field: name,
        problem: `not valid percent-encoding in the path: ${raw.slice(0, 64)}`,
      });
    }
  }
  return params;
}

/**
 * Finds the route for `method` and `path` (without trailing slashes): the match; else the methods
 * the table has for the path (a 405), empty when it has none (a 404).
 * @throws VoxError `invalid_field` for a path parameter that is not valid percent-encoding.
 */
export function findRoute(
  routes: readonly Route<unknown>[],
  method: string,
  path: string,
): Match | { allow: string[] } {
  const allow: string[] = [];
  for (const r of routes) {
    const params = matchPath(r.path, path);
    if (!params) continue;
    if (r.method === method) return { route: r, params };
    if (!allow.includes(r.method)) allow.push(r.method);
  }
  return { allow };
}

/** What the routes serve from. */
export interface RouteDeps {
  readonly config: ServerConfig;
  readonly supervisor: Supervisor;
  readonly access: Access;
  /** Live streams (for `/metrics` and `/debug/state`). */
  readonly streams: ReadonlySet<StreamLink>;
  /** Open `/debug/actors` event streams (ended at shutdown). */
  readonly sse: Set<ServerResponse>;
  readonly inspected: Inspection;
  /** Whether `/demo` is served (config `demo.enabled`; by default on a loopback address). */
  readonly demo: boolean;
  /** This node of a cluster, or null. */
  readonly cluster: ClusterNode | null;
  /** Every actor `/debug` shows, by kind (without it: the root's tree and the streams). */
  readonly actors?: ActorDirectory;
  /**
   * Called for each request that is work (a work route, or any method but GET: management), not a probe or a read of
   * status (`/health`, `/metrics`, `/v1/models`...): the idle collection's `touch`.
   */
  readonly onWork?: () => void;
}

/** Answers one HTTP request on the connection's socket actor `link` as request `rid`; throws the error to answer. */
export type Dispatch = (req: IncomingMessage, res: ServerResponse, link: HttpLink, rid: number) => Promise<void>;

/**
 * In a cluster, each model's status gains the nodes holding it, and an autoscaled one its `autoscale`
 * (`{replicas, last_change: {at, from, to, why} | null}`); models held only elsewhere are listed too.
 */
function withNodes<T extends { id: string }>(cluster: ClusterNode | null, list: T[]): (T & { nodes?: unknown[] })[] {
  if (!cluster) return list;
  const held = cluster.holdersByModel();
  const out: (T & { nodes?: unknown[] })[] = list.map((m) => ({ ...m, nodes: held.get(m.id) ?? [] }));
  for (const [id, nodes] of held)
    if (!list.some((m) => m.id === id))
      out.push({ id, task: nodes[0].task, state: 'unloaded', loaded: false, nodes } as unknown as T & {
        nodes: unknown[];
      });
  // An autoscaled model: its replicas and why their number last changed.
  return out.map((m) => {
    const autoscale = cluster.autoscaler.status(m.id);
    return autoscale ? { ...m, autoscale } : m;
  });
}

/** Management routes in a cluster: load by placement (`node`, `replicas`), unloads on every node unless `node`. */
async function manageCluster(
  supervisor: Supervisor,
  c: ClusterNode,
  path: string,
  body: Record<string, unknown>,
): Promise<unknown> {
  if (path === '/v1/models/load') {
    return c.manageLoad(body, (fields) => {
      const known = typeof fields.id === 'string' ? supervisor.configOf(fields.id) : undefined;
      return validateModelConfig(known ? { ...known, ...fields } : fields);
    });
  }
  if (body.force !== undefined && typeof body.force !== 'boolean') throw invalid('force', 'must be a boolean');
  if (path === '/v1/models/unload') {
    if (typeof body.id !== 'string' || !body.id) throw invalid('id', 'required, a model id string');
    const r = await c.manageUnload([body.id], body.node, body.force === true);
    if (r.not_found.includes(body.id)) throw voxError('model_not_found', { id: body.id });
    return { id: body.id, loaded: false, nodes: r.nodes };
  }
  if (path === '/v1/models/unload_many') {
    if (!Array.isArray(body.ids) || !body.ids.every((x) => typeof x === 'string'))
      throw invalid('ids', 'required, an array of model id strings');
    return c.manageUnload(body.ids as string[], body.node);
  }
  const { unloaded, nodes } = await c.manageUnload(undefined, body.node);
  return { unloaded, nodes };
}

/**
 * A task body reader: up to `limits.max_body_bytes` (a msgpack body, a tensor request: its tensors'
 * limit plus room for names and shapes), parsed as the route asks, with the time it started.
 * @throws VoxError `tensor_too_large` for a msgpack body over its limit; `body_too_large` for another.
 */
function taskBody(
  config: ServerConfig,
  parse: (req: IncomingMessage, url: URL, body: Buffer, t0: number) => TaskRequest | Promise<TaskRequest>,
) {
  return async (req: IncomingMessage, res: ServerResponse, url: URL): Promise<TaskRequest> => {
    const t0 = performance.now();
    const { max_body_bytes, max_tensor_bytes } = config.limits;
    const tensorLimit = max_tensor_bytes + 64 * 1024;
    const byTensor = MSGPACK_TYPES.includes(mediaType(req)) && tensorLimit < max_body_bytes;
    let body: Buffer;
    try {
      body = await readBody(req, res, byTensor ? tensorLimit : max_body_bytes, config.limits.idle_ms);
    } catch (e) {
      if (byTensor && (e as VoxError).code === 'body_too_large') {
        const declared = Number(req.headers['content-length']);
        throw voxError('tensor_too_large', {
          bytes: Number.isFinite(declared) ? declared : undefined,
          limit: max_tensor_bytes,
        });
      }
      throw e;
    }
    // A large JSON body is parsed (and its tensors read) in a decode worker, not on the event loop.
    // (JSON by its type, or with none: only /v2 takes that, as tritonclient sends it; not a body with binary tensor
    // data after its JSON: /v2's Inference-Header-Content-Length.)
    if (
      body.length >= OFF_THREAD_JSON_BYTES &&
      (mediaType(req) === 'application/json' || mediaType(req) === '') &&
      req.headers[INFERENCE_HEADER] === undefined
    )
      (body as Buffer & { parsed?: Record<string, unknown> }).parsed = await parseJsonOffThread(body);
    return parse(req, url, body, t0);
  };
}

/** Aborts when a manager's client goes away (its request then leaves the model's queue). */
function goneSignal(res: ServerResponse): AbortSignal {
  const gone = new AbortController();
  res.on('close', () => res.writableFinished || gone.abort());
  return gone.signal;
}

/** Answers a static page or script. */
function page(res: ServerResponse, type: string, cache: string, text: string): void {
  res.writeHead(200, { 'content-type': type, 'cache-control': cache });
  res.end(text);
}

/** Routes anyone may call that say what the server holds: home page, health, readiness, models, cluster, metrics. */
function statusRoutes(deps: RouteDeps): Route<unknown>[] {
  const { config, supervisor, streams, cluster } = deps;
  const { metrics } = supervisor;
  return [
    // A person who opens the server's address in a browser: what it is and where to go.
    route({
      method: 'GET',
      path: '/',
      auth: 'none',
      handle: ({ res }) => sendHtml(res, 200, homePage(deps.demo, config.management.enabled)),
    }),
    route({
      method: 'GET',
      path: '/health',
      auth: 'none',
      handle: ({ res }) => sendJson(res, 200, { status: 'ok', models: supervisor.statuses().length }),
    }),
    route({
      method: 'GET',
      path: '/ready',
      auth: 'none',
      handle: ({ res }) => {
        if (!supervisor.accepting) return sendJson(res, 503, { status: supervisor.phase });
        const failed = supervisor.failedModels();
        // Still ready (the other models serve), but a configured model that failed to load is named.
        const clustered = cluster
          ? { cluster: { node: cluster.name, nats: cluster.connected ? 'connected' : 'disconnected' } }
          : {};
        sendJson(
          res,
          200,
          failed.length ? { status: 'ready', failed_models: failed, ...clustered } : { status: 'ready', ...clustered },
        );
      },
    }),
    route({
      method: 'GET',
      path: '/v1/models',
      auth: 'none',
      handle: ({ res }) =>
        sendJson(res, 200, {
          models: withNodes(cluster, supervisor.statuses()),
          failed_models: supervisor.failedModels(),
        }),
    }),
    route({
      method: 'GET',
      path: '/v1/cluster',
      auth: 'none',
      handle: ({ res }) => {
        if (!cluster) throw voxError('not_clustered');
        sendJson(res, 200, cluster.status());
      },
    }),
    route({
      method: 'GET',
      path: '/v1/models/:id',
      auth: 'none',
      handle: ({ res, params }) => {
        const status = supervisor.status(params.id);
        if (!status) throw supervisor.unknownModel(params.id);
        sendJson(res, 200, cluster ? withNodes(cluster, [status])[0] : status);
      },
    }),
    route({
      method: 'GET',
      path: '/metrics',
      auth: 'none',
      handle: async ({ res }) => {
        for (const m of supervisor.statuses()) {
          metrics.queued.set({ model: m.id }, m.queued_requests);
          metrics.activeSlots.set({ model: m.id }, m.active_slots);
          metrics.resident.set({ model: m.id }, m.resident_bytes);
        }
        metrics.wsConnections.set(streams.size);
        metrics.wsBuffered.set([...streams].reduce((n, s) => n + s.ws.bufferedAmount, 0));
        const text = await metrics.registry.metrics();
        res.writeHead(200, { 'content-type': metrics.registry.contentType });
        res.end(text);
      },
    }),
  ];
}

/** The debug page, its charts, state and live actor events (management), and the demo page. */
function pageRoutes(deps: RouteDeps): Route<unknown>[] {
  const { supervisor, streams, sse, inspected, cluster, actors } = deps;
  const demo = demoRoute(deps.demo);
  return [
    // The debug page and its layout script hold no data; what they show does.
    route({
      method: 'GET',
      path: '/debug',
      auth: 'managementPage',
      offPage: DEBUG_OFF_PAGE,
      handle: ({ res }) => page(res, 'text/html; charset=utf-8', 'no-store', DEBUG_PAGE),
    }),
    route({
      method: 'GET',
      path: '/debug/elk.js',
      auth: 'managementPage',
      handle: ({ res }) => page(res, 'text/javascript; charset=utf-8', 'max-age=3600', ELK_SCRIPT),
    }),
    route({
      method: 'GET',
      path: '/debug/charts',
      auth: 'management',
      handle: ({ res }) => sendJson(res, 200, actors ? actors.chartList() : CHARTS),
    }),
    route({
      method: 'GET',
      path: '/debug/state',
      auth: 'management',
      handle: ({ res }) => sendJson(res, 200, debugState(supervisor, streams, inspected.log, cluster, actors)),
    }),
    route({
      method: 'GET',
      path: '/debug/actors',
      auth: 'management',
      handle: ({ res }) => streamActors(res, inspected.log, sse),
    }),
    ...(['GET', 'HEAD'] as const).flatMap((method) =>
      ['/demo', '/demo/*'].map((path) => route({ method, path, auth: 'none', handle: (r) => demo(r.path, r.res) })),
    ),
  ];
}

/** Loading and unloading models (management token; JSON bodies of at most 1 MiB); in a cluster, by placement. */
function managementRoutes(deps: RouteDeps): Route<unknown>[] {
  const { config, supervisor, cluster } = deps;
  const timeout = config.busy_timeout_ms;
  /** A management body: a JSON object of at most 1 MiB. */
  const jsonBody = async (req: IncomingMessage, res: ServerResponse): Promise<Record<string, unknown>> =>
    parseJsonObject(await readBody(req, res, 1024 * 1024, config.limits.idle_ms));
  /** A management route at `path`: in a cluster by {@link manageCluster}, else by `local`; the answer is 200 JSON. */
  const manage = (
    path: string,
    local: (body: Record<string, unknown>, gone: () => AbortSignal) => Promise<unknown>,
  ): Route<unknown> =>
    route({
      auth: 'management',
      accepts: ['application/json'],
      work: true,
      body: jsonBody,
      method: 'POST',
      path,
      handle: async ({ res, body }) =>
        sendJson(
          res,
          200,
          cluster ? await manageCluster(supervisor, cluster, path, body) : await local(body, () => goneSignal(res)),
        ),
    });
  return [
    manage('/v1/models/load', (body, gone) => supervisor.load(body, timeout, gone())),
    manage('/v1/models/unload', async (body, gone) => {
      if (typeof body.id !== 'string' || !body.id) throw invalid('id', 'required, a model id string');
      if (body.force !== undefined && typeof body.force !== 'boolean') throw invalid('force', 'must be a boolean');
      const entry = supervisor.require(body.id);
      await (body.force ? entry.forceUnload() : entry.unload(timeout, gone()));
      return { id: body.id, loaded: false };
    }),
    manage('/v1/models/unload_many', async (body, gone) => {
      if (!Array.isArray(body.ids) || !body.ids.every((x) => typeof x === 'string'))
        throw invalid('ids', 'required, an array of model id strings');
      return supervisor.unloadMany(body.ids as string[], timeout, gone());
    }),
    manage('/v1/models/unload_all', async (_body, gone) => ({
      unloaded: (await supervisor.unloadMany(supervisor.registeredIds, timeout, gone())).unloaded,
    })),
  ];
}

/**
 * The task routes (API key): the transport parses, the connection's socket actor runs the task in an exchange that
 * holds the lease.
 */
function taskRoutes(config: ServerConfig): Route<unknown>[] {
  return [
    route({
      method: 'POST',
      path: '/v1/tasks/run',
      auth: 'apiKey',
      accepts: requireRunMediaType,
      work: true,
      body: taskBody(config, (req, url, body, t0) =>
        mediaType(req) === 'multipart/form-data'
          ? parseMultipartRun(req, url, body, t0)
          : parseRunRequest(req, url, body, t0),
      ),
      handle: ({ link, rid, body }) => link.tell({ type: 'TASK', rid, request: body }),
    }),
    route({
      method: 'POST',
      path: '/v1/tasks/batch',
      auth: 'apiKey',
      accepts: ['application/json'],
      work: true,
      body: taskBody(config, (_req, url, body, t0) => parseBatchRequest(url, body, t0)),
      handle: ({ link, rid, body }) => link.tell({ type: 'TASK', rid, request: body }),
    }),
    route({
      method: 'GET',
      path: '/v1/stream',
      auth: 'none',
      handle: ({ path }) => {
        throw voxError('websocket_required', { path });
      },
    }),
  ];
}

/**
 * Every HTTP route (the WebSocket upgrade of `/v1/stream` is handled on `upgrade`), in the order
 * {@link findRoute} scans them.
 */
function serverRoutes(deps: RouteDeps): Route<unknown>[] {
  return [
    ...statusRoutes(deps),
    ...pageRoutes(deps),
    ...managementRoutes(deps),
    ...taskRoutes(deps.config),
    ...inferenceProtocolRoutes(deps),
  ];
}

/**
 * voxserve's version, for the protocol's server metadata: package.json, one level up from the sources, two from dist/.
 */
const VERSION = ((): string => {
  for (const p of ['../package.json', '../../package.json']) {
    try {
      const pkg = JSON.parse(readFileSync(new URL(p, import.meta.url), 'utf8')) as { name?: string; version?: string };
      if (pkg.name === 'voxserve' && pkg.version) return pkg.version;
    } catch {
      // not there
    }
  }
  return 'unknown';
})();

/**
 * `POST /v2/models/{id}/infer` takes `application/json`, or no Content-Type at all (tritonclient's
 * HTTP client sends none); a body with binary tensor data (`Inference-Header-Content-Length` set)
 * also `application/octet-stream`. (A browser on another site is refused by its Origin first.)
 * @throws VoxError `unsupported_media_type` (415).
 */
function requireV2InferMediaType(req: IncomingMessage): void {
  const type = mediaType(req);
  if (type === 'application/json' || type === '') return;
  if (req.headers[INFERENCE_HEADER] !== undefined && type === 'application/octet-stream') return;
  throw voxError('unsupported_media_type', {
    expected: 'application/json, or application/octet-stream with Inference-Header-Content-Length (binary tensor data)',
    got: type,
  });
}

/**
 * The Open Inference Protocol (KServe v2 REST, runtime/oip.ts) for `tensor` models: health, server
 * and model metadata, model readiness, and inference (JSON, and the binary tensor data extension), as Triton, KServe and their clients
 * speak it. Inference takes the same lease, checks and slots as a tensor `POST /v1/tasks/run`.
 */
function inferenceProtocolRoutes(deps: RouteDeps): Route<unknown>[] {
  const { config, supervisor } = deps;
  /** A tensor model's entry, or the 404 / 400 saying what it is. */
  const tensorModel = (id: string) => {
    const entry = supervisor.requireForWork(id);
    if (entry.config.task !== 'tensor')
      throw voxError('wrong_task', {
        id: entry.id,
        task: entry.config.task,
        problem: 'the Open Inference Protocol (/v2) serves tensor models; send audio to POST /v1/tasks/run',
      });
    return entry;
  };
  return [
    route({
      method: 'GET',
      path: '/v2/health/live',
      auth: 'none',
      handle: ({ res }) => sendJson(res, 200, { live: true }),
    }),
    route({
      method: 'GET',
      path: '/v2/health/ready',
      auth: 'none',
      handle: ({ res }) => sendJson(res, supervisor.accepting ? 200 : 503, { ready: supervisor.accepting }),
    }),
    route({
      method: 'GET',
      path: '/v2',
      auth: 'none',
      handle: ({ res }) =>
        sendJson(res, 200, { name: 'voxserve', version: VERSION, extensions: ['binary_tensor_data'] }),
    }),
    route({
      method: 'GET',
      path: '/v2/models/:id/ready',
      auth: 'none',
      handle: ({ res, params }) => {
        const entry = tensorModel(params.id);
        const ready = entry.status().state === 'ready';
        sendJson(res, ready ? 200 : 503, { name: entry.id, ready });
      },
    }),
    route({
      method: 'GET',
      path: '/v2/models/:id',
      auth: 'apiKey',
      work: true,
      // Its inputs and outputs are what the loaded session reports: the model is loaded if it is not.
      handle: async ({ res, params }) => {
        const entry = tensorModel(params.id);
        const { handle, granted } = leaseGranted(entry, { metrics: supervisor.metrics }, () => {});
        try {
          const meta = (await granted).info.tensor ?? { inputs: [], outputs: [] };
          sendJson(res, 200, {
            name: entry.id,
            platform: 'onnxruntime_onnx',
            inputs: meta.inputs.map(v2TensorMeta),
            outputs: meta.outputs.map(v2TensorMeta),
          });
        } finally {
          handle.release();
        }
      },
    }),
    route({
      method: 'POST',
      path: '/v2/models/:id/infer',
      auth: 'apiKey',
      accepts: requireV2InferMediaType,
      work: true,
      body: taskBody(config, async (req, url, body, t0): Promise<TaskRequest> => {
        const id = decodeURIComponent(url.pathname.split('/')[3]);
        const header = req.headers[INFERENCE_HEADER];
        const parts =
          header === undefined
            ? { json: body, binary: undefined }
            : splitBinaryBody(String(header), body, config.limits.max_tensor_bytes);
        // The JSON part of a body with binary data is parsed off the event loop when large, as a JSON body is (taskBody).
        const json =
          parts.binary && parts.json.length >= OFF_THREAD_JSON_BYTES
            ? await parseJsonOffThread(parts.json)
            : parseJsonObject(parts.json);
        const { fields, id: requestId, binary } = readV2Infer(json, parts.binary);
        return {
          kind: 'run',
          model: id,
          files: [],
          tensor: { fields, binary: false },
          v2: { id: requestId, binary },
          t0,
        };
      }),
      handle: ({ link, rid, body, params }) => {
        tensorModel(params.id);
        link.tell({ type: 'TASK', rid, request: body });
      },
    }),
  ];
}

/**
 * The server's HTTP routes, and the function that answers a request from them: the Host and
 * Origin checks and CORS preflight first, then the route's auth, body types, refusal while not
 * accepting work, body, handler. Throws the error to answer (the caller writes it).
 */
export function createDispatch(deps: RouteDeps): Dispatch {
  const { config, supervisor, access } = deps;
  const routes = serverRoutes(deps);
  return async (req, res, link, rid) => {
    const url = requestUrl(req);
    const path = url.pathname.replace(/\/+$/, '') || '/';
    const method = req.method ?? 'GET';
    access.host(req);
    const preflight = method === 'OPTIONS';
    for (const [k, v] of Object.entries(access.origin(req, preflight))) res.setHeader(k, v);
    if (preflight) {
      res.writeHead(204, { allow: 'GET, POST, OPTIONS' });
      return void res.end();
    }
    const found = findRoute(routes, method, path);
    if (!('route' in found)) {
      if (!found.allow.length) throw voxError('route_not_found', { route: `${method} ${path}` });
      res.setHeader('allow', found.allow.join(', '));
      throw voxError('method_not_allowed', { method, path });
    }
    const { route: r, params } = found;
    if (r.work || method !== 'GET') deps.onWork?.();
    if (r.auth === 'apiKey') access.apiKey(req);
    else if (r.offPage && !config.management.enabled) return sendHtml(res, 403, r.offPage);
    else if (r.auth !== 'none') access.management(req, r.auth === 'managementPage');
    if (typeof r.accepts === 'function') r.accepts(req);
    else if (r.accepts) requireMediaType(req, [...r.accepts]);
    if (r.work && !supervisor.accepting) throw supervisor.notAccepting();
    const body = r.body ? await r.body(req, res, url) : undefined;
    await r.handle({ req, res, url, path, params, body, link, rid });
  };
}
