// "The client closes an idle keep-alive connection first", for the hop the inference pods'
// own Istio sidecar holds: the sidecar's inbound clusters keep connections to
// kvguard-control (proxy and admin ports) and to vLLM on loopback. If the server closes an
// idle one first, a request the sidecar sends on it as it closes gets 503, and Envoy does
// not retry inference POSTs. So the sidecar's inbound idle timeout (a Sidecar's
// `ingress[].connectionPool` for the port, else its `inboundConnectionPool`, else Envoy's
// 1 h) must be below each server's:
//   kvguard-control proxy   control/src/server.rs HEADER_READ_TIMEOUT (its port: --listen)
//   kvguard-control admin   control/src/admin.rs HEAD_READ_TIMEOUT (--admin-listen)
//   vLLM                    VLLM_HTTP_TIMEOUT_KEEP_ALIVE's default (upstream-facts.json)
//
// Usage: node keepalive.mjs --control-src DIR --engines ENGINES.yaml --istio ROUTING.yaml
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { parseAllDocuments } from "yaml";
import { loadFacts } from "./upstream-facts.mjs";

const args = process.argv.slice(2);
const opt = {};
for (let i = 0; i < args.length; i += 2) opt[args[i].replace(/^--/, "")] = args[i + 1];
const docs = (f) => parseAllDocuments(readFileSync(f, "utf8")).map((d) => d.toJS()).filter(Boolean);
const errors = [];
const seconds = (d) => {
  const m = /^(\d+(?:\.\d+)?)(ms|s|m|h)$/.exec(String(d ?? ""));
  return m ? Number(m[1]) * { ms: 0.001, s: 1, m: 60, h: 3600 }[m[2]] : NaN;
};
const constSecs = (file, name) => {
  const m = new RegExp(`const ${name}: Duration = Duration::from_secs\\((\\d+)\\)`).exec(readFileSync(join(opt["control-src"], file), "utf8"));
  if (!m) errors.push(`control/src/${file}: no \`const ${name}: Duration = Duration::from_secs(N)\` (keepalive.mjs reads it)`);
  return Number(m?.[1]);
};
const vllm = loadFacts().vllm;

for (const d of docs(opt.engines).filter((o) => o.kind === "Deployment")) {
  const spec = d.spec.template.spec;
  const all = [...(spec.initContainers ?? []), ...(spec.containers ?? [])];
  const control = all.find((c) => c.name === "kvguard-control");
  if (!control) continue;
  const portOf = (flag) => Number(/:(\d+)$/.exec((control.args ?? []).find((a) => a.startsWith(`${flag}=`)) ?? "")?.[1]);
  const servers = [
    { port: portOf("--listen"), idle: constSecs("server.rs", "HEADER_READ_TIMEOUT"), who: "kvguard-control's proxy (control/src/server.rs HEADER_READ_TIMEOUT)" },
    { port: portOf("--admin-listen"), idle: constSecs("admin.rs", "HEAD_READ_TIMEOUT"), who: "kvguard-control's admin (control/src/admin.rs HEAD_READ_TIMEOUT)" },
    ...all.filter((c) => c.name !== "kvguard-control").flatMap((c) => c.ports ?? []).map((p) => ({
      port: p.containerPort,
      idle: vllm.facts.httpKeepAliveSeconds.value,
      who: `vLLM ${vllm.version} (${vllm.facts.httpKeepAliveSeconds.file})`,
    })),
  ];
  const labels = d.spec.template.metadata.labels ?? {};
  const sidecars = docs(opt.istio).filter(
    (o) => o.kind === "Sidecar" && o.metadata.namespace === d.metadata.namespace &&
      Object.entries(o.spec?.workloadSelector?.labels ?? {}).every(([k, v]) => labels[k] === v),
  );
  if (sidecars.length > 1) errors.push(`Deployment ${d.metadata.name}: ${sidecars.length} Sidecars select its pods (Istio picks one)`);
  const sc = sidecars[0]?.spec ?? {};
  for (const s of servers) {
    const perPort = (sc.ingress ?? []).find((i) => i.port?.number === s.port)?.connectionPool?.http?.idleTimeout;
    const set = perPort ?? sc.inboundConnectionPool?.http?.idleTimeout;
    const idle = set === undefined ? 3600 : seconds(set);
    if (!(idle < s.idle)) {
      errors.push(
        `Deployment ${d.metadata.name}: its Istio sidecar keeps idle connections to port ${s.port} for ${set ?? "1h (Envoy's default: no Sidecar inboundConnectionPool selects the pods)"}, ` +
          `not below ${s.who}'s ${s.idle} s: the server closes first and a request sent on the closing connection gets 503 (not retried); ` +
          `set a Sidecar's inboundConnectionPool.http.idleTimeout below ${Math.min(...servers.map((x) => x.idle))} s`,
      );
    }
  }
}
for (const e of errors) console.error(`FAIL ${e}`);
if (errors.length) process.exit(1);
console.log("ok: every inbound hop of the inference pods closes idle connections before its server does");
