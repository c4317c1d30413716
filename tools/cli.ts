#!/usr/bin/env node
/**
 * The voxserve command line: `serve` runs the server; `run` and `stream` are clients of a
 * running server (HTTP `POST /v1/tasks/run` and WebSocket `/v1/stream`).
 */
import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { Command, InvalidArgumentError } from 'commander';
import WebSocket from 'ws';
import { loadServerConfig, type ServerConfig } from '../runtime/config.js';
import { LOG_LEVELS } from '../runtime/telemetry.js';
import { VoxError } from '../runtime/errors.js';
import { startServer } from '../transport/server.js';

const require = createRequire(import.meta.url);
const { WaveFile } = require('wavefile') as typeof import('wavefile');
const DEFAULT_URL = 'http://127.0.0.1:8080';

const int = (name: string) => (v: string): number => {
  if (!/^\d+$/.test(v)) throw new InvalidArgumentError(`${name} must be a non-negative integer`);
  return Number(v);
};

function die(message: string): never {
  process.stderr.write(`voxserve: ${message}\n`);
  process.exit(1);
}

function unreachable(url: string, e: unknown): never {
  const code = (e as { cause?: { code?: string }; code?: string }).cause?.code ?? (e as { code?: string }).code;
  if (code === 'ECONNREFUSED' || code === 'ENOTFOUND' || code === 'EHOSTUNREACH') {
    die(`no voxserve is running at ${url} (${code}); start one with: voxserve serve`);
  }
  const cause = (e as { cause?: { message?: string } }).cause?.message;
  die(`cannot reach ${url}: ${cause ?? (e as Error).message}`);
}

interface ServeOptions {
  config?: string;
  host?: string;
  port?: number;
  busyTimeoutMs?: number;
  management?: boolean;
  maxLoadedModels?: number;
  minFreeMemoryMb?: number;
  idleUnloadMs?: number;
  drainTimeoutMs?: number;
  logLevel?: string;
  inspect?: boolean;
  statelyInspector?: string;
}

const program = new Command('voxserve').description('Voice models (Silero VAD, openWakeWord) over HTTP and WebSocket');

program
  .command('serve')
  .description('run the server (with no config: the embedded default models, on 127.0.0.1:8080)')
  .option('--config <file>', 'JSON config file')
  .option('--host <host>', 'listen address')
  .option('--port <port>', 'listen port (0 picks a free one)', int('--port'))
  .option('--busy-timeout-ms <ms>', 'server ceiling on admission waits, ms (0 = unbounded)', int('--busy-timeout-ms'))
  .option('--management', 'enable the model management routes (load/unload)')
  .option('--max-loaded-models <n>', 'models resident at once; cold loads evict the least recently used idle one (0 = no limit)', int('--max-loaded-models'))
  .option('--min-free-memory-mb <mb>', 'refuse a cold load that would leave less memory free (0 = off)', int('--min-free-memory-mb'))
  .option('--idle-unload-ms <ms>', 'unload models idle this long (0 = off)', int('--idle-unload-ms'))
  .option('--drain-timeout-ms <ms>', 'on SIGTERM/SIGINT, how long running work may finish', int('--drain-timeout-ms'))
  .option('--log-level <level>', `JSON log level on stdout: ${LOG_LEVELS.join(', ')}`)
  .option('--inspect', 'record state-chart transitions for /debug and /debug/actors')
  .option('--stately-inspector <url>', 'also send them to a Stately inspector relay (@statelyai/inspect), e.g. ws://localhost:8090')
  .action(async (opts: ServeOptions) => {
    let config: ServerConfig;
    try {
      config = loadServerConfig(opts.config, {
        host: opts.host,
        port: opts.port,
        busy_timeout_ms: opts.busyTimeoutMs,
        max_loaded_models: opts.maxLoadedModels,
        min_free_memory_mb: opts.minFreeMemoryMb,
        idle_unload_ms: opts.idleUnloadMs,
        drain_timeout_ms: opts.drainTimeoutMs,
        log_level: opts.logLevel as ServerConfig['log_level'] | undefined,
      });
    } catch (e) {
      die(e instanceof VoxError ? `invalid configuration: ${e.message}` : String(e));
    }
    if (opts.management) config.management = { ...config.management, enabled: true };
    if (opts.inspect) config.debug = { ...config.debug, inspect: true };
    if (opts.statelyInspector) config.debug = { ...config.debug, stately_url: opts.statelyInspector };
    const t0 = performance.now();
    let server;
    try {
      server = await startServer(config);
    } catch (e) {
      die(`cannot start on ${config.host}:${config.port}: ${(e as Error).message}`);
    }
    process.stderr.write(`voxserve listening on ${server.url} (${Math.round(performance.now() - t0)} ms); models: GET ${server.url}/v1/models\n`);
    let signals = 0;
    const stop = (sig: string): void => {
      const first = ++signals === 1;
      process.stderr.write(first ? `voxserve: ${sig}, draining (up to ${config.drain_timeout_ms} ms; again to skip)\n` : `voxserve: ${sig}, skipping the drain\n`);
      // A second call skips what is left of the drain.
      server.close().then(
        () => {
          if (first) process.exit(0);
        },
        (e) => die(`shutdown failed: ${(e as Error).message}`),
      );
    };
    process.on('SIGTERM', () => stop('SIGTERM'));
    process.on('SIGINT', () => stop('SIGINT'));
  });

program
  .command('run')
  .description('send a WAV file to a running server and print the JSON result')
  .argument('<model>', 'model id, e.g. silero-vad or alexa')
  .argument('<file>', 'WAV file')
  .option('--url <url>', 'server URL', DEFAULT_URL)
  .action(async (model: string, file: string, opts: { url: string }) => {
    let wav: Buffer;
    try {
      wav = readFileSync(file);
    } catch (e) {
      die(`cannot read ${file}: ${(e as NodeJS.ErrnoException).code ?? (e as Error).message}`);
    }
    const url = `${opts.url.replace(/\/+$/, '')}/v1/tasks/run?model=${encodeURIComponent(model)}`;
    let res: Response;
    try {
      res = await fetch(url, { method: 'POST', headers: { 'content-type': 'audio/wav' }, body: new Uint8Array(wav) });
    } catch (e) {
      unreachable(opts.url, e);
    }
    const text = await res.text();
    process.stdout.write(`${text}\n`);
    if (!res.ok) process.exit(1);
  });

program
  .command('stream')
  .description('stream a WAV file to a running server over WebSocket and print events as they arrive')
  .argument('<model>', 'model id')
  .argument('<file>', 'WAV file (PCM or float, any rate and channel count; sent as s16le)')
  .option('--url <url>', 'server URL', DEFAULT_URL)
  .option('--realtime', 'send each 100 ms frame when its audio has elapsed')
  .option('--frame-ms <ms>', 'frame length, ms', int('--frame-ms'), 100)
  .action(async (model: string, file: string, opts: { url: string; realtime?: boolean; frameMs: number }) => {
    let wav: InstanceType<typeof WaveFile>;
    try {
      wav = new WaveFile(readFileSync(file));
      wav.toBitDepth('16');
    } catch (e) {
      die(`cannot read ${file} as WAV: ${(e as Error).message}`);
    }
    const fmt = wav.fmt as { sampleRate: number; numChannels: number };
    const pcm = Buffer.from((wav.data as { samples: Uint8Array }).samples);
    const q = new URLSearchParams({ model, sample_rate: String(fmt.sampleRate), channels: String(fmt.numChannels), encoding: 's16le' });
    const wsUrl = `${opts.url.replace(/^http/, 'ws').replace(/\/+$/, '')}/v1/stream?${q}`;
    const ws = new WebSocket(wsUrl, 'voxserve.v1.json');
    const frameBytes = Math.max(2 * fmt.numChannels, Math.round((fmt.sampleRate * opts.frameMs) / 1000) * 2 * fmt.numChannels);
    let failed = false;
    ws.on('unexpected-response', (_req, res) => die(`server refused the stream: HTTP ${res.statusCode}`));
    ws.on('error', (e) => unreachable(opts.url, e));
    ws.on('message', async (data) => {
      const event = JSON.parse(data.toString());
      process.stdout.write(`${JSON.stringify(event)}\n`);
      if (event.type === 'error') failed = true;
      if (event.type !== 'ready') return;
      const start = performance.now();
      for (let off = 0, i = 0; off < pcm.length; off += frameBytes, i++) {
        if (opts.realtime) {
          const due = start + i * opts.frameMs - performance.now();
          if (due > 0) await new Promise((r) => setTimeout(r, due));
        }
        ws.send(pcm.subarray(off, off + frameBytes));
      }
      ws.send(JSON.stringify({ type: 'end' }));
    });
    ws.on('close', (code, reason) => {
      if (code !== 1000) process.stderr.write(`voxserve: stream closed ${code} ${reason.toString()}\n`);
      process.exit(code === 1000 && !failed ? 0 : 1);
    });
  });

program
  .command('bench')
  .description('live streaming benchmark against a server it starts, with the bare and per-client baselines (one table)')
  .option('--streams <list>', 'comma-separated stream counts', '100,500,1000')
  .option('--frame-ms <ms>', 'frame length, ms', int('--frame-ms'), 100)
  .option('--seconds <s>', 'audio per stream, s', int('--seconds'), 20)
  .option('--slots <n>', 'server slots for the model', int('--slots'), 1)
  .option('--batch-delay-ms <ms>', "the model's max_batch_delay_ms", int('--batch-delay-ms'), 10)
  .option('--isolation <list>', 'slot host isolation modes to run side by side: process, thread', 'thread,process')
  .action(async (opts: { streams: string; frameMs: number; seconds: number; slots: number; batchDelayMs: number; isolation: string }) => {
    const streams = opts.streams.split(',').map(Number);
    if (streams.some((n) => !Number.isInteger(n) || n < 1)) die('--streams must be a comma-separated list of positive integers');
    const isolation = opts.isolation.split(',');
    if (!isolation.every((m) => m === 'process' || m === 'thread')) die(`--isolation must be a comma-separated list of process and thread, got '${opts.isolation}'`);
    const { bench } = await import('./bench.js');
    await bench({ streams, frameMs: opts.frameMs, seconds: opts.seconds, slots: opts.slots, batchDelayMs: opts.batchDelayMs, isolation: isolation as ('process' | 'thread')[] });
  });

program.parseAsync().catch((e) => die((e as Error).message));
