/**
 * Issue 43 (d): multipart uploads on `POST /v1/tasks/run` (`curl -F file=@x.wav -F model=ID`):
 * the same result as the file sent as the body; the form's text fields are the raw-body run's
 * query parameters; a form without one file, or one that is not a form, is a 400 saying so.
 */
import { execFile } from 'node:child_process';
import { promisify } from 'node:util';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { VoxServer } from '../../transport/server.js';
import { fixture, fixturePath, startTestServer } from '../helpers.js';

const exec = promisify(execFile);
let server: VoxServer;
beforeAll(async () => {
  server = await startTestServer();
});
afterAll(async () => {
  await server?.close();
});

const strip = (r: Record<string, unknown>) => ({ ...r, timing: undefined });

async function raw(model: string, name: string, query = ''): Promise<Record<string, unknown>> {
  const r = await fetch(`${server.url}/v1/tasks/run?model=${model}${query}`, {
    method: 'POST',
    headers: { 'content-type': 'application/octet-stream' },
    body: new Uint8Array(fixture(name)),
  });
  expect(r.status).toBe(200);
  return strip(await r.json());
}

function form(fields: Record<string, string>, files: [string, string, string][]): FormData {
  const f = new FormData();
  for (const [k, v] of Object.entries(fields)) f.append(k, v);
  for (const [field, name, type] of files) f.append(field, new Blob([new Uint8Array(fixture(name))], { type }), name);
  return f;
}

describe('multipart uploads on POST /v1/tasks/run (issue 43)', () => {
  it('a WAV and an Ogg file with the model as a form field or in the query: the raw body route result', async () => {
    const a = await fetch(`${server.url}/v1/tasks/run`, {
      method: 'POST',
      body: form({ model: 'silero-vad' }, [['file', 'Front_Center.wav', 'audio/wav']]),
    });
    expect(a.status).toBe(200);
    expect(strip(await a.json())).toEqual(await raw('silero-vad', 'Front_Center.wav'));
    const b = await fetch(`${server.url}/v1/tasks/run?model=silero-vad`, {
      method: 'POST',
      body: form({}, [['audio', 'Front_Center.ogg', 'audio/ogg']]),
    });
    expect(b.status).toBe(200);
    expect(strip(await b.json())).toEqual(await raw('silero-vad', 'Front_Center.ogg'));
    // Task options as form fields.
    const c = await fetch(`${server.url}/v1/tasks/run`, {
      method: 'POST',
      body: form({ model: 'hey-jarvis', threshold: '0.3', scores: 'true' }, [
        ['file', 'espeak_hey_jarvis_22k.wav', 'audio/x-wav'],
      ]),
    });
    expect(c.status).toBe(200);
    expect(strip(await c.json())).toEqual(
      await raw('hey-jarvis', 'espeak_hey_jarvis_22k.wav', '&threshold=0.3&scores=true'),
    );
  }, 60_000);

  it('curl -F file=@x.wav', async () => {
    const { stdout } = await exec('curl', [
      '-s',
      '-F',
      `file=@${fixturePath('Front_Center.wav')}`,
      '-F',
      'model=silero-vad',
      `${server.url}/v1/tasks/run`,
    ]);
    expect(strip(JSON.parse(stdout))).toEqual(await raw('silero-vad', 'Front_Center.wav'));
  });

  it('no file, two files, a field twice, or no form at all: a 400 saying what to do', async () => {
    const cases: [RequestInit, string, string][] = [
      [
        { body: form({ model: 'silero-vad' }, []) },
        'invalid_field',
        'file: a multipart upload needs one file part (curl -F file=@x.wav)',
      ],
      [
        {
          body: form({ model: 'silero-vad' }, [
            ['a', 'Front_Center.wav', 'audio/wav'],
            ['b', 'Front_Left.wav', 'audio/wav'],
          ]),
        },
        'invalid_field',
        'file: one file per request, got 2; several files go to POST /v1/tasks/batch',
      ],
      [
        {
          body: 'junk',
          headers: { 'content-type': 'multipart/form-data; boundary=zz' },
        },
        'invalid_multipart',
        'body is not a readable multipart/form-data form (Failed to parse body as FormData.)',
      ],
    ];
    for (const [init, code, message] of cases) {
      const r = await fetch(`${server.url}/v1/tasks/run`, { method: 'POST', ...init });
      expect(r.status, message).toBe(400);
      expect((await r.json()).error, message).toEqual({ type: 'invalid_request_error', code, message });
    }
    const twice = await fetch(`${server.url}/v1/tasks/run?model=silero-vad`, {
      method: 'POST',
      body: form({ model: 'silero-vad' }, [['file', 'Front_Center.wav', 'audio/wav']]),
    });
    expect((await twice.json()).error.message).toBe('model: given twice (in the query string and in the form)');
    // A form is a type a web page may post to another site without a preflight: its Origin is checked.
    const foreign = await fetch(`${server.url}/v1/tasks/run?model=silero-vad`, {
      method: 'POST',
      headers: { origin: 'http://evil.example' },
      body: form({}, [['file', 'Front_Center.wav', 'audio/wav']]),
    });
    expect(foreign.status).toBe(403);
    expect((await foreign.json()).error.code).toBe('origin_not_allowed');
  });
});

describe("a form's denoise, sample_rate and Accept (a newcomer's finding: they were ignored)", () => {
  it('a chain, a denoise answer at a chosen rate, JSON on Accept, and a bad chain refused, as with the raw body', async () => {
    const post = (fields: Record<string, string>, headers: Record<string, string> = {}) =>
      fetch(`${server.url}/v1/tasks/run`, {
        method: 'POST',
        headers,
        body: form(fields, [['file', 'Front_Center.wav', 'audio/wav']]),
      });
    const chain = await post({ model: 'silero-vad', denoise: 'rnnoise' });
    expect(chain.status).toBe(200);
    const chained = strip(await chain.json()) as Record<string, unknown>;
    expect(chained).toEqual(await raw('silero-vad', 'Front_Center.wav', '&denoise=rnnoise'));
    // The chain changes the answer (else the test could not tell it was ignored).
    expect(chained.segments).not.toEqual((await raw('silero-vad', 'Front_Center.wav')).segments);
    const wav = await post({ model: 'rnnoise', sample_rate: '16000' });
    expect(wav.status).toBe(200);
    const bytes = Buffer.from(await wav.arrayBuffer());
    expect(bytes.readUInt32LE(24)).toBe(16_000); // the WAV header's sample rate
    const json = await post({ model: 'rnnoise' }, { accept: 'application/json' });
    expect(json.headers.get('content-type')).toMatch(/json/);
    const bad = await post({ model: 'silero-vad', denoise: 'silero-vad' });
    expect(bad.status).toBe(400);
    expect((await bad.json()).error.message).toMatch(/denoise/);
    const unknown = await post({ model: 'silero-vad', denoise: 'nope' });
    expect(unknown.status).toBe(400);
    expect((await unknown.json()).error.message).toMatch(/^denoise: /);
  });
});
