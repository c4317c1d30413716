/**
 * Test harness (issue 41, autoscaling): a CPU budget per node, as if each node had a small machine
 * of its own. On one 2-core machine the nodes otherwise share both cores, so a second replica
 * adds no capacity and a test cannot tell whether scaling out helps. Each budget is a cgroup of
 * the kernel's `cpu` controller with a CFS quota (`cpus` cores' worth of time per 100 ms period):
 * cgroup v1 (`/sys/fs/cgroup/cpu/`, this machine and CI) or v2 (`cpu.max`). A process added
 * keeps its threads (slot hosts with `isolation: 'thread'`) and children in the budget.
 *
 * Needs root: {@link requireCpuBudgets} throws saying why, so the suite fails instead of skipping.
 * Every budget is named `vx41-<test pid>-<node>`; a test process killed before its `afterAll` leaves
 * its nodes and budgets behind, and the next run's {@link requireCpuBudgets} removes them.
 */
import { existsSync, mkdirSync, readdirSync, readFileSync, rmdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';

const V1 = '/sys/fs/cgroup/cpu';
const V2 = '/sys/fs/cgroup';
const PERIOD_US = 100_000;

/** The cgroup root to make budgets in, or why there is none. */
function root(): { dir: string; v2: boolean } | { why: string } {
  if (process.getuid?.() !== 0)
    return { why: 'per-node CPU budgets are cgroups: run this suite as root (as .ci/run does)' };
  if (existsSync(join(V1, 'cpu.cfs_quota_us'))) return { dir: V1, v2: false };
  const controllers = join(V2, 'cgroup.controllers');
  if (existsSync(controllers) && readFileSync(controllers, 'utf8').split(/\s+/).includes('cpu'))
    return { dir: V2, v2: true };
  return { why: "no cgroup `cpu` controller here (neither /sys/fs/cgroup/cpu nor cgroup v2's cpu.max)" };
}

/**
 * Checks that budgets can be made, and cleans up after earlier test processes that died without
 * doing so (killed): the nodes left running in their budgets are killed (SIGKILL), and the
 * budgets removed once empty.
 * @throws Error saying why per-node CPU budgets cannot be made here (not root, no cpu controller).
 */
export async function requireCpuBudgets(): Promise<void> {
  const r = root();
  if ('why' in r) throw new Error(r.why);
  const stale = readdirSync(r.dir).filter((d) => {
    const m = /^vx41-(\d+)-/.exec(d);
    return m && !existsSync(`/proc/${m[1]}`);
  });
  for (const d of stale)
    for (const pid of readFileSync(join(r.dir, d, 'cgroup.procs'), 'utf8')
      .split('\n')
      .filter(Boolean)) {
      try {
        process.kill(Number(pid), 'SIGKILL');
      } catch {
        // gone already
      }
    }
  for (const d of stale)
    for (let i = 0; i < 20; i++) {
      try {
        rmdirSync(join(r.dir, d));
        break;
      } catch {
        await new Promise((done) => setTimeout(done, 100)); // its processes still exiting
      }
    }
}

/** One node's CPU budget. */
export interface CpuBudget {
  /** Puts process `pid` (its threads and later children too) in the budget. */
  add(pid: number): void;
  /** Moves what is left back to the root group and removes the budget. */
  remove(): void;
}

/**
 * Makes a budget of `cpus` cores (e.g. 0.6: 60 ms of CPU per 100 ms; Infinity: no limit) named `name`
 * (unique per test process).
 * @throws Error as {@link requireCpuBudgets}, or the kernel's refusal.
 */
export function cpuBudget(name: string, cpus: number): CpuBudget {
  const r = root();
  if ('why' in r) throw new Error(r.why);
  const dir = join(r.dir, `vx41-${process.pid}-${name}`);
  if (!existsSync(dir)) mkdirSync(dir);
  // Infinity: no quota (a process kept in a budget only to be cleaned up with the test's nodes).
  const quota = Number.isFinite(cpus) ? Math.round(cpus * PERIOD_US) : -1;
  if (r.v2) {
    const sub = join(r.dir, 'cgroup.subtree_control');
    if (!readFileSync(sub, 'utf8').includes('cpu')) writeFileSync(sub, '+cpu');
    writeFileSync(join(dir, 'cpu.max'), `${quota < 0 ? 'max' : quota} ${PERIOD_US}`);
  } else {
    writeFileSync(join(dir, 'cpu.cfs_period_us'), String(PERIOD_US));
    writeFileSync(join(dir, 'cpu.cfs_quota_us'), String(quota));
  }
  return {
    add: (pid) => writeFileSync(join(dir, 'cgroup.procs'), String(pid)),
    remove: () => {
      try {
        for (const pid of readFileSync(join(dir, 'cgroup.procs'), 'utf8').split('\n').filter(Boolean))
          writeFileSync(join(r.dir, 'cgroup.procs'), pid);
        rmdirSync(dir);
      } catch {
        // its processes still exiting: the empty group goes with the next run's cleanup
      }
    },
  };
}
