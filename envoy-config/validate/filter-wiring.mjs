// Checks what `envoy --mode validate` cannot: that each kvguard filter in an Envoy bootstrap is
// wired to clusters that exist (Envoy accepts any name in the plugin's configuration; an
// abort to a missing cluster fails at run time as `dispatch_error`), and, with --hygiene,
// that the header_mutation filter stripping client-sent x-kvguard-* request headers and the
// x-kvguard-control response stamp comes before kvguard in the same chain (it then runs after
// kvguard on responses, so kvguard still reads the stamp).
//
// Usage: node filter-wiring.mjs [--hygiene] BOOTSTRAP.yaml...
import { readFileSync } from "node:fs";
import { parse } from "yaml";

const args = process.argv.slice(2);
const hygiene = args.includes("--hygiene");
const files = args.filter((a) => a !== "--hygiene");
if (!files.length) {
  console.error("usage: node filter-wiring.mjs [--hygiene] BOOTSTRAP.yaml...");
  process.exit(64);
}

const errors = [];
const isKvguard = (f) =>
  f.typed_config?.["@type"]?.endsWith("envoy.extensions.filters.http.wasm.v3.Wasm") &&
  f.typed_config.config?.root_id === "kvguard";

function strips(f) {
  const m = f.typed_config?.mutations ?? {};
  const req = (m.request_mutations ?? []).some(
    (x) => x.remove_on_match?.key_matcher?.prefix === "x-kvguard-",
  );
  const resp = (m.response_mutations ?? []).some(
    (x) => x.remove === "x-kvguard-control" || x.remove_on_match?.key_matcher?.prefix === "x-kvguard-",
  );
  return req && resp;
}

for (const file of files) {
  const cfg = parse(readFileSync(file, "utf8"));
  const clusters = new Set((cfg.static_resources?.clusters ?? []).map((c) => c.name));
  let seen = 0;
  for (const l of cfg.static_resources?.listeners ?? []) {
    for (const fc of l.filter_chains ?? []) {
      for (const nf of fc.filters ?? []) {
        const chain = nf.typed_config?.http_filters;
        if (!Array.isArray(chain)) continue;
        chain.forEach((f, i) => {
          if (!isKvguard(f)) return;
          seen++;
          const where = `${file}: listener ${l.name}, http_filters[${i}] (${f.name})`;
          let pc;
          try {
            pc = JSON.parse(f.typed_config.config.configuration?.value ?? "{}");
          } catch (e) {
            errors.push(`${where}: configuration is not JSON: ${e.message}`);
            return;
          }
          for (const key of ["control_cluster", "control_target_cluster"]) {
            if (pc[key] !== undefined && !clusters.has(pc[key])) {
              errors.push(`${where}: ${key} "${pc[key]}" is not a cluster of this file (aborts would end as dispatch_error); clusters: ${[...clusters].join(", ")}`);
            }
          }
          if (hygiene && !chain.slice(0, i).some((x) => x.name === "envoy.filters.http.header_mutation" && strips(x))) {
            errors.push(`${where}: no header_mutation filter before kvguard that removes request headers with prefix x-kvguard- and the response header x-kvguard-control`);
          }
        });
      }
    }
  }
  if (!seen) errors.push(`${file}: no kvguard filter (wasm, root_id kvguard) in any http_filters`);
  else console.log(`ok ${file}: ${seen} kvguard filter(s) wired${hygiene ? ", header hygiene before each" : ""}`);
}
if (errors.length) {
  errors.forEach((e) => console.error(`FAIL ${e}`));
  process.exit(1);
}
