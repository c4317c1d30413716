/**
 * Issue 44 item 6: a wake-word family's slot hosts load each head the first time a job names it.
 * They used to keep it for the family's whole life, so a family that never stops (some wake-word
 * model always loaded) grew with every head any model ever named: ad hoc groups come and go, and
 * a watched folder's heads are replaced (with thread hosts that is the server process's memory).
 * Now a host releases the heads no model of the family names, at its next job: it holds the
 * heads of the models loaded, not of every model since the family started.
 */
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { OWW_EMBEDDING, OWW_MELSPECTROGRAM, OWW_MODELS } from '../../runtime/catalog.js';
import { OWW, type WakewordJob, type WakewordResult } from '../../runtime/slots/slot-protocol.js';
import { startWorkerSlot } from '../../runtime/slots/slots.js';
import { type FamilyView, WakewordFamilies } from '../../runtime/wakeword/wakeword-family.js';

const families = new WakewordFamilies();
const head = (name: string): string => join(OWW_MODELS, `${name}_v0.1.onnx`);
const spec = {
  kind: 'wakeword' as const,
  heads: [],
  melspectrogram: new Uint8Array(readFileSync(OWW_MELSPECTROGRAM)),
  embedding: new Uint8Array(readFileSync(OWW_EMBEDDING)),
};
/** One model of the family (one slot, a worker thread): its view. */
const model = (heads: string[]): Promise<FamilyView> =>
  families.acquire('family', spec, 1, startWorkerSlot, heads.map(head));
const views: FamilyView[] = [];
afterAll(async () => {
  for (const v of views) await v.close();
});

/** Runs one 80 ms step of silence on `view`; the heads its host holds afterwards. */
async function headsHeld(view: FamilyView): Promise<number> {
  const window = Math.max(...view.info.heads!.map((h) => h.window));
  const job: WakewordJob = {
    kind: 'wakeword',
    audio: new Float32Array(OWW.LOOKBACK + OWW.STEP),
    mel: new Float32Array(OWW.MEL_FRAMES * OWW.MEL_BINS).fill(1),
    embeddings: new Float32Array(window * OWW.EMBEDDING),
  };
  const r = (await view.run(job)) as WakewordResult;
  expect(r.scores.length).toBeGreaterThan(0);
  return r.headsLoaded!;
}

describe('wake-word family heads', () => {
  it("a family's host holds the heads of its models loaded now, not of every model it served", async () => {
    const a = await model(['alexa']);
    const b = await model(['hey_jarvis', 'timer']);
    views.push(a, b);
    expect(families.size).toBe(1);
    expect(await headsHeld(a)).toBe(1);
    expect(await headsHeld(b)).toBe(3);
    await a.close();
    // alexa's model is gone: its head goes at the host's next job.
    expect(await headsHeld(b)).toBe(2);
    const c = await model(['weather']);
    views.push(c);
    await b.close();
    expect(await headsHeld(c)).toBe(1);
    // A head released is loaded again when a model names it once more, and scores.
    const again = await model(['alexa', 'weather']);
    views.push(again);
    expect(await headsHeld(again)).toBe(2);
    expect(families.size).toBe(1);
  });
});
