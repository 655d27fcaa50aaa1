// Builds kubernetes/prometheusrule.yaml (a Prometheus Operator PrometheusRule) from the rule
// files in prometheus/, so Operator users get exactly the rules that promtool tests.
// --write regenerates it; --check (scripts/validate-configs) fails if it is out of date;
// --spec writes the object's spec.groups as one rule file, for `promtool check rules`: the
// Operator hands Prometheus all of a PrometheusRule's groups as one file, where a repeated
// group name is refused (two source files may each use the name; their union may not).
//
// Usage: node prometheusrule.mjs --check|--write OUT.yaml RULES.yaml...
//        node prometheusrule.mjs --spec PROMETHEUSRULE.yaml OUT.yaml
import { readFileSync, writeFileSync, existsSync } from "node:fs";
import { parse, stringify } from "yaml";

if (process.argv[2] === "--spec") {
  const [, , , obj, out] = process.argv;
  const spec = parse(readFileSync(obj, "utf8")).spec;
  writeFileSync(out, stringify({ groups: spec.groups }, { lineWidth: 0 }));
  process.exit(0);
}
const [mode, out, ...rules] = process.argv.slice(2);
if (!["--check", "--write"].includes(mode) || !out || !rules.length) {
  console.error("usage: node prometheusrule.mjs --check|--write OUT.yaml RULES.yaml...");
  process.exit(2);
}
const groups = rules.flatMap((f) => parse(readFileSync(f, "utf8")).groups);
const obj = {
  apiVersion: "monitoring.coreos.com/v1",
  kind: "PrometheusRule",
  metadata: {
    name: "kvguard",
    namespace: "monitoring",
    labels: { "app.kubernetes.io/name": "kvguard", role: "alert-rules" },
  },
  spec: { groups },
};
const text =
  "# GENERATED from envoy-config/prometheus/*.yaml by envoy-config/validate/prometheusrule.mjs\n" +
  "# (node envoy-config/validate/prometheusrule.mjs --write ...); do not edit by hand.\n" +
  "# kvguard's recording and alerting rules for the Prometheus Operator. ADAPT the namespace\n" +
  "# and the labels your Prometheus' ruleSelector expects.\n" +
  stringify(obj, { lineWidth: 0 });
if (mode === "--write") {
  writeFileSync(out, text);
  console.log(`wrote ${out}`);
} else if (!existsSync(out) || readFileSync(out, "utf8") !== text) {
  console.error(`${out} is out of date with ${rules.join(", ")}: run node envoy-config/validate/prometheusrule.mjs --write ${out} ${rules.join(" ")}`);
  process.exit(1);
} else {
  console.log(`${out} matches ${rules.join(", ")}`);
}
