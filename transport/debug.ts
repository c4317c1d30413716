import type { ServerResponse } from 'node:http';
import { modelMachine } from '../actors/model.js';
import type { Supervisor } from '../actors/supervisor.js';
import type { InspectionLog } from '../actors/inspection.js';
import { streamPhase } from '../actors/stream.js';
import type { StreamLink } from './stream.js';

/** The model entry state chart as data: states and their transitions (event -> target). */
export function modelChart(): { states: string[]; transitions: { from: string; event: string; to: string }[] } {
  const transitions: { from: string; event: string; to: string }[] = [];
  const states = Object.keys(modelMachine.root.states);
  for (const [from, node] of Object.entries(modelMachine.root.states)) {
    for (const [eventType, list] of node.transitions) {
      const event = eventType.startsWith('xstate.done.actor') ? 'done' : eventType.startsWith('xstate.error.actor') ? 'error' : eventType;
      for (const t of list) for (const target of t.target ?? []) transitions.push({ from, event, to: target.key });
    }
  }
  return { states, transitions };
}

/** `GET /debug/state`: the supervisor's state, the chart, every model's status, streams by state, recent transitions. */
export function debugState(supervisor: Supervisor, streams: ReadonlySet<StreamLink>, inspection: InspectionLog | null): unknown {
  const byState: Record<string, number> = { open: 0, streaming: 0, draining: 0 };
  for (const s of streams) {
    const phase = streamPhase(s.actor);
    byState[phase] = (byState[phase] ?? 0) + 1;
  }
  return {
    inspect: inspection !== null,
    supervisor: supervisor.actor.getSnapshot().value,
    chart: modelChart(),
    models: supervisor.statuses(),
    streams: byState,
    transitions: inspection ? inspection.recent().filter((r) => r.kind === '@xstate.snapshot').slice(-50) : [],
  };
}

/**
 * `GET /debug/actors`: server-sent events, one `data:` line of JSON per inspection record: the
 * ring buffer first, then live records until the client goes or `closing` fires.
 */
export function streamActors(res: ServerResponse, inspection: InspectionLog | null, closing: Set<ServerResponse>): void {
  res.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-store', connection: 'keep-alive' });
  if (!inspection) {
    res.end(`event: off\ndata: ${JSON.stringify({ message: 'inspection is off; start the server with --inspect' })}\n\n`);
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

/** `GET /debug`: a self-contained page (no CDN): live actors, each model's chart with its state lit, the last transitions. */
export const DEBUG_PAGE = `<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>voxserve /debug</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; } h2 { font-size: 1.05em; margin: 0.3em 0; }
.models { display: flex; flex-wrap: wrap; gap: 1em; }
.model { border: 1px solid #ccc; border-radius: 6px; padding: 0.6em; }
.meta { color: #555; font-size: 12px; }
svg text { font: 11px system-ui, sans-serif; }
.state rect { fill: #f4f4f4; stroke: #888; }
.state.current rect { fill: #2f7de1; stroke: #1b4f91; }
.state.current text { fill: white; font-weight: bold; }
table { border-collapse: collapse; font-size: 12px; } td, th { padding: 2px 8px; border-bottom: 1px solid #eee; text-align: left; }
#off { color: #a60; }
</style></head><body>
<h1>voxserve <span id="sup" class="meta"></span></h1>
<div class="meta">streams: <span id="streams"></span> <span id="off"></span></div>
<div id="models" class="models"></div>
<h2>Last transitions</h2>
<table><thead><tr><th>time</th><th>actor</th><th>event</th><th>state</th></tr></thead><tbody id="log"></tbody></table>
<script>
const token = new URLSearchParams(location.search).get('token');
const headers = token ? { authorization: 'Bearer ' + token } : {};
const W = 440, H = 300, BW = 104, BH = 28;
// The model entry chart's own layout; any other chart goes on a circle.
const LAYOUT = { unloaded: [110, 50], loading: [330, 50], ready: [330, 250], unloading: [110, 250], reconfiguring: [220, 150] };
function place(states) {
  if (states.every((s) => LAYOUT[s])) return Object.fromEntries(states.map((s) => [s, { x: LAYOUT[s][0], y: LAYOUT[s][1] }]));
  const pos = {}; const n = states.length;
  states.forEach((s, i) => { const a = -Math.PI / 2 + (2 * Math.PI * i) / n; pos[s] = { x: W / 2 + 150 * Math.cos(a), y: H / 2 + 105 * Math.sin(a) }; });
  return pos;
}
function esc(s) { return String(s).replace(/[&<>"]/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;' })[c]); }
function chartSvg(chart, current) {
  const pos = place(chart.states);
  let out = '<svg width="' + W + '" height="' + H + '" viewBox="0 0 ' + W + ' ' + H + '">';
  out += '<defs><marker id="arr" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#777"/></marker></defs>';
  const seen = {};
  for (const t of chart.transitions) {
    if (t.from === t.to) continue;
    const a = pos[t.from], b = pos[t.to];
    const key = [t.from, t.to].sort().join('|'); const k = (seen[key] = (seen[key] || 0) + 1);
    const dx = b.x - a.x, dy = b.y - a.y, len = Math.hypot(dx, dy) || 1;
    const off = (t.from < t.to ? 1 : -1) * (6 + (k - 1) * 14);
    const nx = -dy / len * off, ny = dx / len * off;
    const sx = a.x + dx * 0.3 + nx, sy = a.y + dy * 0.3 + ny, ex = a.x + dx * 0.7 + nx, ey = a.y + dy * 0.7 + ny;
    out += '<line x1="' + sx + '" y1="' + sy + '" x2="' + ex + '" y2="' + ey + '" stroke="#999" marker-end="url(#arr)"/>';
    // Labels beside vertical edges, above or below the others.
    const vertical = Math.abs(dx) < Math.abs(dy);
    const lx = (sx + ex) / 2 + (vertical ? Math.sign(nx) * 5 : 0), ly = (sy + ey) / 2 + (vertical ? 4 + (k - 1) * 13 : Math.sign(ny || -1) * 7 + 3);
    const anchor = vertical ? (nx < 0 ? 'end' : 'start') : 'middle';
    out += '<text x="' + lx + '" y="' + ly + '" fill="#666" text-anchor="' + anchor + '">' + esc(t.event) + '</text>';
  }
  for (const s of chart.states) {
    const p = pos[s];
    out += '<g class="state' + (s === current ? ' current' : '') + '" data-state="' + s + '"><rect x="' + (p.x - BW / 2) + '" y="' + (p.y - BH / 2) + '" width="' + BW + '" height="' + BH + '" rx="8"/>';
    out += '<text x="' + p.x + '" y="' + (p.y + 4) + '" text-anchor="middle">' + s + '</text></g>';
  }
  return out + '</svg>';
}
async function refresh() {
  const r = await fetch('/debug/state', { headers });
  if (!r.ok) { document.getElementById('sup').textContent = 'HTTP ' + r.status; return; }
  const d = await r.json();
  document.getElementById('sup').textContent = 'supervisor: ' + d.supervisor;
  document.getElementById('streams').textContent = Object.entries(d.streams).map(([k, v]) => k + ' ' + v).join(', ');
  document.getElementById('off').textContent = d.inspect ? '' : '(inspection is off: start with --inspect to see transitions)';
  document.getElementById('models').innerHTML = d.models.map((m) =>
    '<div class="model" data-model="' + esc(m.id) + '" data-state="' + m.state + '"><h2>' + esc(m.id) + ' <span class="meta">' + m.task + ', ' + m.state + '</span></h2>' +
    '<div class="meta">slots ' + m.active_slots + '/' + m.slots + ', leases ' + m.active_leases + '/' + m.max_streams + ', queued ' + m.queued_requests + (m.last_error ? ', last error: ' + esc(m.last_error) : '') + '</div>' +
    chartSvg(d.chart, m.state) + '</div>').join('');
  document.getElementById('log').innerHTML = d.transitions.slice().reverse().map((t) =>
    '<tr><td>' + new Date(t.at).toISOString().slice(11, 23) + '</td><td>' + esc(t.actor) + '</td><td>' + esc(t.event || '') + '</td><td>' + esc(JSON.stringify(t.state)) + '</td></tr>').join('');
}
refresh(); setInterval(refresh, 500);
</script></body></html>`;
