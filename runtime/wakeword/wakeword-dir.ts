import { type FSWatcher, watch } from 'node:fs';
import { readdir, readFile, stat } from 'node:fs/promises';
import { join } from 'node:path';
import { invalid } from '../errors.js';
import { spellAsId } from '../names.js';
import { headProblem } from '../onnx-file.js';

/**
 * `wakeword_dir` (docs/models.md#a-folder-of-wake-words): a folder of openWakeWord heads, each
 * `*.onnx` file a wake-word model whose id is its file name written as an id (`hey_computer_v0.1.onnx`
 * -> `hey-computer`). The folder is scanned at start, again on every change `fs.watch` reports,
 * and every second in case it reports none (network file systems, some containers). A file that is
 * not a head (not ONNX, another input shape, a `.tflite`) is reported with what is wrong with it;
 * the other files are not affected. Files are read and checked on the main thread without
 * onnxruntime: the check reads the model's graph inputs and outputs from its protobuf.
 */

/**
 * Checks that `wakeword_dir` is a folder this process can read, before the server listens.
 * @throws VoxError `invalid_field` `wakeword_dir` saying what is wrong and what to do.
 */
export async function checkWakewordDir(dir: string): Promise<void> {
  try {
    if (!(await stat(dir)).isDirectory())
      throw invalid(
        'wakeword_dir',
        `'${dir}' is a file, not a folder; give --wakeword-dir a folder of *.onnx wake words`,
      );
    await readdir(dir);
  } catch (e) {
    const code = (e as NodeJS.ErrnoException).code;
    if (!code) throw e;
    throw invalid(
      'wakeword_dir',
      code === 'ENOENT'
        ? `the folder '${dir}' does not exist; create it (mkdir -p '${dir}') or give --wakeword-dir a folder that exists`
        : `the folder '${dir}' cannot be read (${code}); give --wakeword-dir a folder this user can read`,
    );
  }
}

/** How often the folder is scanned when no change is reported, ms. */
export const RESCAN_MS = 1000;
/** Largest file taken for a head (openWakeWord's are 0.2-1.8 MB). */
const MAX_HEAD_BYTES = 64 * 1024 * 1024;

/** One file of the folder that makes a model: its id and path. */
export interface FolderHead {
  id: string;
  path: string;
}

/** One file of the folder that does not, and why (`id` is what its name would make). */
export interface FolderProblem {
  id: string;
  path: string;
  error: string;
}

/** What one scan of the folder found. */
export interface FolderScan {
  heads: FolderHead[];
  problems: FolderProblem[];
}

/** A file already checked: its size and modification time when checked, and the outcome. */
interface Checked {
  size: number;
  mtimeMs: number;
  problem: string | null;
}

/**
 * Scans `dir` once: every `*.onnx` file is a head or a problem; a `*.tflite` file is a problem
 * (voxserve runs ONNX; openWakeWord's training writes both). Other files are ignored. A file
 * unchanged (size and mtime) since it was last checked is not read again (`cache`).
 * @throws Error when the folder itself cannot be read.
 */
export async function scanFolder(dir: string, cache: Map<string, Checked> = new Map()): Promise<FolderScan> {
  const scan: FolderScan = { heads: [], problems: [] };
  const names = (await readdir(dir)).filter((n) => /\.(onnx|tflite)$/i.test(n)).sort();
  const seen = new Set<string>();
  const ids = new Map<string, string>();
  for (const name of names) {
    const path = join(dir, name);
    const id = spellAsId(name.replace(/\.(onnx|tflite)$/i, ''));
    let problem: string | null;
    try {
      const st = await stat(path);
      const known = cache.get(path);
      if (!st.isFile()) problem = 'not a regular file';
      else if (/\.tflite$/i.test(name))
        problem = 'a TFLite model: voxserve runs ONNX heads (openWakeWord writes both; use the .onnx file)';
      else if (known && known.size === st.size && known.mtimeMs === st.mtimeMs) problem = known.problem;
      else if (st.size > MAX_HEAD_BYTES) problem = `${st.size} bytes: larger than any head (at most ${MAX_HEAD_BYTES})`;
      else {
        problem = headProblem(await readFile(path));
        cache.set(path, { size: st.size, mtimeMs: st.mtimeMs, problem });
      }
    } catch (e) {
      // Removed between readdir and stat: it is simply gone.
      if ((e as NodeJS.ErrnoException).code === 'ENOENT') continue;
      problem = `cannot be read: ${(e as NodeJS.ErrnoException).code ?? (e as Error).message}`;
    }
    seen.add(path);
    if (!problem && !/^[a-z0-9][a-z0-9._-]{0,127}$/.test(id))
      problem = `its name does not make a model id ('${id}': 1-128 characters of a-z 0-9 . _ -)`;
    if (!problem && ids.has(id)) problem = `makes the id '${id}', which ${ids.get(id)} has already`;
    if (problem) scan.problems.push({ id, path, error: problem });
    else {
      ids.set(id, name);
      scan.heads.push({ id, path });
    }
  }
  for (const path of cache.keys()) if (!seen.has(path)) cache.delete(path);
  // A .tflite beside the .onnx of the same head (openWakeWord's training writes both) is no problem.
  const served = new Set(scan.heads.map((h) => h.id));
  scan.problems = scan.problems.filter((p) => !(/\.tflite$/i.test(p.path) && served.has(p.id)));
  return scan;
}

/**
 * Keeps a folder of heads in view: scans it at {@link start}, then on each change `fs.watch`
 * reports (after 100 ms of quiet, so a file being copied is read once it is whole) and every
 * {@link RESCAN_MS}; calls `onScan` with every scan's result (an empty one while the folder does
 * not exist, then `onError`). Scans never overlap.
 */
export class WakewordFolder {
  private readonly cache = new Map<string, Checked>();
  private watcher: FSWatcher | null = null;
  private timer: NodeJS.Timeout | null = null;
  private debounce: NodeJS.Timeout | null = null;
  private scanning: Promise<void> | null = null;
  private again = false;
  private stopped = false;

  /**
   * @param onScan each scan's result (also the first, before `start` resolves).
   * @param onError a scan that failed (the folder cannot be read); scanning goes on.
   */
  constructor(
    readonly dir: string,
    private readonly onScan: (scan: FolderScan) => void,
    private readonly onError: (e: Error) => void = () => {},
  ) {}

  /** Scans once, then keeps watching. @throws Error when the folder cannot be read at all. */
  async start(): Promise<void> {
    this.onScan(await scanFolder(this.dir, this.cache));
    try {
      this.watcher = watch(this.dir, () => this.soon());
      this.watcher.on('error', () => {});
    } catch {
      // No watching here (the interval still rescans).
    }
    this.timer = setInterval(() => void this.rescan(), RESCAN_MS);
    this.timer.unref();
  }

  private soon(): void {
    if (this.debounce) clearTimeout(this.debounce);
    this.debounce = setTimeout(() => void this.rescan(), 100);
    this.debounce.unref();
  }

  /** Scans now (or right after the scan in progress). */
  rescan(): Promise<void> {
    if (this.stopped) return Promise.resolve();
    if (this.scanning) {
      this.again = true;
      return this.scanning;
    }
    this.scanning = (async () => {
      do {
        this.again = false;
        try {
          const scan = await scanFolder(this.dir, this.cache);
          if (!this.stopped) this.onScan(scan);
        } catch (e) {
          // The folder itself is gone: none of its heads is there any more.
          if ((e as NodeJS.ErrnoException).code === 'ENOENT' && !this.stopped) this.onScan({ heads: [], problems: [] });
          this.onError(e as Error);
        }
      } while (this.again && !this.stopped);
      this.scanning = null;
    })();
    return this.scanning;
  }

  /** Stops watching. */
  stop(): void {
    this.stopped = true;
    this.watcher?.close();
    if (this.timer) clearInterval(this.timer);
    if (this.debounce) clearTimeout(this.debounce);
  }
}
