/**
 * Connection memory, measured on a `voxserve serve` child process (VmRSS from /proc):
 * RSS per idle WebSocket stream (1,000 open, each past `ready`), and RSS across rounds of 1,000
 * connections opened and dropped at random points (handshake, before ready, mid-stream). The
 * first round raises the heap's high-water mark (V8 and malloc keep freed pages), so the leak
 * check compares the last round with the first: a leak grows every round.
 * The idle figure is given twice: against the RSS before any connection (`cold`: it includes V8's
 * young generation growing to its working size, a fixed cost, spread over the 1,000), and
 * against the RSS after a first round of 1,000 streams opened and closed (`warm`: what each
 * further idle stream costs).
 *
 *   npm run build && node dist/tools/bench-connections.js [--connections 1000]
 */
import { mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import WebSocket from 'ws';
import { defaultCatalog } from '../runtime/config.js';
import { spawnServer } from './spawn-server.js';

const { values } = parseArgs({ options: { connections: { type: 'string', default: '1000' } } });
const N = Number(values.connections);
const dir = mkdtempSync(join(tmpdir(), 'voxserve-conn-'));
const config = join(dir, 'config.json');
const silero = defaultCatalog().find((m) => m.id === 'silero-vad')!;
writeFileSync(
  config,
  JSON.stringify({
    port: 0,
    limits: { max_ws_connections: N + 10, idle_ms: 0 },
    models: [{ ...silero, max_streams: N + 10, lazy: false }],
  }),
);
const { child, url } = await spawnServer(['--config', config]);
const rss = (): number =>
  Number(/VmRSS:\s+(\d+) kB/.exec(readFileSync(`/proc/${child.pid}/status`, 'utf8'))![1]) * 1024;
const settle = (): Promise<void> => new Promise((r) => setTimeout(r, 1000));
const wsUrl = `${url.replace('http', 'ws')}/v1/stream?model=silero-vad`;

// Warm-up: one full stream, so lazily allocated paths exist before the baseline.
await new Promise<void>((resolve) => {
  const ws = new WebSocket(wsUrl);
  ws.on('message', () => {
    ws.send(Buffer.alloc(32000));
    ws.send(JSON.stringify({ type: 'end' }));
  });
  ws.on('close', () => resolve());
});
await settle();
const baseline = rss();

/** Opens `n` streams and resolves once each is past `ready`. */
const openIdle = async (n: number): Promise<WebSocket[]> => {
  const open: WebSocket[] = [];
  await Promise.all(
    Array.from(
      { length: n },
      () =>
        new Promise<void>((resolve) => {
          const ws = new WebSocket(wsUrl);
          ws.once('message', () => resolve());
          ws.on('error', () => resolve());
          open.push(ws);
        }),
    ),
  );
  return open;
};
// Warm: a first round of N streams opened and closed.
for (const ws of await openIdle(N)) ws.terminate();
await settle();
const warmBaseline = rss();

// N idle streams, each past `ready`.
const open = await openIdle(N);
await settle();
const withIdle = rss();
for (const ws of open) ws.terminate();
await settle();

// N connections dropped at random points, three rounds (a leak grows every round).
const rounds: number[] = [];
for (let round = 0; round < 4; round++) {
  await Promise.all(
    Array.from(
      { length: N },
      (_, i) =>
        new Promise<void>((resolve) => {
          const ws = new WebSocket(wsUrl);
          const point = i % 4;
          ws.on('error', () => resolve());
          ws.on('close', () => resolve());
          if (point === 0) setImmediate(() => ws.terminate());
          ws.on('open', () => point === 1 && ws.terminate());
          ws.on('message', () => {
            ws.send(Buffer.alloc(3200));
            if (point === 2) ws.terminate();
            else setTimeout(() => ws.close(), 5);
          });
        }),
    ),
  );
  await settle();
  rounds.push(rss());
}
const after = rounds[rounds.length - 1];
const firstRound = rounds[0];
const status = (await (await fetch(`${url}/v1/models/silero-vad`)).json()) as {
  active_leases: number;
  queued_requests: number;
};
child.kill('SIGTERM');

const KiB = 1024;
const MiB = 1024 * 1024;
console.log(`baseline RSS (model loaded, no connections)   ${(baseline / MiB).toFixed(1)} MiB`);
console.log(`RSS after ${N} streams opened and closed     ${(warmBaseline / MiB).toFixed(1)} MiB (warm baseline)`);
console.log(
  `RSS with ${N} idle streams                    ${(withIdle / MiB).toFixed(1)} MiB -> ${((withIdle - warmBaseline) / N / KiB).toFixed(1)} KiB per idle stream warm (target < 50), ${((withIdle - baseline) / N / KiB).toFixed(1)} KiB cold`,
);
console.log(`RSS after each round of ${N} drops, MiB: ${rounds.map((r) => (r / MiB).toFixed(1)).join(', ')}`);
console.log(
  `first round vs no connections: ${(firstRound / baseline).toFixed(3)} (heap high-water); last round vs first: ${(after / firstRound).toFixed(3)} (target <= 1.10)`,
);
console.log(`leases held afterwards: ${status.active_leases}, queued: ${status.queued_requests}`);
