// Checks that every Istio Gateway server with `credentialName` can get its certificate: the
// pods its selector picks (Deployments in the Gateway's namespace) run as a service account
// that a RoleBinding there binds to a Role (or ClusterRole) allowing `list` on secrets —
// istiod asks that (a SubjectAccessReview) before it serves a gateway a secret by SDS; without
// it the listener has no certificate and TLS handshakes fail. The secret itself is created
// by hand (ROLLOUT.md).
//
// Usage: node gateway-tls.mjs MANIFEST.yaml...
import { readFileSync } from "node:fs";
import { parseAllDocuments } from "yaml";

const objs = process.argv
  .slice(2)
  .flatMap((f) => parseAllDocuments(readFileSync(f, "utf8")).map((d) => ({ o: d.toJS(), f })))
  .filter((x) => x.o);
const of = (kind) => objs.filter((x) => x.o.kind === kind).map((x) => x.o);
const ns = (o) => o.metadata?.namespace ?? "default";
const errors = [];
const allows = (rule, cred) =>
  (rule.apiGroups ?? []).some((g) => g === "" || g === "*") &&
  (rule.resources ?? []).some((r) => r === "secrets" || r === "*") &&
  (rule.verbs ?? []).some((v) => v === "list" || v === "*") &&
  (!rule.resourceNames || rule.resourceNames.includes(cred));
let checked = 0;

for (const gw of of("Gateway").filter((g) => g.apiVersion?.startsWith("networking.istio.io/"))) {
  const sel = gw.spec?.selector ?? {};
  for (const server of gw.spec?.servers ?? []) {
    const cred = server.tls?.credentialName;
    if (!cred) continue;
    const where = `Gateway ${ns(gw)}/${gw.metadata.name} (${cred})`;
    const pods = of("Deployment").filter(
      (d) => ns(d) === ns(gw) && Object.entries(sel).every(([k, v]) => d.spec?.template?.metadata?.labels?.[k] === v),
    );
    if (!pods.length) errors.push(`${where}: its selector matches no Deployment in ${ns(gw)}`);
    for (const d of pods) {
      const sa = d.spec.template.spec?.serviceAccountName ?? "default";
      const ok = of("RoleBinding").some(
        (rb) =>
          ns(rb) === ns(gw) &&
          (rb.subjects ?? []).some((s) => s.kind === "ServiceAccount" && s.name === sa && (s.namespace ?? ns(rb)) === ns(gw)) &&
          [...of("Role").filter((r) => ns(r) === ns(gw)), ...of("ClusterRole")].some(
            (r) => r.kind === rb.roleRef?.kind && r.metadata.name === rb.roleRef?.name && (r.rules ?? []).some((x) => allows(x, cred)),
          ),
      );
      if (!ok) errors.push(`${where}: service account ${ns(gw)}/${sa} of Deployment ${d.metadata.name} may not list secrets in ${ns(gw)} (no Role + RoleBinding): istiod serves it no certificate`);
      else checked++;
    }
  }
}
if (!checked && !errors.length) errors.push("no Gateway server with credentialName found");
for (const e of errors) console.error(`FAIL ${e}`);
if (!errors.length) console.log(`ok: ${checked} gateway Deployment(s) may read their TLS secret`);
process.exit(errors.length ? 1 : 0);
