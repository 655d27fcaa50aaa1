//! A silent client behind a real Envoy with small buffers back-pressures the stream: the
//! engine keeps generating (as vLLM does) but Envoy stops reading the upstream early.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvguard_integration::client;
use kvguard_integration::envoy::{Envoy, EnvoyOptions};
use kvguard_integration::sim::{self, EndKind, SimConfig};
use kvguard_integration::wait::bounded;
use serde_json::json;
use std::time::Duration;

const T: Duration = Duration::from_secs(90);
const W: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_client_back_pressures_through_envoy() {
    bounded("back-pressure", T, async {
        let sim = sim::spawn(SimConfig {
            token_rate: 4000.0,
            ..SimConfig::default()
        })
        .await
        .unwrap();
        let mut opts = EnvoyOptions::new(sim.addr());
        opts.per_connection_buffer_limit_bytes = Some(16 * 1024);
        opts.downstream_sndbuf = Some(16 * 1024);
        let envoy = Envoy::start(opts).await.unwrap();
        let body = json!({"prompt": "x", "stream": true, "max_tokens": 2000});
        let silent = client::silent_client(
            envoy.listener_addr(),
            "/v1/completions",
            &body,
            &[],
            4096,
            true,
        )
        .await
        .unwrap();
        assert_eq!(silent.status(), Some(200));
        let st = sim
            .wait_state("generation done", W, |s| {
                s.requests.first().is_some_and(|r| r.ended.is_some())
            })
            .await
            .unwrap();
        let r = &st.requests[0];
        assert_eq!(
            r.ended,
            Some(EndKind::Length),
            "the engine finishes regardless"
        );
        // ~2000 chunks of ~200 bytes were generated and the kernel took them (loopback
        // socket buffers are large), but Envoy paused reading the upstream: what it read
        // (so what a filter could see) stayed a fraction of it.
        let total: f64 = 2000.0 * 200.0;
        let paused = envoy
            .stat("cluster.upstream.upstream_flow_control_paused_reading_total")
            .await
            .unwrap()
            .unwrap();
        let rx = envoy
            .stat("cluster.upstream.upstream_cx_rx_bytes_total")
            .await
            .unwrap()
            .unwrap();
        eprintln!(
            "engine delivered {} bytes, envoy read {rx}, paused {paused} times",
            r.bytes_delivered
        );
        assert!(paused >= 1.0);
        assert!(rx < total / 2.0, "envoy read {rx} bytes");
        // A reading client gets everything.
        let mut s = client::stream_sse(envoy.listener_addr(), "/v1/completions", &body, &[], false)
            .await
            .unwrap();
        let all = s.collect_bytes(W).await.unwrap();
        let st = sim.state();
        assert_eq!(st.requests[1].bytes_delivered as usize, all.len());
        drop(silent);
    })
    .await
    .unwrap();
}
