/**
 * Issue 43 (c): why does my wake word not fire? The option `scores` gives each 80 ms step's score
 * per label: `score` events on a stream (`scores=true`, the client's `scores: true`, `voxserve
 * stream --scores`) and `scores` in the file route's JSON, the same values both ways.
 */
import { execFile } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { VoxClient, type StreamEvent } from '../../client/node.js';
import type { VoxServer } from '../../transport/server.js';
import { fixture, fixturePath, startTestServer } from '../helpers.js';

const exec = promisify(execFile);
const cli = fileURLToPath(new URL('../../dist/tools/cli.js', import.meta.url));
let server: VoxServer;
beforeAll(async () => {
  server = await startTestServer();
});
afterAll(async () => {
  await server?.close();
});

async function streamEvents(model: string, file: string, scores: boolean): Promise<StreamEvent[]> {
  const stream = await new VoxClient({ url: server.url }).stream({ model, scores });
  const sent = stream.sendFile(fixture(file)).then(() => stream.end());
  const events: StreamEvent[] = [];
  for await (const e of stream) events.push(e);
  await sent;
  return events;
}

describe('wake-word scores (issue 43)', () => {
  it('a stream with scores: a score per 80 ms step and label, the detection after its step; the file route has the same', async () => {
    const events = await streamEvents('alexa,hey-jarvis', 'espeak_hey_jarvis_22k.wav', true);
    const scores = events.filter((e) => e.type === 'score');
    expect(scores.length).toBeGreaterThan(20);
    for (const [i, s] of scores.entries()) {
      expect(Object.keys(s.scores).sort()).toEqual(['alexa', 'hey-jarvis']);
      if (i) expect(s.at_ms - scores[i - 1].at_ms).toBe(80);
    }
    const detection = events.find((e) => e.type === 'detection')!;
    expect(detection).toMatchObject({ label: 'hey-jarvis' });
    const before = events[events.indexOf(detection) - 1];
    expect(before).toEqual({ type: 'score', at_ms: detection.at_ms, scores: expect.any(Object) });
    expect((before as { scores: Record<string, number> }).scores['hey-jarvis']).toBe(detection.score);

    const res = await fetch(`${server.url}/v1/tasks/run?model=alexa,hey-jarvis&scores=true`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: new Uint8Array(fixture('espeak_hey_jarvis_22k.wav')),
    });
    const body = (await res.json()) as { scores: { at_ms: number; scores: Record<string, number> }[] };
    expect(res.status).toBe(200);
    expect(body.scores).toEqual(scores.map(({ at_ms, scores }) => ({ at_ms, scores })));
  }, 60_000);

  it('without scores: no score events, no scores in the result', async () => {
    const events = await streamEvents('hey-jarvis', 'espeak_hey_jarvis_22k.wav', false);
    expect(events.some((e) => e.type === 'score')).toBe(false);
    const res = await fetch(`${server.url}/v1/tasks/run?model=hey-jarvis`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: new Uint8Array(fixture('espeak_hey_jarvis_22k.wav')),
    });
    expect(Object.keys(await res.json())).toEqual(['model', 'task', 'detections', 'timing']);
  }, 60_000);

  it('voxserve stream --scores prints them', async () => {
    const { stdout } = await exec(process.execPath, [
      cli,
      'stream',
      'hey-jarvis',
      fixturePath('espeak_hey_jarvis_22k.wav'),
      '--scores',
      '--url',
      server.url,
    ]);
    const lines = stdout
      .trim()
      .split('\n')
      .map((l) => JSON.parse(l));
    expect(lines.filter((e) => e.type === 'score').length).toBeGreaterThan(20);
    expect(lines.find((e) => e.type === 'score')).toEqual({ type: 'score', at_ms: 480, scores: { 'hey-jarvis': 0 } });
  }, 60_000);
});
