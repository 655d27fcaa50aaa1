// Renders the Envoy configuration that envoy-config/istio/ would give an inference gateway
// pod, so that `envoy --mode validate` can check it. A model of istiod and pilot-agent, not
// them (envoy-config/README.md lists what it cannot prove):
//
//   istio-gateway-base.yaml   what istiod generates for the Gateway/VirtualService/
//                             DestinationRules: listener, connection manager, the gateway's
//                             HTTP filter chain, outbound clusters with Istio mTLS, SDS
//   + the custom bootstrap    pilot-agent hands the file named by ISTIO_BOOTSTRAP_OVERRIDE (a
//                             ConfigMap mounted into istio-proxy) to Envoy as --config-yaml,
//                             which Envoy merges into the bootstrap; written next to the
//                             output as <output>.config-yaml, for `envoy --config-yaml`
//   + each WasmPlugin         an envoy.filters.http.wasm filter where istiod puts phase STATS
//                             (after the authn/authz filters, before gRPC stats); istiod
//                             delivers it by ECDS, here it is inline
//   + EnvoyFilter patches     applied after that, with Istio's semantics (ADD appends; MERGE
//                             merges protobuf-style: messages recursively, repeated fields
//                             appended, scalars replaced; INSERT_FIRST / INSERT_BEFORE)
//   + the stats matcher       pilot-agent's default inclusion list plus the pod's
//                             proxyStatsMatcher (proxy.istio.io/config): other stats do not
//                             exist on an Istio proxy, so the Envoy runs see what Prometheus gets
//
// One output per WasmPlugin, for the gateway Deployment its selector picks (observe and
// enforce select different pods). Istio-only HTTP filters (istio.*) keep their names and
// places with a no-op stand-in config that upstream Envoy loads.
//
// Refused, because in a cluster they would be skipped or ignored silently: a patch that
// matches nothing or that this renderer cannot place, a BOOTSTRAP patch (istiod ignores
// them since 1.21), a WasmPlugin or an EnvoyFilter selecting no Deployment of the inputs, a WasmPlugin url not
// pinned by sha256 digest, the sidecar.istio.io/bootstrapOverride annotation on a gateway pod
// (the gateway injection template ignores it), a custom bootstrap that is missing or not
// JSON. Also refused, as kvguard's own requirements for gateway pods (docs/DESIGN.md, "Gateway pods"):
// no `concurrency` in proxy.istio.io/config, or no EXIT_ON_ZERO_ACTIVE_CONNECTIONS=true in
// pilot-agent's env on any supported Istio release (agentSettings: from upstream-facts.json).
//
// Usage: node istio-render.mjs --base BASE.yaml --wasm PATH --out DIR [--only-selected yes] ISTIO.yaml...
import { readFileSync, writeFileSync, mkdirSync } from "node:fs";
import { join, dirname, basename } from "node:path";
import { parseAllDocuments, parse, stringify } from "yaml";
import { loadFacts, RENDERED_BY } from "./upstream-facts.mjs";

const args = process.argv.slice(2);
const opt = {};
const files = [];
for (let i = 0; i < args.length; i++) {
  if (args[i].startsWith("--")) opt[args[i].slice(2)] = args[++i];
  else files.push(args[i]);
}
const facts = loadFacts();
for (const k of ["base", "wasm", "out"]) {
  if (!opt[k]) die(`missing --${k}`);
}

function die(msg) {
  console.error(`istio-render: ${msg}`);
  process.exit(1);
}
const isObj = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
const clone = (v) => JSON.parse(JSON.stringify(v));

// Protobuf merge, as Istio's MERGE (and pilot-agent's bootstrap override) does it.
function merge(dst, src, where) {
  for (const [k, v] of Object.entries(src)) {
    if (Array.isArray(v) && Array.isArray(dst[k])) dst[k] = dst[k].concat(clone(v));
    else if (isObj(v) && isObj(dst[k])) {
      if (v["@type"] && dst[k]["@type"] && v["@type"] !== dst[k]["@type"]) {
        die(`${where}: MERGE of ${k}: type ${v["@type"]} onto ${dst[k]["@type"]}`);
      }
      merge(dst[k], v, where);
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
const ofKind = (kind) => objects.filter((x) => x.o.kind === kind);
const envoyFilters = ofKind("EnvoyFilter");
const wasmPlugins = ofKind("WasmPlugin");
const deployments = ofKind("Deployment");
const configMaps = ofKind("ConfigMap");
if (!wasmPlugins.length) die("no WasmPlugin in the inputs");
const ref = (x) => `${x.file}: ${x.o.kind} ${x.o.metadata?.namespace}/${x.o.metadata?.name}`;

const listenerPort = (l) => l.address?.socket_address?.port_value;
const hcms = (ls) =>
  ls.flatMap((l) => l.filter_chains.flatMap((fc) => fc.filters.filter((f) => f.name === "envoy.filters.network.http_connection_manager")));

function listenersOf(cfg, p, where) {
  const lm = p.match?.listener ?? {};
  const ls = cfg.static_resources.listeners.filter((l) => lm.portNumber === undefined || listenerPort(l) === lm.portNumber);
  if (!ls.length) die(`${where}: ${p.applyTo} matches no listener (port ${lm.portNumber})`);
  return ls;
}

function applyPatch(cfg, p, where) {
  const ctx = p.match?.context ?? "ANY";
  if (p.applyTo === "BOOTSTRAP") {
    die(`${where}: applyTo BOOTSTRAP: istiod ignores BOOTSTRAP patches (removed in Istio 1.21, still accepted); use a custom bootstrap (ISTIO_BOOTSTRAP_OVERRIDE from a ConfigMap, see istio/gateway.yaml)`);
  }
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
      hits.forEach((c) => merge(c, value, where));
      return;
    }
    case "LISTENER MERGE":
      listenersOf(cfg, p, where).forEach((l) => merge(l, value, where));
      return;
    case "NETWORK_FILTER MERGE": {
      const fname = p.match?.listener?.filterChain?.filter?.name;
      let n = 0;
      for (const l of listenersOf(cfg, p, where)) {
        for (const fc of l.filter_chains) {
          for (const f of fc.filters) {
            if (fname === undefined || f.name === fname) {
              merge(f, value, where);
              n++;
            }
          }
        }
      }
      if (!n) die(`${where}: NETWORK_FILTER MERGE matches no filter named ${fname}`);
      return;
    }
    case "HTTP_FILTER INSERT_FIRST":
    case "HTTP_FILTER INSERT_BEFORE": {
      const fm = p.match?.listener?.filterChain?.filter ?? {};
      if (fm.name !== undefined && fm.name !== "envoy.filters.network.http_connection_manager") {
        die(`${where}: HTTP_FILTER under network filter ${fm.name}: only the connection manager has HTTP filters`);
      }
      const sub = fm.subFilter?.name;
      if (op === "INSERT_BEFORE" && sub === undefined) die(`${where}: INSERT_BEFORE needs match.listener.filterChain.filter.subFilter.name`);
      let n = 0;
      for (const h of hcms(listenersOf(cfg, p, where))) {
        const chain = h.typed_config.http_filters;
        const at = op === "INSERT_FIRST" ? 0 : chain.findIndex((x) => x.name === sub);
        if (at < 0) continue;
        chain.splice(at, 0, clone(value));
        n++;
      }
      if (!n) die(`${where}: HTTP_FILTER ${op} matches no connection manager${sub ? ` with an HTTP filter named ${sub}` : ""}`);
      return;
    }
    default:
      die(`${where}: applyTo ${p.applyTo} with operation ${op} is not rendered by istio-render.mjs (add it, so that it is validated)`);
  }
}

function wasmFilter(wp) {
  const s = wp.spec;
  const where = `WasmPlugin ${wp.metadata.namespace}/${wp.metadata.name}`;
  if (s.type && s.type !== "HTTP") die(`${where}: type ${s.type} not rendered`);
  if (s.phase && s.phase !== "STATS") die(`${where}: phase ${s.phase} not rendered`);
  if (!/^oci:\/\/[^@\s]+@sha256:[0-9a-f]{64}$/.test(s.url ?? "")) {
    die(`${where}: url ${JSON.stringify(s.url)} is not pinned by digest (oci://<registry>/kvguard-filter@sha256:<64 hex>, the digest scripts/images prints): with a tag, pods that pulled at different times run different modules`);
  }
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

// The Deployments whose pods a WasmPlugin's selector picks.
function selectedDeployments(wp) {
  const want = Object.entries(wp.spec.selector?.matchLabels ?? {});
  if (wp.spec.targetRefs) die(`WasmPlugin ${wp.metadata.name}: targetRefs not rendered (selector only)`);
  const hits = deployments.filter(
    (d) =>
      d.o.metadata.namespace === wp.metadata.namespace &&
      want.every(([k, v]) => d.o.spec.template?.metadata?.labels?.[k] === v),
  );
  // --only-selected yes: the inputs hold one gateway (Gateway API), which one plugin selects.
  if (!hits.length && opt["only-selected"] === "yes") return [];
  if (!hits.length) die(`WasmPlugin ${wp.metadata.namespace}/${wp.metadata.name}: its selector ${JSON.stringify(wp.spec.selector)} picks no Deployment of the inputs`);
  return hits;
}

// What the gateway pod's proxy gets: pilot-agent's custom bootstrap and the proxy config.
function podProxy(d) {
  const where = ref(d);
  const tpl = d.o.spec.template;
  const ann = tpl.metadata?.annotations ?? {};
  if (ann["sidecar.istio.io/bootstrapOverride"] !== undefined && ann["inject.istio.io/templates"] === "gateway") {
    die(`${where}: sidecar.istio.io/bootstrapOverride is ignored by the gateway injection template; set ISTIO_BOOTSTRAP_OVERRIDE, the mount and the volume in the pod spec`);
  }
  const pc = parse(ann["proxy.istio.io/config"] ?? "") ?? {};
  const proxy = (tpl.spec.containers ?? []).find((c) => c.name === "istio-proxy");
  if (!proxy) die(`${where}: no istio-proxy container`);
  for (const r of agentSettings(d, pc, proxy)) {
    if (r.error) die(`${where}: Istio ${r.release}: ${r.error}`);
  }
  const path = (proxy.env ?? []).find((e) => e.name === "ISTIO_BOOTSTRAP_OVERRIDE")?.value;
  if (!path) return { pc, bootstrap: null };
  const mount = (proxy.volumeMounts ?? []).find((m) => m.mountPath === dirname(path));
  if (!mount) die(`${where}: ISTIO_BOOTSTRAP_OVERRIDE ${path}: no volume mounted at ${dirname(path)}`);
  const vol = (tpl.spec.volumes ?? []).find((v) => v.name === mount.name);
  const cmName = vol?.configMap?.name;
  if (!cmName) die(`${where}: volume ${mount.name} (custom bootstrap) is not a ConfigMap`);
  const cm = configMaps.find((c) => c.o.metadata.name === cmName && c.o.metadata.namespace === d.o.metadata.namespace);
  if (!cm) die(`${where}: ConfigMap ${cmName} (custom bootstrap) is not in the inputs`);
  const text = cm.o.data?.[basename(path)];
  if (text === undefined) die(`${ref(cm)}: no key ${basename(path)} (ISTIO_BOOTSTRAP_OVERRIDE ${path})`);
  try {
    return { pc, bootstrap: JSON.parse(text), from: `${ref(cm)} ${basename(path)}` };
  } catch (e) {
    return die(`${ref(cm)} ${basename(path)}: not JSON: ${e.message}`);
  }
}

// What pilot-agent of each supported Istio release gets on this pod, from the facts in
// upstream-facts.json (each with its upstream file): the pod template that renders it
// (`kube-gateway` for a Gateway API gateway, marked by gateway-api.mjs; else the injector's
// gateway template), whether that render turns proxy.istio.io/config's proxyMetadata into
// env, and the settings pilot-agent reads only from env. kvguard needs the drain
// (EXIT_ON_ZERO_ACTIVE_CONNECTIONS) and a fixed concurrency on every gateway pod.
function agentSettings(d, pc, proxy) {
  const kube = d.o.metadata?.annotations?.[RENDERED_BY];
  const injected = d.o.spec.template.metadata?.annotations?.["inject.istio.io/templates"] ?? "sidecar";
  return Object.entries(facts.istio.releases).map(([release, { ref, facts: f }]) => {
    const src = (k) => `${ref}:${f[k].file}`;
    const tpl = kube ?? injected;
    if (!(tpl in f.podTemplates.value)) return { release, error: `no pod template ${tpl} in istiod ${release} (${src("podTemplates")})` };
    const env = new Map((proxy.env ?? []).map((e) => [e.name, e.value ?? "(from a reference)"]));
    const readsPod = kube ? f.gatewayApiProxyConfigFromPod.value : f.injectorProxyConfigFromPod.value;
    const metaToEnv = readsPod && f.templateProxyMetadataEnv.value[tpl];
    const how = kube
      ? `this pod is rendered by istiod's Gateway API controller from ${f.podTemplates.value[tpl]}, which is not given the pod's proxy.istio.io/config (${src("gatewayApiProxyConfigFromPod")})`
      : `the injector renders this pod from ${f.podTemplates.value[tpl]} (${readsPod ? "with" : "without"} the pod's proxy.istio.io/config, ${src("injectorProxyConfigFromPod")})`;
    const envOnly = new Set(f.agentEnvOnly.value);
    for (const [k, v] of Object.entries(pc.proxyMetadata ?? {})) {
      if (metaToEnv && !env.has(k)) env.set(k, String(v));
      else if (!metaToEnv && envOnly.has(k) && !env.has(k)) {
        return { release, error: `proxyMetadata.${k} in proxy.istio.io/config never reaches pilot-agent, which reads ${k} only from env (${src("agentEnvOnly")}): ${how}; set it in the istio-proxy container's env` };
      }
    }
    if (env.get("EXIT_ON_ZERO_ACTIVE_CONNECTIONS") !== "true") {
      return { release, error: `pilot-agent's env lacks EXIT_ON_ZERO_ACTIVE_CONNECTIONS=true (read only from env, ${src("agentEnvOnly")}; ${how}): it would kill Envoy terminationDrainDuration (5 s) after SIGTERM, cutting every stream` };
    }
    if (!f.agentProxyConfigFromPod.value) return { release, error: `pilot-agent does not read proxy.istio.io/config (${src("agentProxyConfigFromPod")}): the model needs revisiting` };
    if (!Number.isInteger(pc.concurrency) || pc.concurrency < 1) {
      return { release, error: "proxy.istio.io/config has no concurrency: Envoy would start one worker (one V8 VM of the filter) per node core" };
    }
    return { release };
  });
}

// Istio-only HTTP filters: same name and place, a config upstream Envoy loads that does nothing.
const STANDIN = { "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config" };
// Filters istiod puts before the WasmPlugins of phase STATS (metadata exchange, authn, authz).
const BEFORE_STATS = new Set(["istio.metadata_exchange", "envoy.filters.http.ext_authz", "envoy.filters.http.jwt_authn", "istio_authn", "envoy.filters.http.rbac"]);

// Every gateway Deployment: a PodDisruptionBudget covers its pods (a node drain would take
// them all at once, cutting their streams), and a LoadBalancer Service in front of them
// keeps the client address (externalTrafficPolicy: Local; the filter and use_remote_address
// read it).
const podsOf = (sel, d) => Object.entries(sel ?? {}).every(([k, v]) => d.o.spec.template?.metadata?.labels?.[k] === v);
for (const d of deployments) {
  const ns = d.o.metadata.namespace;
  const same = (x) => x.o.metadata.namespace === ns;
  if (!ofKind("PodDisruptionBudget").some((p) => same(p) && podsOf(p.o.spec?.selector?.matchLabels, d))) die(`${ref(d)}: no PodDisruptionBudget in the inputs covers its pods: a node drain evicts them all at once, cutting every stream`);
  for (const svc of ofKind("Service").filter((x) => same(x) && x.o.spec?.type === "LoadBalancer" && podsOf(x.o.spec.selector, d))) {
    if (svc.o.spec.externalTrafficPolicy !== "Local") die(`${ref(svc)}: LoadBalancer without externalTrafficPolicy: Local: the gateway sees a node's address, not the client's`);
  }
}

// An EnvoyFilter whose workloadSelector picks no gateway pod of the inputs applies to nothing.
for (const ef of envoyFilters) {
  const want = Object.entries(ef.o.spec.workloadSelector?.labels ?? {});
  const hit = deployments.some(
    (d) => d.o.metadata.namespace === ef.o.metadata.namespace && want.every(([k, v]) => d.o.spec.template?.metadata?.labels?.[k] === v),
  );
  if (!hit) die(`${ref(ef)}: its workloadSelector ${JSON.stringify(ef.o.spec.workloadSelector ?? {})} picks no Deployment of the inputs (istiod would apply it to nothing)`);
}

// pilot-agent's stats inclusion list (istio/istio pkg/bootstrap/config.go and
// tools/packaging/common/envoy_bootstrap.json): only these Envoy stats exist on an Istio
// proxy, plus those its proxyStatsMatcher names.
function istioStatsMatcher(m = {}) {
  const prefix = ["reporter=", ...(m.inclusionPrefixes ?? []), "cluster_manager", "listener_manager", "server", "cluster.xds-grpc", "wasm", "component", "istio"];
  const suffix = [...(m.inclusionSuffixes ?? []), "rbac.allowed", "rbac.denied", "shadow_allowed", "shadow_denied", "downstream_cx_active"];
  const regex = [...(m.inclusionRegexps ?? []), "vhost\\..*\\.route\\..*"];
  return {
    inclusion_list: {
      patterns: [...prefix.map((p) => ({ prefix: p })), ...suffix.map((s) => ({ suffix: s })), ...regex.map((r) => ({ safe_regex: { regex: r } }))],
    },
  };
}

const base = parseAllDocuments(readFileSync(opt.base, "utf8"))[0].toJS();
// The bootstrap's stats tags and the gateway's stat prefix delimiter, per supported release
// (upstream-facts.json); releases that agree share one rendering.
const statGroups = new Map();
for (const [release, r] of Object.entries(facts.istio.releases)) {
  const v = { tags: r.facts.bootstrapStatsTags.value, delimiter: r.facts.gatewayStatPrefix.value.delimiter };
  const k = JSON.stringify(v);
  if (!statGroups.has(k)) statGroups.set(k, { ...v, releases: [] });
  statGroups.get(k).releases.push(release);
}
mkdirSync(opt.out, { recursive: true });
for (const group of statGroups.values()) for (const { o: wp } of wasmPlugins) {
  for (const d of selectedDeployments(wp)) {
    const { pc, bootstrap, from } = podProxy(d);
    const cfg = clone(base);
    cfg.stats_config.stats_tags = clone(group.tags);
    for (const l of cfg.static_resources.listeners) {
      const a = l.address.socket_address;
      for (const h of hcms([l])) h.typed_config.stat_prefix = `outbound_${a.address}_${a.port_value}${group.delimiter}`;
    }
    cfg.stats_config.stats_matcher = istioStatsMatcher(pc.proxyStatsMatcher);
    for (const h of hcms(cfg.static_resources.listeners)) {
      const chain = h.typed_config.http_filters;
      const at = chain.findIndex((x) => !BEFORE_STATS.has(x.name));
      chain.splice(at < 0 ? chain.length : at, 0, wasmFilter(wp));
    }
    for (const { file, o: ef } of envoyFilters) {
      (ef.spec.configPatches ?? []).forEach((p, i) => applyPatch(cfg, p, `${file}: ${ef.metadata.name} configPatches[${i}]`));
    }
    for (const h of hcms(cfg.static_resources.listeners)) {
      for (const f of h.typed_config.http_filters) {
        if (f.name.startsWith("istio.")) f.typed_config = clone(STANDIN);
      }
    }
    const suffix = statGroups.size > 1 ? `-istio-${group.releases.join("-")}` : "";
    const out = join(opt.out, `istio-gateway-${wp.metadata.name}${suffix}.yaml`);
    writeFileSync(
      out,
      `# Rendered by istio-render.mjs from ${opt.base} and ${files.join(", ")}\n` +
        `# Istio ${group.releases.join(", ")}: WasmPlugin ${wp.metadata.name} on the pods of Deployment ${d.o.metadata.name} ` +
        `(concurrency ${pc.concurrency}; custom bootstrap: ${from ?? "none"})\n` +
        stringify(cfg, { lineWidth: 0 }),
    );
    if (bootstrap) writeFileSync(`${out}.config-yaml`, JSON.stringify(bootstrap));
    console.log(out);
  }
}
