/** Model files named in a config file: where relative paths resolve, and problems found at start (issue 23). */
import { mkdirSync, mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import {
  OWW_EMBEDDING,
  OWW_MODELS,
  RNNOISE_WASM,
  SILERO_V5,
  SILERO_V6,
  shippedModelFiles,
} from '../../runtime/catalog.js';
import { loadServerConfig, ServerConfig } from '../../runtime/config.js';
import { checkModelFile, looksLikeOnnx } from '../../runtime/loader.js';
import { startServer, type VoxServer } from '../../transport/server.js';
import { fixture, fixturePath, until } from '../helpers.js';

const dir = mkdtempSync(join(tmpdir(), 'voxserve-files-'));

describe('relative model paths in a config file', () => {
  it('are taken from the config file folder, not the working directory', () => {
    const folder = join(dir, 'etc', 'voxserve');
    mkdirSync(folder, { recursive: true });
    const file = join(folder, 'voxserve.json');
    writeFileSync(
      file,
      JSON.stringify({
        models: [
          {
            id: 'mine',
            task: 'wakeword',
            path: 'models/mine.onnx',
            melspectrogram_path: '../mel.onnx',
            embedding_path: '/abs/emb.onnx',
          },
        ],
      }),
    );
    const m = loadServerConfig(file).models[0];
    // Expected: the folder of the file joined by hand, whatever process.cwd() is.
    expect(m.path).toBe(`${dir}/etc/voxserve/models/mine.onnx`);
    expect(m.melspectrogram_path).toBe(`${dir}/etc/mel.onnx`);
    expect(m.embedding_path).toBe('/abs/emb.onnx');
    // No config file (API loads, flags): nothing is rewritten here.
    expect(ServerConfig.parse({ models: [{ id: 'x', task: 'vad', path: 'rel.onnx' }] }).models[0].path).toBe(
      'rel.onnx',
    );
  });
});

describe('an ONNX file is recognised by its first bytes (onnx.proto ModelProto)', () => {
  it('accepts every model file the catalog ships and refuses other files', () => {
    // Every one but RNNoise's WASM build (the `denoise` task's `rnnoise`, not ONNX: runtime/slots/rnnoise.ts).
    for (const f of shippedModelFiles().filter((f) => f !== RNNOISE_WASM))
      expect(looksLikeOnnx(readFileSync(f).subarray(0, 16)), f).toBe(true);
    expect(looksLikeOnnx(readFileSync(RNNOISE_WASM).subarray(0, 16))).toBe(false);
    // The same package ships TFLite builds of the same models: flatbuffers, not ONNX.
    expect(looksLikeOnnx(readFileSync(join(OWW_MODELS, 'alexa_v0.1.tflite')).subarray(0, 16))).toBe(false);
    expect(looksLikeOnnx(fixture('Front_Center.wav').subarray(0, 16))).toBe(false);
    expect(looksLikeOnnx(Buffer.from('{"not": "a model"}'))).toBe(false);
    expect(looksLikeOnnx(new Uint8Array(0))).toBe(false);
    expect(() => checkModelFile(fixturePath('Front_Center.wav'))).toThrow(
      `model file ${fixturePath('Front_Center.wav')} is not an ONNX model`,
    );
    expect(() => checkModelFile(join(dir, 'nope.onnx'))).toThrow(
      `cannot read model file ${dir}/nope.onnx: it does not exist`,
    );
    expect(() => checkModelFile(dir)).toThrow('it is not a regular file');
    expect(() => checkModelFile(SILERO_V6)).not.toThrow();
  });
});

describe('lazy models with a bad file, found at start', () => {
  let server: VoxServer;
  afterAll(async () => {
    await server?.close();
  });

  it('are listed in failed_models with the resolved path, and their first use says why (not a protobuf error)', async () => {
    const folder = join(dir, 'conf');
    mkdirSync(join(folder, 'models'), { recursive: true });
    writeFileSync(join(folder, 'models', 'broken.onnx'), 'this is not a model\n');
    writeFileSync(join(folder, 'models', 'good.onnx'), readFileSync(SILERO_V5));
    const file = join(folder, 'voxserve.json');
    writeFileSync(
      file,
      JSON.stringify({
        log_level: 'silent',
        port: 0,
        models: [
          { id: 'missing', task: 'vad', path: 'models/missing.onnx' },
          { id: 'broken', task: 'vad', path: 'models/broken.onnx' },
          { id: 'good', task: 'vad', path: 'models/good.onnx' },
          {
            id: 'mel-gone',
            task: 'wakeword',
            path: join(OWW_MODELS, 'alexa_v0.1.onnx'),
            melspectrogram_path: 'models/mel.onnx',
            embedding_path: OWW_EMBEDDING,
          },
        ],
      }),
    );
    server = await startServer(loadServerConfig(file));
    await until(async () => (await fetch(`${server.url}/ready`)).status === 200);
    const ready = await (await fetch(`${server.url}/ready`)).json();
    expect(ready.failed_models).toEqual([
      { id: 'missing', error: `cannot read model file ${folder}/models/missing.onnx: it does not exist` },
      {
        id: 'broken',
        error: `model file ${folder}/models/broken.onnx is not an ONNX model (its first bytes are not an ONNX ModelProto)`,
      },
      { id: 'mel-gone', error: `cannot read model file ${folder}/models/mel.onnx: it does not exist` },
    ]);
    expect((await (await fetch(`${server.url}/v1/models`)).json()).failed_models).toEqual(ready.failed_models);
    const run = await fetch(`${server.url}/v1/tasks/run?model=broken`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: new Uint8Array(fixture('Front_Left.wav')),
    });
    const body = await run.json();
    expect(body.error.message).toContain(`model file ${folder}/models/broken.onnx is not an ONNX model`);
    expect(body.error.message).not.toMatch(/protobuf/i);
    const good = await fetch(`${server.url}/v1/tasks/run?model=good`, {
      method: 'POST',
      headers: { 'content-type': 'audio/wav' },
      body: new Uint8Array(fixture('Front_Left.wav')),
    });
    expect(good.status).toBe(200);
  });
});

describe('an unknown wake-word head in a config file', () => {
  it('names the config field and the known wake words, without pointing at a server that is not running', async () => {
    const err = await startServer(
      ServerConfig.parse({
        log_level: 'silent',
        port: 0,
        models: [{ id: 'house', task: 'wakeword', heads: ['alexa', 'hey-jarvus'] }],
      }),
    ).catch((e: Error) => e);
    expect((err as Error).message).toMatch(
      /^models\.0\.heads\.1: wake-word model 'hey-jarvus' does not exist \(did you mean 'hey-jarvis'\?\); the wake-word models this server knows: alexa, hey-jarvis, hey-mycroft, hey-rhasspy, timer, weather$/,
    );
  });
});
