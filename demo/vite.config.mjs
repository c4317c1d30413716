// Builds the /demo page (demo/index.html, demo/app.ts and the client it imports) into dist/demo,
// served by the server from memory. Run by `npm run build`.
import { fileURLToPath } from 'node:url';
import { defineConfig } from 'vite';

export default defineConfig({
  root: fileURLToPath(new URL('.', import.meta.url)),
  base: '/demo/',
  logLevel: 'warn',
  build: {
    outDir: fileURLToPath(new URL('../dist/demo', import.meta.url)),
    emptyOutDir: true,
    chunkSizeWarningLimit: 4096,
  },
});
