import { closeSync, openSync, readSync, statSync } from 'node:fs';
import { readFile } from 'node:fs/promises';
import { headsOf, modelFiles, type ModelConfig } from './config.js';
import { OWW_EMBEDDING, OWW_MELSPECTROGRAM } from './catalog.js';
import { looksLikeOnnx } from './onnx-file.js';
import { SlotPool, slotFactory, type ModelPool, type SlotFactory } from './slots/slots.js';
import { WakewordFamilies } from './wakeword/wakeword-family.js';
import type { LoadSpec } from './slots/slot-protocol.js';
import type { Batcher } from './batcher.js';

/** A model's loaded slots plus what they hold. `close()` stops clones, the primary, then drops shared weights. */
export interface LoadedModel {
  pool: ModelPool;
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

export { looksLikeOnnx } from './onnx-file.js';

/**
 * Checks a model file before anything loads it: it exists, is a regular file (a FIFO or a device
 * would block the reader, a thread of libuv's pool or a slot host, forever; it is not opened) and
 * starts like an ONNX model ({@link looksLikeOnnx}). Synchronous (a stat and a read of 16 bytes),
 * so the server's start can check every configured model before it accepts work.
 * @param path an absolute path (the message shows it as given).
 * @throws Error `cannot read model file <path>: it does not exist` (or the errno code: EACCES...),
 *   `... it is not a regular file`, or `model file <path> is not an ONNX model (...)`.
 */
export function checkModelFile(path: string): void {
  let isFile: boolean;
  try {
    isFile = statSync(path).isFile();
  } catch (e) {
    const code = (e as NodeJS.ErrnoException).code;
    throw new Error(
      `cannot read model file ${path}: ${code === 'ENOENT' ? 'it does not exist' : (code ?? (e as Error).message)}`,
    );
  }
  if (!isFile) throw new Error(`cannot read model file ${path}: it is not a regular file`);
  const head = new Uint8Array(16);
  let n = 0;
  try {
    const fd = openSync(path, 'r');
    try {
      n = readSync(fd, head, 0, head.length, 0);
    } finally {
      closeSync(fd);
    }
  } catch (e) {
    throw new Error(`cannot read model file ${path}: ${(e as NodeJS.ErrnoException).code ?? (e as Error).message}`);
  }
  if (!looksLikeOnnx(head.subarray(0, n)))
    throw new Error(
      `model file ${path} is not an ONNX model (${n === 0 ? 'it is empty' : 'its first bytes are not an ONNX ModelProto'})`,
    );
}

/**
 * Every file a model needs (its file or its heads' files, and the wake-word feature models it
 * names), checked as {@link checkModelFile} does.
 * @returns the first problem's message, or null when every file looks loadable.
 */
export function modelFileProblem(config: ModelConfig): string | null {
  // A denoise model's file is the RNNoise WASM build the package ships, not ONNX (see config.ts).
  const files = config.task === 'denoise' ? [] : [...modelFiles(config)];
  if (config.task === 'wakeword')
    files.push(config.melspectrogram_path ?? OWW_MELSPECTROGRAM, config.embedding_path ?? OWW_EMBEDDING);
  for (const file of files) {
    try {
      checkModelFile(file);
    } catch (e) {
      return (e as Error).message;
    }
  }
  return null;
}

async function readModelFile(path: string): Promise<Uint8Array> {
  checkModelFile(path);
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

/**
 * Where slot hosts run and how long a job and a load may take, server-wide (a model's own `isolation`, `job_timeout_ms`
 * and `load_timeout_ms` win).
 */
export interface SlotDefaults {
  isolation: 'process' | 'thread';
  /** ms; 0 = none. */
  jobTimeoutMs: number;
  /** ms; 0 = none. Bounds each slot's respawn (the model entry's chart bounds the whole load). */
  loadTimeoutMs: number;
}

/**
 * The loader used by the server: reads the files, starts `config.slots` slot hosts, child
 * processes or worker threads as the model's (else the server's) `isolation` says. Wake-word
 * models share their slot hosts: every one with the same feature models, `slots`, isolation and
 * timeouts is a view of one family that holds the features once and loads heads as they are used
 * (runtime/wakeword/wakeword-family.ts).
 * @param factory a fixed slot factory instead (tests).
 */
export function createLoader(
  bundles: WeightBundles,
  defaults: SlotDefaults = { isolation: 'process', jobTimeoutMs: 30_000, loadTimeoutMs: 60_000 },
  factory?: SlotFactory,
): ModelLoader {
  const families = new WakewordFamilies();
  return async (config, signal) => {
    if (config.task !== 'denoise') for (const file of modelFiles(config)) checkModelFile(file);
    const isolation = config.isolation ?? defaults.isolation;
    const jobTimeoutMs = config.job_timeout_ms ?? defaults.jobTimeoutMs;
    const loadTimeoutMs = config.load_timeout_ms ?? defaults.loadTimeoutMs;
    const hosts = factory ?? slotFactory(isolation, jobTimeoutMs);
    if (config.task === 'wakeword') {
      const melPath = config.melspectrogram_path ?? OWW_MELSPECTROGRAM;
      const embPath = config.embedding_path ?? OWW_EMBEDDING;
      const b = await bundles.acquire(melPath, embPath);
      try {
        const key = JSON.stringify([melPath, embPath, config.slots, isolation, jobTimeoutMs, loadTimeoutMs]);
        const spec: LoadSpec = {
          kind: 'wakeword',
          heads: [],
          melspectrogram: b.bundle.melspectrogram,
          embedding: b.bundle.embedding,
        };
        const heads = headsOf(config).map((h) => h.path);
        const pool = await families.acquire(key, spec, config.slots, hosts, heads, { signal, loadTimeoutMs });
        return {
          pool,
          residentBytes: 0,
          close: async () => {
            await pool.close();
            b.release();
          },
        };
      } catch (e) {
        b.release();
        throw e;
      }
    }
    const spec: LoadSpec = { kind: config.task, model: config.path };
    const pool = await SlotPool.start(spec, config.slots, hosts, { signal, loadTimeoutMs });
    return { pool, residentBytes: 0, close: () => pool.close() };
  };
}
