import { type FSWatcher, watch } from 'node:fs';
import { readdir, readFile, stat } from 'node:fs/promises';
import { join } from 'node:path';
import { looksLikeOnnx } from './loader.js';
import { spellAsId } from './names.js';

/**
 * `wakeword_dir` (docs/models.md#a-folder-of-wake-words): a folder of openWakeWord heads, each
 * `*.onnx` file a wake-word model whose id is its file name written as an id (`hey_computer_v0.1.onnx`
 * -> `hey-computer`). The folder is scanned at start, again on every change `fs.watch` reports,
 * and every second in case it reports none (network file systems, some containers). A file that is
 * not a head (not ONNX, another input shape, a `.tflite`) is reported with what is wrong with it;
 * the other files are not affected. Files are read and checked on the main thread without
 * onnxruntime: the check reads the model's graph inputs and outputs from its protobuf.
 */

/** How often the folder is scanned when no change is reported, ms. */
export const RESCAN_MS = 1000;
/** Largest file taken for a head (openWakeWord's are 0.2-1.8 MB). */
const MAX_HEAD_BYTES = 64 * 1024 * 1024;
/** The size of one openWakeWord embedding: a head reads N of them. */
const EMBEDDING = 96;

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

/** A protobuf field: its number, wire type, and value (a varint, or the bytes of a length-delimited field). */
type Field = { n: number; wire: number; value: number; bytes: Uint8Array };

/**
 * The fields of one protobuf message (the wire format of protobuf's encoding guide: varint,
 * 64-bit, length-delimited and 32-bit fields; groups are refused).
 * @throws Error on a truncated or malformed message.
 */
function fields(buf: Uint8Array): Field[] {
  const out: Field[] = [];
  let at = 0;
  const varint = (): number => {
    let v = 0;
    for (let shift = 0; ; shift += 7) {
      if (at >= buf.length || shift > 63) throw new Error('truncated protobuf');
      const b = buf[at++];
      v += (b & 0x7f) * 2 ** shift;
      if (!(b & 0x80)) return v;
    }
  };
  while (at < buf.length) {
    const tag = varint();
    const wire = tag % 8;
    const n = Math.floor(tag / 8);
    const empty = buf.subarray(0, 0);
    if (wire === 0) out.push({ n, wire, value: varint(), bytes: empty });
    else if (wire === 1 || wire === 5) {
      at += wire === 1 ? 8 : 4;
      if (at > buf.length) throw new Error('truncated protobuf');
    } else if (wire === 2) {
      const len = varint();
      if (at + len > buf.length) throw new Error('truncated protobuf');
      out.push({ n, wire, value: len, bytes: buf.subarray(at, at + len) });
      at += len;
    } else throw new Error(`protobuf wire type ${wire} is not supported`);
  }
  return out;
}

const text = (b: Uint8Array): string => Buffer.from(b.buffer, b.byteOffset, b.byteLength).toString('utf8');

/** A graph input or output: its name, element type (onnx.proto TensorProto.DataType, 1 = float) and dimensions (a number, or the name of a dynamic one). */
interface ValueInfo {
  name: string;
  elemType: number;
  dims: (number | string)[];
}

/** onnx.proto ValueInfoProto {name 1, type 2: TypeProto {tensor_type 1: {elem_type 1, shape 2: {dim 1: {dim_value 1, dim_param 2}}}}}. */
function valueInfo(bytes: Uint8Array): ValueInfo {
  const v: ValueInfo = { name: '', elemType: 0, dims: [] };
  for (const f of fields(bytes)) {
    if (f.n === 1 && f.wire === 2) v.name = text(f.bytes);
    if (f.n !== 2 || f.wire !== 2) continue;
    for (const t of fields(f.bytes)) {
      if (t.n !== 1 || t.wire !== 2) continue;
      for (const tt of fields(t.bytes)) {
        if (tt.n === 1 && tt.wire === 0) v.elemType = tt.value;
        if (tt.n !== 2 || tt.wire !== 2) continue;
        for (const dim of fields(tt.bytes)) {
          if (dim.n !== 1 || dim.wire !== 2) continue;
          let d: number | string = '?';
          for (const x of fields(dim.bytes)) {
            if (x.n === 1 && x.wire === 0) d = x.value;
            if (x.n === 2 && x.wire === 2) d = text(x.bytes) || '?';
          }
          v.dims.push(d);
        }
      }
    }
  }
  return v;
}

const shown = (v: ValueInfo): string =>
  `${v.elemType === 1 ? 'float' : `element type ${v.elemType}`} [${v.dims.join(', ')}]`;

/**
 * Why an ONNX file is not an openWakeWord classifier head, or null when it is one: its graph
 * (onnx.proto ModelProto.graph 7: inputs 11, outputs 12, initializers 5 whose names 8 older
 * exporters list among the inputs) takes one float input [batch, N, 96] (N embeddings, a fixed
 * number) and gives one output [batch, classes]: the rule the slot host applies when it loads a head.
 */
export function headProblem(bytes: Uint8Array): string | null {
  if (!looksLikeOnnx(bytes.subarray(0, 16)))
    return bytes.length === 0 ? 'the file is empty' : 'not an ONNX model (its first bytes are not an ONNX ModelProto)';
  try {
    const graph = fields(bytes).find((f) => f.n === 7 && f.wire === 2);
    if (!graph) return 'not an ONNX model: it has no graph';
    const g = fields(graph.bytes);
    const weights = new Set(
      g
        .filter((f) => f.n === 5 && f.wire === 2)
        .flatMap((f) => {
          const name = fields(f.bytes).find((x) => x.n === 8 && x.wire === 2);
          return name ? [text(name.bytes)] : [];
        }),
    );
    const inputs = g
      .filter((f) => f.n === 11 && f.wire === 2)
      .map((f) => valueInfo(f.bytes))
      .filter((v) => !weights.has(v.name));
    const outputs = g.filter((f) => f.n === 12 && f.wire === 2).map((f) => valueInfo(f.bytes));
    const [input] = inputs;
    const ok =
      inputs.length === 1 &&
      input.elemType === 1 &&
      input.dims.length === 3 &&
      typeof input.dims[1] === 'number' &&
      input.dims[1] > 0 &&
      input.dims[2] === EMBEDDING &&
      outputs.length === 1 &&
      outputs[0].dims.length === 2;
    if (ok) return null;
    return `not an openWakeWord head: it takes ${inputs.map(shown).join(', ') || 'no input'} and gives ${outputs.map(shown).join(', ') || 'no output'}; a head takes one float input [1, N, 96] (N embeddings) and gives one output [1, classes]`;
  } catch (e) {
    return `not a readable ONNX model (${(e as Error).message})`;
  }
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
 * {@link RESCAN_MS}; calls `onScan` with every scan's result. Scans never overlap.
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
