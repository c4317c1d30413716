/**
 * Load -> infer -> unload loop of a synthetic model, measuring the RSS of this process and its
 * slot-host children after each unload: a leak shows as RSS growing across cycles. Baseline:
 * RSS after the first cycle. Each isolation mode runs on a fresh server, one after the other.
 *
 *   npm run build && node --expose-gc dist/tools/bench-residency.js [--cycles 50] [--size-mib 200] [--isolation
 * thread,process]
 */
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { parseArgs } from 'node:util';
import { ServerConfig } from '../runtime/config.js';
import { startServer } from '../transport/server.js';
import { treeRssBytes } from './proc.js';
import { syntheticModel } from './synth-model.js';

const { values } = parseArgs({
  options: {
    cycles: { type: 'string', default: '50' },
    'size-mib': { type: 'string', default: '200' },
    isolation: { type: 'string', default: 'thread,process' },
  },
});
const cycles = Number(values.cycles);
const sizeMiB = Number(values['size-mib']);
const dir = mkdtempSync(join(tmpdir(), 'voxserve-bench-'));
const path = join(dir, 'model.onnx');
writeFileSync(path, syntheticModel(sizeMiB, 1));

const wav = Buffer.alloc(44 + 3200);
wav.write('RIFF', 0);
wav.writeUInt32LE(36 + 3200, 4);
wav.write('WAVEfmt ', 8);
wav.writeUInt32LE(16, 16);
wav.writeUInt16LE(1, 20);
wav.writeUInt16LE(1, 22);
wav.writeUInt32LE(16000, 24);
wav.writeUInt32LE(32000, 28);
wav.writeUInt16LE(2, 32);
wav.writeUInt16LE(16, 34);
wav.write('data', 36);
wav.writeUInt32LE(3200, 40);

const MiB = 1024 * 1024;
/**
 * With `node --expose-gc`, a full GC first: what is measured is then memory still held, not garbage not yet collected.
 */
const rssNow = (): number => {
  (globalThis as { gc?: () => void }).gc?.();
  return treeRssBytes(process.pid);
};
for (const isolation of values.isolation.split(',') as ('process' | 'thread')[]) {
  const server = await startServer(
    ServerConfig.parse({
      port: 0,
      log_level: 'silent',
      management: { enabled: true },
      isolation,
      models_root: dirname(path),
    }),
  );
  const post = async (route: string, body: unknown): Promise<void> => {
    const res = await fetch(`${server.url}${route}`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify(body),
    });
    if (!res.ok) throw new Error(`${route}: ${res.status} ${await res.text()}`);
  };
  const rss: number[] = [];
  let loadedRss = 0;
  for (let i = 0; i < cycles; i++) {
    await post('/v1/models/load', { id: 'synthetic', task: 'vad', path });
    const r = await fetch(`${server.url}/v1/tasks/run?model=synthetic`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: new Uint8Array(wav),
    });
    if (!r.ok) throw new Error(`run: ${r.status}`);
    if (i === 0) loadedRss = rssNow();
    await post('/v1/models/unload', { id: 'synthetic' });
    rss.push(rssNow());
  }
  await server.close();
  const first = rss[0];
  const last = rss[rss.length - 1];
  console.log(
    `isolation ${isolation}: synthetic model ${sizeMiB} MiB, ${cycles} load/infer/unload cycles (RSS of the server and its slot-host processes)`,
  );
  console.log(`RSS while loaded (cycle 1)     ${(loadedRss / MiB).toFixed(0)} MiB`);
  console.log(`RSS after unload, cycle 1      ${(first / MiB).toFixed(0)} MiB (baseline)`);
  console.log(`RSS after unload, cycle ${cycles}     ${(last / MiB).toFixed(0)} MiB`);
  console.log(`max RSS after unload           ${(Math.max(...rss) / MiB).toFixed(0)} MiB`);
  console.log(`RSS after each unload, MiB    ${rss.map((x) => Math.round(x / MiB)).join(' ')}`);
  console.log(`ratio last / baseline          ${(last / first).toFixed(3)} (target <= 1.05)`);
}
rmSync(dir, { recursive: true, force: true });
