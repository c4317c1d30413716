/** Inspection stream, metrics, logs, the Stately relay and the /debug page in headless Chromium. */
import { existsSync, mkdirSync } from 'node:fs';
import { Writable } from 'node:stream';
import { pino } from 'pino';
import { chromium } from 'playwright-core';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { WebSocketServer } from 'ws';
import { defaultCatalog, ServerConfig } from '../../runtime/config.js';
import { statePath } from '../../runtime/telemetry.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { fixture } from '../helpers.js';

const silero = defaultCatalog().find((m) => m.id === 'silero-vad')!.path;
const lines: any[] = [];
const sink = new Writable({
  write(chunk, _enc, cb) {
    for (const l of chunk.toString().split('\n')) if (l) lines.push(JSON.parse(l));
    cb();
  },
});
let server: VoxServer;

beforeAll(async () => {
  server = await startServer(ServerConfig.parse({ port: 0, management: { enabled: true }, debug: { inspect: true } }), {
    log: pino({ level: 'info' }, sink),
  });
});
afterAll(async () => {
  await server?.close();
});

const post = async (path: string, body: unknown) =>
  (
    await fetch(`${server.url}${path}`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify(body),
    })
  ).json();
const run = async (model: string) =>
  fetch(`${server.url}/v1/tasks/run?model=${model}`, {
    method: 'POST',
    headers: { 'content-type': 'audio/wav' },
    body: new Uint8Array(fixture('Front_Left.wav')),
  });
/** The value of one sample in the Prometheus text exposition. */
async function metric(name: string, labels: Record<string, string>): Promise<number> {
  const text = await (await fetch(`${server.url}/metrics`)).text();
  const want = Object.entries(labels).map(([k, v]) => `${k}="${v}"`);
  const line = text.split('\n').find((l) => l.startsWith(`${name}{`) && want.every((w) => l.includes(w)));
  return line ? Number(line.split(' ').at(-1)) : 0;
}

describe('observability', () => {
  it('the inspector stream carries load -> infer -> reconfigure -> unload in order, and the metrics move', async () => {
    const events: any[] = [];
    const ac = new AbortController();
    const res = await fetch(`${server.url}/debug/actors`, { signal: ac.signal });
    expect(res.headers.get('content-type')).toBe('text/event-stream');
    const reader = (async () => {
      const dec = new TextDecoder();
      let buf = '';
      for await (const chunk of res.body as unknown as AsyncIterable<Uint8Array>) {
        buf += dec.decode(chunk);
        let i;
        while ((i = buf.indexOf('\n\n')) >= 0) {
          const block = buf.slice(0, i);
          buf = buf.slice(i + 2);
          if (block.startsWith('data: ')) events.push(JSON.parse(block.slice(6)));
        }
      }
    })().catch(() => {});

    expect(await post('/v1/models/load', { id: 'obs', task: 'vad', path: silero })).toMatchObject({ loaded: true });
    expect((await run('obs')).status).toBe(200);
    expect(await post('/v1/models/load', { id: 'obs', slots: 2 })).toMatchObject({ reconfigured: true });
    expect(await post('/v1/models/unload', { id: 'obs' })).toMatchObject({ loaded: false });
    await new Promise((r) => setTimeout(r, 100));
    ac.abort();
    await reader;

    // `resident.ready.leases.idle` and `.busy` are both `ready` here; `resident.loading.queued` and `.building` both
    // `loading`.
    const states = events
      .filter((e) => e.actor === 'model:obs' && e.kind === '@xstate.snapshot')
      .map((e) => e.state.replace(/^resident\./, '').replace(/^(ready|loading)\..*/, '$1'))
      .filter((s, i, all) => s !== all[i - 1]);
    expect(states).toEqual([
      'unloaded',
      'loading',
      'ready',
      'reconfiguring',
      'loading',
      'ready',
      'unloading',
      'unloaded',
    ]);
    const causes = events.filter((e) => e.actor === 'model:obs' && e.kind === '@xstate.event').map((e) => e.event);
    expect(causes).toEqual(expect.arrayContaining(['LOAD', 'RECONFIGURE', 'UNLOAD']));
    expect(causes.indexOf('LOAD')).toBeLessThan(causes.indexOf('RECONFIGURE'));
    expect(causes.indexOf('RECONFIGURE')).toBeLessThan(causes.indexOf('UNLOAD'));

    expect(await metric('voxserve_requests_total', { model: 'obs', outcome: 'ok' })).toBe(1);
    expect(await metric('voxserve_loads_total', { model: 'obs', outcome: 'ok' })).toBe(2);
    expect(await metric('voxserve_load_duration_seconds_count', { model: 'obs' })).toBe(2);
    expect(await metric('voxserve_queue_wait_seconds_count', { model: 'obs' })).toBe(1);
    expect(await metric('voxserve_inference_duration_seconds_count', { model: 'obs' })).toBeGreaterThan(0);
    expect(await metric('voxserve_resident_bytes', { model: 'obs' })).toBe(0);
    const text = await (await fetch(`${server.url}/metrics`)).text();
    expect(text).toContain('voxserve_nodejs_eventloop_lag_seconds');
    expect(text).toContain('voxserve_ws_connections');
  });

  it('counts failures by outcome and logs one line per request, per transition, per stream close', async () => {
    const before = await metric('voxserve_requests_total', { model: 'silero-vad', outcome: 'invalid_request_error' });
    const bad = await fetch(`${server.url}/v1/tasks/run?model=silero-vad`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: 'nope',
    });
    expect(bad.status).toBe(400);
    expect(await metric('voxserve_requests_total', { model: 'silero-vad', outcome: 'invalid_request_error' })).toBe(
      before + 1,
    );

    const requests = lines.filter((l) => l.msg === 'request' && l.model === 'obs');
    expect(requests).toEqual([
      expect.objectContaining({
        route: 'run',
        outcome: 'ok',
        queue_ms: expect.any(Number),
        inference_ms: expect.any(Number),
        wall_ms: expect.any(Number),
      }),
    ]);
    const transitions = lines
      .filter((l) => l.msg === 'model state' && l.model === 'obs')
      .map((l) => `${l.from}->${l.to}`);
    expect(transitions).toEqual([
      'unloaded->loading',
      'loading->ready',
      'ready->reconfiguring',
      'reconfiguring->loading',
      'loading->ready',
      'ready->unloading',
      'unloading->unloaded',
    ]);

    const ws = new (await import('ws')).default(`${server.url.replace('http', 'ws')}/v1/stream?model=silero-vad`);
    await new Promise<void>((resolve) => {
      ws.on('message', (d) => {
        if (JSON.parse(d.toString()).type === 'ready') ws.send(JSON.stringify({ type: 'end' }));
      });
      ws.on('close', () => resolve());
    });
    await new Promise((r) => setTimeout(r, 50));
    expect(lines.filter((l) => l.msg === 'stream closed').at(-1)).toMatchObject({
      route: 'stream',
      model: 'silero-vad',
      code: 1000,
      session_id: expect.any(String),
    });
    expect(await metric('voxserve_ws_closed_total', { code: '1000' })).toBeGreaterThanOrEqual(1);
  });

  it('sends the state charts to a Stately inspector relay (@statelyai/inspect)', async () => {
    const relay = new WebSocketServer({ port: 0, host: '127.0.0.1' });
    await new Promise((r) => relay.on('listening', r));
    const got: any[] = [];
    relay.on('connection', (ws) => ws.on('message', (d) => got.push(JSON.parse(d.toString()))));
    const port = (relay.address() as { port: number }).port;
    const s = await startServer(
      ServerConfig.parse({
        log_level: 'silent',
        port: 0,
        management: { enabled: true },
        debug: { stately_url: `ws://127.0.0.1:${port}` },
      }),
    );
    try {
      await fetch(`${s.url}/v1/models/load`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ id: 'stately', task: 'vad', path: silero }),
      });
      const deadline = Date.now() + 5000;
      const values = () => got.filter((g) => g.type === '@xstate.snapshot').map((g) => statePath(g.snapshot?.value));
      const ready = 'resident.ready.leases.idle.keepAliveOff, work.flowing';
      while (!values().includes(ready) && Date.now() < deadline) await new Promise((r) => setTimeout(r, 50));
      expect(values()).toEqual(
        expect.arrayContaining(['running', 'resident.loading.queued', 'resident.loading.building', ready]),
      );
    } finally {
      await s.close();
      relay.close();
    }
  });

  it('the /debug page shows an eviction: the victim, its reason, and the load that caused it', async () => {
    const s = await startServer(
      ServerConfig.parse({
        log_level: 'silent',
        port: 0,
        max_loaded_models: 1,
        management: { enabled: true },
        debug: { inspect: true },
      }),
    );
    const browser = await chromium.launch({
      executablePath: '/usr/bin/chromium',
      args: [
        '--headless',
        '--no-sandbox',
        '--disable-gpu',
        '--disable-quic',
        '--no-first-run',
        '--disable-background-networking',
        '--disable-component-update',
        '--disable-sync',
      ],
    });
    try {
      const load = (body: unknown) =>
        fetch(`${s.url}/v1/models/load`, {
          method: 'POST',
          headers: { 'content-type': 'application/json' },
          body: JSON.stringify(body),
        });
      expect((await load({ id: 'vad-a', task: 'vad', path: silero })).status).toBe(200);
      expect((await load({ id: 'vad-b', task: 'vad', path: silero })).status).toBe(200);
      const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
      await page.goto(`${s.url}/debug`);
      await page.waitForSelector('[data-model="vad-a"][data-state="unloaded"]');
      expect(await page.textContent('[data-model="vad-a"]')).toContain('evicted (lru)');
      // vad-b's row, selected, lights its states on the model entries' shared chart.
      await page.click('tr[data-model="vad-b"][data-state="ready"]');
      await page.waitForSelector('svg[data-chart="model"] .state.current[data-state="resident.ready.leases.idle"]');
      const log = (await page.textContent('#log')) ?? '';
      expect(log).toMatch(/model:vad-a\s*EVICT\s*\{"reason":"lru","replyTo":"supervisor"\}/);
      expect(log).toMatch(/supervisor\s*\S*\s*\{"room":\{"target":"vad-b"/);
      mkdirSync('spec/artifacts', { recursive: true });
      await page.screenshot({ path: 'spec/artifacts/debug-eviction.png', fullPage: true });
    } finally {
      await browser.close();
      await s.close();
    }
  });

  it("the /debug page shows a model's state change, live, in headless Chromium", async () => {
    expect(
      existsSync('/usr/bin/chromium'),
      'Debian chromium is needed: apt-get install -y chromium (bash .ci/run installs it)',
    ).toBe(true);
    const browser = await chromium.launch({
      executablePath: '/usr/bin/chromium',
      args: [
        '--headless',
        '--no-sandbox',
        '--disable-gpu',
        '--disable-quic',
        '--no-first-run',
        '--disable-background-networking',
        '--disable-component-update',
        '--disable-sync',
      ],
    });
    try {
      const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
      await page.goto(`${server.url}/debug`);
      await page.waitForSelector('[data-model="silero-vad"]');
      await post('/v1/models/unload', { id: 'page-model' }).catch(() => {});
      expect(await post('/v1/models/load', { id: 'page-model', task: 'vad', path: silero })).toMatchObject({
        loaded: true,
      });
      await page.click('tr[data-model="page-model"][data-state="ready"]', { timeout: 5000 });
      await page.waitForSelector('svg[data-chart="model"] .state.current[data-state="resident.ready"]', {
        timeout: 5000,
      });
      // Every chart is drawn from its definition, once per kind: the root, the supervisor, model entries, both socket
      // actors.
      for (const chart of ['system', 'supervisor', 'model', 'stream', 'http'])
        await page.waitForSelector(`svg[data-chart="${chart}"] .state`, { timeout: 5000 });
      expect(await page.locator('[data-chart="system"] .state.current[data-state="running"]').count()).toBe(1);
      expect((await page.textContent('#log')) ?? '').toContain('model:page-model');
      await post('/v1/models/unload', { id: 'page-model' });
      await page.waitForSelector('[data-model="page-model"][data-state="unloaded"]', { timeout: 5000 });
      await post('/v1/models/load', { id: 'page-model' });
      await page.waitForSelector('[data-model="page-model"][data-state="ready"]', { timeout: 5000 });
      mkdirSync('spec/artifacts', { recursive: true });
      await page.screenshot({ path: 'spec/artifacts/debug.png', fullPage: true });
    } finally {
      await browser.close();
    }
  });
});
