/**
 * The wire form of the work nodes send each other over NATS (docs/cluster.md "The request path across nodes"): jobs
 * and replies as binary frames (the slot-host frame), error replies, messages over `max_payload` in parts, a batch
 * split by rows and joined again, and the buffers a holder decodes its peers' jobs into.
 */
import type { NatsConnection } from '@nats-io/transport-node';
import { fromWire, voxError, type VoxError } from '../runtime/errors.js';
import {
  decodeFrame,
  encodeFrame,
  OWW,
  SILERO,
  type FromSlot,
  type Job,
  type JobResult,
  type ToSlot,
} from '../runtime/slots/slot-protocol.js';

/** A message of the cluster's job subjects: the slot-host protocol's `run` plus what a holder needs. */
export interface RemoteJob {
  type: 'job';
  /** `<ingress node>:<seq>`: names the job in logs; a re-sent job keeps it. */
  id: string;
  model: string;
  /** How long the job may wait at the holder for a lease and a slot, ms (0 = unbounded). */
  wait_ms: number;
  job: Extract<ToSlot, { type: 'run' }>['job'];
}

/** A holder's answer to a job or an info request. */
export type RemoteReply =
  | { type: 'result'; result: Extract<FromSlot, { type: 'result' }>['result']; ran_ms: number }
  | { type: 'info'; info: Extract<FromSlot, { type: 'loaded' }>['info'] }
  /**
   * `not_held`: the node does not hold the model ready (any more). Else a VoxError's type, and its `code`
   * (docs/errors.md).
   */
  | { type: 'error'; error: string; message: string; retry_after_s?: number; code?: string };

/** A peer's error reply. */
export type ErrorReply = Extract<RemoteReply, { type: 'error' }>;

/** The one encoding of an error for a peer: the VoxError's type and code (docs/errors.md) and its Retry-After. */
export function errorReply(v: VoxError): ErrorReply {
  return { type: 'error', error: v.type, code: v.code, message: v.message, retry_after_s: v.retryAfterS };
}

/** The reply of a node that does not hold the model ready (any more): its ingress sends the job elsewhere. */
export function notHeld(message: string): ErrorReply {
  return { type: 'error', error: 'not_held', message };
}

/**
 * The one decoding of a peer's error reply: the VoxError it stands for (by its code), its message prefixed with the
 * node; `not_held` is 503 `no_holder`.
 */
export function replyError(node: string, r: ErrorReply): VoxError {
  const message = `node ${node}: ${r.message}`;
  return r.error === 'not_held' ? voxError('no_holder', { message }) : fromWire({ code: r.code, message });
}

/** Encodes a job or reply as one binary frame (the slot-host frame: JSON head, Float32Arrays as raw bytes). */
export function encodeMessage(msg: RemoteJob | RemoteReply): Uint8Array {
  return Buffer.concat(encodeFrame(msg as unknown as ToSlot));
}

/**
 * Decodes {@link encodeMessage}'s frame, copied once so that its arrays are aligned views of their own buffer.
 * @param into where to copy it (its first `data.length` bytes; from {@link FrameBuffers}); absent: a new buffer.
 */
export function decodeMessage<T extends RemoteJob | RemoteReply>(data: Uint8Array, into?: Uint8Array): T {
  const own = into ? into.subarray(0, data.length) : new Uint8Array(data.length);
  own.set(data);
  return decodeFrame(own) as T;
}

/**
 * Buffers a holder decodes its peers' jobs into, kept from job to job. Each job's bytes were copied into a new buffer
 * before: V8 counts the bytes of every new ArrayBuffer towards its next mark-compact, and a holder receiving ~10 MB of
 * jobs a second ran one every ~0.85 s (docs/cluster.md "Benchmark").
 */
export class FrameBuffers {
  private readonly free: Uint8Array[] = [];
  /** @param keep the most free buffers kept (more jobs than that at once allocate, as before): at most 8 MiB. */
  constructor(private readonly keep = 8) {}

  /** A buffer of at least `bytes` (a power of two, at least 64 KiB), the caller's until {@link give}n back. */
  take(bytes: number): Uint8Array {
    const i = this.free.findIndex((b) => b.byteLength >= bytes);
    if (i >= 0) return this.free.splice(i, 1)[0];
    return new Uint8Array(Math.max(65_536, 2 ** Math.ceil(Math.log2(bytes))));
  }

  /** Gives `b` (taken here) back: nothing reads the views decoded from it any more. One over 1 MiB is not kept. */
  give(b: Uint8Array): void {
    if (this.free.length < this.keep && b.byteLength <= 1 << 20) this.free.push(b);
  }
}

/**
 * Publishes `data` on `subject`, in parts when it is larger than the server's `max_payload`: each
 * part goes to `<subject>.part` as `[u32 head length][head JSON {id, i, n}][bytes]`, in order (NATS
 * keeps one connection's messages to one subscription in order), the last with the reply
 * subject. An {@link Assembler} on the other side joins them.
 */
export function publishInParts(nc: NatsConnection, subject: string, data: Uint8Array, reply?: string): void {
  const max = nc.info?.max_payload ?? 1024 * 1024;
  if (data.length <= max) return nc.publish(subject, data, reply ? { reply } : undefined);
  const size = max - 256;
  const n = Math.ceil(data.length / size);
  const id = `${Date.now().toString(36)}.${Math.random().toString(36).slice(2)}`;
  for (let i = 0; i < n; i++) {
    const head = Buffer.from(JSON.stringify({ id, i, n }));
    const len = Buffer.alloc(4);
    len.writeUInt32LE(head.length);
    const part = Buffer.concat([len, head, data.subarray(i * size, (i + 1) * size)]);
    nc.publish(`${subject}.part`, part, i === n - 1 && reply ? { reply } : undefined);
  }
}

/** Joins the parts {@link publishInParts} sent. Parts of a message not completed within a minute are dropped. */
export class Assembler {
  private readonly open = new Map<string, { parts: Uint8Array[]; at: number }>();

  /**
   * Adds one part. @returns the whole message once its last part came, else null (also for a part
   * that is not one {@link publishInParts} sends: dropped, never thrown into the NATS client,
   * which would close the connection).
   */
  add(part: Uint8Array): Uint8Array | null {
    const buf = Buffer.from(part.buffer, part.byteOffset, part.byteLength);
    let head: { id?: unknown; i?: unknown; n?: unknown } | null;
    let len: number;
    try {
      len = buf.readUInt32LE(0);
      head = JSON.parse(buf.subarray(4, 4 + len).toString());
    } catch {
      return null;
    }
    if (typeof head?.id !== 'string' || !Number.isInteger(head.n) || !Number.isInteger(head.i)) return null;
    const { id, i, n } = head as { id: string; i: number; n: number };
    if (n < 1 || i < 0 || i >= n) return null;
    const now = Date.now();
    for (const [k, v] of this.open) if (now - v.at > 60_000) this.open.delete(k);
    const entry = this.open.get(id) ?? { parts: [], at: now };
    entry.parts[i] = buf.subarray(4 + len);
    this.open.set(id, entry);
    if (entry.parts.filter(Boolean).length < n) return null;
    this.open.delete(id);
    return Buffer.concat(entry.parts);
  }
}

/**
 * Splits a job of several rows (a batch of streams, `counts`) into two jobs of about half the
 * rows each, for a frame over NATS's `max_payload`. Rows are independent and laid out row after
 * row in every field (slot-protocol.ts), so each half is a valid job and the halves' results,
 * concatenated field by field ({@link joinResults}), are the whole job's result.
 * @returns the two halves, or null for a single row (it cannot be split).
 */
export function splitJob(job: Job): [Job, Job] | null {
  // Only the row layouts below are known here; any other job goes in parts (publishInParts).
  if (job.kind !== 'vad' && job.kind !== 'wakeword') return null;
  const counts = job.counts;
  if (!counts || counts.length < 2) return null;
  const k = Math.floor(counts.length / 2);
  const [c1, c2] = [counts.slice(0, k), counts.slice(k)];
  const sum = (c: number[]): number => c.reduce((a, b) => a + b, 0);
  if (job.kind === 'vad') {
    const w = sum(c1) * SILERO.WINDOW;
    const s = k * SILERO.STATE;
    const c = k * SILERO.CONTEXT;
    return [
      {
        kind: 'vad',
        counts: c1,
        windows: job.windows.subarray(0, w),
        state: job.state.subarray(0, s),
        context: job.context.subarray(0, c),
      },
      {
        kind: 'vad',
        counts: c2,
        windows: job.windows.subarray(w),
        state: job.state.subarray(s),
        context: job.context.subarray(c),
      },
    ];
  }
  const a = c1.length * OWW.LOOKBACK + sum(c1) * OWW.STEP;
  const m = (job.mel.length / counts.length) * k;
  const e = (job.embeddings.length / counts.length) * k;
  return [
    {
      kind: 'wakeword',
      counts: c1,
      audio: job.audio.subarray(0, a),
      mel: job.mel.subarray(0, m),
      embeddings: job.embeddings.subarray(0, e),
    },
    {
      kind: 'wakeword',
      counts: c2,
      audio: job.audio.subarray(a),
      mel: job.mel.subarray(m),
      embeddings: job.embeddings.subarray(e),
    },
  ];
}

/**
 * Runs the two halves of a split job ({@link splitJob}) with `run`, at once, and joins their results
 * ({@link joinResults}). Each half's result is copied as it comes: a local process slot's answer is a view into a
 * buffer reused `SLOT_DEPTH` (2) answers later (runtime/slots/slots.ts, `processSlots`), and other jobs' answers may
 * come between the halves' (a model held here behind its remote pool: the first half's rows took a later job's
 * probabilities and states).
 */
export async function runHalves(halves: [Job, Job], run: (half: Job) => Promise<JobResult>): Promise<JobResult> {
  const own = (r: JobResult): JobResult => {
    const out: Record<string, unknown> = { ...r };
    for (const [k, v] of Object.entries(r)) if (v instanceof Float32Array) out[k] = v.slice();
    return out as unknown as JobResult;
  };
  const [a, b] = await Promise.all(halves.map((h) => run(h).then(own)));
  return joinResults(a, b);
}

/** The result of a job split by {@link splitJob}: its halves' results, each field concatenated. */
export function joinResults(a: JobResult, b: JobResult): JobResult {
  const cat = (x: Float32Array, y: Float32Array): Float32Array => {
    const out = new Float32Array(x.length + y.length);
    out.set(x);
    out.set(y, x.length);
    return out;
  };
  const ran: [number, number] | undefined =
    a.ran && b.ran ? [Math.min(a.ran[0], b.ran[0]), Math.max(a.ran[1], b.ran[1])] : undefined;
  if (a.kind === 'vad' && b.kind === 'vad')
    return {
      kind: 'vad',
      probs: cat(a.probs, b.probs),
      state: cat(a.state, b.state),
      context: cat(a.context, b.context),
      ran,
    };
  if (a.kind === 'wakeword' && b.kind === 'wakeword')
    return {
      kind: 'wakeword',
      scores: cat(a.scores, b.scores),
      mel: cat(a.mel, b.mel),
      embeddings: cat(a.embeddings, b.embeddings),
      ran,
    };
  throw new Error('joinResults: results of different kinds');
}
