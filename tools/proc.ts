import { readdirSync, readFileSync } from 'node:fs';

/** A process and its live descendants (the slot hosts under process isolation), from /proc. */
export function processTree(pid: number): number[] {
  const out = [pid];
  for (const tid of readdirSync(`/proc/${pid}/task`)) {
    const kids = readFileSync(`/proc/${pid}/task/${tid}/children`, 'utf8').trim();
    if (kids) for (const k of kids.split(' ')) out.push(...processTree(Number(k)));
  }
  return out;
}

/** CPU seconds (utime + stime, clock ticks of 10 ms) of a process and its live descendants. */
export function treeCpuSeconds(pid: number): number {
  return processTree(pid).reduce((s, p) => s + ownCpuSeconds(p), 0);
}

/**
 * CPU seconds of a process alone (`main`) and of its live descendants together (`hosts`: the slot hosts under process
 * isolation).
 */
export function cpuApart(pid: number): { main: number; hosts: number } {
  const [main, ...kids] = processTree(pid).map(ownCpuSeconds);
  return { main, hosts: kids.reduce((a, b) => a + b, 0) };
}

/** CPU seconds (utime + stime, clock ticks of 10 ms) of one process, its threads included. */
export function ownCpuSeconds(pid: number): number {
  const f = readFileSync(`/proc/${pid}/stat`, 'utf8').split(') ')[1].split(' ');
  return (Number(f[11]) + Number(f[12])) / 100;
}

/** Resident bytes (VmRSS) of a process and its live descendants. */
export function treeRssBytes(pid: number): number {
  return processTree(pid).reduce(
    (n, p) => n + Number(/VmRSS:\s+(\d+) kB/.exec(readFileSync(`/proc/${p}/status`, 'utf8'))?.[1] ?? 0) * 1024,
    0,
  );
}
