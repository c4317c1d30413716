import { readdirSync, readFileSync, statSync } from 'node:fs';
import { dirname, join, relative, resolve } from 'node:path';
import { describe, expect, it } from 'vitest';

const root = join(import.meta.dirname, '..', '..');

/** Each source module and the modules it imports at run time (`import type` is erased, so left out). */
function importGraph(): Map<string, string[]> {
  const graph = new Map<string, string[]>();
  const walk = (dir: string): void => {
    for (const name of readdirSync(dir)) {
      const path = join(dir, name);
      if (statSync(path).isDirectory()) walk(path);
      else if (name.endsWith('.ts') && !name.endsWith('.d.ts')) {
        const text = readFileSync(path, 'utf8');
        const deps = [...text.matchAll(/^(?:import|export)\s+(type\s+)?[^'"]*?from '(\.[^']+)'/gm)]
          .filter((m) => !m[1])
          .map((m) => resolve(dirname(path), m[2].replace(/\.js$/, '.ts')));
        graph.set(
          relative(root, path),
          deps.map((d) => relative(root, d)),
        );
      }
    }
  };
  for (const dir of ['actors', 'cluster', 'runtime', 'transport', 'tools', 'client']) walk(join(root, dir));
  return graph;
}

/** Every cycle a depth-first walk meets, as `a -> b -> a`. */
function cycles(graph: Map<string, string[]>): string[] {
  const state = new Map<string, 'open' | 'done'>();
  const stack: string[] = [];
  const found: string[] = [];
  const visit = (n: string): void => {
    state.set(n, 'open');
    stack.push(n);
    for (const m of graph.get(n) ?? []) {
      if (state.get(m) === 'open') found.push([...stack.slice(stack.indexOf(m)), m].join(' -> '));
      else if (!state.has(m) && graph.has(m)) visit(m);
    }
    stack.pop();
    state.set(n, 'done');
  };
  for (const n of graph.keys()) if (!state.has(n)) visit(n);
  return found;
}

describe('module structure', () => {
  it('no modules import each other, directly or around a loop (runtime/catalog.ts and runtime/config.ts did)', () => {
    const graph = importGraph();
    expect(graph.get('runtime/config.ts')).toContain('runtime/catalog.ts');
    expect(cycles(graph)).toEqual([]);
  });

  it('transport/ carries bytes: it imports no slot pool, batcher, task, loader or admission (transport/http.ts read tensors)', () => {
    const inference = /^runtime\/(slots|slot-worker|batcher|loader|admission)\.ts$|^runtime\/tasks\//;
    const found = [...importGraph()]
      .filter(([module]) => module.startsWith('transport/'))
      .flatMap(([module, deps]) => deps.filter((d) => inference.test(d)).map((d) => `${module} -> ${d}`));
    expect(found).toEqual([]);
  });
});
