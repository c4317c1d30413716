/**
 * The stream socket chart's deadlines under controlled time, with its `work` actor replaced by one
 * that reports a client that never sends and a write that never flushes: only the chart decides.
 */
import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest';
import { createActor, fromCallback } from 'xstate';
import { streamSocketMachine, type StreamOutput } from '../../actors/stream.js';
import { Limits } from '../../runtime/config.js';

/** `work` that is ready at once and reports a silent client and a stuck write whenever asked. */
const stuckWork = fromCallback(({ sendBack, receive }) => {
  sendBack({ type: 'READY', model: 'm', task: 'vad' });
  receive((e: { type: string }) => {
    if (e.type === 'CHECK_IDLE') sendBack({ type: 'IDLE_REPORT', silentMs: 1e9 });
    if (e.type === 'CHECK_SEND') sendBack({ type: 'SEND_REPORT', waitingMs: 1e9 });
  });
});

function start(limits: Partial<Limits>) {
  const machine = streamSocketMachine.provide({ actors: { work: stuckWork as never }, actions: { log: () => {} } });
  const actor = createActor(machine, {
    input: { id: 'test', limits: Limits.parse({ idle_ms: 0, heartbeat_ms: 0, send_timeout_ms: 0, ...limits }) },
  });
  const out: StreamOutput[] = [];
  actor.on('*', (o: StreamOutput) => void out.push(o));
  actor.start();
  return { actor, out, closes: () => out.filter((o) => o.type === 'close') };
}

beforeEach(() => void vi.useFakeTimers());
afterEach(() => void vi.useRealTimers());

describe('stream deadlines count only the peer time', () => {
  it.each([
    ['idle_ms', { idle_ms: 100 }, { code: 1008, reason: 'no message for limits.idle_ms (100 ms)' }],
    ['heartbeat_ms', { heartbeat_ms: 100 }, { code: 1001, reason: 'no pong: peer is gone' }],
    [
      'send_timeout_ms',
      { send_timeout_ms: 100 },
      { code: 1013, reason: 'client is not reading: a send waited over limits.send_timeout_ms (100 ms)' },
    ],
  ] as const)(
    '%s is suspended while the server has paused reading, and runs a full period once it reads again',
    async (name, limits, cut) => {
      const s = start(limits);
      s.actor.send({ type: 'PAUSE' });
      await vi.advanceTimersByTimeAsync(10_000);
      expect(s.closes()).toEqual([]);
      // While paused the server still pings (a beacon for the client's heartbeat), every heartbeat_ms
      // (100 ms here: 10,000 / 100 = 100 pings), but awaits no pong; without a heartbeat, none.
      expect(s.out.filter((o) => o.type === 'ping').length).toBe(name === 'heartbeat_ms' ? 100 : 0);
      s.actor.send({ type: 'RESUME' });
      await vi.advanceTimersByTimeAsync(90);
      expect(s.closes()).toEqual([]);
      await vi.advanceTimersByTimeAsync(300); // heartbeat: one ping, unanswered at the next
      expect(s.closes()).toEqual([{ type: 'close', ...cut }]);
    },
  );

  it('issue 25 (client heartbeat): while paused, the server pings every 5 s at the most (heartbeat_ms 30 s) and cuts nobody', async () => {
    const s = start({ heartbeat_ms: 30_000 });
    s.actor.send({ type: 'PAUSE' });
    await vi.advanceTimersByTimeAsync(60_000);
    // 60 s paused, a ping every 5 s (not every 30 s: a client's heartbeat of 10 s must hear one).
    expect(s.out.filter((o) => o.type === 'ping').length).toBe(12);
    expect(s.closes()).toEqual([]);
  });

  it('a client over ws_max_buffered_bytes while the server has paused reading: 1013 "server is behind" (the server gives up); while reading: "client is not reading"', async () => {
    const paused = start({});
    paused.actor.send({ type: 'PAUSE' });
    paused.actor.send({ type: 'SEND_BLOCKED' });
    expect(paused.closes()).toEqual([
      { type: 'close', code: 1013, reason: expect.stringMatching(/^server is behind: .*while it paused reading/) },
    ]);
    const reading = start({});
    reading.actor.send({ type: 'SEND_BLOCKED' });
    expect(reading.closes()).toEqual([
      { type: 'close', code: 1013, reason: expect.stringMatching(/^client is not reading/) },
    ]);
  });
});
