// Runs Envoy for a moment with a rendered Envoy config and the real filter, sends requests
// that the filter tracks (their upstream is a closed port, so they end in an upstream reset
// and an abort attempt), and checks what /stats/prometheus exports:
// - kvguard_filter_* stats are exported at all (the module loaded, the names are as
//   documented);
// - every kvguard_filter_* name is listed in METRICS.md: a label the config's stats_tags do
//   not extract would leave its `_label=.=value;.;` encoding in the name, and show here;
// - no name still carries the tag encoding.
// Listener and admin ports are 0 and every cluster points at a closed port: nothing on the
// machine is reached, nothing fixed is bound.
//
// Usage: node envoy-stats.mjs --envoy BIN --config RENDERED.yaml --metrics METRICS.md
import { spawn } from "node:child_process";
import { readFileSync, writeFileSync, mkdtempSync, rmSync, existsSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createServer } from "node:net";
import { parse, stringify } from "yaml";

const args = process.argv.slice(2);
const opt = {};
for (let i = 0; i < args.length; i += 2) opt[args[i].replace(/^--/, "")] = args[i + 1];
for (const k of ["envoy", "config", "metrics"]) if (!opt[k]) fail(`missing --${k}`);

function fail(msg) {
  console.error(`FAIL ${msg}`);
  process.exit(1);
}
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// A port that nothing listens on: bind, note, close.
async function closedPort() {
  return new Promise((resolve, reject) => {
    const s = createServer();
    s.once("error", reject);
    s.listen(0, "127.0.0.1", () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

const known = new Set(
  [...readFileSync(opt.metrics, "utf8").matchAll(/^\| `([a-zA-Z_][a-zA-Z0-9_]*)` \|/gm)].map((m) => m[1]),
);

const cfg = parse(readFileSync(opt.config, "utf8"));
const dead = await closedPort();
cfg.admin.address.socket_address.port_value = 0;
for (const l of cfg.static_resources.listeners) {
  l.address.socket_address.address = "127.0.0.1";
  l.address.socket_address.port_value = 0;
}
for (const c of cfg.static_resources.clusters) {
  for (const e of c.load_assignment?.endpoints ?? []) {
    for (const lb of e.lb_endpoints ?? []) {
      const sa = lb.endpoint?.address?.socket_address;
      if (sa) {
        sa.address = "127.0.0.1";
        sa.port_value = dead;
      }
    }
  }
}
const dir = mkdtempSync(join(tmpdir(), "kvguard-envoy-stats-"));
const cfgFile = join(dir, "envoy.yaml");
const adminFile = join(dir, "admin.addr");
writeFileSync(cfgFile, stringify(cfg, { lineWidth: 0 }));

const envoy = spawn(
  opt.envoy,
  ["-c", cfgFile, "--disable-hot-restart", "--concurrency", "2", "--admin-address-path", adminFile, "-l", "warning"],
  { stdio: ["ignore", "ignore", "pipe"] },
);
let log = "";
envoy.stderr.on("data", (d) => (log += d));
let exited = null;
envoy.on("exit", (code) => (exited = code));
const cleanup = () => {
  if (exited === null) envoy.kill("SIGKILL");
  rmSync(dir, { recursive: true, force: true });
};

try {
  let admin = null;
  for (let i = 0; i < 200 && !admin; i++) {
    if (exited !== null) throw new Error(`envoy exited (${exited}):\n${log.split("\n").slice(-15).join("\n")}`);
    if (existsSync(adminFile)) admin = readFileSync(adminFile, "utf8").trim() || null;
    if (!admin) await sleep(50);
  }
  if (!admin) throw new Error("envoy did not bind its admin port within 10 s");
  let port = null;
  for (let i = 0; i < 200 && !port; i++) {
    try {
      const ls = await (await fetch(`http://${admin}/listeners?format=json`)).json();
      port = ls.listener_statuses?.[0]?.local_address?.socket_address?.port_value || null;
    } catch {}
    if (!port) await sleep(50);
  }
  if (!port) throw new Error("envoy did not bind its listener within 10 s");
  const paths = ["/v1/chat/completions", "/v1/completions"];
  for (const p of paths) {
    await fetch(`http://127.0.0.1:${port}${p}`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ model: "m", stream: true, messages: [{ role: "user", content: "hi" }] }),
    }).then((r) => r.arrayBuffer()).catch(() => {});
  }
  // Wait (at most 10 s) for the aborts to end: connection refused, retried, then counted
  // in kvguard_filter_aborts_total{reason,outcome}, which exercises two tags at once.
  let text = "";
  for (let i = 0; i < 40; i++) {
    await sleep(250);
    text = await (await fetch(`http://${admin}/stats/prometheus`)).text();
    if (/^kvguard_filter_aborts_total\{/m.test(text) && /^kvguard_filter_pending_aborts\{\} 0$/m.test(text)) break;
  }
  const names = new Set();
  const bad = [];
  for (const line of text.split("\n")) {
    const m = /^([^\s{#]+)(\{[^}]*\})? /.exec(line);
    if (!m || !m[1].includes("kvguard_filter")) continue;
    names.add(m[1]);
    if (/=\.=|_\.;|;\.;/.test(line) || !known.has(m[1])) bad.push(line);
  }
  if (!names.size) throw new Error(`no kvguard_filter_ stats on /stats/prometheus:\n${log.split("\n").slice(-10).join("\n")}`);
  if (!names.has("kvguard_filter_requests_tracked_total")) bad.push("(kvguard_filter_requests_tracked_total missing after tracked requests)");
  for (const b of bad) console.error(`FAIL not a documented name (stats_tags in ${opt.config} or METRICS.md): ${b}`);
  if (bad.length) {
    cleanup();
    process.exit(1);
  }
  console.log(`ok: ${names.size} kvguard_filter_ names exported, all documented: ${[...names].sort().join(", ")}`);
  for (const line of text.split("\n")) if (line.startsWith("kvguard_filter_") && line.includes("{") && !line.includes("{}")) console.log(`  ${line}`);
} catch (e) {
  cleanup();
  fail(e.message);
}
cleanup();
