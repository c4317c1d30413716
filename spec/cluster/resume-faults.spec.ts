/**
 * A resumed stream at the edges of a node's failure (issue 41; docs/client.md "Resuming a stream
 * on another node"): real `voxserve serve --cluster` processes A, B, C and one nats-server on
 * loopback, C holding silero-vad. The ingress of a live stream is frozen (SIGSTOP), killed
 * (SIGKILL) right after `end()`, or drained. Expected values come from a single node without a
 * cluster (this process) running the whole recording as a file (agreeing with
 * spec/fixtures/REFERENCE.jsonl): a stream resumed from its last checkpoint (Silero's state and
 * the segmenter's) gives the same segments before and after the gap.
 */
import type { ChildProcess } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { VoxClient, type StreamEvent, type StreamEventOf, type VoxStream } from '../../client/node.js';
import { ServerConfig } from '../../runtime/config.js';
import { spawnServer } from '../../tools/spawn-server.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { expectSegments, fixture, reference, until, WaveFile } from '../helpers.js';
import { startNats, type NatsServer } from './nats-server.js';

const FILE = 'silero_test.wav';
const RATE = 16_000;
/** 100 ms frames of 16 kHz s16le. */
const FRAME = 3200;

const dir = mkdtempSync(join(tmpdir(), 'voxserve-resume-faults-'));
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

let single: VoxServer;
let nats: NatsServer;
let A: { url: string; child: ChildProcess };
let B: { url: string; child: ChildProcess };
let C: { url: string; child: ChildProcess };
const pcm = Buffer.from((new WaveFile(fixture(FILE)).data as { samples: Uint8Array }).samples);
const totalMs = Math.round(pcm.length / 32);
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

/** Reads `stream`'s events into an array; resolves when the stream is over. */
function collect(stream: VoxStream): { events: StreamEvent[]; reading: Promise<void> } {
  const events: StreamEvent[] = [];
  const reading = (async () => {
    for await (const e of stream) events.push(e);
  })();
  return { events, reading };
}

/** The one `resumed` event, and the events before and after it. */
function split(events: StreamEvent[]): { r: StreamEventOf<'resumed'>; before: StreamEvent[]; after: StreamEvent[] } {
  const resumed = events.filter((e): e is StreamEventOf<'resumed'> => e.type === 'resumed');
  expect(resumed.length).toBe(1);
  const at = events.indexOf(resumed[0]);
  return { r: resumed[0], before: events.slice(0, at), after: events.slice(at + 1) };
}

/** A node that sees silero-vad ready on C. */
async function modelSeen(n: { url: string }): Promise<void> {
  await until(async () => {
    const body = (await (await fetch(`${n.url}/v1/models`)).json()) as {
      models: { id: string; nodes?: { node: string; state: string }[] }[];
    };
    return body.models.find((m) => m.id === 'silero-vad')?.nodes?.some((x) => x.state === 'ready') ?? false;
  }, 10_000);
}

describe('a resumed stream at the edges of a node failure', () => {
  it('an ingress frozen with SIGSTOP: noticed by the heartbeat, the look-up of the next node bounded, the stream resumed on B', async () => {
    const vox = new VoxClient({ urls: [A.url, B.url, C.url], heartbeatMs: 2000 });
    const stream = await vox.stream({ model: 'silero-vad', sampleRate: RATE, resume: { timeoutMs: 20_000 } });
    expect(stream.serverUrl).toBe(A.url);
    const { events, reading } = collect(stream);
    const progress = (): number =>
      Math.max(0, ...events.flatMap((e) => (e.type === 'progress' ? [e.processed_ms] : [])));
    const send = async (fromMs: number, toMs: number): Promise<void> => {
      for (let o = fromMs * 32; o < toMs * 32; o += FRAME) await stream.send(pcm.subarray(o, o + FRAME));
    };
    await send(0, 20_000);
    await until(() => progress() >= 19_000, 30_000);
    // 5 s more, then A freezes at once: most of it unconfirmed.
    await send(20_000, 25_000);
    const frozenAt = performance.now();
    A.child.kill('SIGSTOP');
    try {
      // Heartbeat (2-4 s), then A's /ready unanswered: bounded, and A is asked after B anyway.
      await until(() => events.some((e) => e.type === 'resumed'), 30_000);
      const resumeMs = performance.now() - frozenAt;
      await send(25_000, totalMs);
      const done = await stream.end();
      await reading;
      const { r, before, after } = split(events);
      expect(r.previous_url).toBe(A.url);
      expect(r.url).toBe(B.url);
      expect(r.dropped).toBeNull();
      expect(done.processed_ms).toBe(totalMs);
      // Resumed from A's last checkpoint (the audio it confirmed): the segments before the gap and after it are the
      // whole recording's, to the millisecond.
      expect(r.resent.start_ms).toBe(r.gap.start_ms);
      expect([...ends(before), ...ends(after)]).toEqual(whole);
      console.log(`SIGSTOP: resumed on B ${Math.round(resumeMs)} ms after the freeze; gap ${JSON.stringify(r.gap)}`);
    } finally {
      A.child.kill('SIGKILL');
    }
  }, 120_000);

  it('an ingress killed right after end() of a recording sent at full speed: every unconfirmed byte re-sent, events for the whole recording', async () => {
    const vox = new VoxClient({ urls: [B.url, C.url], heartbeatMs: 2000 });
    // A buffer well under the recording: without keeping every unconfirmed byte, the head would be let go.
    const stream = await vox.stream({ model: 'silero-vad', sampleRate: RATE, resume: { bufferMs: 10_000 } });
    expect(stream.serverUrl).toBe(B.url);
    const { events, reading } = collect(stream);
    for (let o = 0; o < pcm.length; o += FRAME) await stream.send(pcm.subarray(o, o + FRAME));
    const ending = stream.end();
    B.child.kill('SIGKILL');
    const done = await ending;
    await reading;
    const { r, before, after } = split(events);
    expect(r.previous_url).toBe(B.url);
    expect(r.url).toBe(C.url);
    // Nothing was let go: all the unconfirmed audio was sent again, up to the end of the recording.
    expect(r.dropped).toBeNull();
    expect(r.resent).toEqual({ start_ms: r.gap.start_ms, end_ms: totalMs });
    expect(done.processed_ms).toBe(totalMs);
    // Before the gap and after it (from B's last checkpoint): the whole recording's segments, to the millisecond.
    const got = [...ends(before), ...ends(after)];
    expect(got).toEqual(whole);
    console.log(`end() then SIGKILL: gap ${JSON.stringify(r.gap)} re-sent whole; ${got.length} segments`);
  }, 120_000);

  it("a draining ingress sent 20050 ms (off the model's window grid) hands the stream over at its last whole window (done at 20032 ms with a checkpoint): after the gap, the continuous run's segments exactly", async () => {
    const D = await startNode(nats.url, 'D');
    await modelSeen(D);
    const vox = new VoxClient({ urls: [D.url, C.url], heartbeatMs: 2000 });
    const stream = await vox.stream({ model: 'silero-vad', sampleRate: RATE });
    expect(stream.serverUrl).toBe(D.url);
    const { events, reading } = collect(stream);
    // 20050 ms: not a whole number of 32 ms windows. D drains (SIGTERM): its done (then 1001) stops at the last whole
    // window with the checkpoint there; the 18 ms after it go to the next node.
    const cut = 20_050 * 32;
    for (let o = 0; o < cut; o += FRAME) await stream.send(pcm.subarray(o, Math.min(o + FRAME, cut)));
    await until(() => events.some((e) => e.type === 'progress' && e.processed_ms >= 19_000), 30_000);
    D.child.kill('SIGTERM');
    await until(() => events.some((e) => e.type === 'resumed'), 30_000);
    for (let o = cut; o < pcm.length; o += FRAME) await stream.send(pcm.subarray(o, o + FRAME));
    const done = await stream.end();
    await reading;
    const { r, before, after } = split(events);
    expect(r.previous_url).toBe(D.url);
    expect(r.url).toBe(C.url);
    expect(r.gap).toEqual({ start_ms: 20_032, end_ms: 20_050 });
    expect(done.processed_ms).toBe(totalMs);
    // From the checkpoint of the last whole window (Silero's state and the segmenter's with it), re-sent from there.
    expect(r.resent.start_ms).toBe(20_032);
    // The continuous run (one node, the whole recording) from the resume on: the same segments, the first included
    // (a segment under way at the gap keeps its start), to the millisecond.
    const continuous = whole.filter((s) => s.end_ms > r.gap.start_ms);
    const resumed = ends(after).filter((s) => s.end_ms > r.gap.start_ms);
    expect(continuous.length).toBeGreaterThan(5);
    expect(resumed).toEqual(continuous);
    expect([...ends(before), ...ends(after)]).toEqual(whole);
    console.log(
      `drained at 20050 ms sent: resent from ${r.resent.start_ms} ms; ${resumed.length} segments after the gap equal the continuous run's`,
    );
  }, 120_000);
});
