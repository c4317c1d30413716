import { realpath } from 'node:fs/promises';
import { isAbsolute, resolve, sep } from 'node:path';
import { invalid } from './errors.js';

/**
 * Resolves a model path given over the API inside `root` (`models_root`): relative paths are
 * taken from the root, symlinks are followed, and the result must stay inside the root.
 * With no root configured, the path is only made absolute.
 * @param field the body field, for the error message.
 * @throws VoxError `invalid_request_error` if the path escapes the root (`..`, an absolute path
 *   elsewhere, a symlink out).
 */
export async function confinePath(root: string | undefined, path: string, field: string): Promise<string> {
  if (!root) return resolve(path);
  const base = await realpath(root).catch(() => resolve(root));
  const abs = isAbsolute(path) ? path : resolve(base, path);
  // A file that does not exist yet cannot be a symlink out; its load fails later with ENOENT.
  const real = await realpath(abs).catch(() => resolve(abs));
  if (real !== base && !real.startsWith(base + sep)) throw invalid(`${field}: '${path}' is outside models_root`);
  return real;
}
