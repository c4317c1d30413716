/**
 * The server API of the `voxserve` package (`import { startServer } from 'voxserve'`); the
 * client is `voxserve/client`.
 */
export { startServer, type VoxServer, type ServerOptions } from './transport/server.js';
export { defaultCatalog, loadServerConfig, ServerConfig, ModelConfig, type Limits } from './runtime/config.js';
export { ERRORS, VoxError, voxError, type ErrorCode, type ErrorType, type WireError } from './runtime/errors.js';
