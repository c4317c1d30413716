import { Histogram, Registry } from 'prom-client';
import { describe, expect, it } from 'vitest';
import { ModelHistogram } from '../../runtime/telemetry.js';

describe('ModelHistogram', () => {
  it("exposes the same text as prom-client's Histogram for the same observations, per model", async () => {
    const buckets = [0.001, 0.01, 0.1, 1];
    const ours = new Registry();
    const theirs = new Registry();
    const fast = new ModelHistogram('x_seconds', 'help text', buckets, ours);
    const reference = new Histogram({
      name: 'x_seconds',
      help: 'help text',
      labelNames: ['model'],
      buckets,
      registers: [theirs],
    });
    const values = [0, 0.0005, 0.001, 0.002, 0.05, 0.1, 0.5, 1, 3, 1e9];
    for (const [i, v] of values.entries()) {
      const model = i % 3 ? 'a' : 'b';
      fast.labels({ model }).observe(v);
      reference.labels({ model }).observe(v);
    }
    expect(await ours.metrics()).toBe(await theirs.metrics());
    expect(await ours.metrics()).toContain('x_seconds_bucket{le="0.01",model="a"} 2');
    ours.resetMetrics();
    theirs.resetMetrics();
    fast.labels({ model: 'a' }).observe(0.2);
    reference.labels({ model: 'a' }).observe(0.2);
    expect((await ours.metrics()).split('\n').filter((l) => l.includes('model="a"'))).toEqual(
      (await theirs.metrics()).split('\n').filter((l) => l.includes('model="a"')),
    );
  });
});
