/**
 * `/debug` at scale (issue 40): with 50 registered models (a folder of wake words makes this
 * normal) and live streams, the page draws one chart per kind of actor (at most 12), not one per
 * model, and still names every model, each a row of its kind's table; selecting a row lights that
 * instance's states on the kind's shared chart. `GET /debug/state` carries the same as `kinds`.
 */
import { mkdirSync } from 'node:fs';
import { chromium, type Browser } from 'playwright-core';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import WebSocket from 'ws';
import { defaultCatalog, ServerConfig } from '../../runtime/config.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { until } from '../helpers.js';

const silero = defaultCatalog().find((m) => m.id === 'silero-vad')!.path;
const ids = Array.from({ length: 50 }, (_, i) => `vad-${String(i).padStart(2, '0')}`);
const STREAMS = 20;
let server: VoxServer;
let browser: Browser;
const sockets: WebSocket[] = [];

beforeAll(async () => {
  server = await startServer(
    ServerConfig.parse({
      log_level: 'silent',
      port: 0,
      management: { enabled: true },
      debug: { inspect: true },
      models: ids.map((id) => ({ id, task: 'vad', path: silero })),
    }),
  );
  const r = await fetch(`${server.url}/v1/models/load`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ id: 'vad-07' }),
  });
  expect(r.status, await r.text()).toBe(200);
  for (let i = 0; i < STREAMS; i++) {
    const ws = new WebSocket(`${server.url.replace('http', 'ws')}/v1/stream?model=vad-07`);
    ws.on('error', () => {});
    sockets.push(ws);
  }
  await until(
    async () => (await (await fetch(`${server.url}/debug/state`)).json()).streams.streaming === STREAMS,
    10_000,
  );
  browser = await chromium.launch({
    executablePath: '/usr/bin/chromium',
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--no-first-run', '--disable-background-networking'],
  });
}, 60_000);
afterAll(async () => {
  for (const ws of sockets) ws.terminate();
  await browser?.close();
  await server?.close();
});

describe('/debug with 50 registered models', () => {
  it('GET /debug/state: one kind per chart, a row per model and per stream', async () => {
    const d = await (await fetch(`${server.url}/debug/state`)).json();
    const kinds = new Map<string, any>(d.kinds.map((k: any) => [k.kind, k]));
    expect([...kinds.keys()]).toEqual(expect.arrayContaining(['system', 'supervisor', 'model', 'stream', 'http']));
    expect(d.kinds.length).toBeLessThanOrEqual(12);
    const models = kinds.get('model');
    for (const id of ids) expect(models.instances.map((i: any) => i.name)).toContain(id);
    expect(models.instances.find((i: any) => i.name === 'vad-07')).toMatchObject({
      id: 'model:vad-07',
      state: 'ready',
      leases: `${STREAMS}/256`,
      queue: 0,
    });
    expect(models.instances.find((i: any) => i.name === 'vad-03')).toMatchObject({
      state: 'unloaded',
      active: ['unloaded'],
    });
    expect(models.states.unloaded).toBe(models.count - 1);
    const streams = kinds.get('stream');
    expect(streams.count).toBe(STREAMS);
    expect(streams.instances[0].detail).toBe('streaming, model vad-07');
    expect(kinds.get('system').instances).toEqual([expect.objectContaining({ id: 'system', state: 'running' })]);
    // What the page drew before stays: a model list with active states, streams by phase, a sample.
    expect(d.models.length).toBe(models.count);
    expect(d.streams.streaming).toBe(STREAMS);
    expect(d.sockets.length).toBe(STREAMS);
  });

  it('the page draws at most one chart per kind and names every model; a selected row lights its states', async () => {
    const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
    await page.goto(`${server.url}/debug`);
    // The first draw waits for the charts' layout (elkjs), slow on a loaded machine.
    await page.waitForFunction(
      (names) => {
        const text = document.body.textContent ?? '';
        return document.querySelector('svg[data-chart="model"]') && names.every((n) => text.includes(n));
      },
      ids,
      { timeout: 30_000 },
    );
    const charts = await page.locator('svg[data-chart]').count();
    expect(charts, 'charts drawn').toBeLessThanOrEqual(12);
    expect(charts).toBe(await page.locator('section.kind').count());
    expect(await page.locator('svg[data-chart="model"]').count()).toBe(1);
    const text = (await page.textContent('section[data-kind="model"]')) ?? '';
    for (const id of ids) expect(text).toContain(id);
    expect(await page.locator('section[data-kind="stream"] tr.inst').count()).toBe(STREAMS);
    // Many instances: each state is marked with how many are in it, and none is lit before a row is chosen.
    expect(await page.locator('svg[data-chart="model"] .state.current').count()).toBe(0);
    expect(
      Number(await page.getAttribute('svg[data-chart="model"] .state[data-state="unloaded"]', 'data-count')),
    ).toBeGreaterThanOrEqual(49);
    // A kind of one instance is lit as it is.
    expect(await page.locator('svg[data-chart="system"] .state.current[data-state="running"]').count()).toBe(1);

    await page.click('tr[data-model="vad-07"]');
    await page.waitForSelector('tr.selected[data-model="vad-07"]');
    await page.waitForSelector('svg[data-chart="model"] .state.current[data-state="resident.ready"]');
    expect(await page.locator('svg[data-chart="model"] .state.current[data-state="unloaded"]').count()).toBe(0);
    await page.click('tr[data-model="vad-03"]');
    await page.waitForSelector('svg[data-chart="model"] .state.current[data-state="unloaded"]');
    expect(await page.locator('svg[data-chart="model"] .state.current[data-state="resident.ready"]').count()).toBe(0);
    // The selection lasts across the page's refreshes.
    await new Promise((r) => setTimeout(r, 1200));
    expect(await page.locator('svg[data-chart="model"] .state.current[data-state="unloaded"]').count()).toBe(1);

    // A stream's row lights the stream chart.
    await page.click('section[data-kind="stream"] tr.inst >> nth=0');
    await page.waitForSelector('svg[data-chart="stream"] .state.current[data-state="live.phase.streaming"]');
    // docs/debug.png is this page with vad-07 lit, wide enough for the model chart to fit.
    await page.setViewportSize({ width: 1900, height: 1000 });
    await page.click('tr[data-model="vad-07"]');
    await page.waitForSelector('svg[data-chart="model"] .state.current[data-state="resident.ready"]');
    mkdirSync('spec/artifacts', { recursive: true });
    await page.screenshot({ path: 'spec/artifacts/debug-scale.png', fullPage: true });
    await page.close();
  });
});
