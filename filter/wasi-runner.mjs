// Cargo runner for wasm32-wasip1 test binaries under Node.js (>= 20, `node:wasi`).
//
//   CARGO_TARGET_WASM32_WASIP1_RUNNER="node <repo>/filter/wasi-runner.mjs" \
//     cargo test --target wasm32-wasip1 -p kvguard-filter-core -p kvguard-contract
//
// Cargo calls `<runner> <test.wasm> [libtest args...]`. The module gets those args,
// the environment, and the current directory and `/` preopened; the process exits
// with the module's exit code (a failed test or a trap is non-zero).
import { readFile } from "node:fs/promises";
import { WASI } from "node:wasi";
import process from "node:process";

// node:wasi prints an ExperimentalWarning; keep the test output clean.
process.removeAllListeners("warning");
process.on("warning", (w) => {
  if (w.name !== "ExperimentalWarning") console.error(w);
});

const [wasmPath, ...args] = process.argv.slice(2);
if (!wasmPath) {
  console.error("usage: node wasi-runner.mjs <module.wasm> [args...]");
  process.exit(2);
}

const wasi = new WASI({
  version: "preview1",
  args: [wasmPath, ...args],
  env: process.env,
  preopens: { ".": process.cwd(), "/": "/" },
  returnOnExit: true,
});

let code;
try {
  const module = await WebAssembly.compile(await readFile(wasmPath));
  const instance = await WebAssembly.instantiate(module, wasi.getImportObject());
  code = wasi.start(instance);
} catch (e) {
  // A trap (e.g. a panic with panic=abort is `unreachable`) ends here.
  console.error(`wasi-runner: ${wasmPath}: ${e && e.stack ? e.stack : e}`);
  code = 101;
}
process.exit(typeof code === "number" ? code : 1);
