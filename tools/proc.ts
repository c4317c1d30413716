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
  let s = 0;
  for (const p of processTree(pid)) {
    const f = readFileSync(`/proc/${p}/stat`, 'utf8').split(') ')[1].split(' ');
    s += (Number(f[11]) + Number(f[12])) / 100;
  }
  return s;
}

/** Resident bytes (VmRSS) of a process and its live descendants. */
export function treeRssBytes(pid: number): number {
  return processTree(pid).reduce((n, p) => n + Number(/VmRSS:\s+(\d+) kB/.exec(readFileSync(`/proc/${p}/status`, 'utf8'))?.[1] ?? 0) * 1024, 0);
}
