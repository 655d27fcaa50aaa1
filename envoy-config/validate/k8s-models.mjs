// Validates Kubernetes custom resources against their CRD schemas, as published by
// kubernetes-models (npm @kubernetes-models/istio: Istio 1.29 CRDs;
// @kubernetes-models/prometheus-operator). Core kinds are checked by kubernetes-validate
// instead; a kind neither knows is an error, so nothing is skipped silently.
//
// Two passes per object:
// 1. the CRD's OpenAPI schema (types, enums, required fields, patterns), compiled by
//    kubernetes-models into `Model.validate()`;
// 2. unknown fields: the CRD schemas do not forbid extra properties (the API server prunes
//    them silently, kubectl --validate=strict refuses them), so a typo such as
//    `failStratgy` would pass pass 1. Each object is type-checked as a TypeScript object
//    literal against the package's generated interface; excess-property checks name any
//    field the schema does not have. Free-form fields (`pluginConfig`, EnvoyFilter
//    `patch.value`) are `{}` there and are not checked (the Envoy side is checked by
//    `envoy --mode validate` on the rendered config).
//
// Usage: node k8s-models.mjs FILE.yaml...   (exit 1 with the schema's own messages)
import { readFileSync, writeFileSync, mkdtempSync, symlinkSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, dirname } from "node:path";
import { fileURLToPath } from "node:url";
import { parseAllDocuments } from "yaml";
import ts from "typescript";
import * as istio from "@kubernetes-models/istio";
import * as promop from "@kubernetes-models/prometheus-operator";

// apiVersion/kind -> model class, from the packages' own exports.
const models = new Map();
function register(ns) {
  for (const value of Object.values(ns)) {
    if (value && typeof value === "object") register(value);
    else if (typeof value === "function" && value.apiVersion && value.kind) {
      models.set(`${value.apiVersion}/${value.kind}`, value);
    }
  }
}
register(istio);
register(promop);

// Module path of a model's type declarations, e.g.
// @kubernetes-models/istio/extensions.istio.io/v1alpha1/WasmPlugin
const typeModules = new Map();
function registerTypes(pkg, ns) {
  for (const value of Object.values(ns)) {
    if (value && typeof value === "object") registerTypes(pkg, value);
    else if (typeof value === "function" && value.apiVersion && value.kind) {
      typeModules.set(`${value.apiVersion}/${value.kind}`, `${pkg}/${value.apiVersion}/${value.kind}`);
    }
  }
}
registerTypes("@kubernetes-models/istio", istio);
registerTypes("@kubernetes-models/prometheus-operator", promop);
const strictDecls = []; // { where, name, key, obj }

let failed = 0;
let checked = 0;
for (const file of process.argv.slice(2)) {
  const docs = parseAllDocuments(readFileSync(file, "utf8"));
  docs.forEach((doc, i) => {
    const where = `${file}: document ${i + 1}`;
    if (doc.errors.length) {
      console.error(`${where}: YAML: ${doc.errors.map((e) => e.message).join("; ")}`);
      failed++;
      return;
    }
    const obj = doc.toJS();
    if (obj === null) return;
    const key = `${obj.apiVersion}/${obj.kind}`;
    const Model = models.get(key);
    const name = `${key} ${obj.metadata?.namespace ?? "-"}/${obj.metadata?.name ?? "?"}`;
    if (!Model) {
      console.error(`${where}: no schema for ${key} (not an Istio or Prometheus Operator kind)`);
      failed++;
      return;
    }
    try {
      new Model(obj).validate();
      checked++;
      console.log(`ok   ${where}: ${name}`);
      strictDecls.push({ where, name, key, obj });
    } catch (e) {
      failed++;
      console.error(`FAIL ${where}: ${name}: ${e.message}`);
      for (const err of e.errors ?? []) {
        console.error(`     ${err.instancePath || "/"} ${err.message ?? err.keyword} ${JSON.stringify(err.params ?? {})}`);
      }
    }
  });
}
// Pass 2: unknown fields, through TypeScript's excess-property checks.
if (strictDecls.length) {
  const here = dirname(fileURLToPath(import.meta.url));
  const dir = mkdtempSync(join(tmpdir(), "kvguard-k8s-strict-"));
  try {
    symlinkSync(join(here, "node_modules"), join(dir, "node_modules"), "dir");
    const lines = [];
    const owners = []; // line index -> decl
    strictDecls.forEach((d, i) => {
      const M = models.get(d.key);
      lines.push(`import type { I${M.kind} as T${i} } from "${typeModules.get(d.key)}";`);
      owners.push(null);
    });
    strictDecls.forEach((d, i) => {
      const body = `export const o${i}: T${i} = ${JSON.stringify(d.obj, null, 2)};`.split("\n");
      for (const l of body) { lines.push(l); owners.push(d); }
    });
    const file = join(dir, "objects.ts");
    writeFileSync(file, lines.join("\n") + "\n");
    const program = ts.createProgram([file], {
      noEmit: true, strict: true, skipLibCheck: true, target: ts.ScriptTarget.ES2022,
      module: ts.ModuleKind.ESNext, moduleResolution: ts.ModuleResolutionKind.Bundler,
    });
    const diags = ts.getPreEmitDiagnostics(program).filter((d) => d.file && d.file.fileName === file);
    const bad = new Set();
    for (const d of diags) {
      const { line } = d.file.getLineAndCharacterOfPosition(d.start);
      const owner = owners[line];
      let msg = ts.flattenDiagnosticMessageText(d.messageText, "\n").split("\n")[0];
      if (msg.length > 160) msg = msg.slice(0, 157) + "...";
      console.error(`FAIL ${owner ? `${owner.where}: ${owner.name}` : "(type declarations)"}: not in the schema: ${lines[line].trim()}\n     ${msg}`);
      if (owner) bad.add(owner); else failed++;
    }
    failed += bad.size;
    if (!diags.length) console.log(`ok   no unknown fields in ${strictDecls.length} object(s)`);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}
console.log(`${checked} object(s) checked, ${failed} failure(s)`);
process.exit(failed ? 1 : 0);
