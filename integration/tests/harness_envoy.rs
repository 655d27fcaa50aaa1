//! A real plain Envoy (no filter) in front of the simulator, started by `Envoy::start`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvguard_integration::client;
use kvguard_integration::envoy::{self, Envoy, EnvoyOptions};
use kvguard_integration::sim::{self, EndKind, SimConfig};
use kvguard_integration::wait::bounded;
use serde_json::json;
use std::time::Duration;

const T: Duration = Duration::from_secs(90);
const W: Duration = Duration::from_secs(15);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_envoy_streams_http1_and_h2c_and_mints_ids() {
    bounded("plain envoy", T, async {
        let sim = sim::spawn(SimConfig::default()).await.unwrap();
        let envoy = Envoy::start(EnvoyOptions::new(sim.addr())).await.unwrap();
        for (i, http2) in [false, true].into_iter().enumerate() {
            let body = json!({"messages": [{"role": "user", "content": "hi"}], "stream": true, "max_tokens": 8,
                "stream_options": {"include_usage": true}});
            let mine = format!("client-chosen-{i}");
            let mut s = client::stream_sse(envoy.listener_addr(), "/v1/chat/completions", &body, &[("x-request-id", &mine)], http2)
                .await
                .unwrap();
            assert_eq!(s.status, 200);
            let events = s.collect(W).await.unwrap();
            assert_eq!(events.len(), 1 + 8 + 1 + 1, "{events:?}");
            assert!(events.last().unwrap().is_done());
            // The edge minted a fresh id; the client's one did not reach the engine.
            let st = sim.state();
            let rec = st.requests.last().unwrap();
            assert_ne!(rec.request_id, mine);
            assert_eq!(rec.request_id.len(), 36, "a UUID: {}", rec.request_id);
            assert_eq!(events[0].json().unwrap()["id"], format!("chatcmpl-{}", rec.request_id));
            assert!(!rec.headers.contains_key("x-envoy-internal"), "{:?}", rec.headers);
        }
        let stats = envoy.stats().await.unwrap();
        assert_eq!(stats.get("cluster.upstream.upstream_rq_200"), Some(&2.0), "{stats:?}");
        assert_eq!(envoy.stat("http.ingress_http.downstream_rq_2xx").await.unwrap(), Some(2.0));
        envoy.wait_stat("http.ingress_http.downstream_rq_completed", W, |v| v >= 2.0).await.unwrap();
        assert!(envoy.log().contains("ACCESS ["), "access log in the log");
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_through_envoy_reaches_the_engine() {
    bounded("disconnect via envoy", T, async {
        let sim = sim::spawn(SimConfig {
            token_rate: 50.0,
            ..SimConfig::default()
        })
        .await
        .unwrap();
        let mut opts = EnvoyOptions::new(sim.addr());
        opts.upstream_http2 = true;
        let envoy = Envoy::start(opts).await.unwrap();
        for http2 in [false, true] {
            let mut s = client::stream_sse(
                envoy.listener_addr(),
                "/v1/completions",
                &json!({"prompt": "x", "stream": true, "max_tokens": 1000}),
                &[],
                http2,
            )
            .await
            .unwrap();
            s.read_events(2, W).await.unwrap();
            s.disconnect();
            let st = sim
                .wait_state("aborted via envoy", W, |s| s.is_idle())
                .await
                .unwrap();
            assert_eq!(
                st.requests.last().unwrap().ended,
                Some(EndKind::Disconnected)
            );
        }
        assert!(
            envoy.log().contains("downstream_remote_disconnect"),
            "{}",
            envoy.log()
        );
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoys_run_in_parallel_and_bootstrap_validates() {
    bounded("parallel envoys", T, async {
        let sim = sim::spawn(SimConfig::default()).await.unwrap();
        let mut opts = EnvoyOptions::new(sim.addr());
        opts.concurrency = 2;
        opts.control = Some(sim.addr());
        opts.original_dst_cluster = Some(envoy::CONTROL_TARGET_CLUSTER.into());
        let boot = envoy::bootstrap(&opts, None).unwrap();
        Envoy::validate(&boot).unwrap();
        let (a, b) = tokio::join!(Envoy::start(opts.clone()), Envoy::start(opts));
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_ne!(a.listener_addr(), b.listener_addr());
        assert_ne!(a.admin_addr(), b.admin_addr());
        for e in [&a, &b] {
            let r = client::post_json(
                e.listener_addr(),
                "/v1/completions",
                &json!({"prompt": "x", "max_tokens": 2}),
                &[],
            )
            .await
            .unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
        }
        let clusters = client::get(a.admin_addr(), "/clusters")
            .await
            .unwrap()
            .text();
        assert!(clusters.contains("kvguard_control::"), "{clusters}");
        assert!(
            Envoy::validate(&json!({"static_resources": {"clusters": [{"name": 1}]}})).is_err()
        );
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extra_yaml_and_patch_hooks_reach_envoy() {
    bounded("hooks", T, async {
        let sim = sim::spawn(SimConfig::default()).await.unwrap();
        let mut opts = EnvoyOptions::new(sim.addr());
        // --config-yaml is merged by Envoy: repeated fields (listeners) are appended.
        opts.extra_yaml = Some(
            r#"
static_resources:
  listeners:
  - name: extra
    address: {socket_address: {address: 127.0.0.1, port_value: 0}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: extra
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes: [{match: {prefix: "/"}, direct_response: {status: 299, body: {inline_string: extra}}}]
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}
"#
            .into(),
        );
        opts.patch = Some(std::sync::Arc::new(|b: &mut serde_json::Value| {
            b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["stat_prefix"] = json!("patched");
        }));
        let envoy = Envoy::start(opts).await.unwrap();
        let extra = envoy.listener_named("extra").await.unwrap();
        let r = client::get(extra, "/").await.unwrap();
        assert_eq!((r.status, r.text().as_str()), (299, "extra"));
        let r = client::post_json(envoy.listener_addr(), "/v1/completions", &json!({"prompt": "x", "max_tokens": 1}), &[]).await.unwrap();
        assert_eq!(r.status, 200);
        envoy.wait_stat("http.patched.downstream_rq_2xx", W, |v| v >= 1.0).await.unwrap();
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_restart_hands_the_listener_to_the_next_epoch() {
    bounded("hot restart", T, async {
        let sim = sim::spawn(SimConfig { token_rate: 10.0, ..SimConfig::default() }).await.unwrap();
        let mut opts = EnvoyOptions::new(sim.addr());
        // Not enabled: no next epoch.
        let cold = Envoy::start(opts.clone()).await.unwrap();
        assert!(cold.hot_restart_epoch().is_none());
        assert!(cold.hot_restart(opts.clone()).await.is_err());
        drop(cold);
        opts.hot_restart = true;
        opts.drain_time_s = 1;
        opts.parent_shutdown_time_s = Some(2);
        // Two families side by side: Envoy picks a free base id for each.
        let mut a0 = Envoy::start(opts.clone()).await.unwrap();
        let b0 = Envoy::start(opts.clone()).await.unwrap();
        let (base, epoch) = a0.hot_restart_epoch().unwrap();
        assert_eq!(epoch, 0);
        assert_ne!(Some(base), b0.hot_restart_epoch().map(|h| h.0));
        let shm = format!("/dev/shm/envoy_shared_memory_{}", base * 10);
        assert!(std::path::Path::new(&shm).exists(), "{shm}");
        // A stream live on epoch 0 (20 tokens at 10/s) finishes on it while it drains.
        let body = json!({"messages": [{"role": "user", "content": "hi"}], "stream": true, "max_tokens": 20});
        let mut live = client::stream_sse(a0.listener_addr(), "/v1/chat/completions", &body, &[], false).await.unwrap();
        live.next_data(W).await.unwrap().unwrap();
        let a1 = a0.hot_restart(a0.options().clone()).await.unwrap();
        assert_eq!(a1.hot_restart_epoch(), Some((base, 1)));
        assert_eq!(a1.listener_addr(), a0.listener_addr());
        // Its own admin listener (read from its own address file): on port 0 it may get the
        // parent's port back, since Envoy shuts the parent's admin down first (seen in CI).
        // That it is epoch 1's shows below: it answers after epoch 0 has exited.
        assert!(live.collect(W).await.unwrap().last().unwrap().is_done());
        // Epoch 0 exits at parent-shutdown time; epoch 1 serves on the same port.
        let t = std::time::Instant::now();
        assert!(a0.guard().wait_exit_async(W).await.unwrap().success());
        eprintln!("epoch 0 exited {:?} after the live stream ended", t.elapsed());
        let mut s = client::stream_sse(a1.listener_addr(), "/v1/chat/completions", &body, &[], true).await.unwrap();
        assert!(s.collect(W).await.unwrap().last().unwrap().is_done());
        assert_eq!(a1.stat("http.ingress_http.downstream_rq_2xx").await.unwrap().map(|v| v >= 1.0), Some(true));
        // The shared memory region goes with the last epoch of the family.
        drop(a0);
        assert!(std::path::Path::new(&shm).exists());
        drop(a1);
        assert!(!std::path::Path::new(&shm).exists(), "{shm} left behind");
    })
    .await
    .unwrap();
}
