/**
 * The /demo page: microphone -> AudioWorklet (capture-worklet.js, ~20 ms blocks at the
 * AudioContext's rate) -> libsamplerate (WASM, SINC_FASTEST) to 16 kHz -> s16le -> one
 * `voxserve/client` stream per chosen model. A canvas timeline draws the last
 * {@link WINDOW_MS} of audio: for each VAD model its speech-probability curve (the stream's
 * `probability` events) over its speech segments, and wake-word detections. With the denoise
 * toggle, the microphone also goes, at the AudioContext's own rate, to a denoise stream
 * (`rnnoise`), whose answered audio is played (WebAudio, in order) and drawn as a level beside the
 * microphone's.
 * The page is served by the server it calls (same origin, so the Origin check lets it in); the
 * API key field, when filled, goes on each stream as the subprotocol `voxserve.key.<key>`.
 */
import { ConverterType, create } from '@alexanderolsen/libsamplerate-js';
import { VoxClient, VoxClientError, type StreamEvent, type VoxStream } from '../client/index.js';
import './style.css';

/** Audio shown on the timeline, ms. */
const WINDOW_MS = 20_000;
const RATE = 16_000;

interface Lane {
  model: string;
  task: string;
  stream: VoxStream | null;
  /** Speech segments, ms of stream time; `end` null while open. */
  segments: { start: number; end: number | null }[];
  detections: { at: number; label: string; score: number }[];
  /** VAD: the speech probability of each 32 ms window, by its start, ms. */
  probs: { at: number; p: number }[];
  /** Wake words: each 80 ms step's highest score among the lane's labels, by the step's end, ms (`score` events). */
  scores: { at: number; p: number }[];
  status: string;
}

/** Status calls (`GET /v1/models`) need no key. */
const vox = new VoxClient();
const el = <T extends HTMLElement>(id: string): T => document.getElementById(id) as T;
const keyInput = el<HTMLInputElement>('key');
const canvas = el<HTMLCanvasElement>('timeline');
const startButton = el<HTMLButtonElement>('start');
const stopButton = el<HTMLButtonElement>('stop');
const status = el<HTMLSpanElement>('status');
const eventList = el<HTMLOListElement>('events');
const fileInput = el<HTMLInputElement>('file');
const denoiseToggle = el<HTMLInputElement>('denoise');

let lanes: Lane[] = [];
/** Audio sent so far, ms: the stream time of "now". */
let sentMs = 0;
let stopCapture: (() => Promise<void>) | null = null;
/** The denoise model the toggle streams to (the first the server lists), if any. */
let denoiseModel: string | null = null;

/**
 * The denoise toggle's stream while the microphone runs: the microphone at the AudioContext's
 * rate to the denoise model; what it answers is played from `playAt` on, chunk after chunk.
 */
interface Denoising {
  model: string;
  stream: VoxStream;
  rate: number;
  /** Where the next answered chunk starts playing, AudioContext time, s. */
  playAt: number;
  /** Per 20 ms of audio: the microphone's level and the denoised level, dBFS, by stream time, ms. */
  raw: { at: number; db: number }[];
  denoised: { at: number; db: number }[];
  /** Denoised samples received so far (they make the denoised levels' clock). */
  received: number;
  status: string;
}
let denoising: Denoising | null = null;

function say(text: string, error = false): void {
  status.textContent = text;
  status.className = error ? 'error' : 'muted';
}

/**
 * What to tell the user about a stream that failed. A browser is not told why a WebSocket
 * handshake was refused: from this page (same origin, the server reachable) that is almost
 * always a missing or wrong API key.
 */
function why(e: unknown): string {
  if (!(e instanceof VoxClientError)) return `cannot start: ${(e as Error).message}`;
  if (e.type !== 'connection_error' || e.closeCode !== 1006) return `${e.type}: ${e.message}`;
  return keyInput.value.trim()
    ? 'the server refused the stream: is the API key one of its auth.api_keys?'
    : 'the server refused the stream: if it sets auth.api_keys, enter an API key';
}

function logEvent(model: string, e: StreamEvent): void {
  const li = document.createElement('li');
  li.dataset.model = model;
  li.dataset.type = e.type;
  if (e.type === 'detection') li.dataset.label = e.label;
  const { type, ...rest } = e;
  li.textContent = `${(sentMs / 1000).toFixed(2).padStart(7)} s  ${model}  ${type} ${JSON.stringify(rest)}`;
  eventList.prepend(li);
  while (eventList.children.length > 300) eventList.lastElementChild!.remove();
}

/** RMS of each whole 20 ms block of `samples` ([-1, 1], `rate` Hz) from stream time `at` ms, dBFS (floor -80). */
function levels(samples: Float32Array, rate: number, at: number): { at: number; db: number }[] {
  const block = Math.round(rate / 50);
  const out: { at: number; db: number }[] = [];
  for (let o = 0; o + block <= samples.length; o += block) {
    let sum = 0;
    for (let i = o; i < o + block; i++) sum += samples[i] * samples[i];
    out.push({ at: at + (o * 1000) / rate, db: Math.max(-80, 10 * Math.log10(sum / block + 1e-12)) });
  }
  return out;
}

/** Keeps the last two timeline windows of 20 ms levels. */
function keep(list: { at: number; db: number }[], more: { at: number; db: number }[]): void {
  list.push(...more);
  if (list.length > 2 * (WINDOW_MS / 20)) list.splice(0, WINDOW_MS / 20);
}

/** A chunk of denoised audio (s16le at the stream's rate): played after the one before, and its level drawn. */
function playDenoised(ctx: AudioContext, d: Denoising, data: Uint8Array): void {
  // A copy: the chunk's bytes may start at an odd offset.
  const pcm = new Int16Array(data.slice().buffer);
  if (!pcm.length) return;
  const samples = Float32Array.from(pcm, (v) => v / 32768);
  // The last answers come after Stop has closed the context: drawn, not played.
  if (ctx.state !== 'closed') {
    const buffer = ctx.createBuffer(1, samples.length, d.rate);
    buffer.copyToChannel(samples, 0);
    const source = ctx.createBufferSource();
    source.buffer = buffer;
    source.connect(ctx.destination);
    // A little ahead of now, so that chunks arriving unevenly still play back to back.
    d.playAt = Math.max(d.playAt, ctx.currentTime + 0.1);
    source.start(d.playAt);
    d.playAt += buffer.duration;
  }
  keep(d.denoised, levels(samples, d.rate, (d.received * 1000) / d.rate));
  d.received += samples.length;
  // For the page's test: denoised audio played so far, chunks and ms.
  canvas.dataset.denoisedChunks = String(Number(canvas.dataset.denoisedChunks ?? 0) + 1);
  canvas.dataset.denoisedMs = String(Math.round((d.received * 1000) / d.rate));
}

function onEvent(lane: Lane, e: StreamEvent): void {
  if (e.type === 'score') {
    lane.scores.push({ at: e.at_ms, p: Math.max(...Object.values(e.scores)) });
    if (lane.scores.length > 2 * (WINDOW_MS / 80)) lane.scores.splice(0, WINDOW_MS / 80);
    // For the page's test: score steps drawn so far.
    canvas.dataset.scoreSteps = String(Number(canvas.dataset.scoreSteps ?? 0) + 1);
    return;
  }
  if (e.type === 'probability') {
    if (typeof e.p === 'number') lane.probs.push({ at: e.at_ms, p: e.p });
    else e.p.forEach((p, i) => lane.probs.push({ at: e.at_ms + i * 32, p }));
    // Keep what the timeline shows.
    if (lane.probs.length > 2 * (WINDOW_MS / 32)) lane.probs.splice(0, WINDOW_MS / 32);
    // For the page's test: windows drawn so far.
    canvas.dataset.probabilityWindows = String(
      Number(canvas.dataset.probabilityWindows ?? 0) + (typeof e.p === 'number' ? 1 : e.p.length),
    );
    return;
  }
  logEvent(lane.model, e);
  if (e.type === 'speech_start') lane.segments.push({ start: e.at_ms, end: null });
  if (e.type === 'speech_end') {
    const open = lane.segments.at(-1);
    if (open && open.end === null) Object.assign(open, { start: e.start_ms, end: e.end_ms });
    else lane.segments.push({ start: e.start_ms, end: e.end_ms });
  }
  if (e.type === 'detection') lane.detections.push({ at: e.at_ms, label: e.label, score: e.score });
}

async function listModels(): Promise<void> {
  const box = el<HTMLFieldSetElement>('models');
  try {
    const models = await vox.models();
    const wanted = new URLSearchParams(location.search).get('models')?.split(',') ?? ['silero-vad', 'hey-jarvis'];
    box.replaceChildren(Object.assign(document.createElement('legend'), { textContent: 'models' }));
    // A denoise model answers audio, not events: the denoise toggle streams to it.
    denoiseModel = models.find((m) => m.task === 'denoise')?.id ?? null;
    denoiseToggle.disabled = denoiseModel === null;
    for (const m of models.filter((x) => x.task !== 'denoise')) {
      const label = document.createElement('label');
      const input = Object.assign(document.createElement('input'), {
        type: 'checkbox',
        value: m.id,
        checked: wanted.includes(m.id),
      });
      input.dataset.task = m.task;
      label.append(
        input,
        ` ${m.id} `,
        Object.assign(document.createElement('span'), { className: 'muted', textContent: `(${m.task})` }),
      );
      box.append(label);
    }
    startButton.disabled = false;
  } catch (e) {
    say(`cannot list models: ${(e as Error).message}`, true);
  }
}

const newLane = (c: { model: string; task: string }): Lane => ({
  ...c,
  stream: null,
  segments: [],
  detections: [],
  probs: [],
  scores: [],
  status: 'opening',
});

/** The ticked models. */
const chosenModels = (): { model: string; task: string }[] =>
  [...document.querySelectorAll<HTMLInputElement>('#models input:checked')].map((i) => ({
    model: i.value,
    task: i.dataset.task ?? '',
  }));

/** A client with the page's API key, if one is entered. @throws TypeError for a bad key. */
const keyedClient = (): VoxClient => (keyInput.value.trim() ? new VoxClient({ apiKey: keyInput.value.trim() }) : vox);

/**
 * The file picker: each ticked model runs on the chosen file (`POST /v1/tasks/run`: any format
 * the server decodes, WAV, MP3, Ogg, FLAC, WebM), and the timeline shows its results over the
 * file's time: segments, detections and (wake words) each step's score.
 */
async function runFile(file: File): Promise<void> {
  const chosen = chosenModels();
  if (!chosen.length) return say('choose at least one model', true);
  let client: VoxClient;
  try {
    client = keyedClient();
  } catch (e) {
    return say((e as Error).message, true);
  }
  lanes = chosen.map((c) => newLane(c));
  sentMs = 0;
  say(`running ${file.name} on ${lanes.map((l) => l.model).join(', ')} ...`);
  await Promise.all(
    lanes.map(async (lane) => {
      try {
        const r = await client.run(file, {
          model: lane.model,
          options: lane.task === 'wakeword' ? { scores: true } : undefined,
        });
        sentMs = Math.max(sentMs, r.timing.audio_duration_ms);
        if (r.task === 'vad')
          for (const s of r.segments) {
            onEvent(lane, { type: 'speech_start', at_ms: s.start_ms });
            onEvent(lane, { type: 'speech_end', start_ms: s.start_ms, end_ms: s.end_ms, confidence: s.confidence });
          }
        else {
          for (const s of r.scores ?? []) onEvent(lane, { type: 'score', ...s });
          for (const d of r.detections) onEvent(lane, { type: 'detection', ...d });
        }
        lane.status = 'done';
      } catch (e) {
        lane.status = e instanceof VoxClientError ? `${e.type}: ${e.message}` : String(e);
        say(`${lane.model}: ${lane.status}`, true);
      }
    }),
  );
  if (lanes.every((l) => l.status === 'done')) say(`${file.name}: ${(sentMs / 1000).toFixed(2)} s`);
  fileInput.value = '';
}

/** Float samples in [-1, 1] as 16-bit PCM. */
function toS16(samples: Float32Array): Int16Array {
  const pcm = new Int16Array(samples.length);
  for (let i = 0; i < samples.length; i++) {
    const v = Math.max(-1, Math.min(1, samples[i]));
    pcm[i] = v < 0 ? v * 0x8000 : v * 0x7fff;
  }
  return pcm;
}

async function start(): Promise<void> {
  const chosen = chosenModels();
  if (!chosen.length && !denoiseToggle.checked) return say('choose at least one model, or denoise', true);
  startButton.disabled = true;
  let client: VoxClient;
  try {
    client = keyedClient();
  } catch (e) {
    startButton.disabled = false;
    return say((e as Error).message, true);
  }
  say('opening the microphone ...');
  lanes = chosen.map((c) => newLane(c));
  sentMs = 0;
  let mic: MediaStream | null = null;
  let ctx: AudioContext | null = null;
  try {
    mic = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false },
    });
    ctx = new AudioContext();
    await ctx.audioWorklet.addModule(`${import.meta.env.BASE_URL}capture-worklet.js`);
    const resampler =
      ctx.sampleRate === RATE
        ? null
        : await create(1, ctx.sampleRate, RATE, { converterType: ConverterType.SRC_SINC_FASTEST });
    if (denoiseToggle.checked && denoiseModel) {
      // The microphone at its own rate: RNNoise runs at 48 kHz, and the answer comes back at this rate to play.
      const model = denoiseModel;
      const stream = await client.stream({ model, sampleRate: ctx.sampleRate, encoding: 's16le' });
      const d: Denoising = {
        model,
        stream,
        rate: ctx.sampleRate,
        playAt: 0,
        raw: [],
        denoised: [],
        received: 0,
        status: 'streaming',
      };
      denoising = d;
      const playTo = ctx;
      void (async () => {
        try {
          for await (const e of stream) {
            if (e.type === 'audio') playDenoised(playTo, d, e.data);
            else logEvent(model, e);
          }
          d.status = 'done';
        } catch (err) {
          d.status = err instanceof VoxClientError ? `${err.type}: ${err.message}` : String(err);
          say(`${model}: ${d.status}`, true);
        }
      })();
    } else denoising = null;
    say(`connecting ${lanes.length} stream(s) ...`);
    await Promise.all(
      lanes.map(async (lane) => {
        // VAD streams send their speech probabilities, 100 ms of windows per event.
        lane.stream = await client.stream({
          model: lane.model,
          sampleRate: RATE,
          encoding: 's16le',
          probabilities: lane.task === 'vad' ? 100 : undefined,
          // Wake words send each step's score: how close a wake word that does not fire came.
          scores: lane.task === 'wakeword' ? true : undefined,
        });
        lane.status = 'streaming';
        const stream = lane.stream;
        void (async () => {
          try {
            for await (const e of stream) onEvent(lane, e);
            lane.status = 'done';
          } catch (err) {
            lane.status = err instanceof VoxClientError ? `${err.type}: ${err.message}` : String(err);
            say(`${lane.model}: ${lane.status}`, true);
          }
        })();
      }),
    );
    const source = ctx.createMediaStreamSource(mic);
    // Blocks of 20 ms.
    const capture = new AudioWorkletNode(ctx, 'voxserve-capture', {
      processorOptions: { blockFrames: Math.round(ctx.sampleRate / 50) },
    });
    const mute = ctx.createGain();
    mute.gain.value = 0;
    source.connect(capture).connect(mute).connect(ctx.destination);
    const d = denoising;
    const micRate = ctx.sampleRate;
    capture.port.onmessage = (m: MessageEvent<Float32Array>) => {
      if (d) {
        keep(d.raw, levels(m.data, micRate, sentMs));
        d.stream.send(toS16(m.data)).catch(() => {});
      }
      const samples = resampler ? resampler.full(m.data).slice() : m.data;
      sentMs += (samples.length * 1000) / RATE;
      const pcm = toS16(samples);
      for (const lane of lanes) lane.stream?.send(pcm).catch(() => {});
    };
    const [m, c] = [mic, ctx];
    stopCapture = async () => {
      capture.port.onmessage = null;
      for (const t of m.getTracks()) t.stop();
      await c.close();
      resampler?.destroy();
      await Promise.all([...lanes.map((l) => l.stream?.end().catch(() => {})), d?.stream.end().catch(() => {})]);
    };
    stopButton.disabled = false;
    const to = [...lanes.map((l) => l.model), ...(d ? [`${d.model} (at ${d.rate} Hz, played back)`] : [])];
    say(`streaming at 16 kHz (microphone at ${ctx.sampleRate} Hz) to ${to.join(', ')}`);
  } catch (e) {
    for (const t of mic?.getTracks() ?? []) t.stop();
    await ctx?.close().catch(() => {});
    for (const lane of lanes) lane.stream?.close();
    denoising?.stream.close();
    denoising = null;
    startButton.disabled = false;
    say(why(e), true);
  }
}

async function stop(): Promise<void> {
  stopButton.disabled = true;
  await stopCapture?.();
  stopCapture = null;
  startButton.disabled = false;
  say('stopped');
}

/** Draws the last WINDOW_MS of stream time: a time grid, then one row per model. */
function draw(): void {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth;
  const h = canvas.clientHeight;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
  }
  const g = canvas.getContext('2d')!;
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, w, h);
  const left = 120;
  const end = Math.max(sentMs, WINDOW_MS);
  const t0 = end - WINDOW_MS;
  const x = (t: number): number => left + ((t - t0) / WINDOW_MS) * (w - left - 8);
  const d = denoising;
  const rows = lanes.length + (d ? 1 : 0);
  const rowH = (h - 22) / Math.max(rows, 2);
  g.font = '12px system-ui, sans-serif';
  g.textBaseline = 'middle';
  // Time grid: a line a second, labelled every 5 s.
  for (let s = Math.ceil(t0 / 1000); s * 1000 <= end; s++) {
    g.strokeStyle = s % 5 === 0 ? '#c5cbd8' : '#eceff5';
    g.beginPath();
    g.moveTo(x(s * 1000), 0);
    g.lineTo(x(s * 1000), h - 18);
    g.stroke();
    if (s % 5 === 0) {
      g.fillStyle = '#6b7385';
      g.fillText(`${s} s`, x(s * 1000) - 8, h - 9);
    }
  }
  const label = (row: number, text: string, sub = ''): void => {
    g.fillStyle = '#1d2330';
    g.fillText(text, 6, rowH * row + rowH / 2 - (sub ? 7 : 0));
    if (sub) {
      g.fillStyle = '#6b7385';
      g.fillText(sub, 6, rowH * row + rowH / 2 + 8);
    }
  };
  lanes.forEach((lane, row) => {
    const top = rowH * row + 4;
    g.strokeStyle = '#eceff5';
    g.beginPath();
    g.moveTo(0, rowH * row);
    g.lineTo(w, rowH * row);
    g.stroke();
    label(
      row,
      lane.model,
      lane.task === 'wakeword' ? 'wake word' : lane.task === 'vad' ? 'speech probability' : lane.task,
    );
    for (const s of lane.segments) {
      const a = Math.max(t0, s.start);
      const b = s.end ?? sentMs;
      if (b < t0) continue;
      g.fillStyle = s.end === null ? 'rgba(46,139,87,0.3)' : 'rgba(46,139,87,0.45)';
      g.fillRect(x(a), top, Math.max(2, x(b) - x(a)), rowH - 8);
    }
    // The speech probability, 0 at the bottom of the row and 1 at its top.
    if (lane.probs.length) {
      g.strokeStyle = '#1d4f91';
      g.lineWidth = 1.5;
      g.beginPath();
      let first = true;
      for (const p of lane.probs) {
        if (p.at + 32 < t0) continue;
        const px = x(Math.max(t0, p.at + 16));
        const py = top + (1 - p.p) * (rowH - 8);
        if (first) g.moveTo(px, py);
        else g.lineTo(px, py);
        first = false;
      }
      g.stroke();
      g.lineWidth = 1;
    }
    // A wake word's score (the highest of its labels) at each 80 ms step, 0 at the bottom, 1 at the top.
    if (lane.scores.length) {
      g.strokeStyle = '#e0701b';
      g.lineWidth = 1.5;
      g.beginPath();
      let first = true;
      for (const p of lane.scores) {
        if (p.at < t0) continue;
        const px = x(p.at);
        const py = top + (1 - p.p) * (rowH - 8);
        if (first) g.moveTo(px, py);
        else g.lineTo(px, py);
        first = false;
      }
      g.stroke();
      g.lineWidth = 1;
    }
    for (const d of lane.detections) {
      if (d.at < t0) continue;
      g.fillStyle = '#e0701b';
      g.fillRect(x(d.at) - 2, top, 4, rowH - 8);
      g.fillText(`${d.label} ${d.score.toFixed(2)}`, x(d.at) + 5, top + (rowH - 8) / 2);
    }
    if (lane.status !== 'streaming') {
      g.fillStyle = lane.status.includes(':') ? '#b3261e' : '#6b7385';
      g.fillText(lane.status, left + 6, top + 10);
    }
  });
  if (d) {
    // The denoise row: the microphone's level and the denoised level, -80 dBFS at the bottom, 0 at the top.
    const row = lanes.length;
    const top = rowH * row + 4;
    g.strokeStyle = '#eceff5';
    g.beginPath();
    g.moveTo(0, rowH * row);
    g.lineTo(w, rowH * row);
    g.stroke();
    label(row, d.model, 'raw / denoised');
    for (const [list, colour] of [
      [d.raw, '#9aa3b5'],
      [d.denoised, '#1d4f91'],
    ] as const) {
      g.strokeStyle = colour;
      g.lineWidth = 1.5;
      g.beginPath();
      let first = true;
      for (const p of list) {
        if (p.at < t0) continue;
        const py = top + (-p.db / 80) * (rowH - 8);
        if (first) g.moveTo(x(p.at), py);
        else g.lineTo(x(p.at), py);
        first = false;
      }
      g.stroke();
      g.lineWidth = 1;
    }
    if (d.status !== 'streaming') {
      g.fillStyle = d.status.includes(':') ? '#b3261e' : '#6b7385';
      g.fillText(d.status, left + 6, top + 10);
    }
  }
  requestAnimationFrame(draw);
}

startButton.addEventListener('click', () => void start());
fileInput.addEventListener('change', () => {
  const file = fileInput.files?.[0];
  if (file) void runFile(file);
});
stopButton.addEventListener('click', () => void stop());
requestAnimationFrame(draw);
void listModels();
