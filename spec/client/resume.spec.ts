/**
 * voxserve/client `resume` against scripted nodes (a `ws` server and `/ready` each): what a
 * resumed stream sends the next node (`offset_ms`, `progress`, the kept audio byte for byte),
 * what it reports (`resumed`: gap, resent, dropped), that an event whose confirmation was lost is
 * said once, that a draining node's `done` hands the stream on, and when it gives up. The real
 * thing (nodes killed with SIGKILL) is spec/cluster/resume.spec.ts.
 */
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { afterEach, describe, expect, it } from 'vitest';
import { WebSocketServer, type WebSocket } from 'ws';
import { VoxClient, VoxClientError, type StreamEvent, type VoxStream } from '../../client/node.js';
import { until } from '../helpers.js';

/** A scripted node: answers `/ready` (200 while `ready`), and hands each stream's socket and query to `onStream`. */
interface FakeNode {
  url: string;
  ready: boolean;
  /** Each stream opened here: its query, and the binary it received. */
  streams: { query: URLSearchParams; ws: WebSocket; audio: Buffer[]; texts: string[] }[];
  onStream: (s: FakeNode['streams'][number]) => void;
  /** Answer handshakes with this HTTP status instead of upgrading. */
  refuse: number | null;
  /** Never answer `/ready` (a frozen node: its kernel accepts, nothing answers), or never answer the upgrade. */
  hang: 'ready' | 'upgrade' | null;
  close(): Promise<void>;
}

const nodes: FakeNode[] = [];
afterEach(async () => {
  await Promise.all(nodes.splice(0).map((n) => n.close()));
});

async function fakeNode(): Promise<FakeNode> {
  /** Upgrades never answered (`hang`), destroyed at `close`. */
  const hung: { destroy(): void }[] = [];
  const http: Server = createServer((req, res) => {
    if (node.hang === 'ready') return;
    res.statusCode = req.url === '/ready' && node.ready ? 200 : 503;
    res.end('{}');
  });
  const wss = new WebSocketServer({ noServer: true, handleProtocols: (p) => [...p][0] });
  http.on('upgrade', (req, socket, head) => {
    if (node.hang === 'upgrade') return void hung.push(socket);
    if (node.refuse) {
      const body = '{"error":{"type":"not_found","message":"model: no such model"}}';
      socket.end(
        `HTTP/1.1 ${node.refuse} No\r\ncontent-type: application/json\r\ncontent-length: ${body.length}\r\nconnection: close\r\n\r\n${body}`,
      );
      return;
    }
    wss.handleUpgrade(req, socket, head, (ws) => {
      const s = { query: new URL(req.url!, 'http://x').searchParams, ws, audio: [] as Buffer[], texts: [] as string[] };
      ws.on('error', () => {});
      ws.on('message', (d: Buffer, binary) => (binary ? s.audio.push(Buffer.from(d)) : s.texts.push(d.toString())));
      node.streams.push(s);
      node.onStream(s);
    });
  });
  await new Promise<void>((r) => http.listen(0, '127.0.0.1', r));
  const node: FakeNode = {
    url: `http://127.0.0.1:${(http.address() as AddressInfo).port}`,
    ready: true,
    streams: [],
    refuse: null,
    hang: null,
    onStream: (s) =>
      s.ws.send(JSON.stringify({ type: 'ready', session_id: 'x', model: 'm', task: 'vad', sample_rate: 16000 })),
    close: async () => {
      for (const c of wss.clients) c.terminate();
      for (const socket of hung) socket.destroy();
      http.closeAllConnections();
      await new Promise((r) => http.close(r));
    },
  };
  nodes.push(node);
  return node;
}

const event = (e: Record<string, unknown>): string => JSON.stringify(e);
/** `ms` of 16 kHz s16le audio whose every sample is its own index (mod 2^15), from sample `from`. */
function audio(fromMs: number, ms: number): Buffer {
  const b = Buffer.alloc(ms * 32);
  for (let i = 0; i < ms * 16; i++) b.writeInt16LE((fromMs * 16 + i) % 32768, i * 2);
  return b;
}

/** Sends `ms` of {@link audio} from 0 in 100 ms frames; resolves once `node`'s first stream has all of it. */
async function sendAll(stream: VoxStream, node: FakeNode, ms: number): Promise<Buffer> {
  const sent = audio(0, ms);
  for (let o = 0; o < sent.length; o += 3200) await stream.send(sent.subarray(o, o + 3200));
  await until(() => node.streams[0].audio.reduce((n, d) => n + d.length, 0) === sent.length);
  return sent;
}

async function collect(stream: AsyncIterable<StreamEvent>, into: StreamEvent[]): Promise<void> {
  for await (const e of stream) into.push(e);
}

describe('resume (scripted nodes)', () => {
  it('with several urls it is on by default: progress asked, no offset on the first node', async () => {
    const [a, b] = [await fakeNode(), await fakeNode()];
    const several = await new VoxClient({ urls: [a.url, b.url] }).stream({ model: 'm' });
    expect(a.streams[0].query.get('progress')).toBe('true');
    expect(a.streams[0].query.has('offset_ms')).toBe(false);
    several.close();
    const one = await new VoxClient({ url: a.url }).stream({ model: 'm' });
    expect(a.streams[1].query.has('progress')).toBe(false);
    one.close();
    await expect(new VoxClient({ url: a.url }).stream({ model: 'm', resume: { bufferMs: -1 } })).rejects.toThrow(
      /^resume.bufferMs: a number of ms/,
    );
  });

  it('the node drops the connection: the next node gets offset_ms at the confirmed audio and the rest byte for byte; resumed reports the gap', async () => {
    const [a, b] = [await fakeNode(), await fakeNode()];
    const stream = await new VoxClient({ urls: [a.url, b.url] }).stream({ model: 'm' });
    const events: StreamEvent[] = [];
    const reading = collect(stream, events);
    const sent = await sendAll(stream, a, 3000);
    const A = a.streams[0].ws;
    // Confirmed up to 1024 ms; an event after that confirmation is lost with the node.
    A.send(event({ type: 'speech_start', at_ms: 500 }));
    A.send(event({ type: 'progress', processed_ms: 1024 }));
    A.send(event({ type: 'speech_start', at_ms: 1500 }));
    await new Promise((r) => setTimeout(r, 50));
    a.ready = false;
    A.terminate();
    await until(() => b.streams.length === 1 && b.streams[0].audio.reduce((n, d) => n + d.length, 0) === 1976 * 32);
    const B = b.streams[0];
    expect(B.query.get('offset_ms')).toBe('1024');
    expect(B.query.get('progress')).toBe('true');
    expect(B.query.get('model')).toBe('m');
    expect(Buffer.concat(B.audio).equals(sent.subarray(1024 * 32))).toBe(true);
    expect(stream.serverUrl).toBe(b.url);
    // The new node says the event again, confirms it; more audio goes to it; then end.
    B.ws.send(event({ type: 'speech_start', at_ms: 1500 }));
    B.ws.send(event({ type: 'progress', processed_ms: 2048 }));
    await stream.send(audio(3000, 100));
    const ending = stream.end();
    await until(() => B.texts.includes('{"type":"end"}'));
    expect(Buffer.concat(B.audio).equals(Buffer.concat([sent.subarray(1024 * 32), audio(3000, 100)]))).toBe(true);
    B.ws.send(event({ type: 'done', processed_ms: 3100, timing: {} }));
    B.ws.close(1000, 'done');
    expect((await ending).processed_ms).toBe(3100);
    await reading;
    expect(events.map((e) => e.type)).toEqual([
      'ready',
      'speech_start',
      'progress',
      'resumed',
      'speech_start',
      'progress',
      'done',
    ]);
    expect(events[3]).toEqual({
      type: 'resumed',
      url: b.url,
      previous_url: a.url,
      session_id: 'x',
      gap: { start_ms: 1024, end_ms: 3000 },
      resent: { start_ms: 1024, end_ms: 3000 },
      dropped: null,
    });
    expect((await stream.closed).error).toBeUndefined();
  });

  it('a progress with a checkpoint: the next node gets resume_from (no offset_ms) and the audio from the checkpoint; events the new node says again up to the audio confirmed are dropped', async () => {
    const [a, b] = [await fakeNode(), await fakeNode()];
    // Silero's 32 ms windows: the audio is kept from the last window start at or before the confirmed ms.
    a.onStream = (s) =>
      s.ws.send(event({ type: 'ready', session_id: 'x', model: 'm', task: 'vad', sample_rate: 16000, window_ms: 32 }));
    const stream = await new VoxClient({ urls: [a.url, b.url] }).stream({ model: 'm' });
    expect(a.streams[0].query.get('checkpoints')).toBe('true');
    const events: StreamEvent[] = [];
    const reading = collect(stream, events);
    const sent = await sendAll(stream, a, 3000);
    const A = a.streams[0].ws;
    // A checkpoint at 1024 ms; then (a draining node's done) the audio confirmed to 1050 ms, with an event.
    A.send(event({ type: 'progress', processed_ms: 1024, checkpoint: 'CP-1024' }));
    A.send(event({ type: 'speech_start', at_ms: 1040 }));
    A.send(event({ type: 'done', processed_ms: 1050, timing: {} }));
    await new Promise((r) => setTimeout(r, 50));
    a.ready = false;
    A.close(1001, 'going away');
    await until(() => b.streams.length === 1 && b.streams[0].audio.reduce((n, d) => n + d.length, 0) === 1976 * 32);
    const B = b.streams[0];
    expect(B.query.get('resume_from')).toBe('CP-1024');
    expect(B.query.has('offset_ms')).toBe(false);
    expect(Buffer.concat(B.audio).equals(sent.subarray(1024 * 32))).toBe(true);
    // B says the event of 1024-1056 ms again (dropped: it was handed on), then a new one.
    B.ws.send(event({ type: 'speech_start', at_ms: 1040 }));
    B.ws.send(event({ type: 'progress', processed_ms: 1024 + 32 - 6 }));
    B.ws.send(event({ type: 'speech_end', start_ms: 1040, end_ms: 2000, confidence: 0.9 }));
    B.ws.send(event({ type: 'progress', processed_ms: 3000, checkpoint: 'CP-3000' }));
    const ending = stream.end();
    await until(() => B.texts.includes('{"type":"end"}'));
    B.ws.send(event({ type: 'done', processed_ms: 3000, timing: {} }));
    B.ws.close(1000, 'done');
    await ending;
    await reading;
    expect(events.map((e) => e.type)).toEqual([
      'ready',
      'progress',
      'speech_start',
      'resumed',
      'speech_end',
      'progress',
      'done',
    ]);
    expect(events[3]).toMatchObject({
      gap: { start_ms: 1050, end_ms: 3000 },
      resent: { start_ms: 1024, end_ms: 3000 },
    });
  });

  it('bufferMs of audio written and unconfirmed: send waits for a progress, and a resume re-sends all of it (nothing dropped)', async () => {
    const [a, b] = [await fakeNode(), await fakeNode()];
    const stream = await new VoxClient({ urls: [a.url, b.url] }).stream({ model: 'm', resume: { bufferMs: 1000 } });
    const events: StreamEvent[] = [];
    void collect(stream, events).catch(() => {});
    const sent = audio(0, 3000);
    let given = 0;
    const sending = (async () => {
      for (let o = 0; o < sent.length; o += 3200) {
        await stream.send(sent.subarray(o, o + 3200));
        given = o + 3200;
      }
    })();
    const received = (): number => a.streams[0].audio.reduce((n, d) => n + d.length, 0);
    await until(() => received() === 1000 * 32);
    // Nothing confirmed: the 1000 ms written are all kept, and the next send waits.
    await new Promise((r) => setTimeout(r, 300));
    expect(received()).toBe(1000 * 32);
    expect(given).toBeLessThanOrEqual(1100 * 32);
    a.streams[0].ws.send(event({ type: 'progress', processed_ms: 500 }));
    await until(() => received() === 1500 * 32);
    a.ready = false;
    a.streams[0].ws.terminate();
    await until(() => events.some((e) => e.type === 'resumed'));
    // The gap ends at what send() was given: the frame waiting in it (1500-1600 ms) too.
    expect(events.find((e) => e.type === 'resumed')).toMatchObject({
      gap: { start_ms: 500, end_ms: 1600 },
      resent: { start_ms: 500, end_ms: 1600 },
      dropped: null,
    });
    expect(b.streams[0].query.get('offset_ms')).toBe('500');
    const atB = (): number => b.streams[0].audio.reduce((n, d) => n + d.length, 0);
    // B is sent the kept 500-1600 ms; each progress lets another bufferMs go.
    await until(() => atB() === 1100 * 32);
    b.streams[0].ws.send(event({ type: 'progress', processed_ms: 1600 }));
    await until(() => atB() === 2100 * 32);
    b.streams[0].ws.send(event({ type: 'progress', processed_ms: 2600 }));
    await sending;
    await until(() => atB() === 2500 * 32);
    expect(Buffer.concat(b.streams[0].audio).equals(sent.subarray(500 * 32))).toBe(true);
    stream.close();
  });

  it('a frame longer than bufferMs, confirmed but for its last partial window, does not hold the next send back', async () => {
    const a = await fakeNode();
    const stream = await new VoxClient({ urls: [a.url, a.url] }).stream({ model: 'm', resume: { bufferMs: 1000 } });
    const seen: StreamEvent[] = [];
    void collect(stream, seen).catch(() => {});
    await stream.send(audio(0, 1500));
    const received = (): number => a.streams[0].audio.reduce((n, d) => n + d.length, 0);
    await until(() => received() === 1500 * 32);
    // The server confirms whole 32 ms windows: 46 of them; 28 ms wait for more audio.
    a.streams[0].ws.send(event({ type: 'progress', processed_ms: 1472 }));
    await until(() => seen.some((e) => e.type === 'progress'));
    const next = stream.send(audio(1500, 100));
    await expect(
      Promise.race([next.then(() => 'sent'), new Promise((r) => setTimeout(() => r('waiting'), 3000))]),
    ).resolves.toBe('sent');
    stream.close();
  });

  it('a frozen node (its /ready never answered) is passed over after heartbeatMs, and the lost node is asked last', async () => {
    const [a, b, c] = [await fakeNode(), await fakeNode(), await fakeNode()];
    const stream = await new VoxClient({ urls: [a.url, b.url, c.url], heartbeatMs: 500 }).stream({ model: 'm' });
    const events: StreamEvent[] = [];
    void collect(stream, events).catch(() => {});
    b.hang = 'ready';
    a.streams[0].ws.terminate();
    await until(() => events.some((e) => e.type === 'resumed'), 8000);
    expect(stream.serverUrl).toBe(c.url);
    expect(a.streams.length).toBe(1);
    stream.close();
  });

  it('timeoutMs is enforced whatever the node does: one that answers /ready and never the handshake (heartbeatMs 0)', async () => {
    const [a, b] = [await fakeNode(), await fakeNode()];
    const stream = await new VoxClient({ urls: [a.url, b.url], heartbeatMs: 0 }).stream({
      model: 'm',
      resume: { timeoutMs: 600 },
    });
    const reading = collect(stream, []);
    a.ready = false;
    b.hang = 'upgrade';
    a.streams[0].ws.terminate();
    const err = await Promise.race([
      reading.then(
        () => null,
        (e) => e,
      ),
      new Promise((r) => setTimeout(() => r('still waiting 8 s later'), 8000)),
    ]);
    expect(err).toBeInstanceOf(VoxClientError);
    expect((err as VoxClientError).message).toMatch(/was lost and could not be resumed within 600 ms/);
    expect((await stream.closed).error).toBe(err);
  });

  it('a resume attempt refused before ready (error event, close 1013: no holder yet) is tried again, and its error is not handed on', async () => {
    const [a, b] = [await fakeNode(), await fakeNode()];
    const stream = await new VoxClient({ urls: [a.url, b.url] }).stream({ model: 'm' });
    const events: StreamEvent[] = [];
    void collect(stream, events).catch(() => {});
    const ready = b.onStream;
    let refusals = 2;
    b.onStream = (s) => {
      if (refusals-- > 0) {
        s.ws.send(
          event({
            type: 'error',
            error: { type: 'server_busy', code: 'no_holder', message: 'no holder of m answered' },
          }),
        );
        s.ws.close(1013, 'no holder');
      } else ready(s);
    };
    a.ready = false;
    a.streams[0].ws.terminate();
    await until(() => events.some((e) => e.type === 'resumed'));
    expect(b.streams).toHaveLength(3);
    expect(events.map((e) => e.type)).toEqual(['ready', 'resumed']);
    stream.close();
    expect((await stream.closed).error).toBeUndefined();
  });

  it('a node that answers /ready but refuses the stream (503, e.g. at max_ws_connections) is tried last: the stream resumes on the next', async () => {
    const [a, b, c] = [await fakeNode(), await fakeNode(), await fakeNode()];
    const stream = await new VoxClient({ urls: [a.url, b.url, c.url] }).stream({ model: 'm' });
    const events: StreamEvent[] = [];
    void collect(stream, events).catch(() => {});
    a.ready = false;
    b.refuse = 503;
    a.streams[0].ws.terminate();
    await until(() => events.some((e) => e.type === 'resumed'));
    expect(events.find((e) => e.type === 'resumed')).toMatchObject({ url: c.url, previous_url: a.url });
    expect(c.streams).toHaveLength(1);
    stream.close();
  });

  it('every node refuses the stream with 503 until timeoutMs: the stream fails saying the resume failed, with the 503', async () => {
    const [a, b] = [await fakeNode(), await fakeNode()];
    const stream = await new VoxClient({ urls: [a.url, b.url] }).stream({ model: 'm', resume: { timeoutMs: 700 } });
    const reading = collect(stream, []);
    a.ready = false;
    b.refuse = 503;
    a.streams[0].ws.terminate();
    const err = await reading.then(
      () => null,
      (e) => e,
    );
    expect(err).toMatchObject({ status: 503 });
    expect(err.message).toMatch(/was lost and could not be resumed within 700 ms/);
  });

  it("a draining node's done (then close 1001) before end(): the stream goes on on the next node, done not handed on", async () => {
    const [a, b] = [await fakeNode(), await fakeNode()];
    const stream = await new VoxClient({ urls: [a.url, b.url] }).stream({ model: 'm' });
    const events: StreamEvent[] = [];
    const reading = collect(stream, events);
    await stream.send(audio(0, 500));
    await until(() => a.streams[0].audio.length > 0);
    a.ready = false;
    a.streams[0].ws.send(event({ type: 'speech_start', at_ms: 100 }));
    a.streams[0].ws.send(event({ type: 'done', processed_ms: 500, timing: {} }));
    a.streams[0].ws.close(1001, 'server shutting down');
    await until(() => b.streams.length >= 1);
    const seen = (): string =>
      JSON.stringify({ events, b: b.streams.map((x) => [`${x.query}`, x.texts, x.audio.length]) });
    expect(b.streams.length, seen()).toBe(1);
    expect(b.streams[0].query.get('offset_ms'), seen()).toBe('500');
    const ending = stream.end();
    await until(() => b.streams[0].texts.length >= 1);
    expect(b.streams[0].texts, seen()).toEqual(['{"type":"end"}']);
    expect(b.streams[0].audio.length, seen()).toBe(0);
    b.streams[0].ws.send(event({ type: 'done', processed_ms: 500, timing: {} }));
    b.streams[0].ws.close(1000);
    expect((await ending).processed_ms, seen()).toBe(500);
    await reading;
    expect(
      events.map((e) => e.type),
      seen(),
    ).toEqual(['ready', 'speech_start', 'resumed', 'done']);
    expect(events[2], seen()).toMatchObject({ gap: { start_ms: 500, end_ms: 500 }, dropped: null });
  });

  it('end() while it resumes: the next node is sent the rest and end as it opens, and its done (however soon) is what end() gives', async () => {
    const [a, b] = [await fakeNode(), await fakeNode()];
    // B answers `end` at once: its done and close come before end()'s own turn to write.
    b.onStream = (s) => {
      s.ws.on('message', (_d, binary) => {
        if (binary) return;
        // Then the connection drops at once (no closing handshake): done covers all 700 ms sent, so it is the end.
        s.ws.send(event({ type: 'done', processed_ms: 700, timing: {} }), () => s.ws.terminate());
      });
    };
    const stream = await new VoxClient({ urls: [a.url, b.url] }).stream({ model: 'm' });
    const events: StreamEvent[] = [];
    const reading = collect(stream, events);
    const sent = audio(0, 700);
    await stream.send(sent);
    await until(() => a.streams[0].audio.length > 0);
    a.ready = false;
    a.streams[0].ws.send(event({ type: 'progress', processed_ms: 320 }));
    await until(() => events.some((e) => e.type === 'progress'));
    a.streams[0].ws.terminate();
    // The client is on B (so it knows A is gone) but B is not ready: end() waits; then B opens.
    await until(() => b.streams.length === 1);
    const ending = stream.end();
    await new Promise((r) => setTimeout(r, 30));
    b.streams[0].ws.send(event({ type: 'ready', session_id: 'y', model: 'm', task: 'vad', sample_rate: 16000 }));
    expect((await ending).processed_ms).toBe(700);
    await reading;
    expect(Buffer.concat(b.streams[0].audio).equals(sent.subarray(320 * 32))).toBe(true);
    expect(b.streams[0].texts).toEqual(['{"type":"end"}']);
    expect(events.map((e) => e.type)).toEqual(['ready', 'progress', 'resumed', 'done']);
  });

  it('no node to resume on within timeoutMs: the stream fails with connection_error saying so', async () => {
    const [a, b] = [await fakeNode(), await fakeNode()];
    const stream = await new VoxClient({ urls: [a.url, b.url] }).stream({ model: 'm', resume: { timeoutMs: 600 } });
    const events: StreamEvent[] = [];
    const reading = collect(stream, events);
    a.ready = false;
    b.ready = false;
    const t0 = Date.now();
    a.streams[0].ws.terminate();
    const err = await reading.then(
      () => null,
      (e) => e,
    );
    expect(err).toBeInstanceOf(VoxClientError);
    expect(err.type).toBe('connection_error');
    expect(err.message).toMatch(/was lost and could not be resumed within 600 ms: none of .* answers GET \/ready/);
    expect(Date.now() - t0).toBeGreaterThanOrEqual(550);
    await expect(stream.send(audio(0, 100))).rejects.toBe(err);
    expect((await stream.closed).error).toBe(err);
  });

  it('the next node refuses the stream (404): it fails at once with that error', { timeout: 8000 }, async () => {
    const [a, b] = [await fakeNode(), await fakeNode()];
    const stream = await new VoxClient({ urls: [a.url, b.url] }).stream({ model: 'm' });
    const events: StreamEvent[] = [];
    const reading = collect(stream, events);
    a.ready = false;
    b.refuse = 404;
    a.streams[0].ws.terminate();
    const err = await reading.then(
      () => null,
      (e) => e,
    );
    expect(err).toMatchObject({ type: 'not_found', status: 404 });
    expect(events.map((e) => e.type)).toEqual(['ready']);
  });

  it('close() while it resumes stops it', async () => {
    const [a, b] = [await fakeNode(), await fakeNode()];
    const stream = await new VoxClient({ urls: [a.url, b.url] }).stream({ model: 'm' });
    a.ready = false;
    b.ready = false;
    a.streams[0].ws.terminate();
    await new Promise((r) => setTimeout(r, 100));
    stream.close();
    expect(await stream.closed).toEqual({ code: 1000, reason: 'client closed' });
    b.ready = true;
    await new Promise((r) => setTimeout(r, 400));
    expect(b.streams.length).toBe(0);
  });
});
