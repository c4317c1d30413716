/**
 * Ad hoc wake-word groups leave nothing behind once unloaded (issue 44, item 7): the group leaves
 * the registry as it unloads (not only when the next group registers), and every metric series
 * labelled with its id goes with it, so groups made on demand do not pile up series or memory.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { VoxServer } from '../../transport/server.js';
import { fixture, startTestServer, until } from '../helpers.js';

let server: VoxServer;
beforeAll(async () => {
  server = await startTestServer({ management: { enabled: true } });
  await until(async () => (await fetch(`${server.url}/ready`)).status === 200, 10_000);
});
afterAll(() => server?.close());

/** The /metrics lines of series labelled `model="<id>"`. */
async function seriesOf(id: string): Promise<string[]> {
  const text = await (await fetch(`${server.url}/metrics`)).text();
  return text.split('\n').filter((l) => !l.startsWith('#') && l.includes(`model="${id}"`));
}

describe('an ad hoc group unloaded', () => {
  it('leaves the registry and /metrics at once, and a request for it registers it afresh', async () => {
    const group = 'alexa,hey-jarvis';
    const r = await fetch(`${server.url}/v1/tasks/run?model=${group}`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: new Uint8Array(fixture('espeak_alexa_16k.wav')),
    });
    expect(r.status).toBe(200);
    const during = await seriesOf(group);
    expect(during.length).toBeGreaterThan(10); // requests, inference, queue wait, loads, batch size, gauges...
    const un = await fetch(`${server.url}/v1/models/unload`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ id: group }),
    });
    expect(un.status).toBe(200);
    await until(async () => (await fetch(`${server.url}/v1/models/${encodeURIComponent(group)}`)).status === 404, 2000);
    expect(await seriesOf(group)).toEqual([]);
    const { models } = (await (await fetch(`${server.url}/v1/models`)).json()) as { models: { id: string }[] };
    expect(models.map((m) => m.id)).not.toContain(group);
    // A request for it again registers it afresh.
    const again = await fetch(`${server.url}/v1/tasks/run?model=${group}`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: new Uint8Array(fixture('espeak_alexa_16k.wav')),
    });
    expect(again.status).toBe(200);
  });
});
