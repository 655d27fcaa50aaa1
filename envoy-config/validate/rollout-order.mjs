// Replays the kubectl commands of the ```sh blocks of the files given (docs/DEPLOY-ISTIO.md,
// then envoy-config/istio/ROLLOUT.md), in order, against a model of an
// empty cluster with Istio installed (namespaces default, kube-system, kube-public,
// istio-system; the core, apps, policy, RBAC, networking and Istio API groups). Fails when a
// command uses a namespace that does not exist yet, when a workload is applied before a
// secret it reads (or a Gateway before its credentialName), on `kubectl label namespace`
// (the label belongs in the Namespace manifest, or a re-created namespace loses it), when a
// namespace whose pods need Istio's injection lacks the label in its manifest, when
// Prometheus Operator kinds are applied on a line that does not say it needs the Operator
// ("Prometheus Operator" in its comment: the Operator's CRDs and namespace `monitoring`),
// when a manifest of envoy-config/istio/ (and its gateway-api/, inference-pool/) or
// envoy-config/kubernetes/ is never applied. Also, from upstream-facts.json: a Gateway API
// object using a field the installed CRD release (its bundle URL) does not have, an
// HTTPRoute to an InferencePool before istiod's switch is set (`kubectl -n istio-system set
// env deployment/istiod NAME=true`), an object applied from two files, a `kubectl delete
// httproute` not chained after a `kubectl wait` for the route that takes its traffic, and a
// command in a fence other than ```sh (not replayed).
//
// Usage: node rollout-order.mjs REPO_ROOT MARKDOWN...
import { readFileSync, readdirSync, statSync } from "node:fs";
import { join } from "node:path";
import { parseAllDocuments } from "yaml";
import { loadFacts } from "./upstream-facts.mjs";

const [root, ...docs] = process.argv.slice(2);
const errors = [];
const namespaces = new Set(["default", "kube-system", "kube-public", "istio-system"]);
const secrets = new Set(); // ns/name
const applied = new Set();
const groups = new Set(["", "apps", "policy", "rbac.authorization.k8s.io", "networking.k8s.io",
  "networking.istio.io", "security.istio.io", "extensions.istio.io", "telemetry.istio.io"]);
const nsLabels = new Map();
// What istiod and the CRDs do, per supported release (upstream-facts.json).
const facts = loadFacts();
const istiodEnv = new Map(); // set with `kubectl -n istio-system set env deployment/istiod`
const crdVersions = new Map(); // API group -> installed release (from the bundle's URL)
const objects = new Map(); // kind ns/name -> file
const routes = new Map(); // ns/name -> { key, ready }
// CRD bundles applied by URL: the API groups they install and their release.
const BUNDLES = [
  { re: /kubernetes-sigs\/gateway-api\/releases\/download\/(v[\d.]+)\/(standard|experimental)-install\.yaml$/, groups: ["gateway.networking.k8s.io"] },
  { re: /kubernetes-sigs\/gateway-api-inference-extension\/releases\/download\/(v[\d.]+)\/manifests\.yaml$/, groups: ["inference.networking.k8s.io", "inference.networking.x-k8s.io"] },
];
const vnum = (v) => v.replace(/^v/, "").split(".").map(Number).reduce((a, x) => a * 1000 + x, 0);
const injected = new Map(); // ns -> a workload needing injection

// The ```sh blocks, with `\` continuations joined, `&&` chains split and comments kept
// apart. A kubectl command in any other fence is not replayed: refused.
const lines = [];
for (const doc of docs) {
  let fence = null;
  const file = doc.split("/").pop();
  readFileSync(doc, "utf8").split("\n").forEach((l, i) => {
    const f = /^\s*```(\S*)\s*$/.exec(l);
    if (f && fence === null) fence = f[1];
    else if (f) fence = null;
    else if (fence === "sh") {
      if (lines.length && lines.at(-1).text.endsWith("\\")) lines.at(-1).text = lines.at(-1).text.slice(0, -1) + " " + l.trim();
      else lines.push({ text: l.trim(), n: `${file}:${i + 1}` });
    } else if (fence !== null && /^\s*(kubectl|helm|istioctl)\s/.test(l)) {
      errors.push(`${file}:${i + 1}: a command in a \`\`\`${fence} fence, which is not replayed: put it in a \`\`\`sh fence`);
    }
  });
}
for (let i = 0; i < lines.length; i++) {
  const [first, ...rest] = lines[i].text.split(/\s+&&\s+/);
  if (rest.length) lines.splice(i, 1, { ...lines[i], text: first }, ...rest.map((t) => ({ ...lines[i], text: t, chained: true })));
}

const podSpecOf = (o) => o.spec?.template?.spec;
const needsInjection = (o) => {
  const t = o.spec?.template?.metadata ?? {};
  return t.labels?.["sidecar.istio.io/inject"] === "true" || t.annotations?.["sidecar.istio.io/nativeSidecar"] === "true" ||
    !!t.annotations?.["inject.istio.io/templates"];
};
const secretRefs = (spec) => {
  const out = [];
  for (const c of [...(spec?.containers ?? []), ...(spec?.initContainers ?? [])]) {
    for (const e of c.env ?? []) if (e.valueFrom?.secretKeyRef && !e.valueFrom.secretKeyRef.optional) out.push(e.valueFrom.secretKeyRef.name);
    for (const e of c.envFrom ?? []) if (e.secretRef && !e.secretRef.optional) out.push(e.secretRef.name);
  }
  for (const v of spec?.volumes ?? []) if (v.secret && !v.secret.optional) out.push(v.secret.secretName);
  return out;
};

function apply(file, line, operator) {
  const docs = parseAllDocuments(readFileSync(file, "utf8")).map((d) => d.toJS()).filter(Boolean);
  applied.add(file);
  const where = `${line.n}: ${file.slice(root.length + 1)}`;
  for (const o of docs) {
    const group = o.apiVersion.includes("/") ? o.apiVersion.split("/")[0] : "";
    const name = `${o.kind} ${o.metadata?.name}`;
    if (!groups.has(group) && !(operator && group === "monitoring.coreos.com")) {
      errors.push(`${where}: ${name}: API group ${group} is not installed at this point${group === "monitoring.coreos.com" ? ' (say "needs the Prometheus Operator" on the line, or split it off)' : ""}`);
      continue;
    }
    if (o.kind === "Namespace") {
      namespaces.add(o.metadata.name);
      nsLabels.set(o.metadata.name, o.metadata.labels ?? {});
      continue;
    }
    if (o.kind.startsWith("Cluster")) continue;
    const ns = o.metadata?.namespace ?? "default";
    if (!namespaces.has(ns) && !(operator && ns === "monitoring")) errors.push(`${where}: ${name}: namespace ${ns} does not exist yet`);
    if (o.kind === "Secret") secrets.add(`${ns}/${o.metadata.name}`);
    const key = `${o.kind} (${group || "core"}) ${ns}/${o.metadata.name}`;
    if (objects.has(key) && objects.get(key) !== file) errors.push(`${where}: ${key} was applied from ${objects.get(key).slice(root.length + 1)}: this replaces it (give each its own name)`);
    objects.set(key, file);
    if (group === "gateway.networking.k8s.io") gatewayApiObject(o, ns, where);
    for (const s of secretRefs(podSpecOf(o))) if (!secrets.has(`${ns}/${s}`)) errors.push(`${where}: ${name} reads secret ${ns}/${s}, not created yet`);
    for (const srv of o.kind === "Gateway" ? (o.spec?.servers ?? []) : []) {
      const c = srv.tls?.credentialName;
      if (c && !secrets.has(`${ns}/${c}`)) errors.push(`${where}: ${name}: TLS secret ${ns}/${c} not created yet`);
    }
    if (podSpecOf(o) && needsInjection(o)) injected.set(ns, name);
  }
}

// Gateway API objects: their TLS secrets exist, the installed CRDs have the fields they
// use, an InferencePool backend has istiod's switch on, routes are tracked for deletes.
function gatewayApiObject(o, ns, where) {
  const name = `${o.kind} ${o.metadata.name}`;
  for (const l of o.kind === "Gateway" ? (o.spec?.listeners ?? []) : []) {
    for (const c of l.tls?.certificateRefs ?? []) if (!secrets.has(`${c.namespace ?? ns}/${c.name}`)) errors.push(`${where}: ${name}: TLS secret ${c.namespace ?? ns}/${c.name} not created yet`);
  }
  const have = crdVersions.get("gateway.networking.k8s.io");
  const since = facts.gatewayApi.facts.standardSince;
  const uses = { "Gateway.infrastructure": o.kind === "Gateway" && o.spec?.infrastructure, "HTTPRoute.timeouts": o.kind === "HTTPRoute" && (o.spec?.rules ?? []).some((r) => r.timeouts) };
  for (const [field, used] of Object.entries(uses)) {
    if (used && have && vnum(have) < vnum(since.value[field])) errors.push(`${where}: ${name} uses ${field}, standard only from Gateway API ${since.value[field]} (${since.file}); the CRDs installed are ${have}: the field is pruned`);
  }
  if (o.kind !== "HTTPRoute") return;
  const pool = (o.spec?.rules ?? []).flatMap((r) => r.backendRefs ?? []).some((b) => b.kind === "InferencePool");
  if (pool) {
    for (const [release, r] of Object.entries(facts.istio.releases)) {
      const f = r.facts.inferenceExtensionFlag;
      const on = istiodEnv.has(f.value.name) ? istiodEnv.get(f.value.name) === "true" : f.value.default;
      if (!on) {
        errors.push(`${where}: ${name} routes to an InferencePool, but istiod ${release}'s ${f.value.name} is ${f.value.default} by default (${r.ref}:${f.file}) and no earlier command turns it on: the backend is refused and every request on the route gets 500`);
        break;
      }
    }
  }
  routes.set(`${ns}/${o.metadata.name}`, { key: JSON.stringify([o.spec?.parentRefs, o.spec?.hostnames, (o.spec?.rules ?? []).map((r) => r.matches)]), ready: false });
}

for (const line of lines) {
  const [cmd, comment = ""] = line.text.split(/\s+#\s*/, 2);
  const w = cmd.split(/\s+/);
  if (w[0] !== "kubectl") continue;
  const nsIdx = w.indexOf("-n");
  const ns = nsIdx >= 0 ? w[nsIdx + 1] : "default";
  const a = w.filter((x, i) => !(x === "-n" || (i > 0 && w[i - 1] === "-n"))); // without -n NS
  const verb = a[1];
  const operator = /Prometheus Operator/.test(comment);
  if (/^https?:/.test(a.at(-1) ?? "") && verb === "apply") {
    const b = BUNDLES.find((x) => x.re.test(a.at(-1)));
    if (!b) errors.push(`${line.n}: \`${cmd}\`: a URL this replay does not know (name its API groups in rollout-order.mjs)`);
    else b.groups.forEach((g) => (groups.add(g), crdVersions.set(g, b.re.exec(a.at(-1))[1])));
    continue;
  }
  if (verb === "set" && a[2] === "env" && /^(deployment|deploy|deployment\.apps)\/istiod$/.test(a[3] ?? "") && ns === "istio-system") {
    for (const kv of a.slice(4)) if (/^[A-Z0-9_]+=/.test(kv)) istiodEnv.set(kv.split("=")[0], kv.slice(kv.indexOf("=") + 1));
    continue;
  }
  if (verb === "wait" && a.some((x) => x.startsWith("httproute/"))) {
    const r = routes.get(`${ns}/${a.find((x) => x.startsWith("httproute/")).split("/")[1]}`);
    if (!r) errors.push(`${line.n}: \`${cmd}\`: no such HTTPRoute applied yet`);
    else if (!/ResolvedRefs|Accepted/.test(cmd)) errors.push(`${line.n}: \`${cmd}\`: wait for the route's ResolvedRefs (its backends resolved), not just its existence`);
    else r.ready = true;
    continue;
  }
  if (verb === "delete" && /^(httproute|httproutes)$/.test(a[2] ?? "")) {
    const gone = routes.get(`${ns}/${a[3]}`);
    const successor = gone && [...routes.entries()].find(([k, r]) => k !== `${ns}/${a[3]}` && r.key === gone.key);
    if (!successor) errors.push(`${line.n}: \`${cmd}\`: no other route with the same parents, hosts and matches takes its traffic`);
    else if (!successor[1].ready || !line.chained) errors.push(`${line.n}: \`${cmd}\`: chain it (\`&&\`) after a \`kubectl wait\` for ${successor[0]}'s ResolvedRefs, so a route that is not serving never takes the traffic`);
    routes.delete(`${ns}/${a[3]}`);
    continue;
  }
  if (verb === "label" && /^(namespace|ns)$/.test(a[2])) {
    errors.push(`${line.n}: \`${cmd}\`: label the Namespace in its manifest instead`);
  } else if (verb === "create") {
    if (a[2] === "namespace" || a[2] === "ns") namespaces.add(a[3]);
    else {
      if (!namespaces.has(ns)) errors.push(`${line.n}: \`${cmd}\`: namespace ${ns} does not exist yet`);
      if (a[2] === "secret") secrets.add(`${ns}/${a[4]}`);
    }
  } else if (verb === "apply") {
    w.forEach((x, i) => {
      if (x !== "-f") return;
      const p = join(root, w[i + 1]);
      const files = statSync(p).isDirectory() ? readdirSync(p).filter((f) => /\.ya?ml$/.test(f)).sort().map((f) => join(p, f)) : [p];
      for (const f of files) apply(f, line, operator);
    });
  }
}
for (const [ns, who] of injected) {
  const l = nsLabels.get(ns);
  if (!l) errors.push(`namespace ${ns} (${who} needs Istio's injection) is not created from a manifest`);
  else if (l["istio-injection"] !== "enabled" && !l["istio.io/rev"]) errors.push(`Namespace ${ns}: ${who} needs Istio's injection, but the manifest has no istio-injection: enabled (or istio.io/rev) label`);
}
for (const dir of ["envoy-config/istio", "envoy-config/istio/gateway-api", "envoy-config/istio/inference-pool", "envoy-config/kubernetes"]) {
  for (const f of readdirSync(join(root, dir)).filter((f) => /\.ya?ml$/.test(f))) {
    if (!applied.has(join(root, dir, f))) errors.push(`${dir}/${f} is never applied by the commands`);
  }
}
for (const e of errors) console.error(`FAIL ${e}`);
if (!errors.length) console.log(`ok: ${lines.length} command lines replayed on an empty cluster; ${applied.size} manifests applied`);
process.exit(errors.length ? 1 : 0);
