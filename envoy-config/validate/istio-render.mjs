// Renders the Envoy configuration that envoy-config/istio/ produces on an inference gateway,
// so that `envoy --mode validate` can check what the EnvoyFilter patches and the WasmPlugins
// would push: istio-gateway-base.yaml (what Istio generates for the Gateway/VirtualService/
// DestinationRules) + every EnvoyFilter configPatch (Istio's semantics: ADD appends, MERGE
// merges protobuf-style: messages recursively, repeated fields appended, scalars replaced)
// + each WasmPlugin as an envoy.filters.http.wasm filter before the router (phase STATS).
// One output file per WasmPlugin (observe, enforce: they select different pods).
//
// A patch this renderer cannot place, or one whose match selects nothing, is an error: in a
// cluster Istio would skip it silently, and the gateway would run without it.
//
// Usage: node istio-render.mjs --base BASE.yaml --wasm PATH --out DIR ISTIO.yaml...
import { readFileSync, writeFileSync, mkdirSync } from "node:fs";
import { join } from "node:path";
import { parseAllDocuments, stringify } from "yaml";

const args = process.argv.slice(2);
const opt = {};
const files = [];
for (let i = 0; i < args.length; i++) {
  if (args[i].startsWith("--")) opt[args[i].slice(2)] = args[++i];
  else files.push(args[i]);
}
for (const k of ["base", "wasm", "out"]) {
  if (!opt[k]) die(`missing --${k}`);
}

function die(msg) {
  console.error(`istio-render: ${msg}`);
  process.exit(1);
}
const isObj = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
const clone = (v) => JSON.parse(JSON.stringify(v));

// Protobuf merge, as Istio's MERGE does it.
function merge(dst, src) {
  for (const [k, v] of Object.entries(src)) {
    if (Array.isArray(v) && Array.isArray(dst[k])) dst[k] = dst[k].concat(clone(v));
    else if (isObj(v) && isObj(dst[k])) {
      if (v["@type"] && dst[k]["@type"] && v["@type"] !== dst[k]["@type"]) {
        die(`MERGE of ${k}: type ${v["@type"]} onto ${dst[k]["@type"]}`);
      }
      merge(dst[k], v);
    } else dst[k] = clone(v);
  }
  return dst;
}

const objects = [];
for (const f of files) {
  for (const doc of parseAllDocuments(readFileSync(f, "utf8"))) {
    if (doc.errors.length) die(`${f}: ${doc.errors[0].message}`);
    const o = doc.toJS();
    if (o) objects.push({ file: f, o });
  }
}
const envoyFilters = objects.filter((x) => x.o.kind === "EnvoyFilter");
const wasmPlugins = objects.filter((x) => x.o.kind === "WasmPlugin");
if (!wasmPlugins.length) die("no WasmPlugin in the inputs");

const listenerPort = (l) => l.address?.socket_address?.port_value;

function applyPatch(cfg, p, where) {
  const ctx = p.match?.context ?? "ANY";
  if (!["ANY", "GATEWAY"].includes(ctx)) return; // not for a gateway
  const op = p.patch?.operation;
  const value = p.patch?.value;
  const sr = cfg.static_resources;
  switch (`${p.applyTo} ${op}`) {
    case "CLUSTER ADD":
      sr.clusters.push(clone(value));
      return;
    case "CLUSTER MERGE": {
      const m = p.match?.cluster ?? {};
      const hits = sr.clusters.filter((c) => {
        const [dir, port, subset, svc] = c.name.split("|");
        return (
          dir === "outbound" &&
          (m.service === undefined || m.service === svc) &&
          (m.portNumber === undefined || Number(port) === m.portNumber) &&
          (m.subset === undefined || m.subset === subset) &&
          (m.name === undefined || m.name === c.name)
        );
      });
      if (!hits.length) die(`${where}: CLUSTER MERGE matches no cluster (${JSON.stringify(m)})`);
      hits.forEach((c) => merge(c, value));
      return;
    }
    case "LISTENER MERGE":
    case "NETWORK_FILTER MERGE": {
      const lm = p.match?.listener ?? {};
      const ls = sr.listeners.filter((l) => lm.portNumber === undefined || listenerPort(l) === lm.portNumber);
      if (!ls.length) die(`${where}: ${p.applyTo} matches no listener (port ${lm.portNumber})`);
      if (p.applyTo === "LISTENER") {
        ls.forEach((l) => merge(l, value));
        return;
      }
      const fname = lm.filterChain?.filter?.name;
      let n = 0;
      for (const l of ls) {
        for (const fc of l.filter_chains) {
          for (const f of fc.filters) {
            if (fname === undefined || f.name === fname) {
              merge(f, value);
              n++;
            }
          }
        }
      }
      if (!n) die(`${where}: NETWORK_FILTER MERGE matches no filter named ${fname}`);
      return;
    }
    case "BOOTSTRAP MERGE":
      merge(cfg, value);
      return;
    default:
      die(`${where}: applyTo ${p.applyTo} with operation ${op} is not rendered by istio-render.mjs (add it, so that it is validated)`);
  }
}

function wasmFilter(wp) {
  const s = wp.spec;
  if (s.type && s.type !== "HTTP") die(`WasmPlugin ${wp.metadata.name}: type ${s.type} not rendered`);
  if (s.phase && s.phase !== "STATS") die(`WasmPlugin ${wp.metadata.name}: phase ${s.phase} not rendered`);
  const env = s.vmConfig?.env ?? [];
  const host = env.filter((e) => (e.valueFrom ?? "INLINE") === "HOST").map((e) => e.name);
  const inline = Object.fromEntries(env.filter((e) => (e.valueFrom ?? "INLINE") === "INLINE").map((e) => [e.name, e.value ?? ""]));
  const policy = { FAIL_OPEN: "FAIL_OPEN", FAIL_CLOSE: "FAIL_CLOSED", FAIL_RELOAD: "FAIL_RELOAD" }[s.failStrategy ?? "FAIL_CLOSE"];
  const name = `${wp.metadata.namespace}.${wp.metadata.name}`;
  return {
    name,
    typed_config: {
      "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
      config: {
        name,
        root_id: s.pluginName ?? "",
        failure_policy: policy,
        configuration: {
          "@type": "type.googleapis.com/google.protobuf.StringValue",
          value: JSON.stringify(s.pluginConfig ?? {}),
        },
        vm_config: {
          vm_id: name,
          runtime: "envoy.wasm.runtime.v8",
          code: { local: { filename: opt.wasm } },
          environment_variables: {
            ...(host.length ? { host_env_keys: host } : {}),
            ...(Object.keys(inline).length ? { key_values: inline } : {}),
          },
        },
      },
    },
  };
}

const base = parseAllDocuments(readFileSync(opt.base, "utf8"))[0].toJS();
mkdirSync(opt.out, { recursive: true });
for (const { o: wp } of wasmPlugins) {
  const cfg = clone(base);
  for (const { file, o: ef } of envoyFilters) {
    (ef.spec.configPatches ?? []).forEach((p, i) => applyPatch(cfg, p, `${file}: ${ef.metadata.name} configPatches[${i}]`));
  }
  for (const l of cfg.static_resources.listeners) {
    for (const fc of l.filter_chains) {
      for (const f of fc.filters) {
        if (f.name !== "envoy.filters.network.http_connection_manager") continue;
        const hf = f.typed_config.http_filters;
        const router = hf.findIndex((x) => x.name === "envoy.filters.http.router");
        hf.splice(router < 0 ? hf.length : Math.max(0, router - 2), 0, wasmFilter(wp));
      }
    }
  }
  const out = join(opt.out, `istio-gateway-${wp.metadata.name}.yaml`);
  writeFileSync(out, `# Rendered by istio-render.mjs from ${opt.base} and ${files.join(", ")}\n` + stringify(cfg, { lineWidth: 0 }));
  console.log(out);
}
