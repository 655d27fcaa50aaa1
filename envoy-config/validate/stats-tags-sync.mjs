// The filter's labels must be extracted the same way everywhere: compares the stats_tags of
// every Envoy config given (a bootstrap's `stats_config`, or a ConfigMap holding a custom
// bootstrap as JSON, the Istio gateways' way) that carries a tag for the filter's names
// (`_<label>=\.=`), and fails if they differ.
// (validate/envoy-stats.mjs proves one of them against the real filter's names.)
//
// Usage: node stats-tags-sync.mjs FILE.yaml...
import { readFileSync } from "node:fs";
import { parseAllDocuments } from "yaml";

const sets = [];
for (const f of process.argv.slice(2)) {
  for (const doc of parseAllDocuments(readFileSync(f, "utf8"))) {
    const o = doc.toJS();
    if (!o) continue;
    const cands = [o.stats_config];
    if (o.kind === "ConfigMap") {
      for (const [k, v] of Object.entries(o.data ?? {})) {
        if (k.endsWith(".json")) cands.push(JSON.parse(v).stats_config);
      }
    }
    for (const sc of cands) {
      const tags = (sc?.stats_tags ?? []).filter((t) => /^\(_\w+=\\\.=/.test(t.regex ?? ""));
      if (tags.length) sets.push({ f, tags: tags.map((t) => `${t.tag_name} ${t.regex}`).sort() });
    }
  }
}
if (sets.length < 2) {
  console.error(`FAIL found the filter's stats_tags in ${sets.length} file(s), expected every Envoy config`);
  process.exit(1);
}
const ref = sets[0];
let bad = 0;
for (const s of sets.slice(1)) {
  if (JSON.stringify(s.tags) !== JSON.stringify(ref.tags)) {
    console.error(`FAIL ${s.f}: stats_tags [${s.tags.join("; ")}] differ from ${ref.f}: [${ref.tags.join("; ")}]`);
    bad++;
  }
}
if (!bad) console.log(`same ${ref.tags.length} tags (${ref.tags.map((t) => t.split(" ")[0]).join(", ")}) in ${sets.map((s) => s.f).join(", ")}`);
process.exit(bad ? 1 : 0);
