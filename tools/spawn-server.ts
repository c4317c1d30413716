import { spawn, type ChildProcess } from 'node:child_process';
import { existsSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';

/**
 * Servers started by {@link spawnServer} that have not exited yet, each with what to remove once
 * it has (a tool interrupted stops them with {@link stopSpawned}).
 */
const spawned = new Map<ChildProcess, () => void>();

/** Asks every spawned server that is still running to stop (SIGTERM) and removes its files now. */
export function stopSpawned(): void {
  for (const [child, cleanup] of spawned) {
    child.kill('SIGTERM');
    cleanup();
  }
}

/**
 * Starts `voxserve serve` (the compiled CLI) as a child process with `args` (use `--port 0` or a
 * config with `port: 0`), and resolves once it listens and `/ready` answers 200. For the
 * benchmarks and shutdown tests, which measure or signal a separate server process.
 * `VOXSERVE_SERVER_NODE_ARGS` adds Node flags to the server process (profiling).
 * @param cleanup called once the server has exited, or when {@link stopSpawned} stops it.
 * @throws Error if the server exits first.
 */
export async function spawnServer(
  args: string[],
  cleanup: () => void = () => {},
): Promise<{ child: ChildProcess; url: string }> {
  // The compiled CLI: beside this file in dist/, or in dist/ when this runs from the sources (vitest).
  const sibling = fileURLToPath(new URL('./cli.js', import.meta.url));
  const cli = existsSync(sibling) ? sibling : fileURLToPath(new URL('../dist/tools/cli.js', import.meta.url));
  // VOXSERVE_SERVER_NODE_ARGS: extra Node flags for the server process, e.g. `--cpu-prof --cpu-prof-dir=/tmp/prof`.
  const nodeArgs = (process.env.VOXSERVE_SERVER_NODE_ARGS ?? '').split(' ').filter(Boolean);
  const child = spawn(process.execPath, [...nodeArgs, cli, 'serve', ...args], {
    stdio: ['ignore', process.env.CLUSTER_LOG ? 'pipe' : 'ignore', 'pipe'],
  });
  spawned.set(child, cleanup);
  child.once('exit', () => {
    spawned.delete(child);
    cleanup();
  });
  const url = await new Promise<string>((resolve, reject) => {
    let err = '';
    child.stderr!.on('data', (d: Buffer) => {
      err += d.toString();
      const m = /listening on (\S+)/.exec(err);
      if (m) resolve(m[1]);
    });
    child.on('exit', (code) => reject(new Error(`voxserve serve exited with ${code}: ${err.trim()}`)));
  });
  while ((await fetch(`${url}/ready`)).status !== 200) await new Promise((r) => setTimeout(r, 20));
  return { child, url };
}

/**
 * {@link spawnServer} with `config` (a config file's content, see docs/configuration.md) written
 * to a folder of its own under the system's temp folder, removed once the server has exited (or
 * failed to start). @throws as {@link spawnServer}.
 */
export async function spawnWithConfig(config: object): Promise<{ child: ChildProcess; url: string }> {
  const dir = mkdtempSync(join(tmpdir(), 'voxserve-bench-'));
  const removeDir = (): void => rmSync(dir, { recursive: true, force: true });
  const file = join(dir, 'config.json');
  writeFileSync(file, JSON.stringify(config));
  try {
    return await spawnServer(['--config', file], removeDir);
  } catch (e) {
    removeDir();
    throw e;
  }
}
