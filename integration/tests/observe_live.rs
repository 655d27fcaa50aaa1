//! The leak where operators look: the demo's scenarios (simulator) under a real Prometheus
//! that scrapes Envoy, kvguard-control and the engine and evaluates the shipped rules and
//! alerts with only their windows scaled down (integration/src/demo/observe.rs).
//!
//! - The leak alerts fire during the run without kvguard and never during the run with it.
//! - A steady healthy run (no disconnects, no stalls) fires no alert at all.
//! - Every dashboard query answers with data while the load runs, but for the panels listed
//!   in [`NO_DATA_HERE`], whose reason is checked.
//! - Every metric name the rules, alerts and dashboard use is in the live scrapes, but for
//!   the names listed in [`NOT_SCRAPED_HERE`], whose reason is stated.
//! - The LoRA count, the engine's process figures and the throughput-against-uptime rules
//!   have live values, and the throughput-decline alert evaluates on them.
//! - kvguard watching itself: failing abort calls, a lease admin path down (the in-band
//!   renewals still landing) and a missing scrape fire their alerts.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvguard_integration::demo::observe::{self, Observed};
use kvguard_integration::demo::{self, DemoConfig, EngineKind, Mode, RunResult};
use kvguard_integration::prom;
use std::collections::BTreeSet;

/// Alerts that a leak (clients gone behind a hop that does not pass disconnects on, no
/// kvguard) makes fire within a minute-long scaled run.
const LEAK_ALERTS: [&str; 2] = ["KvguardOrphanedStreams", "KvguardCoverageFalling"];

/// Why a dashboard panel cannot have data in this stack (checked by [`check_reason`]).
#[derive(Debug, Clone, Copy)]
enum NoData {
    /// kvguard-control runs with `--no-nvml`: `kvguard_control_nvml_available == 0`.
    NoGpu,
    /// kvguard-control runs without `--engine-pid`: the demo's simulator runs inside this
    /// test process, whose tree is the whole stack (`kvguard_control_engine_processes ==
    /// 0`). The self-watching test runs the simulator as its own process and checks these
    /// panels there.
    NoEnginePid,
}

/// Dashboard panels that cannot have data here, with the reason.
const NO_DATA_HERE: [(&str, NoData); 4] = [
    ("GPU memory used / total", NoData::NoGpu),
    ("GPU memory per process", NoData::NoGpu),
    (ENGINE_PANELS[0], NoData::NoEnginePid),
    (ENGINE_PANELS[1], NoData::NoEnginePid),
];

/// The dashboard's engine-process panels (kvguard-control's `/proc` figures, or cAdvisor's).
const ENGINE_PANELS: [&str; 2] = [
    "Engine open file descriptors (process tree)",
    "Engine memory (process tree)",
];

/// Names the rules and dashboard use that no process of this stack exports.
const NOT_SCRAPED_HERE: [(&str, &str); 7] = [
    (
        "kube_pod_container_resource_requests",
        "kube-state-metrics (Kubernetes only)",
    ),
    (
        "container_file_descriptors",
        "cAdvisor (Kubernetes only; here kvguard-control reads the engine's /proc)",
    ),
    (
        "container_memory_working_set_bytes",
        "cAdvisor (Kubernetes only; here kvguard-control reads the engine's /proc)",
    ),
    (
        "kvguard_control_gpu_process_memory_used_bytes",
        "NVML only (--no-nvml here)",
    ),
    (
        "kvguard_control_gpu_memory_used_bytes",
        "NVML only (--no-nvml here)",
    ),
    (
        "kvguard_control_gpu_memory_total_bytes",
        "NVML only (--no-nvml here)",
    ),
    (
        "vllm:nixl_num_kv_expired_reqs_total",
        "vLLM with NixlConnector, prefill side (asserted live in e2e_vllm_pd.rs)",
    ),
];

fn cfg(seed: u64) -> DemoConfig {
    let mut c = DemoConfig::new(EngineKind::Sim);
    c.arrival_s = 30.0;
    // Without kvguard the departed clients' requests stay open behind the hop; the orphan
    // signal subtracts the gateways' largest count over two evaluations from kvguard-
    // control's smallest (scrape skew must not fire it while traffic ramps), so while
    // arrivals churn it is only clearly above 0 once they stop. The drain gives the 15 s
    // `for:` room after the last arrival (it fired 26.5 s after the last arrival in a
    // recorded run).
    c.drain_s = 40.0;
    // Enough orphans, running long enough: 30 % of 300–600-token streams (at the
    // simulator's 40 tokens/s) leave, most of them with seconds of generation ahead.
    c.disconnect_share = 0.3;
    c.min_tokens = 300;
    c.max_tokens = 600;
    c.seed = seed;
    c.prometheus = true;
    c
}

/// The leak run, sized from the shipped alerts' `for:` as scaled (`F`, 15 s): an alert
/// fires only on a signal that holds for `F`, and an orphan behind the lossy hop lasts
/// until its request's natural end. Streams last 2–2.5 `F` at the simulator's pace, so
/// the orphans of clients that left early hold the signal above 0 for over `F` after the
/// arrivals stop, however slowly the machine runs the clients; the arrivals (2 `F`) keep
/// completions flowing for the coverage alert's `F`; the drain outlasts the longest stream
/// by `F`/2 of margin; the pool holds every stream at once (no queueing to
/// change the timing). Measured on 2 cores with one kept busy by a spinner (scripts/test's
/// native stage under load, docs/TESTING.md).
fn leak_cfg(seed: u64) -> DemoConfig {
    let for_s = LEAK_ALERTS
        .iter()
        .map(|a| prom::shipped_alert_for(a).unwrap() as f64 / f64::from(observe::SCALE))
        .fold(0.0, f64::max);
    let mut c = cfg(seed);
    let tokens = |f: f64| (f * for_s * c.sim_token_rate) as u32;
    c.rate = 2.0;
    c.arrival_s = 2.0 * for_s;
    c.min_tokens = tokens(2.0);
    c.max_tokens = tokens(2.5);
    c.drain_s = 3.0 * for_s;
    // Every stream of the arrivals at once, prompt and all, with room to spare.
    c.sim_kv_blocks = (c.rate * c.arrival_s) as u32 * (c.max_tokens / 16 + 8);
    c
}

fn observed(r: &RunResult) -> &Observed {
    r.observed.as_ref().expect("the run was observed")
}

fn fired(o: &Observed) -> BTreeSet<String> {
    o.alerts
        .iter()
        .filter(|m| m.state == "firing")
        .map(|m| m.name.clone())
        .collect()
}

/// Panels whose queries all answered with at least one series.
fn empty_panels(o: &Observed) -> BTreeSet<String> {
    o.panels
        .iter()
        .filter(|p| p.samples == 0)
        .map(|p| p.query.panel.clone())
        .collect()
}

fn check_dashboard(o: &Observed) {
    for p in &o.panels {
        assert!(
            p.error.is_none(),
            "panel {:?}: Prometheus refused {:?}: {:?}",
            p.query.panel,
            p.query.expr,
            p.error
        );
    }
    assert!(!o.panels.is_empty(), "no dashboard query ran");
    let allowed: BTreeSet<String> = NO_DATA_HERE.iter().map(|(p, _)| p.to_string()).collect();
    let empty = empty_panels(o);
    let unexpected: Vec<_> = o
        .panels
        .iter()
        .filter(|p| p.samples == 0 && !allowed.contains(&p.query.panel))
        .map(|p| format!("{:?}: {}", p.query.panel, p.query.expr))
        .collect();
    assert!(
        unexpected.is_empty(),
        "dashboard queries without data while the load ran:\n{}",
        unexpected.join("\n")
    );
    // Each listed panel exists and is empty for its reason (a stale entry would lie).
    for (panel, why) in NO_DATA_HERE {
        assert!(
            o.panels.iter().any(|p| p.query.panel == panel),
            "NO_DATA_HERE names {panel:?}, not a panel of the dashboard"
        );
        assert!(
            empty.contains(panel),
            "{panel:?} has data: drop it from NO_DATA_HERE"
        );
        check_reason(o, why);
    }
}

/// The reason holds in this run.
fn check_reason(o: &Observed, why: NoData) {
    match why {
        NoData::NoGpu => assert_eq!(
            o.figures.get("kvguard_control_nvml_available"),
            Some(&0.0),
            "NVML is available: the GPU panels must have data"
        ),
        NoData::NoEnginePid => assert_eq!(
            o.figures.get("max(kvguard_control_engine_processes)"),
            Some(&0.0),
            "kvguard-control reads an engine process: the engine panels must have data"
        ),
    }
}

fn check_names(o: &Observed) {
    let root = kvguard_integration::paths::repo_root().unwrap();
    let mut used = BTreeSet::new();
    let mut recorded = BTreeSet::new();
    for f in prom::shipped_rule_files().unwrap() {
        let text = std::fs::read_to_string(&f).unwrap();
        for line in text.lines() {
            if let Some(r) = line.trim().strip_prefix("- record: ") {
                recorded.insert(r.trim().to_string());
            }
        }
        used.extend(
            exprs_of_rules(&text)
                .iter()
                .flat_map(|e| prom::promql_names(e)),
        );
    }
    let dash: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("envoy-config/grafana/kvguard-dashboard.json")).unwrap(),
    )
    .unwrap();
    for q in prom::dashboard_queries(&dash, &[("instance", ".*")]) {
        used.extend(prom::promql_names(&q.expr));
    }
    let exempt: BTreeSet<&str> = NOT_SCRAPED_HERE.iter().map(|(n, _)| *n).collect();
    let missing: Vec<&String> = used
        .iter()
        .filter(|n| !recorded.contains(*n) && !exempt.contains(n.as_str()))
        .filter(|n| !o.scraped_names.contains(*n))
        .collect();
    assert!(
        missing.is_empty(),
        "names used by the rules/dashboard that no live scrape holds: {missing:?}"
    );
    for n in &recorded {
        assert!(
            !n.is_empty() && n.contains(':'),
            "recording rule name {n:?}"
        );
    }
}

/// The `expr:` values of a rule file (block scalars included).
fn exprs_of_rules(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut lines = text.lines().peekable();
    while let Some(l) = lines.next() {
        let t = l.trim_start();
        let Some(v) = t.strip_prefix("expr:") else {
            continue;
        };
        let v = v.trim();
        if v == "|" || v == ">-" || v == "|-" {
            let indent = l.len() - t.len();
            let mut e = String::new();
            while let Some(n) = lines.peek() {
                let nt = n.trim_start();
                if !nt.is_empty() && n.len() - nt.len() <= indent {
                    break;
                }
                e.push_str(nt);
                e.push(' ');
                lines.next();
            }
            out.push(e);
        } else {
            out.push(v.to_string());
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leak_alerts_fire_without_kvguard_and_never_with_it() {
    let c = leak_cfg(42);
    let progress = |s: String| eprintln!("{s}");
    let res = demo::run_demo(&c, &[Mode::Leak, Mode::Kvguard], None, &progress)
        .await
        .unwrap();
    demo::verdict(&res).unwrap();
    let leak = observed(res.leak.as_ref().unwrap());
    let kvg = observed(res.kvguard.as_ref().unwrap());
    eprintln!(
        "without kvguard:\n{}{:?}\nwith kvguard:\n{}{:?}",
        observe::timeline(&leak.alerts),
        leak.figures,
        observe::timeline(&kvg.alerts),
        kvg.figures
    );
    for p in kvg.panels.iter().filter(|p| p.samples == 0) {
        eprintln!("empty panel query {:?}: {}", p.query.panel, p.query.expr);
    }
    eprintln!(
        "scraped kvguard names: {:?}",
        kvg.scraped_names
            .iter()
            .filter(|n| n.starts_with("kvguard"))
            .collect::<Vec<_>>()
    );
    let (fl, fk) = (fired(leak), fired(kvg));
    for a in LEAK_ALERTS {
        assert!(fl.contains(a), "{a} did not fire without kvguard: {fl:?}");
        assert!(!fk.contains(a), "{a} fired with kvguard: {fk:?}");
    }
    // The orphans' cost, as kvguard-control counts it: engine time and streamed tokens
    // between the client's departure (the filter's gone_ms) and the engine connection
    // closing. Only the run with the filter knows when clients left.
    let secs = kvg.figures["sum(kvguard_control_orphan_seconds_total)"];
    let ends = kvg.figures["sum(kvguard_control_orphan_ends_total)"];
    assert!(
        ends > 0.0,
        "no orphan cost counted with kvguard: {:?}",
        kvg.figures
    );
    assert!(secs > 0.0 && secs / ends < 5.0, "{:?}", kvg.figures);
    assert_eq!(leak.figures["sum(kvguard_control_orphan_ends_total)"], 0.0);
    check_dashboard(kvg);
    check_names(kvg);
    check_engine_signals(kvg);
}

/// The LoRA and throughput-against-uptime signals on live data: the simulator lists the
/// demo's adapters, the throughput and uptime recording rules have values, and the
/// throughput-decline alert (and the engine fd/memory alerts) evaluate.
fn check_engine_signals(o: &Observed) {
    let f = &o.figures;
    assert_eq!(
        f.get("max(kvguard_control_engine_lora_adapters)"),
        Some(&(demo::DEMO_LORA_ADAPTERS.len() as f64)),
        "{f:?}"
    );
    assert!(
        f.get("max(instance:vllm_generation_tokens:rate1h)") > Some(&0.0),
        "{f:?}"
    );
    let up = f.get("max(instance:vllm_uptime_seconds)").copied();
    assert!(up.is_some_and(|u| u > 0.0 && u < 600.0), "uptime {up:?}");
    for r in [
        "KvguardEngineThroughputDeclining",
        "instance:vllm_generation_tokens:rate1h",
        "instance:vllm_requests:rate1h",
        "instance:vllm_uptime_seconds",
        "KvguardEngineFdsRising",
        "KvguardEngineMemoryRising",
    ] {
        assert_eq!(
            o.rule_health.get(r).map(String::as_str),
            Some("ok"),
            "rule {r}: {:?}",
            o.rule_health
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steady_healthy_run_fires_no_alert() {
    let mut c = cfg(7);
    c.disconnect_share = 0.0;
    c.stall_share = 0.0;
    let progress = |s: String| eprintln!("{s}");
    let res = demo::run_demo(&c, &[Mode::Kvguard], None, &progress)
        .await
        .unwrap();
    demo::verdict(&res).unwrap();
    let o = observed(res.kvguard.as_ref().unwrap());
    eprintln!("{}", observe::timeline(&o.alerts));
    assert!(
        fired(o).is_empty(),
        "alerts fired on a healthy run: {}",
        observe::timeline(&o.alerts)
    );
    // Prometheus evaluated them (a rule that never ran would be silent too).
    assert!(o.rules_evaluated > 0, "no alerting rule was evaluated");
    assert_eq!(o.rule_errors, Vec::<String>::new());
}

/// kvguard watching itself, live: the filter's abort calls and out-of-band lease renewals
/// go to a closed port (the admin path unreachable) while clients leave their streams and
/// the in-band renewals still land: `KvguardAbortsFailing` and `KvguardLeaseAdminPathDown`
/// fire (the divergence: nothing is cut for it), `KvguardLeaseRenewalsFailing` (both
/// paths) does not; then kvguard-control is killed and `KvguardScrapeMissing` fires for its
/// target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn self_watching_alerts_fire_on_failing_aborts_and_a_missing_scrape() {
    use kvguard_integration::demo::stack::{self, Stack, StackOptions};
    use kvguard_integration::proc::ChildGuard;
    use std::time::{Duration, Instant};
    kvguard_integration::wait::bounded("self-watching alerts", Duration::from_secs(240), async {
        // The simulator as its own process: kvguard-control reads its process (tree) by
        // pid, as it would vLLM's.
        let (sim_proc, engine) = ChildGuard::spawn_with_addr_file(
            "engine-sim",
            &kvguard_integration::paths::engine_sim_bin().unwrap(),
            ["--token-rate", "20"],
            &[],
            Duration::from_secs(20),
        )
        .await
        .unwrap();
        // The renewal period scaled down with the rules' windows (60 renewals in the
        // shipped 5 min window, 20 in the scaled 5 s one): at the shipped 5 s period a
        // scaled window held one renewal or none, and the in-band rate read 0 between.
        let mut cfg = stack::filter_config(3000, 0);
        cfg["lease_renew_ms"] = stack::FILTER_TICK_MS.into();
        let mut opts = StackOptions::new(engine, Some(cfg));
        opts.control_args = vec![
            "--engine-pid".into(),
            sim_proc.pid().to_string(),
            "--sample-interval".into(),
            "1s".into(),
        ];
        opts.lossy = false;
        opts.abort_target = Some(stack::closed_port().await.unwrap());
        opts.envoy_extra_yaml = Some(observe::shipped_stats_config().unwrap());
        let mut st = Stack::start(opts).await.unwrap();
        // Clients that leave mid-stream, one a second, from before the first scrape until
        // the abort alert fires: the in-band renewals go over the upstream their streams
        // use, so they land from the first period the out-of-band ones fail in.
        let entry = st.entry();
        leave_a_stream(entry).await;
        let leavers = tokio::spawn(async move {
            loop {
                tokio::spawn(leave_a_stream(entry));
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
        let mut o = observe::Observer::start(&st, engine).await.unwrap();
        let t0 = Instant::now();
        // The engine-process panels have data: kvguard-control sums the simulator's one
        // process (it has no children).
        let p = o.prometheus();
        kvguard_integration::wait::poll_until_async(
            "kvguard_control_engine_processes == 1 in Prometheus",
            Duration::from_secs(20),
            Duration::from_millis(250),
            || async {
                (p.result_len("kvguard_control_engine_processes == 1")
                    .await
                    .ok()?
                    == 1)
                    .then_some(())
            },
        )
        .await
        .unwrap();
        let root = kvguard_integration::paths::repo_root().unwrap();
        let dash: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(root.join("envoy-config/grafana/kvguard-dashboard.json"))
                .unwrap(),
        )
        .unwrap();
        let instance = st.control.admin.to_string();
        let queries = prom::dashboard_queries(&dash, &[("instance", &instance)]);
        for panel in ENGINE_PANELS {
            let q = queries.iter().find(|q| q.panel == panel).unwrap();
            assert_eq!(
                p.result_len(&q.expr).await.unwrap(),
                1,
                "{panel}: {}",
                q.expr
            );
        }
        assert_eq!(
            p.result_len("kvguard_control_engine_process_open_fds > 3")
                .await
                .unwrap(),
            1
        );
        assert_eq!(
            p.result_len("kvguard_control_engine_process_resident_memory_bytes > 1e6")
                .await
                .unwrap(),
            1
        );
        let a = o
            .wait_firing("KvguardAbortsFailing", &[], t0, Duration::from_secs(90))
            .await;
        leavers.abort();
        let a = a.unwrap_or_else(|e| panic!("{e:#}\n{}", st.logs(30)));
        assert!(
            ["failed", "dispatch_error"].contains(&a["outcome"].as_str().unwrap_or("")),
            "{a}"
        );
        // The out-of-band renewals go to the same (closed) control cluster and fail; the
        // in-band ones, over the inference path, land: the admin path is down, the lease
        // holds.
        o.wait_firing(
            "KvguardLeaseAdminPathDown",
            &[],
            t0,
            Duration::from_secs(60),
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", st.logs(30)));
        assert!(
            !o.seen
                .alerts
                .iter()
                .any(|m| m.name == "KvguardLeaseRenewalsFailing"),
            "KvguardLeaseRenewalsFailing although the in-band renewals land"
        );
        // kvguard-control gone: its target is down (scaled `for:` 5 s).
        st.control.kill().unwrap();
        let m = o
            .wait_firing(
                "KvguardScrapeMissing",
                &[("job", "kvguard-control")],
                t0,
                Duration::from_secs(60),
            )
            .await
            .unwrap();
        eprintln!("{}{m}", observe::timeline(&o.seen.alerts));
        drop(st);
    })
    .await
    .unwrap();
}

/// One streaming completion through `entry` whose client leaves after its first body
/// bytes (the filter then sends an abort).
async fn leave_a_stream(entry: std::net::SocketAddr) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = r#"{"model":"tiny","prompt":"abcd","stream":true,"max_tokens":400}"#;
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let Ok(mut s) = tokio::net::TcpStream::connect(entry).await else {
        return;
    };
    if s.write_all(req.as_bytes()).await.is_err() {
        return;
    }
    // Headers and the first chunk, then gone.
    let mut buf = vec![0u8; 4096];
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("data: ") {
        match tokio::time::timeout(std::time::Duration::from_secs(10), s.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => seen.extend_from_slice(&buf[..n]),
            _ => return,
        }
    }
    drop(s);
}
