import { emit, setup, type Actor, type AnyActorLogic, type AnyActorRef } from 'xstate';

/** Events of the system root. */
export type SystemEvent =
  | { type: 'STARTED' }
  /** `close()`: accept nothing new, let what runs finish (up to the drain deadline). */
  | { type: 'SHUTDOWN' }
  /** `destroy()`: cut what runs now. */
  | { type: 'DESTROY' }
  /** Every stream and request that ran when the drain began has finished. */
  | { type: 'DRAINED' }
  /** No HTTP connection is left open (they close as their clients get their 503s). */
  | { type: 'IDLE' }
  | { type: 'STOPPED' };

/**
 * What the root emits to whoever listens (`root.on('drain', ...)`): socket actors drain on
 * `drain`; the transport closes its listener on `linger` and cuts what is left on `cut`.
 */
export type SystemEmitted = { type: 'drain' } | { type: 'linger' } | { type: 'cut' };

/**
 * The system root (DESIGN.md section 2), one per server: `starting` (eager models loading) ->
 * `running` (accepting work) -> `draining` (shutdown: nothing new accepted; emits `drain`, which
 * every socket actor listens to) -> `closing` (emits `cut`: what is left is cut off, connections
 * close, models unload) -> `stopped`. `draining` lasts until what ran has finished (`DRAINED`),
 * plus a short `lingering` for idle keep-alive clients to get their 503 (until `IDLE`, at most
 * the `idleLinger` delay), and never past the `drainTimeout` delay (`drain_timeout_ms`, provided by
 * the supervisor); `DESTROY` goes to `closing` at once. It invokes the supervisor with `systemId`
 * `supervisor`; model entries are the supervisor's children (`model:<id>`). Socket actors are
 * root actors of their own that share the inspector and listen to `drain`.
 */
export const systemMachine = setup({
  types: {
    events: {} as SystemEvent,
    emitted: {} as SystemEmitted,
    input: {} as { supervisor?: unknown } | undefined,
    context: {} as { supervisor?: unknown },
  },
  actors: { supervisor: {} as AnyActorLogic },
  delays: {
    /** `drain_timeout_ms` (the supervisor provides the configured value). */
    drainTimeout: 10_000,
    /**
     * How long idle keep-alive connections are left, once drained, for their clients' next request (answered 503 with
     * `Connection: close`): closing one while a request is on its way resets that request.
     */
    idleLinger: 1_000,
  },
}).createMachine({
  id: 'system',
  context: ({ input }) => ({ supervisor: input?.supervisor }),
  // The supervisor's input (its live dependencies) passes through.
  invoke: {
    id: 'supervisor',
    systemId: 'supervisor',
    src: 'supervisor',
    input: ({ context }: { context: { supervisor?: unknown } }) => context.supervisor,
  },
  initial: 'starting',
  states: {
    starting: { on: { STARTED: 'running', SHUTDOWN: 'draining', DESTROY: 'closing' } },
    running: { on: { SHUTDOWN: 'draining', DESTROY: 'closing' } },
    draining: {
      entry: emit({ type: 'drain' }),
      after: { drainTimeout: 'closing' },
      on: { DESTROY: 'closing', STOPPED: 'stopped' },
      initial: 'finishing',
      states: {
        finishing: { on: { DRAINED: 'lingering' } },
        lingering: {
          entry: emit({ type: 'linger' }),
          after: { idleLinger: '#system.closing' },
          on: { IDLE: '#system.closing' },
        },
      },
    },
    closing: { entry: emit({ type: 'cut' }), on: { STOPPED: 'stopped' } },
    stopped: { type: 'final' },
  },
});

/**
 * Shutdown phase 2 for a socket actor: `DRAIN` reaches it when the root emits `drain`, for as
 * long as it runs (the listener goes once it reaches its final state).
 */
export function drainOnShutdown(root: Pick<Actor<typeof systemMachine>, 'on'>, socket: AnyActorRef): void {
  const sub = root.on('drain', () => {
    if (socket.getSnapshot().status === 'active') socket.send({ type: 'DRAIN' });
  });
  socket.subscribe({ complete: () => sub.unsubscribe(), error: () => sub.unsubscribe() });
}
