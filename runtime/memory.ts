import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { freemem } from 'node:os';
import { setFlagsFromString } from 'node:v8';
import { runInNewContext } from 'node:vm';
import type { ModelConfig } from './config.js';

const MiB = 1024 * 1024;

/** Returns the memory available to this process now, bytes. */
export type MemoryProbe = () => number;

function readNumber(path: string): number | null {
  try {
    const text = readFileSync(path, 'utf8').trim();
    const n = Number(text);
    return Number.isFinite(n) ? n : null; // cgroup "max" (no limit) is not a number
  } catch {
    return null;
  }
}

/**
 * Actually available memory, bytes: the lower of the cgroup v2 limit minus usage
 * (`/sys/fs/cgroup/memory.max` - `memory.current`) and `/proc/meminfo` MemAvailable.
 * Where neither exists (no cgroup v2 limit, no /proc), falls back to `os.freemem()`, which
 * on Linux is MemFree (lower than MemAvailable: it ignores reclaimable page cache, so the
 * guard errs on the side of refusing).
 */
export const availableMemory: MemoryProbe = () => {
  const candidates: number[] = [];
  const max = readNumber('/sys/fs/cgroup/memory.max');
  const current = readNumber('/sys/fs/cgroup/memory.current');
  if (max !== null && current !== null) candidates.push(Math.max(0, max - current));
  try {
    const m = /^MemAvailable:\s+(\d+) kB/m.exec(readFileSync('/proc/meminfo', 'utf8'));
    if (m) candidates.push(Number(m[1]) * 1024);
  } catch {
    // no /proc
  }
  return candidates.length ? Math.min(...candidates) : freemem();
};

/** Per-slot overhead of a worker thread with onnxruntime loaded, bytes (measured here: ~35 MiB). */
export const SLOT_OVERHEAD_BYTES = 32 * MiB;
/** Weights in memory per byte of model file (onnxruntime's copy plus allocator slack). */
export const FILE_FACTOR = 1.5;

/**
 * Footprint estimate of a model not loaded before, bytes: per slot, {@link SLOT_OVERHEAD_BYTES}
 * plus {@link FILE_FACTOR} x the model's file bytes (`fileBytes`: the model plus, for wake
 * words, the feature models). Once a model has loaded, its measured footprint replaces this.
 */
export function estimateFootprint(config: Pick<ModelConfig, 'slots'>, fileBytes: number): number {
  return config.slots * (SLOT_OVERHEAD_BYTES + FILE_FACTOR * fileBytes);
}

/** Bytes as whole MiB, for messages. */
export const mib = (bytes: number): string => `${Math.round(bytes / MiB)} MiB`;

/**
 * V8's full garbage collection, reached without `--expose-gc` on the command line (the flag set at run time, read from
 * a new context).
 */
let gcFn: (() => void) | null = null;

/**
 * Runs one full garbage collection now (blocks for its duration: ~10-50 ms for the server's
 * heap). V8 collects when JavaScript allocates; an idle server allocates nothing, so the
 * off-heap buffers its streams left behind (audio frames, results: hundreds of MiB after an
 * hour of wake-word streams) stayed in RSS until the next burst of work (issue 25 item 14).
 * Chrome runs such collections in idle time; Node has no idle notification, so the server calls
 * this once it has been idle a while ({@link IdleCollector}).
 */
export function collectGarbage(): void {
  if (!gcFn) {
    setFlagsFromString('--expose-gc');
    gcFn = runInNewContext('gc') as () => void;
  }
  gcFn();
}

/** glibc's `malloc_trim`, bound once (null: not glibc, or koffi's binary missing; undefined: not tried yet). */
let mallocTrim: ((pad: number) => number) | null | undefined;

/**
 * Gives the memory malloc holds free back to the system: glibc's `malloc_trim(0)`, which since
 * glibc 2.8 releases the free pages inside every arena, not only its top (man 3 malloc_trim). The
 * server's main process needs it once idle: glibc raises its mmap threshold to the size of the
 * largest block freed (up to 32 MiB), so the medium buffers of streams, jobs and head files come
 * from the main arena, and the pages they leave free stayed resident (23-42 MiB after wake-word
 * churn, issue 44 item 6; docs/operations.md). Called through koffi (an FFI: JavaScript cannot
 * reach libc). Blocks by what it gives back: 0.15 ms on a fresh process, 4-5 ms for 55 MiB; the
 * first call also loads koffi (~10 ms).
 * @returns true if malloc was trimmed; false where there is no glibc (macOS, musl) or no FFI
 */
export function trimFreedMemory(): boolean {
  if (mallocTrim === undefined) {
    mallocTrim = null;
    try {
      if (process.platform === 'linux') {
        const koffi = createRequire(import.meta.url)('koffi') as typeof import('koffi')['default'];
        mallocTrim = koffi.load('libc.so.6').func('int malloc_trim(size_t pad)') as (pad: number) => number;
      }
    } catch {
      // no glibc (musl), or koffi has no binary for this platform: the memory stays with malloc
    }
  }
  if (!mallocTrim) return false;
  mallocTrim(0);
  return true;
}

/**
 * Collects garbage, then gives malloc's free pages back ({@link trimFreedMemory}), once after each
 * spell of work, when the server has been idle for `idleMs`:
 * `busy()` says whether work is in flight (requests, streams; checked every `idleMs` / 5);
 * `touch()` marks work too short to be seen that way.
 */
export class IdleCollector {
  private worked = false;
  /** Since when `busy()` has said no (ms since the epoch), 0 while there is work. */
  private quietSince = 0;
  private readonly timer: NodeJS.Timeout;
  /** Collections run (for tests). */
  runs = 0;

  constructor(
    private readonly busy: () => boolean,
    idleMs = 5000,
  ) {
    this.timer = setInterval(
      () => {
        if (this.busy()) {
          this.worked = true;
          return void (this.quietSince = 0);
        }
        if (!this.worked) return;
        const now = Date.now();
        if (!this.quietSince) return void (this.quietSince = now);
        if (now - this.quietSince < idleMs) return;
        this.worked = false;
        this.quietSince = 0;
        this.runs++;
        collectGarbage();
        trimFreedMemory();
      },
      Math.max(10, idleMs / 5),
    ).unref();
  }

  /**
   * Work happened (a request or a stream started): the idle time counts from now. (Short requests fall between the
   * samples of `busy()`: without this, a collection, which blocks 10-50 ms, came every ~5 s of steady traffic.)
   */
  touch(): void {
    this.worked = true;
    this.quietSince = 0;
  }

  stop(): void {
    clearInterval(this.timer);
  }
}
