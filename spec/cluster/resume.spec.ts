/**
 * The ingress node of a stream dies (issue 20; docs/client.md "Resuming a stream on another
 * node"): real `voxserve serve --cluster` processes A, B, C and one nats-server on loopback; a
 * `VoxClient` given the three URLs streams a recording through A (C holds the model), A is killed
 * with SIGKILL mid-stream, and the stream resumes on B. Expected values come from a single node
 * without a cluster (this process) running the whole recording as a file (checked against
 * spec/fixtures/REFERENCE.jsonl): the events before the gap and after it together (the stream
 * resumes from the last checkpoint A gave, model state included: docs/websocket-api.md).
 */
import type { ChildProcess } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { VoxClient, type StreamEvent, type StreamEventOf } from '../../client/node.js';
import { ServerConfig } from '../../runtime/config.js';
import { spawnServer } from '../../tools/spawn-server.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { expectSegments, fixture, reference, until, WaveFile } from '../helpers.js';
import { startNats, type NatsServer } from './nats-server.js';

const FILE = 'silero_test.wav';
const RATE = 16_000;
/** 100 ms frames of 16 kHz s16le. */
const FRAME = 3200;

const dir = mkdtempSync(join(tmpdir(), 'voxserve-resume-'));
const children: ChildProcess[] = [];

/** `voxserve serve --cluster` as a child process named `name`. */
async function startNode(nats: string, name: string): Promise<{ url: string; child: ChildProcess }> {
  const file = join(dir, `${name}.json`);
  writeFileSync(
    file,
    JSON.stringify({
      port: 0,
      log_level: process.env.CLUSTER_LOG ?? 'warn',
      isolation: 'thread',
      management: { enabled: true },
      cluster: { nats, node: name, heartbeat_ms: 500, job_deadline_ms: 3000 },
    }),
  );
  const { child, url } = await spawnServer(['--config', file]);
  children.push(child);
  if (process.env.CLUSTER_LOG) child.stderr!.on('data', (d) => process.stderr.write(`[${name}] ${d}`));
  return { url, child };
}

type Segment = { start_ms: number; end_ms: number };

/** The segments of a 16 kHz WAV on the single node (`POST /v1/tasks/run`). */
async function fileSegments(url: string, wav: Buffer): Promise<Segment[]> {
  const res = await fetch(`${url}/v1/tasks/run?model=silero-vad`, {
    method: 'POST',
    headers: { 'content-type': 'audio/wav' },
    body: new Uint8Array(wav),
  });
  expect(res.status).toBe(200);
  return ((await res.json()) as { segments: Segment[] }).segments.map((s) => ({
    start_ms: s.start_ms,
    end_ms: s.end_ms,
  }));
}

const ends = (events: StreamEvent[]): Segment[] =>
  events.flatMap((e) => (e.type === 'speech_end' ? [{ start_ms: e.start_ms, end_ms: e.end_ms }] : []));
const starts = (events: StreamEvent[]): number[] => events.flatMap((e) => (e.type === 'speech_start' ? [e.at_ms] : []));

let single: VoxServer;
let nats: NatsServer;
let A: { url: string; child: ChildProcess };
let B: { url: string; child: ChildProcess };
let C: { url: string; child: ChildProcess };
const pcm = Buffer.from((new WaveFile(fixture(FILE)).data as { samples: Uint8Array }).samples);
let whole: Segment[];

beforeAll(async () => {
  single = await startServer(ServerConfig.parse({ log_level: 'silent', port: 0, isolation: 'thread' }));
  whole = await fileSegments(single.url, fixture(FILE));
  // The single node agrees with the independent reference.
  expectSegments(whole, reference(FILE).segments_v6, 40);
  nats = await startNats();
  [A, B, C] = await Promise.all(['A', 'B', 'C'].map((n) => startNode(nats.url, n)));
  const r = await fetch(`${A.url}/v1/models/load`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ id: 'silero-vad', node: 'C' }),
  });
  expect(r.status, await r.text()).toBe(200);
  for (const n of [A, B])
    await until(async () => {
      const body = (await (await fetch(`${n.url}/v1/models`)).json()) as {
        models: { id: string; nodes?: { node: string; state: string }[] }[];
      };
      return body.models.find((m) => m.id === 'silero-vad')?.nodes?.some((x) => x.state === 'ready') ?? false;
    }, 5000);
}, 120_000);

afterAll(async () => {
  await single?.close();
  for (const c of children) if (c.exitCode === null && c.signalCode === null) c.kill('SIGKILL');
  await nats?.stop();
  rmSync(dir, { recursive: true, force: true });
});

describe('the ingress node of a stream dies (SIGKILL)', () => {
  it('the stream resumes on another node: events after the gap on the original clock, the gap reported as what was unconfirmed', async () => {
    const vox = new VoxClient({ urls: [A.url, B.url, C.url], heartbeatMs: 2000 });
    const stream = await vox.stream({ model: 'silero-vad', sampleRate: RATE });
    expect(stream.serverUrl).toBe(A.url);
    const events: StreamEvent[] = [];
    const reading = (async () => {
      for await (const e of stream) events.push(e);
    })();
    const progress = (): number =>
      Math.max(0, ...events.flatMap((e) => (e.type === 'progress' ? [e.processed_ms] : [])));
    const send = async (fromMs: number, toMs: number): Promise<void> => {
      for (let o = fromMs * 32; o < toMs * 32; o += FRAME) await stream.send(pcm.subarray(o, o + FRAME));
    };

    // 20 s, confirmed; then 10 s more at once, and A is killed right away: most of it is unconfirmed.
    await send(0, 20_000);
    await until(() => progress() >= 19_000, 30_000);
    await send(20_000, 30_000);
    const killedAt = performance.now();
    A.child.kill('SIGKILL');
    const sentAtKill = 30_000;
    // The rest once the stream has resumed (a send meanwhile would wait, and be in the gap), then end.
    await until(() => events.some((e) => e.type === 'resumed'), 30_000);
    const resumeMs = performance.now() - killedAt;
    await send(30_000, (pcm.length / 32) | 0);
    const done = await stream.end();
    await reading;

    const resumed = events.filter((e): e is StreamEventOf<'resumed'> => e.type === 'resumed');
    expect(resumed.length).toBe(1);
    const r = resumed[0];
    const at = events.indexOf(r);
    const before = events.slice(0, at);
    const after = events.slice(at + 1);
    expect(r.previous_url).toBe(A.url);
    expect(r.url).toBe(B.url);
    expect(stream.serverUrl).toBe(B.url);

    // The gap is what was sent and not confirmed: from the last progress A sent to what was sent at the kill.
    const confirmed = Math.max(...before.flatMap((e) => (e.type === 'progress' ? [e.processed_ms] : [])));
    expect(confirmed).toBeGreaterThanOrEqual(19_000);
    expect(r.gap).toEqual({ start_ms: confirmed, end_ms: sentAtKill });
    expect(r.gap.end_ms).toBeGreaterThan(r.gap.start_ms);
    // All of it was kept and sent again (30 s buffer): nothing dropped.
    expect(r.resent).toEqual({ start_ms: confirmed, end_ms: sentAtKill });
    expect(r.dropped).toBeNull();
    console.log(
      `resume: gap ${JSON.stringify(r.gap)} (${r.gap.end_ms - r.gap.start_ms} ms unconfirmed at the kill), resumed ${Math.round(resumeMs)} ms after the kill`,
    );

    // Before the gap: A's events, a prefix of the whole recording's (none lost before the confirmed audio).
    const early = ends(before);
    expect(early).toEqual(whole.slice(0, early.length));
    expect(early.length).toBeGreaterThanOrEqual(whole.filter((s) => s.end_ms <= confirmed - 1000).length);
    expect(early.every((s) => s.end_ms <= confirmed)).toBe(true);
    expect(starts(before)).toEqual(whole.slice(0, starts(before).length).map((s) => s.start_ms));

    // After the gap: B went on from A's last checkpoint (Silero's state and the segmenter's), so the segments before
    // and after the gap are the whole recording's, to the millisecond, starts included.
    expect(ends(after).length).toBeGreaterThan(3);
    expect([...early, ...ends(after)]).toEqual(whole);
    expect([...starts(before), ...starts(after)]).toEqual(whole.map((s) => s.start_ms));
    // Progress goes on from the offset, and done is on the same clock.
    const later = after.flatMap((e) => (e.type === 'progress' ? [e.processed_ms] : []));
    expect(later[0]).toBeGreaterThan(confirmed);
    expect(done.processed_ms).toBe(Math.round(pcm.length / 32));
  }, 120_000);
});
