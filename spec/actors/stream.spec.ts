/**
 * The stream socket chart's deadlines under controlled time, with its `work` actor replaced by one
 * that reports a client that never sends: only the chart decides. The send deadline is the
 * channel's (a write that never flushes).
 */
import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest';
import { createActor, fromCallback } from 'xstate';
import { StreamChannel, streamSocketMachine, type StreamOutput } from '../../actors/stream.js';
import { Limits } from '../../runtime/config.js';

/** `work` that is ready at once and reports a silent client whenever asked. */
const stuckWork = fromCallback(({ sendBack, receive }) => {
  sendBack({ type: 'READY', model: 'm', task: 'vad' });
  receive((e: { type: string }) => {
    if (e.type === 'CHECK_IDLE') sendBack({ type: 'IDLE_REPORT', silentMs: 1e9 });
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

  it('send_timeout_ms is suspended while the server has paused reading, and runs a full period once it reads again (the channel)', async () => {
    const channel = new StreamChannel(0, 100);
    const expired: number[] = [];
    channel.onSendExpired = (ms) => void expired.push(ms);
    channel.readingPaused(true);
    channel.writing(); // never flushed
    // Resumed between two of the timer's turns: the full period counts from the resume, not from the write.
    await vi.advanceTimersByTimeAsync(10_050);
    expect(expired).toEqual([]);
    channel.readingPaused(false);
    await vi.advanceTimersByTimeAsync(90);
    expect(expired).toEqual([]);
    await vi.advanceTimersByTimeAsync(300);
    expect(expired).toHaveLength(1);
    expect(expired[0]).toBeGreaterThanOrEqual(100);
  });

  /**
   * A channel of `limits.ws_max_messages_per_s` 1000 whose reading the server paused for 3 s, then resumed; `send(n)`
   * pushes n frames at once.
   */
  async function afterPause() {
    const channel = new StreamChannel(1000, 0);
    const seen = { flooded: 0 };
    channel.onFlood = () => void seen.flooded++;
    channel.readingPaused(true);
    await vi.advanceTimersByTimeAsync(3000);
    channel.readingPaused(false);
    const send = (n: number): void => {
      for (let i = 0; i < n; i++) channel.push(Buffer.alloc(640));
    };
    return { channel, seen, send };
  }

  it("ws_max_messages_per_s: the time the server paused reading is credited: the client's backlog after the resume is not a flood", async () => {
    const { channel, seen, send } = await afterPause();
    // 3 s of credit on top of a full bucket (a second's worth): a backlog of 1500 messages passes...
    send(1500);
    expect(seen.flooded).toBe(0);
    // ... and the credit is used up past 1000 + 3000 messages at once.
    send(2600);
    expect(seen.flooded).toBe(1);
    channel.close();
  });

  it('ws_max_messages_per_s: once the bucket has refilled after a backlog, the credit has lapsed', async () => {
    const { channel, seen, send } = await afterPause();
    send(1200); // the backlog: the bucket and 200 of the credit
    await vi.advanceTimersByTimeAsync(2000); // the bucket full again
    send(1002); // a second's worth and one more, at once
    expect(seen.flooded).toBe(1);
    channel.close();
  });

  it('the send deadline runs only while a write waits: no timer before a write or after it flushes, none past the deadline for flushed writes', async () => {
    const channel = new StreamChannel(0, 100);
    const expired: number[] = [];
    channel.onSendExpired = (ms) => void expired.push(ms);
    expect(vi.getTimerCount()).toBe(0);
    for (let i = 0; i < 5; i++) {
      const flushed = channel.writing();
      await vi.advanceTimersByTimeAsync(60);
      flushed();
    }
    await vi.advanceTimersByTimeAsync(1000);
    expect(expired).toEqual([]);
    expect(vi.getTimerCount()).toBe(0);
    // A write waiting since 60 ms into a period expires 100 ms after it began, not at the period's end.
    channel.writing()();
    await vi.advanceTimersByTimeAsync(60);
    channel.writing();
    await vi.advanceTimersByTimeAsync(99);
    expect(expired).toEqual([]);
    await vi.advanceTimersByTimeAsync(2);
    expect(expired).toHaveLength(1);
    channel.close();
  });

  it('the send deadline is judged one event-loop turn after it falls due: a write flushed in that turn counts', async () => {
    vi.useRealTimers();
    const channel = new StreamChannel(0, 20);
    const expired: number[] = [];
    channel.onSendExpired = (ms) => void expired.push(ms);
    const flushed = channel.writing();
    // Falls due in the same timer turn as the deadline (created after it), before the next turn.
    setTimeout(flushed, 20);
    await new Promise((r) => setTimeout(r, 60));
    expect(expired).toEqual([]);
    channel.close();
  });

  it('SEND_EXPIRED cuts the stream off: 1013 "client is not reading"', () => {
    const s = start({ send_timeout_ms: 100 });
    s.actor.send({ type: 'SEND_EXPIRED', waitingMs: 150 });
    expect(s.closes()).toEqual([
      {
        type: 'close',
        code: 1013,
        reason: 'client is not reading: a send waited over limits.send_timeout_ms (100 ms)',
      },
    ]);
  });

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
