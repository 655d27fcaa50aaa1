// Checks that every metric name envoy-config/ uses is a documented one.
// - Every PromQL expression in the Prometheus rule files and the Grafana dashboards: each
//   metric name must be listed in METRICS.md, and each recording-rule name (with `:`) must
//   be defined in one of the rule files.
// - Every other mention of a kvguard_control_* / kvguard_filter_* name in the files given
//   (configs, docs, probes) must be listed in METRICS.md too, so a renamed metric cannot
//   survive in a comment, a preStop script or a README.
//
// Usage: node metric-names.mjs --metrics METRICS.md --rules R.yaml... --dashboards D.json... --mentions FILE...
import { readFileSync } from "node:fs";
import { parse } from "yaml";
import { promqlNames } from "./promql.mjs";

const args = process.argv.slice(2);
const lists = { metrics: [], rules: [], dashboards: [], mentions: [] };
let cur = null;
for (const a of args) {
  if (a.startsWith("--")) cur = a.slice(2);
  else if (cur in lists) lists[cur].push(a);
  else throw new Error(`unexpected argument ${a}`);
}

const known = new Set();
for (const f of lists.metrics) {
  for (const m of readFileSync(f, "utf8").matchAll(/^\| `([a-zA-Z_][a-zA-Z0-9_:]*)` \|/gm)) known.add(m[1]);
}
if (!known.size) throw new Error("no metric names found in the METRICS tables");

let errors = 0;
let checked = 0;
const recorded = new Set();
const exprs = []; // [where, expr]
for (const f of lists.rules) {
  const doc = parse(readFileSync(f, "utf8"));
  for (const g of doc.groups ?? []) {
    for (const r of g.rules ?? []) {
      if (r.record) recorded.add(r.record);
      exprs.push([`${f}: ${r.record ?? r.alert}`, r.expr]);
    }
  }
}
function walk(o, where, out) {
  if (Array.isArray(o)) o.forEach((v, i) => walk(v, `${where}[${i}]`, out));
  else if (o && typeof o === "object") {
    for (const [k, v] of Object.entries(o)) {
      if (k === "expr" && typeof v === "string") out.push([`${where}.${k}`, v]);
      else if (k === "definition" && typeof v === "string") out.push([`${where}.${k}`, v.replace(/label_values\(([^,)]+)(,[^)]*)?\)/, "$1")]);
      else walk(v, `${where}.${k}`, out);
    }
  }
}
for (const f of lists.dashboards) {
  let dash;
  try {
    dash = JSON.parse(readFileSync(f, "utf8"));
  } catch (e) {
    console.error(`FAIL ${f}: not valid JSON: ${e.message}`);
    errors++;
    continue;
  }
  for (const [k, v] of [["title", "string"], ["uid", "string"], ["panels", "object"]]) {
    if (typeof dash[k] !== v) {
      console.error(`FAIL ${f}: dashboard has no ${k}`);
      errors++;
    }
  }
  const out = [];
  walk(dash, f, out);
  if (!out.length) {
    console.error(`FAIL ${f}: no query found`);
    errors++;
  }
  exprs.push(...out);
}
for (const [where, expr] of exprs) {
  for (const name of promqlNames(expr)) {
    checked++;
    if (known.has(name)) continue; // a documented name, also an engine's `vllm:` one
    if (name.includes(":")) {
      if (!recorded.has(name)) {
        console.error(`FAIL ${where}: recording rule ${name} is not defined in ${lists.rules.join(", ")}`);
        errors++;
      }
    } else if (!known.has(name)) {
      console.error(`FAIL ${where}: metric ${name} is not in ${lists.metrics.join(", ")}`);
      errors++;
    }
  }
}
// Names that look like metrics but are not: Envoy cluster names of the configs.
const NOT_METRICS = new Set(["kvguard_control_replica"]);
let mentions = 0;
for (const f of lists.mentions) {
  const text = readFileSync(f, "utf8");
  // Not inside a recording-rule name (a:b:c), not a tag-encoded stat name (..._reason=.=),
  // not a prefix (kvguard_filter_ or kvguard_filter_*).
  for (const m of text.matchAll(/(?<![A-Za-z0-9_:])kvguard_(?:control|filter)_[a-z0-9_]*[a-z0-9](?![a-z0-9_]*[=.*:])/g)) {
    // `___` is Envoy's sanitised form of an unextracted tag (quoted in docs as an example of
    // a failure); never a real name, and validate/envoy-stats.mjs checks the live output.
    if (NOT_METRICS.has(m[0]) || m[0].includes("___")) continue;
    mentions++;
    if (!known.has(m[0])) {
      const line = text.slice(0, m.index).split("\n").length;
      console.error(`FAIL ${f}:${line}: ${m[0]} is not in ${lists.metrics.join(", ")}`);
      errors++;
    }
  }
}
console.log(`${known.size} documented names; ${exprs.length} queries, ${checked} name uses, ${mentions} other mentions checked; ${errors} error(s)`);
process.exit(errors ? 1 : 0);
