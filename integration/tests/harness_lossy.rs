//! The lossy hop reproduces the leak: a client disconnect does not reach the engine.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvguard_integration::client;
use kvguard_integration::envoy::{Envoy, EnvoyOptions};
use kvguard_integration::lossy::{self, LossyConfig};
use kvguard_integration::proc::ChildGuard;
use kvguard_integration::sim::{self, EndKind, SeqState, SimConfig};
use kvguard_integration::{paths, wait::bounded};
use serde_json::json;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);
const W: Duration = Duration::from_secs(15);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_behind_lossy_hop_leaks_until_the_end() {
    bounded("lossy hop leak", T, async {
        let sim = sim::spawn(SimConfig {
            token_rate: 100.0,
            ..SimConfig::default()
        })
        .await
        .unwrap();
        for upstream_http2 in [false, true] {
            let hop = lossy::spawn(LossyConfig {
                listen: None,
                upstream: sim.addr(),
                upstream_http2,
            })
            .await
            .unwrap();
            let id = format!("leak-{upstream_http2}");
            let mut s = client::stream_sse(
                hop.addr(),
                "/v1/completions",
                &json!({"prompt": "x", "stream": true, "max_tokens": 300}),
                &[("x-request-id", &id)],
                false,
            )
            .await
            .unwrap();
            s.read_events(2, W).await.unwrap();
            s.disconnect();
            let stats = kvguard_integration::wait::poll_until(
                "hop notices",
                W,
                Duration::from_millis(10),
                || {
                    let st = hop.stats();
                    (st.clients_gone == 1).then_some(st)
                },
            )
            .await
            .unwrap();
            assert_eq!(stats.requests, 1);
            // The engine never hears of it: the sequence runs to max_tokens.
            let r = sim.state().request(&id).unwrap().clone();
            assert_eq!(r.state, SeqState::Running);
            let st = sim
                .wait_state("leaked one ends", W, |s| {
                    s.request(&id).unwrap().ended.is_some()
                })
                .await
                .unwrap();
            let r = st.request(&id).unwrap();
            assert_eq!(r.ended, Some(EndKind::Length));
            assert!(!r.client_gone);
            assert_eq!(r.tokens_sent, 300);
            kvguard_integration::wait::poll_until(
                "hop drained",
                W,
                Duration::from_millis(10),
                || (hop.stats().upstream_completed == 1).then_some(()),
            )
            .await
            .unwrap();
            assert!(hop.stats().bytes_after_client_gone > 0);
        }
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lossy_hop_binary_behind_envoy_passes_streams_and_ids() {
    bounded("lossy-hop binary", T, async {
        let sim = sim::spawn(SimConfig::default()).await.unwrap();
        let up = sim.addr().to_string();
        let (_hop, hop_addr) = ChildGuard::spawn_with_addr_file("lossy-hop", paths::lossy_hop_bin().unwrap(), ["--upstream", up.as_str()], &[], W)
            .await
            .unwrap();
        let envoy = Envoy::start(EnvoyOptions::new(hop_addr)).await.unwrap();
        for http2 in [false, true] {
            let mut s = client::stream_sse(envoy.listener_addr(), "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "x"}], "stream": true, "max_tokens": 4}), &[], http2)
                .await
                .unwrap();
            let ev = s.collect(W).await.unwrap();
            assert!(ev.last().unwrap().is_done());
            let st = sim.state();
            let rec = st.requests.last().unwrap();
            assert_eq!(ev[0].json().unwrap()["id"], format!("chatcmpl-{}", rec.request_id));
        }
        // Behind Envoy + lossy hop a disconnect leaks as well.
        let mut s = client::stream_sse(envoy.listener_addr(), "/v1/completions", &json!({"prompt": "x", "stream": true, "max_tokens": 400}), &[("x-sim-rate", "50")], false)
            .await
            .unwrap();
        s.read_events(1, W).await.unwrap();
        s.disconnect();
        tokio::time::sleep(Duration::from_millis(300)).await; // the leak must still be there
        let st = sim.state();
        assert_eq!(st.running.len(), 1, "{st:?}");
        assert_eq!(st.clients_gone, 0);
    })
    .await
    .unwrap();
}
