import { hostname } from 'node:os';
import { Bonjour } from 'bonjour-service';
import type { Logger } from 'pino';
import type { ServerConfig } from '../runtime/config.js';
import { isLoopback } from './access.js';

/**
 * Zeroconf (mDNS/DNS-SD) announcement of the Wyoming service, as wyoming-openwakeword's
 * `--zeroconf` does: a `_wyoming._tcp` service with the listener's port, which Home Assistant's
 * Wyoming integration discovers by itself. Announced with `bonjour-service` (multicast-dns on UDP
 * 5353 of every interface), and withdrawn (a goodbye packet) when the server stops.
 */
export interface Announcement {
  /** The service instance name announced (`voxserve-<host name>`, or `wyoming.zeroconf`'s name). */
  readonly name: string;
  /** Withdraws the service and closes the mDNS socket. */
  stop(): Promise<void>;
}

/**
 * Whether the Wyoming listener is announced: `wyoming.zeroconf` when set (`true`, a name, or
 * `false`), else when Wyoming listens beyond loopback (a satellite or Home Assistant on another
 * machine can reach it).
 */
export function zeroconfWanted(config: ServerConfig): boolean {
  const z = config.wyoming.zeroconf;
  return z === undefined ? !isLoopback(config.wyoming.host) : z !== false;
}

/**
 * Announces `_wyoming._tcp` on `port`. A failure of the mDNS socket (port 5353 not available, no
 * multicast) is logged as a warning: Wyoming still serves, and can be added by host and port.
 */
export function announceWyoming(config: ServerConfig, port: number, log: Logger): Announcement {
  const z = config.wyoming.zeroconf;
  const name = typeof z === 'string' ? z : `voxserve-${hostname().split('.')[0]}`;
  const bonjour = new Bonjour({}, (e: Error) =>
    log.warn({ err: e.message }, 'zeroconf: the _wyoming._tcp announcement failed'),
  );
  const service = bonjour.publish({ name, type: 'wyoming', protocol: 'tcp', port, probe: false });
  service.on('error', (e: Error) => log.warn({ err: e.message }, 'zeroconf: the _wyoming._tcp announcement failed'));
  log.info({ name, type: '_wyoming._tcp', port }, 'zeroconf announced');
  let stopped: Promise<void> | null = null;
  return {
    name,
    stop: () =>
      (stopped ??= new Promise<void>((resolve) => {
        const done = (): void => {
          clearTimeout(timer);
          resolve();
        };
        // The goodbye packet, then the socket; a stop never waits more than a second for it.
        const timer = setTimeout(() => {
          bonjour.destroy();
          resolve();
        }, 1000);
        bonjour.unpublishAll(() => bonjour.destroy(done));
      })),
  };
}
