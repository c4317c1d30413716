/**
 * The history checker (spec/cluster/history.ts) on hand-made histories: one that keeps the
 * contract passes, and each violation alone is found and named.
 */
import { describe, expect, it } from 'vitest';
import { check, type Event, type Final, fromLog, MARGIN_MS } from './history.js';

const SEGMENTS = { segments: [{ start_ms: 2, end_ms: 2046 }] };
const EVENTS = [
  { type: 'speech_start', at_ms: 10 },
  { type: 'speech_end', start_ms: 10, end_ms: 900 },
  { type: 'speech_start', at_ms: 3000 },
  { type: 'speech_end', start_ms: 3000, end_ms: 3900 },
];
const expected = { 'file:silero-vad:a.wav': SEGMENTS, 'stream:silero-vad:a.wav': EVENTS };

/** A run that keeps the contract: a file ok, a file refused in time, a stream, a resumed stream, loads one after the other. */
function good(): { history: Event[]; final: Final } {
  const t = 1_000_000;
  const history: Event[] = [
    { type: 'invoke', id: 'f1', op: 'file', node: 'a', model: 'silero-vad', input: 'a.wav', at: t, busy_ms: 3000 },
    { type: 'invoke', id: 'f2', op: 'file', node: 'b', model: 'silero-vad', input: 'a.wav', at: t, busy_ms: 3000 },
    { type: 'invoke', id: 's1', op: 'stream', node: 'a', model: 'silero-vad', input: 'a.wav', at: t, busy_ms: 3000 },
    { type: 'invoke', id: 's2', op: 'stream', node: 'b', model: 'silero-vad', input: 'a.wav', at: t, busy_ms: 3000 },
    { type: 'load', node: 'c', model: 'silero-vad', start: t, end: t + 400 },
    { type: 'lock', model: 'silero-vad', op: 'put', owner: 'a', at: t },
    { type: 'ok', id: 'f1', at: t + 500, result: SEGMENTS },
    { type: 'fail', id: 'f2', at: t + 3000 + MARGIN_MS - 1, status: 503, error: 'server_busy' },
    { type: 'lock', model: 'silero-vad', op: 'delete', at: t + 450 },
    { type: 'unload', node: 'c', model: 'silero-vad', at: t + 10_000 },
    { type: 'load', node: 'b', model: 'silero-vad', start: t + 10_001, end: t + 10_400 },
    { type: 'ok', id: 's1', at: t + 5000, result: EVENTS },
    // resumed without a checkpoint: the events before the gap equal the single node's; after it they may differ
    {
      type: 'ok',
      id: 's2',
      at: t + 5000,
      result: [...EVENTS.slice(0, 2), { type: 'speech_start', at_ms: 3100 }],
      gap: { from_ms: 2000, to_ms: 2500, checkpoint: false },
    },
    // resumed from the model's checkpoint: every event equals the single node's
    { type: 'invoke', id: 's3', op: 'stream', node: 'c', model: 'silero-vad', input: 'a.wav', at: t, busy_ms: 3000 },
    { type: 'ok', id: 's3', at: t + 6000, result: EVENTS, gap: { from_ms: 2000, to_ms: 2500, checkpoint: true } },
  ];
  const final: Final = {
    nodes: ['a', 'b', 'c'].map((node) => ({
      node,
      models: [
        { id: 'silero-vad', active_leases: 0, nodes: [{ node: 'b', state: 'ready', config: 'abc', active_leases: 0 }] },
      ],
      slot_hosts: [],
    })),
    locks: [],
  };
  return { history, final };
}

describe('history checker', () => {
  it('passes a history that keeps the contract', () => {
    const { history, final } = good();
    expect(check(history, final, expected)).toEqual([]);
  });

  const cases: [string, (h: Event[], f: Final) => void][] = [
    [
      'unanswered',
      (h) =>
        h.splice(
          h.findIndex((e) => e.type === 'ok' && e.id === 'f1'),
          1,
        ),
    ],
    ['answered-twice', (h) => h.push({ type: 'ok', id: 'f1', at: 1_000_900, result: SEGMENTS })],
    [
      'unclear-error',
      (h) =>
        h.push(
          { type: 'invoke', id: 'x', op: 'file', node: 'a', model: 'silero-vad', input: 'a.wav', at: 0, busy_ms: 3000 },
          { type: 'fail', id: 'x', at: 10, status: 0, error: 'socket hang up' },
        ),
    ],
    [
      'late-error',
      (h) =>
        h.push(
          { type: 'invoke', id: 'x', op: 'file', node: 'a', model: 'silero-vad', input: 'a.wav', at: 0, busy_ms: 3000 },
          { type: 'fail', id: 'x', at: 3000 + MARGIN_MS + 1, status: 503, error: 'server_busy' },
        ),
    ],
    [
      'wrong-result',
      (h) =>
        h.push(
          {
            type: 'invoke',
            id: 'x',
            op: 'stream',
            node: 'a',
            model: 'silero-vad',
            input: 'a.wav',
            at: 0,
            busy_ms: 3000,
          },
          { type: 'ok', id: 'x', at: 10, result: EVENTS.slice(1) },
        ),
    ],
    ['stray-answer', (h) => h.push({ type: 'ok', id: 'never-asked', at: 1_000_100, result: SEGMENTS })],
    [
      'concurrent-loads',
      (h) => h.push({ type: 'load', node: 'a', model: 'silero-vad', start: 1_000_300, end: 1_000_800 }),
    ],
    [
      'holders-differ',
      (_h, f) => f.nodes[2].models[0].nodes.push({ node: 'c', state: 'ready', config: 'abc', active_leases: 0 }),
    ],
    [
      'configs-differ',
      (_h, f) => {
        for (const n of f.nodes) n.models[0].nodes.push({ node: 'c', state: 'ready', config: 'def', active_leases: 0 });
      },
    ],
    [
      'lease-left',
      (_h, f) => {
        f.nodes[0].models[0].active_leases = 1;
      },
    ],
    ['lock-left', (_h, f) => f.locks.push('silero-vad')],
    ['slot-host-left', (_h, f) => f.nodes[1].slot_hosts.push(4242)],
  ];
  it.each(cases)('finds %s', (kind, spoil) => {
    const { history, final } = good();
    spoil(history, final);
    const found = check(history, final, expected);
    expect(found.map((v) => v.kind)).toEqual([kind]);
  });

  it('a stream resumed with events before its gap that differ is a wrong result', () => {
    const { history, final } = good();
    const s2 = history.find((e) => e.type === 'ok' && e.id === 's2') as { result: unknown };
    s2.result = [EVENTS[0]];
    expect(check(history, final, expected).map((v) => v.kind)).toEqual(['wrong-result']);
  });

  it('an answer before its request is a stray answer', () => {
    const { history, final } = good();
    const f1 = history.find((e) => e.type === 'ok' && e.id === 'f1') as { at: number };
    f1.at = 1;
    expect(check(history, final, expected).map((v) => v.kind)).toEqual(['stray-answer']);
  });

  it('a stream resumed from a checkpoint with events after its gap that differ is a wrong result', () => {
    const { history, final } = good();
    const s3 = history.find((e) => e.type === 'ok' && e.id === 's3') as { result: unknown };
    s3.result = [...EVENTS.slice(0, 3), { type: 'speech_end', start_ms: 3000, end_ms: 3932 }];
    expect(check(history, final, expected).map((v) => v.kind)).toEqual(['wrong-result']);
  });

  it('reads loads from a node log: a remote pool is no load, a load behind a remote pool is', () => {
    const line = (time: number, msg: string, extra: Record<string, unknown> = {}) => ({
      line: { time, msg, model: 'm', ...extra },
    });
    const log = [
      line(1, 'model state', { from: 'unloaded', to: 'loading' }),
      line(2, 'cluster: model served by other nodes'),
      line(3, 'model state', { from: 'loading', to: 'ready' }),
      line(9, 'cluster: holds the model here behind its remote pool'),
      line(10, 'model state', { from: 'ready', to: 'unloading' }),
      line(11, 'model state', { from: 'unloading', to: 'unloaded' }),
      line(20, 'model state', { from: 'unloaded', to: 'loading' }),
      line(25, 'model state', { from: 'loading', to: 'ready' }),
    ];
    expect(fromLog('a', log)).toEqual([
      { type: 'load', node: 'a', model: 'm', start: 9, end: 9 },
      { type: 'unload', node: 'a', model: 'm', at: 11 },
      { type: 'load', node: 'a', model: 'm', start: 20, end: 25 },
    ]);
  });
});
