import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import type { ServerResponse } from 'node:http';
import type { AnyStateMachine } from 'xstate';
import type { ClusterNode, HeldModel } from '../cluster/node.js';
import { httpSocketMachine } from '../actors/http.js';
import type { InspectionLog } from '../actors/inspection.js';
import { modelMachine } from '../actors/model.js';
import { streamPhase, streamSocketMachine } from '../actors/stream.js';
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

/** The charts `/debug` draws: the system root, the supervisor, a model entry, and both socket actors. */
export const CHARTS: Chart[] = [
  systemMachine,
  supervisorMachine,
  modelMachine,
  streamSocketMachine,
  httpSocketMachine,
].map(chartOf);

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

/**
 * `GET /debug/state`: the root's and the supervisor's states (with the supervisor's figures: the
 * load it works for, what it waits for, the victim), every model's status and active states,
 * streams counted by phase with a sample of their states, the last transitions, and the cluster
 * ({@link clusterView}; null for a single node).
 */
export function debugState(
  supervisor: Supervisor,
  streams: ReadonlySet<StreamLink>,
  inspection: InspectionLog | null,
  cluster: ClusterNode | null = null,
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
    models: supervisor
      .statuses()
      .map((m) => ({ ...m, active: activePaths(supervisor.chartValue(m.id) ?? 'unloaded') })),
    streams: counts,
    sockets: sample,
    transitions: inspection ? inspection.recent().slice(-80) : [],
    cluster: cluster ? clusterView(cluster) : null,
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
