// Runs the vitest suite and ends with one line `N passed, N failed[, N skipped]` (read by CI).
// Exits with vitest's exit code.
import { spawnSync } from 'node:child_process';
import { mkdirSync, readdirSync, readFileSync, rmSync } from 'node:fs';

mkdirSync('spec/artifacts', { recursive: true });
// The fuzz suites (spec/fuzz) write their input counts here; stale ones from an earlier run go first.
for (const f of readdirSync('spec/artifacts')) if (f.startsWith('fuzz-')) rmSync(`spec/artifacts/${f}`);
const report = 'spec/artifacts/vitest.json';
const r = spawnSync(
  'npx',
  ['vitest', 'run', '--reporter=default', '--reporter=json', `--outputFile=${report}`, ...process.argv.slice(2)],
  { stdio: 'inherit' },
);
let summary = '0 passed, 1 failed';
try {
  const j = JSON.parse(readFileSync(report, 'utf8'));
  const skipped = j.numPendingTests + j.numTodoTests;
  // A file that fails to load has no tests; count it as a failure.
  const brokenFiles = j.testResults.filter((f) => f.status === 'failed' && f.assertionResults.length === 0).length;
  summary = `${j.numPassedTests} passed, ${j.numFailedTests + brokenFiles} failed${skipped ? `, ${skipped} skipped` : ''}`;
} catch {
  // no report: vitest did not run
}
const fuzz = readdirSync('spec/artifacts')
  .filter((f) => f.startsWith('fuzz-'))
  .map((f) => JSON.parse(readFileSync(`spec/artifacts/${f}`, 'utf8')).total);
if (fuzz.length) console.log(`fuzz: ${fuzz.reduce((a, b) => a + b, 0)} inputs`);
console.log(summary);
process.exit(r.status ?? 1);
