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
// and when a manifest of envoy-config/istio/ or envoy-config/kubernetes/ is never applied.
//
// Usage: node rollout-order.mjs REPO_ROOT MARKDOWN...
import { readFileSync, readdirSync, statSync } from "node:fs";
import { join } from "node:path";
import { parseAllDocuments } from "yaml";

const [root, ...docs] = process.argv.slice(2);
const errors = [];
const namespaces = new Set(["default", "kube-system", "kube-public", "istio-system"]);
const secrets = new Set(); // ns/name
const applied = new Set();
const groups = new Set(["", "apps", "policy", "rbac.authorization.k8s.io", "networking.k8s.io",
  "networking.istio.io", "security.istio.io", "extensions.istio.io", "telemetry.istio.io"]);
const nsLabels = new Map();
const injected = new Map(); // ns -> a workload needing injection

// The ```sh blocks, with `\` continuations joined and comments kept apart.
const lines = [];
for (const doc of docs) {
  let inSh = false;
  const file = doc.split("/").pop();
  readFileSync(doc, "utf8").split("\n").forEach((l, i) => {
    if (/^\s*```sh\s*$/.test(l)) inSh = true;
    else if (/^\s*```\s*$/.test(l)) inSh = false;
    else if (inSh) {
      if (lines.length && lines.at(-1).text.endsWith("\\")) lines.at(-1).text = lines.at(-1).text.slice(0, -1) + " " + l.trim();
      else lines.push({ text: l.trim(), n: `${file}:${i + 1}` });
    }
  });
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
    for (const s of secretRefs(podSpecOf(o))) if (!secrets.has(`${ns}/${s}`)) errors.push(`${where}: ${name} reads secret ${ns}/${s}, not created yet`);
    for (const srv of o.kind === "Gateway" ? (o.spec?.servers ?? []) : []) {
      const c = srv.tls?.credentialName;
      if (c && !secrets.has(`${ns}/${c}`)) errors.push(`${where}: ${name}: TLS secret ${ns}/${c} not created yet`);
    }
    if (podSpecOf(o) && needsInjection(o)) injected.set(ns, name);
  }
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
for (const dir of ["envoy-config/istio", "envoy-config/kubernetes"]) {
  for (const f of readdirSync(join(root, dir)).filter((f) => /\.ya?ml$/.test(f))) {
    if (!applied.has(join(root, dir, f))) errors.push(`${dir}/${f} is never applied by the commands`);
  }
}
for (const e of errors) console.error(`FAIL ${e}`);
if (!errors.length) console.log(`ok: ${lines.length} command lines replayed on an empty cluster; ${applied.size} manifests applied`);
process.exit(errors.length ? 1 : 0);
