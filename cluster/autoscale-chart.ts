/**
 * The scaler of one autoscaled model as a chart (docs/cluster.md "Replicas that follow load"):
 * created by cluster/autoscale.ts on the node that decides for the model, fed a {@link ScaleSample}
 * at each heartbeat, with the config's `scale_up_after_ms` and `scale_down_after_ms` as `after`
 * delays. Its steps (place one more replica, drain one) are promises cluster/autoscale.ts provides
 * (a spec gives fakes).
 */
import { assign, fromPromise, setup } from 'xstate';
import type { Autoscale } from '../runtime/config.js';

/** What the deciding node hears of a model's load at a heartbeat. */
export interface ScaleSample {
  /** Live nodes holding the model ready. */
  replicas: number;
  /** The highest queue wait or stream lag p95 any node reports for the model, ms. */
  wait_ms: number;
  /** Slots running a job, summed over the holders (cluster/autoscale.ts averages it over the heartbeats). */
  busy_slots: number;
  /** Slots summed over the holders. */
  slots: number;
}

/** Why the number of replicas last changed; `at` in ms since the epoch (the deciding node's clock). */
export interface ReplicaChange {
  at: number;
  from: number;
  to: number;
  why: string;
}

/** What a scaler is given: the model and its `autoscale` config. */
export interface ScalerInput {
  id: string;
  autoscale: Autoscale;
  /** The last change known (kept when another node took over the decision), or null. */
  last_change?: ReplicaChange | null;
}

/** The scaler's context: its input, the last sample, and the last change it made. */
export interface ScalerContext {
  id: string;
  autoscale: Autoscale;
  sample: ScaleSample | null;
  last_change: ReplicaChange | null;
  /** While scaling or settling: the change under way. */
  pending: ReplicaChange | null;
}

/** Events: a heartbeat's figures. */
export type ScalerEvent = { type: 'SAMPLE' } & ScaleSample;

/** Longest wait for the heartbeats to show a change made (the new replica ready, the drained one gone), ms. */
export const SETTLE_MS = 10_000;

/** Over target: the wait past `target_wait_ms` with room for one more replica, or fewer replicas than `min_replicas`. */
export const isOver = (a: Autoscale, s: ScaleSample): boolean =>
  s.replicas < a.min_replicas || (s.wait_ms > a.target_wait_ms && s.replicas < a.max_replicas);

/**
 * Under target: more replicas than `min_replicas`, the wait within target, and the busy slots
 * fitting in one replica fewer at a quarter of use. A quarter, not a half: a holder's work per job
 * outside its slot (the job's message, lease and answer) took about as much of its CPU as the
 * slot's run (wake-word jobs of one step, nodes in CPU budgets of their own), so 1.5 holders' worth
 * on two replicas showed their slots busy about 0.5 of one replica, and at half use one was
 * drained under that load (autoscale-e2e, 2 runs of 3).
 */
export const isUnder = (a: Autoscale, s: ScaleSample): boolean =>
  s.replicas > a.min_replicas &&
  s.wait_ms <= a.target_wait_ms &&
  s.busy_slots <= 0.25 * (s.slots / s.replicas) * (s.replicas - 1);

const why = (c: ScalerContext, up: boolean): string => {
  const a = c.autoscale;
  const s = c.sample!;
  if (up && s.replicas < a.min_replicas) return `fewer replicas than min_replicas (${a.min_replicas})`;
  return up
    ? `wait p95 ${Math.round(s.wait_ms)} ms over target_wait_ms ${a.target_wait_ms} for ${a.scale_up_after_ms} ms`
    : `wait p95 ${Math.round(s.wait_ms)} ms within target_wait_ms ${a.target_wait_ms} and ${s.busy_slots} of ${s.slots} slots busy for ${a.scale_down_after_ms} ms`;
};

const never = (): never => {
  throw new Error('scaler chart: a step was not provided');
};

/**
 * `steady` -> `over` (a sample over target) -> after `scale_up_after_ms` still over -> `scalingUp`
 * (one more replica placed) -> `settling` until a sample shows the new count (at most
 * {@link SETTLE_MS}) -> `cooling` for `scale_up_after_ms` (samples only kept) -> `steady`; likewise `under` -> after `scale_down_after_ms` -> `scalingDown`
 * (one replica drained and unloaded). A sample no longer over (under) goes back to `steady`. A step
 * that fails goes back to `steady` (tried again after the delay); `failed` (provided) logs it.
 */
export const scalerMachine = setup({
  types: {
    context: {} as ScalerContext,
    input: {} as ScalerInput,
    events: {} as ScalerEvent,
  },
  actors: {
    /** Places one more replica; resolves with the node that now holds it. */
    addReplica: fromPromise<string, { id: string }>(never),
    /** Drains and unloads one replica; resolves with the node that held it. */
    removeReplica: fromPromise<string, { id: string }>(never),
  },
  actions: {
    /** A step failed (logged by cluster/autoscale.ts). */
    failed: (_, _params: { error: unknown }) => {},
  },
  guards: {
    over: ({ context, event }) => isOver(context.autoscale, event),
    under: ({ context, event }) => isUnder(context.autoscale, event),
    shown: ({ context, event }) => event.replicas === context.pending?.to,
  },
  delays: {
    upAfter: ({ context }) => context.autoscale.scale_up_after_ms,
    downAfter: ({ context }) => context.autoscale.scale_down_after_ms,
  },
}).createMachine({
  id: 'scaler',
  context: ({ input }) => ({
    id: input.id,
    autoscale: input.autoscale,
    sample: null,
    last_change: input.last_change ?? null,
    pending: null,
  }),
  initial: 'steady',
  states: {
    steady: {
      on: {
        SAMPLE: [
          { guard: 'over', target: 'over', actions: assign({ sample: ({ event }) => event }) },
          { guard: 'under', target: 'under', actions: assign({ sample: ({ event }) => event }) },
          { actions: assign({ sample: ({ event }) => event }) },
        ],
      },
    },
    over: {
      after: { upAfter: 'scalingUp' },
      on: {
        SAMPLE: [
          { guard: 'over', actions: assign({ sample: ({ event }) => event }) },
          { target: 'steady', actions: assign({ sample: ({ event }) => event }) },
        ],
      },
    },
    under: {
      after: { downAfter: 'scalingDown' },
      on: {
        SAMPLE: [
          { guard: 'under', actions: assign({ sample: ({ event }) => event }) },
          { target: 'steady', actions: assign({ sample: ({ event }) => event }) },
        ],
      },
    },
    scalingUp: {
      entry: assign({
        pending: ({ context }) => ({
          at: 0,
          from: context.sample!.replicas,
          to: context.sample!.replicas + 1,
          why: why(context, true),
        }),
      }),
      invoke: {
        src: 'addReplica',
        input: ({ context }) => ({ id: context.id }),
        onDone: {
          target: 'settling',
          actions: assign({ last_change: ({ context }) => ({ ...context.pending!, at: Date.now() }) }),
        },
        onError: {
          target: 'steady',
          actions: [{ type: 'failed', params: ({ event }) => ({ error: event.error }) }, assign({ pending: null })],
        },
      },
    },
    scalingDown: {
      entry: assign({
        pending: ({ context }) => ({
          at: 0,
          from: context.sample!.replicas,
          to: context.sample!.replicas - 1,
          why: why(context, false),
        }),
      }),
      invoke: {
        src: 'removeReplica',
        input: ({ context }) => ({ id: context.id }),
        onDone: {
          target: 'settling',
          actions: assign({ last_change: ({ context }) => ({ ...context.pending!, at: Date.now() }) }),
        },
        onError: {
          target: 'steady',
          actions: [{ type: 'failed', params: ({ event }) => ({ error: event.error }) }, assign({ pending: null })],
        },
      },
    },
    // The new count shown: the waits measured before it (streams started on fewer replicas) are not
    // taken for the new count's for `scale_up_after_ms`.
    cooling: {
      after: { upAfter: 'steady' },
      on: { SAMPLE: { actions: assign({ sample: ({ event }) => event }) } },
    },
    settling: {
      after: { [SETTLE_MS]: { target: 'steady', actions: assign({ pending: null }) } },
      on: {
        SAMPLE: [
          { guard: 'shown', target: 'cooling', actions: assign({ pending: null, sample: ({ event }) => event }) },
          { actions: assign({ sample: ({ event }) => event }) },
        ],
      },
    },
  },
});
