/**
 * The idle garbage collection (issue 25 item 14): once after each spell of work, when the server has idled; and the
 * malloc trim after it (issue 44 item 6).
 */
import { execFileSync } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { describe, expect, it } from 'vitest';
import { IdleCollector } from '../../runtime/memory.js';
import { until } from '../helpers.js';

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

describe('IdleCollector (issue 25 item 14)', () => {
  it('issue 25 item 14: collects once after work, only when idle for idleMs; never while busy; not again without new work', async () => {
    let busy = true;
    const c = new IdleCollector(() => busy, 100);
    try {
      await sleep(250);
      expect(c.runs).toBe(0); // busy: never
      busy = false;
      await until(() => c.runs === 1, 2000);
      await sleep(300);
      expect(c.runs).toBe(1); // idle with no new work: once
      c.touch(); // a short request came and went
      await until(() => c.runs === 2, 2000);
    } finally {
      c.stop();
    }
  });

  it('never collects while short requests keep coming, each between two looks at busy(); once after they stop', async () => {
    const c = new IdleCollector(() => false, 100);
    try {
      // A request every 40 ms, each over before the collector looks (every 20 ms): 600 ms of traffic, 6 x idleMs.
      for (let t = 0; t < 600; t += 40) {
        c.touch();
        await sleep(40);
      }
      expect(c.runs).toBe(0);
      await until(() => c.runs === 1, 2000);
    } finally {
      c.stop();
    }
  });
});

/**
 * A process that leaves free pages in glibc's main arena the way the server did (issue 44 item 6): one 8 MiB block
 * freed raises malloc's mmap threshold to 8 MiB, so 240 buffers of 256 KiB then come from the arena; every 12th is
 * kept, so the free ones sit between live ones and free() cannot give them back from the arena's top. It prints its
 * RSS (/proc/self/status) before and after `trimFreedMemory` (or nothing, with TRIM=0), MiB.
 */
const script = `
import { readFileSync } from 'node:fs';
import { trimFreedMemory } from ${JSON.stringify(fileURLToPath(new URL('../../dist/runtime/memory.js', import.meta.url)))};
const rss = () => Number(/VmRSS:\\s+(\\d+) kB/.exec(readFileSync('/proc/self/status', 'utf8'))[1]) / 1024;
let big = Buffer.allocUnsafeSlow(8 << 20);
big.fill(1);
big = null;
gc();
const kept = [];
let freed = [];
for (let i = 0; i < 240; i++) {
  const b = Buffer.allocUnsafeSlow(256 << 10);
  b.fill(i);
  (i % 12 === 11 ? kept : freed).push(b);
}
freed = null;
gc();
await new Promise((r) => setTimeout(r, 200));
gc();
const before = rss();
const trimmed = process.env.TRIM === '1' && trimFreedMemory();
console.log(JSON.stringify({ trimmed, before, after: rss(), kept: kept.length }));
`;

describe('trimFreedMemory (issue 44 item 6)', () => {
  const run = (trim: boolean) =>
    JSON.parse(
      execFileSync(process.execPath, ['--expose-gc', '--input-type=module', '-e', script], {
        env: { ...process.env, TRIM: trim ? '1' : '0' },
      }).toString(),
    ) as { trimmed: boolean; before: number; after: number };

  it.runIf(process.platform === 'linux')(
    "gives the arena's free pages back: RSS falls by most of the 55 MiB freed, and stays without it",
    () => {
      const without = run(false);
      const withTrim = run(true);
      expect(withTrim.trimmed).toBe(true);
      // 220 of 240 buffers of 256 KiB freed: 55 MiB. Measured here: 103 -> 51 MiB with the trim, 103 -> 103 without.
      expect(withTrim.before - withTrim.after).toBeGreaterThan(30);
      expect(without.before - without.after).toBeLessThan(5);
    },
  );
});
