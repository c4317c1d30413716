import { realpath, stat } from 'node:fs/promises';
import { basename, dirname, isAbsolute, join, resolve, sep } from 'node:path';
import { shippedModelFiles } from './catalog.js';
import { invalid, voxError } from './errors.js';

/**
 * The fully resolved form of `path`: every symlink followed. For a path that does not exist,
 * its deepest existing ancestor is resolved and the rest appended, so a missing file behind a
 * symlink is judged where the symlink points (and an error cannot tell missing from existing).
 */
async function resolveFully(path: string): Promise<string> {
  try {
    return await realpath(path);
  } catch {
    const parent = dirname(path);
    return parent === path ? path : join(await resolveFully(parent), basename(path));
  }
}

let shipped: Promise<Set<string>> | null = null;

/**
 * Resolves a model path given over the API inside `root` (`models_root`): relative paths are
 * taken from the root, symlinks are followed, and the fully resolved result must lie inside the
 * root (or be one of the model files the embedded catalog ships). Only names are resolved
 * (`realpath`): no file is opened. The error for a path outside is the same whether the file
 * exists or not; only a path found inside is then checked (`stat`) to be an existing file.
 * @param root the folder, or `false` (explicit opt-out): the path is only made absolute (no I/O;
 *   a missing file is then the loader's error).
 * @param field the body field, for the error message.
 * @returns the resolved path, which is what the loader then opens.
 * @throws VoxError `invalid_request_error` if the path is empty, escapes the root (`..`, an absolute path
 *   elsewhere, a symlink out), or, inside it, does not exist or is not a regular file.
 */
export async function confinePath(root: string | false, path: string, field: string): Promise<string> {
  if (path.trim() === '') throw invalid(field, `must name a model file, got '${path}'`);
  if (root === false) return resolve(path);
  const base = await resolveFully(resolve(root));
  const real = await resolveFully(isAbsolute(path) ? path : resolve(base, path));
  if (real.startsWith(base + sep)) return existingFile(real, path, field, root);
  shipped ??= Promise.all(shippedModelFiles().map(resolveFully)).then((files) => new Set(files));
  if ((await shipped).has(real)) return real;
  throw voxError('invalid_model_file', {
    field,
    path,
    problem: `is outside models_root (${root}); put the model there, or set models_root in the config`,
  });
}

/**
 * `real` (inside `root`) if it names a regular file (`stat`: the file is not opened).
 * @throws VoxError `invalid_request_error` naming `field` if it does not exist, cannot be
 *   examined, or is not a regular file.
 */
async function existingFile(real: string, path: string, field: string, root: string): Promise<string> {
  let file: boolean;
  try {
    file = (await stat(real)).isFile();
  } catch (e) {
    const code = (e as NodeJS.ErrnoException).code;
    throw voxError('invalid_model_file', {
      field,
      path,
      problem:
        code === 'ENOENT' || code === 'ENOTDIR'
          ? `does not exist in models_root (${root})`
          : `cannot be read (${code})`,
    });
  }
  if (!file) throw voxError('invalid_model_file', { field, path, problem: 'is not a regular file' });
  return real;
}
