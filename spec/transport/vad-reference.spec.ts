/**
 * VAD results against independent reference values (spec/fixtures/REFERENCE.jsonl: silero-vad's
 * `get_speech_timestamps` computed by a separate implementation, see spec/fixtures/README.md), on
 * the file route and over a stream, for every WAV fixture. Tolerance as the reference's README
 * gives it: each boundary within one window (32 ms) for 16 kHz audio, within 300 ms for audio the
 * server resamples.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import WebSocket from 'ws';
import { ServerConfig } from '../../runtime/config.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { expectSegments, fixture, references, WaveFile } from '../helpers.js';

/** Each embedded Silero VAD and the reference values it must give. */
const MODELS = [
  { model: 'silero-vad', segments: 'segments_v6' },
  { model: 'silero-vad-v5', segments: 'segments' },
] as const;

/** The WAV fixtures (compressed input is checked in input.spec.ts). */
const wavs = references().filter((r) => r.file.endsWith('.wav'));

let server: VoxServer;
beforeAll(async () => {
  server = await startServer(ServerConfig.parse({ log_level: 'silent', port: 0 }));
});
afterAll(async () => {
  await server?.close();
});

const rateOf = (wav: Buffer): number => (new WaveFile(wav).fmt as { sampleRate: number }).sampleRate;

/**
 * Streams a WAV's PCM (s16le at its own rate, mono) in 100 ms frames; resolves with its `speech_end` events (the
 * segments).
 */
function streamSegments(model: string, wav: Buffer): Promise<{ start_ms: number; end_ms: number }[]> {
  const w = new WaveFile(wav);
  const { sampleRate, numChannels } = w.fmt as { sampleRate: number; numChannels: number };
  const pcm = Buffer.from((w.data as { samples: Uint8Array }).samples);
  const frame = (sampleRate / 10) * 2 * numChannels;
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(
      `${server.url.replace('http', 'ws')}/v1/stream?model=${model}&sample_rate=${sampleRate}&channels=${numChannels}`,
    );
    const segments: { start_ms: number; end_ms: number }[] = [];
    ws.on('error', reject);
    ws.on('message', (d) => {
      const e = JSON.parse(d.toString());
      if (e.type === 'speech_end') segments.push({ start_ms: e.start_ms, end_ms: e.end_ms });
      if (e.type === 'error') reject(new Error(JSON.stringify(e)));
      if (e.type !== 'ready') return;
      for (let o = 0; o < pcm.length; o += frame) ws.send(pcm.subarray(o, o + frame));
      ws.send(JSON.stringify({ type: 'end' }));
    });
    ws.on('close', (code) => (code === 1000 ? resolve(segments) : reject(new Error(`closed ${code}`))));
  });
}

describe.each(MODELS)('$model against REFERENCE.jsonl ($segments)', ({ model, segments }) => {
  it.each(wavs.map((r) => [r.file, r] as const))('file route: %s', async (_f, ref) => {
    const wav = fixture(ref.file);
    const res = await fetch(`${server.url}/v1/tasks/run?model=${model}`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: new Uint8Array(wav),
    });
    expect(res.status).toBe(200);
    const body = await res.json();
    expect(body).toMatchObject({ model, task: 'vad', sample_rate: 16000 });
    expect(Math.abs(body.timing.audio_duration_ms - ref.seconds * 1000)).toBeLessThanOrEqual(10);
    expectSegments(body.segments, ref[segments], rateOf(wav) === 16_000 ? 32 : 300);
  });

  it.each(wavs.map((r) => [r.file, r] as const))('stream: %s', async (_f, ref) => {
    const wav = fixture(ref.file);
    expectSegments(await streamSegments(model, wav), ref[segments], rateOf(wav) === 16_000 ? 32 : 300);
  });
});
