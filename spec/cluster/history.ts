/**
 * A history checker for cluster runs (issue 41, "A history checker"), in the manner of Jepsen's:
 * a run records every operation as events (a request's invocation and its answer, a model's
 * load, unload and lock operations), each with the node and the wall time (ms since the epoch;
 * every process of a run is on this machine, so their clocks are one), and the state the cluster
 * is left in; {@link check} then lists what breaks the contract:
 * - every request (a file or tensor request over HTTP, a live stream over WebSocket) is answered
 *   exactly once: with a result equal to a single node's for the same input (a stream: its events;
 *   resumed on another node from the model's checkpoint, all of them too; resumed without one, its
 *   events before the reported gap), or with a clear error (an
 *   HTTP status or close code and an error code) within its busy timeout plus {@link MARGIN_MS};
 * - at most one load of a model is in flight in the cluster at any time;
 * - after healing, every node lists the same holders of a model, with one config;
 * - nothing left behind: no active lease, no load lock in the lock bucket, no slot host process
 *   once everything is unloaded;
 * - no stray answer: none for a request never asked, none before its request.
 */

/** How long past its busy timeout an error answer may come, ms: 3 heartbeats of 1 s (a holder taken for gone) and 2 s for this loaded 2-core machine. */
export const MARGIN_MS = 5000;

/** An operation asked of a node: `file` (`POST /v1/tasks/run`), `tensor`, or `stream` (WebSocket). */
export interface Invoke {
  type: 'invoke';
  /** Unique per request in the history. */
  id: string;
  op: 'file' | 'tensor' | 'stream';
  /** The node it was sent to (its ingress). */
  node: string;
  model: string;
  /** What was sent (a fixture's name): with `op` and `model`, the key of its expected result. */
  input: string;
  /** Wall time, ms. */
  at: number;
  /** The model's busy timeout, ms: an error must come within it plus {@link MARGIN_MS}. */
  busy_ms: number;
}

/**
 * A result: a file's or tensor's body, a stream's events (without `ready`; `done` as `{type, processed_ms}`, so that a
 * stream cut short is told apart).
 */
export interface Ok {
  type: 'ok';
  id: string;
  at: number;
  result: unknown;
  /**
   * A stream resumed on another node: the gap its client reported, ms of audio. `checkpoint`: the new
   * session went on from the model's checkpoint (a VAD stream, `resume_from`), so every event must
   * still equal the single node's; without one (a fresh session on the window grid), only those
   * before the gap.
   */
  gap?: { from_ms: number; to_ms: number; checkpoint: boolean };
}

/** An error answer: `status` an HTTP status or a WebSocket close code (0: none came), `error` its code or why. */
export interface Fail {
  type: 'fail';
  id: string;
  at: number;
  status: number;
  error: string;
}

/** A load of `model` on `node` (a local slot pool): from `start` to `end`, wall time in ms. */
export interface Load {
  type: 'load';
  node: string;
  model: string;
  start: number;
  end: number;
}

/** `model` unloaded on `node` at `at`. */
export interface Unload {
  type: 'unload';
  node: string;
  model: string;
  at: number;
}

/** A write to `model`'s load lock at `at`: taken or renewed (`put`, by `owner`) or released (`delete`). */
export interface LockOp {
  type: 'lock';
  model: string;
  op: 'put' | 'delete';
  owner?: string;
  at: number;
}

export type Event = Invoke | Ok | Fail | Load | Unload | LockOp;

/** What a node reports at the end of a run. */
export interface NodeState {
  node: string;
  /** Its `GET /v1/models`: per model, the holders it lists (from the registry). */
  models: {
    id: string;
    active_leases: number;
    nodes: { node: string; state: string; config: string; active_leases: number }[];
  }[];
  /** Pids of its slot host processes still running (after everything was unloaded: none). */
  slot_hosts: number[];
}

/** The cluster at the end of a run, after healing and unloading. */
export interface Final {
  nodes: NodeState[];
  /** Keys left in the lock bucket. */
  locks: string[];
}

export type ViolationKind =
  | 'unanswered'
  | 'answered-twice'
  | 'unclear-error'
  | 'late-error'
  | 'wrong-result'
  | 'concurrent-loads'
  | 'holders-differ'
  | 'configs-differ'
  | 'lease-left'
  | 'lock-left'
  | 'slot-host-left'
  | 'stray-answer';

export interface Violation {
  kind: ViolationKind;
  detail: string;
}

/** A stream event's time, ms of audio (`at_ms`, else `end_ms`, else `start_ms`), or undefined. */
function eventTime(e: unknown): number | undefined {
  const o = e as Record<string, unknown>;
  for (const k of ['at_ms', 'end_ms', 'start_ms']) if (typeof o?.[k] === 'number') return o[k] as number;
  return undefined;
}

const same = (a: unknown, b: unknown): boolean => JSON.stringify(a) === JSON.stringify(b);

/**
 * Checks a run's `history` and its `final` state against the contract above.
 * @param expected the single node's result per `op:model:input` (a stream's: its events).
 * @returns every violation found (none: the run passed).
 * @throws Error when an invocation's expected result is missing from `expected`.
 */
export function check(history: Event[], final: Final, expected: Record<string, unknown>): Violation[] {
  const out: Violation[] = [];
  const invokes = new Map<string, Invoke>();
  const answers = new Map<string, (Ok | Fail)[]>();
  for (const e of history) {
    if (e.type === 'invoke') invokes.set(e.id, e);
    else if (e.type === 'ok' || e.type === 'fail') answers.set(e.id, [...(answers.get(e.id) ?? []), e]);
  }
  for (const [id, got] of answers) {
    const inv = invokes.get(id);
    if (!inv) out.push({ kind: 'stray-answer', detail: `${id}: answered, never asked` });
    else if (got.some((a) => a.at < inv.at)) out.push({ kind: 'stray-answer', detail: `${id}: answered before asked` });
  }
  for (const [id, inv] of invokes) {
    const key = `${inv.op}:${inv.model}:${inv.input}`;
    if (!(key in expected)) throw new Error(`expected: no result for ${key} (request ${id})`);
    const got = answers.get(id) ?? [];
    const what = `${inv.op} ${id} on ${inv.node} (${inv.model})`;
    if (got.length === 0) {
      out.push({ kind: 'unanswered', detail: `${what}: no answer` });
      continue;
    }
    if (got.length > 1) out.push({ kind: 'answered-twice', detail: `${what}: ${got.length} answers` });
    const a = got[0];
    if (a.type === 'fail') {
      if (a.status === 0 || !a.error)
        out.push({ kind: 'unclear-error', detail: `${what}: status ${a.status} '${a.error}'` });
      else if (a.at - inv.at > inv.busy_ms + MARGIN_MS)
        out.push({
          kind: 'late-error',
          detail: `${what}: ${a.status} ${a.error} after ${a.at - inv.at} ms (busy timeout ${inv.busy_ms} + ${MARGIN_MS})`,
        });
      continue;
    }
    const want = expected[key];
    if (a.gap && !a.gap.checkpoint) {
      const before = (evs: unknown): unknown[] =>
        (evs as unknown[]).filter((e) => (eventTime(e) ?? Number.POSITIVE_INFINITY) < a.gap!.from_ms);
      if (!same(before(a.result), before(want)))
        out.push({ kind: 'wrong-result', detail: `${what}: events before its gap at ${a.gap.from_ms} ms differ` });
    } else if (!same(a.result, want))
      out.push({
        kind: 'wrong-result',
        detail: `${what}${a.gap ? ` (resumed from a checkpoint at ${a.gap.from_ms} ms)` : ''}: ${JSON.stringify(a.result).slice(0, 200)}`,
      });
  }
  const loads = history.filter((e): e is Load => e.type === 'load');
  for (let i = 0; i < loads.length; i++)
    for (let j = i + 1; j < loads.length; j++) {
      const [x, y] = [loads[i], loads[j]];
      if (x.model === y.model && x.start <= y.end && y.start <= x.end)
        out.push({
          kind: 'concurrent-loads',
          detail: `${x.model}: loading on ${x.node} (${x.start}-${x.end}) and on ${y.node} (${y.start}-${y.end})`,
        });
    }
  const holdersSeen = new Map<string, Map<string, string>>();
  const configsSeen = new Map<string, Set<string>>();
  for (const n of final.nodes)
    for (const m of n.models) {
      const holders = m.nodes.filter((h) => h.state === 'ready');
      const view = holders
        .map((h) => h.node)
        .sort()
        .join(',');
      const views = holdersSeen.get(m.id) ?? new Map<string, string>();
      views.set(n.node, view);
      holdersSeen.set(m.id, views);
      const configs = configsSeen.get(m.id) ?? new Set<string>();
      for (const h of holders) configs.add(h.config);
      configsSeen.set(m.id, configs);
      if (m.active_leases > 0)
        out.push({ kind: 'lease-left', detail: `${m.id} on ${n.node}: ${m.active_leases} leases` });
      for (const h of m.nodes)
        if (h.active_leases > 0)
          out.push({ kind: 'lease-left', detail: `${m.id}: ${n.node} lists ${h.active_leases} leases on ${h.node}` });
    }
  for (const views of holdersSeen.values())
    for (const n of final.nodes) if (!views.has(n.node)) views.set(n.node, '(model not listed)');
  for (const [model, configs] of configsSeen)
    if (configs.size > 1) out.push({ kind: 'configs-differ', detail: `${model}: configs ${[...configs].join(', ')}` });
  for (const [model, views] of holdersSeen)
    if (new Set(views.values()).size > 1)
      out.push({
        kind: 'holders-differ',
        detail: `${model}: ${[...views].map(([n, v]) => `${n} lists [${v}]`).join(', ')}`,
      });
  for (const k of final.locks) out.push({ kind: 'lock-left', detail: `lock ${k}` });
  for (const n of final.nodes)
    if (n.slot_hosts.length > 0)
      out.push({ kind: 'slot-host-left', detail: `${n.node}: slot host pids ${n.slot_hosts.join(', ')}` });
  return out;
}

/** A run's figures: requests by op, answered ok, and errors by `op status error`. */
export function figures(history: Event[]): {
  requests: Record<string, number>;
  ok: number;
  failures: Record<string, number>;
} {
  const invokes = new Map(history.filter((e): e is Invoke => e.type === 'invoke').map((e) => [e.id, e]));
  const requests: Record<string, number> = {};
  for (const i of invokes.values()) requests[i.op] = (requests[i.op] ?? 0) + 1;
  let ok = 0;
  const failures: Record<string, number> = {};
  for (const e of history) {
    if (e.type === 'ok') ok++;
    if (e.type === 'fail') {
      const k = `${invokes.get(e.id)?.op} ${e.status} ${e.error}`;
      failures[k] = (failures[k] ?? 0) + 1;
    }
  }
  return { requests, ok, failures };
}

/**
 * The loads and unloads in a node's log (pino JSON lines, `log_level` info): a load runs from the
 * model's `unloaded -> loading` to its next `model state`, unless the node logged `cluster: model
 * served by other nodes` for it meanwhile (a remote pool, no load); a load behind a remote pool
 * (`cluster: holds the model here behind its remote pool`) is logged only when done, so it is a
 * load from that time to that time. An unload is `-> unloaded` from any state but `loading`.
 */
export function fromLog(node: string, log: { line: Record<string, unknown> }[]): (Load | Unload)[] {
  const out: (Load | Unload)[] = [];
  const open = new Map<string, { start: number; remote: boolean }>();
  for (const { line } of log) {
    const model = line.model as string | undefined;
    const time = line.time as number;
    if (!model) continue;
    if (line.msg === 'cluster: model served by other nodes') {
      const o = open.get(model);
      if (o) o.remote = true;
    } else if (line.msg === 'cluster: holds the model here behind its remote pool') {
      out.push({ type: 'load', node, model, start: time, end: time });
    } else if (line.msg === 'model state') {
      const o = open.get(model);
      if (o) {
        open.delete(model);
        if (!o.remote) out.push({ type: 'load', node, model, start: o.start, end: time });
      }
      if (line.to === 'loading') open.set(model, { start: time, remote: false });
      if (line.to === 'unloaded' && line.from !== 'loading') out.push({ type: 'unload', node, model, at: time });
    }
  }
  for (const [model, o] of open)
    if (!o.remote) out.push({ type: 'load', node, model, start: o.start, end: Number.POSITIVE_INFINITY });
  return out;
}
