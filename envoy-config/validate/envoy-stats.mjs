// Runs Envoy for a moment with a rendered Envoy config and the real filter, sends requests
// that the filter tracks (their upstream is a closed port, so they end in an upstream reset
// and an abort attempt), and checks what /stats/prometheus exports:
// - kvguard_filter_* stats are exported at all (the module loaded, the names are as
//   documented);
// - every kvguard_filter_* name is listed in METRICS.md: a label the config's stats_tags do
//   not extract would leave its `_label=.=value;.;` encoding in the name, and show here;
// - no name still carries the tag encoding;
// - with --rules A.yaml,B.yaml: every label those rules select an exported metric by is on
//   each of its series (a tag regex that misses the metric's stat name leaves it off).
// Listener and admin ports are 0 and every cluster points at a closed port: nothing on the
// machine is reached, nothing fixed is bound.
//
// With --config-yaml FILE, Envoy also gets that file's text as --config-yaml (how pilot-agent
// hands an Istio gateway its custom bootstrap), and the config is made plain text first
// (TLS off, see envoy-run.mjs: the rendered gateway's certificates come from an SDS server
// that does not exist here).
//
// Usage: node envoy-stats.mjs --envoy BIN --config RENDERED.yaml --metrics METRICS.md [--config-yaml FILE] [--rules A,B]
import { readFileSync, writeFileSync } from "node:fs";
import { parse } from "yaml";
import { closedPort, plaintext, pointClustersAt, sleep, startEnvoy } from "./envoy-run.mjs";

const args = process.argv.slice(2);
const opt = {};
for (let i = 0; i < args.length; i += 2) opt[args[i].replace(/^--/, "")] = args[i + 1];
for (const k of ["envoy", "config", "metrics"]) if (!opt[k]) fail(`missing --${k}`);

function fail(msg) {
  console.error(`FAIL ${msg}`);
  process.exit(1);
}

const known = new Set(
  [...readFileSync(opt.metrics, "utf8").matchAll(/^\| `([a-zA-Z_][a-zA-Z0-9_]*)` \|/gm)].map((m) => m[1]),
);

const cfg = parse(readFileSync(opt.config, "utf8"));
pointClustersAt(cfg, await closedPort());
const extra = [];
if (opt["config-yaml"]) {
  plaintext(cfg);
  extra.push("--config-yaml", readFileSync(opt["config-yaml"], "utf8"));
}
let run = null;
const cleanup = () => run?.stop();

try {
  run = await startEnvoy(opt.envoy, cfg, extra);
  const { admin, port } = run;
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
  // --dump FILE: every metric name on /stats/prometheus, for alert-series.mjs.
  if (opt.dump) writeFileSync(opt.dump, [...new Set(text.split("\n").map((l) => /^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]/.exec(l)?.[1]).filter(Boolean))].sort().join("\n") + "\n");
  const names = new Set();
  const bad = [];
  const labelBad = [];
  for (const line of text.split("\n")) {
    const m = /^([^\s{#]+)(\{[^}]*\})? /.exec(line);
    if (!m || !m[1].includes("kvguard_filter")) continue;
    names.add(m[1]);
    if (/=\.=|_\.;|;\.;/.test(line) || !known.has(m[1])) bad.push(line);
  }
  if (!names.size) throw new Error(`no kvguard_filter_ stats on /stats/prometheus:\n${run.log()}`);
  if (!names.has("kvguard_filter_requests_tracked_total")) bad.push("(kvguard_filter_requests_tracked_total missing after tracked requests)");
  // --rules A.yaml,B.yaml: a label the rules select an exported metric by must be on its series.
  for (const f of (opt.rules ?? "").split(",").filter(Boolean)) {
    const exprs = (parse(readFileSync(f, "utf8")).groups ?? []).flatMap((g) => g.rules ?? []).map((r) => String(r.expr));
    for (const [, metric, matchers] of exprs.flatMap((e) => [...e.matchAll(/([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}/g)])) {
      const series = text.split("\n").filter((l) => l.startsWith(`${metric}{`));
      for (const [, label] of matchers.matchAll(/([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)/g)) {
        const without = series.filter((l) => !new RegExp(`[{,]${label}="`).test(l));
        if (series.length && without.length) labelBad.push(`${metric} is selected by ${label} in ${f}, but this Envoy exports it without that label: ${without.join("; ")} (the stats_tags do not match its stat names)`);
      }
    }
  }
  for (const b of bad) console.error(`FAIL not a documented name (stats_tags in ${opt.config} or METRICS.md): ${b}`);
  for (const b of labelBad) console.error(`FAIL ${b}`);
  if (bad.length || labelBad.length) {
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
