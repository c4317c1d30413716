/**
 * The Node entry of `voxserve/client` (package `exports` condition `node`): the same client,
 * with the `ws` package as its default WebSocket (Node 20 has no global WebSocket).
 */
import WebSocket from 'ws';
import { VoxClient as BrowserClient, type ClientOptions, type WebSocketConstructor } from './index.js';

export * from './index.js';

/** {@link BrowserClient} whose default WebSocket is `ws`'s. */
export class VoxClient extends BrowserClient {
  constructor(opts: ClientOptions = {}) {
    super({ WebSocket: WebSocket as unknown as WebSocketConstructor, ...opts });
  }
}
