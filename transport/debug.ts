import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import type { ServerResponse } from 'node:http';
import type { AnyActorRef, AnyStateMachine, InspectionEvent } from 'xstate';
import type { ClusterNode, HeldModel } from '../cluster/node.js';
import { httpSocketMachine } from '../actors/http.js';
import type { InspectionLog } from '../actors/inspection.js';
import { modelMachine, type ModelStatus } from '../actors/model.js';
import { streamPhase, streamResources, streamSocketMachine } from '../actors/stream.js';
import { supervisorMachine, type Supervisor } from '../actors/supervisor.js';
import { systemMachine } from '../actors/system.js';
import type { StreamLink } from './stream.js';

/** One state of a chart: its dotted path (`resident.ready.idle`; the root is `""`), kind and children. */
export interface ChartNode {
  id: string;
  key: string;
  type: string;
  children: ChartNode[];
}

/** One transition: from and to state paths, and a label (event, `after <delay>`, `always`, `[guard]`). */
export interface ChartEdge {
  source: string;
  target: string;
  label: string;
}

/** A machine's definition as data for the `/debug` page to lay out. */
export interface Chart {
  id: string;
  root: ChartNode;
  edges: ChartEdge[];
}

/** A transition's event type as a short label. */
function eventLabel(type: string, delays: Map<string, string>): string {
  if (type.startsWith('xstate.after.')) return `after ${delays.get(type) ?? type.split('.')[2]}`;
  if (type.startsWith('xstate.done.actor')) return 'done';
  if (type.startsWith('xstate.error.actor')) return 'error';
  return type;
}

/**
 * Reads a machine's own definition (states, transitions with their events, guards and delays) into
 * {@link Chart}: nothing is drawn by hand, so the page shows what the code runs.
 */
export function chartOf(machine: AnyStateMachine): Chart {
  const edges: ChartEdge[] = [];
  type Node = (typeof machine)['root'];
  const walk = (node: Node): ChartNode => {
    const id = node.path.join('.');
    const delays = new Map<string, string>(node.after.map((a) => [a.eventType, String(a.delay)]));
    const add = (label: string, ts: readonly { target?: readonly Node[] | undefined; guard?: unknown }[]): void => {
      for (const t of ts) {
        const guard = typeof t.guard === 'string' ? ` [${t.guard}]` : t.guard ? ' [guard]' : '';
        for (const target of t.target ?? [])
          edges.push({ source: id, target: target.path.join('.'), label: label + guard });
      }
    };
    for (const [type, ts] of node.transitions) add(eventLabel(type, delays), ts);
    if (node.always) add('always', node.always);
    return { id, key: node.key, type: node.type, children: Object.values(node.states).map(walk) };
  };
  return { id: machine.id, root: walk(machine.root), edges };
}

/**
 * The kinds `/debug` always draws, with or without instances: the root, the supervisor, model
 * entries and both socket actors.
 */
const DECLARED: [string, AnyStateMachine][] = [
  ['system', systemMachine],
  ['supervisor', supervisorMachine],
  ['model', modelMachine],
  ['stream', streamSocketMachine],
  ['http', httpSocketMachine],
];

/** The charts of the declared kinds (`GET /debug/charts` adds any other machine found running). */
export const CHARTS: Chart[] = DECLARED.map(([, m]) => chartOf(m));

/** A logic that is a state machine (its `id` names its chart), not a callback or promise actor. */
function machineOf(ref: AnyActorRef): AnyStateMachine | null {
  const logic = (ref as { logic?: unknown }).logic as Partial<AnyStateMachine> | undefined;
  return logic && typeof logic.id === 'string' && logic.root && typeof logic.getInitialSnapshot === 'function'
    ? (logic as AnyStateMachine)
    : null;
}

/**
 * Every actor `/debug` shows, grouped by kind: the kind of an actor is its machine's `id`
 * (`model`, `stream`, a cluster chart's own id), so a new chart shows up as one kind without
 * more work; a root added with a kind of its own (Wyoming's stream sockets) is that kind. Roots
 * are walked with their children and the `systemId`s of their system; callback and promise
 * actors are left out (they have no chart). Roots that stopped are forgotten.
 */
export class ActorDirectory {
  private readonly roots = new Map<AnyActorRef, string | undefined>();
  private readonly sources: [string | undefined, () => Iterable<AnyActorRef>][] = [];
  /** Kind -> the machine drawn for it (declared ones first, in order, then as found). */
  private readonly machines = new Map<string, AnyStateMachine>(DECLARED);
  private readonly charts = new Map<string, Chart>();

  /** Draws `kind` with `machine`'s chart even while it has no instance. */
  declare(kind: string, machine: AnyStateMachine): void {
    if (!this.machines.has(kind)) this.machines.set(kind, machine);
  }

  /** Walks `actor` (and its children) until it stops; `kind` names it instead of its machine's id. */
  add(actor: AnyActorRef, kind?: string): void {
    this.roots.set(actor, kind);
    const drop = (): void => void this.roots.delete(actor);
    actor.subscribe({ complete: drop, error: drop });
  }

  /**
   * An inspection observer that adds each root actor created with it (the cluster's membership
   * and placement charts, each a root of its own), then passes every event on to `next`.
   */
  watch(next?: (e: InspectionEvent) => void): (e: InspectionEvent) => void {
    return (e) => {
      if (e.type === '@xstate.actor' && !(e.actorRef as { _parent?: unknown })._parent) {
        const ref = e.actorRef as AnyActorRef;
        // Announced from the actor's constructor: added once it is whole.
        queueMicrotask(() => this.add(ref));
      }
      next?.(e);
    };
  }

  /** Walks the actors `list` returns at each look (a transport's set of live sockets). */
  source(list: () => Iterable<AnyActorRef>, kind?: string): void {
    this.sources.push([kind, list]);
  }

  /** Every live actor with a chart, by kind; each kind's machine is {@link machine}. */
  walk(): Map<string, AnyActorRef[]> {
    const out = new Map<string, AnyActorRef[]>([...this.machines.keys()].map((k) => [k, []]));
    const seen = new Set<AnyActorRef>();
    const visit = (ref: AnyActorRef, kind: string | undefined): void => {
      if (seen.has(ref)) return;
      seen.add(ref);
      const snap = ref.getSnapshot() as { status?: string; children?: Record<string, AnyActorRef> };
      if (snap.status !== 'active') return;
      const machine = machineOf(ref);
      if (machine) {
        const k = kind ?? machine.id;
        if (!this.machines.has(k)) this.machines.set(k, machine);
        if (!out.has(k)) out.set(k, []);
        out.get(k)!.push(ref);
      }
      for (const child of Object.values(snap.children ?? {})) if (child) visit(child, undefined);
    };
    const roots: [AnyActorRef, string | undefined][] = [...this.roots];
    for (const [kind, list] of this.sources) for (const ref of list()) roots.push([ref, kind]);
    for (const [ref, kind] of roots) {
      visit(ref, kind);
      const keyed = (ref as { system?: { getAll?: () => Record<string, AnyActorRef | undefined> } }).system;
      for (const other of Object.values(keyed?.getAll?.() ?? {})) if (other) visit(other, undefined);
    }
    return out;
  }

  /** The machine drawn for `kind`. */
  machine(kind: string): AnyStateMachine | undefined {
    return this.machines.get(kind);
  }

  /** `GET /debug/charts`: the chart of every kind known so far, once per machine id. */
  chartList(): Chart[] {
    this.walk();
    for (const m of this.machines.values()) if (!this.charts.has(m.id)) this.charts.set(m.id, chartOf(m));
    return [...this.charts.values()];
  }
}

/**
 * Every active state path of a snapshot value (`{resident: {ready: 'idle'}}` -> `resident`,
 * `resident.ready`, `resident.ready.idle`).
 */
export function activePaths(value: unknown, prefix = ''): string[] {
  const join = (k: string): string => (prefix ? `${prefix}.${k}` : k);
  if (typeof value === 'string') return [join(value)];
  if (!value || typeof value !== 'object') return [];
  return Object.entries(value as Record<string, unknown>).flatMap(([k, v]) => [join(k), ...activePaths(v, join(k))]);
}

/** One node as `/debug` shows it: `GET /v1/cluster`'s entry, with each model it holds and its figures. */
export interface DebugClusterNode {
  node: string;
  url: string;
  free_bytes: number;
  draining: boolean;
  last_seen_ms: number;
  max_loaded_models: number;
  models: ({ id: string } & HeldModel)[];
}

/**
 * The cluster as this node's registry view has it (`GET /v1/cluster`, with each node's models
 * and their figures from the registry, as `GET /v1/models` lists them per model).
 */
export function clusterView(cluster: ClusterNode): {
  node: string;
  nats: { url: string; connected: boolean };
  heartbeat_ms: number;
  /** The membership chart's active states (`connected`, `connected.heartbeat.waiting`, `disconnected`, ...). */
  active: string[];
  nodes: DebugClusterNode[];
} {
  const status = cluster.status() as ReturnType<typeof clusterView> & {
    nodes: (Omit<DebugClusterNode, 'models'> & { models: string[] })[];
  };
  const held = new Map<string, ({ id: string } & HeldModel)[]>();
  for (const [id, holders] of cluster.holdersByModel())
    for (const { node, ...figures } of holders) {
      if (!held.has(node)) held.set(node, []);
      held.get(node)!.push({ id, ...figures });
    }
  return {
    ...status,
    active: activePaths(cluster.membership.getSnapshot().value),
    nodes: status.nodes.map((n) => ({
      ...n,
      models: (held.get(n.node) ?? []).sort((a, b) => a.id.localeCompare(b.id)),
    })),
  };
}

/** One actor as a row of its kind's table on `/debug`. */
export interface DebugInstance {
  /** The actor's id (`model:vad-a`, `socket:12`, `socket:http:3`); a catalog model not registered yet: `model:<id>`. */
  id: string;
  /** What the row is called: the model's id, else the actor's id. */
  name: string;
  /** The current state: the names of the chart's active leaves (a model's: its status state, `ready`, ...). */
  state: string;
  /** Every active state path, to light on the kind's chart. */
  active: string[];
  /** Leases held, as `held/most` (a model: streams and requests on it; HTTP: requests in flight), or null. */
  leases: string | null;
  /** What waits (a model's queued requests, the supervisor's pending loads, pipelined HTTP requests), or null. */
  queue: number | null;
  /** A few more figures in words. */
  detail: string;
}

/** One kind of actor: the chart it is drawn on, how many there are, in which states, and a row per instance. */
export interface DebugKind {
  kind: string;
  /** The chart's id in `GET /debug/charts` (two kinds may share one: Wyoming's sockets are stream sockets). */
  chart: string;
  count: number;
  /** Instances per active state path (every instance, also those past {@link MAX_ROWS}). */
  states: Record<string, number>;
  /** At most {@link MAX_ROWS}, in the order found (models by id). */
  instances: DebugInstance[];
}

/** The most rows `/debug/state` lists per kind (the counts cover every instance). */
export const MAX_ROWS = 1000;

/** The names of the active leaves of a set of state paths (those no other path extends): `streaming, reading`. */
function leaves(active: string[]): string {
  return active
    .filter((p) => !active.some((q) => q.startsWith(`${p}.`)))
    .map((p) => p.split('.').at(-1))
    .join(', ');
}

/** Numbers, flags and list lengths of a context, for kinds with no figures of their own. */
function contextFigures(context: unknown): string {
  if (!context || typeof context !== 'object') return '';
  const out: string[] = [];
  for (const [k, v] of Object.entries(context)) {
    if (typeof v === 'number' || typeof v === 'boolean') out.push(`${k} ${v}`);
    else if (Array.isArray(v)) out.push(`${k} ${v.length}`);
    if (out.length === 6) break;
  }
  return out.join(', ');
}

/** A row for one actor, with the figures its kind has. */
function rowOf(kind: string, ref: AnyActorRef): DebugInstance {
  const snap = ref.getSnapshot() as { value: unknown; context: any };
  const active = activePaths(snap.value);
  const ctx = snap.context;
  // An actor made without an id (a placement) is named by its systemId, or the id in its context.
  const named = ref.id !== ref.sessionId ? ref.id : typeof ctx?.id === 'string' ? ctx.id : ref.id;
  const row: DebugInstance = {
    id: ref.id,
    name: (ref as { systemId?: string }).systemId ?? named,
    state: leaves(active),
    active,
    leases: null,
    queue: null,
    detail: '',
  };
  if (kind === 'supervisor') {
    row.queue = ctx.pending.length;
    row.detail = ctx.current ? `cold load of ${ctx.current.id}` : 'gate idle';
  } else if (kind === 'http') {
    row.leases = String(ctx.active.length);
    row.queue = ctx.waiting.length;
  } else if (kind === 'stream' || kind === 'wyoming') {
    const url = streamResources(ctx.id)?.url;
    const model = url ? new URL(url, 'http://localhost').searchParams.get('model') : null;
    row.detail = `${streamPhase(ref as never)}${model ? `, model ${model}` : ''}`;
  } else if (kind !== 'system') row.detail = contextFigures(ctx);
  return row;
}

/** A model's row: its status (every catalog model, registered or not) and its entry's chart. */
function modelRow(m: ModelStatus, ref: AnyActorRef | undefined): DebugInstance {
  const active = activePaths(ref?.getSnapshot().value ?? 'unloaded');
  const detail = [
    `${m.task}, slots ${m.active_slots}/${m.slots}`,
    m.last_eviction ? `evicted (${m.last_eviction.reason})` : '',
    m.cool_down ? `cooling down (${m.cool_down.failures} failures)` : '',
    m.last_error ? `last error: ${m.last_error}` : '',
  ];
  return {
    id: `model:${m.id}`,
    name: m.id,
    state: m.state,
    active,
    leases: `${m.active_leases}/${m.max_streams}`,
    queue: m.queued_requests,
    detail: detail.filter(Boolean).join(', '),
  };
}

/** Every kind of actor with its instances (`GET /debug/state`'s `kinds`); models are the supervisor's statuses. */
export function debugKinds(directory: ActorDirectory, statuses: ModelStatus[]): DebugKind[] {
  const out: DebugKind[] = [];
  for (const [kind, refs] of directory.walk()) {
    let rows: DebugInstance[];
    if (kind === 'model') {
      const byId = new Map(refs.map((r) => [r.id, r]));
      rows = statuses.map((m) => modelRow(m, byId.get(`model:${m.id}`)));
      const named = new Set(rows.map((r) => r.id));
      rows.push(...refs.filter((r) => !named.has(r.id)).map((r) => rowOf(kind, r)));
      rows.sort((a, b) => a.name.localeCompare(b.name));
    } else rows = refs.map((r) => rowOf(kind, r));
    const states: Record<string, number> = {};
    for (const r of rows) for (const p of r.active) states[p] = (states[p] ?? 0) + 1;
    const chart = directory.machine(kind)!.id;
    out.push({ kind, chart, count: rows.length, states, instances: rows.slice(0, MAX_ROWS) });
  }
  return out;
}

/**
 * `GET /debug/state`: the root's and the supervisor's states (with the supervisor's figures: the
 * load it works for, what it waits for, the victim), every model's status and active states,
 * streams counted by phase with a sample of their states, the last transitions, the cluster
 * ({@link clusterView}; null for a single node), and every kind of actor with a row per instance
 * (`kinds`, {@link debugKinds}: what the page draws, one chart per kind).
 * @param directory the server's actors; without it, the root's tree and `streams`.
 */
export function debugState(
  supervisor: Supervisor,
  streams: ReadonlySet<StreamLink>,
  inspection: InspectionLog | null,
  cluster: ClusterNode | null = null,
  directory?: ActorDirectory,
): unknown {
  const counts: Record<string, number> = { open: 0, streaming: 0, draining: 0, closing: 0 };
  const sample: { id: string; phase: string; active: string[] }[] = [];
  for (const s of streams) {
    const phase = streamPhase(s.actor);
    counts[phase] = (counts[phase] ?? 0) + 1;
    if (sample.length < 50) sample.push({ id: s.actor.id, phase, active: activePaths(s.actor.getSnapshot().value) });
  }
  const sup = supervisor.actor.getSnapshot();
  const { current, room, victim, waitingFor, pending } = sup.context;
  const statuses = supervisor.statuses();
  if (!directory) {
    directory = new ActorDirectory();
    directory.source(() => [supervisor.root]);
    directory.source(() => [...streams].map((s) => s.actor));
  }
  return {
    inspect: inspection !== null,
    root: { state: supervisor.phase, active: activePaths(supervisor.phase) },
    supervisor: {
      active: activePaths(sup.value),
      loading_for: current?.id ?? null,
      pending: pending.map((p) => p.id),
      waiting_for: waitingFor,
      victim,
      room,
    },
    models: statuses.map((m) => ({ ...m, active: activePaths(supervisor.chartValue(m.id) ?? 'unloaded') })),
    streams: counts,
    sockets: sample,
    transitions: inspection ? inspection.recent().slice(-80) : [],
    cluster: cluster ? clusterView(cluster) : null,
    kinds: debugKinds(directory, statuses),
  };
}

/**
 * `GET /debug/actors`: server-sent events, one `data:` line of JSON per inspection record: the
 * ring buffer first, then live records until the client goes or `closing` fires.
 */
export function streamActors(
  res: ServerResponse,
  inspection: InspectionLog | null,
  closing: Set<ServerResponse>,
): void {
  res.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-store', connection: 'keep-alive' });
  if (!inspection) {
    res.end(
      `event: off\ndata: ${JSON.stringify({ message: 'inspection is off; start the server with --inspect' })}\n\n`,
    );
    return;
  }
  for (const r of inspection.recent()) res.write(`data: ${JSON.stringify(r)}\n\n`);
  const unsubscribe = inspection.subscribe((r) => res.write(`data: ${JSON.stringify(r)}\n\n`));
  closing.add(res);
  res.on('close', () => {
    unsubscribe();
    closing.delete(res);
  });
}

/** elkjs's bundled build (Eclipse Layout Kernel in JavaScript), served to the page at `/debug/elk.js`: no CDN. */
export const ELK_SCRIPT = readFileSync(createRequire(import.meta.url).resolve('elkjs/lib/elk.bundled.js'), 'utf8');

/**
 * `GET /debug`: a self-contained page. It fetches `/debug/charts` (every machine's definition),
 * lays each out once with elkjs (layered, hierarchy included), and redraws from `/debug/state`
 * twice a second one card per kind of actor (`kinds`: the root, the supervisor, model entries,
 * stream, Wyoming and HTTP sockets, and any other chart found running, such as the cluster's):
 * its chart drawn once, each state marked with how many instances are in it, and a row per
 * instance (id, state, leases, queue, figures; a filter past ten rows). Selecting a row lights
 * that instance's states on the chart (a kind of one instance is lit as it is). Then, in a
 * cluster, one card per node (the models it holds, free memory, draining), and the last
 * transitions with their event payloads.
 */
export const DEBUG_PAGE = `<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>voxserve /debug</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; } h2 { font-size: 1.05em; margin: 0.3em 0; }
.row { display: flex; flex-wrap: wrap; gap: 1em; align-items: flex-start; }
.card { border: 1px solid #ccc; border-radius: 6px; padding: 0.6em; }
.kind { margin-bottom: 1em; } .kind .body { display: flex; flex-wrap: wrap; gap: 1em; align-items: flex-start; }
.kind .svg { width: 100%; overflow-x: auto; }
.rows { min-width: 24em; flex: 1; } .scroll { max-height: 22em; overflow-y: auto; }
.rows input { font: inherit; font-size: 12px; margin-bottom: 4px; width: 16em; }
.meta { color: #555; font-size: 12px; }
svg text { font: 11px system-ui, sans-serif; }
.state > rect { fill: #f7f7f7; stroke: #999; }
.state.compound > rect, .state.parallel > rect { fill: none; stroke: #bbb; stroke-dasharray: 4 3; }
.state.occupied > rect { fill: #dce8f8; }
.state.compound.occupied > rect, .state.parallel.occupied > rect { fill: none; stroke: #7fa7dd; }
.state.current > rect { fill: #2f7de1; stroke: #1b4f91; }
.state.compound.current > rect, .state.parallel.current > rect {
  fill: #e8f0fc; stroke: #2f7de1; stroke-dasharray: none;
}
.state.current.atomic > text, .state.current.final > text { fill: white; font-weight: bold; }
.state .n { font-size: 10px; fill: #1b4f91; font-weight: bold; } .state.current.atomic > .n { fill: white; }
.edge path { fill: none; stroke: #999; } .edge text { fill: #666; font-size: 10px; }
table { border-collapse: collapse; font-size: 12px; }
td, th { padding: 2px 8px; border-bottom: 1px solid #eee; text-align: left; vertical-align: top; }
tr.inst { cursor: pointer; } tr.inst:hover { background: #f3f6fb; } tr.inst.selected { background: #dce8f8; }
code { font-size: 11px; } #off { color: #a60; }
</style><script src="/debug/elk.js"></script></head><body>
<h1>voxserve <span id="phase" class="meta"></span> <span id="off" class="meta"></span></h1>
<div id="kinds"></div>
<h2>cluster <span id="cluster-meta" class="meta"></span></h2><div id="cluster" class="row"></div>
<h2>Last transitions</h2>
<table><thead><tr><th>time</th><th>actor</th><th>event</th><th>payload</th><th>state</th></tr></thead>
<tbody id="log"></tbody></table>
<script>
const token = new URLSearchParams(location.search).get('token');
const headers = token ? { authorization: 'Bearer ' + token } : {};
const elk = new ELK();
const layouts = {};
const TITLES = { system: 'system root', supervisor: 'supervisor', model: 'model entries',
  stream: 'stream sockets (WebSocket)', wyoming: 'Wyoming connections', http: 'HTTP connections' };
/** The instance selected per kind, its card, and the last state read. */
const selected = {}, cards = {};
let last = null, fetching = null;
const ENTITIES = { '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;' };
function esc(s) { return String(s).replace(/[&<>"]/g, (c) => ENTITIES[c]); }
function elkNode(n) {
  const leaf = !n.children.length;
  // Names are drawn here, not by ELK: atomic states centred, compound ones at their top left.
  const node = { id: 'n:' + n.id, layoutOptions: { 'elk.padding': '[top=24,left=10,bottom=10,right=10]' },
    children: n.children.map(elkNode) };
  if (leaf) { node.width = Math.max(70, n.key.length * 7 + 30); node.height = 28; }
  return node;
}
async function layout(chart) {
  const edges = chart.edges.filter((e) => e.target !== '' && e.source !== '').map((e, i) => ({ id: 'e' + i,
    sources: ['n:' + e.source], targets: ['n:' + e.target],
    labels: [{ text: e.label, width: e.label.length * 5.6, height: 11 }] }));
  const root = elkNode(chart.root);
  const graph = { id: 'g', layoutOptions: { 'elk.algorithm': 'layered', 'elk.direction': 'RIGHT',
    'elk.hierarchyHandling': 'INCLUDE_CHILDREN', 'elk.json.edgeCoords': 'ROOT', 'elk.json.shapeCoords': 'ROOT',
    'elk.spacing.nodeNode': '18', 'elk.layered.spacing.nodeNodeBetweenLayers': '30', 'elk.edgeLabels.inline': 'true' },
    children: root.children, edges };
  const done = await elk.layout(graph);
  const types = {};
  (function index(n) { types[n.id] = n.type; n.children.forEach(index); })(chart.root);
  return { graph: done, chart, types };
}
/** Lays out the charts not laid out yet (a kind seen for the first time: fetched again). */
async function ensureCharts(ids) {
  if (ids.every((id) => layouts[id]) || fetching) return fetching;
  fetching = (async () => {
    const r = await fetch('/debug/charts', { headers });
    if (r.ok) for (const c of await r.json()) if (!layouts[c.id]) layouts[c.id] = await layout(c);
  })().finally(() => { fetching = null; });
  return fetching;
}
/** A chart: the states in \`active\` lit, each state with instances in it marked with their count (\`counts\`). */
function svgOf(lay, active, counts) {
  const g = lay.graph, on = new Set(active);
  const w = Math.ceil(g.width), h = Math.ceil(g.height);
  // Drawn at its size, or narrower to fit the page down to 70 % (its card scrolls past that).
  let out = '<svg viewBox="0 0 ' + w + ' ' + h + '" style="width: 100%; max-width: ' + w + 'px; min-width: ' +
    Math.round(w * 0.7) + 'px; height: auto" data-chart="' + esc(lay.chart.id) + '">';
  out += '<defs><marker id="arr" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="6" markerHeight="6" ' +
    'orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#888"/></marker></defs>';
  (function draw(nodes) {
    for (const n of nodes || []) {
      const id = n.id.slice(2), type = lay.types[id], name = id.split('.').at(-1);
      const leaf = !(n.children && n.children.length), count = counts ? counts[id] || 0 : 0;
      out += '<g class="state ' + type + (on.has(id) ? ' current' : '') + (count ? ' occupied' : '') +
        '" data-state="' + esc(id) + '"' + (counts ? ' data-count="' + count + '"' : '') + '><rect x="' + n.x +
        '" y="' + n.y + '" width="' + n.width + '" height="' + n.height + '" rx="7"/>';
      out += leaf
        ? '<text x="' + (n.x + n.width / 2) + '" y="' + (n.y + n.height / 2 + 4) + '" text-anchor="middle">' +
          esc(name) + '</text>'
        : '<text x="' + (n.x + 8) + '" y="' + (n.y + 15) + '">' + esc(name) +
          (type === 'parallel' ? ' (parallel)' : '') + '</text>';
      if (count)
        out += '<text class="n" x="' + (n.x + n.width - 5) + '" y="' + (n.y + 11) + '" text-anchor="end">' +
          count + '</text>';
      out += '</g>';
      draw(n.children);
    }
  })(g.children);
  for (const e of g.edges || []) {
    for (const s of e.sections || []) {
      const pts = [s.startPoint, ...(s.bendPoints || []), s.endPoint];
      out += '<g class="edge"><path d="M' + pts.map((p) => p.x + ',' + p.y).join(' L') + '" marker-end="url(#arr)"/>';
      for (const l of e.labels || []) out += '<text x="' + l.x + '" y="' + (l.y + 9) + '">' + esc(l.text) + '</text>';
      out += '</g>';
    }
  }
  return out + '</svg>';
}
/** The card of a kind, made once: its title, figures, chart, filter and table. */
function cardOf(kind) {
  if (cards[kind]) return cards[kind];
  const el = document.createElement('section');
  el.className = 'card kind';
  el.dataset.kind = kind;
  el.innerHTML = '<h2>' + esc(TITLES[kind] || kind) + ' <span class="meta count"></span></h2>' +
    '<div class="meta figures"></div><div class="body"><div class="svg"></div><div class="rows">' +
    '<input type="search" placeholder="filter by id or state" hidden><div class="meta hint"></div>' +
    '<div class="scroll"><table><thead><tr><th>id</th><th>state</th><th>leases</th><th>queue</th><th></th></tr>' +
    '</thead><tbody></tbody></table></div></div></div>';
  el.querySelector('input').oninput = () => draw(kind);
  el.querySelector('tbody').onclick = (ev) => {
    const tr = ev.target.closest('tr.inst');
    if (!tr) return;
    selected[kind] = selected[kind] === tr.dataset.id ? undefined : tr.dataset.id;
    draw(kind);
  };
  document.getElementById('kinds').appendChild(el);
  return (cards[kind] = el);
}
/** One instance's row (a model's also carries \`data-model\` and its status state). */
function rowOf(kind, i, sel) {
  return '<tr class="inst' + (sel && sel.id === i.id ? ' selected' : '') + '" data-id="' + esc(i.id) + '"' +
    (kind === 'model' ? ' data-model="' + esc(i.name) + '" data-state="' + esc(i.state) + '"' : '') + '><td><b>' +
    esc(i.name) + '</b></td><td>' + esc(i.state) + '</td><td>' + (i.leases === null ? '' : esc(i.leases)) +
    '</td><td>' + (i.queue === null ? '' : i.queue) + '</td><td class="meta">' + esc(i.detail) + '</td></tr>';
}
/** Redraws one kind's card from the last state read. */
function draw(kind) {
  const k = last && last.kinds.find((x) => x.kind === kind);
  if (!k) return;
  const card = cardOf(kind), lay = layouts[k.chart];
  const sel = k.instances.find((i) => i.id === selected[kind]) || (k.count === 1 ? k.instances[0] : null);
  const leaves = Object.entries(k.states).filter(([p]) => lay && ['atomic', 'final'].includes(lay.types[p]));
  card.querySelector('.count').textContent = k.count + (k.count === 1 ? ' instance' : ' instances') +
    (k.count > 1 && leaves.length ? ': ' + leaves.map(([p, n]) => p.split('.').at(-1) + ' ' + n).join(', ') : '');
  if (lay) card.querySelector('.svg').innerHTML = svgOf(lay, sel ? sel.active : [], k.count > 1 ? k.states : null);
  const input = card.querySelector('input'), q = input.value.trim().toLowerCase();
  input.hidden = k.count <= 10;
  const rows = q
    ? k.instances.filter((i) => (i.name + ' ' + i.id + ' ' + i.state).toLowerCase().includes(q))
    : k.instances;
  const lit = sel ? 'lit: ' + sel.name + ' (click it again to clear)' : 'click a row to light its states';
  card.querySelector('.hint').textContent = (k.count > 1 ? lit : '') +
    (k.instances.length < k.count ? '; the first ' + k.instances.length + ' of ' + k.count + ' are listed' : '') +
    (q ? '; ' + rows.length + ' match' : '');
  card.querySelector('tbody').innerHTML = rows.map((i) => rowOf(kind, i, sel)).join('');
}
function supervisorFigures(s) {
  if (!s.loading_for) return 'gate idle';
  const room = s.room, list = (xs) => esc(xs.join(', ') || 'none');
  return 'cold load of <b>' + esc(s.loading_for) + '</b>' + (s.waiting_for ? ', waiting for ' + s.waiting_for : '') +
    (s.victim ? ', victim ' + esc(s.victim.id) + ' (' + s.victim.reason + ')' : '') +
    (room ? '<br>resident: ' + list(room.resident) + '; retiring: ' + list(room.retiring) + '; candidates: ' +
      list(room.candidates) + (room.headroom_bytes ? '; needs ' + room.needed_bytes + ' + ' + room.headroom_bytes +
      ' B, free ' + room.free_bytes + ' B' : '') : '') +
    (s.pending.length ? '<br>pending: ' + esc(s.pending.join(', ')) : '');
}
function nodeCard(c, n) {
  const mib = (b, digits) => (b / 1048576).toFixed(digits) + ' MiB';
  const models = n.models.length
    ? n.models.map((m) => '<tr data-model="' + esc(m.id) + '"><td><b>' + esc(m.id) + '</b></td><td>' + esc(m.state) +
      '</td><td>slots ' + (m.slots - m.free_slots) + '/' + m.slots + '</td><td>queued ' + m.queued + '</td><td>' +
      mib(m.resident_bytes, 1) + '</td></tr>').join('')
    : '<tr><td class="meta">holds no model</td></tr>';
  return '<div class="card node" data-node="' + esc(n.node) + '"><h2>' + esc(n.node) + ' <span class="meta">' +
    (n.node === c.node ? 'this node' : 'seen ' + n.last_seen_ms + ' ms ago') + (n.draining ? ', <b>draining</b>' : '') +
    '</span></h2><div class="meta">' + esc(n.url) + '<br>free memory ' + mib(n.free_bytes, 0) +
    (n.max_loaded_models ? ', at most ' + n.max_loaded_models + ' models' : '') + '</div><table><tbody>' + models +
    '</tbody></table></div>';
}
function drawCluster(c) {
  document.getElementById('cluster-meta').textContent = c
    ? 'this node: ' + c.node + ', NATS ' + (c.nats.connected ? 'connected' : 'disconnected') + ' (' + c.nats.url +
      '), heartbeat ' + c.heartbeat_ms + ' ms'
    : '(a single node: no cluster configured)';
  document.getElementById('cluster').innerHTML = c ? c.nodes.map((n) => nodeCard(c, n)).join('') : '';
}
function logRow(t) {
  const payload = t.payload ? JSON.stringify(t.payload) : t.context ? JSON.stringify(t.context) : '';
  return '<tr><td>' + new Date(t.at).toISOString().slice(11, 23) + '</td><td>' + esc(t.actor) + '</td><td>' +
    esc(t.event || t.kind) + '</td><td><code>' + esc(payload) + '</code></td><td>' + esc(t.state || '') + '</td></tr>';
}
async function refresh() {
  const r = await fetch('/debug/state', { headers });
  if (!r.ok) {
    document.getElementById('phase').textContent = r.status !== 403 ? 'HTTP ' + r.status
      : token ? 'HTTP 403: the token is not the management.token of this server'
      : 'this server has a management token: open /debug?token=<management.token>';
    return;
  }
  const d = await r.json();
  await ensureCharts(d.kinds.map((k) => k.chart));
  last = d;
  const off = '(inspection is off: start with --inspect to see transitions)';
  document.getElementById('phase').textContent =
    'system: ' + d.root.state + ', supervisor: ' + d.supervisor.active.at(-1);
  document.getElementById('off').textContent = d.inspect ? '' : off;
  for (const k of d.kinds) draw(k.kind);
  if (cards.supervisor) cards.supervisor.querySelector('.figures').innerHTML = supervisorFigures(d.supervisor);
  if (cards.stream)
    cards.stream.querySelector('.figures').textContent =
      'by phase: ' + Object.entries(d.streams).map(([k, v]) => k + ' ' + v).join(', ');
  drawCluster(d.cluster);
  document.getElementById('log').innerHTML = d.transitions.slice().reverse().map(logRow).join('');
}
(async () => {
  await ensureCharts(['system']);
  await refresh();
  setInterval(refresh, 500);
})();
</script></body></html>`;
