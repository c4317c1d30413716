/**
 * Property-based interleaving tests of the model lifecycle contract (DESIGN.md C1-C10, C17)
 * against fake slot hosts whose load, run and close are scheduled by fast-check's scheduler.
 *
 * A failure prints its seed and the scheduler's order of every step of the shrunk case. The runs
 * are deterministic for a seed: `FC_SEED=<seed> npx vitest run spec/actors/interleavings.spec.ts
 * -t '<test name>'` reruns them and shrinks to the same counterexample.
 */
import fc from 'fast-check';
import { afterEach, describe, expect, it } from 'vitest';
import { Supervisor } from '../../actors/supervisor.js';
import { Admission } from '../../runtime/admission.js';
import { ModelConfig, ServerConfig } from '../../runtime/config.js';
import { VoxError } from '../../runtime/errors.js';
import type { LoadedModel, ModelLoader } from '../../runtime/loader.js';
import type { Job, JobResult, LoadSpec, VadJob } from '../../runtime/slot-protocol.js';
import { SlotPool, type SlotHost } from '../../runtime/slots.js';

const RUNS = Number(process.env.FC_RUNS ?? 1000);
const replay = process.env.FC_SEED ? { seed: Number(process.env.FC_SEED) } : {};

type LoadFault = 'ok' | 'throws' | 'no-session' | 'clone-fails';
type RunFault = 'ok' | 'throws' | 'worker-exits';

/** What one run observed. */
class World {
  readonly loadsInFlight = new Map<string, number>();
  readonly livePools = new Map<string, number>();
  /** Slots started and not yet closed, per model (clones included). */
  readonly liveSlots = new Map<string, number>();
  readonly violations: string[] = [];
  /** Per admission queue: sequence numbers of acquisitions in the order they were granted. */
  readonly grants = new Map<Admission, number[]>();
  readonly ops: { name: string; done: boolean; promise: Promise<void> }[] = [];
  readonly controllers: AbortController[] = [];
  private seq = 0;

  constructor(
    readonly s: fc.Scheduler,
    private readonly loadFaults: LoadFault[],
    private readonly runFaults: RunFault[],
    /** max_loaded_models (0 = no limit): live pools, retiring ones included, never exceed it. */
    readonly limit = 0,
  ) {}

  nextSeq(): number {
    return ++this.seq;
  }
  loadFault(): LoadFault {
    return this.loadFaults.shift() ?? 'ok';
  }
  runFault(): RunFault {
    return this.runFaults.shift() ?? 'ok';
  }
  bump(map: Map<string, number>, id: string, by: number, limit: number, what: string): void {
    const n = (map.get(id) ?? 0) + by;
    map.set(id, n);
    if (n > limit) this.violations.push(`${what} for ${id}: ${n}`);
    if (map === this.livePools && this.limit > 0) {
      const total = [...map.values()].reduce((a, b) => a + b, 0);
      if (total > this.limit) this.violations.push(`${total} pools resident over max_loaded_models ${this.limit}`);
    }
  }

  /** Starts an operation; expected failures (VoxError, AbortError) are fine, anything else is a violation. */
  launch(name: string, op: () => Promise<unknown>): void {
    const rec = { name, done: false, promise: Promise.resolve() };
    rec.promise = (async () => {
      try {
        await op();
      } catch (e) {
        const expected = e instanceof VoxError || (e instanceof DOMException && e.name === 'AbortError');
        if (!expected) this.violations.push(`${name} threw ${(e as Error)?.stack ?? e}`);
      } finally {
        rec.done = true;
      }
    })();
    this.ops.push(rec);
  }
}

/** A loader over fake slots; every step waits for the scheduler. */
function fakeLoader(w: World): ModelLoader {
  return async (config: ModelConfig): Promise<LoadedModel> => {
    const id = config.id;
    w.bump(w.loadsInFlight, id, 1, 1, 'two loads at once');
    try {
      await w.s.schedule(Promise.resolve(), `load ${id}`);
      const fault = w.loadFault();
      if (fault === 'throws') throw new Error('loader threw');
      if (fault === 'no-session') return null as unknown as LoadedModel;
      let made = 0;
      const factory = async (_spec: LoadSpec): Promise<SlotHost> => {
        const n = made++;
        await w.s.schedule(Promise.resolve(), `slot ${id}#${n}`);
        if (fault === 'clone-fails' && n === 1) throw new Error('clone failed');
        let exit: ((e: Error) => void) | null = null;
        let closed = false;
        w.bump(w.liveSlots, id, 1, 16, 'too many slots');
        return {
          info: {},
          run: async (job: Job): Promise<JobResult> => {
            await w.s.schedule(Promise.resolve(), `run ${id}#${n}`);
            if (closed) throw new VoxError('server_error', 'slot is closed');
            const f = w.runFault();
            if (f === 'throws') throw new VoxError('server_error', 'inference failed');
            if (f === 'worker-exits') {
              const cb = exit;
              exit = null;
              cb?.(new Error('worker exited'));
              throw new VoxError('server_error', 'slot failed: worker exited');
            }
            return { kind: 'vad', probs: new Float32Array(0), state: (job as { state: Float32Array }).state, context: new Float32Array(64) };
          },
          close: async () => {
            if (closed) return;
            closed = true;
            await w.s.schedule(Promise.resolve(), `close ${id}#${n}`);
            w.bump(w.liveSlots, id, -1, 16, '');
          },
          onExit: (cb) => (exit = cb),
        };
      };
      // A pool with a single slot has no clone to fail; a clone fault then yields no session.
      const slots = fault === 'clone-fails' ? Math.max(2, config.slots) : config.slots;
      const pool = await SlotPool.start({ kind: 'vad', model: '/fake.onnx' }, slots, factory);
      w.bump(w.livePools, id, 1, 1, 'two pools resident');
      let closed = false;
      return {
        pool,
        residentBytes: 1000 * slots,
        close: async () => {
          await pool.close();
          if (!closed) w.bump(w.livePools, id, -1, 1, '');
          closed = true;
        },
      };
    } finally {
      w.bump(w.loadsInFlight, id, -1, 1, '');
    }
  };
}

const job = (): VadJob => ({ kind: 'vad', windows: new Float32Array(512), state: new Float32Array(256), context: new Float32Array(64) });

type Real = { w: World; sup: Supervisor };
type Cmd = fc.AsyncCommand<object, Real, false>;

const IDS = ['a', 'b', 'c'] as const;
const idArb = fc.constantFrom(...IDS);

/** A request holding its lease across `jobs` inferences (a file, or a stream's windows). */
class Request implements Cmd {
  constructor(
    readonly id: string,
    readonly jobs: number,
  ) {}
  check = (): boolean => true;
  async run(_m: object, { w, sup }: Real): Promise<void> {
    const ctl = new AbortController();
    w.controllers.push(ctl);
    w.launch(this.toString(), async () => {
      const entry = sup.require(this.id);
      const lease = await entry.admit({ signal: ctl.signal, onRevoke: () => ctl.abort() });
      const exclusiveAlongside = (): void => {
        // A forced unload revokes (aborts) us and takes our lease away: then a manager may hold it.
        if (entry.admission.exclusive && !ctl.signal.aborted) w.violations.push(`${this} holds a lease while a manager holds ${this.id} exclusively`);
      };
      try {
        exclusiveAlongside();
        const { pool, batcher } = await entry.ensureReady(ctl.signal);
        for (let i = 0; i < this.jobs && !ctl.signal.aborted; i++) {
          await (batcher ? batcher.run(job(), ctl.signal) : pool.run(job(), ctl.signal)).catch((e: Error) => {
            // Only a forced unload (which aborts us) may close the pool under a held lease.
            if (/model unloaded/.test(e.message) && !ctl.signal.aborted) w.violations.push(`${this}: pool closed under a held lease`);
            throw e;
          });
          exclusiveAlongside();
        }
      } finally {
        lease.release();
      }
    });
  }
  toString = (): string => `request(${this.id}, ${this.jobs} jobs)`;
}

class Disconnect implements Cmd {
  constructor(readonly index: number) {}
  check = (): boolean => true;
  async run(_m: object, { w }: Real): Promise<void> {
    w.controllers[this.index % Math.max(1, w.controllers.length)]?.abort();
  }
  toString = (): string => `disconnect(${this.index})`;
}

class Load implements Cmd {
  constructor(
    readonly id: string,
    readonly fields: Record<string, unknown>,
  ) {}
  check = (): boolean => true;
  async run(_m: object, { w, sup }: Real): Promise<void> {
    w.launch(this.toString(), () => sup.load({ id: this.id, ...this.fields }, 0));
  }
  toString = (): string => `load(${this.id}, ${JSON.stringify(this.fields)})`;
}

class Unload implements Cmd {
  constructor(
    readonly id: string,
    readonly force: boolean,
  ) {}
  check = (): boolean => true;
  async run(_m: object, { w, sup }: Real): Promise<void> {
    w.launch(this.toString(), async () => {
      const e = sup.require(this.id);
      await (this.force ? e.forceUnload() : e.unload(0));
    });
  }
  toString = (): string => `unload(${this.id}${this.force ? ', force' : ''})`;
}

class BulkUnload implements Cmd {
  constructor(readonly ids: string[]) {}
  check = (): boolean => true;
  async run(_m: object, { w, sup }: Real): Promise<void> {
    w.launch(this.toString(), async () => {
      const r = await sup.unloadMany(this.ids, 0);
      const all = [...r.unloaded, ...r.not_found];
      if (new Set(all).size !== all.length || new Set(all).size !== new Set(this.ids).size) {
        w.violations.push(`bulk unload reported ${JSON.stringify(r)} for ${JSON.stringify(this.ids)}`);
      }
    });
  }
  toString = (): string => `unloadMany(${JSON.stringify(this.ids)})`;
}

const slotsArb = fc.constantFrom(1, 2, 4);
const commandArb = fc.oneof(
  { weight: 5, arbitrary: fc.tuple(idArb, fc.integer({ min: 1, max: 3 })).map(([id, n]) => new Request(id, n) as Cmd) },
  { weight: 2, arbitrary: fc.nat(20).map((i) => new Disconnect(i) as Cmd) },
  // No batch delay timer: the scheduler alone orders everything.
  { weight: 2, arbitrary: fc.tuple(idArb, slotsArb).map(([id, slots]) => new Load(id, { task: 'vad', path: '/fake.onnx', slots, max_batch_delay_ms: 0 }) as Cmd) },
  { weight: 1, arbitrary: fc.tuple(idArb, fc.constantFrom(0, 17, 1.5, '2', null, true)).map(([id, slots]) => new Load(id, { slots }) as Cmd) },
  { weight: 1, arbitrary: fc.tuple(idArb, fc.integer({ min: 1, max: 8 })).map(([id, max_streams]) => new Load(id, { max_streams }) as Cmd) },
  { weight: 2, arbitrary: fc.tuple(idArb, fc.boolean()).map(([id, force]) => new Unload(id, force) as Cmd) },
  { weight: 2, arbitrary: fc.array(fc.constantFrom(...IDS, 'nope'), { minLength: 1, maxLength: 5 }).map((ids) => new BulkUnload(ids) as Cmd) },
);

/** Records, per admission queue, the order in which acquisitions are granted. */
function instrumentAdmission(w: () => World | null): () => void {
  const original = Admission.prototype.acquire;
  Admission.prototype.acquire = function (this: Admission, opts) {
    const world = w();
    const p = original.call(this, opts);
    if (world) {
      const seq = world.nextSeq();
      p.then(
        () => {
          const list = world.grants.get(this) ?? [];
          list.push(seq);
          world.grants.set(this, list);
        },
        () => {},
      );
    }
    return p;
  };
  return () => {
    Admission.prototype.acquire = original;
  };
}

/** Runs scheduled tasks until none is left, letting microtasks and immediates settle in between. */
async function settle(s: fc.Scheduler): Promise<void> {
  for (let i = 0; i < 1000; i++) {
    await new Promise((r) => setImmediate(r));
    if (s.count() === 0) return;
    await s.waitAll();
  }
}

/** Models a and b; with `batch`, their one-window jobs go through a batcher (no delay timer, so the scheduler orders everything). */
const catalogOf = (batch: number): ModelConfig[] =>
  IDS.slice(0, 2).map((id) => ModelConfig.parse({ id, task: 'vad', path: '/fake.onnx', max_streams: 2, max_batch_size: batch, max_batch_delay_ms: 0 }));
let current: World | null = null;
const restore = instrumentAdmission(() => current);
afterEach(() => {
  current = null;
});

/** One property: random commands and faults against a supervisor with `limit` max_loaded_models. */
async function checkInvariants(limit: number, totals: { runs: number; interleavings: number; commands: number }, batch = 1): Promise<void> {
  const catalog = catalogOf(batch);
  await fc.assert(
    fc.asyncProperty(
      fc.scheduler(),
      fc.commands([commandArb], { maxCommands: 14 }),
      fc.array(fc.constantFrom<LoadFault>('ok', 'ok', 'throws', 'no-session', 'clone-fails'), { maxLength: 6 }),
      fc.array(fc.constantFrom<RunFault>('ok', 'ok', 'ok', 'throws', 'worker-exits'), { maxLength: 8 }),
      async (s, cmds, loadFaults, runFaults) => {
        const w = new World(s, loadFaults, runFaults, limit);
        current = w;
        const sup = new Supervisor(ServerConfig.parse({ log_level: 'silent',  busy_timeout_ms: 0, max_loaded_models: limit }), { loader: fakeLoader(w), catalog });
        await fc.scheduledModelRun(s, () => ({ model: {}, real: { w, sup } }), cmds);
        await settle(s);
        // Every operation settled: nothing hangs.
        const hung = w.ops.filter((o) => !o.done);
        if (hung.length && process.env.FC_DEBUG) console.log('HUNG', hung.map((o) => o.name), sup.statuses());
        expect(hung.length, 'operations still pending').toBe(0);
        // Residency returns to baseline after unload of everything.
        w.launch('unload_all', () => sup.unloadMany(sup.registeredIds, 0));
        await settle(s);
        expect(w.ops.every((o) => o.done), 'unload_all settled').toBe(true);
        expect(w.violations).toEqual([]);
        for (const id of sup.registeredIds) {
          const st = sup.status(id)!;
          expect(st, `status of ${id}`).toMatchObject({ state: 'unloaded', loaded: false, resident_bytes: 0, active_leases: 0, queued_requests: 0, active_slots: 0 });
          expect(w.livePools.get(id) ?? 0, `pools of ${id}`).toBe(0);
          expect(w.liveSlots.get(id) ?? 0, `slots of ${id}`).toBe(0);
        }
        // FIFO: each queue granted its acquisitions in the order they were made.
        for (const order of w.grants.values()) expect(order).toEqual([...order].sort((x, y) => x - y));
        totals.runs++;
        totals.commands += [...cmds].length;
        totals.interleavings += s.report().length;
      },
    ),
    { numRuns: RUNS, ...replay },
  );
  console.log(`interleavings (max_loaded_models ${limit}, max_batch_size ${batch}): ${totals.runs} runs, ${totals.commands} commands, ${totals.interleavings} scheduled steps in random order`);
}

describe('model lifecycle under random interleavings (fast-check scheduler, fake slot hosts)', () => {
  it(`holds the contract invariants (${RUNS} runs)`, async () => {
    await checkInvariants(0, { runs: 0, interleavings: 0, commands: 0 });
  });

  it(`holds them with dynamic batching on (${RUNS} runs)`, async () => {
    await checkInvariants(0, { runs: 0, interleavings: 0, commands: 0 }, 4);
  });

  it.each([1, 2, 3])(`with max_loaded_models %i never has more models resident, and every cold load loads or gets a 503 (${RUNS} runs)`, async (limit) => {
    await checkInvariants(limit, { runs: 0, interleavings: 0, commands: 0 });
  });
});

process.on('exit', restore);
