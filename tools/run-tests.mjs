// Runs the vitest suite and ends with one line `N passed, N failed[, N skipped]` (read by CI).
// Exits with vitest's exit code.
import { spawnSync } from 'node:child_process';
import { mkdirSync, readFileSync } from 'node:fs';

mkdirSync('spec/artifacts', { recursive: true });
const report = 'spec/artifacts/vitest.json';
const r = spawnSync('npx', ['vitest', 'run', '--reporter=default', '--reporter=json', `--outputFile=${report}`, ...process.argv.slice(2)], { stdio: 'inherit' });
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
console.log(summary);
process.exit(r.status ?? 1);
