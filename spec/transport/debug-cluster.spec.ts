/**
 * `/debug` shows the cluster (issue 19): `GET /debug/state` on one node carries its registry view
 * (`cluster`: every live node with its URL, free memory, draining flag and the models it holds
 * with their figures), and the page draws it. Two nodes in this process on one nats-server; the
 * expected holdings are what the test made each node hold, the free memory what its probe reports.
 */
import { mkdirSync } from 'node:fs';
import { chromium } from 'playwright-core';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ServerConfig } from '../../runtime/config.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { startNats, type NatsServer } from '../cluster/nats-server.js';
import { until } from '../helpers.js';

const GB = 1024 ** 3;
const free: Record<string, number> = { A: 3 * GB, B: 5 * GB };
let nats: NatsServer;
let A: VoxServer;
let B: VoxServer;
let single: VoxServer;

const node = (name: string): Promise<VoxServer> =>
  startServer(
    ServerConfig.parse({
      log_level: 'silent',
      port: 0,
      isolation: 'thread',
      management: { enabled: true },
      cluster: { nats: nats.url, node: name, heartbeat_ms: 300 },
    }),
    { memoryProbe: () => free[name] },
  );

const state = async (s: VoxServer): Promise<any> => (await fetch(`${s.url}/debug/state`)).json();

beforeAll(async () => {
  nats = await startNats();
  [A, B] = await Promise.all([node('A'), node('B')]);
  single = await startServer(ServerConfig.parse({ log_level: 'silent', port: 0, management: { enabled: true } }));
  const r = await fetch(`${A.url}/v1/models/load`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ id: 'silero-vad', node: 'B' }),
  });
  expect(r.status, await r.text()).toBe(200);
}, 60_000);
afterAll(async () => {
  await Promise.all([A, B, single].map((s) => s?.close()));
  await nats?.stop();
});

describe('/debug in a cluster', () => {
  it("GET /debug/state on A lists both nodes, and B's holding of silero-vad with its figures", async () => {
    await until(
      async () => (await state(A)).cluster?.nodes.find((n: any) => n.node === 'B')?.models.length === 1,
      5000,
    );
    const { cluster } = await state(A);
    expect(cluster.node).toBe('A');
    expect(cluster.nats.connected).toBe(true);
    expect(cluster.nodes.map((n: any) => n.node)).toEqual(['A', 'B']);
    const [a, b] = cluster.nodes;
    expect(a).toMatchObject({ url: A.url, free_bytes: free.A, draining: false, models: [] });
    expect(b).toMatchObject({ url: B.url, free_bytes: free.B, draining: false });
    expect(b.models).toEqual([
      expect.objectContaining({ id: 'silero-vad', task: 'vad', state: 'ready', queued: 0, active_leases: 0 }),
    ]);
    expect(b.models[0].slots).toBeGreaterThan(0);
    expect(b.models[0].free_slots).toBe(b.models[0].slots);
    expect(b.models[0].resident_bytes).toBeGreaterThan(0);
    // B's own page says the same of itself.
    expect((await state(B)).cluster.nodes.find((n: any) => n.node === 'B').models.map((m: any) => m.id)).toEqual([
      'silero-vad',
    ]);
  });

  it("the membership chart is a kind of its own (one row, systemId cluster, connected), drawn beside placement's", async () => {
    const { kinds } = await state(A);
    const membership = kinds.find((k: any) => k.kind === 'membership');
    expect(membership).toMatchObject({ chart: 'membership', count: 1 });
    expect(membership.instances[0]).toMatchObject({ name: 'cluster' });
    expect(membership.instances[0].active).toContain('connected');
    // No placement is under way: the kind is listed (its chart drawn) with no row.
    expect(kinds.find((k: any) => k.kind === 'placement')).toMatchObject({ chart: 'placement', count: 0 });
    const charts = (await (await fetch(`${A.url}/debug/charts`)).json()).map((c: any) => c.id);
    expect(charts).toEqual(expect.arrayContaining(['membership', 'placement']));
    expect((await state(single)).kinds.map((k: any) => k.kind)).not.toContain('membership');
  });

  it('a single node: cluster is null', async () => {
    expect((await state(single)).cluster).toBeNull();
  });

  it("the page, in headless Chromium, draws a card per node with B's silero-vad in it", async () => {
    const browser = await chromium.launch({
      executablePath: '/usr/bin/chromium',
      args: ['--headless', '--no-sandbox', '--disable-gpu', '--no-first-run', '--disable-background-networking'],
    });
    try {
      const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
      await page.goto(`${A.url}/debug`);
      // The first draw waits for the charts' layout (elkjs), slow on a loaded machine.
      await page.waitForSelector('[data-node="B"] tr[data-model="silero-vad"]', { timeout: 30_000 });
      const b = (await page.textContent('[data-node="B"]')) ?? '';
      expect(b).toMatch(/silero-vad\s*ready\s*slots 0\/\d+\s*queued 0/);
      expect(b).toContain(`free memory ${5 * 1024} MiB`);
      expect(b).toContain(B.url);
      expect((await page.textContent('[data-node="A"]')) ?? '').toMatch(/A\s*this node[\s\S]*holds no model/);
      expect(await page.textContent('#cluster-meta')).toMatch(/^this node: A, NATS connected/);
      // The membership chart, its one instance lit as it is; the placement chart beside it.
      await page.waitForSelector('svg[data-chart="membership"] .state.current[data-state="connected"]');
      expect(await page.locator('svg[data-chart="placement"]').count()).toBe(1);
      mkdirSync('spec/artifacts', { recursive: true });
      await page.screenshot({ path: 'spec/artifacts/debug-cluster.png', fullPage: true });
      await page.locator('#cluster').screenshot({ path: 'spec/artifacts/debug-cluster-nodes.png' });
    } finally {
      await browser.close();
    }
  });
});
