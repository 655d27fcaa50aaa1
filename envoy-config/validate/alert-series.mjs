// Checks that every alert can fire in each shipped deployment: each metric its expression
// reads (through the recording rules) must be exported by a target that deployment's
// Prometheus scrapes. Where an expression has top-level `or` branches, one branch whose
// names all exist is enough.
//
// Deployments and what their Prometheus gets:
//   compose     compose/prometheus.yml's jobs: Envoy /stats/prometheus on 9901 (the names an
//               Envoy run of local.yaml exported, --compose-envoy), kvguard-control on 9902,
//               vLLM on 8000
//   kubernetes  kubernetes/podmonitor.yaml's endpoints: the Istio gateways' /stats/prometheus
//               (the names the rendered gateway exported with Istio's stats inclusion list,
//               --istio-envoy), kvguard-control through Istio's merging (:15020), vLLM's
//               /metrics (port `engine`); plus cAdvisor and kube-state-metrics (a
//               kube-prometheus install scrapes them)
// kvguard-control's, vLLM's and the others' names come from METRICS.md (by their source
// column); `up` always exists. KvguardNvmlUnavailable is checked in kubernetes only.
//
// Usage: node alert-series.mjs --metrics METRICS.md --rules RULES.yaml ALERTS.yaml
//          --compose PROMETHEUS.yml --compose-envoy NAMES --podmonitor PODMONITOR.yaml --istio-envoy NAMES
import { readFileSync } from "node:fs";
import { parse, parseAllDocuments } from "yaml";
import { promqlNames } from "./promql.mjs";

const lists = {};
let cur = null;
for (const a of process.argv.slice(2)) {
  if (a.startsWith("--")) lists[(cur = a.slice(2))] = [];
  else lists[cur].push(a);
}
const one = (k) => lists[k]?.[0] ?? (console.error(`missing --${k}`), process.exit(2));

// METRICS.md rows: name → source (kvguard-control, kvguard filter, vLLM, cAdvisor, ...).
const bySource = { control: new Set(), vllm: new Set(), cadvisor: new Set(), ksm: new Set(), always: new Set(["up"]) };
for (const m of readFileSync(one("metrics"), "utf8").matchAll(/^\| `([a-zA-Z_:][a-zA-Z0-9_:]*)` \|[^\n]*\| ([^|\n]*) \|$/gm)) {
  const [, name, source] = m;
  if (name.startsWith("kvguard_control_")) bySource.control.add(name);
  else if (name.startsWith("vllm:") || /^vLLM/.test(source)) bySource.vllm.add(name);
  else if (/^cAdvisor/.test(source)) bySource.cadvisor.add(name);
  else if (/^kube-state-metrics/.test(source)) bySource.ksm.add(name);
  else if (/^Prometheus itself/.test(source)) bySource.always.add(name);
}
const names = (f) => new Set(readFileSync(f, "utf8").split("\n").filter(Boolean));

// What each deployment's Prometheus scrapes.
const deployments = {};
{
  const prom = parse(readFileSync(one("compose"), "utf8"));
  const got = new Set(bySource.always);
  const sources = [];
  for (const job of prom.scrape_configs ?? []) {
    const ports = (job.static_configs ?? []).flatMap((s) => s.targets ?? []).map((t) => t.split(":").pop());
    const path = job.metrics_path ?? "/metrics";
    if (ports.includes("9901") && path === "/stats/prometheus") (names(one("compose-envoy")).forEach((n) => got.add(n)), sources.push("envoy"));
    if (ports.includes("9902") && path === "/metrics") (bySource.control.forEach((n) => got.add(n)), sources.push("kvguard-control"));
    if (ports.includes("8000") && path === "/metrics") (bySource.vllm.forEach((n) => got.add(n)), sources.push("vllm"));
  }
  deployments.compose = { got, sources };
}
{
  const got = new Set([...bySource.always, ...bySource.cadvisor, ...bySource.ksm]);
  const sources = ["cadvisor", "kube-state-metrics"];
  for (const d of parseAllDocuments(readFileSync(one("podmonitor"), "utf8")).map((x) => x.toJS()).filter(Boolean)) {
    const sel = d.spec?.selector?.matchLabels ?? {};
    for (const e of d.spec?.podMetricsEndpoints ?? []) {
      const merged = (e.relabelings ?? []).some((r) => r.targetLabel === "__address__" && String(r.replacement).endsWith(":15020"));
      if (sel.istio === "inference-gateway" && e.path === "/stats/prometheus") (names(one("istio-envoy")).forEach((n) => got.add(n)), sources.push("gateway envoy"));
      else if (merged && e.path === "/stats/prometheus") (bySource.control.forEach((n) => got.add(n)), sources.push("kvguard-control (merged)"));
      else if (e.port === "engine" && (e.path ?? "/metrics") === "/metrics") (bySource.vllm.forEach((n) => got.add(n)), sources.push("vllm"));
    }
  }
  deployments.kubernetes = { got, sources };
}

// Rules: recording name → expr; alerts.
const recorded = new Map();
const alerts = [];
for (const f of lists.rules ?? []) {
  for (const g of parse(readFileSync(f, "utf8")).groups ?? []) {
    for (const r of g.rules ?? []) r.record ? recorded.set(r.record, r.expr) : alerts.push(r);
  }
}
// Top-level `or` branches of an expression (outside parentheses).
function branches(expr) {
  const out = [];
  let depth = 0, start = 0;
  const s = expr.replace(/"(?:[^"\\]|\\.)*"/g, '""');
  for (let i = 0; i < s.length; i++) {
    if (s[i] === "(") depth++;
    else if (s[i] === ")") depth--;
    else if (depth === 0 && /\sor\s/.test(s.slice(i - 1, i + 3)) && s.slice(i, i + 2) === "or") {
      out.push(s.slice(start, i));
      start = i + 2;
    }
  }
  out.push(s.slice(start));
  // A single branch wrapped in parentheses: look inside.
  if (out.length === 1) {
    const t = out[0].trim();
    if (t.startsWith("(") && t.endsWith(")") && balanced(t.slice(1, -1))) return branches(t.slice(1, -1));
  }
  return out;
}
function balanced(s) {
  let d = 0;
  for (const c of s) if ((d += c === "(" ? 1 : c === ")" ? -1 : 0) < 0) return false;
  return d === 0;
}
// The names an expression misses in a deployment ([] = it can fire).
function missing(expr, got, seen = new Set()) {
  let best = null;
  for (const b of branches(expr)) {
    const miss = [];
    for (const n of promqlNames(b)) {
      if (recorded.has(n)) {
        if (seen.has(n)) continue;
        miss.push(...missing(recorded.get(n), got, new Set([...seen, n])).map((m) => `${m} (via ${n})`));
      } else if (!got.has(n)) miss.push(n);
    }
    if (!miss.length) return [];
    if (!best || miss.length < best.length) best = miss;
  }
  return best ?? [];
}

// Alerts meant for one deployment only.
const ONLY = { KvguardNvmlUnavailable: "kubernetes" }; // kube-state-metrics' GPU requests

let errors = 0;
for (const [dep, { got, sources }] of Object.entries(deployments)) {
  let alive = 0;
  for (const a of alerts.filter((x) => (ONLY[x.alert] ?? dep) === dep)) {
    const miss = missing(a.expr, got);
    if (miss.length) {
      errors++;
      console.error(`FAIL ${dep}: ${a.alert} cannot fire: no ${[...new Set(miss)].join(", ")} among what its Prometheus scrapes (${sources.join(", ")})`);
    } else alive++;
  }
  const n = alerts.filter((x) => (ONLY[x.alert] ?? dep) === dep).length;
  console.log(`${dep}: ${alive}/${n} alerts have their series (scraped: ${sources.join(", ")})`);
}
process.exit(errors ? 1 : 0);
