#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#[path = "filter_support.rs"]
mod support;
use kvguard_integration::client;
use kvguard_integration::demo::stack::{self, Stack, StackOptions};
use kvguard_integration::sim::{self, SimConfig};
use std::time::{Duration, Instant};
use support::{chat, W};

async fn open(entry: std::net::SocketAddr, n: usize) -> Vec<client::SseStream> {
    let mut set = tokio::task::JoinSet::new();
    for i in 0..n {
        set.spawn(async move {
            let mut s = client::stream_sse(entry, "/v1/chat/completions", &chat(1000), &[], i % 2 == 0).await.unwrap();
            s.next_data(W).await.unwrap().unwrap();
            s
        });
    }
    let mut live = Vec::new();
    while let Some(s) = set.join_next().await {
        live.push(s.unwrap());
    }
    live
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe() {
    for target in ["control", "hop", "envoy"] {
        let engine = sim::spawn(SimConfig { token_rate: 10.0, max_running: 1024, kv_blocks: 8192, ..SimConfig::default() }).await.unwrap();
        let mut so = StackOptions::new(engine.addr(), Some(stack::filter_config(0, 0)));
        so.buffer_limit = None;
        so.control_args = vec!["--max-age".into(), "60s".into(), "--idle-timeout".into(), "off".into()];
        let st = Stack::start(so).await.unwrap();
        let entry = match target { "control" => st.control.proxy, "hop" => st.hop.as_ref().unwrap().addr(), _ => st.entry() };
        let t0 = Instant::now();
        let live = open(entry, 300).await;
        let s = engine.state();
        eprintln!("{target}: opened in {:?}: running {} waiting {} ended {}", t0.elapsed(), s.running.len(), s.waiting.len(), s.requests.iter().filter(|r| r.ended.is_some()).count());
        tokio::time::sleep(Duration::from_secs(3)).await;
        let s = engine.state();
        eprintln!("{target}: +3 s: running {} ended {}", s.running.len(), s.requests.iter().filter(|r| r.ended.is_some()).count());
        drop(live);
    }
}
