// Checks the Gateway API deployment (istio/gateway-api/gateway.yaml) and writes the
// Deployment istiod's gateway controller would generate for it, for istio-render.mjs:
// - the Gateway, HTTPRoute and ReferenceGrant against the Gateway API v1 fields they may
//   use (a subset of the CRDs: an unknown or misspelt field fails, as k8s-models.mjs does
//   for Istio's kinds); the parametersRef ConfigMap, the HTTPRoute's parent Gateway and the
//   ReferenceGrant of a cross-namespace backend must exist; the listeners' ports must be
//   the gateway model's (istio-gateway-base.yaml), which the EnvoyFilter patches;
// - the generated Deployment (`<gateway>-istio`, pods labelled with the Gateway's name and
//   infrastructure.labels, annotated with infrastructure.annotations, istio-proxy), rendered
//   from the template upstream-facts.json names (not the injector: marked with the
//   RENDERED_BY annotation for istio-render.mjs), with the ConfigMap's `deployment` patch
//   merged in strategically (lists of named items merge by name), plus the ConfigMaps of
//   --configmaps (the custom bootstrap);
// - an InferencePool (Gateway API Inference Extension v1) among the inputs: its fields; it
//   selects the --engines Deployment's pods and targets kvguard-control's proxy port there
//   (every picked request passes kvguard-control); its endpoint picker's Service leads to a
//   Deployment whose --model-server-metrics-port is the engine's own port, not the target
//   port (else the picker's scrapes would be proxied and counted as inference).
//
//   The picker Deployment against the EPP's and vLLM's facts (checkPicker): it starts (known
//   flags, a scheduler config), is reachable (TLS vs the mesh), reads metrics vLLM exports,
//   has the chart's RBAC, two replicas with leader election and probes, failureMode
//   FailOpen, and the engines' NetworkPolicy (--netpol) lets it scrape.
// - one object per kind/namespace/name across the files.
//
// Usage: node gateway-api.mjs --base BASE.yaml --configmaps FILE.yaml --out OUT.yaml
//          [--engines ENGINES.yaml --namespaces NS.yaml --netpol NETPOL.yaml --core-out FILE] GATEWAY_API.yaml [INFERENCE_POOL.yaml]
import { readFileSync, writeFileSync } from "node:fs";
import { parse, parseAllDocuments, stringify } from "yaml";
import { loadFacts, RENDERED_BY } from "./upstream-facts.mjs";

const args = process.argv.slice(2);
const opt = { files: [] };
for (let i = 0; i < args.length; i++) {
  if (args[i].startsWith("--")) opt[args[i].slice(2)] = args[++i];
  else opt.files.push(args[i]);
}
const docs = (f) => parseAllDocuments(readFileSync(f, "utf8")).map((d) => d.toJS()).filter(Boolean);
const objs = opt.files.flatMap(docs);
const errors = [];
// What istiod does with a Gateway, per supported release (upstream-facts.json).
const facts = loadFacts();
const releases = Object.entries(facts.istio.releases);
const templates = new Set(releases.map(([, r]) => r.facts.gatewayApiTemplate.value));
if (templates.size !== 1) errors.push(`the supported Istio releases render Gateway API pods from different templates (${[...templates]}): the model renders one`);
const TEMPLATE = [...templates][0];
const ref = (o) => `${o.kind} ${o.metadata?.namespace}/${o.metadata?.name}`;

// One object per kind, namespace and name across the files: applying the second replaces
// the first (a pool file redefining the Gateway API file's route moves all of its traffic).
{
  const seen = new Map();
  for (const f of opt.files) {
    for (const o of docs(f)) {
      const k = `${o.kind} ${o.metadata?.namespace}/${o.metadata?.name}`;
      if (seen.has(k) && seen.get(k) !== f) errors.push(`${k} is defined in ${seen.get(k)} and in ${f}: applying one replaces the other; give each its own name`);
      seen.set(k, f);
    }
  }
}

// Allowed fields (a subset of Gateway API v1): {} = any value, a string = leaf.
const L = "leaf";
const META = { name: L, namespace: L, labels: {}, annotations: {} };
const PARENT = { group: L, kind: L, namespace: L, name: L, sectionName: L, port: L };
const SCHEMA = {
  Gateway: {
    apiVersion: L, kind: L, metadata: META,
    spec: {
      gatewayClassName: L,
      infrastructure: { labels: {}, annotations: {}, parametersRef: { group: L, kind: L, name: L } },
      addresses: [{ type: L, value: L }],
      listeners: [{
        name: L, hostname: L, port: L, protocol: L,
        tls: { mode: L, certificateRefs: [{ group: L, kind: L, name: L, namespace: L }], options: {} },
        allowedRoutes: { namespaces: { from: L, selector: {} }, kinds: [{ group: L, kind: L }] },
      }],
    },
  },
  HTTPRoute: {
    apiVersion: L, kind: L, metadata: META,
    spec: {
      parentRefs: [PARENT], hostnames: [L],
      rules: [{
        name: L,
        matches: [{ path: { type: L, value: L }, headers: [{ type: L, name: L, value: L }], queryParams: [{ type: L, name: L, value: L }], method: L }],
        filters: [{}],
        backendRefs: [{ group: L, kind: L, name: L, namespace: L, port: L, weight: L, filters: [{}] }],
        timeouts: { request: L, backendRequest: L },
      }],
    },
  },
  InferencePool: {
    apiVersion: L, kind: L, metadata: META,
    spec: {
      selector: { matchLabels: {} },
      targetPorts: [{ number: L }],
      endpointPickerRef: { group: L, kind: L, name: L, port: { number: L }, failureMode: L },
    },
  },
  ReferenceGrant: {
    apiVersion: L, kind: L, metadata: META,
    spec: { from: [{ group: L, kind: L, namespace: L }], to: [{ group: L, kind: L, name: L }] },
  },
};
function fields(v, s, where) {
  if (s === L || (s && typeof s === "object" && !Array.isArray(s) && !Object.keys(s).length)) return;
  if (Array.isArray(s)) {
    if (!Array.isArray(v)) return errors.push(`${where}: expected a list`);
    return v.forEach((x, i) => fields(x, s[0], `${where}[${i}]`));
  }
  if (!v || typeof v !== "object" || Array.isArray(v)) return errors.push(`${where}: expected an object`);
  for (const [k, x] of Object.entries(v)) {
    if (!(k in s)) errors.push(`${where}: unknown field "${k}"`);
    else fields(x, s[k], `${where}.${k}`);
  }
}
const GW_API = /^(gateway|inference)\.networking\.k8s\.io\/v1(beta1)?$/;
for (const o of objs.filter((o) => GW_API.test(o.apiVersion))) {
  if (!SCHEMA[o.kind]) errors.push(`${ref(o)}: kind not checked here`);
  else fields(o, SCHEMA[o.kind], ref(o));
}

const base = parse(readFileSync(opt.base, "utf8"));
const modelPorts = new Set(base.static_resources.listeners.map((l) => l.address.socket_address.port_value));
const configMaps = objs.filter((o) => o.kind === "ConfigMap");
const gateways = objs.filter((o) => o.kind === "Gateway" && GW_API.test(o.apiVersion));
const out = [];

// Strategic merge: objects recursively, lists of {name: ...} items by name, others replaced.
function smerge(a, b) {
  if (Array.isArray(a) && Array.isArray(b) && b.every((x) => x?.name !== undefined)) {
    const r = a.map((x) => ({ ...x }));
    for (const x of b) {
      const i = r.findIndex((y) => y.name === x.name);
      if (i >= 0) r[i] = smerge(r[i], x);
      else r.push(x);
    }
    return r;
  }
  if (a && b && typeof a === "object" && typeof b === "object" && !Array.isArray(a) && !Array.isArray(b)) {
    const r = { ...a };
    for (const [k, v] of Object.entries(b)) r[k] = k in a ? smerge(a[k], v) : v;
    return r;
  }
  return b;
}

for (const gw of gateways) {
  const ns = gw.metadata.namespace;
  if (gw.spec.gatewayClassName !== "istio") errors.push(`${ref(gw)}: gatewayClassName ${gw.spec.gatewayClassName}, not istio`);
  for (const l of gw.spec.listeners ?? []) {
    if (!modelPorts.has(l.port)) errors.push(`${ref(gw)}: listener ${l.name} on ${l.port}: the gateway model (and the EnvoyFilter) listen on ${[...modelPorts]}`);
  }
  const p = gw.spec.infrastructure?.parametersRef;
  let patch = {};
  let servicePatch = {};
  let pdbPatch = null;
  if (p) {
    const cm = configMaps.find((c) => p.kind === "ConfigMap" && c.metadata.name === p.name && c.metadata.namespace === ns);
    if (!cm) errors.push(`${ref(gw)}: parametersRef ConfigMap ${ns}/${p.name} is not in the inputs`);
    else {
      for (const k of Object.keys(cm.data ?? {})) {
        for (const [rel, r] of releases) {
          const f = r.facts.gatewayApiOverlays;
          if (!f.value.includes(k)) errors.push(`${ref(cm)}: key ${k} is not one istiod ${rel} applies (${f.value}; ${r.ref}:${f.file}): it refuses the whole Gateway`);
        }
      }
      patch = parse(cm.data?.deployment ?? "") ?? {};
      servicePatch = parse(cm.data?.service ?? "") ?? {};
      pdbPatch = cm.data?.podDisruptionBudget === undefined ? null : parse(cm.data.podDisruptionBudget) ?? {};
    }
  }
  const labels = { "gateway.networking.k8s.io/gateway-name": gw.metadata.name, ...(gw.spec.infrastructure?.labels ?? {}) };
  const generated = {
    apiVersion: "apps/v1",
    kind: "Deployment",
    metadata: { name: `${gw.metadata.name}-istio`, namespace: ns, labels, annotations: { [RENDERED_BY]: TEMPLATE } },
    spec: {
      selector: { matchLabels: { "gateway.networking.k8s.io/gateway-name": gw.metadata.name } },
      template: {
        metadata: {
          labels: { "sidecar.istio.io/inject": "false", ...labels },
          annotations: { ...(gw.spec.infrastructure?.annotations ?? {}) },
        },
        spec: {
          serviceAccountName: `${gw.metadata.name}-istio`,
          containers: [{ name: "istio-proxy", image: "docker.io/istio/proxyv2:rendered-by-istiod", ports: (gw.spec.listeners ?? []).map((l) => ({ containerPort: l.port, protocol: "TCP" })) }],
        },
      },
    },
  };
  out.push(smerge(generated, patch));
  // The Service (type LoadBalancer, a port per listener) and, only with its overlay, the
  // PodDisruptionBudget, as kube-gateway renders them.
  const selector = { "gateway.networking.k8s.io/gateway-name": gw.metadata.name };
  const ports = (gw.spec.listeners ?? []).map((l) => ({ name: l.name, port: l.port, protocol: "TCP" }));
  out.push(smerge({ apiVersion: "v1", kind: "Service", metadata: { name: `${gw.metadata.name}-istio`, namespace: ns, labels }, spec: { type: "LoadBalancer", selector, ports } }, servicePatch));
  if (pdbPatch) out.push(smerge({ apiVersion: "policy/v1", kind: "PodDisruptionBudget", metadata: { name: `${gw.metadata.name}-istio`, namespace: ns, labels }, spec: { selector: { matchLabels: selector } } }, pdbPatch));
}
for (const r of objs.filter((o) => o.kind === "HTTPRoute")) {
  for (const pr of r.spec?.parentRefs ?? []) {
    if (!gateways.some((g) => g.metadata.name === pr.name && g.metadata.namespace === (pr.namespace ?? r.metadata.namespace))) errors.push(`${ref(r)}: parent Gateway ${pr.name} is not in the inputs`);
  }
  for (const b of (r.spec?.rules ?? []).flatMap((x) => x.backendRefs ?? [])) {
    const bns = b.namespace ?? r.metadata.namespace;
    if (bns === r.metadata.namespace) continue;
    const grant = objs.some(
      (g) => g.kind === "ReferenceGrant" && g.metadata.namespace === bns &&
        g.spec.from.some((f) => f.kind === "HTTPRoute" && f.namespace === r.metadata.namespace) &&
        g.spec.to.some((t) => (t.kind ?? "Service") === (b.kind ?? "Service") && (!t.name || t.name === b.name)),
    );
    if (!grant) errors.push(`${ref(r)}: backend ${bns}/${b.name} in another namespace without a ReferenceGrant there (the route is refused)`);
  }
}
const engines = opt.engines ? docs(opt.engines) : [];
const namespaces = opt.namespaces ? docs(opt.namespaces).filter((o) => o.kind === "Namespace") : [];
const netpols = opt.netpol ? docs(opt.netpol).filter((o) => o.kind === "NetworkPolicy") : [];
for (const pool of objs.filter((o) => o.kind === "InferencePool")) {
  const ns = pool.metadata.namespace;
  const want = Object.entries(pool.spec?.selector?.matchLabels ?? {});
  const picked = engines.filter((d) => d.kind === "Deployment" && d.metadata.namespace === ns && want.every(([k, v]) => d.spec?.template?.metadata?.labels?.[k] === v));
  if (!picked.length) errors.push(`${ref(pool)}: its selector picks no Deployment of ${opt.engines}`);
  for (const d of picked) {
    const spec = d.spec.template.spec;
    const control = [...(spec.initContainers ?? []), ...(spec.containers ?? [])].find((c) => c.name === "kvguard-control");
    const proxyPort = control?.ports?.find((p) => p.name === "proxy")?.containerPort;
    const enginePorts = (spec.containers ?? []).filter((c) => c.name !== "kvguard-control").flatMap((c) => c.ports ?? []).map((p) => p.containerPort);
    for (const t of pool.spec.targetPorts ?? []) {
      if (t.number !== proxyPort) errors.push(`${ref(pool)}: target port ${t.number} is not kvguard-control's proxy port (${proxyPort}) in ${ref(d)}: picked requests would bypass kvguard-control`);
    }
    const epp = pool.spec.endpointPickerRef ?? {};
    if (epp.kind && epp.kind !== "Service") errors.push(`${ref(pool)}: endpointPickerRef kind ${epp.kind}: not modelled`);
    const svc = objs.find((o) => o.kind === "Service" && o.metadata.namespace === ns && o.metadata.name === epp.name);
    if (!svc) errors.push(`${ref(pool)}: endpoint picker Service ${ns}/${epp.name} is not in the inputs`);
    else if (!(svc.spec.ports ?? []).some((p) => p.port === epp.port?.number)) errors.push(`${ref(svc)}: no port ${epp.port?.number} (endpointPickerRef)`);
    const eppPods = svc ? objs.filter((o) => o.kind === "Deployment" && o.metadata.namespace === ns && Object.entries(svc.spec.selector ?? {}).every(([k, v]) => o.spec?.template?.metadata?.labels?.[k] === v)) : [];
    if (svc && !eppPods.length) errors.push(`${ref(svc)}: selects no Deployment of the inputs`);
    if (epp.failureMode !== "FailOpen") errors.push(`${ref(pool)}: endpointPickerRef.failureMode ${epp.failureMode ?? "(unset: FailClose)"}: while the picker is down or unreachable every pool request gets 500; FailOpen lets the gateway balance itself, as kvguard fails open`);
    for (const e of eppPods) {
      const args = e.spec.template.spec.containers.flatMap((c) => c.args ?? []);
      const port = Number(/^--?model-server-metrics-port=(\d+)$/.exec(args.find((a) => /model-server-metrics-port=/.test(a)) ?? "")?.[1]);
      if (!enginePorts.includes(port)) errors.push(`${ref(e)}: --model-server-metrics-port=${port || "(unset: the target port)"}, not the engine's own port (${enginePorts}): the picker's scrapes would go through kvguard-control and count as inference`);
      checkPicker(e, svc, d, port);
    }
  }
}
// The endpoint picker Deployment against the facts of the EPP release it runs and of the
// vLLM it scrapes (upstream-facts.json): it must start, be reachable through the mesh,
// read metrics vLLM has, have its RBAC, survive a pod loss, and be let in by the
// NetworkPolicy of the engines.
function checkPicker(e, svc, engine, metricsPort) {
  const E = facts.epp;
  const f = E.facts;
  const src = (k) => `EPP ${E.ref}: ${f[k].file}`;
  const where = ref(e);
  const pod = e.spec.template;
  const c = pod.spec.containers.find((x) => (x.args ?? []).some((a) => a.startsWith("--pool-name"))) ?? pod.spec.containers[0];
  if (c.image !== E.image) errors.push(`${where}: image ${c.image}, but upstream-facts.json holds the facts of ${E.image}: re-extract them for this version (upstream-facts.mjs --extract --epp TAG)`);
  const argv = new Map();
  for (const a of c.args ?? []) {
    const m = /^--([a-z-]+)(?:=(.*))?$/.exec(a);
    if (m) argv.set(m[1], m[2] ?? "true");
    else errors.push(`${where}: argument ${a}: write flags as --name=value`);
  }
  for (const k of argv.keys()) if (!f.flags.value.includes(k)) errors.push(`${where}: --${k} is not a flag of the EPP (${src("flags")}): it exits at start`);
  if (f.exitsWithoutConfig.value && !argv.has("config-file") && !argv.has("config-text")) {
    errors.push(`${where}: no --config-file (or --config-text): EPP ${E.ref} exits at start without a scheduler configuration (${src("exitsWithoutConfig")}); mount a ConfigMap with an EndpointPickerConfig and name it`);
  }
  if (argv.has("config-file")) {
    const path = argv.get("config-file");
    const mount = (c.volumeMounts ?? []).find((m) => path.startsWith(`${m.mountPath.replace(/\/$/, "")}/`));
    const vol = (pod.spec.volumes ?? []).find((v) => v.name === mount?.name);
    const cm = objs.find((o) => o.kind === "ConfigMap" && o.metadata.namespace === e.metadata.namespace && o.metadata.name === vol?.configMap?.name);
    if (!cm?.data?.[path.split("/").pop()]) errors.push(`${where}: --config-file=${path} is not a key of a ConfigMap of the inputs mounted there: the EPP exits at start`);
  }
  // Reachable: in an injected namespace the gateway speaks Istio mTLS to the pod's sidecar,
  // which hands the EPP plaintext; outside the mesh, TLS needs a DestinationRule (SIMPLE).
  const secure = argv.has("secure-serving") ? argv.get("secure-serving") !== "false" : f.secureServingDefault.value;
  const ns = namespaces.find((n) => n.metadata.name === e.metadata.namespace);
  const injected = (ns?.metadata?.labels?.["istio-injection"] === "enabled" || !!ns?.metadata?.labels?.["istio.io/rev"]) && pod.metadata?.labels?.["sidecar.istio.io/inject"] !== "false";
  const host = `${svc.metadata.name}.${svc.metadata.namespace}.svc.cluster.local`;
  const simpleTls = objs.some((o) => o.kind === "DestinationRule" && o.spec?.host === host && o.spec?.trafficPolicy?.tls?.mode === "SIMPLE");
  if (secure && injected) errors.push(`${where}: serves TLS (--secure-serving, default ${f.secureServingDefault.value}: ${src("secureServingDefault")}), but in the injected namespace ${e.metadata.namespace} its sidecar hands it the gateway's requests as plaintext: every pick fails; pass --secure-serving=false (the mesh's mTLS protects the hop)`);
  if (secure && !injected && !simpleTls) errors.push(`${where}: serves TLS outside the mesh, and no DestinationRule (tls SIMPLE) for ${host} makes the gateway speak it`);
  if (!secure && !injected) errors.push(`${where}: plaintext gRPC outside the mesh: put the pod in an injected namespace or serve TLS`);
  // The metrics it picks by must be names the engine exports.
  for (const [flag, dflt] of Object.entries(f.metricDefaults.value)) {
    const name = (argv.get(flag) ?? dflt).replace(/\{.*$/, "");
    if (name && !facts.vllm.facts.metrics.value.includes(name)) errors.push(`${where}: --${flag} ${argv.has(flag) ? "=" : "defaults to "}${name}, which vLLM ${facts.vllm.version} does not export (${facts.vllm.facts.metrics.file}): the picker reads nothing`);
  }
  // RBAC, as the chart grants it (and the leader election's).
  const sa = pod.spec.serviceAccountName ?? "default";
  if (!objs.some((o) => o.kind === "ServiceAccount" && o.metadata.namespace === e.metadata.namespace && o.metadata.name === sa)) errors.push(`${where}: ServiceAccount ${sa} is not in the inputs: the pods are not created`);
  const roles = objs
    .filter((o) => o.kind === "RoleBinding" && o.metadata.namespace === e.metadata.namespace && (o.subjects ?? []).some((x) => x.kind === "ServiceAccount" && x.name === sa))
    .map((b) => objs.find((o) => o.kind === b.roleRef?.kind && o.metadata.name === b.roleRef?.name && o.metadata.namespace === e.metadata.namespace))
    .filter(Boolean);
  const leader = argv.get("ha-enable-leader-election") === "true";
  const need = [...f.roleRules.value, ...(leader ? f.leaderElectionRoleRules.value : [])];
  const has = (g, r, v) => roles.some((role) => (role.rules ?? []).some((x) => [g, "*"].some((y) => x.apiGroups?.includes(y)) && [r, "*"].some((y) => x.resources?.includes(y)) && [v, "*"].some((y) => x.verbs?.includes(y))));
  for (const rule of need) {
    const missing = rule.apiGroups.flatMap((g) => rule.resources.flatMap((r) => rule.verbs.filter((v) => !has(g, r, v)).map((v) => `${v} ${r}${g ? `.${g}` : ""}`)));
    if (missing.length) errors.push(`${where}: ServiceAccount ${sa} may not ${missing.join(", ")} (a Role bound to it must grant what ${src(f.roleRules.value.includes(rule) ? "roleRules" : "leaderElectionRoleRules")} grants): the picker cannot run`);
  }
  // Survives a pod loss: two replicas, one leader, probes on the EPP's health services.
  if ((e.spec.replicas ?? 1) < 2) errors.push(`${where}: one replica: every restart or node loss leaves the pool without a picker`);
  else if (!leader) errors.push(`${where}: ${e.spec.replicas} replicas without --ha-enable-leader-election pick apart`);
  const hp = Number(argv.get("grpc-health-port") ?? f.grpcHealthPortDefault.value);
  for (const [probe, service] of [["readinessProbe", "readiness"], ["livenessProbe", "liveness"]]) {
    const p = c[probe]?.grpc;
    if (!p) errors.push(`${where}: no gRPC ${probe} (port ${hp})`);
    else if (p.port !== hp || (leader && p.service !== service) || (leader && !f.leaderElectionHealthServices.value.includes(service))) errors.push(`${where}: ${probe} ${JSON.stringify(p)}: with leader election the EPP answers ${service} on ${hp} (${src("leaderElectionHealthServices")})`);
  }
  // Let in where it scrapes.
  const engineLabels = engine.spec.template.metadata.labels;
  const podLabels = pod.metadata?.labels ?? {};
  const matches = (sel, labels) => Object.entries(sel?.matchLabels ?? {}).every(([k, v]) => labels[k] === v);
  for (const np of netpols.filter((n) => n.metadata.namespace === engine.metadata.namespace && matches(n.spec.podSelector, engineLabels))) {
    const ok = (np.spec.ingress ?? []).some((rule) =>
      (rule.from ?? []).some((p) => p.podSelector && !p.namespaceSelector && matches(p.podSelector, podLabels)) &&
      (rule.ports ?? []).some((p) => p.port === metricsPort));
    if (!ok) errors.push(`${ref(np)}: does not admit the picker's pods (${JSON.stringify(podLabels)}) to the engines' port ${metricsPort}: it reads no metrics`);
  }
}

if (!gateways.length) errors.push("no Gateway (gateway.networking.k8s.io) in the inputs");
for (const e of errors) console.error(`FAIL ${e}`);
if (errors.length) process.exit(1);
const extra = opt.configmaps ? docs(opt.configmaps).filter((o) => o.kind === "ConfigMap") : [];
writeFileSync(opt.out, [...out, ...extra].map((o) => stringify(o, { lineWidth: 0 })).join("---\n"));
// --core-out FILE: the inputs' objects of Kubernetes' own API groups, for kubernetes-validate.
const core = objs.filter((o) => !GW_API.test(o.apiVersion) && !/\.istio\.io\//.test(o.apiVersion));
if (opt["core-out"]) writeFileSync(opt["core-out"], core.map((o) => stringify(o, { lineWidth: 0 })).join("---\n"));
console.log(`ok: ${gateways.length} Gateway(s); generated ${out.map((d) => d.metadata.name).join(", ")} → ${opt.out}`);
