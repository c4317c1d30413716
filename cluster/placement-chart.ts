/**
 * One cold placement as a chart (docs/cluster.md "Placement"): created per model being placed by
 * cluster/placement.ts, which provides its steps (each a promise: take the lock, load here, ask a
 * node, join the holders). Its waits (for the lock another node holds, for a holder's heartbeat)
 * end at the model's busy timeout, a delay of the chart; a step that loads is never cut short (its
 * model would leak): the load's own timeout bounds it.
 */
import { assign, fromPromise, setup } from 'xstate';
import type { LoadedModel } from '../runtime/loader.js';
import type { LoadLock } from './locks.js';

/** What a placement is given. `end`: its deadline (this node's clock, ms since the epoch; Infinity: none). */
export interface PlacementInput {
  id: string;
  end: number;
}

/** How a placement ended: the model (local or remote pool), or the error to answer with. */
export type PlacementOutput = { model: LoadedModel } | { error: unknown };

/**
 * Events: `ABORT` (the load was abandoned: its request left) ends a placement that is waiting;
 * `OFFLINE` (the membership chart lost NATS) makes one still taking the lock decide again (it then
 * loads here) instead of waiting out the lock's key-value timeouts.
 */
export type PlacementEvent = { type: 'ABORT'; reason: unknown } | { type: 'OFFLINE' };

const never = (): never => {
  throw new Error('placement chart: a step was not provided');
};

/**
 * `deciding` (pinned here, NATS lost, held elsewhere, or free) -> `joining` the holders' remote
 * pool, `loadingHere`, or `locking` -> `placing` under the lock -> `placed`; `waiting` for the
 * next change of the membership chart when another node holds the lock or the holders are
 * unreachable; `superseded` when the lock was taken over while placing (the other placement is
 * used); `failed` or `timedOut` (the busy timeout) otherwise.
 */
export const placementMachine = setup({
  types: {
    context: {} as PlacementInput & { lock: LoadLock | null; output: PlacementOutput | null },
    input: {} as PlacementInput,
    events: {} as PlacementEvent,
    output: {} as PlacementOutput,
  },
  actors: {
    /** Loads on this node (pinned: with the pin's lock fenced; or NATS lost). */
    loadHere: fromPromise<LoadedModel>(never),
    /** A remote pool on the live holders. */
    join: fromPromise<LoadedModel>(never),
    /**
     * Takes the model's load lock; null when another node holds it. A lock taken after the step was stopped is given
     * back.
     */
    lock: fromPromise<LoadLock | null>(never),
    /** Places under the lock (here or on another node) and releases it. */
    place: fromPromise<LoadedModel, { lock: LoadLock }>(never),
    /** After a take-over: the registry read afresh and the other placement's holder waited for. */
    settle: fromPromise<void>(never),
    /** The next change of the membership chart, or a heartbeat. */
    change: fromPromise<void>(never),
  },
  guards: {
    pinned: () => false,
    offline: () => false,
    held: () => false,
    /** A `join` failed because no holder answered, and holders are still listed: asked again after the next change. */
    retryHolders: () => false,
    /** A `join` failed because no holder answered, and none is listed any more: placed anew. */
    placeAnew: () => false,
  },
  delays: {
    deadline: ({ context }) => (context.end === Infinity ? 2 ** 31 - 1 : Math.max(0, context.end - Date.now())),
  },
}).createMachine({
  id: 'placement',
  context: ({ input }) => ({ ...input, lock: null, output: null }),
  initial: 'deciding',
  states: {
    deciding: {
      always: [
        { guard: 'pinned', target: 'loadingHere' },
        { guard: 'offline', target: 'loadingHere' },
        { guard: 'held', target: 'joining' },
        { target: 'locking' },
      ],
    },
    joining: {
      invoke: {
        src: 'join',
        onDone: { target: 'placed', actions: assign({ output: ({ event }) => ({ model: event.output }) }) },
        onError: [
          { guard: 'retryHolders', target: 'waiting' },
          { guard: 'placeAnew', target: 'locking' },
          { target: 'failed', actions: assign({ output: ({ event }) => ({ error: event.error }) }) },
        ],
      },
    },
    loadingHere: {
      invoke: {
        src: 'loadHere',
        onDone: { target: 'placed', actions: assign({ output: ({ event }) => ({ model: event.output }) }) },
        onError: { target: 'failed', actions: assign({ output: ({ event }) => ({ error: event.error }) }) },
      },
    },
    locking: {
      after: { deadline: 'timedOut' },
      on: {
        ABORT: { target: 'failed', actions: assign({ output: ({ event }) => ({ error: event.reason }) }) },
        OFFLINE: 'deciding',
      },
      invoke: {
        src: 'lock',
        onDone: [
          {
            guard: ({ event }) => event.output !== null,
            target: 'placing',
            actions: assign({ lock: ({ event }) => event.output }),
          },
          { target: 'waiting' },
        ],
        onError: 'waiting',
      },
    },
    placing: {
      invoke: {
        src: 'place',
        input: ({ context }) => ({ lock: context.lock! }),
        onDone: { target: 'placed', actions: assign({ output: ({ event }) => ({ model: event.output }) }) },
        onError: [
          {
            guard: ({ event }) => (event.error as { superseded?: boolean })?.superseded === true,
            target: 'superseded',
          },
          { target: 'failed', actions: assign({ output: ({ event }) => ({ error: event.error }) }) },
        ],
      },
      exit: assign({ lock: null }),
    },
    superseded: {
      after: { deadline: 'timedOut' },
      on: { ABORT: { target: 'failed', actions: assign({ output: ({ event }) => ({ error: event.reason }) }) } },
      invoke: { src: 'settle', onDone: 'deciding', onError: 'deciding' },
    },
    waiting: {
      after: { deadline: 'timedOut' },
      on: { ABORT: { target: 'failed', actions: assign({ output: ({ event }) => ({ error: event.reason }) }) } },
      invoke: { src: 'change', onDone: 'deciding', onError: 'deciding' },
    },
    placed: { type: 'final' },
    failed: { type: 'final' },
    timedOut: { type: 'final' },
  },
  output: ({ context }) => context.output ?? { error: new Error('the placement timed out') },
});
