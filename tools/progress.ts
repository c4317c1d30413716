import { Presets, SingleBar } from 'cli-progress';

/**
 * A progress bar on stderr (cli-progress): `label [bar] percent | value/total unit`, with the
 * estimated time left when `eta`. Redrawn in place on a terminal, else a line a second.
 */
export function progressBar(
  label: string,
  unit: string,
  eta = false,
): { update(value: number, total: number): void; stop(): void } {
  const bar = new SingleBar(
    {
      stream: process.stderr,
      noTTYOutput: true,
      notTTYSchedule: 1000,
      format: `${label} [{bar}] {percentage}% | {value}/{total} ${unit}${eta ? ' | eta {eta_formatted}' : ''}`,
      hideCursor: true,
    },
    Presets.shades_classic,
  );
  let started = false;
  return {
    update(value, total) {
      const v = Math.round(value * 10) / 10;
      const t = Math.round(total * 10) / 10;
      if (!started) bar.start(t, v);
      else bar.setTotal(t);
      started = true;
      bar.update(v);
    },
    stop() {
      if (started) bar.stop();
    },
  };
}
