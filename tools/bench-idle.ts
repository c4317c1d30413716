/**
 * What an idle server costs: the CPU of `voxserve serve` (main process and slot hosts apart) with
 * its models loaded and nothing to do, against a bare Node.js process that does nothing, measured
 * side by side over the same window. A server on a small machine (a Home Assistant box) is idle
 * most of the time; periodic timers there cost CPU for nothing.
 *
 *   npm run build && node dist/tools/bench-idle.js [--seconds 20] [--settle 15]
 *
 * `--settle`: seconds to wait after start before measuring (loading and the first idle garbage
 * collection, see `IdleCollector`, are not idling: at `--settle 5` the main process read 29 ms
 * per second). A bad option is an error naming it (exit 2).
 */
import { spawn } from 'node:child_process';
import { parseArgs } from 'node:util';
import { defaultCatalog } from '../runtime/config.js';
import { cpuApart, ownCpuSeconds } from './proc.js';
import { spawnWithConfig } from './spawn-server.js';

const usage = (why: string): never => {
  process.stderr.write(`bench-idle: ${why}\nusage: node dist/tools/bench-idle.js [--seconds 20] [--settle 15]\n`);
  return process.exit(2);
};
const values = ((): { seconds: string; settle: string } => {
  try {
    return parseArgs({
      options: { seconds: { type: 'string', default: '20' }, settle: { type: 'string', default: '15' } },
    }).values as { seconds: string; settle: string };
  } catch (e) {
    return usage((e as Error).message);
  }
})();
const seconds = Number(values.seconds);
const settle = Number(values.settle);
if (!(seconds > 0)) usage(`--seconds must be a number of seconds over 0, got '${values.seconds}'`);
if (!(settle >= 0)) usage(`--settle must be a number of seconds, 0 or more, got '${values.settle}'`);
const sleep = (s: number): Promise<void> => new Promise((r) => setTimeout(r, s * 1000));

const models = ['silero-vad', 'hey-jarvis'].map((id) => ({
  ...defaultCatalog().find((m) => m.id === id)!,
  slots: 2,
  lazy: false,
}));
const { child } = await spawnWithConfig({ port: 0, log_level: 'warn', models });
const bare = spawn(process.execPath, ['-e', 'setInterval(() => {}, 1 << 30)'], { stdio: 'ignore' });
try {
  await sleep(settle);
  const a = { server: cpuApart(child.pid!), bare: ownCpuSeconds(bare.pid!) };
  await sleep(seconds);
  const b = { server: cpuApart(child.pid!), bare: ownCpuSeconds(bare.pid!) };
  const perS = (x: number): string => ((x * 1000) / seconds).toFixed(2);
  process.stdout.write(
    `idle for ${seconds} s (models silero-vad and hey-jarvis loaded, 2 slots each), CPU ms per second: ` +
      `server main process ${perS(b.server.main - a.server.main)}, slot hosts ${perS(b.server.hosts - a.server.hosts)}; ` +
      `bare Node.js process ${perS(b.bare - a.bare)}\n`,
  );
} finally {
  bare.kill();
  child.kill('SIGTERM');
  await new Promise((r) => child.on('exit', r));
}
