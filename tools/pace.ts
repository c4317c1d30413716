/** A stream paced in real time: when its frame 0 starts (performance.now(), ms) and the next frame to send. */
export interface Paced {
  start: number;
  next: number;
}

/**
 * Sends every stream's frames in real time, as a live source would: frame k of a stream goes
 * once its audio has elapsed (`start + (k + 1) * frameMs`), checked every 2 ms. `send(s, k)`
 * sends frame k (and, for the last, `totalFrames - 1`, whatever ends the stream); `onTick` is
 * called on each check with the time. Resolves once every frame of every stream is sent.
 */
export function paceFrames<S extends Paced>(
  streams: S[],
  totalFrames: number,
  frameMs: number,
  send: (s: S, frame: number) => void,
  onTick: (now: number) => void = () => {},
): Promise<void> {
  return new Promise((resolve) => {
    const tick = (): void => {
      const now = performance.now();
      let pending = false;
      for (const s of streams) {
        while (s.next < totalFrames && s.start + (s.next + 1) * frameMs <= now) send(s, s.next++);
        if (s.next < totalFrames) pending = true;
      }
      onTick(now);
      if (pending) setTimeout(tick, 2);
      else resolve();
    };
    tick();
  });
}
