import { distance } from 'fastest-levenshtein';

/** Longest id compared by edit distance: a longer client string gets no guess (the distance is O(n x m)). */
const MAX_COMPARED = 256;

/**
 * A wake-word name written as a model id: lower case, `_` and spaces as `-`, a `_v0.1` version
 * suffix dropped (`hey_jarvis_v0.1` -> `hey-jarvis`), as the embedded heads' files are named and
 * wyoming-openwakeword and Home Assistant name the wake words.
 */
export function spellAsId(name: string): string {
  return name
    .trim()
    .toLowerCase()
    .replace(/[_\s]+/g, '-')
    .replace(/-v[0-9.]+$/, '');
}

/**
 * Model ids a client probably meant by `given` (for a 404's "did you mean"): the id it spells once
 * written as an id (lower case, `_` and spaces as `-`, a `_v0.1` version suffix dropped, as
 * wyoming-openwakeword and Home Assistant name the wake words), else the ids within a small edit
 * distance of it in lower case with `-` for `_` (Levenshtein distance, from fastest-levenshtein:
 * at most 1 for names up to 4 characters, 2 up to 8, 3 beyond); after those, the ids that hold
 * it as a part (`silero` -> `silero-vad`, `jarvis` -> `hey-jarvis`; 3 characters or more), and
 * the ids of the task it names (`vad` -> `silero-vad`, `silero-vad-v5`).
 * @param tasks each known id's task, for a given name that is a task's.
 * @returns at most three ids, closest first.
 */
export function similarIds(given: string, known: Iterable<string>, tasks?: ReadonlyMap<string, string>): string[] {
  const want = spellAsId(given);
  const ids = [...known];
  const same = ids.filter((id) => id.toLowerCase() === want);
  if (same.length) return same.slice(0, 3);
  if (given.length > MAX_COMPARED) return [];
  const limit = want.length <= 4 ? 1 : want.length <= 8 ? 2 : 3;
  const typed = given
    .trim()
    .toLowerCase()
    .replace(/[_\s]+/g, '-');
  const close = ids
    .map((id) => ({ id, d: swapped(typed, id.toLowerCase()) ? 1 : distance(typed, id.toLowerCase()) }))
    .filter((c) => c.d <= limit)
    .sort((a, b) => a.d - b.d || a.id.localeCompare(b.id))
    .slice(0, 3)
    .map((c) => c.id);
  if (typed.length < 3) return close;
  // A part of an id, whole words first (`vad` is a word of `silero-vad`), then shortest.
  const parts = ids
    .filter((id) => id.toLowerCase().includes(typed))
    .sort(
      (a, b) =>
        Number(!a.toLowerCase().split('-').includes(typed)) - Number(!b.toLowerCase().split('-').includes(typed)) ||
        a.length - b.length ||
        a.localeCompare(b),
    );
  const ofTask = tasks ? ids.filter((id) => tasks.get(id) === typed) : [];
  return [...new Set([...close, ...parts, ...ofTask])].slice(0, 3);
}

/**
 * `a` is `b` with two neighbouring characters swapped (`prot`, `port`): one slip of the fingers, where Levenshtein
 * counts two.
 */
function swapped(a: string, b: string): boolean {
  if (a.length !== b.length) return false;
  let i = 0;
  while (i < a.length && a[i] === b[i]) i++;
  return i + 1 < a.length && a[i] === b[i + 1] && a[i + 1] === b[i] && a.slice(i + 2) === b.slice(i + 2);
}
