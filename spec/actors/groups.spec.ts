/**
 * What any client can make the server load is bounded (issue 25 item 11): ad hoc wake-word
 * groups (`model=a,b,...`, registered on first use by anyone) are capped by `max_ad_hoc_groups`,
 * idle ones unload after `ad_hoc_keep_alive_ms`, and unloaded unused ones leave the registry.
 * The supervisor on fake slots.
 */
import { afterEach, describe, expect, it } from 'vitest';
import { Supervisor } from '../../actors/supervisor.js';
import type { Lease } from '../../runtime/admission.js';
import { ServerConfig } from '../../runtime/config.js';
import { VoxError } from '../../runtime/errors.js';
import { fakeLoader } from '../fuzz/fakes.js';
import { until } from '../helpers.js';

let sup: Supervisor | null = null;
afterEach(async () => {
  await sup?.stop(0);
  sup = null;
});

function supervisor(extra: Record<string, unknown> = {}): Supervisor {
  sup = new Supervisor(ServerConfig.parse({ log_level: 'silent', ...extra }), { loader: fakeLoader });
  return sup;
}

/** The 57 groups of two or more of the six embedded wake-word heads (the count). */
const HEADS = ['alexa', 'hey-jarvis', 'hey-mycroft', 'hey-rhasspy', 'timer', 'weather'];
const GROUPS = Array.from({ length: 63 }, (_, m) => HEADS.filter((_, i) => ((m + 1) >> i) & 1))
  .filter((g) => g.length >= 2)
  .map((g) => g.join(','));

/** One request to a group: lease, load, release (as an HTTP file request does). */
async function use(s: Supervisor, id: string): Promise<void> {
  const entry = s.require(id);
  const lease = await entry.admit({});
  try {
    await entry.ensureReady();
  } finally {
    lease.release();
  }
}

const loadedGroups = (s: Supervisor): string[] =>
  s
    .statuses()
    .filter((m) => m.id.includes(',') && m.state !== 'unloaded')
    .map((m) => m.id);

describe('ad hoc wake-word groups (issue 25 item 11)', () => {
  it('a list naming one model twice (alexa,alexa) is that model, not a group that takes its id from every later group naming it', async () => {
    const s = supervisor();
    await use(s, 'alexa,alexa');
    expect(s.status('alexa')?.task).toBe('wakeword');
    expect(s.registeredIds.filter((id) => id.includes(','))).toEqual([]);
    // The model is still a single wake word: a group naming it registers and loads.
    await use(s, 'alexa,hey-jarvis');
    expect(s.status('alexa,hey-jarvis')?.state).toBe('ready');
    expect(s.require('alexa, alexa')).toBe(s.require('alexa'));
  });

  it('issue 25 item 11: 57 different groups, one after the other: never more than max_ad_hoc_groups loaded (the least recently used idle one is unloaded), and the registry does not grow', async () => {
    expect(GROUPS).toHaveLength(57);
    const s = supervisor({ max_ad_hoc_groups: 3 });
    let most = 0;
    for (const g of GROUPS) {
      await use(s, g);
      most = Math.max(most, loadedGroups(s).filter((id) => s.status(id)!.state !== 'unloading').length);
    }
    expect(most).toBeLessThanOrEqual(3);
    await until(() => loadedGroups(s).length <= 3);
    // Unloaded, unused groups are dropped when a new one registers: the registry holds about max of them.
    expect(s.registeredIds.filter((id) => id.includes(',')).length).toBeLessThanOrEqual(3 + 1);
    // The most recent ones are the ones kept.
    expect(loadedGroups(s)).toContain(GROUPS.at(-1));
  });

  it('issue 25 item 11: with max_ad_hoc_groups loaded and in use, a new group is refused 503 too_many_groups naming the limit; configured groups do not count', async () => {
    const s = supervisor({
      max_ad_hoc_groups: 2,
      models: [{ id: 'house', task: 'wakeword', heads: ['alexa', 'timer'] }],
    });
    const held: Lease[] = [];
    for (const g of GROUPS.slice(0, 2)) {
      const e = s.require(g);
      held.push(await e.admit({}));
      await e.ensureReady();
    }
    let refused: unknown;
    try {
      s.require(GROUPS[2]);
    } catch (e) {
      refused = e;
    }
    expect(refused).toBeInstanceOf(VoxError);
    expect(refused).toMatchObject({ code: 'too_many_groups', status: 503, retryAfterS: 5 });
    expect((refused as Error).message).toMatch(/2 ad hoc groups are loaded and in use \(max_ad_hoc_groups\)/);
    await use(s, 'house'); // a configured group is not ad hoc
    held[0].release();
    await use(s, GROUPS[2]); // one is idle now: it makes room
    expect(loadedGroups(s).filter((id) => id !== 'house' && s.status(id)!.state !== 'unloading')).toHaveLength(2);
    held[1].release();
  });

  it('an evicted ad hoc group asked again counts as a new one: with max_ad_hoc_groups 1 and the other group in use it is refused, never loaded beside it', async () => {
    // A breaker's case: two clients alternating two groups at max_ad_hoc_groups 1; the evicted group's next request
    // reloaded it (unloading -> loading, no check), and both stayed loaded in 72 of 86 polls.
    const s = supervisor({ max_ad_hoc_groups: 1 });
    const [g1, g2] = GROUPS;
    await use(s, g1);
    const e2 = s.require(g2); // g1, idle, is asked to EVICT
    const lease = await e2.admit({});
    await e2.ensureReady();
    expect(s.status(g1)!.state).not.toBe('ready');
    let refused: unknown;
    try {
      s.require(g1);
    } catch (e) {
      refused = e;
    }
    expect(refused).toMatchObject({ code: 'too_many_groups', status: 503 });
    expect(loadedGroups(s).filter((id) => s.status(id)!.state !== 'unloading')).toEqual([g2]);
    lease.release();
    // g2 idle now: g1 may load again, and g2 makes room.
    await use(s, g1);
    expect(loadedGroups(s).filter((id) => s.status(id)!.state !== 'unloading')).toEqual([g1]);
  });

  it('issue 25 item 11: an ad hoc group unloads after ad_hoc_keep_alive_ms idle (default 300000), and leaves the registry then (issue 44 item 7); 0 leaves it to idle_unload_ms', async () => {
    const s = supervisor({ ad_hoc_keep_alive_ms: 100 });
    await use(s, 'alexa,timer');
    const t0 = Date.now();
    expect(s.require('alexa,timer').config.keep_alive_ms).toBe(100);
    await until(() => s.status('alexa,timer') === undefined, 3000);
    expect(Date.now() - t0).toBeGreaterThanOrEqual(90);
    await s.stop(0);
    expect(supervisor().require('alexa,timer').config.keep_alive_ms).toBe(300_000);
    await sup!.stop(0);
    expect(supervisor({ ad_hoc_keep_alive_ms: 0 }).require('alexa,timer').config.keep_alive_ms).toBeUndefined();
  });
});
