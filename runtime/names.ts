/**
 * Model ids a client probably meant by `given` (for a 404's "did you mean"): the id it spells once
 * written as an id (lower case, `_` and spaces as `-`, a `_v0.1` version suffix dropped, as
 * wyoming-openwakeword and Home Assistant name the wake words), else the ids within a small edit
 * distance of it in lower case with `-` for `_` (Levenshtein: at most 1 for names up to 4
 * characters, 2 up to 8, 3 beyond).
 * @returns at most three ids, closest first.
 */
export function similarIds(given: string, known: Iterable<string>): string[] {
  const spell = (s: string): string =>
    s
      .trim()
      .toLowerCase()
      .replace(/[_\s]+/g, '-')
      .replace(/-v[0-9.]+$/, '');
  const want = spell(given);
  const ids = [...known];
  const same = ids.filter((id) => id.toLowerCase() === want);
  if (same.length) return same.slice(0, 3);
  const limit = want.length <= 4 ? 1 : want.length <= 8 ? 2 : 3;
  const typed = given
    .trim()
    .toLowerCase()
    .replace(/[_\s]+/g, '-');
  return ids
    .map((id) => ({ id, d: editDistance(typed, id.toLowerCase()) }))
    .filter((c) => c.d <= limit)
    .sort((a, b) => a.d - b.d || a.id.localeCompare(b.id))
    .slice(0, 3)
    .map((c) => c.id);
}

/** Levenshtein distance (insertions, deletions, substitutions; Wagner-Fischer, one row). */
export function editDistance(a: string, b: string): number {
  if (a.length > 256 || b.length > 256) return Math.abs(a.length - b.length) + 256;
  let row = Array.from({ length: b.length + 1 }, (_, j) => j);
  for (let i = 1; i <= a.length; i++) {
    const next = [i];
    for (let j = 1; j <= b.length; j++)
      next[j] = Math.min(row[j]! + 1, next[j - 1]! + 1, row[j - 1]! + (a[i - 1] === b[j - 1] ? 0 : 1));
    row = next;
  }
  return row[b.length]!;
}
