/**
 * A slot host's body: one ONNX session set for one model, in a child process (`isolation:
 * "process"`: `load` and `release` over the IPC channel, `run` and its answer as binary frames
 * through shared files, see `FrameChannel`) or a worker thread (`isolation: "thread"`, messages over its port). It runs
 * what it is sent and keeps nothing between `run` messages (see slot-protocol.ts).
 * onnxruntime-node blocks its thread for the whole of `create` and `run`, which is why sessions
 * only ever live here.
 *
 * Test hook: with `VOXSERVE_TEST_ABORT_AT` set to a number, a VAD job whose first sample equals it
 * makes the host call `process.abort()` (a native crash, for the crash tests). Never set in use.
 */
import { Socket } from 'node:net';
import { parentPort } from 'node:worker_threads';
import ort from 'onnxruntime-node';
import {
  FrameChannel,
  headLabels,
  OWW,
  SILERO,
  SLOT_DEPTH,
  transferList,
  type FromSlot,
  type Job,
  type JobResult,
  type LoadSpec,
  type SlotInfo,
  type TensorJob,
  type TensorMeta,
  type TensorResult,
  type ToSlot,
  type VadJob,
  type WakewordJob,
  type DenoiseJob,
} from './slot-protocol.js';
import { RNNOISE, RnnoiseEngine } from './rnnoise.js';
import { unsupportedDtype } from '../tasks/tensor.js';
import { IdleCollector } from '../memory.js';

/** The worker thread's port, or null in a child process (then `process.send` / `process.on`). */
const port = parentPort;
/**
 * A child process's job channel: doorbells on fd 4, frames in the shared files fd 5 (`run` in)
 * and fd 6 (`result` and job errors out). Set up at the end of this file.
 */
let jobs: FrameChannel<ToSlot, FromSlot> | null = null;
const ABORT_AT = process.env.VOXSERVE_TEST_ABORT_AT === undefined ? null : Number(process.env.VOXSERVE_TEST_ABORT_AT);
const OPTIONS: ort.InferenceSession.SessionOptions = {
  intraOpNumThreads: 1,
  interOpNumThreads: 1,
  executionMode: 'sequential',
  graphOptimizationLevel: 'all',
};

/** A child process's quiet time before it collects, ms (see the end of this file). */
const HOST_IDLE_GC_MS = 2000;

let sessions: ort.InferenceSession[] = [];
/** A job has run since the idle collector last looked (child processes only). */
let ran = false;
let runJob: ((job: Job) => Promise<JobResult>) | null = null;

function post(msg: FromSlot, transfer: ArrayBuffer[] = []): void {
  if (port) port.postMessage(msg, transfer);
  else if (jobs && 'seq' in msg && msg.seq !== undefined) jobs.send(msg);
  // After `release` (or the server's exit) the channel is closed: a late answer has no one to go to.
  else if (process.connected) process.send!(msg);
}

/**
 * A session on `source` (a path, or the model's bytes). `arena: false` turns off onnxruntime's CPU
 * memory arena: a wake-word family's batches change size with the streams it serves, and the arena
 * keeps the largest batch's buffers for the session's life (20 head combinations at once took
 * 1.11-1.22x one combination's memory with it, 1.09-1.17x without; the CPU per stream-second the same).
 */
async function create(source: string | Uint8Array, arena = true): Promise<ort.InferenceSession> {
  const options = arena ? OPTIONS : { ...OPTIONS, enableCpuMemArena: false };
  // A path is read by onnxruntime; shared bytes are copied out: onnxruntime reads a plain array.
  const s =
    typeof source === 'string'
      ? await ort.InferenceSession.create(source, options)
      : await ort.InferenceSession.create(new Uint8Array(source), options);
  sessions.push(s);
  return s;
}

async function loadVad(model: string): Promise<SlotInfo> {
  const session = await create(model);
  const v5 = session.inputNames.includes('state');
  if (!v5 && !(session.inputNames.includes('h') && session.inputNames.includes('c'))) {
    throw new Error(`not a Silero VAD model: inputs are ${session.inputNames.join(', ')}`);
  }
  const sr = new ort.Tensor('int64', BigInt64Array.from([16000n]), []);
  // State layout: each row keeps 256 floats (v5: state[0], state[1]; v4: h[0], h[1], c[0], c[1]);
  // the tensors want [2, rows, 128] (v5) or [2, rows, 64] twice (v4), for the active rows only.
  // The run's inputs are views of buffers kept across jobs (grown to the largest run), not new
  // arrays per run step: onnxruntime reads them during `run` only.
  const HALF = v5 ? 128 : 64;
  const width = v5 ? SILERO.CONTEXT + SILERO.WINDOW : SILERO.WINDOW;
  let xBuf: Float32Array = new Float32Array(0);
  let hBuf: Float32Array = new Float32Array(0);
  let cBuf: Float32Array = new Float32Array(0);
  const grow = (buf: Float32Array, n: number): Float32Array =>
    buf.length >= n ? buf : new Float32Array(Math.max(n, 2 * buf.length));
  const gather = (into: Float32Array, rows: Float32Array, active: number[], offset: number): Float32Array => {
    const n = active.length;
    const t = into.subarray(0, 2 * n * HALF);
    for (let j = 0; j < n; j++) {
      const r = active[j];
      for (let l = 0; l < 2; l++)
        t.set(rows.subarray(r * 256 + offset + l * HALF, r * 256 + offset + (l + 1) * HALF), (l * n + j) * HALF);
    }
    return t;
  };
  const scatter = (t: Float32Array, rows: Float32Array, active: number[], offset: number): void => {
    const n = active.length;
    for (let j = 0; j < n; j++) {
      const r = active[j];
      for (let l = 0; l < 2; l++)
        rows.set(t.subarray((l * n + j) * HALF, (l * n + j + 1) * HALF), r * 256 + offset + l * HALF);
    }
  };
  runJob = async (job) => {
    const { windows, state, context } = job as VadJob;
    const counts = (job as VadJob).counts ?? [windows.length / SILERO.WINDOW];
    const starts: number[] = [];
    counts.reduce((at, c) => (starts.push(at), at + c), 0);
    const probs = new Float32Array(windows.length / SILERO.WINDOW);
    // The job's state and context are this host's own (a frame or a structured clone): updated in place and sent back.
    const st = state;
    const ctx = context;
    xBuf = grow(xBuf, counts.length * width);
    hBuf = grow(hBuf, counts.length * 2 * HALF);
    if (!v5) cBuf = grow(cBuf, counts.length * 2 * HALF);
    let active = counts.map((_, r) => r);
    for (let i = 0; active.length; i++) {
      active = active.filter((r) => counts[r] > i);
      const n = active.length;
      if (!n) break;
      const x = xBuf.subarray(0, n * width);
      for (let j = 0; j < n; j++) {
        const r = active[j];
        const win = windows.subarray((starts[r] + i) * SILERO.WINDOW, (starts[r] + i + 1) * SILERO.WINDOW);
        if (v5) {
          x.set(ctx.subarray(r * SILERO.CONTEXT, (r + 1) * SILERO.CONTEXT), j * width);
          x.set(win, j * width + SILERO.CONTEXT);
          ctx.set(win.subarray(SILERO.WINDOW - SILERO.CONTEXT), r * SILERO.CONTEXT);
        } else x.set(win, j * width);
      }
      let out: ort.InferenceSession.ReturnType;
      if (v5) {
        out = await session.run({
          input: new ort.Tensor('float32', x, [n, width]),
          state: new ort.Tensor('float32', gather(hBuf, st, active, 0), [2, n, 128]),
          sr,
        });
        scatter(out.stateN.data as Float32Array, st, active, 0);
      } else {
        out = await session.run({
          input: new ort.Tensor('float32', x, [n, SILERO.WINDOW]),
          h: new ort.Tensor('float32', gather(hBuf, st, active, 0), [2, n, 64]),
          c: new ort.Tensor('float32', gather(cBuf, st, active, 128), [2, n, 64]),
          sr,
        });
        scatter(out.hn.data as Float32Array, st, active, 0);
        scatter(out.cn.data as Float32Array, st, active, 128);
      }
      const p = out.output.data as Float32Array;
      for (let j = 0; j < n; j++) probs[starts[active[j]] + i] = p[j];
    }
    return { kind: 'vad', probs, state: st, context: ctx };
  };
  return { vadVersion: v5 ? 'v5' : 'v4' };
}

/** One openWakeWord classifier head: its session, input name, embedding window and label columns. */
async function loadHead(
  path: string,
): Promise<{ session: ort.InferenceSession; input: string; output: string; window: number; labels: string[] }> {
  const head = await create(path, false);
  // An openWakeWord head: one input [1, N, 96] (N embeddings), one output [1, classes].
  const headMeta = head.inputMetadata[0];
  const shape = headMeta?.isTensor ? headMeta.shape : [];
  const outMeta = head.outputMetadata[0];
  const outShape = outMeta?.isTensor ? outMeta.shape : [];
  if (
    head.inputNames.length !== 1 ||
    shape.length !== 3 ||
    typeof shape[1] !== 'number' ||
    shape[2] !== OWW.EMBEDDING ||
    head.outputNames.length !== 1 ||
    outShape.length !== 2
  ) {
    throw new Error(
      `not an openWakeWord head (${path}): inputs ${head.inputNames.join(', ')} [${shape.join(', ')}], outputs ${head.outputNames.length} [${outShape.join(', ')}]; expected one input [1, N, 96] and one output [1, classes]`,
    );
  }
  const columns = typeof outShape[1] === 'number' ? outShape[1] : 1;
  return {
    session: head,
    input: head.inputNames[0],
    output: head.outputNames[0],
    window: shape[1],
    labels: headLabels(head.outputNames[0], columns),
  };
}

/**
 * openWakeWord's initial embedding history (openwakeword/utils.py, AudioFeatures.__init__:
 * `_get_embeddings(np.random.randint(-1000, 1000, 16000*4))`): 4 s of uniform integer noise in
 * [-1000, 1000), its melspectrogram (x/10 + 2), and an embedding of every 76 frames at a stride of
 * 8. openWakeWord draws new noise for every stream; here the noise comes from a fixed-seed
 * generator (Numerical Recipes' 32-bit LCG), so a stream's scores do not depend on chance.
 * Without it (N copies of the embedding of the all-ones buffer, as before) the "alexa" head
 * scored 0.14 on 3 s of silence in its first steps; openWakeWord scores 0.
 * @returns every embedding (41) x 96 floats; a stream takes the last N (its longest head window).
 */
async function noiseEmbeddings(
  melspectrogram: (audio: Float32Array) => Promise<Float32Array>,
  embed: (frames: Float32Array) => Promise<Float32Array>,
  window: number,
): Promise<Float32Array> {
  const noise = new Float32Array(4 * 16_000);
  let state = 1;
  for (let i = 0; i < noise.length; i++) {
    state = (Math.imul(state, 1_664_525) + 1_013_904_223) >>> 0;
    noise[i] = Math.floor((state / 2 ** 32) * 2000) - 1000;
  }
  const spec = (await melspectrogram(noise)).map((x) => x / 10 + 2);
  const frames = spec.length / OWW.MEL_BINS;
  const size = OWW.MEL_FRAMES * OWW.MEL_BINS;
  const all: Float32Array[] = [];
  for (let f = 0; f + OWW.MEL_FRAMES <= frames; f += 8)
    all.push(Float32Array.from(await embed(spec.slice(f * OWW.MEL_BINS, f * OWW.MEL_BINS + size))));
  if (all.length < window)
    throw new Error(`4 s of audio gives ${all.length} embeddings, fewer than a head's window of ${window}`);
  const out = new Float32Array(all.length * OWW.EMBEDDING);
  all.forEach((e, i) => out.set(e, i * OWW.EMBEDDING));
  return out;
}

/**
 * The openWakeWord pipeline with several heads: per 80 ms step the melspectrogram and the
 * embedding run once, and every head reads the last N embeddings of the same buffer. The heads
 * are the spec's, or (a wake-word family's slot host, whose spec has none) the ones each job
 * names, loaded on first use and kept while a job's `keep` names them.
 */
async function loadWakeword(spec: Extract<LoadSpec, { kind: 'wakeword' }>): Promise<SlotInfo> {
  const mel = await create(spec.melspectrogram, false);
  const emb = await create(spec.embedding, false);
  type Head = Awaited<ReturnType<typeof loadHead>>;
  const loaded = new Map<string, Head>();
  const headsOf = async (paths: string[]): Promise<Head[]> => {
    const out: Head[] = [];
    for (const path of paths) {
      let h = loaded.get(path);
      if (!h) loaded.set(path, (h = await loadHead(path)));
      out.push(h);
    }
    return out;
  };
  const specHeads = await headsOf(spec.heads);
  const window = Math.max(0, ...specHeads.map((h) => h.window));
  const melIn = mel.inputNames[0];
  const melOut = mel.outputNames[0];
  const embIn = emb.inputNames[0];
  const embOut = emb.outputNames[0];

  const embed = async (frames: Float32Array): Promise<Float32Array> => {
    const out = await emb.run({ [embIn]: new ort.Tensor('float32', frames, [1, OWW.MEL_FRAMES, OWW.MEL_BINS, 1]) });
    return out[embOut].data as Float32Array;
  };
  const initialEmbeddings = await noiseEmbeddings(
    async (audio) =>
      (await mel.run({ [melIn]: new ort.Tensor('float32', audio, [1, audio.length]) }))[melOut].data as Float32Array,
    embed,
    window,
  );

  // Each model runs for every row of a step in turn (all melspectrograms, then all embeddings,
  // then each head for every row), not the three models row after row: its weights stay in the
  // CPU's caches from one run to the next. Measured on a 2-core EPYC (L2 1 MiB per core, the
  // three models ~3.5 MB together; other agents loading it, load average ~9), 10 rows a job:
  // melspectrogram 410 -> 260 us, head 295 -> 160 us, embedding ~5 % less per step. Every run is still the same batch-1
  // run on the same input
  // (rows are independent; a row's steps stay in order), so the scores are bit for bit the same.
  /** Releases every head loaded on a job's demand that `keep` does not name (a family's models no longer use it). */
  const dropUnused = async (keep: string[]): Promise<void> => {
    const wanted = new Set([...keep, ...spec.heads]);
    for (const [path, h] of loaded) {
      if (wanted.has(path)) continue;
      loaded.delete(path);
      sessions = sessions.filter((s) => s !== h.session);
      await h.session.release();
    }
  };
  runJob = async (job) => {
    const { audio, mel: mels, embeddings: embs, keep } = job as WakewordJob;
    if (keep) await dropUnused(keep);
    const heads = (job as WakewordJob).heads ? await headsOf((job as WakewordJob).heads!) : specHeads;
    const columns = heads.reduce((n, h) => n + h.labels.length, 0);
    const counts = (job as WakewordJob).counts ?? [(audio.length - OWW.LOOKBACK) / OWW.STEP];
    // The job's buffers are this host's own copies (a structured clone or a frame): updated in place and sent back.
    const melSize = OWW.MEL_FRAMES * OWW.MEL_BINS;
    const history = embs.length / counts.length;
    // Per row: its first step's index among the job's steps (scores are row after row), and its audio's start.
    const firstStep: number[] = [];
    const audioAt: number[] = [];
    let steps = 0;
    for (const c of counts) {
      firstStep.push(steps);
      audioAt.push(steps * OWW.STEP + firstStep.length * OWW.LOOKBACK - OWW.LOOKBACK);
      steps += c;
    }
    const scores = new Float32Array(steps * columns);
    const rows = counts.map((_, r) => r);
    for (let s = 0; ; s++) {
      const active = rows.filter((r) => counts[r] > s);
      if (!active.length) break;
      for (const r of active) {
        // Views, not copies: onnxruntime reads its inputs during the run only.
        const x = audio.subarray(audioAt[r] + s * OWW.STEP, audioAt[r] + (s + 1) * OWW.STEP + OWW.LOOKBACK);
        const mo = await mel.run({ [melIn]: new ort.Tensor('float32', x, [1, x.length]) });
        const spec = mo[melOut].data as Float32Array;
        // Shift the mel buffer left by the new frames and append them, transformed (x/10 + 2).
        const melBuf = mels.subarray(r * melSize, (r + 1) * melSize);
        melBuf.copyWithin(0, spec.length);
        const base = melBuf.length - spec.length;
        for (let j = 0; j < spec.length; j++) melBuf[base + j] = spec[j] / 10 + 2;
      }
      for (const r of active) {
        const e = await embed(mels.subarray(r * melSize, (r + 1) * melSize));
        const embBuf = embs.subarray(r * history, (r + 1) * history);
        embBuf.copyWithin(0, OWW.EMBEDDING);
        embBuf.set(e, embBuf.length - OWW.EMBEDDING);
      }
      let col = 0;
      for (const h of heads) {
        for (const r of active) {
          const input = embs.subarray((r + 1) * history - h.window * OWW.EMBEDDING, (r + 1) * history);
          const ho = await h.session.run({ [h.input]: new ort.Tensor('float32', input, [1, h.window, OWW.EMBEDDING]) });
          scores.set(ho[h.output].data as Float32Array, (firstStep[r] + s) * columns + col);
        }
        col += h.labels.length;
      }
    }
    return { kind: 'wakeword', scores, mel: mels, embeddings: embs, headsLoaded: loaded.size };
  };
  return { heads: specHeads.map((h) => ({ window: h.window, labels: h.labels })), initialEmbeddings };
}

/** A session's input or output as the slot reports it ({@link TensorMeta}). */
function tensorMeta(m: ort.InferenceSession.ValueMetadata): TensorMeta {
  return m.isTensor ? { name: m.name, dtype: m.type, shape: [...m.shape] } : { name: m.name, dtype: null, shape: null };
}

/**
 * Any ONNX model as it is (the `tensor` task): a job's inputs are fed as they come (the server
 * has checked them against the metadata reported here) and the outputs it asks for (else all) go
 * back with their dtype and dimensions.
 */
async function loadTensor(model: string): Promise<SlotInfo> {
  const session = await create(model);
  // A model none of whose requests could run is refused now, not listed ready.
  for (const [kind, list] of [
    ['input', session.inputMetadata],
    ['output', session.outputMetadata],
  ] as const)
    for (const m of list) {
      const why = kind === 'input' || m.isTensor ? unsupportedDtype(m.isTensor ? m.type : null) : null;
      if (why) throw new Error(`${kind} ${m.name} ${why}`);
    }
  runJob = async (job) => {
    const { inputs, outputs } = job as TensorJob;
    const feeds: Record<string, ort.Tensor> = {};
    for (const [name, t] of Object.entries(inputs))
      feeds[name] = new ort.Tensor(t.dtype as ort.Tensor.Type, t.data as ort.Tensor.DataType, t.shape);
    const out = outputs ? await session.run(feeds, outputs) : await session.run(feeds);
    const result: TensorResult = { kind: 'tensor', outputs: {} };
    for (const [name, t] of Object.entries(out))
      result.outputs[name] = {
        dtype: t.type,
        shape: [...t.dims],
        data: t.data as TensorResult['outputs'][string]['data'],
      };
    return result;
  };
  return { tensor: { inputs: session.inputMetadata.map(tensorMeta), outputs: session.outputMetadata.map(tensorMeta) } };
}

/**
 * RNNoise (`denoise`): one module instance of the package's WASM build; each row of a job has its
 * state copied in, its frames denoised in place, and its state copied out (runtime/slots/rnnoise.ts).
 */
async function loadDenoise(): Promise<SlotInfo> {
  const engine = await RnnoiseEngine.load();
  runJob = async (job) => {
    const { audio, state } = job as DenoiseJob;
    const counts = (job as DenoiseJob).rows ?? [audio.length / RNNOISE.FRAME];
    const probs = new Float32Array(audio.length / RNNOISE.FRAME);
    // The job's arrays are this host's own (a frame or a structured clone): denoised in place and sent back.
    let at = 0;
    counts.forEach((n, r) => {
      engine.run(
        audio.subarray(at * RNNOISE.FRAME, (at + n) * RNNOISE.FRAME),
        state.subarray(r * RNNOISE.STATE_FLOATS, (r + 1) * RNNOISE.STATE_FLOATS),
        probs.subarray(at, at + n),
      );
      at += n;
    });
    return { kind: 'denoise', audio, probs, state };
  };
  return { denoiseState: engine.initialState() };
}

async function release(): Promise<void> {
  runJob = null;
  const all = sessions;
  sessions = [];
  for (const s of all) await s.release();
}

const onMessage = async (msg: ToSlot): Promise<void> => {
  try {
    if (msg.type === 'load') {
      const spec = msg.spec;
      const info =
        spec.kind === 'vad'
          ? await loadVad(spec.model)
          : spec.kind === 'tensor'
            ? await loadTensor(spec.model)
            : spec.kind === 'denoise'
              ? await loadDenoise()
              : await loadWakeword(spec);
      post({ type: 'loaded', info });
    } else if (msg.type === 'run') {
      if (!runJob) throw new Error('slot has no model loaded');
      if (!port && ABORT_AT !== null && msg.job.kind === 'vad' && msg.job.windows[0] === ABORT_AT) process.abort();
      const start = performance.timeOrigin + performance.now();
      ran = true;
      const result = await runJob(msg.job);
      result.ran = [start, performance.timeOrigin + performance.now()];
      post({ type: 'result', seq: msg.seq, result }, transferList(result));
    } else if (msg.type === 'release') {
      await release();
      // A thread ends once nothing is left to run; a process once its channel is closed.
      if (port) port.close();
      else process.disconnect();
    }
  } catch (e) {
    post({ type: 'error', seq: msg.type === 'run' ? msg.seq : undefined, message: (e as Error).message ?? String(e) });
  }
};
/**
 * Messages are handled one after another, each once the one before has ended: the server sends
 * a job while the one before it still runs (up to SLOT_DEPTH), and a job's runs await.
 */
let turn: Promise<void> = Promise.resolve();
const inTurn = (msg: ToSlot): void => {
  turn = turn.then(() => onMessage(msg));
};
if (port) port.on('message', inTurn);
else {
  process.on('message', inTurn);
  const socket = new Socket({ fd: 4, readable: true, writable: true }).unref();
  // The server is gone or has closed the socket: 'disconnect' below ends the host.
  socket.on('error', () => {});
  // Frames are read into a buffer per region, reused (see FrameChannel's `reuse`): a job's arrays
  // live until its answer, and the job SLOT_DEPTH places later comes only after that.
  jobs = new FrameChannel<ToSlot, FromSlot>(socket, 6, 5, inTurn, () => process.exit(1), true, SLOT_DEPTH);
  // The server is gone (even killed with SIGKILL): no orphan host is left running.
  process.on('disconnect', () => process.exit(0));
  // 2 s without a job after some: one full garbage collection, then malloc's free pages back, as the server's main
  // process does when idle (docs/operations.md). A job's buffers are garbage once answered; nothing else collects them
  // in a host that idles, and what a burst of streams left stayed resident.
  new IdleCollector(() => {
    const busy = ran;
    ran = false;
    return busy;
  }, HOST_IDLE_GC_MS);
}
