// Checks the Gateway API deployment (istio/gateway-api/gateway.yaml) and writes the
// Deployment istiod's gateway controller would generate for it, for istio-render.mjs:
// - the Gateway, HTTPRoute and ReferenceGrant against the Gateway API v1 fields they may
//   use (a subset of the CRDs: an unknown or misspelt field fails, as k8s-models.mjs does
//   for Istio's kinds); the parametersRef ConfigMap, the HTTPRoute's parent Gateway and the
//   ReferenceGrant of a cross-namespace backend must exist; the listeners' ports must be
//   the gateway model's (istio-gateway-base.yaml), which the EnvoyFilter patches;
// - the generated Deployment (`<gateway>-istio`, pods labelled with the Gateway's name and
//   infrastructure.labels, annotated with infrastructure.annotations, gateway injection
//   template, istio-proxy with `image: auto`), with the ConfigMap's `deployment` patch
//   merged in strategically (lists of named items merge by name), plus the ConfigMaps of
//   --configmaps (the custom bootstrap);
// - an InferencePool (Gateway API Inference Extension v1) among the inputs: its fields; it
//   selects the --engines Deployment's pods and targets kvguard-control's proxy port there
//   (every picked request passes kvguard-control); its endpoint picker's Service leads to a
//   Deployment whose --model-server-metrics-port is the engine's own port, not the target
//   port (else the picker's scrapes would be proxied and counted as inference).
//
// Usage: node gateway-api.mjs --base BASE.yaml --configmaps FILE.yaml --out OUT.yaml
//          [--engines ENGINES.yaml] GATEWAY_API.yaml [INFERENCE_POOL.yaml]
import { readFileSync, writeFileSync } from "node:fs";
import { parse, parseAllDocuments, stringify } from "yaml";

const args = process.argv.slice(2);
const opt = { files: [] };
for (let i = 0; i < args.length; i++) {
  if (args[i].startsWith("--")) opt[args[i].slice(2)] = args[++i];
  else opt.files.push(args[i]);
}
const docs = (f) => parseAllDocuments(readFileSync(f, "utf8")).map((d) => d.toJS()).filter(Boolean);
const objs = opt.files.flatMap(docs);
const errors = [];
const ref = (o) => `${o.kind} ${o.metadata?.namespace}/${o.metadata?.name}`;

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
  if (p) {
    const cm = configMaps.find((c) => p.kind === "ConfigMap" && c.metadata.name === p.name && c.metadata.namespace === ns);
    if (!cm) errors.push(`${ref(gw)}: parametersRef ConfigMap ${ns}/${p.name} is not in the inputs`);
    else {
      for (const k of Object.keys(cm.data ?? {})) {
        if (!["deployment", "service", "serviceAccount", "horizontalPodAutoscaler", "podDisruptionBudget"].includes(k)) errors.push(`${ref(cm)}: key ${k} is not one istiod reads`);
      }
      patch = parse(cm.data?.deployment ?? "") ?? {};
    }
  }
  const labels = { "gateway.networking.k8s.io/gateway-name": gw.metadata.name, ...(gw.spec.infrastructure?.labels ?? {}) };
  const generated = {
    apiVersion: "apps/v1",
    kind: "Deployment",
    metadata: { name: `${gw.metadata.name}-istio`, namespace: ns, labels },
    spec: {
      selector: { matchLabels: { "gateway.networking.k8s.io/gateway-name": gw.metadata.name } },
      template: {
        metadata: {
          labels: { ...labels, "sidecar.istio.io/inject": "true" },
          annotations: { "inject.istio.io/templates": "gateway", ...(gw.spec.infrastructure?.annotations ?? {}) },
        },
        spec: {
          serviceAccountName: `${gw.metadata.name}-istio`,
          containers: [{ name: "istio-proxy", image: "auto", ports: (gw.spec.listeners ?? []).map((l) => ({ containerPort: l.port, protocol: "TCP" })) }],
        },
      },
    },
  };
  out.push(smerge(generated, patch));
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
    const svc = objs.find((o) => o.kind === "Service" && o.metadata.namespace === ns && o.metadata.name === epp.name);
    if (!svc) errors.push(`${ref(pool)}: endpoint picker Service ${ns}/${epp.name} is not in the inputs`);
    else if (!(svc.spec.ports ?? []).some((p) => p.port === epp.port?.number)) errors.push(`${ref(svc)}: no port ${epp.port?.number} (endpointPickerRef)`);
    const eppPods = svc ? objs.filter((o) => o.kind === "Deployment" && o.metadata.namespace === ns && Object.entries(svc.spec.selector ?? {}).every(([k, v]) => o.spec?.template?.metadata?.labels?.[k] === v)) : [];
    if (svc && !eppPods.length) errors.push(`${ref(svc)}: selects no Deployment of the inputs`);
    for (const e of eppPods) {
      const args = e.spec.template.spec.containers.flatMap((c) => c.args ?? []);
      const port = Number(/^--?model-server-metrics-port=(\d+)$/.exec(args.find((a) => /model-server-metrics-port=/.test(a)) ?? "")?.[1]);
      if (!enginePorts.includes(port)) errors.push(`${ref(e)}: --model-server-metrics-port=${port || "(unset: the target port)"}, not the engine's own port (${enginePorts}): the picker's scrapes would go through kvguard-control and count as inference`);
    }
  }
}
if (!gateways.length) errors.push("no Gateway (gateway.networking.k8s.io) in the inputs");
for (const e of errors) console.error(`FAIL ${e}`);
if (errors.length) process.exit(1);
const extra = opt.configmaps ? docs(opt.configmaps).filter((o) => o.kind === "ConfigMap") : [];
writeFileSync(opt.out, [...out, ...extra].map((o) => stringify(o, { lineWidth: 0 })).join("---\n"));
console.log(`ok: ${gateways.length} Gateway(s); generated ${out.map((d) => d.metadata.name).join(", ")} → ${opt.out}`);
