//! The shipped Envoy clusters and kvguard-control agree on idle keep-alive connections:
//! every client closes an idle connection before the server does, so a request never
//! meets a connection kvguard-control is closing (a reset before headers: a 503 or a
//! spent attempt).
//!
//! - Statically: the idle timeout of every cluster towards kvguard-control in the shipped
//!   configs (envoy-config/envoy/{edge,local}.yaml, the Istio EnvoyFilter,
//!   DestinationRules and the modelled istiod output) is below kvguard-control's
//!   keep-alive idle on that port, and so is the peers' pool idle.
//! - Driven: a real Envoy with the shipped clusters' idle timeouts in front of the real
//!   kvguard-control, requests on both ports with gaps on either side of the client's idle
//!   timeout and between it and the server's, for `KVGUARD_IDLE_SOAK_SECS` (default 45 s;
//!   docs/TESTING.md has a 5-minute run): every answer 200, Envoy saw no connection closed
//!   by kvguard-control and no reset, and closed idle ones itself.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvguard_integration::client;
use kvguard_integration::demo::stack::Control;
use kvguard_integration::envoy::{Envoy, EnvoyOptions, CONTROL_CLUSTER, UPSTREAM_CLUSTER};
use kvguard_integration::paths::repo_root;
use kvguard_integration::sim::{self, SimConfig};
use kvguard_integration::wait::bounded;
use serde_json::json;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// kvguard-control's keep-alive idle on each port (its head-read deadline, counted from
/// the end of the previous answer).
const PROXY_IDLE: Duration = kvguard_control::server::HEADER_READ_TIMEOUT;
const ADMIN_IDLE: Duration = kvguard_control::admin::HEAD_READ_TIMEOUT;

/// The `idle_timeout` (seconds) of the cluster named `cluster` in a shipped Envoy YAML:
/// the first one after its `name:` line, before the next item at the same indentation or
/// less (the next cluster, the next EnvoyFilter patch). `None`: it has none.
fn cluster_idle_timeout(yaml: &str, cluster: &str) -> Option<Option<u64>> {
    let mut lines = yaml.lines();
    let start = lines.by_ref().find(|l| {
        let t = l.trim_start().trim_start_matches("- ");
        t == format!("name: {cluster}")
    })?;
    let ind = start.len() - start.trim_start().len();
    for line in lines {
        let t = line.trim_start();
        if t.starts_with("- ") && line.len() - t.len() <= ind {
            break;
        }
        if let Some(v) = t.strip_prefix("idle_timeout: ") {
            return Some(v.trim().strip_suffix('s').and_then(|n| n.parse().ok()));
        }
    }
    Some(None)
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo_root().unwrap().join(rel)).unwrap()
}

/// The idle timeout of `cluster` in the shipped file `rel`; fails when it has none
/// (Envoy's default, 1 h, is above the server's).
fn shipped_idle(rel: &str, cluster: &str) -> Duration {
    let idle = cluster_idle_timeout(&read(rel), cluster)
        .unwrap_or_else(|| panic!("{rel}: no cluster {cluster}"));
    Duration::from_secs(idle.unwrap_or_else(|| {
        panic!("{rel}: cluster {cluster} has no idle_timeout (Envoy's default 1 h)")
    }))
}

/// `idleTimeout` of the DestinationRule for `host` in the shipped Istio routing.
fn destination_rule_idle(host: &str) -> Duration {
    let text = read("envoy-config/istio/routing.yaml");
    let doc = text
        .split("\n---")
        .find(|d| d.contains("kind: DestinationRule") && d.contains(&format!("host: {host}")))
        .unwrap_or_else(|| panic!("no DestinationRule for {host}"));
    let v = doc
        .lines()
        .find_map(|l| l.trim().strip_prefix("idleTimeout: "))
        .unwrap_or_else(|| panic!("DestinationRule {host}: no idleTimeout (Envoy's default 1 h)"));
    Duration::from_secs(v.trim_end_matches('s').parse().unwrap())
}

#[test]
fn every_shipped_client_closes_an_idle_connection_before_kvguard_control() {
    let proxy_side = [
        ("envoy-config/envoy/edge.yaml", "engine"),
        ("envoy-config/envoy/local.yaml", "engine"),
        (
            "envoy-config/validate/istio-gateway-base.yaml",
            "outbound|8001||vllm-kvguard.inference.svc.cluster.local",
        ),
    ];
    let admin_side = [
        ("envoy-config/envoy/edge.yaml", "kvguard_control"),
        ("envoy-config/envoy/edge.yaml", "kvguard_control_replica"),
        ("envoy-config/envoy/local.yaml", "kvguard_control"),
        (
            "envoy-config/istio/envoyfilter.yaml",
            "kvguard_control_replica",
        ),
        (
            "envoy-config/validate/istio-gateway-base.yaml",
            "outbound|9902||kvguard-control-admin.inference.svc.cluster.local",
        ),
    ];
    for (rel, cluster) in proxy_side {
        let idle = shipped_idle(rel, cluster);
        assert!(
            idle < PROXY_IDLE,
            "{rel} {cluster}: {idle:?} not below {PROXY_IDLE:?}"
        );
    }
    for (rel, cluster) in admin_side {
        let idle = shipped_idle(rel, cluster);
        assert!(
            idle < ADMIN_IDLE,
            "{rel} {cluster}: {idle:?} not below {ADMIN_IDLE:?}"
        );
    }
    assert!(destination_rule_idle("vllm-kvguard.inference.svc.cluster.local") < PROXY_IDLE);
    assert!(
        destination_rule_idle("kvguard-control-admin.inference.svc.cluster.local") < ADMIN_IDLE
    );
    assert!(kvguard_control::peers::POOL_IDLE < ADMIN_IDLE);
}

/// The cluster's `typed_extension_protocol_options` with the shipped idle timeout.
fn with_idle(cluster: &mut serde_json::Value, idle: Duration) {
    cluster["typed_extension_protocol_options"] = json!({
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "common_http_protocol_options": {"idle_timeout": format!("{}s", idle.as_secs())},
            "explicit_http_config": {"http_protocol_options": {}}
        }
    });
}

/// Sends a request every gap of `gaps` (cycled) until `until`; every answer must be 200.
async fn drive(
    envoy: SocketAddr,
    path: &'static str,
    body: Option<serde_json::Value>,
    gaps: Vec<Duration>,
    until: Instant,
) -> u32 {
    let mut n = 0;
    for gap in gaps.iter().cycle() {
        let r = match &body {
            Some(b) => client::post_json(envoy, path, b, &[]).await.unwrap(),
            None => client::get(envoy, path).await.unwrap(),
        };
        assert_eq!(r.status, 200, "{path} request {n}: {}", r.text());
        n += 1;
        if Instant::now() + *gap >= until {
            break;
        }
        tokio::time::sleep(*gap).await;
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_idle_timeouts_see_no_reset_for_minutes() {
    let secs: u64 = std::env::var("KVGUARD_IDLE_SOAK_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(45);
    let run = Duration::from_secs(secs);
    bounded("test", run + Duration::from_secs(60), async {
        let engine_idle = shipped_idle("envoy-config/envoy/edge.yaml", "engine");
        let control_idle = shipped_idle("envoy-config/envoy/edge.yaml", "kvguard_control");
        let sim = sim::spawn(SimConfig::default()).await.unwrap();
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        let ctl = Control::start(sim.addr(), any, any, &[]).await.unwrap();
        let mut opts = EnvoyOptions::new(ctl.proxy);
        opts.control = Some(ctl.admin);
        opts.patch = Some(Arc::new(move |b: &mut serde_json::Value| {
            for c in b["static_resources"]["clusters"].as_array_mut().unwrap() {
                match c["name"].as_str() {
                    Some(UPSTREAM_CLUSTER) => with_idle(c, engine_idle),
                    Some(CONTROL_CLUSTER) => with_idle(c, control_idle),
                    _ => {}
                }
            }
            // Admin traffic through Envoy's control cluster, as a gateway's aborts and
            // renewals go.
            let routes = &mut b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"]
                [0]["typed_config"]["route_config"]["virtual_hosts"][0]["routes"];
            routes.as_array_mut().unwrap().insert(
                0,
                json!({"match": {"prefix": "/v1/engine"}, "route": {"cluster": CONTROL_CLUSTER}}),
            );
        }));
        let envoy = Envoy::start(opts).await.unwrap();
        let at = envoy.listener_addr();
        let until = Instant::now() + run;
        let s = Duration::from_secs;
        // Gaps just inside and just past the client's idle timeout, and between it and
        // the server's (where the old settings raced).
        let proxy_gaps = vec![
            engine_idle - s(1),
            engine_idle + s(1),
            (engine_idle + PROXY_IDLE) / 2,
            s(1),
        ];
        let admin_gaps = vec![
            control_idle - s(1),
            control_idle + s(1),
            (control_idle + ADMIN_IDLE) / 2,
            s(1),
        ];
        let completion = json!({"model": "tiny", "prompt": "idle", "max_tokens": 4});
        let (np, na) = tokio::join!(
            drive(at, "/v1/completions", Some(completion), proxy_gaps, until),
            drive(at, "/v1/engine", None, admin_gaps, until),
        );
        let stats = envoy.stats().await.unwrap();
        let stat = |c: &str, n: &str| {
            stats
                .get(&format!("cluster.{c}.{n}"))
                .copied()
                .unwrap_or(0.0)
        };
        for c in [UPSTREAM_CLUSTER, CONTROL_CLUSTER] {
            eprintln!(
                "{c}: cx_total {} idle_timeout {} destroy_remote {} rq_5xx {}",
                stat(c, "upstream_cx_total"),
                stat(c, "upstream_cx_idle_timeout"),
                stat(c, "upstream_cx_destroy_remote"),
                stat(c, "upstream_rq_5xx")
            );
            assert_eq!(
                stat(c, "upstream_cx_destroy_remote"),
                0.0,
                "{c}: kvguard-control closed a connection Envoy kept"
            );
            assert_eq!(stat(c, "upstream_rq_5xx"), 0.0, "{c}");
            assert_eq!(
                stat(c, "upstream_cx_destroy_remote_with_active_rq"),
                0.0,
                "{c}"
            );
            assert!(
                stat(c, "upstream_cx_idle_timeout") >= 1.0,
                "{c}: Envoy closed no idle connection itself"
            );
        }
        eprintln!("{np} proxy and {na} admin requests over {run:?}: no reset");
    })
    .await
    .unwrap();
}
