// Runs Envoy on a rendered Envoy config, twice, in front of stand-ins for the engine side
// (nothing on the machine is reached, every port is 0), and checks the header hygiene the
// config's header_mutation filter must give (docs/DESIGN.md, "Header hygiene"):
//
// 1. filter VM down (the kvguard filter taken out of the chain: failing open, it passes
//    everything untouched): the client never sees the `x-kvguard-control` replica stamp,
//    and no client-sent `x-kvguard-*` request header reaches the upstream;
// 2. filter running: the filter still reads the stamp, so the abort for a client that leaves
//    goes to the stamped replica (the ORIGINAL_DST route), not the fallback cluster; and the
//    client still sees no stamp. A header_mutation listed after kvguard would strip the
//    stamp before kvguard reads it, and this fails.
//
// The stand-in upstream signs its stamp like kvguard-control (docs/CONTRACT.md §4) with
// $KVGUARD_SECRET, the key the filter reads. Changed in the copy Envoy runs, so that a
// plain-text loopback client can drive it: TLS and health checks off (envoy-run.mjs
// plaintext), virtual hosts answering any host name, the filter's control_cluster pointed
// at a fallback abort receiver and every other cluster at the stand-in engine, the filter in
// `enforce` mode with control_target_cidrs ["127.0.0.1"], and an ORIGINAL_DST
// `kvguard_control_replica` cluster added when the config has none.
//
// Usage: node header-hygiene.mjs --envoy BIN --config RENDERED.yaml
import { readFileSync } from "node:fs";
import { createServer } from "node:http";
import { createHmac } from "node:crypto";
import { parse } from "yaml";
import { plaintext, sleep, startEnvoy } from "./envoy-run.mjs";

const args = process.argv.slice(2);
const opt = {};
for (let i = 0; i < args.length; i += 2) opt[args[i].replace(/^--/, "")] = args[i + 1];
for (const k of ["envoy", "config"]) if (!opt[k]) fail(`missing --${k}`);
function fail(msg) {
  console.error(`FAIL ${opt.config ?? ""}: ${msg}`);
  process.exit(1);
}
const key = (process.env.KVGUARD_SECRET ?? "").trim();
if (key.length < 16) fail("KVGUARD_SECRET (the filter's key) is not set");

const listen = (server) => new Promise((r) => server.listen(0, "127.0.0.1", () => r(server.address().port)));

// An abort receiver: answers every POST /v1/abort as done, remembers the request ids (and
// answers the filter's lease renewals, POST /v1/lease, without counting them).
function receiver() {
  const got = [];
  const server = createServer((req, res) => {
    let body = "";
    req.on("data", (d) => (body += d));
    req.on("end", () => {
      let id = null;
      try {
        id = JSON.parse(body).request_id;
      } catch {}
      if (req.url !== "/v1/lease") got.push({ path: req.url, id });
      res.writeHead(200, { "content-type": "application/json" });
      res.end(JSON.stringify({ request_id: id, found: true, aborted: true }));
    });
  });
  return { server, got };
}
const replica = receiver();
const fallback = receiver();
const replicaPort = await listen(replica.server);
const fallbackPort = await listen(fallback.server);

// The engine side: a stamped SSE stream that never ends by itself; reports the request
// headers it received in the first event.
const upstream = createServer((req, res) => {
  req.resume();
  const id = req.headers["x-request-id"] ?? "";
  const t = Math.floor(Date.now() / 1000);
  const addr = `127.0.0.1:${replicaPort}`;
  const sig = createHmac("sha256", key).update(`kvguard-stamp-v2\0${addr}|${id}|${t}`).digest("hex");
  res.writeHead(200, { "content-type": "text/event-stream", "x-kvguard-control": `${addr};t=${t};v2=${sig}` });
  res.write(`data: ${JSON.stringify({ headers: Object.keys(req.headers) })}\n\n`);
  const tick = setInterval(() => res.write(`data: {"choices":[{"delta":{"content":"x"}}]}\n\n`), 50);
  res.on("close", () => clearInterval(tick));
});
const upstreamPort = await listen(upstream);

const shipped = parse(readFileSync(opt.config, "utf8"));
const isKvguard = (f) => f.typed_config?.config?.root_id === "kvguard";

// The copy Envoy runs; `vmUp` false takes the filter out.
function prepare(vmUp) {
  const cfg = JSON.parse(JSON.stringify(shipped));
  let n = 0;
  let fallbackCluster = null;
  plaintext(cfg);
  for (const l of cfg.static_resources.listeners) {
    for (const fc of l.filter_chains ?? []) {
      for (const nf of fc.filters ?? []) {
        const hcm = nf.typed_config;
        if (!Array.isArray(hcm?.http_filters)) continue;
        for (const vh of hcm.route_config?.virtual_hosts ?? []) vh.domains = ["*"];
        for (const f of hcm.http_filters.filter(isKvguard)) {
          n++;
          const c = f.typed_config.config.configuration;
          const pc = JSON.parse(c.value);
          fallbackCluster = pc.control_cluster;
          pc.mode = "enforce";
          pc.control_target_cluster ??= "kvguard_control_replica";
          pc.control_target_cidrs = ["127.0.0.1"];
          // The stand-in replica listens on a free port, not the default admin port 9902.
          pc.control_target_ports = [replicaPort];
          c.value = JSON.stringify(pc);
        }
        if (!vmUp) hcm.http_filters = hcm.http_filters.filter((f) => !isKvguard(f));
      }
    }
  }
  if (!n) fail("no kvguard filter in the config");
  const clusters = cfg.static_resources.clusters;
  if (!clusters.some((c) => c.name === "kvguard_control_replica")) {
    clusters.push({
      name: "kvguard_control_replica",
      type: "ORIGINAL_DST",
      lb_policy: "CLUSTER_PROVIDED",
      connect_timeout: "1s",
      original_dst_lb_config: { use_http_header: true, http_header_name: "x-envoy-original-dst-host" },
    });
  }
  for (const c of clusters) {
    const port = c.name === fallbackCluster ? fallbackPort : upstreamPort;
    for (const e of c.load_assignment?.endpoints ?? []) {
      for (const lb of e.lb_endpoints ?? []) {
        const sa = lb.endpoint?.address?.socket_address;
        if (sa) Object.assign(sa, { address: "127.0.0.1", port_value: port });
      }
    }
  }
  return cfg;
}

// One stream: returns the response's stamp header (if any), the request headers the
// upstream saw, and the x-request-id; the client leaves after the first event.
async function stream(port) {
  const ac = new AbortController();
  const res = await fetch(`http://127.0.0.1:${port}/v1/chat/completions`, {
    method: "POST",
    signal: ac.signal,
    headers: { "content-type": "application/json", "x-kvguard-control": "192.0.2.1:9902;t=1;v2=00", "x-kvguard-signature": "00", "x-kvguard-anything": "1" },
    body: JSON.stringify({ model: "m", stream: true, messages: [{ role: "user", content: "hi" }] }),
  });
  const reader = res.body.getReader();
  let text = "";
  while (!text.includes("\n\n")) {
    const { value, done } = await reader.read();
    if (done) break;
    text += new TextDecoder().decode(value);
  }
  ac.abort();
  const first = JSON.parse(text.slice(text.indexOf("data: ") + 6, text.indexOf("\n\n")));
  return { status: res.status, stamp: res.headers.get("x-kvguard-control"), seen: first.headers };
}

const problems = [];
for (const vmUp of [false, true]) {
  const what = vmUp ? "filter running" : "filter VM down";
  let run = null;
  try {
    run = await startEnvoy(opt.envoy, prepare(vmUp));
    const before = { replica: replica.got.length, fallback: fallback.got.length };
    const r = await stream(run.port);
    if (r.status !== 200) problems.push(`${what}: status ${r.status} through Envoy`);
    if (r.stamp !== null) problems.push(`${what}: the client got the replica stamp (x-kvguard-control: ${r.stamp})`);
    // x-kvguard-instance is the filter's own lease tag (set after the mutation stripped any
    // client copy): only with the filter running, and never the client's.
    const leaked = r.seen.filter((h) => h.startsWith("x-kvguard-") && !(vmUp && h === "x-kvguard-instance"));
    if (leaked.length) problems.push(`${what}: client-sent headers reached the upstream: ${leaked.join(", ")}`);
    if (vmUp) {
      // The abort follows the client's reset within milliseconds; 10 s at most.
      for (let i = 0; i < 200 && replica.got.length + fallback.got.length === before.replica + before.fallback; i++) await sleep(50);
      if (replica.got.length === before.replica) {
        problems.push(`${what}: no abort reached the stamped replica (fallback got ${fallback.got.length - before.fallback}: ${JSON.stringify(fallback.got.slice(before.fallback))}): the filter did not read the stamp`);
      }
    }
  } catch (e) {
    problems.push(`${what}: ${e.message}`);
  } finally {
    run?.stop();
  }
}
for (const s of [upstream, replica.server, fallback.server]) s.closeAllConnections?.(), s.close();
if (problems.length) fail(problems.join("; "));
console.log(`ok ${opt.config}: VM down: no stamp out, no client x-kvguard-* in; VM up: stamp read (abort to the replica), none out`);
