import { createRequire } from 'node:module';
import { describe, expect, it } from 'vitest';
import { decodeWav, PcmStreamDecoder, Resampler, resample, SPARE_CONVERTERS } from '../../runtime/audio/audio.js';
import { VoxError } from '../../runtime/errors.js';
import { fixture, toneWav } from '../helpers.js';

function rms(x: Float32Array): number {
  let s = 0;
  for (const v of x) s += v * v;
  return Math.sqrt(s / x.length);
}

describe('decodeWav', () => {
  it.each(['8', '16', '24', '32', '32f'])('decodes %s-bit PCM to float32 at the same level', (bitDepth) => {
    const a = decodeWav(toneWav({ rate: 22050, channels: 1, bitDepth, frames: 2205 }));
    expect(a.sampleRate).toBe(22050);
    expect(a.samples.length).toBe(2205);
    // A sine of amplitude 0.5 has an RMS of 0.5 / sqrt(2).
    expect(rms(a.samples)).toBeCloseTo(0.5 / Math.SQRT2, 2);
  });

  it('downmixes channels by averaging', () => {
    const a = decodeWav(toneWav({ rate: 16000, channels: 3, bitDepth: '16', frames: 1600 }));
    expect(a.samples.length).toBe(1600);
    expect(rms(a.samples)).toBeCloseTo(0.5 / Math.SQRT2, 2);
  });

  it('reads the 48 kHz human recording', () => {
    const a = decodeWav(fixture('Front_Center.wav'));
    expect(a.sampleRate).toBe(48000);
    expect(a.samples.length).toBeGreaterThan(48000);
  });

  it.each([
    ['an empty body', Buffer.alloc(0), /empty body/],
    ['bytes that are not a WAV file', Buffer.from('hello, this is not audio at all, not at all'), /not a readable WAV/],
  ])('rejects %s with a 400 naming the problem', (_name, bytes, message) => {
    expect(() => decodeWav(bytes)).toThrow(message);
    try {
      decodeWav(bytes);
    } catch (e) {
      expect((e as VoxError).status).toBe(400);
    }
  });

  it('rejects a WAV with no samples', () => {
    const w = toneWav({ rate: 16000, channels: 1, bitDepth: '16', frames: 0 });
    expect(() => decodeWav(w)).toThrow(/no samples/);
  });

  it('reads a WAV streamed with unknown sizes (RIFF and data sizes 0xFFFFFFFF, as ffmpeg writes to a pipe) to its end', () => {
    const w = toneWav({ rate: 16000, channels: 1, bitDepth: '16', frames: 1600 });
    w.writeUInt32LE(0xffffffff, 4);
    w.writeUInt32LE(0xffffffff, 40); // the data chunk's size
    expect(decodeWav(w).samples.length).toBe(1600);
  });

  it('rejects a compressed encoding (MS ADPCM) by its format code', () => {
    const w = toneWav({ rate: 8000, channels: 1, bitDepth: '16', frames: 800 });
    w.writeUInt16LE(2, 20); // fmt audioFormat = 2 (MS ADPCM)
    w.writeUInt16LE(4, 34); // bitsPerSample 4
    expect(() => decodeWav(w)).toThrow(/unsupported WAV encoding \(format code 2\); send PCM, float, mu-law or A-law/);
  });

  it('rejects a sample rate out of range', () => {
    const w = toneWav({ rate: 16000, channels: 1, bitDepth: '16', frames: 100 });
    w.writeUInt32LE(4000, 24);
    expect(() => decodeWav(w)).toThrow(/sample_rate: 4000 Hz is out of range/);
  });
});

describe('resample', () => {
  it('changes the length by the rate ratio and keeps the level', async () => {
    const a = decodeWav(toneWav({ rate: 48000, channels: 1, bitDepth: '16', frames: 48000 }));
    const out = await resample(a.samples, 48000, 16000);
    expect(Math.abs(out.length - 16000)).toBeLessThanOrEqual(2);
    expect(rms(out.subarray(100, 15900))).toBeCloseTo(0.5 / Math.SQRT2, 2);
  });

  it('is the identity at equal rates', async () => {
    const x = new Float32Array([0.1, 0.2]);
    expect(await resample(x, 16000, 16000)).toBe(x);
  });
});

describe('PcmStreamDecoder', () => {
  it('reassembles samples split across frames and downmixes stereo s16le', async () => {
    const d = await PcmStreamDecoder.create('s16le', 16000, 2);
    const bytes = Buffer.alloc(8);
    bytes.writeInt16LE(16384, 0); // L0
    bytes.writeInt16LE(0, 2); // R0
    bytes.writeInt16LE(-16384, 4); // L1
    bytes.writeInt16LE(-16384, 6); // R1
    const a = d.push(bytes.subarray(0, 5)); // one frame and one byte of the next
    const b = d.push(bytes.subarray(5));
    expect([...a]).toEqual([0.25]);
    expect([...b]).toEqual([-0.5]);
    d.close();
  });

  it('decodes f32le', async () => {
    const d = await PcmStreamDecoder.create('f32le', 16000, 1);
    const bytes = Buffer.alloc(8);
    bytes.writeFloatLE(0.5, 0);
    bytes.writeFloatLE(-0.25, 4);
    expect([...d.push(bytes)]).toEqual([0.5, -0.25]);
  });

  it('item 2 (#25): reformat() re-initialises the converter in place: the new format decodes as a fresh decoder of it does, and no converter is created', async () => {
    const tone = (rate: number, channels: number, n: number): Buffer => {
      const b = Buffer.alloc(n * 2 * channels);
      for (let i = 0; i < n; i++)
        for (let c = 0; c < channels; c++)
          b.writeInt16LE(Math.round(12000 * Math.sin((2 * Math.PI * 440 * i) / rate)), 2 * (i * channels + c));
      return b;
    };
    const run = (d: PcmStreamDecoder, pcm: Buffer): number[] => [
      ...d.push(pcm.subarray(0, 3000)),
      ...d.push(pcm.subarray(3000)),
      ...d.end(),
    ];
    const d = await PcmStreamDecoder.create('s16le', 48000, 1);
    d.push(tone(48000, 1, 4800));
    d.end();
    const created = Resampler.created;
    for (const [rate, channels] of [
      [22050, 2],
      [16000, 1],
      [44100, 1],
    ]) {
      await d.reformat(rate, channels);
      const pcm = tone(rate, channels, Math.floor(rate / 4));
      const fresh = await PcmStreamDecoder.create('s16le', rate, channels);
      const want = run(fresh, pcm);
      fresh.close();
      const got = run(d, pcm);
      expect(got.length).toBe(want.length);
      expect(Math.max(...got.map((v, i) => Math.abs(v - want[i])))).toBeLessThan(1e-6);
    }
    // The fresh decoders above made one converter at most (16 kHz needs none; each closed one's
    // converter serves the next, see 'a closed resampler ...'); the reformatted one none.
    const made = Resampler.created - created;
    expect(made).toBeLessThanOrEqual(1);
    for (let i = 0; i < 200; i++) await d.reformat(i % 2 ? 16000 : 48000, 1);
    expect(Resampler.created - created).toBe(made);
    d.close();
  });

  it.each([
    [0, 1, /sample_rate/],
    [16000, 0, /channels/],
    [16000, 33, /channels/],
    [400000, 1, /sample_rate/],
  ])('rejects sample_rate %i, channels %i', async (rate, channels, message) => {
    await expect(PcmStreamDecoder.create('s16le', rate, channels)).rejects.toThrow(message);
  });
});

describe('Resampler: converters of closed resamplers are reused', () => {
  const LibSampleRate = createRequire(import.meta.url)(
    '@alexanderolsen/libsamplerate-js',
  ) as typeof import('@alexanderolsen/libsamplerate-js');
  /** 8 kHz chunks of a 440 Hz tone at 0.4, 20 ms each (a telephone stream's frames). */
  const chunks = Array.from({ length: 30 }, (_, k) =>
    Float32Array.from({ length: 160 }, (_, i) => 0.4 * Math.sin((2 * Math.PI * 440 * (k * 160 + i)) / 8000)),
  );
  /** The library's own converter, fresh, chunk by chunk: the reference. */
  async function reference(fromHz: number): Promise<number[][]> {
    const src = await LibSampleRate.create(1, fromHz, 16000, {
      converterType: LibSampleRate.ConverterType.SRC_SINC_FASTEST,
    });
    try {
      return chunks.map((c) => [...src.full(c)]);
    } finally {
      src.destroy();
    }
  }

  it('a stream after many opened and closed at 8 and 48 kHz creates no converter, and resamples exactly as a fresh libsamplerate converter does', async () => {
    const want = await reference(8000);
    (await Resampler.create(8000)).close(); // a spare exists from here on
    const created = Resampler.created;
    for (let i = 0; i < 50; i++) {
      const r = await Resampler.create(i % 2 ? 48000 : 8000);
      r.push(chunks[0]); // leaves filter state behind
      r.close();
    }
    const r = await Resampler.create(8000);
    const got = chunks.map((c) => [...r.push(c)]);
    r.close();
    expect(Resampler.created - created).toBe(0);
    expect(got).toEqual(want);
  });

  it('close() is idempotent and a closed resampler refuses work: two streams never share a converter', async () => {
    const want = await reference(8000);
    const r = await Resampler.create(8000);
    r.close();
    r.close();
    expect(() => r.push(chunks[0])).toThrow(/closed/);
    expect(() => r.flush()).toThrow(/closed/);
    await expect(r.reset(8000)).rejects.toThrow(/closed/);
    // Two live streams, their chunks interleaved: a shared converter would mix their filter states.
    const [a, b] = [await Resampler.create(8000), await Resampler.create(8000)];
    const outA: number[][] = [];
    const outB: number[][] = [];
    for (const c of chunks) {
      outA.push([...a.push(c)]);
      outB.push([...b.push(c)]);
    }
    a.close();
    b.close();
    expect(outA).toEqual(want);
    expect(outB).toEqual(want);
  });

  it.each([
    [48000, 8000, 600_000],
    [8000, 11025, 520_000],
  ])(
    'a converter made for %i Hz and reused at %i Hz takes a push of %i samples as a fresh one does (breaker: cut short; a RangeError)',
    async (first, rate, n) => {
      const signal = Float32Array.from({ length: n }, (_, i) => 0.3 * Math.sin((2 * Math.PI * 300 * i) / rate));
      const src = await LibSampleRate.create(1, rate, 16000, {
        converterType: LibSampleRate.ConverterType.SRC_SINC_FASTEST,
      });
      const want = src.full(signal);
      src.destroy();
      // Only this test's converter is spare: the one made for `first` is the next one taken.
      const held = await Promise.all(Array.from({ length: SPARE_CONVERTERS }, () => Resampler.create(44100)));
      const made = await Resampler.create(first);
      made.push(signal.subarray(0, 1000));
      made.close();
      const created = Resampler.created;
      const r = await Resampler.create(rate);
      expect(Resampler.created).toBe(created);
      const got = r.push(signal);
      r.close();
      for (const h of held) h.close();
      expect(got.length).toBe(want.length);
      // Bit for bit (a deep equality of a million floats takes seconds).
      const bytes = (x: Float32Array): Buffer => Buffer.from(x.buffer, x.byteOffset, x.byteLength);
      expect(bytes(got).equals(bytes(want))).toBe(true);
    },
  );

  it(`keeps at most ${SPARE_CONVERTERS} spare converters: past that, closed ones are freed`, async () => {
    const many = await Promise.all(Array.from({ length: SPARE_CONVERTERS + 4 }, () => Resampler.create(8000)));
    for (const r of many) r.close();
    const created = Resampler.created;
    const again = await Promise.all(Array.from({ length: SPARE_CONVERTERS + 4 }, () => Resampler.create(8000)));
    expect(Resampler.created - created).toBe(4);
    for (const r of again) r.close();
  });
});

describe('decodeWav: chunks it does not need (found by spec/fuzz)', () => {
  /** A 16 kHz mono 16-bit WAV of 32 silent samples with `extra` chunks after its data. */
  function withChunks(extra: [string, Buffer][]): Buffer {
    const chunk = (id: string, body: Buffer, size = body.length): Buffer => {
      const h = Buffer.alloc(8);
      h.write(id, 0, 'latin1');
      h.writeUInt32LE(size, 4);
      return Buffer.concat([h, body]);
    };
    const fmt = Buffer.alloc(16);
    fmt.writeUInt16LE(1, 0); // PCM
    fmt.writeUInt16LE(1, 2);
    fmt.writeUInt32LE(16000, 4);
    fmt.writeUInt32LE(32000, 8);
    fmt.writeUInt16LE(2, 12);
    fmt.writeUInt16LE(16, 14);
    const body = Buffer.concat([
      Buffer.from('WAVE'),
      chunk('fmt ', fmt),
      chunk('data', Buffer.alloc(64)),
      ...extra.map(([id, b]) => chunk(id, b)),
    ]);
    return Buffer.concat([Buffer.from('RIFF'), Buffer.from(new Uint32Array([body.length]).buffer), body]);
  }
  // Counts as the RIFF specs place them: cue's dwCuePoints at 0, smpl's cSampleLoops at 28.
  const cue = Buffer.alloc(64);
  cue.writeUInt32LE(2_000_000, 0);
  const smpl = Buffer.alloc(64);
  smpl.writeUInt32LE(2_000_000, 28);

  it.each([
    ['cue ', cue],
    ['smpl', smpl],
  ])(
    'a %s chunk claiming 2 million entries in 64 bytes decodes at once (wavefile looped over them: seconds; 4 billion: out of memory)',
    (id, body) => {
      const t0 = performance.now();
      const a = decodeWav(withChunks([[id, body]]));
      expect(performance.now() - t0).toBeLessThan(500);
      expect(a.samples.length).toBe(32);
    },
  );
});

/**
 * G.711 expansion written out from the reference C code (Sun Microsystems' g711.c, public domain,
 * the implementation CCITT G.711 software tools are based on): `ulaw2linear` and `alaw2linear`.
 */
function ulaw2linear(byte: number): number {
  const u = ~byte & 0xff;
  let t = ((u & 0x0f) << 3) + 0x84;
  t <<= (u & 0x70) >> 4;
  return u & 0x80 ? 0x84 - t : t - 0x84;
}
function alaw2linear(byte: number): number {
  const a = byte ^ 0x55;
  let t = (a & 0x0f) << 4;
  const seg = (a & 0x70) >> 4;
  if (seg === 0) t += 8;
  else if (seg === 1) t += 0x108;
  else t = (t + 0x108) << (seg - 1);
  return a & 0x80 ? t : -t;
}

/** A mono 8 kHz WAV of 8-bit G.711 samples with format code `code` (6 A-law, 7 mu-law), built by hand. */
function g711Wav(code: number, samples: Uint8Array): Buffer {
  const h = Buffer.alloc(44);
  h.write('RIFF', 0, 'latin1');
  h.writeUInt32LE(36 + samples.length, 4);
  h.write('WAVEfmt ', 8, 'latin1');
  h.writeUInt32LE(16, 16);
  h.writeUInt16LE(code, 20);
  h.writeUInt16LE(1, 22);
  h.writeUInt32LE(8000, 24);
  h.writeUInt32LE(8000, 28);
  h.writeUInt16LE(1, 32);
  h.writeUInt16LE(8, 34);
  h.write('data', 36, 'latin1');
  h.writeUInt32LE(samples.length, 40);
  return Buffer.concat([h, samples]);
}

describe('decodeWav: G.711 telephone audio', () => {
  const every = Uint8Array.from({ length: 256 }, (_, i) => i);
  it.each([
    ['mu-law', 7, ulaw2linear],
    ['A-law', 6, alaw2linear],
  ] as const)('expands every %s code to the 16-bit value of the reference decoder', (_name, code, reference) => {
    const a = decodeWav(g711Wav(code, every));
    expect(a.sampleRate).toBe(8000);
    expect(Array.from(a.samples, (v) => Math.round(v * 32768))).toEqual(Array.from(every, reference));
  });

  it('refuses G.711 at another bit depth, naming it', () => {
    const w = g711Wav(7, every);
    w.writeUInt16LE(16, 34);
    expect(() => decodeWav(w)).toThrow('audio: unsupported bit depth 16 for mu-law samples; expected 8');
  });
});
