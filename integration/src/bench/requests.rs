//! The `requests` section (issue 17): what kvguard costs **per request**, measured with two
//! independent clients side by side, so the figure does not rest on the workspace's own
//! load generator.
//!
//! One Envoy (`--concurrency 1`: one worker, pinned alone on its CPU like the overhead
//! section) with one listener per variant: `none` (router only), `noop` (the do-nothing
//! wasm filter), `noop-read` (it also copies each body chunk into the VM), `kvguard`, and
//! one `kvguard@<label>` per `--compare-wasm label=path` (another build of the filter,
//! same configuration, its own VM): so a change is measured before/after in one run.
//! Each run sends 2,000 one-event SSE requests at 500 concurrent (`--quick`: 600 at 200)
//! through one listener with one client:
//! - `h2load-h1`: h2load (nghttp2's benchmarking client), HTTP/1.1, 500 connections;
//! - `h2load-h2`: h2load over h2c (prior knowledge), 500 connections, one stream each;
//! - `load-h1`: the workspace's load generator (`crate::load`, one connection per stream);
//! - `load-h1-64`: the same with 64 events per request at 100 concurrent, for the
//!   per-event part (per round: (CPU/request at 64 events − at 1 event) / 63).
//!
//! With `--host-call-costs N`, listeners `noop-x-<call>` run the do-nothing filter making
//! one host call N times per request (`integration/bench-noop`), measured with
//! `h2load-h1` only: (CPU/request − `noop`'s) / N is what that host call costs, each.
//!
//! Rounds interleave every client and every listener, alternating the listener order;
//! the figure is Envoy's CPU (schedstat, all threads) per request, and per round the
//! difference of each filter variant to `noop` and to `none`.

use super::{
    cpu, kvguard_envoy, listener_name, load_once, noop_filter_json, pin_proxy,
    raise_circuit_breakers, BenchOptions, Scenario, Spread,
};
use crate::envoy::Envoy;
use crate::receiver::{self, ReceiverConfig};
use anyhow::{bail, Context, Result};
use kvguard_contract::Key;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::upstream::FastUpstream;
use super::SECRET;

/// The clients of the section. `load-h1-64` is the load generator with 64 events per
/// request (100 concurrent): with `load-h1` it splits each variant's cost into a
/// per-request and a per-event part, per round.
pub const CLIENTS: [&str; 4] = ["h2load-h1", "h2load-h2", "load-h1", "load-h1-64"];

/// Events per request of `load-h1-64`.
const LONG_EVENTS: u64 = 64;

/// The host calls `--host-call-costs` measures (bench-noop's `repeat`).
pub const HOST_CALLS: [&str; 10] = [
    "clock",
    "wasi_clock",
    "header",
    "header_pairs",
    "header_absent",
    "remove_header",
    "metric",
    "record",
    "set_property",
    "get_property",
];

/// The do-nothing filter repeating `call` `times` per request, in its own VM.
fn noop_repeat_json(noop_wasm: &Path, call: &str, times: u32) -> Value {
    let mut f = noop_filter_json(noop_wasm, false);
    let c = &mut f["typed_config"]["config"];
    c["configuration"]["value"] = json!(format!(r#"{{"repeat": "{call}", "times": {times}}}"#));
    c["vm_config"]["vm_id"] = json!(format!("noop-x-{call}"));
    f
}

/// The listener of a variant (`kvguard` keeps the harness's `ingress`).
pub(super) fn listener(variant: &str) -> String {
    if variant.contains('@') {
        variant.replace('@', "-")
    } else {
        listener_name(variant).to_owned()
    }
}

/// Envoy with one listener per variant: the overhead section's four, plus one per compared
/// build of the filter and, with `host_calls`, the host-call variants. Returns the variants.
pub(super) async fn envoy(
    upstream: SocketAddr,
    receiver: SocketAddr,
    noop_wasm: PathBuf,
    compare: Vec<(String, PathBuf)>,
    host_calls: Option<u32>,
    kvguard_config: &serde_json::Map<String, Value>,
    edit: impl FnOnce(&mut crate::envoy::EnvoyOptions, &mut Vec<String>),
) -> Result<(Envoy, Vec<String>)> {
    let mut filter = json!({
        "control_cluster": crate::envoy::CONTROL_CLUSTER,
        "secret_env": "KVGUARD_SECRET",
        "mode": "enforce",
    });
    for (k, v) in kvguard_config {
        filter[k] = v.clone();
    }
    let mut variants: Vec<String> = super::VARIANTS.iter().map(|v| (*v).to_owned()).collect();
    variants.extend(compare.iter().map(|(l, _)| format!("kvguard@{l}")));
    if host_calls.is_some() {
        variants.extend(HOST_CALLS.iter().map(|c| format!("noop-x-{c}")));
        // kvguard with a `paths` that matches nothing: its request-header work only (the
        // client headers stripped, path and id read), every request untracked.
        variants.push("kvguard-untracked".to_owned());
    }
    let mut eo = kvguard_envoy(upstream, receiver, filter);
    edit(&mut eo, &mut variants);
    let names = variants.clone();
    eo.patch = Some(Arc::new(move |b: &mut Value| {
        raise_circuit_breakers(b);
        let Some(listeners) = b["static_resources"]["listeners"].as_array_mut() else {
            return;
        };
        let Some(base) = listeners.first().cloned() else {
            return;
        };
        let mut out = Vec::new();
        for variant in &names {
            let mut l = base.clone();
            // The harness waits for a listener named `ingress`: kvguard's keeps that name.
            l["name"] = json!(listener(variant));
            let hcm = &mut l["filter_chains"][0]["filters"][0]["typed_config"];
            hcm["stat_prefix"] = json!(format!("ingress_{}", variant.replace('@', "-")));
            if let Some(filters) = hcm["http_filters"].as_array_mut() {
                // `<kind>@<label>`: that kind with the build `--compare-wasm` calls label.
                let (kind, label) = match variant.split_once('@') {
                    Some((k, l)) => (k, Some(l)),
                    None => (variant.as_str(), None),
                };
                match kind {
                    "none" => filters.retain(|f| f["name"] == "envoy.filters.http.router"),
                    "noop" | "noop-read" => {
                        filters.retain(|f| f["name"] == "envoy.filters.http.router");
                        filters.insert(0, noop_filter_json(&noop_wasm, variant == "noop-read"));
                    }
                    "kvguard-untracked" => {
                        let c = &mut filters[0]["typed_config"]["config"];
                        let mut cfg: Value = c["configuration"]["value"]
                            .as_str()
                            .and_then(|v| serde_json::from_str(v).ok())
                            .unwrap_or_default();
                        cfg["paths"] = json!(["/kvguard-bench-matches-nothing"]);
                        c["configuration"]["value"] = json!(cfg.to_string());
                        c["vm_config"]["vm_id"] = json!("kvguard-untracked");
                    }
                    other if other.starts_with("noop-x-") => {
                        filters.retain(|f| f["name"] == "envoy.filters.http.router");
                        let call = other.trim_start_matches("noop-x-");
                        filters.insert(
                            0,
                            noop_repeat_json(&noop_wasm, call, host_calls.unwrap_or(0)),
                        );
                    }
                    _ => {}
                }
                if let Some((label, path)) =
                    label.and_then(|l| compare.iter().find(|(c, _)| c == l))
                {
                    let vm = &mut filters[0]["typed_config"]["config"]["vm_config"];
                    vm["vm_id"] = json!(format!("{kind}-{label}"));
                    vm["code"] = json!({"local": {"filename": path.display().to_string()}});
                }
            }
            out.push(l);
        }
        *listeners = out;
    }));
    Ok((Envoy::start(eo).await?, variants))
}

/// What one h2load run reported.
#[derive(Debug, Clone, Default)]
pub(super) struct H2loadRun {
    /// Requests that got a 2xx.
    pub succeeded: u64,
    /// Failed, errored or timed out.
    pub failed: u64,
    /// Requests per second over the run.
    pub req_per_s: f64,
}

/// Parses h2load's summary (`requests: N total, N started, N done, N succeeded, N failed,
/// …` and `finished in Xs, Y req/s, …`).
fn parse_h2load(out: &str) -> H2loadRun {
    let mut r = H2loadRun::default();
    for line in out.lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("requests:") {
            for part in rest.split(',') {
                let mut w = part.split_whitespace();
                let (Some(n), Some(what)) = (w.next(), w.next()) else {
                    continue;
                };
                let n = n.parse().unwrap_or(0);
                match what {
                    "succeeded" => r.succeeded = n,
                    "failed" | "errored" | "timeout" => r.failed += n,
                    _ => {}
                }
            }
        } else if let Some(rest) = line.strip_prefix("finished in") {
            if let Some(rps) = rest.split(',').nth(1) {
                r.req_per_s = rps
                    .trim()
                    .trim_end_matches("req/s")
                    .trim()
                    .parse()
                    .unwrap_or(0.0);
            }
        }
    }
    r
}

/// The h2load binary (`H2LOAD`, else `h2load` on the PATH: Debian's `nghttp2-client`,
/// which scripts/setup installs).
fn h2load_bin() -> PathBuf {
    std::env::var_os("H2LOAD").map_or_else(|| PathBuf::from("h2load"), PathBuf::from)
}

/// The request headers of a one-event burst request (the upstream's `x-bench-*`).
const ONE_EVENT: [&str; 2] = ["x-bench-events: 1", "x-bench-interval-us: 0"];

/// One h2load run: `requests` POSTs of `body` over `concurrency` connections, with
/// `headers` (`name: value`, the upstream's `x-bench-*`) added.
pub(super) async fn h2load_once(
    target: SocketAddr,
    h2: bool,
    requests: usize,
    concurrency: usize,
    body: &Path,
    headers: &[&str],
) -> Result<H2loadRun> {
    let mut cmd = std::process::Command::new(h2load_bin());
    cmd.arg("-n")
        .arg(requests.to_string())
        .arg("-c")
        .arg(concurrency.to_string())
        .arg("-m")
        .arg("1")
        // Any connection idle for 30 s fails (the run itself takes seconds).
        .arg("-T")
        .arg("30")
        .arg("-d")
        .arg(body)
        .args(["-H", "content-type: application/json"]);
    for h in headers {
        cmd.arg("-H").arg(h);
    }
    if !h2 {
        cmd.arg("--h1");
    }
    cmd.arg(format!("http://{target}/v1/chat/completions"));
    let out = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::task::spawn_blocking(move || cmd.output()),
    )
    .await
    .context("h2load ran for more than 120 s")??
    .with_context(|| {
        format!(
            "running {} (Debian nghttp2-client; scripts/setup installs it)",
            h2load_bin().display()
        )
    })?;
    let text = String::from_utf8_lossy(&out.stdout);
    let run = parse_h2load(&text);
    if !out.status.success() || run.succeeded == 0 {
        bail!(
            "h2load failed ({}): {}{}",
            out.status,
            text,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(run)
}

/// Writes the clients' request body (a streaming chat completion) into `dir`.
pub(super) fn request_body(dir: &Path) -> Result<PathBuf> {
    let body = dir.join("body.json");
    std::fs::write(
        &body,
        br#"{"model":"bench","stream":true,"max_tokens":1,"messages":[{"role":"user","content":"hi"}]}"#,
    )?;
    Ok(body)
}

/// One run: µs of Envoy CPU per request, requests/s, failures.
type Sample = (f64, f64, u64);

/// The section.
pub async fn requests(opts: &BenchOptions) -> Result<Value> {
    let (n, conc) = if opts.quick { (600, 200) } else { (2000, 500) };
    let up = FastUpstream::spawn().await?;
    let rx = receiver::spawn(ReceiverConfig::new(vec![Key::try_new(SECRET.as_bytes())?])).await?;
    let (mut envoy, variants) = envoy(
        up.addr(),
        rx.addr(),
        opts.noop_wasm.clone(),
        opts.compare_wasm.clone(),
        opts.host_call_costs,
        &opts.kvguard_config,
        |_, _| {},
    )
    .await?;
    let pid = envoy.guard().pid();
    pin_proxy(opts, pid)?;
    let mut ports = BTreeMap::new();
    for v in &variants {
        ports.insert(v.clone(), envoy.listener_named(&listener(v)).await?);
    }
    let body_dir = tempfile::tempdir()?;
    let body = request_body(body_dir.path())?;
    let sc = Scenario {
        name: "per-request".into(),
        http2: false,
        concurrency: conc,
        requests: n,
        events: 1,
        interval_us: 0,
    };
    // Warm-up: every listener with every client.
    for v in &variants {
        h2load_once(ports[v], false, 200, 50, &body, &ONE_EVENT).await?;
        if v.starts_with("noop-x-") {
            continue;
        }
        h2load_once(ports[v], true, 200, 50, &body, &ONE_EVENT).await?;
        let s = load_once(
            ports[v],
            &Scenario {
                requests: 200,
                concurrency: 50,
                ..sc.clone()
            },
            1,
        )
        .await;
        if s.errors > 0 || s.completed == 0 {
            bail!(
                "warm-up through {v} failed: {:?}{}",
                s.error_samples,
                super::aborts_note("requests", &rx.calls())
            );
        }
    }
    let started = Instant::now();
    let mut runs: BTreeMap<String, BTreeMap<String, Vec<Sample>>> = BTreeMap::new();
    for round in 0..opts.rounds {
        let mut order = variants.clone();
        if round % 2 == 1 {
            order.reverse();
        }
        for client in CLIENTS {
            if !opts.request_clients.is_empty() && !opts.request_clients.iter().any(|c| c == client)
            {
                continue;
            }
            for v in &order {
                if (v.starts_with("noop-x-") || v == "kvguard-untracked") && client != "h2load-h1" {
                    continue;
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
                let (ns0, _) = cpu(pid);
                let (done, rps, failed) = match client {
                    "load-h1" | "load-h1-64" => {
                        let sc = if client == "load-h1" {
                            sc.clone()
                        } else {
                            Scenario {
                                requests: n / 4,
                                concurrency: 100,
                                events: LONG_EVENTS,
                                ..sc.clone()
                            }
                        };
                        let s = load_once(ports[v], &sc, round as u64 * 7 + 1).await;
                        let ok = s.completed as u64;
                        (
                            ok,
                            ok as f64 / s.duration_s.max(1e-9),
                            (s.errors + s.truncated) as u64,
                        )
                    }
                    c => {
                        let r = h2load_once(ports[v], c == "h2load-h2", n, conc, &body, &ONE_EVENT)
                            .await?;
                        (r.succeeded, r.req_per_s, r.failed)
                    }
                };
                let (ns1, _) = cpu(pid);
                let us = (ns1 - ns0) as f64 / 1000.0 / done.max(1) as f64;
                eprintln!(
                    "requests round {round} {client:>9} {v:>16}: {us:>7.2} µs Envoy CPU/request  {rps:>7.0} req/s  failed {failed}"
                );
                runs.entry(client.to_owned())
                    .or_default()
                    .entry(v.clone())
                    .or_default()
                    .push((us, rps, failed));
            }
        }
    }
    let mut summary = BTreeMap::new();
    for (client, by_v) in &runs {
        let col = |v: &str| -> Vec<f64> {
            by_v.get(v)
                .map(|xs| xs.iter().map(|x| x.0).collect())
                .unwrap_or_default()
        };
        let diff = |a: &str, b: &str| -> Spread {
            Spread::of(
                &col(a)
                    .iter()
                    .zip(col(b))
                    .map(|(x, y)| x - y)
                    .collect::<Vec<_>>(),
            )
        };
        let mut per_variant = BTreeMap::new();
        for v in &variants {
            let xs = by_v.get(v).cloned().unwrap_or_default();
            per_variant.insert(
                v.clone(),
                json!({
                    "cpu_us_per_request": Spread::of(&col(v)),
                    "req_per_s": Spread::of(&xs.iter().map(|x| x.1).collect::<Vec<_>>()),
                    "failed": xs.iter().map(|x| x.2).sum::<u64>(),
                    "minus_noop_us": diff(v, "noop"),
                    "minus_none_us": diff(v, "none"),
                    "minus_noop_read_us": diff(v, "noop-read"),
                }),
            );
        }
        summary.insert(client.clone(), per_variant);
    }
    // The per-event part: per round and variant, (CPU/request at 64 events − at 1) / 63.
    let per_event = |v: &str| -> Vec<f64> {
        let get = |c: &str| -> Vec<f64> {
            runs.get(c)
                .and_then(|m| m.get(v))
                .map(|xs| xs.iter().map(|x| x.0).collect())
                .unwrap_or_default()
        };
        get("load-h1-64")
            .iter()
            .zip(get("load-h1"))
            .map(|(l, s)| (l - s) / (LONG_EVENTS - 1) as f64)
            .collect()
    };
    let mut per_event_summary = BTreeMap::new();
    for v in &variants {
        let diff = |b: &str| {
            Spread::of(
                &per_event(v)
                    .iter()
                    .zip(per_event(b))
                    .map(|(x, y)| x - y)
                    .collect::<Vec<_>>(),
            )
        };
        per_event_summary.insert(
            v.clone(),
            json!({
                "per_event_us": Spread::of(&per_event(v)),
                "minus_noop_read_us": diff("noop-read"),
                "minus_noop_us": diff("noop"),
            }),
        );
    }
    // What one host call costs: per round, (noop-x-<call> − noop) / N, h2load-h1.
    let mut host_call_ns = BTreeMap::new();
    if let (Some(times), Some(by_v)) = (opts.host_call_costs, runs.get("h2load-h1")) {
        let col = |v: &str| -> Vec<f64> {
            by_v.get(v)
                .map(|xs| xs.iter().map(|x| x.0).collect())
                .unwrap_or_default()
        };
        for c in HOST_CALLS {
            let per: Vec<f64> = col(&format!("noop-x-{c}"))
                .iter()
                .zip(col("noop"))
                .map(|(x, y)| (x - y) * 1000.0 / f64::from(times.max(1)))
                .collect();
            host_call_ns.insert(c.to_owned(), Spread::of(&per));
        }
    }
    let mut out = json!({
        "rounds": opts.rounds,
        "host_call_ns": host_call_ns,
        "host_call_repeats": opts.host_call_costs,
        "requests_per_run": n,
        "concurrency": conc,
        "events_per_request": 1,
        "variants": variants,
        "compare_wasm": super::compare_json(opts),
        "clients": CLIENTS,
        "summary": summary,
        "per_event": per_event_summary,
        "runs": runs,
        "measure_s": started.elapsed().as_secs_f64(),
    });
    super::record_healthy_aborts(&mut out, &rx.calls());
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn h2load_summary_is_parsed() {
        let out = "finished in 1.23s, 1626.02 req/s, 1.01MB/s\n\
                   requests: 2000 total, 2000 started, 2000 done, 1998 succeeded, 2 failed, 2 errored, 0 timeout\n";
        let r = parse_h2load(out);
        assert_eq!((r.succeeded, r.failed), (1998, 4));
        assert!((r.req_per_s - 1626.02).abs() < 1e-6);
    }
}
