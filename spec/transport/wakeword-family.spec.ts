/**
 * Wake words share their features (issue 22): every wake-word model runs on one family of slot
 * hosts that holds the melspectrogram and embedding models once and loads heads as streams use
 * them. 20 different head combinations streaming at once use the slot host that one combination
 * uses, and its memory stays within 1.2x of what one combination takes; each stream still gets
 * its own heads' detections.
 */
import { readdirSync, readFileSync } from 'node:fs';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import WebSocket from 'ws';
import { ServerConfig } from '../../runtime/config.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { fixture, until, WaveFile } from '../helpers.js';

let server: VoxServer;
beforeAll(async () => {
  // No bound on ad hoc groups: this test holds 21 at once.
  server = await startServer(ServerConfig.parse({ log_level: 'silent', port: 0, max_ad_hoc_groups: 0 }));
});
afterAll(async () => {
  await server?.close();
});

/** This process's child processes (the slot hosts: the server runs in this process). */
function children(): number[] {
  const out: number[] = [];
  for (const d of readdirSync('/proc')) {
    if (!/^\d+$/.test(d)) continue;
    try {
      const ppid = /PPid:\s+(\d+)/.exec(readFileSync(`/proc/${d}/status`, 'utf8'))?.[1];
      if (Number(ppid) === process.pid) out.push(Number(d));
    } catch {
      // Gone meanwhile.
    }
  }
  return out;
}

/**
 * Resident memory of the slot hosts together, bytes. RSS, not PSS: PSS splits the pages of
 * onnxruntime's library with every other process mapping it (other test runs on the machine).
 */
function slotHostRss(): number {
  return children().reduce((n, pid) => {
    try {
      return n + Number(/VmRSS:\s+(\d+) kB/.exec(readFileSync(`/proc/${pid}/status`, 'utf8'))?.[1] ?? 0) * 1024;
    } catch {
      return n;
    }
  }, 0);
}

const HEADS = ['alexa', 'hey-jarvis', 'hey-mycroft', 'hey-rhasspy', 'timer', 'weather'];
/** 20 different combinations of the six heads: every pair (15), then five triples. */
const COMBOS: string[][] = [
  ...HEADS.flatMap((a, i) => HEADS.slice(i + 1).map((b) => [a, b])),
  ['alexa', 'hey-jarvis', 'timer'],
  ['alexa', 'hey-mycroft', 'weather'],
  ['hey-jarvis', 'hey-rhasspy', 'timer'],
  ['hey-mycroft', 'timer', 'weather'],
  ['alexa', 'hey-rhasspy', 'weather'],
];

/** 16 kHz s16le PCM of a fixture. */
const pcmOf = (file: string): Buffer => {
  const s = new WaveFile(fixture(file)).getSamples(false, Int16Array) as unknown as Int16Array;
  return Buffer.from(s.buffer, s.byteOffset, s.byteLength);
};

interface Open {
  ws: WebSocket;
  events: { type: string; label?: string; processed_ms?: number }[];
  closed: Promise<number>;
}

/** The ms of `pcm` (16 kHz s16le) the model has run on once every frame is processed: whole 80 ms steps. */
const stepsMs = (pcm: Buffer): number => Math.floor(pcm.length / 2 / 16 / 80) * 80;

/** True once the stream's last `progress` says every whole 80 ms step of `pcm` has been run on. */
const allProcessed = (s: Open, pcm: Buffer): boolean =>
  s.events.some((e) => e.type === 'progress' && (e.processed_ms ?? 0) >= stepsMs(pcm));

/**
 * The slot hosts' RSS once settled, bytes: after 3 s without a job (a host collects its garbage and trims malloc after
 * 2 s), the median of 5 reads 100 ms apart. Read while the last jobs' garbage was still there, the ratio ranged
 * 1.09-1.20 on one build.
 */
async function settledRss(): Promise<number> {
  await new Promise((r) => setTimeout(r, 3000));
  const reads: number[] = [];
  for (let i = 0; i < 5; i++) {
    reads.push(slotHostRss());
    await new Promise((r) => setTimeout(r, 100));
  }
  return reads.sort((a, b) => a - b)[2];
}

/**
 * Opens a stream on `model` and sends `pcm` in 100 ms frames (not ended); resolves once every frame has been processed
 * far enough to give a result.
 */
async function openStream(model: string, pcm: Buffer): Promise<Open> {
  const ws = new WebSocket(
    `${server.url.replace('http', 'ws')}/v1/stream?model=${model}&sample_rate=16000&progress=true`,
  );
  const events: Open['events'] = [];
  ws.on('error', () => {});
  const closed = new Promise<number>((resolve) => ws.on('close', (code) => resolve(code)));
  await new Promise<void>((resolve, reject) => {
    ws.on('message', (d: Buffer) => {
      const e = JSON.parse(d.toString()) as Open['events'][number];
      events.push(e);
      if (e.type === 'ready') resolve();
      if (e.type === 'error') reject(new Error(d.toString()));
    });
  });
  for (let o = 0; o < pcm.length; o += 3200) ws.send(pcm.subarray(o, o + 3200));
  return { ws, events, closed };
}

describe('wake-word models share one family of slot hosts', () => {
  it('20 different head combinations streaming at once: the slot host of one combination, within 1.2x of its memory (both read after the host collected, idle 2 s)', async () => {
    const alexa = pcmOf('espeak_alexa_16k.wav');
    expect(children()).toEqual([]);
    const one = await openStream('alexa,hey-jarvis', alexa);
    // Both reads are taken in the same state: every frame sent has been run on, the streams still open.
    await until(() => one.events.some((e) => e.type === 'detection') && allProcessed(one, alexa), 30_000);
    const hostsOfOne = children();
    expect(hostsOfOne).toHaveLength(1);
    const rssOne = await settledRss();

    const many = await Promise.all(COMBOS.map((c) => openStream(c.join(','), alexa)));
    // Every stream's audio processed: the combinations with alexa detect it, the others never do.
    await until(
      () =>
        many.every(
          (s, i) =>
            allProcessed(s, alexa) && (!COMBOS[i].includes('alexa') || s.events.some((e) => e.type === 'detection')),
        ),
      60_000,
    );
    const models = (
      (await (await fetch(`${server.url}/v1/models`)).json()) as { models: { id: string; loaded: boolean }[] }
    ).models;
    for (const c of COMBOS)
      expect(models.find((m) => m.id === [...c].sort().join(','))?.loaded, c.join(',')).toBe(true);
    expect(children()).toEqual(hostsOfOne);
    const rssAtOnce = slotHostRss();
    const rssMany = await settledRss();
    // The host collected once idle: without that the read does not move at all (3 runs: 112-117 MiB both times; with it
    // 108-117 -> 103-107).
    expect(rssMany, 'a slot host idle for 2 s gives its garbage back').toBeLessThan(rssAtOnce);
    console.log(
      `slot hosts: one combination ${(rssOne / 2 ** 20).toFixed(1)} MiB RSS, 21 at once ${(rssMany / 2 ** 20).toFixed(1)} MiB (${(rssMany / rssOne).toFixed(2)}x; ${(rssAtOnce / 2 ** 20).toFixed(1)} before the host's idle collection)`,
    );
    expect(rssMany / rssOne).toBeLessThanOrEqual(1.2);
    for (const [i, s] of many.entries()) {
      const labels = new Set(s.events.filter((e) => e.type === 'detection').map((e) => e.label));
      expect([...labels], COMBOS[i].join(',')).toEqual(COMBOS[i].includes('alexa') ? ['alexa'] : []);
    }
    for (const s of [one, ...many]) s.ws.send(JSON.stringify({ type: 'end' }));
    expect(await Promise.all([one, ...many].map((s) => s.closed))).toEqual(new Array(21).fill(1000));
  }, 120_000);
});
