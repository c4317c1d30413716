/**
 * The documentation matches the code (issue 23): every example in README.md and docs/ runs and
 * gives output of the documented shape; the config examples are valid and the main one starts a
 * server whose models all load; config keys, routes and CLI flags are documented exactly where
 * the code has them. (Error codes: docs/errors.md, checked by the error catalogue's own test.)
 */
import { execFile } from 'node:child_process';
import { readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { z } from 'zod';
import { ServerConfig } from '../../runtime/config.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { until, wyomingDescribe } from '../helpers.js';

const exec = promisify(execFile);
const root = fileURLToPath(new URL('../..', import.meta.url));
const cli = join(root, 'dist/tools/cli.js');
const PAGES = [
  'README.md',
  'CONTRIBUTING.md',
  ...readdirSync(join(root, 'docs'))
    .filter((f) => f.endsWith('.md'))
    .map((f) => `docs/${f}`),
];
const read = (page: string): string => readFileSync(join(root, page), 'utf8');

interface Block {
  page: string;
  line: number;
  lang: string;
  code: string;
  /** The block right after this one (only blank lines between), if any: a documented output. */
  next?: Block;
}

/** The fenced code blocks of a markdown page, each linked to the block that follows it directly. */
function blocks(page: string): Block[] {
  const text = read(page);
  const out: Block[] = [];
  const re = /^```(\w*)\n([\s\S]*?)^```\n?/gm;
  let prevEnd = -1;
  for (let m = re.exec(text); m; m = re.exec(text)) {
    const b: Block = { page, line: text.slice(0, m.index).split('\n').length, lang: m[1], code: m[2] };
    const prev = out.at(-1);
    if (prev && text.slice(prevEnd, m.index).trim() === '') prev.next = b;
    out.push(b);
    prevEnd = m.index + m[0].length;
  }
  return out;
}
const ALL = PAGES.flatMap(blocks);

/**
 * The shape of a JSON value, for comparing a documented output with a real one: types and keys,
 * not values (ids, timings and scores differ from run to run); arrays by their first element.
 */
function shape(v: unknown): unknown {
  if (Array.isArray(v)) return v.length ? [shape(v[0])] : [];
  if (v && typeof v === 'object')
    return Object.fromEntries(
      Object.entries(v)
        .map(([k, x]) => [k, shape(x)])
        .sort(([a], [b]) => (a as string).localeCompare(b as string)),
    );
  return v === null ? 'null' : typeof v;
}
/** One JSON value per line (`voxserve stream` prints events that way), or one value for the whole text. */
function values(text: string): unknown[] {
  const t = text.trim();
  try {
    return [JSON.parse(t)];
  } catch {
    return t.split('\n').map((l) => JSON.parse(l));
  }
}

/** Placeholders of the docs (`<openssl rand -hex 32>`, `<another secret>`) as values a schema accepts. */
const filled = (code: string): string => code.replace(/<[^>"]+>/g, 'a0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5');

let server: VoxServer;
beforeAll(async () => {
  // With the tensor model of models.md's example config (its path is from a checkout's root: the cwd here).
  const tensor = blocks('docs/models.md').find((b) => b.lang === 'json' && b.code.includes('"task": "tensor"'))!;
  const { models } = JSON.parse(tensor.code) as { models: unknown[] };
  server = await startServer(
    ServerConfig.parse({ log_level: 'silent', port: 0, wyoming: { enabled: true, port: 0 }, models }),
  );
});
afterAll(async () => {
  await server?.close();
});

describe('examples', () => {
  it('every JSON block parses', () => {
    const json = ALL.filter((b) => b.lang === 'json');
    expect(json.length).toBeGreaterThan(3);
    for (const b of json) expect(() => JSON.parse(b.code), `${b.page}:${b.line}`).not.toThrow();
  });

  it('every config example is a valid config file', () => {
    const keys = new Set(Object.keys(ServerConfig.shape));
    const configs = ALL.filter((b) => b.lang === 'json' && b.page.startsWith('docs/')).map((b) => ({
      b,
      v: JSON.parse(filled(b.code)) as Record<string, unknown>,
    }));
    const files = configs.filter(
      ({ v }) => v && typeof v === 'object' && !Array.isArray(v) && Object.keys(v).every((k) => keys.has(k)),
    );
    expect(files.length).toBeGreaterThanOrEqual(4); // configuration, models (2), operations
    for (const { b, v } of files) expect(() => ServerConfig.parse(v), `${b.page}:${b.line}`).not.toThrow();
  });

  it("configuration.md's example starts a server whose models all load", async () => {
    const example = JSON.parse(blocks('docs/configuration.md').find((b) => b.lang === 'json')!.code);
    const s = await startServer(ServerConfig.parse({ ...example, port: 0, log_level: 'silent' }));
    try {
      await until(async () => (await fetch(`${s.url}/ready`)).status === 200, 60_000);
      expect(await (await fetch(`${s.url}/ready`)).json()).toEqual({ status: 'ready' });
      const { models } = await (await fetch(`${s.url}/v1/models`)).json();
      for (const m of example.models)
        expect(models.find((x: { id: string }) => x.id === m.id)?.state, m.id).toBe('ready');
    } finally {
      await s.close();
    }
  }, 90_000);

  it('every shell example with a documented output gives output of that shape', async () => {
    // A documented output of JSON values (a result, or one event per line); other outputs are prose for people.
    const isJson = (text: string): boolean => {
      try {
        values(text);
        return true;
      } catch {
        return false;
      }
    };
    const shown = ALL.filter(
      (b) => b.lang === 'sh' && b.next && (b.next.lang === 'json' || b.next.lang === '') && isJson(b.next.code),
    );
    expect(shown.length).toBeGreaterThanOrEqual(2);
    for (const b of shown) {
      const command = b.code
        .replaceAll('http://127.0.0.1:8080', server.url)
        .replaceAll('127.0.0.1/10400', new URL(server.wyoming!.uri.replace('tcp:', 'http:')).host.replace(':', '/'))
        .replaceAll('node dist/tools/cli.js', `node ${cli}`)
        .replace(/^voxserve /gm, `node ${cli} `);
      const { stdout } = await exec(
        'bash',
        [
          '-c',
          command.includes('--url') || command.includes(server.url)
            ? command
            : command.replace(/(node \S+cli\.js (?:run|stream) .*)$/m, `$1 --url ${server.url}`),
        ],
        { cwd: root, timeout: 60_000 },
      );
      expect(values(stdout).map(shape), `${b.page}:${b.line}`).toEqual(values(b.next!.code).map(shape));
    }
  }, 180_000);

  it("the README's client example prints events of the documented shape", async () => {
    const b = blocks('README.md').find((x) => x.lang === 'js')!;
    // Run where the README says (in the checkout, so `voxserve/client` resolves to this package), against the test
    // server.
    const file = join(root, `.docs-example-${process.pid}.mjs`);
    writeFileSync(file, b.code.replace('new VoxClient()', `new VoxClient({ url: ${JSON.stringify(server.url)} })`));
    try {
      const { stdout } = await exec(process.execPath, [file], { cwd: root, timeout: 60_000 });
      expect(values(stdout).map(shape)).toEqual(values(b.next!.code).map(shape));
    } finally {
      rmSync(file, { force: true });
    }
  }, 90_000);
});

describe('wyoming.md', () => {
  it("its wake-word table is what describe answers: each name and phrase of info's models, in order", async () => {
    const data = await wyomingDescribe(server.wyoming!.uri);
    const rows = read('docs/wyoming.md')
      .split('\n')
      .filter((l) => /^\| `[a-z_]+` \|/.test(l))
      .map((l) => l.split(' | ').map((c) => c.replace(/^\| /, '').replaceAll('`', '')));
    expect(rows.map((r) => ({ name: r[0], phrase: r[1] }))).toEqual(
      data.wake[0].models.map((m) => ({ name: m.name, phrase: m.phrase })),
    );
  });
});

/** A zod schema without its wrappers (optional, default, preprocess, refinements). */
function bare(s: z.ZodType): z.ZodType {
  for (;;) {
    const d = (s as unknown as { _zod: { def: Record<string, unknown> & { type: string } } })._zod.def;
    if (['optional', 'default', 'prefault', 'nullable', 'readonly', 'catch'].includes(d.type))
      s = d.innerType as z.ZodType;
    else if (d.type === 'pipe')
      s = ((d.in as { _zod: { def: { type: string } } })._zod.def.type === 'transform' ? d.out : d.in) as z.ZodType;
    else return s;
  }
}
/** Every key of a config schema: `limits.idle_ms`, `models[].slots`, `models[].heads[].model`. */
function configKeys(s: z.ZodType, prefix = ''): string[] {
  const d = (bare(s) as unknown as { _zod: { def: { type: string; shape?: Record<string, z.ZodType> } } })._zod.def;
  if (d.type !== 'object') return [];
  return Object.entries(d.shape!).flatMap(([k, v]) => {
    const inner = bare(v) as unknown as { _zod: { def: { type: string; element?: z.ZodType; options?: z.ZodType[] } } };
    const def = inner._zod.def;
    const element =
      def.type === 'array'
        ? def.element
        : def.type === 'union'
          ? def.options?.find(
              (o) => (bare(o) as unknown as { _zod: { def: { type: string } } })._zod.def.type === 'array',
            )
          : undefined;
    const nested = element
      ? configKeys(
          (bare(element) as unknown as { _zod: { def: { element?: z.ZodType } } })._zod.def.element ?? element,
          `${prefix}${k}[].`,
        )
      : configKeys(v, `${prefix}${k}.`);
    return [`${prefix}${k}`, ...nested];
  });
}
/** Backticked words of a text. */
const ticked = (text: string): Set<string> => new Set([...text.matchAll(/`([^`\n]+)`/g)].map((m) => m[1]));

describe('documented exactly where the code has it', () => {
  it('every config key is documented (configuration.md, or a feature page of docs/), and every key in configuration.md exists', () => {
    const keys = configKeys(ServerConfig);
    expect(keys).toContain('limits.ws_max_frame_bytes');
    expect(keys).toContain('models[].max_batch_size');
    // A feature's own page (docs/wake-words.md, docs/cluster.md, ...) may document its keys; configuration.md links
    // them.
    const config = ticked(
      PAGES.filter((p) => p.startsWith('docs/'))
        .map(read)
        .join('\n'),
    );
    const models = config;
    const parents = new Set(keys.filter((k) => keys.some((x) => x.startsWith(`${k}.`) || x.startsWith(`${k}[].`))));
    const missing = keys.filter((k) => {
      // The cluster's keys have their own page (docs/cluster.md, the cluster helper's).
      if (k.startsWith('cluster.')) return !new RegExp(`\\b${k.split('.').at(-1)}\\b`).test(read('docs/cluster.md'));
      if (parents.has(k))
        return !config.has(k) && !config.has(`${k}[]`) && ![...config].some((t) => t.startsWith(`${k}.`));
      const leaf = k.split(/\.|\[\]\./).at(-1)!;
      if (k.startsWith('models[].heads[].')) return !models.has(leaf) && !config.has(leaf);

      if (k.startsWith('models[].')) return !config.has(k) && !config.has(leaf);
      return !config.has(k);
    });
    expect(missing, 'config keys with no line in docs/configuration.md').toEqual([]);
    // The other way: the first column of the key table names only keys that exist.
    const table = read('docs/configuration.md')
      .split('\n')
      .filter((l) => l.startsWith('| `'));
    const named = table.flatMap((l) => [...ticked(l.split(' | ')[0])]).filter((t) => !t.startsWith('-'));
    const known = new Set(keys);
    const unknown = named.filter((t) => !known.has(t) && !known.has(t.replace(/\[\]$/, '')));
    expect(unknown, 'keys in docs/configuration.md that the config schema does not have').toEqual([]);
  });

  it('every route the server answers is documented (http-api.md, or a feature page), and every route in http-api.md is answered', async () => {
    // Routes as the server source spells them (its route table, and the WebSocket upgrade's path).
    const source = ['transport/routes.ts', 'transport/server.ts']
      .map((f) => readFileSync(join(root, f), 'utf8'))
      .join('\n');
    // (A path ending in / is a prefix: /debug/..., /demo/...)
    const code = new Set(
      [...source.matchAll(/'(\/(?:v1|v2|debug|demo|health|ready|metrics)(?:[^'\s]*[^/'\s])?)'/g)]
        // The table's patterns as the docs write them: `/v1/models/{id}`; `/demo/*` (files below the page) with the
        // page.
        .map((m) => m[1].replace(/:(\w+)/g, '{$1}').replace(/\/\*$/, ''))
        .concat('/'),
    );
    const doc = read('docs/http-api.md');
    const anyDoc = ticked(
      PAGES.filter((p) => p.startsWith('docs/'))
        .map(read)
        .join('\n'),
    );
    const rows = doc
      .split('\n')
      .filter((l) => /^\| `(GET|POST) \//.test(l))
      .map((l) => l.split(' | ')[0]);
    const documented = rows.flatMap((cell) => {
      const method = /(GET|POST)/.exec(cell)![1];
      return [...ticked(cell)].map((t) => ({ method, path: t.replace(/^(GET|POST) /, '') }));
    });
    const paths = new Set(documented.map((r) => r.path));
    expect(
      [...code].filter((p) => !paths.has(p) && ![...anyDoc].some((t) => t === p || t.endsWith(` ${p}`))),
      'routes in transport/routes.ts missing from the docs',
    ).toEqual([]);
    // Each documented route reaches a handler on a server with management, inspection and the demo on.
    const s = await startServer(
      ServerConfig.parse({ log_level: 'silent', port: 0, management: { enabled: true }, debug: { inspect: true } }),
    );
    try {
      for (const { method, path } of documented) {
        const url = `${s.url}${path.replace('{id}', 'silero-vad')}`;
        const r = await fetch(url, {
          method,
          headers: method === 'POST' ? { 'content-type': 'application/json' } : {},
          body: method === 'POST' ? '{}' : undefined,
          signal: AbortSignal.timeout(10_000),
        });
        const text = path === '/debug/actors' ? '' : await r.text();
        if (path === '/debug/actors') await r.body?.cancel();
        expect(text, `${method} ${path}`).not.toContain('no route');
      }
    } finally {
      await s.close();
    }
  }, 60_000);

  it('every CLI command, flag and environment variable is in cli.md, and every flag there exists', async () => {
    const help = async (...args: string[]): Promise<string> =>
      (await exec(process.execPath, [cli, ...args, '--help'])).stdout;
    const top = await help();
    const commands = [...top.matchAll(/^ {2}(\w+)\b/gm)].map((m) => m[1]).filter((c) => c !== 'help');
    expect(commands).toEqual(expect.arrayContaining(['serve', 'run', 'stream', 'models', 'bench']));
    const doc = read('docs/cli.md');
    const flags = new Set<string>(['--help', '--version', '-V']);
    for (const c of commands) {
      expect(doc, `command ${c}`).toContain(`\`${c}`);
      const text = await help(c);
      for (const m of text.matchAll(/(?:^|\s)(--[a-z][a-z-]*)/g)) flags.add(m[1]);
      for (const m of text.matchAll(/env:\s+(\w+)/g))
        expect(doc, `environment variable ${m[1]} (${c})`).toContain(`\`${m[1]}\``);
    }
    const inDoc = new Set([...doc.matchAll(/(?:^|[\s[`(])(--[a-z][a-z-]*)/g)].map((m) => m[1]));
    expect(
      [...flags].filter((f) => f.startsWith('--') && f !== '--help' && !inDoc.has(f)),
      'flags missing from docs/cli.md',
    ).toEqual([]);
    expect(
      [...inDoc].filter((f) => !flags.has(f)),
      'flags in docs/cli.md the CLI does not have',
    ).toEqual([]);
    // Environment variables in the doc's table exist in the CLI.
    const source = readFileSync(join(root, 'tools/cli.ts'), 'utf8');
    for (const m of doc.matchAll(/`((?:VOXSERVE_)?[A-Z][A-Z_]+)`/g))
      expect(source, `environment variable ${m[1]}`).toContain(m[1]);
  }, 60_000);

  it('README (a front door of at most 250 lines) links every page in docs/, and every link to a page or file points at one that exists', () => {
    const readme = read('README.md');
    expect(readme.split('\n').length).toBeLessThanOrEqual(250);
    for (const f of readdirSync(join(root, 'docs')).filter((x) => x.endsWith('.md')))
      expect(readme, `README links docs/${f}`).toContain(`(docs/${f}`);
    for (const page of PAGES) {
      const base = page.includes('/') ? join(root, 'docs') : root;
      for (const m of read(page).matchAll(/\]\(([^)#\s]+\.(?:md|png))(?:#[^)]*)?\)/g)) {
        if (/^https?:/.test(m[1])) continue;
        expect(() => readFileSync(join(base, m[1])), `${page} -> ${m[1]}`).not.toThrow();
      }
    }
  });
});
