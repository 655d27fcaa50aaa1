//! Envoy stopped (SIGTERM) with 300 live streams through Envoy + kvguard → lossy hop →
//! kvguard-control → simulator, then started again.
//!
//! Documented behaviour: the clients' streams end with Envoy (SIGTERM: Envoy exits in
//! ~0.1 s); the filter's VM goes away with the process and sends no abort for them (measured:
//! 0 of 300); the lossy hop keeps their engine side alive, and kvguard-control's max-age
//! backstop (6 s here, 15 min by default) ends them: no sequence is left behind. A new
//! Envoy serves at once.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "filter_support.rs"]
mod support;

use kvguard_integration::client;
use kvguard_integration::demo::stack::{self, Stack, StackOptions};
use kvguard_integration::envoy::{Envoy, EnvoyOptions};
use kvguard_integration::sim::{self, SimConfig};
use kvguard_integration::wait::bounded;
use std::time::Duration;
use support::{chat, T, W};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_stopped_mid_storm_leaves_no_orphan() {
    bounded("envoy restart", T, async {
        let engine = sim::spawn(SimConfig {
            token_rate: 10.0,
            max_running: 1024,
            kv_blocks: 32768,
            ..SimConfig::default()
        })
        .await
        .unwrap();
        let mut so = StackOptions::new(engine.addr(), Some(stack::filter_config(0, 0)));
        so.buffer_limit = None;
        so.control_args = vec![
            "--max-age".into(),
            "6s".into(),
            "--idle-timeout".into(),
            "off".into(),
        ];
        let mut st = Stack::start(so).await.unwrap();
        let entry = st.entry();
        let mut set = tokio::task::JoinSet::new();
        for i in 0..300 {
            set.spawn(async move {
                let mut s =
                    client::stream_sse(entry, "/v1/chat/completions", &chat(1000), &[], i % 2 == 0)
                        .await
                        .unwrap();
                s.next_data(W).await.unwrap().unwrap();
                s
            });
        }
        let mut live = Vec::new();
        while let Some(s) = set.join_next().await {
            live.push(s.unwrap());
        }
        let s0 = engine.state();
        eprintln!(
            "before the stop: running {} waiting {} requests {} ended {:?}",
            s0.running.len(),
            s0.waiting.len(),
            s0.requests.len(),
            s0.requests
                .iter()
                .filter_map(|r| r.ended)
                .take(3)
                .collect::<Vec<_>>()
        );
        if let Some(r) = s0.requests.iter().find(|r| r.ended.is_some()) {
            eprintln!("an early end: {r:?}");
        }
        assert_eq!(s0.running.len(), 300);
        let t0 = std::time::Instant::now();
        let (status, graceful) = st.envoy.guard().terminate(Duration::from_secs(10)).unwrap();
        eprintln!(
            "envoy exited {status:?} (graceful {graceful}) in {:?}",
            t0.elapsed()
        );
        // Every client's stream ends with it (none hangs), none completed.
        for mut s in live {
            let end = s
                .wait_end(W)
                .await
                .unwrap_or_else(|e| panic!("a stream outlived Envoy: {e:#}"));
            assert!(!end.saw_done(), "{end:?}");
        }
        // No sequence is left behind: aborts the filter got out, the max-age backstop for the rest.
        engine
            .wait_state("every sequence ended", Duration::from_secs(30), |s| {
                s.running.is_empty()
            })
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n{}", st.control.log()));
        let by_reason = st.control.aborts_by_reason().await.unwrap();
        eprintln!(
            "kvguard-control ended them by reason: {by_reason:?} ({:?} after the stop)",
            t0.elapsed()
        );
        // A fresh Envoy before the same hop serves at once.
        let up = st.hop.as_ref().unwrap().addr();
        let mut eo = EnvoyOptions::with_filter(up, st.control.admin, stack::filter_config(0, 0))
            .vm_env("KVGUARD_SECRET", stack::SECRET);
        eo.access_log = false;
        let envoy2 = Envoy::start(eo).await.unwrap();
        let mut s = client::stream_sse(
            envoy2.listener_addr(),
            "/v1/chat/completions",
            &chat(3),
            &[],
            false,
        )
        .await
        .unwrap();
        let end = s.wait_end(W).await.unwrap();
        assert!(end.completed(), "{end:?}");
    })
    .await
    .unwrap();
}
