/**
 * Fakes for the fuzz suites: a loader whose slots answer VAD jobs at once (speech probability =
 * a window's RMS x 4, capped at 1, so tones make segments), and a WebSocket stand-in for
 * `bindStream` that records what the server writes.
 */
import { EventEmitter } from 'node:events';
import type { LoadedModel, ModelLoader } from '../../runtime/loader.js';
import type { Job, JobResult, LoadSpec, VadJob } from '../../runtime/slots/slot-protocol.js';
import { SlotPool, type SlotHost } from '../../runtime/slots/slots.js';

function vadResult(job: VadJob): JobResult {
  const n = job.windows.length / 512;
  const probs = new Float32Array(n);
  for (let w = 0; w < n; w++) {
    let sum = 0;
    for (let i = w * 512; i < (w + 1) * 512; i++) sum += job.windows[i] * job.windows[i];
    probs[w] = Math.min(1, Math.sqrt(sum / 512) * 4);
  }
  const rows = job.counts?.length ?? 1;
  return { kind: 'vad', probs, state: job.state, context: new Float32Array(64 * rows) };
}

/** A loader over in-process fake VAD slots (any task is served as VAD). */
export const fakeLoader: ModelLoader = async (config): Promise<LoadedModel> => {
  const factory = async (_spec: LoadSpec): Promise<SlotHost> => ({
    info: { vadVersion: 'v5' },
    run: async (job: Job) => vadResult(job as VadJob),
    close: async () => {},
    onExit: () => {},
    residentBytes: () => 0,
  });
  const pool = await SlotPool.start({ kind: 'vad', model: config.path }, config.slots, factory);
  return { pool, residentBytes: 0, close: () => pool.close() };
};

/** The parts of a `ws` WebSocket that `bindStream` uses; the server's close is echoed by the "peer". */
export class FakeWs extends EventEmitter {
  readonly OPEN = 1;
  readyState = 1;
  bufferedAmount = 0;
  /** Frames the server sent, in order. */
  readonly sent: (string | Buffer)[] = [];
  /** The server's close, if it closed. */
  closedWith: { code: number; reason: string } | null = null;
  /** The close code the 'close' event carried. */
  finalCode: number | null = null;

  send(data: string | Buffer, cb?: () => void): void {
    this.sent.push(data);
    if (cb) queueMicrotask(cb);
  }
  close(code: number, reason: string): void {
    if (this.readyState !== 1) return;
    this.readyState = 2;
    this.closedWith = { code, reason };
    setImmediate(() => this.peerClose(code));
  }
  /** The connection ends with `code` (the client's close, or the echo of the server's). */
  peerClose(code: number): void {
    if (this.readyState === 3) return;
    this.readyState = 3;
    this.finalCode = code;
    this.emit('close', code);
  }
  pause(): void {}
  resume(): void {}
  ping(): void {
    setImmediate(() => this.readyState === 1 && this.emit('pong'));
  }
  terminate(): void {
    this.peerClose(1006);
  }
}
