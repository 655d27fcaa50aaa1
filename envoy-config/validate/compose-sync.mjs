// Checks that the compose stack and the Envoy file it mounts describe one topology:
// the Envoy config is envoy/local.yaml (the one the by-hand recipe runs), the wasm is mounted
// where that file names it, and the ports of its clusters are the ports the services in
// compose.yaml listen on (Envoy `engine` → kvguard-control proxy or the lossy hop,
// `kvguard_control` → kvguard-control admin, kvguard-control → vLLM). Device reservations
// (`deploy.resources.reservations.devices`: Docker refuses them without the NVIDIA toolkit)
// only on services of profile `gpu` alone, or in GPU_OVERRIDE, which may name only services
// of COMPOSE.yaml.
//
// Usage: node compose-sync.mjs COMPOSE.yaml [GPU_OVERRIDE.yaml]
import { readFileSync, existsSync } from "node:fs";
import { dirname, resolve } from "node:path";
import { parse } from "yaml";

const [file, gpuOverride] = process.argv.slice(2);
const dir = dirname(file);
const compose = parse(readFileSync(file, "utf8"));
const errors = [];
for (const [name, s] of Object.entries(compose.services ?? {})) {
  const devices = s.deploy?.resources?.reservations?.devices ?? [];
  const profiles = s.profiles ?? [];
  if (devices.length && !(profiles.length === 1 && profiles[0] === "gpu"))
    errors.push(`${file}: service ${name} reserves devices (${devices.map((d) => d.driver).join(", ")}) in profiles [${profiles}] — only profile gpu alone, or the GPU override file`);
}
if (gpuOverride) {
  for (const name of Object.keys(parse(readFileSync(gpuOverride, "utf8")).services ?? {}))
    if (!compose.services?.[name]) errors.push(`${gpuOverride}: service ${name} is not in ${file}`);
}
const svc = (name) => compose.services?.[name] ?? (errors.push(`${file}: no service ${name}`), {});

// ${VAR:-default} / ${VAR:?msg} / ${VAR}, as compose expands them with the environment `env`.
let env = {};
const subst = (s) => String(s).replace(/\$\{(\w+)(?::?-([^}]*)|:?\?[^}]*)?\}/g, (_, v, d) => env[v] ?? d ?? "");
const flag = (service, name) => {
  for (const a of svc(service).command ?? []) {
    const m = /^--([\w-]+)=(.*)$/.exec(subst(a));
    if (m && m[1] === name) return m[2];
  }
  errors.push(`${file}: service ${service} has no --${name}`);
  return "";
};
const port = (addr) => Number(String(addr).replace(/^.*:/, "").replace(/\/.*$/, ""));
const mounts = (service) =>
  (svc(service).volumes ?? []).map((v) => {
    const [src, target] = subst(v).split(":");
    return { src, target };
  });

const envoyMount = mounts("envoy").find((m) => m.target === "/etc/envoy/envoy.yaml");
if (!envoyMount) errors.push(`${file}: envoy does not mount a config at /etc/envoy/envoy.yaml`);
else {
  const envoyFile = resolve(dir, envoyMount.src);
  if (!/envoy\/local\.yaml$/.test(envoyFile)) errors.push(`${file}: envoy mounts ${envoyMount.src}, not envoy/local.yaml (the one-machine file)`);
  if (!existsSync(envoyFile)) errors.push(`${file}: ${envoyFile} does not exist`);
  else {
    const envoy = parse(readFileSync(envoyFile, "utf8"));
    const clusters = Object.fromEntries(envoy.static_resources.clusters.map((c) => [c.name, c]));
    const cport = (n) => clusters[n]?.load_assignment?.endpoints?.[0]?.lb_endpoints?.[0]?.endpoint?.address?.socket_address?.port_value;
    const wasmPaths = JSON.stringify(envoy).match(/"filename":"([^"]+\.wasm)"/g)?.map((s) => s.slice(12, -1)) ?? [];
    for (const w of wasmPaths) {
      if (!mounts("envoy").some((m) => m.target === w)) errors.push(`${file}: envoy does not mount the wasm at ${w} (named by ${envoyMount.src})`);
    }
    const listener = envoy.static_resources.listeners[0].address.socket_address.port_value;
    const adminPort = envoy.admin.address.socket_address.port_value;
    // Default profile: Envoy → kvguard-control → vLLM.
    env = {};
    const controlListen = port(flag("kvguard-control", "listen"));
    if (cport("engine") !== controlListen) errors.push(`default profile: Envoy cluster engine → ${cport("engine")}, kvguard-control --listen → ${controlListen}`);
    const admin = port(flag("kvguard-control", "admin-listen"));
    if (cport("kvguard_control") !== admin) errors.push(`Envoy cluster kvguard_control → ${cport("kvguard_control")}, kvguard-control --admin-listen → ${admin}`);
    const engine = port(flag("kvguard-control", "engine-url"));
    const vllm = port(flag("vllm", "port"));
    if (engine !== vllm) errors.push(`kvguard-control --engine-url → ${engine}, vllm --port → ${vllm}`);
    // Profile lossy, run as documented (KVGUARD_CONTROL_PORT=8011): Envoy → lossy hop → kvguard-control.
    env = { KVGUARD_CONTROL_PORT: "8011" };
    if (!(svc("lossy-hop").profiles ?? []).includes("lossy")) errors.push(`${file}: lossy-hop is not in profile lossy`);
    const lossyListen = port(flag("lossy-hop", "listen"));
    const lossyUp = port(flag("lossy-hop", "upstream"));
    const controlLossy = port(flag("kvguard-control", "listen"));
    if (cport("engine") !== lossyListen) errors.push(`profile lossy: Envoy cluster engine → ${cport("engine")}, lossy-hop --listen → ${lossyListen}`);
    if (lossyUp !== controlLossy) errors.push(`profile lossy: lossy-hop --upstream → ${lossyUp}, kvguard-control --listen → ${controlLossy}`);
    if (!errors.length) {
      console.log(`in step: client → :${listener} envoy (admin :${adminPort}) → :${cport("engine")} kvguard-control (admin :${admin}) → :${vllm} vllm`);
      console.log(`profile lossy: envoy → :${lossyListen} lossy-hop → :${lossyUp} kvguard-control (KVGUARD_CONTROL_PORT=8011)`);
    }
  }
}
for (const e of errors) console.error(`FAIL ${e}`);
process.exit(errors.length ? 1 : 0);
