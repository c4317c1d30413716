/**
 * `/debug` groups actors by kind generically (issue 40): a kind is its machine's `id`, so a new
 * chart (the cluster's membership and placements) shows up as one chart with a row per instance
 * without more code. Here, fake `membership` (systemId `cluster`) and `placement` machines: alone
 * in an {@link ActorDirectory}, then spawned into a running server's actor system, where the page
 * fetches their chart once they appear and lights a selected placement's state.
 */
import { connect } from 'node:net';
import { chromium } from 'playwright-core';
import { describe, expect, it } from 'vitest';
import { createActor, createMachine, fromCallback, setup, spawnChild } from 'xstate';
import { ServerConfig } from '../../runtime/config.js';
import { ActorDirectory, debugKinds } from '../../transport/debug.js';
import { startServer } from '../../transport/server.js';
import { until } from '../helpers.js';

const membership = createMachine({
  id: 'membership',
  initial: 'connecting',
  context: { nodes: ['a', 'b'], heartbeats: 3 },
  states: { connecting: { on: { UP: 'connected' } }, connected: { on: { DOWN: 'disconnected' } }, disconnected: {} },
});
const placement = createMachine({
  id: 'placement',
  initial: 'locking',
  states: { locking: { on: { LOCKED: 'loading' } }, loading: { on: { LOADED: 'placed' } }, placed: {} },
});
/** A root that invokes membership as `cluster` and spawns three placements, and a callback actor (no chart). */
const root = setup({ actors: { membership, placement, ticker: fromCallback(() => () => {}) } }).createMachine({
  id: 'fake-root',
  invoke: [{ src: 'membership', id: 'membership', systemId: 'cluster' }, { src: 'ticker' }],
  entry: ['vad', 'kws', 'asr'].map((m) => spawnChild('placement', { id: `placement:${m}` })),
  initial: 'on',
  states: { on: {} },
});

describe('/debug kinds', () => {
  it('a new machine is one kind with its instances as rows; a root that stops is forgotten', () => {
    const dir = new ActorDirectory();
    const actor = createActor(root).start();
    dir.add(actor);
    actor.system.get('cluster')!.send({ type: 'UP' });
    const placements = actor.getSnapshot().children as Record<string, any>;
    placements['placement:kws'].send({ type: 'LOCKED' });
    const kinds = new Map(debugKinds(dir, []).map((k) => [k.kind, k]));
    // The declared kinds stay (no instance here), then the ones found, each once.
    const declared = ['system', 'supervisor', 'model', 'stream', 'http'];
    expect([...kinds.keys()].slice(0, 5)).toEqual(declared);
    expect([...kinds.keys()].slice(5).sort()).toEqual(['fake-root', 'membership', 'placement']);
    expect(kinds.get('membership')).toMatchObject({
      chart: 'membership',
      count: 1,
      states: { connected: 1 },
      instances: [{ id: 'membership', state: 'connected', active: ['connected'], detail: 'nodes 2, heartbeats 3' }],
    });
    expect(kinds.get('placement')).toMatchObject({ count: 3, states: { locking: 2, loading: 1 } });
    expect(kinds.get('placement')!.instances.map((i) => `${i.id} ${i.state}`)).toEqual([
      'placement:vad locking',
      'placement:kws loading',
      'placement:asr locking',
    ]);
    const charts = dir.chartList().map((c) => c.id);
    expect(charts.slice(0, 5)).toEqual(declared);
    expect(charts.slice(5).sort()).toEqual(['fake-root', 'membership', 'placement']);
    actor.stop();
    expect(debugKinds(dir, []).find((k) => k.kind === 'placement')!.count).toBe(0);
  });

  it('a root actor made with the directory as its inspector is added as it is made, named by its context', async () => {
    const dir = new ActorDirectory();
    const actor = createActor(placement, { inspect: dir.watch() });
    actor.start();
    await Promise.resolve();
    actor.send({ type: 'LOCKED' });
    expect(debugKinds(dir, []).find((k) => k.kind === 'placement')).toMatchObject({
      count: 1,
      instances: [{ state: 'loading' }],
    });
    actor.stop();
    expect(debugKinds(dir, []).find((k) => k.kind === 'placement')!.count).toBe(0);
    const named = createActor(
      createMachine({ id: 'placement', context: { id: 'vad' }, initial: 'locking', states: { locking: {} } }),
      {
        inspect: dir.watch(),
      },
    ).start();
    await Promise.resolve();
    expect(debugKinds(dir, []).find((k) => k.kind === 'placement')!.instances[0].name).toBe('vad');
    named.stop();
  });

  it('Wyoming connections are a kind of their own, drawn on the stream chart they run', async () => {
    const server = await startServer(
      ServerConfig.parse({
        log_level: 'silent',
        port: 0,
        management: { enabled: true },
        wyoming: { enabled: true, port: 0 },
      }),
    );
    const state = async (): Promise<any> => (await fetch(`${server.url}/debug/state`)).json();
    const kind = async (k: string): Promise<any> => (await state()).kinds.find((x: any) => x.kind === k);
    const socket = connect(server.wyoming!.port, '127.0.0.1');
    try {
      expect((await (await fetch(`${server.url}/debug/charts`)).json()).map((c: any) => c.id)).toContain('stream');
      await until(async () => (await kind('wyoming')).count === 1, 5000);
      const wyoming = await kind('wyoming');
      expect(wyoming).toMatchObject({ chart: 'stream', count: 1 });
      expect(wyoming.instances[0].id).toMatch(/^socket:\d+$/);
      expect((await kind('stream')).count).toBe(0);
    } finally {
      socket.destroy();
      await server.close();
    }
  });

  it('a kind that appears in a running server gets its chart on the page, and its rows light it', async () => {
    const server = await startServer(
      ServerConfig.parse({ log_level: 'silent', port: 0, management: { enabled: true } }),
    );
    const browser = await chromium.launch({
      executablePath: '/usr/bin/chromium',
      args: ['--headless', '--no-sandbox', '--disable-gpu', '--no-first-run', '--disable-background-networking'],
    });
    try {
      const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
      await page.goto(`${server.url}/debug`);
      await page.waitForSelector('svg[data-chart="model"]', { timeout: 30_000 });
      expect(await page.locator('svg[data-chart="placement"]').count()).toBe(0);
      // The supervisor spawns whatever logic REGISTER carries (a test's fake): here, a placement chart.
      for (const id of ['p1', 'p2'])
        server.supervisor.actor.send({ type: 'REGISTER', id, logic: placement, input: {} } as never);
      const p2 = (server.supervisor.actor.getSnapshot().children as Record<string, any>)['model:p2'];
      p2.send({ type: 'LOCKED' });
      await page.waitForSelector('section[data-kind="placement"] svg[data-chart="placement"]', { timeout: 10_000 });
      expect(await page.locator('section[data-kind="placement"] tr.inst').count()).toBe(2);
      expect(await page.textContent('section[data-kind="placement"] .count')).toBe('2 instances: locking 1, loading 1');
      await page.click('section[data-kind="placement"] tr[data-id="model:p2"]');
      await page.waitForSelector('svg[data-chart="placement"] .state.current[data-state="loading"]');
      p2.send({ type: 'LOADED' });
      await page.waitForSelector('svg[data-chart="placement"] .state.current[data-state="placed"]');
      expect(await page.locator('svg[data-chart]').count()).toBe(6);
    } finally {
      await browser.close();
      await server.close();
    }
  });
});
