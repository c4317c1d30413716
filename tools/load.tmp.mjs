import WebSocket from 'ws';
import { readFileSync } from 'node:fs';
const n = Number(process.argv[2] ?? 60), secs = Number(process.argv[3] ?? 10), model = process.argv[4] ?? 'hey-jarvis';
const pcm = Buffer.concat([readFileSync('/work/main/spec/fixtures/espeak_alexa_16k.wav').subarray(44), readFileSync('/work/main/spec/fixtures/espeak_sentence_16k.wav').subarray(44)]);
const FRAME = 3200;
let done = 0;
await Promise.all(Array.from({ length: n }, (_, k) => new Promise((res) => {
  const ws = new WebSocket(`ws://127.0.0.1:8099/v1/stream?model=${model}`);
  ws.on('error', (e) => { console.error(e.message); res(); });
  ws.on('message', (d) => {
    const e = JSON.parse(d.toString());
    if (e.type === 'ready') {
      const t0 = performance.now() + (k % 100) ; let i = 0;
      const tick = () => {
        if (i * 100 >= secs * 1000) { ws.send(JSON.stringify({ type: 'end' })); return; }
        const off = ((i + k * 13) * FRAME) % (pcm.length - FRAME);
        ws.send(pcm.subarray(off, off + FRAME)); i++;
        setTimeout(tick, Math.max(0, t0 + i * 100 - performance.now()));
      };
      tick();
    }
    if (e.type === 'done') { ws.close(); }
  });
  ws.on('close', () => { done++; res(); });
})));
console.log('done', done);
