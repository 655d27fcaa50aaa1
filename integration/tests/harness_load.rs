//! The load generator counts what it does, and its storm mode really disconnects.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvguard_integration::load::{self, LoadConfig, LoadSummary, Percentiles};
use kvguard_integration::proc::ChildGuard;
use kvguard_integration::sim::{self, SimConfig};
use kvguard_integration::{paths, wait::bounded};
use std::time::Duration;

const T: Duration = Duration::from_secs(90);

#[test]
fn percentiles_nearest_rank() {
    let p = Percentiles::of((1..=100).map(f64::from).collect());
    assert_eq!(
        (p.n, p.p50, p.p90, p.p99, p.max),
        (100, 50.0, 90.0, 99.0, 100.0)
    );
    assert_eq!(Percentiles::of(vec![]), Percentiles::default());
    assert_eq!(Percentiles::of(vec![7.0]).p99, 7.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_load_counts_add_up_and_the_engine_agrees() {
    bounded("mixed load", T, async {
        let sim = sim::spawn(SimConfig {
            token_rate: 400.0,
            ..SimConfig::default()
        })
        .await
        .unwrap();
        let mut cfg = LoadConfig::new(sim.addr());
        cfg.requests = 60;
        cfg.concurrency = 20;
        cfg.rate = 200.0;
        cfg.max_tokens = 20;
        cfg.disconnect_share = 0.3;
        cfg.silent_share = 0.1;
        cfg.silent_hold = Duration::from_secs(2);
        let s = load::run(cfg).await;
        assert_eq!(s.errors, 0, "{s:?}");
        assert_eq!(s.started, 60);
        assert_eq!(
            s.completed + s.disconnected + s.silent + s.truncated,
            60,
            "{s:?}"
        );
        assert!(s.disconnected > 5 && s.silent > 0, "{s:?}");
        assert!(s.ttfb_ms.n >= s.completed && s.ttfb_ms.p99 > 0.0, "{s:?}");
        assert!(s.inter_event_ms.n > 0, "{s:?}");
        let st = sim
            .wait_state("engine idle", Duration::from_secs(20), |st| st.is_idle())
            .await
            .unwrap();
        // Every stream ended one way or the other. A client that disconnects near the end
        // may lose the race with the engine finishing, so only bounds hold exactly.
        assert_eq!((st.finished + st.disconnected) as usize, 60, "{st:?}");
        assert!(
            st.finished as usize >= s.completed + s.silent,
            "{s:?} {st:?}"
        );
        assert!(st.disconnected as usize <= s.disconnected, "{s:?} {st:?}");
        assert!(st.disconnected > 0);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storm_binary_disconnects_all_within_the_window_queued_ones_too() {
    bounded("storm", T, async {
        let sim = sim::spawn(SimConfig {
            token_rate: 20.0,
            max_running: 200,
            ..SimConfig::default()
        })
        .await
        .unwrap();
        let target = sim.addr().to_string();
        let mut g = ChildGuard::spawn_program(
            "kvguard-load",
            paths::load_bin().unwrap(),
            [
                "--target",
                target.as_str(),
                "--storm",
                "300",
                "--storm-window-ms",
                "1000",
                "--max-tokens",
                "100",
                "--stream-timeout-s",
                "20",
                "--http2",
            ],
            &[],
        )
        .unwrap();
        let status = g.wait_exit_async(Duration::from_secs(60)).await.unwrap();
        assert!(status.success(), "{}", g.log());
        let log = g.log();
        let summary: LoadSummary = serde_json::from_str(&log[log.find('{').unwrap()..]).unwrap();
        assert_eq!(summary.disconnected, 300, "{summary:?}");
        assert!(summary.storm_spread_s.unwrap() < 3.0, "{summary:?}");
        let st = sim
            .wait_state("all aborted", Duration::from_secs(20), |s| s.is_idle())
            .await
            .unwrap();
        assert_eq!(st.disconnected, 300, "running and queued ones alike");
        let never_admitted = st
            .requests
            .iter()
            .filter(|r| r.started_ms.is_none())
            .count();
        assert!(
            never_admitted > 0,
            "some were still queued when their client left"
        );
        assert_eq!(st.blocks_used, 0);
    })
    .await
    .unwrap();
}
