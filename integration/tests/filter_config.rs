//! The kvguard filter's configuration and metrics in a real Envoy: a bad configuration
//! is refused (Envoy does not start, the log names the field); the metric names as Envoy
//! shows them in `/stats` and `/stats/prometheus`, with and without the `stats_tags`
//! documented in `filter/README.md`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "filter_support.rs"]
mod support;

use kvguard_integration::client;
use kvguard_integration::envoy::Envoy;
use kvguard_integration::sim::{self, SimConfig};
use kvguard_integration::wait::bounded;
use serde_json::{json, Value};
use std::time::Duration;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_configuration_is_refused_and_named() {
    bounded("bad config", T, async {
        let sim = sim::spawn(SimConfig::default()).await.unwrap();
        let dead = dead_port().await;
        let cases: Vec<(Value, &str, bool)> = vec![
            (
                json!({"idle_timeout_ms": "abc"}),
                "idle_timeout_ms: expected an integer 0..=86400000 (0 = off), got \"abc\"",
                true,
            ),
            (
                json!({"idle_timeout": 5}),
                "unknown field `idle_timeout`",
                true,
            ),
            (
                json!({"mode": "block"}),
                "mode: expected \"enforce\" or \"observe\"",
                true,
            ),
            (
                json!({"control_target_cidrs": ["10.0.0.1/8"], "control_target_cluster": "x"}),
                "control_target_cidrs[0]",
                true,
            ),
            // The secret variable is missing from the VM environment.
            (
                json!({}),
                "secret_env: environment variable \"KVGUARD_SECRET\" is not set",
                false,
            ),
        ];
        for (extra, needle, with_secret) in cases {
            let mut o = options(sim.addr(), dead, extra.clone());
            if !with_secret {
                o.vm_env.clear();
            }
            o.ready_timeout = Duration::from_secs(30);
            let err = match Envoy::start(o).await {
                Ok(e) => panic!("Envoy started with {extra}:\n{}", e.log()),
                Err(e) => format!("{e:#}"),
            };
            // The harness keeps a failed Envoy's bootstrap directory for debugging; this
            // failure is expected, so remove it.
            if let Some(dir) = err
                .split("bootstrap kept at ")
                .nth(1)
                .and_then(|r| r.split("/bootstrap.yaml").next())
            {
                if dir.starts_with(&std::env::temp_dir().display().to_string()) {
                    let _ = std::fs::remove_dir_all(dir);
                }
            }
            assert!(
                err.contains("kvguard: invalid configuration"),
                "{extra}: {err}"
            );
            let shown: Vec<&str> = err
                .lines()
                .filter(|l| l.contains("kvguard") || l.contains("critical") || l.contains("nable"))
                .collect();
            eprintln!("{extra} ->\n{}", shown.join("\n"));
            assert!(
                err.contains(needle),
                "{extra}: wanted {needle:?} in:\n{err}"
            );
        }
    })
    .await
    .unwrap();
}

/// The `stats_tags` block documented in `filter/README.md`.
fn stats_tags() -> Value {
    json!({"stats_tags": [
        {"tag_name": "reason", "regex": "(_reason=\\.=(.+?);\\.;)"},
        {"tag_name": "outcome", "regex": "(_outcome=\\.=(.+?);\\.;)"},
        {"tag_name": "route", "regex": "(_route=\\.=(.+?);\\.;)"},
        {"tag_name": "cause", "regex": "(_cause=\\.=(.+?);\\.;)"},
        {"tag_name": "kind", "regex": "(_kind=\\.=(.+?);\\.;)"}
    ]})
}

async fn one_abort_and_dump(with_tags: bool) -> (String, String) {
    let r = rig_with(
        SimConfig {
            token_rate: 20.0,
            ..SimConfig::default()
        },
        json!({}),
        |o| {
            let prev = o.patch.clone();
            o.patch = Some(std::sync::Arc::new(move |b: &mut Value| {
                if let Some(p) = &prev {
                    p(b);
                }
                if with_tags {
                    b["stats_config"] = stats_tags();
                }
            }));
        },
    )
    .await;
    let mut s = client::stream_sse(
        r.envoy.listener_addr(),
        "/v1/completions",
        &completion(1000, true),
        &[],
        false,
    )
    .await
    .unwrap();
    s.read_events(2, W).await.unwrap();
    s.disconnect();
    r.recv.wait_for_calls(1, W).await.unwrap();
    r.envoy
        .wait_stat(&aborts("downstream_reset", "aborted"), W, |v| v == 1.0)
        .await
        .unwrap_or_else(|e| panic!("{e}: {:?}", futures_stats(&r)));
    let stats = client::get(r.envoy.admin_addr(), "/stats?filter=kvguard")
        .await
        .unwrap()
        .text();
    let prom = client::get(r.envoy.admin_addr(), "/stats/prometheus")
        .await
        .unwrap()
        .text();
    let prom: String = prom
        .lines()
        .filter(|l| l.contains("kvguard"))
        .map(|l| format!("{l}\n"))
        .collect();
    (stats, prom)
}

fn futures_stats(r: &Rig) -> String {
    r.envoy
        .log()
        .lines()
        .filter(|l| l.contains("kvguard"))
        .take(50)
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metric_names_in_stats_and_prometheus() {
    bounded("metric names", T, async {
        let (stats, prom) = one_abort_and_dump(false).await;
        eprintln!("--- /stats (no stats_tags) ---\n{stats}\n--- /stats/prometheus (no stats_tags) ---\n{prom}");
        // Envoy puts custom wasm metrics in the `wasmcustom.` namespace.
        assert!(
            stats.contains("wasmcustom.kvguard_filter_aborts_total_reason=.=downstream_reset;.;_outcome=.=aborted;.;: 1"),
            "{stats}"
        );
        assert!(stats.contains("wasmcustom.kvguard_filter_requests_tracked_total: 1"), "{stats}");

        let (stats, prom_tagged) = one_abort_and_dump(true).await;
        eprintln!("--- /stats (stats_tags) ---\n{stats}\n--- /stats/prometheus (stats_tags) ---\n{prom_tagged}");
        assert!(
            prom_tagged.contains("kvguard_filter_aborts_total{reason=\"downstream_reset\",outcome=\"aborted\"} 1")
                || prom_tagged.contains("kvguard_filter_aborts_total{outcome=\"aborted\",reason=\"downstream_reset\"} 1"),
            "{prom_tagged}"
        );
        assert!(prom_tagged.contains("kvguard_filter_requests_tracked_total 1") || prom_tagged.contains("kvguard_filter_requests_tracked_total{} 1"), "{prom_tagged}");
        assert!(prom_tagged.contains("kvguard_filter_active_requests"), "{prom_tagged}");
        assert!(!prom_tagged.contains("wasmcustom"), "the namespace is stripped: {prom_tagged}");
        // Every metric is defined at configure time, so every family exists from the start.
        for (family, kind) in [
            ("kvguard_filter_requests_tracked_total", "counter"),
            ("kvguard_filter_requests_untracked_total", "counter"),
            ("kvguard_filter_requests_completed_total", "counter"),
            ("kvguard_filter_active_requests", "gauge"),
            ("kvguard_filter_aborts_total", "counter"),
            ("kvguard_filter_pending_aborts", "gauge"),
            ("kvguard_filter_abort_attempts_total", "counter"),
            ("kvguard_filter_abort_routes_total", "counter"),
            ("kvguard_filter_stamp_rejected_total", "counter"),
            ("kvguard_filter_parse_anomalies_total", "counter"),
            ("kvguard_filter_would_abort_total", "counter"),
            ("kvguard_filter_streams_closed_total", "counter"),
            ("kvguard_filter_vm_memory_bytes", "gauge"),
            ("kvguard_filter_host_errors_total", "counter"),
        ] {
            assert!(prom_tagged.contains(&format!("# TYPE {family} {kind}\n")), "{family}: {prom_tagged}");
        }
        for labelled in [
            "kvguard_filter_requests_untracked_total{cause=\"no_request_id\"} 0",
            "kvguard_filter_requests_untracked_total{cause=\"bad_request_id\"} 0",
            "kvguard_filter_abort_routes_total{route=\"replica\"} 0",
            "kvguard_filter_stamp_rejected_total{cause=\"outside_cidrs\"} 0",
            "kvguard_filter_parse_anomalies_total{kind=\"oversized_event\"} 0",
            "kvguard_filter_would_abort_total{reason=\"stalled\"} 0",
            "kvguard_filter_aborts_total{reason=\"max_age\",outcome=\"failed\"} 0",
        ] {
            assert!(prom_tagged.contains(labelled), "{labelled}: {prom_tagged}");
        }
        // The per-request histograms carry `outcome` through the same stats_tags entry
        // (issue 12.5): the aborted request's duration is in the `aborted` histogram.
        assert!(
            prom_tagged.contains("# TYPE kvguard_filter_stream_duration_ms histogram\n"),
            "{prom_tagged}"
        );
        assert!(
            prom_tagged
                .lines()
                .any(|l| l.starts_with("kvguard_filter_stream_duration_ms_bucket{outcome=\"aborted\",le=")),
            "{prom_tagged}"
        );
        assert!(
            !prom_tagged.contains("_outcome___"),
            "a histogram label left in a name: {prom_tagged}"
        );
        // Without stats_tags the labels stay in the (sanitised) name.
        assert!(
            prom.contains("kvguard_filter_aborts_total_reason___downstream_reset____outcome___aborted___{} 1"),
            "{prom}"
        );
    })
    .await
    .unwrap();
}
