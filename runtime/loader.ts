import { readFile, stat } from 'node:fs/promises';
import { headsOf, modelFiles, type ModelConfig } from './config.js';
import { OWW_EMBEDDING, OWW_MELSPECTROGRAM } from './catalog.js';
import { SlotPool, slotFactory, type SlotFactory } from './slots.js';
import type { LoadSpec } from './slot-protocol.js';
import type { Batcher } from './batcher.js';

/** A model's loaded slots plus what they hold. `close()` stops clones, the primary, then drops shared weights. */
export interface LoadedModel {
  pool: SlotPool;
  /** With `max_batch_size` > 1: batches stream jobs across streams (set by the model entry). */
  batcher?: Batcher;
  /** Measured footprint: process RSS growth over the load, bytes (set by the supervisor). */
  residentBytes: number;
  close(): Promise<void>;
}

/**
 * Turns a committed model config into running slots. An aborted `signal` (the load timed out, or
 * its model entry stopped) abandons the load: process hosts still loading are killed.
 */
export type ModelLoader = (config: ModelConfig, signal?: AbortSignal) => Promise<LoadedModel>;

/**
 * Checks that `path` is a regular file before anything opens it: a FIFO or a device would block
 * the reader (a thread of libuv's pool, or a slot host) forever.
 * @throws Error `cannot read model file <path>: <code>` (ENOENT, EACCES...) or `... is not a regular file`.
 */
async function regularFile(path: string): Promise<void> {
  let isFile: boolean;
  try {
    isFile = (await stat(path)).isFile();
  } catch (e) {
    throw new Error(`cannot read model file ${path}: ${(e as NodeJS.ErrnoException).code ?? (e as Error).message}`);
  }
  if (!isFile) throw new Error(`cannot read model file ${path}: it is not a regular file`);
}

async function readModelFile(path: string): Promise<Uint8Array> {
  await regularFile(path);
  let bytes: Buffer;
  try {
    bytes = await readFile(path);
  } catch (e) {
    throw new Error(`cannot read model file ${path}: ${(e as NodeJS.ErrnoException).code ?? (e as Error).message}`);
  }
  // A SharedArrayBuffer: every slot worker reads the same bytes, no copy per message.
  const shared = new Uint8Array(new SharedArrayBuffer(bytes.length));
  shared.set(bytes);
  return shared;
}

interface Bundle {
  melspectrogram: Uint8Array;
  embedding: Uint8Array;
  refs: number;
}

/**
 * The openWakeWord feature models (melspectrogram + embedding) as one shared, immutable weight
 * bundle: read once, reference-counted by the wake-word models using it, dropped after the last.
 */
export class WeightBundles {
  private readonly bundles = new Map<string, Promise<Bundle>>();

  /** Takes a reference; the returned function gives it back (idempotent). */
  async acquire(melPath: string, embPath: string): Promise<{ bundle: Bundle; release: () => void }> {
    const key = `${melPath}\n${embPath}`;
    let p = this.bundles.get(key);
    if (!p) {
      p = Promise.all([readModelFile(melPath), readModelFile(embPath)]).then(([melspectrogram, embedding]) => ({
        melspectrogram,
        embedding,
        refs: 0,
      }));
      this.bundles.set(key, p);
      p.catch(() => this.bundles.delete(key));
    }
    const bundle = await p;
    bundle.refs++;
    let done = false;
    return {
      bundle,
      release: () => {
        if (done) return;
        done = true;
        if (--bundle.refs === 0) this.bundles.delete(key);
      },
    };
  }

  /** Bundles currently held. */
  get size(): number {
    return this.bundles.size;
  }
}

/** Where slot hosts run and how long a job and a load may take, server-wide (a model's own `isolation`, `job_timeout_ms` and `load_timeout_ms` win). */
export interface SlotDefaults {
  isolation: 'process' | 'thread';
  /** ms; 0 = none. */
  jobTimeoutMs: number;
  /** ms; 0 = none. Bounds each slot's respawn (the model entry's chart bounds the whole load). */
  loadTimeoutMs: number;
}

/**
 * The loader used by the server: reads the files, starts `config.slots` slot hosts, child
 * processes or worker threads as the model's (else the server's) `isolation` says.
 * @param factory a fixed slot factory instead (tests).
 */
export function createLoader(
  bundles: WeightBundles,
  defaults: SlotDefaults = { isolation: 'process', jobTimeoutMs: 30_000, loadTimeoutMs: 60_000 },
  factory?: SlotFactory,
): ModelLoader {
  return async (config, signal) => {
    for (const file of modelFiles(config)) await regularFile(file);
    let spec: LoadSpec;
    let release = (): void => {};
    if (config.task === 'wakeword') {
      const b = await bundles.acquire(
        config.melspectrogram_path ?? OWW_MELSPECTROGRAM,
        config.embedding_path ?? OWW_EMBEDDING,
      );
      release = b.release;
      spec = {
        kind: 'wakeword',
        heads: headsOf(config).map((h) => h.path),
        melspectrogram: b.bundle.melspectrogram,
        embedding: b.bundle.embedding,
      };
    } else {
      spec = { kind: 'vad', model: config.path! };
    }
    try {
      const hosts =
        factory ?? slotFactory(config.isolation ?? defaults.isolation, config.job_timeout_ms ?? defaults.jobTimeoutMs);
      const pool = await SlotPool.start(spec, config.slots, hosts, {
        signal,
        loadTimeoutMs: config.load_timeout_ms ?? defaults.loadTimeoutMs,
      });
      return {
        pool,
        residentBytes: 0,
        close: async () => {
          await pool.close();
          release();
        },
      };
    } catch (e) {
      release();
      throw e;
    }
  };
}
