import { pino, type Logger } from 'pino';
import { collectDefaultMetrics, Counter, Gauge, Histogram, Registry } from 'prom-client';
import type { InspectionEvent } from 'xstate';

/** Log levels accepted in config (`log_level`) and on the CLI (`--log-level`). */
export const LOG_LEVELS = ['trace', 'debug', 'info', 'warn', 'error', 'fatal', 'silent'] as const;
export type LogLevel = (typeof LOG_LEVELS)[number];

/** A JSON-lines logger on stdout (pino, synchronous writes, so nothing is lost at exit). */
export function createLogger(level: LogLevel): Logger {
  return pino({ level, base: { service: 'voxserve' } }, pino.destination({ dest: 1, sync: true }));
}

const SECONDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30];
/**
 * The processing lag's buckets: {@link SECONDS} with steps of 25 ms from 50 to 250 ms, where a
 * stream's lag is judged (`voxserve bench` holds a run at p99 under the light-load floor + 100 ms).
 */
const LAG_SECONDS = [...SECONDS, 0.075, 0.125, 0.15, 0.175, 0.2, 0.225].sort((a, b) => a - b);

/**
 * A Prometheus histogram labelled by `model` alone, for values observed per stream window: its
 * `observe` is a bucket search and three additions. prom-client's Histogram validates and hashes
 * the labels on every call (about 3 µs), and the processing lag is observed for every window of
 * every stream (31 per second of VAD audio), a fifth of the main thread's work per stream.
 * Exposed as prom-client exposes its histograms (`_bucket` with `le`, cumulative; `_sum`; `_count`).
 */
export class ModelHistogram {
  readonly type = 'histogram';
  readonly aggregator = 'sum';
  private readonly models = new Map<string, { counts: Float64Array; sum: number; count: number }>();

  /** @param buckets upper bounds, ascending (the +Inf bucket is implied). */
  constructor(
    readonly name: string,
    readonly help: string,
    private readonly buckets: readonly number[],
    registry: Registry,
  ) {
    registry.registerMetric(this as unknown as Histogram);
  }

  /** The observer of one model's values. */
  labels({ model }: { model: string }): { observe(value: number): void } {
    let m = this.models.get(model);
    if (!m) this.models.set(model, (m = { counts: new Float64Array(this.buckets.length), sum: 0, count: 0 }));
    const { buckets } = this;
    const data = m;
    return {
      observe(value: number): void {
        let i = 0;
        while (i < buckets.length && value > buckets[i]) i++;
        if (i < buckets.length) data.counts[i]++;
        data.sum += value;
        data.count++;
      },
    };
  }

  /** Drops one model's series. */
  remove({ model }: { model: string }): void {
    this.models.delete(model);
  }

  /** What prom-client's registry reads at scrape time. */
  async get(): Promise<{
    name: string;
    help: string;
    type: string;
    aggregator: string;
    values: {
      value: number;
      labels: Record<string, string | number>;
      sharedLabels: Record<string, string>;
      metricName: string;
    }[];
  }> {
    const values: {
      value: number;
      labels: Record<string, string | number>;
      sharedLabels: Record<string, string>;
      metricName: string;
    }[] = [];
    for (const [model, m] of this.models) {
      const shared = { model };
      let acc = 0;
      this.buckets.forEach((le, i) =>
        values.push({
          value: (acc += m.counts[i]),
          labels: { le },
          sharedLabels: shared,
          metricName: `${this.name}_bucket`,
        }),
      );
      values.push({ value: m.count, labels: { le: '+Inf' }, sharedLabels: shared, metricName: `${this.name}_bucket` });
      values.push({ value: m.sum, labels: {}, sharedLabels: shared, metricName: `${this.name}_sum` });
      values.push({ value: m.count, labels: {}, sharedLabels: shared, metricName: `${this.name}_count` });
    }
    return { name: this.name, help: this.help, type: this.type, aggregator: this.aggregator, values };
  }

  /** Forgets every observation (prom-client's `resetMetrics`); observers handed out stay valid. */
  reset(): void {
    for (const m of this.models.values()) {
      m.counts.fill(0);
      m.sum = 0;
      m.count = 0;
    }
  }
}

/**
 * Prometheus metrics of one server, in a registry of its own (prom-client). Gauges that mirror
 * status (`queued_requests`, `active_slots`, `resident_bytes`, WebSocket counts) are filled at
 * scrape time by `collect` callbacks the server installs.
 */
export class Metrics {
  readonly registry = new Registry();
  /** Finished requests and streams by model and outcome (ok, or the error type). */
  readonly requests = new Counter({
    name: 'voxserve_requests_total',
    help: 'Requests and streams by model and outcome',
    labelNames: ['model', 'outcome'],
    registers: [this.registry],
  });
  /** One slot job (a run of windows or steps). */
  readonly inference = new Histogram({
    name: 'voxserve_inference_duration_seconds',
    help: 'Slot job run time',
    labelNames: ['model'],
    buckets: SECONDS,
    registers: [this.registry],
  });
  readonly queueWait = new Histogram({
    name: 'voxserve_queue_wait_seconds',
    help: 'Time from arrival to lease',
    labelNames: ['model'],
    buckets: SECONDS,
    registers: [this.registry],
  });
  readonly loads = new Counter({
    name: 'voxserve_loads_total',
    help: 'Model loads by outcome (ok, error)',
    labelNames: ['model', 'outcome'],
    registers: [this.registry],
  });
  readonly loadDuration = new Histogram({
    name: 'voxserve_load_duration_seconds',
    help: 'Model load time',
    labelNames: ['model'],
    buckets: SECONDS,
    registers: [this.registry],
  });
  readonly evictions = new Counter({
    name: 'voxserve_evictions_total',
    help: 'Models unloaded to make room (reason lru or memory) or for being idle (reason idle)',
    labelNames: ['model', 'reason'],
    registers: [this.registry],
  });
  readonly wsClosed = new Counter({
    name: 'voxserve_ws_closed_total',
    help: 'WebSocket streams closed, by close code',
    labelNames: ['code'],
    registers: [this.registry],
  });
  readonly queued = new Gauge({
    name: 'voxserve_queued_requests',
    help: 'Requests waiting for a lease',
    labelNames: ['model'],
    registers: [this.registry],
  });
  readonly activeSlots = new Gauge({
    name: 'voxserve_active_slots',
    help: 'Slots running a job',
    labelNames: ['model'],
    registers: [this.registry],
  });
  readonly resident = new Gauge({
    name: 'voxserve_resident_bytes',
    help: 'Measured model footprint',
    labelNames: ['model'],
    registers: [this.registry],
  });
  /** Windows per batched VAD run. */
  readonly batchSize = new Histogram({
    name: 'voxserve_batch_size',
    help: 'Windows per batched run',
    labelNames: ['model'],
    buckets: [1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
    registers: [this.registry],
  });
  /** From the arrival of a window's last sample to its result (streams). */
  readonly processingLag = new ModelHistogram(
    'voxserve_processing_lag_seconds',
    'Stream window: last sample arrival to result',
    LAG_SECONDS,
    this.registry,
  );
  readonly wsConnections = new Gauge({
    name: 'voxserve_ws_connections',
    help: 'Open WebSocket streams',
    registers: [this.registry],
  });
  readonly wsBuffered = new Gauge({
    name: 'voxserve_ws_bytes_buffered',
    help: 'Outbound bytes queued on WebSockets',
    registers: [this.registry],
  });

  /**
   * Removes every series of `model` from the metrics labelled by model: for a model that has left
   * the registry (an ad hoc group dropped, a folder head whose file is gone), so that the series of
   * models made on demand do not pile up. Its counts are gone with it (Prometheus sees the
   * series end, as for a restarted process).
   */
  async forget(model: string): Promise<void> {
    const byModel = [
      this.requests,
      this.inference,
      this.queueWait,
      this.loads,
      this.loadDuration,
      this.evictions,
      this.queued,
      this.activeSlots,
      this.resident,
      this.batchSize,
    ] as unknown as Gauge<string>[];
    for (const metric of byModel)
      for (const { labels } of (await metric.get()).values)
        if (labels.model === model) {
          const { le: _, ...series } = labels;
          metric.remove(series);
        }
    this.processingLag.remove({ model });
  }

  constructor() {
    // Node's event-loop delay histogram samples every 10 ms (prom-client's default): 10.5-11 ms of
    // CPU per second on an idle server (`node dist/tools/bench-idle.js`). Sampling every 100 ms
    // cost 1.5-3.5 ms, but the histogram's percentiles include the interval (an idle server's p50
    // then reads 0.100 s instead of 0.010), which would break dashboards and alerts: kept at 10 ms.
    collectDefaultMetrics({ register: this.registry, prefix: 'voxserve_' });
  }
}

/** One XState inspection record, as kept in the ring buffer and sent to `/debug/actors`. */
export interface InspectionRecord {
  seq: number;
  /** ms since the epoch */
  at: number;
  /** `@xstate.event`, `@xstate.snapshot`, `@xstate.actor` */
  kind: string;
  /** The actor's id: `system`, `supervisor`, `model:<model id>` or `socket:<n>`. */
  actor: string;
  /** The event's type (the event that caused a snapshot, for snapshots). */
  event?: string;
  /**
   * The event's fields (primitives, actor refs as their id, `error` objects), for events and the snapshots they cause.
   */
  payload?: Record<string, unknown>;
  /** The state as a dotted path (`resident.ready.idle`), for snapshots. */
  state?: string;
  /** The chart's figures worth showing (the supervisor's room, waiting load and victim), for snapshots. */
  context?: Record<string, unknown>;
}

/** Events too frequent to keep: mirrors of counters, per-request and per-frame bookkeeping. */
const QUIET_EVENTS = new Set(['LEASES', 'xstate.init', 'REQUEST_STARTED', 'RESPONSE_CLOSED', 'PONG']);

/** A state value as a dotted path; parallel regions joined with `, `. */
export function statePath(value: unknown): string {
  if (typeof value === 'string') return value;
  if (!value || typeof value !== 'object') return String(value);
  return Object.entries(value as Record<string, unknown>)
    .map(([k, v]) => (v && (typeof v !== 'object' || Object.keys(v).length) ? `${k}.${statePath(v)}` : k))
    .join(', ');
}

/** An event's fields made JSON-safe: primitives, arrays of primitives, actor refs by id, `{type, message}` errors. */
function payloadOf(event: Record<string, unknown>): Record<string, unknown> | undefined {
  const out: Record<string, unknown> = {};
  for (const [k, v] of Object.entries(event)) {
    if (k === 'type') continue;
    if (v === null || ['string', 'number', 'boolean'].includes(typeof v)) out[k] = v;
    else if (Array.isArray(v) && v.every((x) => typeof x !== 'object')) out[k] = v;
    else if (v && typeof v === 'object' && 'sessionId' in v && 'id' in v) out[k] = (v as { id: string }).id;
    else if (v instanceof Error) out[k] = { type: (v as { type?: string }).type ?? v.name, message: v.message };
    else if (v && typeof v === 'object' && 'message' in v)
      out[k] = { type: (v as { type?: unknown }).type, message: (v as { message: unknown }).message };
  }
  return Object.keys(out).length ? out : undefined;
}

/** Context fields shown with snapshots (the supervisor's decisions). */
const SHOWN_CONTEXT = ['room', 'victim', 'waitingFor', 'evicted', 'lastError'];

/**
 * A bounded ring buffer of inspection records with live subscribers (`/debug/actors`).
 * `inspect` is the observer given to XState's `createActor(..., { inspect })`. Snapshots are kept
 * only when an actor's state changes; promise and callback actors are left out.
 */
export class InspectionLog {
  private readonly buffer: InspectionRecord[] = [];
  private readonly subscribers = new Set<(r: InspectionRecord) => void>();
  private readonly lastState = new Map<string, string>();
  private seq = 0;

  /** @param capacity records kept. */
  constructor(private readonly capacity = 2000) {}

  readonly inspect = (e: InspectionEvent): void => {
    // Microsteps carry each state an actor passes through, before the events its actions send are
    // delivered, so the log keeps cause before effect; snapshots add the initial and stopped states.
    if (
      e.type !== '@xstate.snapshot' &&
      e.type !== '@xstate.microstep' &&
      e.type !== '@xstate.event' &&
      e.type !== '@xstate.actor'
    )
      return;
    const actor = (e.actorRef as { id?: string }).id ?? '';
    if (!/^(system$|supervisor$|model:|socket:)/.test(actor)) return;
    const r: InspectionRecord = {
      seq: ++this.seq,
      at: Date.now(),
      kind: e.type === '@xstate.microstep' ? '@xstate.snapshot' : e.type,
      actor,
    };
    if (e.type === '@xstate.event') {
      if (QUIET_EVENTS.has(e.event.type)) return;
      r.event = e.event.type;
      r.payload = payloadOf(e.event as Record<string, unknown>);
    }
    if (e.type === '@xstate.snapshot' || e.type === '@xstate.microstep') {
      const snapshot = e.snapshot as { value?: unknown; status?: string; context?: Record<string, unknown> };
      const state = snapshot.status === 'stopped' ? 'stopped' : statePath(snapshot.value);
      if (this.lastState.get(actor) === state) return;
      // An HTTP connection going busy and idle with each request (the /debug page's own polls) is noise.
      if (actor.startsWith('socket:http:') && (state === 'open' || state === 'streaming') && this.lastState.has(actor))
        return;
      if (state === 'stopped') this.lastState.delete(actor);
      else this.lastState.set(actor, state);
      r.event = e.event.type;
      r.payload = payloadOf(e.event as Record<string, unknown>);
      r.state = state;
      const shown = SHOWN_CONTEXT.filter((k) => snapshot.context?.[k] != null);
      if (shown.length) r.context = Object.fromEntries(shown.map((k) => [k, snapshot.context![k]]));
    }
    this.buffer.push(r);
    if (this.buffer.length > this.capacity) this.buffer.shift();
    for (const s of this.subscribers) s(r);
  };

  /** Records kept now, oldest first. */
  recent(): InspectionRecord[] {
    return [...this.buffer];
  }

  /** Calls `fn` with every new record; returns the unsubscribe function. */
  subscribe(fn: (r: InspectionRecord) => void): () => void {
    this.subscribers.add(fn);
    return () => this.subscribers.delete(fn);
  }
}
