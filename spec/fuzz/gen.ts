/**
 * Structure-aware input generators for the fuzz suites (fast-check arbitraries) and the runner
 * that counts inputs, applies the per-input time budget and makes runs reproducible.
 *
 * The generators build well-formed inputs first (a RIFF/WAVE file with its chunks, a query
 * string of the route's own parameters, a JSON body with the route's own fields) and then mutate
 * single fields, so most inputs get past the first check and reach the deeper ones.
 */
import { mkdirSync, writeFileSync } from 'node:fs';
import fc from 'fast-check';
import { VoxError } from '../../runtime/errors.js';

/** Multiplies every property's run count (`FUZZ_SCALE=10` for a long local run). */
export const SCALE = Number(process.env.FUZZ_SCALE ?? 1);
/** `FC_SEED=<seed>` replays the runs of a failure (fast-check prints the seed and the shrunk input). */
const replay = process.env.FC_SEED
  ? { seed: Number(process.env.FC_SEED), ...(process.env.FC_PATH ? { path: process.env.FC_PATH } : {}) }
  : {};

/** Inputs checked so far in this file, by area. */
export const counts: Record<string, number> = {};

/**
 * Checks `predicate` on `runs` inputs of `arb` (times {@link SCALE}); each input must settle
 * within `budgetMs` (an async predicate is failed by fast-check's timeout, a synchronous one by its
 * measured time). The predicate returns true when the input was accepted (a result, not a 4xx):
 * at least `minAccepted` of the inputs, and not nearly all, must be. Counted under `area`.
 */
export async function fuzz<T>(
  area: string,
  arb: fc.Arbitrary<T>,
  runs: number,
  budgetMs: number,
  predicate: (v: T) => boolean | Promise<boolean>,
  minAccepted = 0.05,
): Promise<void> {
  const n = Math.max(1, Math.round(runs * SCALE));
  let accepted = 0;
  let ran = 0;
  await fc.assert(
    fc.asyncProperty(arb, async (v) => {
      const t0 = performance.now();
      const ok = await predicate(v);
      const ms = performance.now() - t0;
      if (ms > budgetMs) throw new Error(`input took ${ms.toFixed(0)} ms, over the budget of ${budgetMs} ms`);
      ran++;
      if (ok) accepted++;
    }),
    { numRuns: n, timeout: budgetMs, ...replay },
  );
  counts[area] = (counts[area] ?? 0) + n;
  // Inputs that all bounce off the first check test nothing deeper: the generator must get some through.
  if (accepted < minAccepted * ran)
    throw new Error(
      `only ${accepted} of ${ran} inputs were accepted (want at least ${minAccepted * 100} %): the generator is too far off`,
    );
  if (accepted > 0.98 * ran)
    throw new Error(`${accepted} of ${ran} inputs were accepted: the generator hardly breaks anything`);
}

/** Writes this file's counts to `spec/artifacts/fuzz-<name>.json` (summed by tools/run-tests.mjs) and prints them. */
export function report(name: string): void {
  const total = Object.values(counts).reduce((a, b) => a + b, 0);
  console.log(
    `fuzz ${name}: ${total} inputs (${Object.entries(counts)
      .map(([k, v]) => `${k} ${v}`)
      .join(', ')})`,
  );
  mkdirSync('spec/artifacts', { recursive: true });
  writeFileSync(`spec/artifacts/fuzz-${name}.json`, JSON.stringify({ total, counts }));
}

/** The outcome every input must reach: a result, or a VoxError with a 4xx status (never a 500 or another throw). */
export function expect4xx(e: unknown, what: string): VoxError {
  if (!(e instanceof VoxError))
    throw new Error(`${what}: threw ${(e as Error)?.stack ?? e} instead of a named 4xx error`);
  if (e.status >= 500) throw new Error(`${what}: ${e.status} ${e.type}: ${e.message}`);
  return e;
}

// ---------- numbers and strings that break parsers ----------

/** `arb` in one input of `of` (a mutation), else null (leave the field as it should be). */
export const sometimes = <T>(arb: fc.Arbitrary<T>, of = 6): fc.Arbitrary<T | null> =>
  fc.oneof({ weight: of - 1, arbitrary: fc.constant(null) }, { weight: 1, arbitrary: arb });

/** Integers around the edges: 0, 1, -1, powers of two and their neighbours, u16/u32 maxima. */
export const edgeInt = fc.oneof(
  fc.constantFrom(
    0,
    1,
    -1,
    2,
    7,
    8,
    255,
    256,
    65535,
    65536,
    2 ** 31 - 1,
    2 ** 31,
    2 ** 32 - 1,
    2 ** 32,
    2 ** 53 - 1,
    -(2 ** 31),
  ),
  fc.integer(),
  fc.nat(100),
);

/** JSON values of the wrong kind for a numeric or string field. */
export const junkValue: fc.Arbitrary<unknown> = fc.oneof(
  fc.constantFrom(
    null,
    true,
    false,
    '',
    ' ',
    '0',
    '-1',
    '1e309',
    'NaN',
    '0x10',
    [],
    {},
    [1],
    { a: 1 },
    -0,
    1e308,
    -1e308,
    5e-324,
    0.5,
    1.5,
    2 ** 53,
    -(2 ** 53),
  ),
  edgeInt,
  fc.double(),
  fc.string({ maxLength: 20 }),
  fc.jsonValue({ maxDepth: 3 }),
);

/** Strings for query parameter values: numbers in every spelling, blanks, unicode, percent junk. */
export const queryValue = fc.oneof(
  fc.constantFrom(
    '',
    ' ',
    '0',
    '-1',
    '+1',
    '1.5',
    '1e3',
    '0x1F',
    '016000',
    '16000 ',
    ' 16000',
    'NaN',
    'Infinity',
    '%',
    '%zz',
    '%00',
    '\u0000',
    '😀',
    'null',
    'undefined',
    '[]',
    '{}',
  ),
  edgeInt.map(String),
  fc.double().map(String),
  fc.string({ maxLength: 16 }),
  fc.string({ unit: 'binary', maxLength: 8 }),
);

// ---------- WAV ----------

/** One RIFF chunk as it will be written: id, declared size, body (padded to even length unless `pad` is false). */
export interface Chunk {
  id: string;
  body: Uint8Array;
  /** Declared size; default: the body's length. */
  size?: number;
  pad?: boolean;
}

/** Serialises a RIFF file from its chunks. */
export function riff(chunks: Chunk[], opts: { riffId?: string; waveId?: string; riffSize?: number } = {}): Buffer {
  const parts: Buffer[] = [Buffer.from((opts.waveId ?? 'WAVE').padEnd(4).slice(0, 4), 'latin1')];
  for (const c of chunks) {
    const h = Buffer.alloc(8);
    h.write(c.id.padEnd(4).slice(0, 4), 0, 'latin1');
    h.writeUInt32LE((c.size ?? c.body.length) >>> 0, 4);
    parts.push(h, Buffer.from(c.body));
    if (c.body.length % 2 && c.pad !== false) parts.push(Buffer.alloc(1));
  }
  const body = Buffer.concat(parts);
  const h = Buffer.alloc(8);
  h.write((opts.riffId ?? 'RIFF').padEnd(4).slice(0, 4), 0, 'latin1');
  h.writeUInt32LE((opts.riffSize ?? body.length) >>> 0, 4);
  return Buffer.concat([h, body]);
}

/** The fields of a `fmt ` chunk (WAVEFORMATEX, with WAVEFORMATEXTENSIBLE's tail when `ext`). */
export interface Fmt {
  tag: number;
  channels: number;
  rate: number;
  byteRate: number;
  blockAlign: number;
  bits: number;
  /** Extensible tail: cbSize, valid bits, channel mask, first two bytes of the sub-format GUID. */
  ext?: { cbSize: number; validBits: number; mask: number; sub: number };
  /** Bytes of the chunk body actually written (a short or long `fmt `). */
  length: number;
}

export function fmtBody(f: Fmt): Uint8Array {
  const b = Buffer.alloc(40);
  b.writeUInt16LE(f.tag & 0xffff, 0);
  b.writeUInt16LE(f.channels & 0xffff, 2);
  b.writeUInt32LE(f.rate >>> 0, 4);
  b.writeUInt32LE(f.byteRate >>> 0, 8);
  b.writeUInt16LE(f.blockAlign & 0xffff, 12);
  b.writeUInt16LE(f.bits & 0xffff, 14);
  if (f.ext) {
    b.writeUInt16LE(f.ext.cbSize & 0xffff, 16);
    b.writeUInt16LE(f.ext.validBits & 0xffff, 18);
    b.writeUInt32LE(f.ext.mask >>> 0, 20);
    b.writeUInt16LE(f.ext.sub & 0xffff, 24);
    // The rest of KSDATAFORMAT_SUBTYPE_*: 00 00 00 00 10 00 80 00 00 AA 00 38 9B 71
    Buffer.from([0, 0, 0, 0, 0x10, 0, 0x80, 0, 0, 0xaa, 0, 0x38, 0x9b, 0x71]).copy(b, 26);
  }
  return b.subarray(0, f.length);
}

const fmtArb: fc.Arbitrary<Fmt> = fc
  .record({
    // Format tag and bit depth: a pair the decoder supports, mostly.
    tagBits: fc.oneof(
      {
        weight: 10,
        arbitrary: fc.constantFrom<[number, number]>(
          [1, 8],
          [1, 16],
          [1, 16],
          [1, 24],
          [1, 32],
          [3, 32],
          [3, 64],
          [65534, 16],
        ),
      },
      {
        weight: 1,
        arbitrary: fc.tuple(
          fc.constantFrom(0, 1, 2, 3, 6, 7, 17, 85, 0xfffe, 0xffff),
          fc.constantFrom(0, 1, 4, 8, 12, 16, 20, 24, 32, 48, 64, 0xffff),
        ),
      },
      { weight: 1, arbitrary: fc.tuple(fc.integer({ min: 0, max: 0xffff }), fc.integer({ min: 0, max: 0xffff })) },
    ) as fc.Arbitrary<[number, number]>,
    channels: fc.oneof(
      { weight: 12, arbitrary: fc.constantFrom(1, 1, 2, 3, 6) },
      { weight: 2, arbitrary: fc.integer({ min: 0, max: 40 }) },
      { weight: 1, arbitrary: fc.constantFrom(0xffff, 256) },
    ),
    rate: fc.oneof(
      { weight: 12, arbitrary: fc.constantFrom(8000, 11025, 16000, 22050, 44100, 48000) },
      { weight: 2, arbitrary: fc.constantFrom(0, 1, 7999, 192000, 192001, 2 ** 31, 2 ** 32 - 1) },
      { weight: 1, arbitrary: fc.integer({ min: 0, max: 2 ** 32 - 1 }) },
    ),
    byteRate: sometimes(fc.integer({ min: 0, max: 2 ** 32 - 1 })),
    blockAlign: sometimes(fc.integer({ min: 0, max: 0xffff })),
    ext: sometimes(
      fc.record({
        cbSize: fc.constantFrom(22, 0, 2, 100),
        validBits: fc.constantFrom(16, 24, 0, 12),
        mask: fc.constantFrom(4, 3, 0),
        sub: fc.constantFrom(1, 3, 0, 2, 0xffff),
      }),
      4,
    ),
    length: sometimes(fc.constantFrom(0, 2, 14, 16, 18, 20, 26, 39, 40)),
  })
  .map(({ byteRate, blockAlign, length, ext, tagBits: [tag, bits], ...rest }) => {
    const f = { ...rest, tag, bits };
    const align = Math.max(1, Math.floor((f.channels * f.bits) / 8));
    return {
      ...f,
      ext: ext ?? undefined,
      blockAlign: blockAlign ?? align,
      byteRate: byteRate ?? f.rate * align,
      length: length ?? (ext || f.tag === 65534 ? 40 : 16),
    };
  });

/** PCM-ish sample bytes: silence, a tone, extremes, random; a length that may not be a whole frame. */
const dataArb = fc.oneof(
  fc.uint8Array({ maxLength: 3000 }),
  fc.tuple(fc.nat(3000), fc.constantFrom(0, 0x7f, 0x80, 0xff)).map(([n, v]) => new Uint8Array(n).fill(v)),
  fc.nat(1500).map((n) => {
    const s = new Int16Array(n);
    for (let i = 0; i < n; i++) s[i] = Math.round(Math.sin(i / 3) * 20000);
    return new Uint8Array(s.buffer);
  }),
  // Float samples: NaN, infinities, values far outside [-1, 1].
  fc
    .array(fc.oneof(fc.float(), fc.constantFrom(NaN, Infinity, -Infinity, 1e30, -2, 1)), { maxLength: 400 })
    .map((xs) => new Uint8Array(Float32Array.from(xs).buffer)),
);

/** A chunk that is neither `fmt ` nor `data`. */
const otherChunk: fc.Arbitrary<Chunk> = fc.record({
  id: fc.oneof(
    fc.constantFrom('LIST', 'fact', 'JUNK', 'junk', 'PAD ', 'bext', 'cue ', 'smpl', 'ds64'),
    fc.string({ unit: 'binary-ascii', minLength: 4, maxLength: 4 }),
  ),
  body: fc.uint8Array({ maxLength: 64 }),
  size: sometimes(fc.oneof(fc.nat(200), fc.constantFrom(2 ** 32 - 1, 2 ** 31, 1_000_000))).map((s) => s ?? undefined),
  pad: sometimes(fc.constant(false)).map((p) => p ?? true),
});

/** A declared chunk size: the true one, off by a little, or far off. */
const sizeMutation = sometimes(
  fc.oneof(
    fc.integer({ min: -3, max: 3 }).map((d) => ({ delta: d })),
    fc.constantFrom(0, 1, 2 ** 31, 2 ** 32 - 1).map((s) => ({ set: s })),
  ),
);

/**
 * A WAV file: `fmt ` and `data` chunks with mutated fields, extra, odd-sized, duplicated or
 * reordered chunks, wrong RIFF/WAVE ids and sizes, truncation and a few overwritten bytes.
 */
export const wavArb: fc.Arbitrary<Buffer> = fc
  .record({
    fmt: fmtArb,
    data: dataArb,
    dataSize: sizeMutation,
    fmtSize: sizeMutation,
    before: fc.array(otherChunk, { maxLength: 1 }),
    between: fc.array(otherChunk, { maxLength: 1 }),
    after: fc.array(otherChunk, { maxLength: 1 }),
    order: fc.oneof(
      { weight: 15, arbitrary: fc.constant('fmt-data' as const) },
      { weight: 1, arbitrary: fc.constantFrom('data-fmt', 'no-fmt', 'no-data', 'two-fmt', 'two-data') },
    ),
    riffId: sometimes(fc.constantFrom('RIFX', 'RF64', 'riff', 'RIF', '\0\0\0\0'), 12),
    waveId: sometimes(fc.constantFrom('WAV ', 'AVI ', 'wave', '\0\0\0\0'), 12),
    riffSize: sizeMutation,
    truncate: sometimes(fc.double({ min: 0, max: 1, noNaN: true })),
    flips: fc.array(fc.tuple(fc.nat(), fc.nat(255)), { maxLength: 2 }),
    flip: fc.nat(5),
  })
  .map((w) => {
    const size = (m: { delta?: number; set?: number } | null, actual: number): number | undefined =>
      m === null ? undefined : (m.set ?? Math.max(0, actual + (m.delta ?? 0)));
    const fmt: Chunk = { id: 'fmt ', body: fmtBody(w.fmt), size: size(w.fmtSize, w.fmt.length) };
    const data: Chunk = { id: 'data', body: w.data, size: size(w.dataSize, w.data.length) };
    const core = {
      'fmt-data': [fmt, ...w.between, data],
      'data-fmt': [data, ...w.between, fmt],
      'no-fmt': [...w.between, data],
      'no-data': [fmt, ...w.between],
      'two-fmt': [fmt, fmt, data],
      'two-data': [fmt, data, data],
    }[w.order];
    const body = riff([...w.before, ...core, ...w.after], {
      riffId: w.riffId ?? undefined,
      waveId: w.waveId ?? undefined,
    });
    if (w.riffSize) body.writeUInt32LE(size(w.riffSize, body.length - 8)! >>> 0, 4);
    let out = w.truncate === null ? body : body.subarray(0, Math.floor(w.truncate * body.length));
    // A few overwritten bytes, mostly in the headers (the first 44 bytes), only some of the time.
    if (w.flip === 0) {
      out = Buffer.from(out);
      for (const [at, v] of w.flips) if (out.length) out[at % Math.min(out.length, 64)] = v;
    }
    return out;
  });

// ---------- query strings ----------

/** A query string over `keys` (plus unknown keys), each value valid or broken, keys repeated or missing. */
export function queryArb(valid: Record<string, fc.Arbitrary<string>>): fc.Arbitrary<string> {
  const keys = Object.keys(valid);
  const pair = fc.oneof(
    // Unknown keys are a 400 on every route (issue 13): rarer, so that most inputs reach the deeper checks.
    {
      weight: 14,
      arbitrary: fc
        .constantFrom(...keys)
        .chain((k) =>
          fc.tuple(fc.constant(k), fc.oneof({ weight: 3, arbitrary: valid[k] }, { weight: 2, arbitrary: queryValue })),
        ),
    },
    {
      weight: 1,
      arbitrary: fc.tuple(
        fc.oneof(
          fc.constantFrom('', 'x', 'Model', 'sample_rate[]', '__proto__', 'constructor'),
          fc.string({ maxLength: 8 }),
        ),
        queryValue,
      ),
    },
  );
  // Mostly each key once (a repeated parameter is a 400 naming it), now and then repeats.
  const pairs = fc.oneof(
    { weight: 7, arbitrary: fc.uniqueArray(pair, { maxLength: 7, selector: ([k]) => k }) },
    { weight: 1, arbitrary: fc.array(pair, { maxLength: 7 }) },
  );
  return fc
    .tuple(pairs, fc.boolean(), fc.nat(3))
    .map(([pairs, raw, sep]) =>
      pairs
        .map(([k, v]) => (raw ? `${k}=${v}` : `${encodeURIComponent(k)}=${encodeURIComponent(v)}`))
        .join(['&', '&', '&&', ';'][sep]),
    );
}

// ---------- JSON bodies ----------

/**
 * A JSON body: `template` (a valid body) with fields dropped, replaced by junk or added, or
 * another JSON value altogether, or text that is not JSON at all.
 */
export function jsonBodyArb(template: fc.Arbitrary<Record<string, unknown>>): fc.Arbitrary<string> {
  const mutated = fc
    .tuple(
      template,
      fc.array(fc.tuple(fc.nat(), fc.constantFrom('drop', 'junk', 'add')), { maxLength: 2 }),
      fc.array(junkValue, { minLength: 3, maxLength: 3 }),
      fc.string({ maxLength: 10 }),
    )
    .map(([body, edits, junk, extraKey]) => {
      const out: Record<string, unknown> = { ...body };
      const keys = Object.keys(out);
      edits.forEach(([i, op], j) => {
        const k = keys[i % Math.max(1, keys.length)];
        if (op === 'drop' && k) delete out[k];
        else if (op === 'junk' && k) out[k] = junk[j];
        else if (op === 'add') out[extraKey || 'extra'] = junk[j];
      });
      return JSON.stringify(out);
    });
  return fc.oneof(
    { weight: 8, arbitrary: mutated },
    { weight: 1, arbitrary: fc.jsonValue({ maxDepth: 4 }).map((v) => JSON.stringify(v) ?? 'null') },
    {
      weight: 1,
      arbitrary: fc.oneof(
        fc.constantFrom(
          '',
          ' ',
          '{',
          '{"a":',
          '[',
          'nul',
          '{"a":1,}',
          '\ufeff{}',
          '{"__proto__":{"x":1}}',
          '{"a":1e999999}',
          '[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]',
          '"just a string"',
        ),
        fc.string({ maxLength: 40 }),
        fc.string({ unit: 'binary', maxLength: 40 }),
      ),
    },
  );
}

/** A base64 string of a fuzzed WAV (or of junk, or not base64 at all). */
export const base64Wav = fc.oneof(
  { weight: 6, arbitrary: wavArb.map((b) => b.toString('base64')) },
  { weight: 1, arbitrary: fc.constantFrom('', '====', 'AAAA', 'not base64!', 'QUJD\nREVG') },
  { weight: 1, arbitrary: fc.string({ maxLength: 12 }) },
);

/** Task options: valid keys with valid or junk values, and unknown keys. */
const probability = fc.oneof(
  { weight: 8, arbitrary: fc.double({ min: 0.01, max: 0.99, noNaN: true }) },
  { weight: 1, arbitrary: fc.constantFrom(0, 1, -0.5, 1.5, 5) },
  { weight: 1, arbitrary: junkValue },
);
const ms = fc.oneof({ weight: 8, arbitrary: fc.nat(2000) }, { weight: 1, arbitrary: junkValue });
export const optionsArb: fc.Arbitrary<unknown> = fc.oneof(
  { weight: 3, arbitrary: fc.record({ threshold: probability }, { requiredKeys: [] }) },
  {
    weight: 3,
    arbitrary: fc.record(
      {
        threshold: probability,
        neg_threshold: probability,
        min_speech_duration_ms: ms,
        min_silence_duration_ms: ms,
        speech_pad_ms: ms,
      },
      { requiredKeys: [] },
    ),
  },
  {
    weight: 1,
    arbitrary: fc.dictionary(
      fc.constantFrom('max_speech_duration_s', 'Threshold', 'window_size_samples', ''),
      junkValue,
      { maxKeys: 2 },
    ),
  },
  { weight: 1, arbitrary: junkValue },
);
