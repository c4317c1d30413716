import { emit, setup, type Actor, type AnyActorLogic, type AnyActorRef } from 'xstate';

/** Events of the system root. */
export type SystemEvent = { type: 'STARTED' } | { type: 'SHUTDOWN' } | { type: 'STOPPED' };

/** What the root emits to whoever listens (`root.on('drain', ...)`): socket actors drain on it. */
export type SystemEmitted = { type: 'drain' };

/**
 * The system root (DESIGN.md section 2), one per server: `starting` (eager models loading) ->
 * `running` (accepting work) -> `draining` (shutdown: nothing new accepted; emits `drain`, which
 * every socket actor listens to) -> `stopped`. It invokes the supervisor with `systemId`
 * `supervisor`; model entries are the supervisor's children (`model:<id>`). Socket actors are
 * root actors of their own that share the inspector and listen to `drain`.
 */
export const systemMachine = setup({
  types: { events: {} as SystemEvent, emitted: {} as SystemEmitted, input: {} as { supervisor?: unknown } | undefined, context: {} as { supervisor?: unknown } },
  actors: { supervisor: {} as AnyActorLogic },
}).createMachine({
  id: 'system',
  context: ({ input }) => ({ supervisor: input?.supervisor }),
  // The supervisor's input (its live dependencies) passes through.
  invoke: { id: 'supervisor', systemId: 'supervisor', src: 'supervisor', input: ({ context }: { context: { supervisor?: unknown } }) => context.supervisor },
  initial: 'starting',
  states: {
    starting: { on: { STARTED: 'running', SHUTDOWN: 'draining' } },
    running: { on: { SHUTDOWN: 'draining' } },
    draining: { entry: emit({ type: 'drain' }), on: { STOPPED: 'stopped' } },
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
