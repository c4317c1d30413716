import { describe, expect, it } from 'vitest';
import { similarIds } from '../../runtime/names.js';

const IDS = ['silero-vad', 'silero-vad-v5', 'alexa', 'hey-jarvis', 'hey-mycroft', 'hey-rhasspy', 'timer', 'weather'];

describe('similarIds: the ids a 404 suggests', () => {
  it('takes the spellings of wyoming-openwakeword and Home Assistant as the id they name', () => {
    for (const given of ['hey_jarvis', 'Hey Jarvis', 'hey_jarvis_v0.1', 'HEY-JARVIS'])
      expect(similarIds(given, IDS), given).toEqual(['hey-jarvis']);
  });

  it('suggests ids within a small edit distance, closest first, and nothing for a name like none', () => {
    expect(similarIds('silero-vda', IDS)).toEqual(['silero-vad']); // 2 edits; silero-vad-v5 is 5, over the limit of 3 past 8 characters
    expect(similarIds('silero-vad-5', IDS)).toEqual(['silero-vad-v5', 'silero-vad']); // 1 and 2 edits, closest first
    expect(similarIds('alexx', IDS)).toEqual(['alexa']);
    expect(similarIds('timr', IDS)).toEqual(['timer']); // 4 characters: 1 edit
    expect(similarIds('xyzzy', IDS)).toEqual([]);
    expect(similarIds('h'.repeat(10_000), IDS)).toEqual([]);
  });

  it('issue 43: failing those, ids holding the name as a part, then the ids of the task it names', () => {
    const tasks = new Map(IDS.map((id) => [id, id.startsWith('silero') ? 'vad' : 'wakeword']));
    expect(similarIds('vad', IDS, tasks)).toEqual(['silero-vad', 'silero-vad-v5']);
    expect(similarIds('silero', IDS, tasks)).toEqual(['silero-vad', 'silero-vad-v5']);
    expect(similarIds('jarvis', IDS, tasks)).toEqual(['hey-jarvis']);
    expect(similarIds('wakeword', IDS, tasks)).toEqual(['alexa', 'hey-jarvis', 'hey-mycroft']);
    expect(similarIds('ab', IDS, tasks)).toEqual([]);
  });
});
