/**
 * Socket actor churn: the cost of creating a stream socket actor, taking it to `ready` and
 * closing it (lease released, actor final), with 10 and with 5,000 other socket actors open.
 * Each socket actor is its own root actor sharing the inspector, so the cost should not grow
 * with the number open (children of one parent would: XState copies the children map on every
 * spawn). In process, on the embedded Silero VAD (one real slot worker), inspection on, so the
 * shared inspector is in the path; no WebSocket (the transport's cost is not the actor's).
 *
 *   npm run build && node dist/tools/bench-sockets.js [--churn 1000]
 */
import { parseArgs } from 'node:util';
import { createInspection } from '../actors/inspection.js';
import { createStreamSocket, type StreamOutput, type StreamSocket } from '../actors/stream.js';
import { Supervisor } from '../actors/supervisor.js';
import { drainOnShutdown } from '../actors/system.js';
import { ServerConfig } from '../runtime/config.js';

const { values } = parseArgs({ options: { churn: { type: 'string', default: '1000' } } });
const CHURN = Number(values.churn);
/** Open counts, in order; 10 again at the end, so JIT warm-up does not favour the later row. */
const OPEN = [10, 5000, 10];

const config = ServerConfig.parse({
  log_level: 'silent',
  debug: { inspect: true },
  limits: { idle_ms: 0, heartbeat_ms: 0 },
});
const inspection = await createInspection(config);
const sup = new Supervisor({ ...config, models: [] }, { inspect: inspection.inspect });
await sup.start();
// Room for every stream: the catalog's Silero VAD with max_streams raised.
await sup.load({ id: 'silero-vad', max_streams: 6000 }, 0);

/** Opens one socket actor and resolves once it is `ready`. */
function open(): Promise<StreamSocket> {
  const { actor } = createStreamSocket(
    { url: '/v1/stream?model=silero-vad', limits: config.limits, registry: sup },
    inspection.inspect,
  );
  return new Promise((resolve, reject) => {
    actor.on('*', (o: StreamOutput) => {
      if (o.type === 'send' && o.event.type === 'ready') resolve(actor);
      else if (o.type === 'send' && o.event.type === 'error') reject(new Error(JSON.stringify(o.event)));
    });
    drainOnShutdown(sup.root, actor);
    actor.start();
  });
}

/** Closes one socket actor as a peer would and resolves once its lease is released. */
function close(actor: StreamSocket): Promise<void> {
  return new Promise((resolve) => {
    actor.on('released', () => resolve());
    actor.send({ type: 'PEER_CLOSED', code: 1000 });
  });
}

const rows: string[] = [];
for (const n of OPEN) {
  const held = await Promise.all(Array.from({ length: n }, open));
  // Warm-up, then the timed churn: one at a time, open to ready to closed.
  for (let i = 0; i < 500; i++) await close(await open());
  const t0 = performance.now();
  const cpu0 = process.cpuUsage();
  for (let i = 0; i < CHURN; i++) await close(await open());
  const wall = (performance.now() - t0) / CHURN;
  const cpu = process.cpuUsage(cpu0);
  rows.push(`${n} | ${(wall * 1000).toFixed(0)} | ${((cpu.user + cpu.system) / CHURN).toFixed(0)}`);
  await Promise.all(held.map(close));
}
console.log(`socket actors: open -> ready -> closed, ${CHURN} one after another, with others open (inspection on)`);
console.log('open | wall µs per socket | CPU µs per socket');
console.log('---|---|---');
for (const r of rows) console.log(r);
const [, many, few] = rows.map((r) => Number(r.split(' | ')[2]));
console.log(`ratio (5,000 open / 10 open after it, CPU): ${(many / few).toFixed(2)}`);
await sup.stop(0);
inspection.stop();
process.exit(0);
