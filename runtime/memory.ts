import { readFileSync } from 'node:fs';
import { freemem } from 'node:os';
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
