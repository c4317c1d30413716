/**
 * Deadlines count only the peer's time (issue 12): while the server has paused reading a stream
 * (backpressure) or still holds its unprocessed audio, the idle, heartbeat and send deadlines do
 * not run. The reproduction (a model at ~100 ms per window, idle_ms 4000, heartbeat_ms
 * 2000, 12 s of audio at once) scaled down to run in seconds: a model at ~25 ms per window,
 * idle_ms 1000, heartbeat_ms 500. The server still pauses reading for several seconds (12 s of
 * audio is over the 10 s it buffers; it reads again under 5 s), several deadline periods.
 */
import { mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { beforeAll, describe, expect, it } from 'vitest';
import WebSocket from 'ws';
import { ServerConfig } from '../../runtime/config.js';
import { writeSyntheticModel } from '../../tools/synth-model.js';
import { startServer } from '../../transport/server.js';

const model = join(mkdtempSync(join(tmpdir(), 'voxserve-slow-')), 'slow.onnx');
beforeAll(async () => {
  await writeSyntheticModel(model, 0, 25);
});

describe('deadlines count only the peer time', () => {
  it.each([
    { idle_ms: 1000, heartbeat_ms: 500, send_timeout_ms: 1000 },
    { idle_ms: 1000, heartbeat_ms: 0, send_timeout_ms: 1000 },
  ])(
    'a client that sends 12 s at once, then keeps up, is served to the end while the server reads it slowly (%o)',
    async (limits) => {
      const server = await startServer(
        ServerConfig.parse({
          log_level: 'silent',
          port: 0,
          limits,
          models: [{ id: 'slow', task: 'vad', path: model, lazy: false }],
        }),
      );
      try {
        while ((await fetch(`${server.url}/ready`)).status !== 200) await new Promise((r) => setTimeout(r, 20)); // the model loads eagerly
        const ws = new WebSocket(`${server.url.replace('http', 'ws')}/v1/stream?model=slow`);
        const events: any[] = [];
        const closed = new Promise<{ code: number; reason: string }>((r) =>
          ws.on('close', (code, why) => r({ code, reason: why.toString() })),
        );
        ws.on('error', () => {});
        const frame = Buffer.alloc(3200, 1); // 100 ms of 16 kHz s16
        ws.on('message', async (d) => {
          const e = JSON.parse(d.toString());
          events.push(e);
          if (e.type !== 'ready') return;
          for (let i = 0; i < 120; i++) ws.send(frame); // 12 s at once
          for (let i = 0; i < 20; i++) {
            await new Promise((r) => setTimeout(r, 100)); // then 2 s in real time
            if (ws.readyState !== WebSocket.OPEN) return;
            ws.send(frame);
          }
          ws.send(JSON.stringify({ type: 'end' }));
        });
        // How long the server keeps reading paused: the reproduction holds only if it is several deadline periods.
        let pausedMs = 0;
        const poll = setInterval(() => {
          for (const link of server.streams)
            if (link.actor.getSnapshot().matches({ live: { intake: 'paused' } })) pausedMs += 20;
        }, 20);
        const { code, reason } = await closed;
        clearInterval(poll);
        expect({ code, reason }).toEqual({ code: 1000, reason: 'done' });
        expect(pausedMs).toBeGreaterThan(limits.idle_ms);
        expect(events.filter((e) => e.type === 'error')).toEqual([]);
        expect(events.at(-1)).toMatchObject({ type: 'done', processed_ms: 14_000 });
      } finally {
        await server.close();
      }
    },
  );
});
