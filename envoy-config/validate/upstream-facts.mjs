// Facts about istiod, pilot-agent, the Gateway API Inference Extension's endpoint picker
// (EPP), the Gateway API CRDs and vLLM that the other checks model, read from upstream source and stored in
// upstream-facts.json, each with the file and ref (and commit) it was read from. The checks
// load them from the JSON (nothing is downloaded when they run); this script makes the JSON
// from local clones and checks that it covers every supported Istio release.
//
//   node upstream-facts.mjs --extract --istio ISTIO_GIT --gie GIE_GIT --gwapi GATEWAY_API_GIT --vllm VLLM_PKG_DIR
//        --releases "1.28=release-1.28 ... next=master" --epp v1.3.1 > upstream-facts.json
//   node upstream-facts.mjs --check upstream-facts.json --istio-releases "1.28 1.29 ..."
//
// The Istio releases to check are those whose Envoy scripts/validate-configs validates
// (Istio 1.N embeds Envoy 1.(N+8); `next` is istio master, Envoy 1.40). What each fact is:
// see FACTS below; a fact the extractor cannot find fails the extraction (the model must
// then be revisited, not the fact guessed).
import { execFileSync } from "node:child_process";
import { readFileSync, readdirSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

// The annotation gateway-api.mjs puts on the Deployment it generates: the istiod template
// that renders it (istio-render.mjs reads it).
export const RENDERED_BY = "validate.kvguard.io/rendered-by";
export const FACTS_FILE = new URL("./upstream-facts.json", import.meta.url);
export function loadFacts(file = FACTS_FILE) {
  return JSON.parse(readFileSync(file, "utf8"));
}
// Every fact an Istio release must have, and what reads it.
const FACTS = {
  gatewayApiTemplate: "the pod template istiod renders a `gatewayClassName: istio` Gateway's Deployment from (gateway-api.mjs)",
  gatewayApiProxyConfigFromPod: "whether that render reads the pod's proxy.istio.io/config (false: proxyMetadata there never becomes env)",
  gatewayApiOverlays: "the parametersRef ConfigMap keys istiod applies",
  podTemplates: "istiod's pod templates by name (inject.istio.io/templates; kube-gateway) and their files",
  templateProxyMetadataEnv: "per pod template: it writes ProxyConfig.proxyMetadata as container env",
  injectorProxyConfigFromPod: "the injector merges the pod's proxy.istio.io/config before rendering (classic gateways)",
  agentEnvOnly: "settings pilot-agent reads only from its process env (env.Register)",
  agentProxyConfigFromPod: "pilot-agent reads proxy.istio.io/config from the pod's annotations at run time",
  gatewayStatPrefix: "the gateway connection manager's stat_prefix (`outbound_<ip>_<port>` + delimiter)",
  bootstrapStatsTags: "the bootstrap's stats_tags (literal ones)",
  inferenceExtensionFlag: "istiod's switch for InferencePool backends, and its default",
  inferenceExtProcPlacement: "where istiod puts the InferencePool ext_proc filter in a gateway's chain",
  inferenceExtProcRouteModes: "the per-route ext_proc processing mode istiod sets on a pool route",
};

const opt = {};
if (import.meta.url === pathToFileURL(process.argv[1]).href) {
  const args = process.argv.slice(2);
  for (let i = 0; i < args.length; i++) {
    if (!args[i].startsWith("--")) continue;
    const k = args[i].slice(2);
    opt[k] = args[i + 1] && !args[i + 1].startsWith("--") ? args[++i] : true;
  }
  if (opt.extract) extract();
  else if (opt.check) check();
}

function extract() {
  const git = (dir, ...a) => execFileSync("git", ["-C", dir, ...a], { encoding: "utf8", maxBuffer: 64 << 20 });
  const show = (dir, ref, path) => {
    try {
      return git(dir, "show", `${ref}:${path}`);
    } catch {
      return null;
    }
  };
  const need = (cond, what) => {
    if (!cond) throw new Error(`extract: ${what}`);
    return cond;
  };
  const out = { istio: { upstream: "https://github.com/istio/istio", releases: {} } };
  for (const pair of String(opt.releases).split(/\s+/).filter(Boolean)) {
    const [release, ref] = pair.split("=");
    const I = opt.istio;
    const commit = git(I, "rev-parse", ref).trim();
    const src = (path) => need(show(I, ref, path), `${ref}: no ${path}`);
    const first = (...paths) => need(paths.find((p) => show(I, ref, p) !== null), `${ref}: none of ${paths}`);
    const f = {};
    const dcPath = first("pilot/pkg/config/kube/gatewaycommon/deploymentcontroller.go", "pilot/pkg/config/kube/gateway/deploymentcontroller.go");
    const classPath = first("pilot/pkg/config/kube/gatewaycommon/classinfo.go", "pilot/pkg/config/kube/gateway/deploymentcontroller.go");
    const tpl = need(/[Tt]emplates:\s*"([\w-]+)"/.exec(src(classPath))?.[1], `${ref}: the istio class's template`);
    f.gatewayApiTemplate = { value: tpl, file: classPath };
    const dc = src(dcPath);
    const pcCall = need(/GetProxyConfigOrDefault\(([^)]*)\)/.exec(dc)?.[1], `${ref}: GetProxyConfigOrDefault in ${dcPath}`);
    f.gatewayApiProxyConfigFromPod = { value: pcCall.split(",")[2].trim() !== "nil", file: dcPath };
    const overlays = need(/supportedOverlays\s*=\s*sets\.New\(([^)]*)\)/.exec(dc)?.[1], `${ref}: supportedOverlays`);
    f.gatewayApiOverlays = { value: [...overlays.matchAll(/"(\w+)"/g)].map((m) => m[1]), file: dcPath };
    const chart = "manifests/charts/istio-control/istio-discovery";
    const cmPath = `${chart}/templates/istiod-injector-configmap.yaml`;
    const podTemplates = Object.fromEntries([...src(cmPath).matchAll(/^\s+([\w-]+): \|\n\{\{ \.Files\.Get "(files\/[\w.-]+)"/gm)].map((m) => [m[1], `${chart}/${m[2]}`]));
    need(podTemplates[tpl] && podTemplates.gateway, `${ref}: templates ${tpl} and gateway in ${cmPath}`);
    f.podTemplates = { value: podTemplates, file: cmPath };
    const envRange = /range \$key, \$value := \.ProxyConfig\.ProxyMetadata/;
    f.templateProxyMetadataEnv = { value: Object.fromEntries(Object.entries(podTemplates).map(([n, p]) => [n, envRange.test(src(p))])), file: `${chart}/files/*.yaml` };
    f.injectorProxyConfigFromPod = { value: /GetAnnotations\(\)\[annotation\.ProxyConfig\.Name\]/.test(src("pkg/kube/inject/inject.go")), file: "pkg/kube/inject/inject.go" };
    const opts = "pilot/cmd/pilot-agent/options/options.go";
    f.agentEnvOnly = { value: [...src(opts).matchAll(/env\.Register\("([A-Z0-9_]+)"/g)].map((m) => m[1]).sort(), file: opts };
    const cfg = "pilot/cmd/pilot-agent/config/config.go";
    f.agentProxyConfigFromPod = { value: /ReadPodAnnotations/.test(src(cfg)) && /annotations\[annotation\.ProxyConfig\.Name\]/.test(src(cfg)), file: cfg };
    const delim = need(/StatPrefixDelimiter\s*=\s*"([^"]*)"/.exec(src("pkg/config/constants/constants.go"))?.[1], `${ref}: StatPrefixDelimiter`);
    const gw = "pilot/pkg/networking/core/gateway.go";
    need(/statPrefix\s*:?=\s*strings\.ToLower\(ml\.Listener\.TrafficDirection\.String\(\)\) \+ "_" \+ ml\.Listener\.Name/.test(src(gw)), `${ref}: gateway stat prefix form`);
    const delimited = /util\.DelimitedStatsPrefix\(statPrefix\)/.test(src(gw));
    f.gatewayStatPrefix = { value: { form: "outbound_<ip>_<port>", delimiter: delimited ? delim : "" }, file: `${gw}, pkg/config/constants/constants.go` };
    const boot = "tools/packaging/common/envoy_bootstrap.json";
    const section = need(/"stats_tags":\s*\[([\s\S]*?)\n {4}\]/.exec(src(boot))?.[1], `${ref}: stats_tags in ${boot}`);
    need(!/\{\{-?\s*if/.test(section.split("range")[0]), `${ref}: conditional stats_tags (not modelled)`);
    const tags = [];
    for (const m of section.matchAll(/\{([^{}]*)\}/g)) {
      const o = m[1];
      if (o.includes("{{") || o.includes("$tag")) continue;
      const name = /"tag_name":\s*"([^"]+)"/.exec(o)?.[1];
      const re = /"regex":\s*"((?:[^"\\]|\\.)*)"/.exec(o)?.[1];
      if (name && re) tags.push({ tag_name: name, regex: JSON.parse(`"${re}"`) });
    }
    f.bootstrapStatsTags = { value: need(tags.length && tags, `${ref}: no stats tags`), file: boot };
    const exp = "pilot/pkg/features/experimental.go";
    const flag = need(/env\.Register\("(ENABLE_GATEWAY_API_INFERENCE_EXTENSION)",\s*(true|false)/.exec(src(exp)), `${ref}: inference extension flag`);
    f.inferenceExtensionFlag = { value: { name: flag[1], default: flag[2] === "true" }, file: exp };
    const lb = "pilot/pkg/networking/core/listener_builder.go";
    const lbs = src(lb);
    const at = (re) => need(lbs.search(re) + 1, `${ref}: ${re} in ${lb}`);
    const stats = at(/PopAppendHTTP\w*\(filters, \w+, extensions\.(PluginPhase|TrafficExtension)_STATS\)/);
    const unspec = at(/PopAppendHTTP\w*\(filters, \w+, extensions\.(PluginPhase|TrafficExtension)_UNSPECIFIED(_PHASE)?\)/);
    const xp = at(/append\(filters, xdsfilters\.InferencePoolExtProc\)/);
    const grpc = at(/append\(filters, xdsfilters\.GrpcStats\)/);
    need(stats < xp && unspec < xp && xp < grpc, `${ref}: ext_proc not between the STATS plugins and grpc_stats`);
    f.inferenceExtProcPlacement = { value: { after: "wasm plugins of phase STATS (and unspecified)", before: "envoy.filters.http.grpc_stats" }, file: lb };
    const rt = "pilot/pkg/networking/core/route/route.go";
    const rts = src(rt);
    const block = need(/InferencePoolExtensionRefs\[in\.Name\][\s\S]*?ProcessingMode: &extproc\.ProcessingMode\{([\s\S]*?)\n\t+\},/.exec(rts)?.[1], `${ref}: pool route processing mode`);
    const modes = {};
    for (const m of block.matchAll(/(\w+)Mode:\s*extproc\.ProcessingMode_(\w+)/g)) modes[m[1].replace(/([a-z])([A-Z])/g, "$1_$2").toLowerCase() + "_mode"] = m[2];
    f.inferenceExtProcRouteModes = { value: modes, file: rt };
    for (const k of Object.keys(FACTS)) need(f[k], `${ref}: fact ${k} missing`);
    out.istio.releases[release] = { ref, commit, facts: f };
  }
  if (opt.gie) {
    const G = opt.gie;
    const ref = String(opt.epp);
    const commit = git(G, "rev-parse", ref).trim();
    const optsPath = "pkg/epp/server/options.go";
    const o = need(show(G, ref, optsPath), `${ref}: no ${optsPath}`);
    const flags = [...o.matchAll(/fs\.\w+Var\(&opts\.(\w+), "([a-z-]+)"/g)].map((m) => ({ field: m[1], flag: m[2] }));
    const consts = Object.fromEntries([...o.matchAll(/^\t(Default\w+)\s*=\s*(\d+)/gm)].map((m) => [m[1], Number(m[2])]));
    const defaults = {};
    for (const m of o.matchAll(/^\t\t(\w+):\s+("[^"]*"|true|false|\d+|Default\w+),/gm)) defaults[m[1]] = m[2] in consts ? consts[m[2]] : JSON.parse(m[2]);
    const flagDefault = (flag) => defaults[flags.find((x) => x.flag === flag)?.field];
    const runner = "cmd/epp/runner/runner.go";
    const r = need(show(G, ref, runner), `${ref}: no ${runner}`);
    const noConfig = /ConfigText == "" && opts\.ConfigFile == ""[\s\S]{0,80}return nil, nil/.test(r) && /scheduler config must be set/.test(r);
    const hp = "cmd/epp/runner/health.go";
    const hs = need(show(G, ref, hp), `${ref}: no ${hp}`);
    const services = [...hs.matchAll(/(\w+)CheckService\s*=\s*"(\w+)"/g)].map((m) => m[2]);
    out.epp = {
      upstream: "https://github.com/kubernetes-sigs/gateway-api-inference-extension",
      image: `registry.k8s.io/gateway-api-inference-extension/epp:${ref}`,
      ref,
      commit,
      facts: {
        flags: { value: flags.map((x) => x.flag).sort(), file: optsPath },
        secureServingDefault: { value: need(flagDefault("secure-serving") !== undefined, `${ref}: secure-serving default`) && flagDefault("secure-serving"), file: optsPath },
        grpcHealthPortDefault: { value: flagDefault("grpc-health-port"), file: optsPath },
        grpcPortDefault: { value: flagDefault("grpc-port"), file: optsPath },
        metricDefaults: {
          value: Object.fromEntries(flags.filter((x) => /-metric$/.test(x.flag) && typeof flagDefault(x.flag) === "string").map((x) => [x.flag, flagDefault(x.flag)])),
          file: optsPath,
        },
        exitsWithoutConfig: { value: noConfig, file: runner },
        leaderElectionHealthServices: { value: need(services.length && services, `${ref}: health services`), file: hp },
      },
    };
    // The RBAC the EPP needs, as the project's chart grants it.
    const rbac = "config/charts/inferencepool/templates/rbac.yaml";
    const rb = need(show(G, ref, rbac), `${ref}: no ${rbac}`);
    // Flow-style rules (`- apiGroups: [...]`, resources, verbs); the pool's own group is templated.
    const list = (t) => t.split(",").map((x) => x.trim()).filter(Boolean).map((x) => x.replace(/"/g, "")).map((x) => (x.includes("{{") ? "inference.networking.k8s.io" : x));
    const rules = (t) => [...t.matchAll(/- apiGroups: \[([^\]]*)\]\n\s+resources: \[([^\]]*)\]\n\s+verbs: \[([^\]]*)\]/g)].map((m) => ({ apiGroups: list(m[1]), resources: list(m[2]), verbs: list(m[3]) }));
    out.epp.facts.roleRules = { value: need(rules(rb).length && rules(rb), `${ref}: Role rules`), file: rbac };
    const le = "config/charts/inferencepool/templates/leader-election-rbac.yaml";
    out.epp.facts.leaderElectionRoleRules = { value: need(rules(show(G, ref, le) ?? "").length && rules(show(G, ref, le)), `${ref}: leader election rules`), file: le };
  }
  if (opt.gwapi) {
    // The first Gateway API release whose standard-channel CRD has each field kvguard uses
    // that came after v1.0 (the CRDs validate and prune by these schemas).
    const G = String(opt.gwapi);
    const tags = git(G, "tag").split("\n").filter((t) => /^v1\.\d+\.0$/.test(t)).sort((a, b) => Number(a.split(".")[1]) - Number(b.split(".")[1]));
    const fields = { Gateway: ["infrastructure"], HTTPRoute: ["timeouts"] };
    const since = {};
    for (const [kind, names] of Object.entries(fields)) {
      const file = `config/crd/standard/gateway.networking.k8s.io_${kind.toLowerCase()}s.yaml`;
      for (const name of names) {
        const t = tags.find((tag) => new RegExp(`^\\s+${name}:`, "m").test(show(G, tag, file) ?? ""));
        since[`${kind}.${name}`] = { value: need(t, `gateway-api: ${kind}.${name} in no release`), file };
      }
    }
    out.gatewayApi = { upstream: "https://github.com/kubernetes-sigs/gateway-api", tags, facts: { standardSince: { value: Object.fromEntries(Object.entries(since).map(([k, v]) => [k, v.value])), file: "config/crd/standard/gateway.networking.k8s.io_{gateways,httproutes}.yaml" } } };
  }
  if (opt.vllm) {
    const p = join(String(opt.vllm), "v1/metrics/loggers.py");
    const text = readFileSync(p, "utf8");
    const version = /^Version: (.+)$/m.exec(readFileSync(join(String(opt.vllm), "..", readdirSync(join(String(opt.vllm), "..")).find((d) => /^vllm(_\w+)?-.*\.dist-info$/.test(d)), "METADATA"), "utf8"))[1];
    const envs = readFileSync(join(String(opt.vllm), "envs.py"), "utf8");
    const keepAlive = need(/"VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "(\d+)"/.exec(envs)?.[1], "vllm: VLLM_HTTP_TIMEOUT_KEEP_ALIVE");
    out.vllm = {
      version,
      facts: {
        metrics: { value: [...new Set([...text.matchAll(/"(vllm:[a-z_]+)"/g)].map((m) => m[1]))].sort(), file: "vllm/v1/metrics/loggers.py" },
        httpKeepAliveSeconds: { value: Number(keepAlive), file: "vllm/envs.py (VLLM_HTTP_TIMEOUT_KEEP_ALIVE)" },
      },
    };
  }
  process.stdout.write(JSON.stringify(out, null, 1) + "\n");
}

function check() {
  const facts = loadFacts(String(opt.check));
  const errors = [];
  for (const rel of String(opt["istio-releases"] ?? "").split(/\s+/).filter(Boolean)) {
    const r = facts.istio.releases[rel];
    if (!r) {
      errors.push(`no facts for Istio ${rel} (a supported release: its Envoy is validated): run node envoy-config/validate/upstream-facts.mjs --extract ... with ${rel}=release-${rel} (see its header) and commit upstream-facts.json`);
      continue;
    }
    if (!/^[0-9a-f]{40}$/.test(r.commit ?? "")) errors.push(`Istio ${rel}: no commit`);
    for (const k of Object.keys(FACTS)) {
      if (!r.facts?.[k] || r.facts[k].value === undefined || !r.facts[k].file) errors.push(`Istio ${rel}: fact ${k} (${FACTS[k]}) missing, or without its source file`);
    }
  }
  for (const part of ["epp", "vllm", "gatewayApi"]) {
    for (const [k, v] of Object.entries(facts[part]?.facts ?? {})) if (v.value === undefined || !v.file) errors.push(`${part}: fact ${k} without value or source file`);
    if (!facts[part]) errors.push(`no ${part} facts`);
  }
  for (const e of errors) console.error(`FAIL ${e}`);
  if (errors.length) process.exit(1);
  const rels = Object.entries(facts.istio.releases).map(([k, r]) => `${k} (${r.ref}@${r.commit.slice(0, 8)})`);
  console.log(`ok: facts for Istio ${rels.join(", ")}; EPP ${facts.epp.ref}; vLLM ${facts.vllm.version}`);
}
