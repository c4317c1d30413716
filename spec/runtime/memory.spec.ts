/** The idle garbage collection (issue 25 item 14): once after each spell of work, when the server has idled. */
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
});
