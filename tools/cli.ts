#!/usr/bin/env node
/**
 * The voxserve command line: `serve` runs the server; `run` and `stream` are clients of a
 * running server (through `voxserve/client`: HTTP `POST /v1/tasks/run`, WebSocket `/v1/stream`).
 */
import { readFileSync, writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { basename, extname, relative, resolve } from 'node:path';
import { setFlagsFromString } from 'node:v8';
import { Command, CommanderError, InvalidArgumentError, Option } from 'commander';
import { VoxClient, VoxClientError, type ModelStatus, type VoxStream } from '../client/node.js';
import { decodeWav } from '../runtime/audio/audio.js';
import { describeBytes } from '../runtime/audio/decode.js';
import { ClusterConfig, formatIssues, loadServerConfig, type ServerConfig } from '../runtime/config.js';
import { LOG_LEVELS } from '../runtime/telemetry.js';
import { VoxError } from '../runtime/errors.js';
import { startServer } from '../transport/server.js';
import { progressBar } from './progress.js';
import type { WorkloadName } from './bench.js';

const require = createRequire(import.meta.url);
const { WaveFile } = require('wavefile') as typeof import('wavefile');
const { version } = require('../../package.json') as { version: string };
const DEFAULT_URL = 'http://127.0.0.1:8080';

const int =
  (name: string) =>
  (v: string): number => {
    if (!/^\d+$/.test(v)) throw new InvalidArgumentError(`${name} must be a non-negative integer`);
    return Number(v);
  };

/** `--frame-ms`: 1-10,000 ms (0 would send one sample per frame). */
const frameMs = (v: string): number => {
  const n = int('--frame-ms')(v);
  if (n < 1 || n > 10_000) throw new InvalidArgumentError('--frame-ms must be from 1 to 10000 ms');
  return n;
};

/**
 * `--option k=v` (repeatable): a task option, validated by the server with the same schema as a
 * JSON body's `options`; a numeric value is sent as a number (as the server reads query parameters).
 */
const collectOption = (v: string, all: Record<string, unknown>): Record<string, unknown> => {
  const m = /^([A-Za-z_][A-Za-z0-9_]*)=(.+)$/.exec(v);
  if (!m) throw new InvalidArgumentError(`'${v}' is not of the form key=value, e.g. threshold=0.7`);
  return { ...all, [m[1]]: Number.isFinite(Number(m[2])) ? Number(m[2]) : m[2] };
};

/** Content-Type of an audio file sent by `run`, by its extension (the server also reads its magic bytes). */
const AUDIO_TYPES: Record<string, string> = {
  '.wav': 'audio/wav',
  '.mp3': 'audio/mpeg',
  '.ogg': 'audio/ogg',
  '.oga': 'audio/ogg',
  '.opus': 'audio/ogg',
  '.flac': 'audio/flac',
  '.webm': 'audio/webm',
};

/** Exit code of a command that could not start because of its configuration (flags or config file). */
const CONFIG_ERROR = 2;

/**
 * Ends the command with `voxserve: <message>` on stderr and exit code `code` (1; {@link CONFIG_ERROR} for a
 * configuration mistake).
 */
function die(message: string, code = 1): never {
  process.stderr.write(`voxserve: ${message}\n`);
  process.exit(code);
}

/** A client of the server at `url`, with an API key if given; a bad URL or key ends the command. */
function client(url: string, apiKey?: string): VoxClient {
  try {
    return new VoxClient({ url, apiKey });
  } catch (e) {
    die((e as Error).message.replace(/^url:/, '--url:').replace(/^apiKey:/, '--api-key:'));
  }
}

/**
 * How this CLI was started, for messages that tell the user a command to run: `voxserve` when
 * installed as a command, else `node <path to cli.js>` (a checkout: `node dist/tools/cli.js`).
 */
function invocation(): string {
  const script = process.argv[1] ?? '';
  return basename(script) === 'cli.js' ? `node ${relative(process.cwd(), script) || script}` : 'voxserve';
}

/**
 * Ends a client command that failed: a server error (an HTTP answer, a refused stream
 * handshake included) is printed as its wire body on stdout (`{"error":{type,code,message}}`), a
 * closed stream as its close code on stderr; exit 1.
 */
function failed(url: string, e: unknown): never {
  if (!(e instanceof VoxClientError)) die((e as Error).message);
  if (e.type === 'connection_error') {
    if (e.code === 'ECONNREFUSED' || e.code === 'ENOTFOUND' || e.code === 'EHOSTUNREACH') {
      // The port asked for, when it is not serve's default.
      const port = new URL(url).port;
      const on = port && port !== '8080' ? ` --port ${port}` : '';
      die(`no voxserve is running at ${url} (${e.code}); start one with: ${invocation()} serve${on}`);
    }
    die(e.message);
  }
  if (e.closeCode !== undefined && e.status === undefined)
    die(`stream closed ${e.closeCode} (${e.type}): ${e.message}`);
  process.stdout.write(`${JSON.stringify({ error: { type: e.type, code: e.code, message: e.message } })}\n`);
  process.exit(1);
}

/**
 * What `serve` says when the server cannot start: a config problem found at start (an unknown
 * wake-word head, ...) as such; an address in use or refused, naming which listener (HTTP or
 * Wyoming) and how to choose another.
 */
function startFailure(e: unknown, config: ServerConfig): string {
  if (e instanceof VoxError) return `invalid configuration: ${e.message}`;
  const err = e as NodeJS.ErrnoException & { address?: string; port?: number };
  if (err.syscall === 'listen' && err.port !== undefined) {
    const wyoming =
      config.wyoming.enabled &&
      err.port === config.wyoming.port &&
      (err.port !== config.port || err.address === config.wyoming.host);
    const what = wyoming
      ? `the Wyoming address ${err.address}:${err.port}`
      : `the HTTP address ${err.address}:${err.port}`;
    const how = wyoming
      ? 'choose another with --wyoming HOST:PORT (or wyoming.port in the config)'
      : 'choose another with --port (or VOXSERVE_PORT, or port in the config)';
    const why =
      err.code === 'EADDRINUSE'
        ? 'is already in use (another voxserve?)'
        : err.code === 'EACCES'
          ? 'is not allowed for this user (ports below 1024 need privileges)'
          : `cannot be listened on (${err.code})`;
    return `cannot start: ${what} ${why}; ${how}`;
  }
  return `cannot start on ${config.host}:${config.port}: ${err.message}`;
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
  wyoming?: string | true;
  zeroconf?: string | boolean;
  wakewordDir?: string;
  cluster?: string;
  node?: string;
}

// A reader that stops early (`voxserve stream ... | head -2`) closes our stdout: stop quietly, as
// Unix tools do, instead of crashing on EPIPE.
process.stdout.on('error', (e: NodeJS.ErrnoException) => {
  if (e.code === 'EPIPE') process.exit(0);
  throw e;
});

const program = new Command('voxserve')
  .description('Voice models (Silero VAD, openWakeWord, RNNoise) over HTTP, WebSocket and Wyoming')
  .version(version, '-V, --version')
  // A flag commander cannot read (unknown, or a value it refuses) is a configuration mistake too: exit 2, not
  // commander's 1 (its `error: ...` line is printed already). Set before the commands: they inherit it.
  .exitOverride();

program
  .command('serve')
  .description('run the server (with no config: the embedded default models, on 127.0.0.1:8080)')
  .addOption(new Option('--config <file>', 'JSON config file').env('VOXSERVE_CONFIG'))
  .addOption(new Option('--host <host>', 'listen address').env('VOXSERVE_HOST'))
  .addOption(
    new Option('--port <port>', 'listen port (0 picks a free one); else VOXSERVE_PORT, else PORT')
      .argParser(int('--port'))
      .env('VOXSERVE_PORT'),
  )
  .option('--busy-timeout-ms <ms>', 'server ceiling on admission waits, ms (0 = unbounded)', int('--busy-timeout-ms'))
  .option('--management', 'enable the model management routes (load/unload)')
  .option(
    '--max-loaded-models <n>',
    'models resident at once; cold loads evict the least recently used idle one (0 = no limit)',
    int('--max-loaded-models'),
  )
  .option(
    '--min-free-memory-mb <mb>',
    'refuse a cold load that would leave less memory free (0 = off)',
    int('--min-free-memory-mb'),
  )
  .option('--idle-unload-ms <ms>', 'unload models idle this long (0 = off)', int('--idle-unload-ms'))
  .option('--drain-timeout-ms <ms>', 'on SIGTERM/SIGINT, how long running work may finish', int('--drain-timeout-ms'))
  .option('--log-level <level>', `JSON log level on stdout: ${LOG_LEVELS.join(', ')}`)
  .option('--inspect', 'record state-chart transitions for /debug and /debug/actors')
  .option(
    '--stately-inspector <url>',
    'also send them to a Stately inspector relay (@statelyai/inspect), e.g. ws://localhost:8090',
  )
  .option('--wyoming [host:port]', 'serve the Wyoming wake-word protocol (Home Assistant), default 127.0.0.1:10400')
  .option(
    '--zeroconf [name]',
    'announce Wyoming by zeroconf (_wyoming._tcp, as wyoming-openwakeword), as NAME (default voxserve-<host name>); on by default when Wyoming listens beyond loopback',
  )
  .option('--no-zeroconf', 'do not announce Wyoming by zeroconf')
  .option(
    '--wakeword-dir <dir>',
    'a folder of openWakeWord heads (*.onnx): each is a wake-word model, picked up while the server runs',
  )
  .addOption(
    new Option(
      '--cluster <nats-url>',
      'join a cluster of voxserve nodes over NATS, e.g. nats://127.0.0.1:4222 (docs/cluster.md)',
    ).env('VOXSERVE_CLUSTER'),
  )
  .addOption(
    new Option('--node <name>', "this node's name in the cluster (default: host name and process id)").env(
      'VOXSERVE_NODE',
    ),
  )
  .action(async (opts: ServeOptions) => {
    if (opts.port === undefined && process.env.PORT) {
      if (!/^\d+$/.test(process.env.PORT))
        die(`PORT must be a non-negative integer, got '${process.env.PORT}'`, CONFIG_ERROR);
      opts.port = Number(process.env.PORT);
    }
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
        wakeword_dir: opts.wakewordDir === undefined ? undefined : resolve(opts.wakewordDir),
      });
    } catch (e) {
      die(e instanceof VoxError ? `invalid configuration: ${e.message}` : String(e), CONFIG_ERROR);
    }
    if (opts.management) config.management = { ...config.management, enabled: true };
    if (opts.inspect) config.debug = { ...config.debug, inspect: true };
    if (opts.statelyInspector) config.debug = { ...config.debug, stately_url: opts.statelyInspector };
    if (opts.wyoming) {
      const m = opts.wyoming === true ? null : /^(.+):(\d{1,5})$/.exec(opts.wyoming);
      if (opts.wyoming !== true && (!m || Number(m[2]) > 65535))
        die(`--wyoming: expected host:port, got '${opts.wyoming}'`, CONFIG_ERROR);
      config.wyoming = {
        ...config.wyoming,
        enabled: true,
        host: m?.[1] ?? config.wyoming.host,
        port: m ? Number(m[2]) : config.wyoming.port,
      };
    }
    if (opts.zeroconf !== undefined) config.wyoming = { ...config.wyoming, zeroconf: opts.zeroconf };
    if (opts.cluster || opts.node) {
      if (!opts.cluster && !config.cluster)
        die('--node: needs --cluster <nats-url> (or cluster.nats in the config file)', CONFIG_ERROR);
      const r = ClusterConfig.safeParse({
        ...config.cluster,
        ...(opts.cluster ? { nats: opts.cluster } : {}),
        ...(opts.node ? { node: opts.node } : {}),
      });
      if (!r.success) die(`invalid configuration: ${formatIssues(r.error, 'cluster')}`, CONFIG_ERROR);
      config.cluster = r.data;
    }
    // A serving process keeps V8 from pretenuring (allocating straight into the old generation
    // from sites whose objects once survived): otherwise, in 6 of 14 runs of 800 VAD streams, V8
    // took to pretenuring short-lived objects and ran a major collection every ~2 s from then on
    // (main process +10-30 % CPU, lag p99 ~45 -> 93-154 ms); with it off, 1 run in 26, and none of
    // 8 with it set here, before the server starts (docs/benchmarks-efficiency.md).
    setFlagsFromString('--no-allocation-site-pretenuring');
    const t0 = performance.now();
    let server;
    try {
      server = await startServer(config);
    } catch (e) {
      die(startFailure(e, config), e instanceof VoxError ? CONFIG_ERROR : 1);
    }
    let signals = 0;
    const stop = (sig: string): void => {
      const first = ++signals === 1;
      process.stderr.write(
        first
          ? `voxserve: ${sig}, draining (up to ${config.drain_timeout_ms} ms; again to skip)\n`
          : `voxserve: ${sig}, skipping the drain\n`,
      );
      // A second signal cuts what is left of the drain.
      (first ? server.close() : server.destroy()).then(
        () => {
          if (first) process.exit(0);
        },
        (e) => die(`shutdown failed: ${(e as Error).message}`),
      );
    };
    // Another process took this node's name while this one was paused or cut off: it drains and leaves, exit 1.
    if (server.cluster)
      server.cluster.onNameLost = (e) => {
        process.stderr.write(`voxserve: ${e.message}; this process leaves the cluster\n`);
        server.close().then(
          () => process.exit(1),
          () => process.exit(1),
        );
      };
    process.on('SIGTERM', () => stop('SIGTERM'));
    process.on('SIGINT', () => stop('SIGINT'));
    // Announced once the signals are handled: whoever reads this line may stop the server at once.
    process.stderr.write(
      `voxserve listening on ${server.url} (${Math.round(performance.now() - t0)} ms); models: GET ${server.url}/v1/models\n`,
    );
    if (server.wyoming) process.stderr.write(`voxserve wyoming on ${server.wyoming.uri}\n`);
    if (server.zeroconf) process.stderr.write(`voxserve zeroconf: _wyoming._tcp as ${server.zeroconf.name}\n`);
    // Configuration mistakes found at start (a model file that is not there) are said here, not only in the log.
    for (const f of server.supervisor.failedModels()) {
      const index = config.models.findIndex((m) => m.id === f.id);
      const where = index >= 0 ? ` (config models[${index}], path '${config.models[index].path ?? ''}')` : '';
      process.stderr.write(
        `voxserve: warning: model ${f.id}${where} cannot load: ${f.error}; requests for it get 503 model_unavailable until it is fixed\n`,
      );
    }
  });

program
  .command('run')
  .description(
    'send an audio file (WAV, MP3, Ogg Vorbis/Opus, FLAC, WebM/Opus) to a running server and print the JSON result',
  )
  .argument('<model>', 'model id, e.g. silero-vad or alexa')
  .argument('<file>', 'audio file')
  .option('--url <url>', 'server URL', DEFAULT_URL)
  .addOption(new Option('--api-key <key>', "one of the server's auth.api_keys").env('VOXSERVE_API_KEY'))
  .option('--option <key=value>', 'task option (repeatable), e.g. --option threshold=0.7', collectOption, {})
  .option('--progress', 'draw a progress bar on stderr even when it is not a terminal')
  .option('--no-progress', 'no progress bar (default: one on stderr when it is a terminal)')
  .option('-o, --output <file>', 'a denoise model (rnnoise): write the denoised audio to this WAV file')
  .option('--denoise <model>', 'a chain: denoise with this model (rnnoise) before the VAD or wake-word model')
  .action(
    async (
      model: string,
      file: string,
      opts: {
        url: string;
        apiKey?: string;
        option: Record<string, unknown>;
        progress?: boolean;
        output?: string;
        denoise?: string;
      },
    ) => {
      let audio: Buffer;
      try {
        audio = readFileSync(file);
      } catch (e) {
        die(`cannot read ${file}: ${(e as NodeJS.ErrnoException).code ?? (e as Error).message}`);
      }
      if (opts.output !== undefined) {
        // -o takes the denoise answer's own options only: the others would be dropped silently.
        if (opts.denoise !== undefined || Object.keys(opts.option).some((k) => k !== 'sample_rate'))
          die(
            "-o writes a denoise model's audio: it takes --option sample_rate=HZ only (not --denoise or task options)",
          );
        try {
          const wav = await client(opts.url, opts.apiKey).denoise(audio, {
            model,
            sampleRate: opts.option.sample_rate === undefined ? undefined : Number(opts.option.sample_rate),
            contentType: AUDIO_TYPES[extname(file).toLowerCase()],
          });
          writeFileSync(opts.output, wav);
          process.stderr.write(`wrote ${opts.output} (${wav.length} bytes)\n`);
        } catch (e) {
          failed(opts.url, e);
        }
        return;
      }
      const show = opts.progress ?? process.stderr.isTTY;
      const bar = show ? progressBar('processed', 's', true) : null;
      try {
        const result = await client(opts.url, opts.apiKey).run(audio, {
          model,
          denoise: opts.denoise,
          options: Object.keys(opts.option).length ? opts.option : undefined,
          contentType: AUDIO_TYPES[extname(file).toLowerCase()],
          onProgress: bar ? (p) => bar.update(p.processed_ms / 1000, p.audio_duration_ms / 1000) : undefined,
        });
        bar?.stop();
        process.stdout.write(`${JSON.stringify(result)}\n`);
      } catch (e) {
        bar?.stop();
        failed(opts.url, e);
      }
    },
  );

program
  .command('models')
  .description('list the models of a running server: id, task, state, licence (and the models that failed to load)')
  .option('--url <url>', 'server URL', DEFAULT_URL)
  .option('--json', 'print the GET /v1/models answer as it is')
  .action(async (opts: { url: string; json?: boolean }) => {
    let list: { models: ModelStatus[]; failed_models: { id: string; error: string }[] };
    try {
      list = await client(opts.url).modelList();
    } catch (e) {
      failed(opts.url, e);
    }
    if (opts.json) return void process.stdout.write(`${JSON.stringify(list)}\n`);
    const rows = [
      ['ID', 'TASK', 'STATE', 'LICENCE'],
      ...list.models.map((m) => [m.id, m.task, m.state, m.licence ?? '-']),
    ];
    const widths = rows[0].map((_, i) => Math.max(...rows.map((r) => r[i].length)));
    for (const r of rows)
      process.stdout.write(`${r.map((c, i) => (i === r.length - 1 ? c : c.padEnd(widths[i]))).join('  ')}\n`);
    for (const f of list.failed_models) process.stdout.write(`failed to load: ${f.id}: ${f.error}\n`);
  });

program
  .command('stream')
  .description('stream a WAV file to a running server over WebSocket and print events as they arrive')
  .argument('<model>', 'model id')
  .argument('<file>', 'WAV file (PCM, float, mu-law or A-law, any rate and channel count; sent as s16le)')
  .option('--url <url>', 'server URL', DEFAULT_URL)
  .option('--realtime', 'send each frame when its audio has elapsed')
  .option('--frame-ms <ms>', 'frame length, 1-10000 ms', frameMs, 100)
  .option('--protocol <p>', 'event encoding: json or msgpack', 'json')
  .option('--scores', "wake words: print each 80 ms step's score per label (score events)")
  .option('-o, --output <file>', 'a denoise stream (rnnoise): write the audio it answers to this WAV file')
  .addOption(new Option('--api-key <key>', "one of the server's auth.api_keys").env('VOXSERVE_API_KEY'))
  .action(
    async (
      model: string,
      file: string,
      opts: {
        url: string;
        realtime?: boolean;
        frameMs: number;
        protocol: string;
        apiKey?: string;
        scores?: boolean;
        output?: string;
      },
    ) => {
      if (opts.protocol !== 'json' && opts.protocol !== 'msgpack')
        die(`--protocol must be json or msgpack, got '${opts.protocol}'`);
      let wav: InstanceType<typeof WaveFile>;
      try {
        const bytes = readFileSync(file);
        // A compressed file is named, with the command that takes it (`run` decodes it on the server).
        const looks = describeBytes(bytes);
        if (looks.format && looks.format !== 'wav')
          die(
            `cannot stream ${file}: this looks like ${looks.name}; \`stream\` sends WAV audio: send it with \`${invocation()} run ${model} ${file}\` (the server decodes ${looks.name}), or convert it to WAV`,
          );
        // The server's own checks of a WAV body (a truncated data chunk, a bit depth its encoding cannot have): a file
        // HTTP refuses is refused here.
        decodeWav(bytes);
        wav = new WaveFile(bytes);
        // G.711 (telephone audio) is expanded by its codec: toBitDepth would take its bytes for 8-bit PCM.
        const { audioFormat } = wav.fmt as { audioFormat: number };
        if (audioFormat === 7) wav.fromMuLaw();
        else if (audioFormat === 6) wav.fromALaw();
        else wav.toBitDepth('16');
      } catch (e) {
        die(`cannot read ${file} as WAV: ${(e as Error).message}`);
      }
      const fmt = wav.fmt as { sampleRate: number; numChannels: number };
      const pcm = Buffer.from((wav.data as { samples: Uint8Array }).samples);
      const frameBytes = Math.max(
        2 * fmt.numChannels,
        Math.round((fmt.sampleRate * opts.frameMs) / 1000) * 2 * fmt.numChannels,
      );
      let stream: VoxStream;
      try {
        stream = await client(opts.url, opts.apiKey).stream({
          model,
          sampleRate: fmt.sampleRate,
          channels: fmt.numChannels,
          encoding: 's16le',
          protocol: opts.protocol,
          ...(opts.scores ? { scores: true } : {}),
        });
      } catch (e) {
        failed(opts.url, e);
      }
      let errors = 0;
      const audio: Uint8Array[] = [];
      const printing = (async () => {
        for await (const event of stream) {
          // Denoised audio is not printed as numbers: its size is, and `-o` keeps it.
          if (event.type === 'audio') {
            audio.push(event.data);
            process.stdout.write(`${JSON.stringify({ type: 'audio', bytes: event.data.length })}\n`);
            continue;
          }
          process.stdout.write(`${JSON.stringify(event)}\n`);
          if (event.type === 'error') errors++;
        }
      })();
      // Handled below (awaited after the audio is sent): without this, a stream the server closes
      // while the sender waits for its next real-time frame is an unhandled rejection.
      printing.catch(() => {});
      const start = performance.now();
      try {
        for (let off = 0, i = 0; off < pcm.length; off += frameBytes, i++) {
          if (opts.realtime) {
            const due = start + i * opts.frameMs - performance.now();
            if (due > 0) await new Promise((r) => setTimeout(r, due));
          }
          await stream.send(pcm.subarray(off, off + frameBytes));
        }
        await stream.end();
        await printing;
      } catch (e) {
        await printing.catch(() => {});
        failed(opts.url, e);
      }
      if (opts.output) {
        // Mono 16-bit PCM at the rate the stream was opened with (the file's), as the stream answers it.
        const pcm16 = Buffer.concat(audio);
        const out = new WaveFile();
        out.fromScratch(1, fmt.sampleRate, '16', new Int16Array(pcm16.buffer, pcm16.byteOffset, pcm16.length / 2));
        writeFileSync(opts.output, out.toBuffer());
        process.stderr.write(`wrote ${opts.output} (${pcm16.length / 2} samples at ${fmt.sampleRate} Hz)\n`);
      }
      process.exit(errors ? 1 : 0);
    },
  );

program
  .command('bench')
  .description(
    "what share of the bare models' capacity the server holds, and its CPU over each stream's whole life (open to close): VAD (100 and 20 ms frames), wake words and (--task denoise) RNNoise, against the bare loop measured in the same run",
  )
  .option('--task <list>', 'workloads: vad100, vad20, wakeword, denoise (vad = vad100,vad20)', 'vad100,vad20,wakeword')
  .option('--quick', 'the same shape, shorter: the same rounds with 6 s streams and search steps of 10 % of the limit')
  .option(
    '--rounds <n>',
    'rounds of everything: bare loop (best), held search and runs (median, spread)',
    int('--rounds'),
    3,
  )
  .option('--seconds <s>', 'audio per stream and run, s (default 60; --quick 6)', int('--seconds'))
  .option('--streams <list>', 'fixed stream counts instead of the held search (for profiling), each run in every round')
  .option('--slots <n>', 'server slots per model', int('--slots'), 2)
  .option('--batch-size <n>', "the model's max_batch_size (default: the server's)", int('--batch-size'))
  .option('--batch-delay-ms <ms>', "the model's max_batch_delay_ms (default: the server's)", int('--batch-delay-ms'))
  .option('--isolation <mode>', 'slot hosts: process or thread', 'process')
  .option('--probabilities', 'VAD streams ask for probabilities=true (a probability event per window)')
  .option(
    '--warm-up <s>',
    "audio per stream of the unmeasured warm-up each run's server gets first, s (0: measure a fresh server)",
    int('--warm-up'),
    2,
  )
  .action(
    async (opts: {
      task: string;
      quick?: boolean;
      rounds: number;
      seconds?: number;
      streams?: string;
      slots: number;
      batchSize?: number;
      batchDelayMs?: number;
      isolation: string;
      probabilities?: boolean;
      warmUp: number;
    }) => {
      const workloads = opts.task.split(',').flatMap((t) => (t === 'vad' ? ['vad100', 'vad20'] : [t]));
      const known = ['vad100', 'vad20', 'wakeword', 'denoise'];
      if (!workloads.every((t) => known.includes(t)))
        die(`--task must be a comma-separated list of ${known.join(', ')} (or vad), got '${opts.task}'`);
      const streams = opts.streams?.split(',').map(Number);
      if (streams?.some((n) => !Number.isInteger(n) || n < 1))
        die('--streams must be a comma-separated list of positive integers');
      if (opts.isolation !== 'process' && opts.isolation !== 'thread')
        die(`--isolation must be process or thread, got '${opts.isolation}'`);
      // The server's own bounds (docs/configuration.md), checked before minutes of bare loops, not after.
      if (opts.rounds < 1) die('--rounds must be at least 1');
      if (opts.seconds !== undefined && opts.seconds < 1) die('--seconds must be at least 1');
      if (opts.slots < 1 || opts.slots > 16) die("--slots must be from 1 to 16 (a model's slots)");
      if (opts.batchSize !== undefined && (opts.batchSize < 1 || opts.batchSize > 512))
        die('--batch-size must be from 1 to 512 (max_batch_size)');
      if (opts.batchDelayMs !== undefined && opts.batchDelayMs > 1000)
        die('--batch-delay-ms must be from 0 to 1000 (max_batch_delay_ms)');
      const { bench } = await import('./bench.js');
      await bench({
        workloads: workloads as WorkloadName[],
        rounds: opts.rounds,
        seconds: opts.seconds ?? (opts.quick ? 6 : 60),
        step: opts.quick ? 0.1 : 0.05,
        streams,
        slots: opts.slots,
        batchSize: opts.batchSize,
        batchDelayMs: opts.batchDelayMs,
        isolation: opts.isolation,
        probabilities: opts.probabilities,
        warmUpS: opts.warmUp,
      });
    },
  );

program.parseAsync().catch((e) => {
  if (e instanceof CommanderError) process.exit(e.exitCode === 0 ? 0 : CONFIG_ERROR);
  die((e as Error).message);
});
