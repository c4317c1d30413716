/**
 * The Wyoming framing parser alone: events as the Wyoming README "Format" defines them, built
 * here byte by byte, cut into segments every which way.
 */
import { describe, expect, it } from 'vitest';
import { WyomingFramingError, WyomingParser } from '../../transport/wyoming.js';

/** One event as bytes: header line, data section, payload (as wyoming's Python writer sends them). */
function frame(type: string, data?: Record<string, unknown>, payload?: Buffer): Buffer {
  const body = data ? Buffer.from(JSON.stringify(data)) : Buffer.alloc(0);
  const header = { type, data_length: body.length, payload_length: payload?.length ?? 0 };
  return Buffer.concat([Buffer.from(`${JSON.stringify(header)}\n`), body, payload ?? Buffer.alloc(0)]);
}

/** Feeds `bytes` in pieces of the given sizes (cycled), collecting every event. */
function feed(parser: WyomingParser, bytes: Buffer, sizes: number[]) {
  const events = [];
  for (let at = 0, i = 0; at < bytes.length; i++) {
    const n = sizes[i % sizes.length];
    events.push(...parser.push(bytes.subarray(at, at + n)));
    at += n;
  }
  return events;
}

describe('WyomingParser', () => {
  const payload = Buffer.from(Array.from({ length: 3000 }, (_, i) => (i * 7) % 256));
  const stream = Buffer.concat([
    frame('describe'),
    Buffer.from('\n\n'),
    frame('detect', { names: ['alexa'] }),
    Buffer.from(`${JSON.stringify({ type: 'audio-start', data: { rate: 16000, width: 2, channels: 1 } })}\n`),
    frame('audio-chunk', { rate: 16000, width: 2, channels: 1, timestamp: 0 }, payload),
    frame('audio-stop', { timestamp: 93 }),
  ]);
  const expected = [
    { type: 'describe', data: {}, payload: null },
    { type: 'detect', data: { names: ['alexa'] }, payload: null },
    { type: 'audio-start', data: { rate: 16000, width: 2, channels: 1 }, payload: null },
    { type: 'audio-chunk', data: { rate: 16000, width: 2, channels: 1, timestamp: 0 }, payload },
    { type: 'audio-stop', data: { timestamp: 93 }, payload: null },
  ];

  it.each([[[stream.length]], [[1]], [[2, 3, 5]], [[50]], [[1000, 1]], [[4096]]])(
    'the same events however the bytes are cut (pieces of %j bytes)',
    (sizes) => {
      expect(feed(new WyomingParser(4096, 65536), stream, sizes)).toEqual(expected);
    },
  );

  it('a header line over the limit is an error even when it comes in pieces', () => {
    const p = new WyomingParser(100, 1000);
    expect(() => feed(p, Buffer.from(`{"type":"x","pad":"${'y'.repeat(200)}"}\n`), [10])).toThrow(
      new WyomingFramingError('header line over 100 bytes'),
    );
  });

  it('item 3 (#25): a 1 MB payload in 50-byte pieces copies each byte at most once (not every buffered byte on every piece)', () => {
    const big = Buffer.alloc(1_000_000, 1);
    const bytes = frame('audio-chunk', { rate: 16000, width: 2, channels: 1 }, big);
    const once = new WyomingParser(4096, 2 * 1024 * 1024);
    // (Buffer.equals: vitest's deep equality walks a megabyte slowly.)
    expect(feed(once, bytes, [bytes.length]).map((e) => e.payload?.equals(big))).toEqual([true]);
    const trickled = new WyomingParser(4096, 2 * 1024 * 1024);
    expect(feed(trickled, bytes, [50]).map((e) => e.payload?.equals(big))).toEqual([true]);
    // At once: the payload is copied out of the segment once. In 50-byte pieces: still once (a
    // parser that joins all it holds on every piece copies about 20,000 x 0.5 MB = 10 GB).
    expect(once.copiedBytes).toBeLessThanOrEqual(bytes.length);
    expect(trickled.copiedBytes).toBeLessThanOrEqual(bytes.length);
  });
});
