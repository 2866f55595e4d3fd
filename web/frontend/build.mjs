// Build the dashboard: bundle src/ (and uPlot from node_modules) into ../static/, which the
// controller serves under /ui/ and the wheel packages. Run by `make web-assets`
// (npm ci && node build.mjs); the output is not committed.
import { build } from "esbuild";
import { copyFile, mkdir, rm } from "node:fs/promises";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const out = join(here, "..", "static");

await rm(out, { recursive: true, force: true });
await mkdir(out, { recursive: true });
await build({
  entryPoints: [
    { in: join(here, "src", "main.js"), out: "app" },
    { in: join(here, "src", "app.css"), out: "app" },
  ],
  outdir: out,
  bundle: true,
  minify: true,
  sourcemap: false,
  format: "iife",
  target: ["es2020"],
  legalComments: "eof",
  // uPlot is MIT licensed; its notice travels with the bundle.
  banner: { js: "/* trainguard dashboard. Bundles uPlot (c) Leon Sorokin, MIT License. */" },
  logLevel: "warning",
});
await copyFile(join(here, "src", "index.html"), join(out, "index.html"));
console.log(`dashboard assets built into ${out}`);
