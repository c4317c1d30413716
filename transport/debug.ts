import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import type { ServerResponse } from 'node:http';
import type { AnyActorRef, AnyStateMachine } from 'xstate';
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

/** The kinds `/debug` always draws, with or without instances: the root, the supervisor, model entries and both socket actors. */
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

/** Every active state path of a snapshot value (`{resident: {ready: 'idle'}}` -> `resident`, `resident.ready`, `resident.ready.idle`). */
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
  /** The actor's id (`model:vad-a`, `socket:12`, `socket:http:3`); a catalog model not registered yet has `model:<id>`. */
  id: string;
  /** What the row is called: the model's id, else the actor's id. */
  name: string;
  /** The current state: the active leaves of the chart (a model's status state, `ready`, `unloaded`, ...). */
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

/** The active leaves of a set of state paths (those no other path extends). */
function leaves(active: string[]): string {
  return active.filter((p) => !active.some((q) => q.startsWith(`${p}.`))).join(', ');
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
  const row: DebugInstance = {
    id: ref.id,
    name: ref.id,
    state: leaves(active),
    active,
    leases: null,
    queue: null,
    detail: '',
  };
  const ctx = snap.context;
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
 * lays each out once with elkjs (layered, hierarchy included), and redraws the active states from
 * `/debug/state` twice a second: the root, the supervisor with the figures of the load it works
 * for, one card per model, in a cluster one card per node (the models it holds, free memory,
 * draining), stream sockets counted by phase (click one to see its chart), and the last
 * transitions with their event payloads.
 */
export const DEBUG_PAGE = `<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>voxserve /debug</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; } h2 { font-size: 1.05em; margin: 0.3em 0; }
.row { display: flex; flex-wrap: wrap; gap: 1em; align-items: flex-start; }
.card { border: 1px solid #ccc; border-radius: 6px; padding: 0.6em; }
.meta { color: #555; font-size: 12px; }
svg text { font: 11px system-ui, sans-serif; }
.state > rect { fill: #f7f7f7; stroke: #999; }
.state.compound > rect { fill: none; stroke: #bbb; stroke-dasharray: 4 3; }
.state.current > rect { fill: #2f7de1; stroke: #1b4f91; }
.state.compound.current > rect { fill: #e8f0fc; stroke: #2f7de1; stroke-dasharray: none; }
.state.current.atomic > text, .state.current.final > text { fill: white; font-weight: bold; }
.edge path { fill: none; stroke: #999; } .edge text { fill: #666; font-size: 10px; }
table { border-collapse: collapse; font-size: 12px; } td, th { padding: 2px 8px; border-bottom: 1px solid #eee; text-align: left; vertical-align: top; }
code { font-size: 11px; } #off { color: #a60; } .sock { cursor: pointer; text-decoration: underline; margin-right: 0.6em; }
</style><script src="/debug/elk.js"></script></head><body>
<h1>voxserve <span id="phase" class="meta"></span></h1>
<div class="row">
  <div class="card" id="root-card" data-chart="system"><h2>system root</h2><div class="svg"></div></div>
  <div class="card" id="sup-card" data-chart="supervisor"><h2>supervisor</h2><div id="figures" class="meta"></div><div class="svg"></div></div>
</div>
<h2>models</h2><div id="models" class="row"></div>
<h2>cluster <span id="cluster-meta" class="meta"></span></h2><div id="cluster" class="row"></div>
<h2>sockets <span id="off"></span></h2>
<div class="meta">streams: <span id="streams"></span></div><div id="socklist" class="meta"></div>
<div class="row"><div class="card" id="sock-card" data-chart="stream"><h2 id="sock-title">stream socket (click one above)</h2><div class="svg"></div></div>
<div class="card" data-chart="http"><h2>HTTP socket</h2><div class="svg"></div></div></div>
<h2>Last transitions</h2>
<table><thead><tr><th>time</th><th>actor</th><th>event</th><th>payload</th><th>state</th></tr></thead><tbody id="log"></tbody></table>
<script>
const token = new URLSearchParams(location.search).get('token');
const headers = token ? { authorization: 'Bearer ' + token } : {};
const elk = new ELK();
const layouts = {};
function esc(s) { return String(s).replace(/[&<>"]/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;' })[c]); }
function elkNode(n, edges) {
  const leaf = !n.children.length;
  // Names are drawn here, not by ELK: atomic states centred, compound ones at their top left.
  const node = { id: 'n:' + n.id, layoutOptions: { 'elk.padding': '[top=24,left=10,bottom=10,right=10]' }, children: n.children.map((c) => elkNode(c, edges)) };
  if (leaf) { node.width = Math.max(70, n.key.length * 7 + 16); node.height = 28; }
  return node;
}
async function layout(chart) {
  const edges = chart.edges.filter((e) => e.target !== '' && e.source !== '').map((e, i) => ({ id: 'e' + i, sources: ['n:' + e.source], targets: ['n:' + e.target],
    labels: [{ text: e.label, width: e.label.length * 5.6, height: 11 }] }));
  const root = elkNode(chart.root, edges);
  const graph = { id: 'g', layoutOptions: { 'elk.algorithm': 'layered', 'elk.direction': 'RIGHT', 'elk.hierarchyHandling': 'INCLUDE_CHILDREN',
    'elk.json.edgeCoords': 'ROOT', 'elk.json.shapeCoords': 'ROOT', 'elk.spacing.nodeNode': '18', 'elk.layered.spacing.nodeNodeBetweenLayers': '30', 'elk.edgeLabels.inline': 'true' },
    children: root.children, edges };
  const done = await elk.layout(graph);
  return { graph: done, chart };
}
function svgOf(lay, active) {
  const g = lay.graph, on = new Set(active);
  let out = '<svg width="' + Math.ceil(g.width) + '" height="' + Math.ceil(g.height) + '" data-chart="' + lay.chart.id + '">';
  out += '<defs><marker id="arr" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="6" markerHeight="6" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#888"/></marker></defs>';
  const types = {};
  (function index(n) { types['n:' + n.id] = n.type; n.children.forEach(index); })(lay.chart.root);
  (function draw(nodes) {
    for (const n of nodes || []) {
      const id = n.id.slice(2), type = types[n.id], name = id.split('.').at(-1), leaf = !(n.children && n.children.length);
      out += '<g class="state ' + type + (on.has(id) ? ' current' : '') + '" data-state="' + esc(id) + '"><rect x="' + n.x + '" y="' + n.y + '" width="' + n.width + '" height="' + n.height + '" rx="7"/>';
      out += leaf ? '<text x="' + (n.x + n.width / 2) + '" y="' + (n.y + n.height / 2 + 4) + '" text-anchor="middle">' + esc(name) + '</text>'
        : '<text x="' + (n.x + 8) + '" y="' + (n.y + 15) + '">' + esc(name) + (type === 'parallel' ? ' (parallel)' : '') + '</text>';
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
let selected = null;
function fill(card, chartId, active) { const el = card.querySelector('.svg'); if (layouts[chartId]) el.innerHTML = svgOf(layouts[chartId], active); }
async function refresh() {
  const r = await fetch('/debug/state', { headers });
  if (!r.ok) { document.getElementById('phase').textContent = r.status === 403 ? (token ? 'HTTP 403: the token is not the management.token of this server' : 'this server has a management token: open /debug?token=<management.token>') : 'HTTP ' + r.status; return; }
  const d = await r.json();
  document.getElementById('phase').textContent = 'system: ' + d.root.state + ', supervisor: ' + d.supervisor.active.at(-1);
  fill(document.getElementById('root-card'), 'system', d.root.active);
  fill(document.getElementById('sup-card'), 'supervisor', d.supervisor.active);
  const s = d.supervisor, room = s.room;
  document.getElementById('figures').innerHTML = s.loading_for ? 'cold load of <b>' + esc(s.loading_for) + '</b>' + (s.waiting_for ? ', waiting for ' + s.waiting_for : '') +
    (s.victim ? ', victim ' + esc(s.victim.id) + ' (' + s.victim.reason + ')' : '') + (room ? '<br>resident: ' + esc(room.resident.join(', ') || 'none') + '; retiring: ' + esc(room.retiring.join(', ') || 'none') +
    '; candidates: ' + esc(room.candidates.join(', ') || 'none') + (room.headroom_bytes ? '; needs ' + room.needed_bytes + ' + ' + room.headroom_bytes + ' B, free ' + room.free_bytes + ' B' : '') : '') +
    (s.pending.length ? '<br>pending: ' + esc(s.pending.join(', ')) : '') : 'gate idle';
  document.getElementById('models').innerHTML = d.models.map((m) =>
    '<div class="card model" data-model="' + esc(m.id) + '" data-state="' + m.state + '"><h2>' + esc(m.id) + ' <span class="meta">' + m.task + ', ' + m.state + '</span></h2>' +
    '<div class="meta">slots ' + m.active_slots + '/' + m.slots + ', leases ' + m.active_leases + '/' + m.max_streams + ', queued ' + m.queued_requests +
    (m.last_eviction ? ', evicted (' + m.last_eviction.reason + ')' : '') + (m.last_error ? ', last error: ' + esc(m.last_error) : '') + '</div>' +
    (layouts.model ? svgOf(layouts.model, m.active) : '') + '</div>').join('');
  const c = d.cluster;
  document.getElementById('cluster-meta').textContent = c ? 'this node: ' + c.node + ', NATS ' + (c.nats.connected ? 'connected' : 'disconnected') + ' (' + c.nats.url + '), heartbeat ' + c.heartbeat_ms + ' ms' : '(a single node: no cluster configured)';
  document.getElementById('cluster').innerHTML = c ? c.nodes.map((n) =>
    '<div class="card node" data-node="' + esc(n.node) + '"><h2>' + esc(n.node) + ' <span class="meta">' + (n.node === c.node ? 'this node' : 'seen ' + n.last_seen_ms + ' ms ago') + (n.draining ? ', <b>draining</b>' : '') + '</span></h2>' +
    '<div class="meta">' + esc(n.url) + '<br>free memory ' + (n.free_bytes / 1048576).toFixed(0) + ' MiB' + (n.max_loaded_models ? ', at most ' + n.max_loaded_models + ' models' : '') + '</div>' +
    '<table><tbody>' + (n.models.length ? n.models.map((m) => '<tr data-model="' + esc(m.id) + '"><td><b>' + esc(m.id) + '</b></td><td>' + esc(m.state) + '</td><td>slots ' + (m.slots - m.free_slots) + '/' + m.slots + '</td><td>queued ' + m.queued + '</td><td>' + (m.resident_bytes / 1048576).toFixed(1) + ' MiB</td></tr>').join('') : '<tr><td class="meta">holds no model</td></tr>') + '</tbody></table></div>').join('') : '';
  document.getElementById('streams').textContent = Object.entries(d.streams).map(([k, v]) => k + ' ' + v).join(', ');
  document.getElementById('off').textContent = d.inspect ? '' : '(inspection is off: start with --inspect to see transitions)';
  document.getElementById('socklist').innerHTML = d.sockets.map((k) => '<span class="sock" data-socket="' + esc(k.id) + '">' + esc(k.id) + ' (' + k.phase + ')</span>').join('');
  for (const el of document.querySelectorAll('.sock')) el.onclick = () => { selected = el.dataset.socket; refresh(); };
  const sock = d.sockets.find((k) => k.id === selected);
  document.getElementById('sock-title').textContent = sock ? 'stream socket ' + sock.id : 'stream socket (click one above)';
  fill(document.getElementById('sock-card'), 'stream', sock ? sock.active : []);
  fill(document.querySelector('[data-chart="http"]'), 'http', []);
  document.getElementById('log').innerHTML = d.transitions.slice().reverse().map((t) =>
    '<tr><td>' + new Date(t.at).toISOString().slice(11, 23) + '</td><td>' + esc(t.actor) + '</td><td>' + esc(t.event || t.kind) + '</td><td><code>' + esc(t.payload ? JSON.stringify(t.payload) : t.context ? JSON.stringify(t.context) : '') +
    '</code></td><td>' + esc(t.state || '') + '</td></tr>').join('');
}
(async () => {
  const r = await fetch('/debug/charts', { headers });
  if (r.ok) for (const c of await r.json()) layouts[c.id] = await layout(c);
  await refresh();
  setInterval(refresh, 500);
})();
</script></body></html>`;
