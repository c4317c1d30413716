/**
 * Scripted scenarios on the actor system, read from the inspection stream (DESIGN.md section 2,
 * C4, C12, C14): LRU eviction, idle eviction, a busy model refusing `EVICT`, stuck work. Fake
 * slot hosts; the expected order of events is the contract's, not the code's.
 */
import { describe, expect, it } from 'vitest';
import { Supervisor } from '../../actors/supervisor.js';
import { ModelConfig, ServerConfig } from '../../runtime/config.js';
import { VoxError } from '../../runtime/errors.js';
import type { LoadedModel, ModelLoader } from '../../runtime/loader.js';
import type { Job, JobResult } from '../../runtime/slots/slot-protocol.js';
import { SlotPool, type SlotHost } from '../../runtime/slots/slots.js';
import { InspectionLog, type InspectionRecord } from '../../runtime/telemetry.js';

/** Slots whose `run` waits for `gate` (resolved at once unless a test holds it). */
function fakeLoader(gate: { hold: Promise<void> | null }): ModelLoader {
  return async (): Promise<LoadedModel> => {
    const host: SlotHost = {
      info: {},
      run: async (job: Job): Promise<JobResult> => {
        await gate.hold;
        return {
          kind: 'vad',
          probs: new Float32Array(1),
          state: (job as { state: Float32Array }).state,
          context: new Float32Array(64),
        };
      },
      close: async () => {},
      onExit: () => {},
      residentBytes: () => 0,
    };
    const pool = await SlotPool.start({ kind: 'vad', model: '/fake.onnx' }, 1, async () => host);
    return { pool, residentBytes: 1000, close: () => pool.close() };
  };
}

const catalog = ['A', 'B'].map((id) => ModelConfig.parse({ id, task: 'vad', path: '/fake.onnx', max_batch_size: 1 }));
const job = () => ({
  kind: 'vad' as const,
  windows: new Float32Array(512),
  state: new Float32Array(256),
  context: new Float32Array(64),
});

function system(
  extra: Record<string, unknown>,
  gate = { hold: null as Promise<void> | null },
): { sup: Supervisor; log: InspectionLog; gate: typeof gate } {
  const log = new InspectionLog(10_000);
  const sup = new Supervisor(ServerConfig.parse({ log_level: 'silent', ...extra }), {
    loader: fakeLoader(gate),
    catalog,
    inspect: log.inspect,
  });
  return { sup, log, gate };
}

/** One request: lease, load if needed, one inference, release. */
async function request(sup: Supervisor, id: string): Promise<void> {
  const entry = sup.require(id);
  const lease = await entry.admit({});
  try {
    const { pool } = await entry.ensureReady();
    await pool.run(job());
  } finally {
    lease.release();
  }
}

/** Index of the first record matching `pred` after `from`; fails the test if there is none. */
function find(records: InspectionRecord[], what: string, pred: (r: InspectionRecord) => boolean, from = -1): number {
  const i = records.findIndex((r, k) => k > from && pred(r));
  expect(i, `${what} (after record ${from})`).toBeGreaterThan(from);
  return i;
}

describe('eviction as the inspector sees it', () => {
  it("max_loaded_models 1: B requested right after A's request ended -> A, idle, is evicted when first asked (its idle turn, told 25 ms after its last lease, is told before EVICT)", async () => {
    // A breaker's case: the gate asked A to EVICT while A's idle turn waited its delay; A's chart, still busy, refused,
    // and B's load waited ~25 ms for A's turn (503 no_room with a 45 ms busy timeout, 4 of 12 swaps).
    const { sup, log } = system({ max_loaded_models: 1 });
    for (let i = 0; i < 3; i++) {
      await request(sup, 'A');
      await request(sup, 'B');
    }
    const r = log.recent();
    const refused = r.filter((x) => x.kind === '@xstate.event' && x.event === 'EVICT_REFUSED');
    expect(refused.map((x) => x.payload)).toEqual([]);
    const evicted = r.filter((x) => x.actor === 'supervisor' && x.kind === '@xstate.event' && x.event === 'EVICTED');
    expect(evicted.length).toBe(5);
  });

  it('max_loaded_models 1: load A, request B -> the supervisor makes room, A gets EVICT {reason: lru}, unloads, then B loads', async () => {
    const { sup, log } = system({ max_loaded_models: 1 });
    await request(sup, 'A');
    await request(sup, 'B');
    const r = log.recent();
    if (process.env.DUMP) console.log(r.map((x) => JSON.stringify(x)).join('\n'));
    const asked = find(
      r,
      'B asks the gate',
      (x) =>
        x.actor === 'supervisor' && x.kind === '@xstate.event' && x.event === 'LOAD_REQUESTED' && x.payload?.id === 'B',
    );
    const room = find(
      r,
      'supervisor making room',
      (x) => x.actor === 'supervisor' && x.kind === '@xstate.snapshot' && x.state === 'evicting',
      asked,
    );
    expect(r[room].context?.victim).toEqual({ id: 'A', reason: 'lru' });
    expect(r[room].context?.room).toMatchObject({ target: 'B', max_loaded: 1, resident: ['A'], candidates: ['A'] });
    const evict = find(
      r,
      'A receives EVICT lru',
      (x) => x.actor === 'model:A' && x.kind === '@xstate.event' && x.event === 'EVICT' && x.payload?.reason === 'lru',
      room,
    );
    const unloading = find(r, 'A unloading', (x) => x.actor === 'model:A' && x.state === 'resident.unloading', evict);
    const unloaded = find(r, 'A unloaded', (x) => x.actor === 'model:A' && x.state === 'unloaded', unloading);
    // B waited at the gate (`loading.queued`) from its request on; it builds only once A is gone.
    const queued = find(
      r,
      'B queued at the gate',
      (x) => x.actor === 'model:B' && x.state === 'resident.loading.queued',
    );
    expect(queued).toBeLessThan(room);
    const granted = find(r, 'the gate grants B', (x) => x.actor === 'supervisor' && x.state === 'loading', unloaded);
    const building = find(
      r,
      'B loading',
      (x) => x.actor === 'model:B' && x.state === 'resident.loading.building',
      granted,
    );
    find(r, 'B ready', (x) => x.actor === 'model:B' && x.state?.startsWith('resident.ready') === true, building);
    expect(sup.status('A')).toMatchObject({ state: 'unloaded', last_eviction: { reason: 'lru' } });
    expect(sup.status('B')).toMatchObject({ state: 'ready' });
    expect(sup.evictions).toBe(1);
  });

  it('idle_unload_ms: an idle model gets EVICT {reason: idle} from its own keep-alive delay and unloads', async () => {
    const { sup, log } = system({ idle_unload_ms: 50 });
    await request(sup, 'A');
    const t0 = Date.now();
    await new Promise((r) => setTimeout(r, 200));
    const r = log.recent();
    // Raised by A's own keep-alive delay: the snapshot it causes carries it.
    const evict = find(
      r,
      'A takes EVICT idle',
      (x) =>
        x.actor === 'model:A' &&
        x.event === 'EVICT' &&
        x.payload?.reason === 'idle' &&
        x.state === 'resident.unloading',
    );
    find(r, 'A unloaded', (x) => x.actor === 'model:A' && x.state === 'unloaded', evict);
    expect(r[evict].at - t0).toBeLessThan(200);
    expect(sup.status('A')).toMatchObject({ state: 'unloaded', last_eviction: { reason: 'idle' } });
  });

  it('idle_unload_ms: a busy model is not evicted while its request runs', async () => {
    let open!: () => void;
    const { sup, log, gate } = system({ idle_unload_ms: 50 });
    gate.hold = new Promise<void>((r) => (open = r));
    const running = request(sup, 'A');
    await new Promise((r) => setTimeout(r, 200));
    expect(sup.status('A')).toMatchObject({ state: 'ready', active_leases: 1 });
    expect(log.recent().some((x) => x.actor === 'model:A' && x.event === 'EVICT')).toBe(false);
    open();
    await running;
  });

  it('a busy A refuses EVICT; the load of B waits for it, then gets 503 at the busy timeout', async () => {
    let open!: () => void;
    const { sup, log, gate } = system({ max_loaded_models: 1, busy_timeout_ms: 300 });
    await request(sup, 'A');
    gate.hold = new Promise<void>((r) => (open = r));
    const busyA = request(sup, 'A');
    const t0 = Date.now();
    const err = await request(sup, 'B').then(
      () => null,
      (e: unknown) => e,
    );
    const waited = Date.now() - t0;
    open();
    await busyA;
    expect(err).toBeInstanceOf(VoxError);
    expect(err).toMatchObject({ type: 'server_busy', status: 503 });
    expect((err as Error).message).toMatch(/max_loaded_models \(1\)/);
    expect(waited).toBeGreaterThanOrEqual(290);
    const r = log.recent();
    const evict = find(
      r,
      'A asked to EVICT',
      (x) => x.actor === 'model:A' && x.event === 'EVICT' && x.payload?.reason === 'lru',
    );
    const refusal = find(
      r,
      'A refuses',
      (x) => x.actor === 'supervisor' && x.event === 'EVICT_REFUSED' && x.payload?.id === 'A',
      evict,
    );
    const waiting = find(
      r,
      'the gate waits for a release',
      (x) => x.actor === 'supervisor' && x.state === 'waitingForRelease',
      refusal,
    );
    expect(r[waiting].context?.waitingFor).toBe('release');
    expect(r.some((x) => x.actor === 'model:A' && x.state === 'resident.unloading')).toBe(false);
    expect(sup.status('A')).toMatchObject({ state: 'ready' });
    expect(sup.status('B')).toMatchObject({ state: 'unloaded', last_error: null });
  });

  it('stuck work (C4): once every slot has run longer than the busy timeout, a new request gets 503 at once', async () => {
    let open!: () => void;
    const { sup, gate } = system({ busy_timeout_ms: 100 });
    await request(sup, 'A');
    gate.hold = new Promise<void>((r) => (open = r));
    const stuck = request(sup, 'A');
    await new Promise((r) => setTimeout(r, 150));
    const t0 = Date.now();
    const err = await sup
      .require('A')
      .admit({})
      .then(
        (lease) => (lease.release(), null),
        (e: unknown) => e,
      );
    expect(Date.now() - t0).toBeLessThan(50);
    expect(err).toMatchObject({ type: 'server_busy' });
    expect((err as Error).message).toMatch(/stuck/);
    open();
    await stuck;
    // Unstuck: admitted again.
    await request(sup, 'A');
  });
});
