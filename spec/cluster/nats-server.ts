/**
 * Test helper: Debian's `nats-server` (installed by .ci/run) on free loopback ports, with its
 * JetStream store in a temp folder that goes with it.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

/** A free TCP port on 127.0.0.1 (bound once and released). */
export function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const s = createServer();
    s.once('error', reject);
    s.listen(0, '127.0.0.1', () => {
      const { port } = s.address() as { port: number };
      s.close(() => resolve(port));
    });
  });
}

export interface NatsServer {
  url: string;
  port: number;
  proc: ChildProcess;
  /** Stops the server (SIGTERM, then SIGKILL) and removes its store. */
  stop(): Promise<void>;
  /** Stops the server (SIGTERM, or `signal`) but keeps its store (for {@link restart}). */
  halt(signal?: NodeJS.Signals): Promise<void>;
  /** Starts the server again on the same port with the same store (its buckets survive). */
  restart(): Promise<void>;
}

/**
 * Starts `nats-server -js` on a free port and waits until it is ready.
 * @param args more arguments (`--auth TOKEN`, cluster routes).
 * @param port the client port (default: a free one).
 */
export async function startNats(args: string[] = [], port?: number): Promise<NatsServer> {
  const p = port ?? (await freePort());
  const dir = mkdtempSync(join(tmpdir(), 'voxserve-nats-'));
  const launch = async (): Promise<ChildProcess> => {
    const proc = spawn('/usr/sbin/nats-server', ['-js', '-a', '127.0.0.1', '-p', String(p), '-sd', dir, ...args], {
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    let out = '';
    await new Promise<void>((resolve, reject) => {
      const on = (d: Buffer): void => {
        out += d.toString();
        if (out.includes('Server is ready')) resolve();
      };
      proc.stdout!.on('data', on);
      proc.stderr!.on('data', on);
      proc.once('exit', (code) => reject(new Error(`nats-server exited with ${code}: ${out}`)));
      setTimeout(() => reject(new Error(`nats-server not ready in 10 s: ${out}`)), 10_000).unref();
    });
    return proc;
  };
  const halt = async (proc: ChildProcess, signal: NodeJS.Signals = 'SIGTERM'): Promise<void> => {
    if (proc.exitCode !== null || proc.signalCode !== null) return;
    const exited = new Promise<void>((r) => proc.once('exit', () => r()));
    proc.kill(signal);
    const t = setTimeout(() => proc.kill('SIGKILL'), 3000);
    await exited;
    clearTimeout(t);
  };
  const server: NatsServer = {
    url: `nats://127.0.0.1:${p}`,
    port: p,
    proc: await launch(),
    stop: async () => {
      await halt(server.proc);
      rmSync(dir, { recursive: true, force: true });
    },
    halt: (signal) => halt(server.proc, signal),
    restart: async () => {
      await halt(server.proc);
      server.proc = await launch();
    },
  };
  return server;
}
