// Runs a real Envoy for the validators that need one (envoy-stats.mjs, header-hygiene.mjs):
// a copy of a rendered config with the admin and every listener on 127.0.0.1 port 0, hot
// restart off (no base id, no shared memory), and the bound ports read back.
import { spawn } from "node:child_process";
import { readFileSync, writeFileSync, mkdtempSync, rmSync, existsSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createServer } from "node:net";
import { stringify } from "yaml";

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// A port that nothing listens on: bind, note, close.
export async function closedPort() {
  return new Promise((resolve, reject) => {
    const s = createServer();
    s.once("error", reject);
    s.listen(0, "127.0.0.1", () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

// Points every cluster endpoint of `cfg` at 127.0.0.1:`port` (in place).
export function pointClustersAt(cfg, port) {
  for (const c of cfg.static_resources.clusters) {
    for (const e of c.load_assignment?.endpoints ?? []) {
      for (const lb of e.lb_endpoints ?? []) {
        const sa = lb.endpoint?.address?.socket_address;
        if (sa) {
          sa.address = "127.0.0.1";
          sa.port_value = port;
        }
      }
    }
  }
}

// Makes `cfg` reachable by a plain-text loopback client (in place): TLS off on listeners
// and clusters (transport sockets, TLS inspector, SNI matches) and no active health checks.
// The HTTP filter chains, routes and clusters stay as they are.
export function plaintext(cfg) {
  for (const l of cfg.static_resources.listeners) {
    delete l.listener_filters;
    for (const fc of l.filter_chains ?? []) {
      delete fc.transport_socket;
      delete fc.filter_chain_match;
    }
  }
  for (const c of cfg.static_resources.clusters) {
    delete c.transport_socket;
    delete c.health_checks;
  }
}

// Starts Envoy on `cfg` (an object; not modified), with `extra` arguments (e.g.
// ["--config-yaml", text]). Resolves to { admin: "ip:port", port: the first listener's port,
// stop(), log() } once both are bound (10 s each at most).
export async function startEnvoy(bin, cfg, extra = []) {
  const c = JSON.parse(JSON.stringify(cfg));
  c.admin.address.socket_address.port_value = 0;
  for (const l of c.static_resources.listeners) {
    l.address.socket_address.address = "127.0.0.1";
    l.address.socket_address.port_value = 0;
  }
  const dir = mkdtempSync(join(tmpdir(), "kvguard-envoy-run-"));
  const cfgFile = join(dir, "envoy.yaml");
  const adminFile = join(dir, "admin.addr");
  writeFileSync(cfgFile, stringify(c, { lineWidth: 0 }));
  const envoy = spawn(
    bin,
    ["-c", cfgFile, "--disable-hot-restart", "--concurrency", "2", "--admin-address-path", adminFile, "-l", "warning", ...extra],
    { stdio: ["ignore", "ignore", "pipe"] },
  );
  let log = "";
  envoy.stderr.on("data", (d) => (log += d));
  let exited = null;
  envoy.on("exit", (code) => (exited = code));
  const tail = () => log.split("\n").slice(-15).join("\n");
  const stop = () => {
    if (exited === null) envoy.kill("SIGKILL");
    rmSync(dir, { recursive: true, force: true });
  };
  try {
    let admin = null;
    for (let i = 0; i < 200 && !admin; i++) {
      if (exited !== null) throw new Error(`envoy exited (${exited}):\n${tail()}`);
      if (existsSync(adminFile)) admin = readFileSync(adminFile, "utf8").trim() || null;
      if (!admin) await sleep(50);
    }
    if (!admin) throw new Error("envoy did not bind its admin port within 10 s");
    let port = null;
    for (let i = 0; i < 200 && !port; i++) {
      if (exited !== null) throw new Error(`envoy exited (${exited}):\n${tail()}`);
      try {
        const ls = await (await fetch(`http://${admin}/listeners?format=json`)).json();
        port = ls.listener_statuses?.[0]?.local_address?.socket_address?.port_value || null;
      } catch {}
      if (!port) await sleep(50);
    }
    if (!port) throw new Error("envoy did not bind its listener within 10 s");
    return { admin, port, stop, log: tail };
  } catch (e) {
    stop();
    throw e;
  }
}
