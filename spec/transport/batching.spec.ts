/** Dynamic batching across streams, processing lag, and POST /v1/tasks/batch, on real models and audio. */
import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import WebSocket from 'ws';
import { defaultCatalog, ServerConfig } from '../../runtime/config.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { calibrate, syntheticModel } from '../../tools/synth-model.js';
import { fixture, WaveFile } from '../helpers.js';

const silero = defaultCatalog().find((m) => m.id === 'silero-vad')!.path;
const jarvis = defaultCatalog().find((m) => m.id === 'hey-jarvis')!;
let server: VoxServer;
/** Run time of one window of the synthetic `slow` model, ms (calibrated on this machine). */
const SLOW_MS = 40;

beforeAll(async () => {
  const slow = join(mkdtempSync(join(tmpdir(), 'voxserve-lag-')), 'slow.onnx');
  writeFileSync(slow, syntheticModel(1, Math.max(1, Math.round(SLOW_MS / (await calibrate())))));
  server = await startServer(
    ServerConfig.parse({
      log_level: 'silent',
      port: 0,
      models: [
        { id: 'unbatched', task: 'vad', path: silero, max_batch_size: 1 },
        { id: 'batched', task: 'vad', path: silero, max_batch_size: 32, max_batch_delay_ms: 5 },
        { ...jarvis, id: 'wake-unbatched', max_batch_size: 1 },
        { ...jarvis, id: 'wake-batched', max_batch_size: 32, max_batch_delay_ms: 5 },
        { id: 'slow', task: 'vad', path: slow, max_batch_size: 1 },
      ],
    }),
  );
});
afterAll(async () => {
  await server?.close();
});

/** Streams a 16-bit WAV in 20 ms frames, paced every `paceMs`; returns the task events. */
function stream(model: string, wav: Buffer, paceMs: number): Promise<any[]> {
  const w = new WaveFile(wav);
  const fmt = w.fmt as { sampleRate: number; numChannels: number };
  const pcm = Buffer.from((w.data as { samples: Uint8Array }).samples);
  const frame = Math.round(fmt.sampleRate * 0.02) * 2 * fmt.numChannels;
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(
      `${server.url.replace('http', 'ws')}/v1/stream?model=${model}&sample_rate=${fmt.sampleRate}&channels=${fmt.numChannels}`,
    );
    const events: any[] = [];
    ws.on('error', reject);
    ws.on('message', async (d) => {
      const e = JSON.parse(d.toString());
      if (e.type !== 'ready') return void events.push(e);
      for (let off = 0; off < pcm.length; off += frame) {
        ws.send(pcm.subarray(off, off + frame));
        await new Promise((r) => setTimeout(r, paceMs));
      }
      ws.send(JSON.stringify({ type: 'end' }));
    });
    ws.on('close', () => resolve(events.filter((e) => e.type !== 'done')));
  });
}

async function metric(name: string, model: string): Promise<number> {
  const text = await (await fetch(`${server.url}/metrics`)).text();
  const line = text.split('\n').find((l) => l.startsWith(`${name}{`) && l.includes(`model="${model}"`));
  return line ? Number(line.split(' ').at(-1)) : 0;
}

describe('dynamic batching', () => {
  it('is invisible in results: 12 concurrent streams give the events of unbatched runs, and windows really share runs', async () => {
    const files = ['espeak_sentence_16k.wav', 'Front_Center.wav', 'Front_Left.wav', 'silence_3s_16k.wav'].map(fixture);
    const expected = await Promise.all(files.map((f) => stream('unbatched', f, 0)));
    expect(expected[0].some((e) => e.type === 'speech_end')).toBe(true);
    const got = await Promise.all(Array.from({ length: 12 }, (_, i) => stream('batched', files[i % files.length], 1)));
    got.forEach((events, i) => expect(events, `stream ${i}`).toEqual(expected[i % files.length]));
    const batches = await metric('voxserve_batch_size_count', 'batched');
    const windows = await metric('voxserve_batch_size_sum', 'batched');
    expect(batches).toBeGreaterThan(0);
    expect(windows / batches).toBeGreaterThan(1.5); // on average, windows of several streams per run
  });

  it('is invisible in wake-word results: 8 concurrent streams give the detections of unbatched runs, and steps really share jobs', async () => {
    const files = [
      'espeak_hey_jarvis_22k.wav',
      'espeak_alexa_16k.wav',
      'espeak_sentence_16k.wav',
      'Front_Center.wav',
    ].map(fixture);
    const expected = await Promise.all(files.map((f) => stream('wake-unbatched', f, 0)));
    expect(expected[0].some((e) => e.type === 'detection')).toBe(true);
    const got = await Promise.all(
      Array.from({ length: 8 }, (_, i) => stream('wake-batched', files[i % files.length], 1)),
    );
    // A detection's label is its model id: the two models differ only there.
    const relabel = (events: any[]) => events.map((e) => ({ ...e, label: 'hey-jarvis' }));
    got.forEach((events, i) => expect(relabel(events), `stream ${i}`).toEqual(relabel(expected[i % files.length])));
    const batches = await metric('voxserve_batch_size_count', 'wake-batched');
    const rows = await metric('voxserve_batch_size_sum', 'wake-batched');
    expect(batches).toBeGreaterThan(0);
    expect(rows / batches).toBeGreaterThan(1.5); // on average, steps of several streams per job
  });

  it('reports processing lag per window in status and metrics', async () => {
    await stream('batched', fixture('Front_Left.wav'), 5);
    const s = await (await fetch(`${server.url}/v1/models/batched`)).json();
    expect(s.processing_lag_ms).toMatchObject({ p50: expect.any(Number), p99: expect.any(Number) });
    expect(s.processing_lag_ms.p99).toBeGreaterThanOrEqual(s.processing_lag_ms.p50);
    expect(s.processing_lag_ms.windows).toBeGreaterThan(0);
    expect(await metric('voxserve_processing_lag_seconds_count', 'batched')).toBe(s.processing_lag_ms.windows);
  });

  it('processing lag is at least the inference: a model that runs about 40 ms per window lags about that much, one entry per window', async () => {
    const wav = fixture('espeak_sentence_16k.wav');
    const samples = (new WaveFile(wav).data as { samples: Uint8Array }).samples.length / 2;
    // Real time: each window's last sample arrives while the slot is free, so its lag is its job.
    await stream('slow', wav, 20);
    const s = await (await fetch(`${server.url}/v1/models/slow`)).json();
    expect(s.processing_lag_ms.windows).toBeGreaterThanOrEqual(Math.floor(samples / 512));
    // Half the calibrated run time: calibration is approximate on a shared machine.
    expect(s.processing_lag_ms.p50).toBeGreaterThanOrEqual(SLOW_MS / 2);
    expect(s.processing_lag_ms.p99).toBeGreaterThanOrEqual(s.processing_lag_ms.p50);
    expect(s.processing_lag_ms.p99).toBeLessThan(10_000);
    expect(await metric('voxserve_processing_lag_seconds_count', 'slow')).toBe(s.processing_lag_ms.windows);
    const sum = await metric('voxserve_processing_lag_seconds_sum', 'slow');
    expect(sum / s.processing_lag_ms.windows).toBeGreaterThanOrEqual(SLOW_MS / 2 / 1000);
  });
});

describe('POST /v1/tasks/batch', () => {
  it('streams one result per file as server-sent events with its index, an error for a bad file, then done', async () => {
    const names = ['Front_Center.wav', 'silence_3s_16k.wav', 'espeak_sentence_16k.wav'];
    const files = [...names.map((n) => fixture(n).toString('base64')), Buffer.from('not a wav').toString('base64')];
    const res = await fetch(`${server.url}/v1/tasks/batch`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ model: 'silero-vad', files }),
    });
    expect(res.status).toBe(200);
    expect(res.headers.get('content-type')).toBe('text/event-stream');
    const events = (await res.text())
      .trim()
      .split('\n\n')
      .map((block) => {
        const [ev, data] = block.split('\n');
        return { event: ev.slice('event: '.length), data: JSON.parse(data.slice('data: '.length)) };
      });
    expect(events.at(-1)).toMatchObject({ event: 'done', data: { files: 4, failed: 1 } });
    const results = events.filter((e) => e.event === 'result');
    expect(results.map((r) => r.data.index).sort()).toEqual([0, 1, 2]);
    for (const r of results) {
      const single = await (
        await fetch(`${server.url}/v1/tasks/run?model=silero-vad`, {
          method: 'POST',
          headers: { 'content-type': 'audio/wav' },
          body: new Uint8Array(fixture(names[r.data.index])),
        })
      ).json();
      expect(r.data.segments).toEqual(single.segments);
    }
    expect(events.find((e) => e.event === 'error')).toMatchObject({
      data: { index: 3, error: { type: 'invalid_request_error' } },
    });
  });

  it.each([
    [{ model: 'silero-vad' }, /^files:/],
    [{ model: 'silero-vad', files: [] }, /^files:/],
    [{ model: 'silero-vad', files: [42] }, /^files\.0:/],
    [{ files: ['AAAA'] }, /^model:/],
  ])('refuses %j with 400 naming the field', async (body, message) => {
    const res = await fetch(`${server.url}/v1/tasks/batch`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify(body),
    });
    expect(res.status).toBe(400);
    expect((await res.json()).error.message).toMatch(message);
  });
});
