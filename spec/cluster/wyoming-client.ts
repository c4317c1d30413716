/**
 * Test helper: a Wyoming client session (the protocol of wyoming-openwakeword: one JSON header
 * line, then its data and payload bytes) for the cluster specs.
 */
import { connect } from 'node:net';
import { fixture, until, WaveFile } from '../helpers.js';

/**
 * A Wyoming session on 127.0.0.1:`port`: `detect` hey_jarvis, the fixture `file` in 100 ms
 * `audio-chunk`s (one every `gapMs`, or all at once with 0), `audio-stop`; resolves with the
 * events (header type plus data) up to the first `detection`, `not-detected` or `error` once the
 * audio is all sent.
 * @param onChunk called after each chunk is written (tests count the audio under way).
 */
export async function wyomingSession(
  port: number,
  file: string,
  gapMs = 0,
  onChunk: () => void = () => {},
): Promise<Record<string, unknown>[]> {
  const socket = connect(port, '127.0.0.1');
  const events: Record<string, unknown>[] = [];
  let buf = Buffer.alloc(0);
  socket.on('data', (d: Buffer) => {
    buf = Buffer.concat([buf, d]);
    for (let nl = buf.indexOf('\n'); nl >= 0; nl = buf.indexOf('\n')) {
      const header = JSON.parse(buf.subarray(0, nl).toString());
      const dl = header.data_length ?? 0;
      if (buf.length < nl + 1 + dl + (header.payload_length ?? 0)) break;
      events.push({
        type: header.type,
        ...header.data,
        ...(dl ? JSON.parse(buf.subarray(nl + 1, nl + 1 + dl).toString()) : {}),
      });
      buf = buf.subarray(nl + 1 + dl + (header.payload_length ?? 0));
    }
  });
  const send = (type: string, data: Record<string, unknown>, payload?: Buffer): void => {
    const body = Buffer.from(JSON.stringify(data));
    socket.write(
      Buffer.concat([
        Buffer.from(`${JSON.stringify({ type, data_length: body.length, payload_length: payload?.length ?? 0 })}\n`),
        body,
        payload ?? Buffer.alloc(0),
      ]),
    );
  };
  const w = new WaveFile(fixture(file));
  const rate = (w.fmt as { sampleRate: number }).sampleRate;
  const pcm = Buffer.from((w.data as { samples: Uint8Array }).samples);
  const step = (rate / 10) * 2;
  send('detect', { names: ['hey_jarvis'] });
  send('audio-start', { rate, width: 2, channels: 1, timestamp: 0 });
  for (let o = 0, t = 0; o < pcm.length; o += step, t += 100) {
    send('audio-chunk', { rate, width: 2, channels: 1, timestamp: t }, pcm.subarray(o, o + step));
    onChunk();
    if (gapMs) await new Promise((r) => setTimeout(r, gapMs));
  }
  send('audio-stop', { timestamp: Math.round((pcm.length / 2 / rate) * 1000) });
  await until(
    () => events.some((e) => e.type === 'detection' || e.type === 'not-detected' || e.type === 'error'),
    30_000,
  );
  socket.end();
  return events;
}
