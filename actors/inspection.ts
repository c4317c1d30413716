import type { InspectionEvent } from 'xstate';
import type { ServerConfig } from '../runtime/config.js';
import { InspectionLog } from '../runtime/telemetry.js';

export { InspectionLog };

/** The actor system's inspection: one observer shared by every actor (root, supervisor, entries, sockets). */
export interface Inspection {
  /** The `/debug` ring buffer, when `debug.inspect` is on. */
  log: InspectionLog | null;
  /** The observer to give `createActor(..., { inspect })`; undefined when inspection is off. */
  inspect?: (e: InspectionEvent) => void;
  /** Closes the Stately relay, if any. */
  stop: () => void;
}

/**
 * The XState inspection observer for the config: the `/debug` ring buffer (`debug.inspect`)
 * and/or a Stately inspector relay (`debug.stately_url`, via `@statelyai/inspect`, loaded only when used).
 */
export async function createInspection(config: ServerConfig): Promise<Inspection> {
  const log = config.debug.inspect ? new InspectionLog() : null;
  const observers: ((e: InspectionEvent) => void)[] = [];
  if (log) observers.push(log.inspect);
  let stop = (): void => {};
  if (config.debug.stately_url) {
    const { createWebSocketInspector } = await import('@statelyai/inspect');
    const stately = createWebSocketInspector({ url: config.debug.stately_url });
    observers.push(stately.inspect.next!.bind(stately.inspect));
    stop = () => stately.stop();
  }
  return { log, inspect: observers.length ? (e) => observers.forEach((o) => o(e)) : undefined, stop };
}
