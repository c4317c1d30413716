import { createHash, timingSafeEqual } from 'node:crypto';
import type { IncomingMessage } from 'node:http';
import type { ServerConfig } from '../runtime/config.js';
import { voxError } from '../runtime/errors.js';
import { KEY_PROTOCOL } from '../runtime/wire.js';

/**
 * Who may talk to the server, checked on every request and WebSocket handshake before it is
 * routed: the `Host` header (against DNS rebinding), the `Origin` header (against cross-site
 * requests from browsers; allowed origins get CORS headers), API keys (inference routes and
 * streams) and the management token (management and debug routes).
 */

/** Sent on the answer to a CORS preflight (`OPTIONS` with `Origin`) from an allowed origin. */
const PREFLIGHT = {
  'access-control-allow-methods': 'GET, POST',
  'access-control-allow-headers': 'authorization, content-type',
  'access-control-max-age': '600',
};

const digest = (s: string): Buffer => createHash('sha256').update(s).digest();
const bearer = (req: IncomingMessage): string => /^bearer\s+(.*)$/i.exec(req.headers.authorization ?? '')?.[1] ?? '';

/**
 * Host name of a `Host` header or a configured name: lower case, no port, IPv6 in brackets, IPv4 canonical; null if not
 * a host.
 */
function hostName(host: string): string | null {
  const bare = host.split(':').length > 2 && !host.startsWith('[') ? `[${host}]` : host; // an unbracketed IPv6 address
  try {
    return new URL(`http://${bare}`).hostname || null;
  } catch {
    return null;
  }
}

const loopbackName = (name: string): boolean =>
  name === 'localhost' || name === '[::1]' || /^127\.\d+\.\d+\.\d+$/.test(name);

/** True for addresses only this machine can reach. */
export function isLoopback(host: string): boolean {
  const name = hostName(host);
  return name !== null && loopbackName(name);
}

/** The checks of one server, with its config's lists prepared once. */
export interface Access {
  /**
   * The `Host` header must name loopback (`localhost`, 127.0.0.0/8, `[::1]`), the configured
   * `host`, or an `allowed_hosts` entry (`*`: any). A request without one (HTTP/1.0) passes: a
   * browser always sends it.
   * @throws VoxError `forbidden`.
   */
  host(req: IncomingMessage): void;
  /**
   * The `Origin` header, if any, must be the server's own (the `Host` the request was sent to,
   * http or https) or in `allowed_origins`.
   * @returns the CORS headers to answer with (empty without an `Origin`); `preflight` adds
   *   the allowed methods and headers.
   * @throws VoxError `forbidden`.
   */
  origin(req: IncomingMessage, preflight?: boolean): Record<string, string>;
  /**
   * With `auth.api_keys` set, the request must carry one: `Authorization: Bearer <key>`, or on a
   * WebSocket handshake a subprotocol `voxserve.key.<key>` among `protocols`. Compared in
   * constant time (equal-length SHA-256 digests, every key).
   * @throws VoxError `unauthorized`.
   */
  apiKey(req: IncomingMessage, protocols?: string[]): void;
  /**
   * Management and debug routes need management enabled and, when set, the bearer token
   * (compared in constant time).
   * @param page the static `/debug` page itself, which holds no data: it sends the token (from
   *   its `?token=`) on its own requests.
   * @throws VoxError `forbidden`.
   */
  management(req: IncomingMessage, page?: boolean): void;
}

/** Builds the access checks of a server from its config. */
export function createAccess(config: ServerConfig): Access {
  const hosts = new Set(config.allowed_hosts.map((h) => (h === '*' ? h : hostName(h))));
  const configured = hostName(config.host);
  const origins = new Set(config.allowed_origins.map((o) => new URL(o).origin));
  const keys = config.auth.api_keys.map(digest);
  const token = config.management.token;
  return {
    host(req) {
      const given = req.headers.host;
      if (given === undefined || hosts.has('*')) return;
      const name = hostName(given);
      if (name !== null && (loopbackName(name) || name === configured || hosts.has(name))) return;
      throw voxError('host_not_allowed', { host: given });
    },
    origin(req, preflight = false) {
      const given = req.headers.origin;
      if (given === undefined) return {};
      let url: URL | null = null;
      try {
        url = new URL(given);
      } catch {
        // not an origin: refused below
      }
      let own = false;
      if (url && (url.protocol === 'http:' || url.protocol === 'https:') && req.headers.host) {
        try {
          own = new URL(`${url.protocol}//${req.headers.host}`).host === url.host;
        } catch {
          // a Host that is not a host: not our origin
        }
      }
      if (!url || url.origin === 'null' || !(own || origins.has(url.origin))) {
        throw voxError('origin_not_allowed', { origin: given });
      }
      return {
        'access-control-allow-origin': url.origin,
        'access-control-expose-headers': 'retry-after, www-authenticate',
        vary: 'Origin',
        ...(preflight ? PREFLIGHT : {}),
      };
    },
    apiKey(req, protocols = []) {
      if (!keys.length) return;
      const given = bearer(req) || protocols.find((p) => p.startsWith(KEY_PROTOCOL))?.slice(KEY_PROTOCOL.length) || '';
      const d = digest(given);
      let ok = false;
      for (const k of keys) ok = timingSafeEqual(d, k) || ok;
      if (ok) return;
      throw given ? voxError('api_key_invalid') : voxError('api_key_required', { keyProtocol: KEY_PROTOCOL });
    },
    management(req, page = false) {
      if (!config.management.enabled) {
        throw voxError('management_disabled');
      }
      if (page || !token) return;
      if (!timingSafeEqual(digest(bearer(req)), digest(token))) {
        throw voxError('management_token_required');
      }
    },
  };
}
