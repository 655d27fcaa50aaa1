//! The mass-stall valve in a real Envoy: 20 streams on one worker go idle at the same
//! moment (an engine-wide pause a little longer than the idle timeout of 1 s). `max(8, 20 %)` = 8 are closed
//! and aborted at once; the other 12 are held one more idle window, the pause ends within
//! it, and they reach `[DONE]`. Late, never "every stream reset".
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "filter_support.rs"]
mod support;

use kvguard_integration::client;
use kvguard_integration::envoy::Envoy;
use kvguard_integration::receiver::{self, ReceiverConfig};
use kvguard_integration::wait::bounded;
use serde_json::json;
use std::time::Duration;
use support::*;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::sync::watch;

const STREAMS: usize = 20;

/// An upstream whose SSE streams send 2 events, a 3rd when `gate` reaches 1 (all at
/// once), then nothing until `gate` reaches 2 (the pause), then 3 more and `[DONE]`.
async fn pausing_upstream(
    gate: watch::Receiver<u8>,
) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let task = tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let mut gate = gate.clone();
            tokio::spawn(async move {
                let Ok(_) = read_head(&mut s).await else {
                    return;
                };
                let head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n";
                if s.write_all(head).await.is_err() {
                    return;
                }
                for i in 0..7 {
                    match i {
                        2 => {
                            let _ = gate.wait_for(|g| *g >= 1).await;
                        }
                        3 => {
                            let _ = gate.wait_for(|g| *g >= 2).await;
                        }
                        _ => {}
                    }
                    let ev = if i == 6 {
                        "data: [DONE]\n\n".to_owned()
                    } else {
                        format!("data: {{\"t\":{i}}}\n\n")
                    };
                    if s.write_all(format!("{:x}\r\n{ev}\r\n", ev.len()).as_bytes())
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                let _ = s.write_all(b"0\r\n\r\n").await;
                let _ = s.shutdown().await;
            });
        }
    });
    (addr, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mass_stall_is_late_not_every_stream_reset() {
    bounded("mass stall", T, async {
        let (gate_tx, gate_rx) = watch::channel(0u8);
        let (up, task) = pausing_upstream(gate_rx).await;
        let recv = receiver::spawn(ReceiverConfig::new(vec![key()]))
            .await
            .unwrap();
        let envoy = Envoy::start(options(up, recv.addr(), json!({"idle_timeout_ms": 1000})))
            .await
            .unwrap();
        let mut streams = Vec::new();
        for i in 0..STREAMS {
            let mut s = client::stream_sse(
                envoy.listener_addr(),
                "/v1/completions",
                &completion(8, true),
                &[],
                i % 2 == 1,
            )
            .await
            .unwrap();
            assert_eq!(s.read_events(2, W).await.unwrap().len(), 2);
            streams.push(s);
        }
        // Every stream's last event at the same moment, then the pause.
        gate_tx.send(1).unwrap();
        for s in &mut streams {
            assert_eq!(s.read_events(1, W).await.unwrap().len(), 1);
        }
        // 8 close after the idle timeout; the other 12 are held.
        let calls = recv.wait_for_calls(8, W).await.unwrap();
        envoy
            .wait_stat("kvguard_filter_stall_holds_total", W, |v| v == 12.0)
            .await
            .unwrap();
        assert!(calls
            .iter()
            .all(|c| c.abort.as_ref().unwrap().reason.as_str() == "stalled"));
        // Each stall is put to the abort endpoint first; the 8 answered close at the next
        // tick.
        envoy
            .wait_stat("kvguard_filter_streams_closed_total", W, |v| v == 8.0)
            .await
            .unwrap();
        // The pause ends inside the hold (which runs to about 2 s after the last event):
        // the held streams go on to [DONE].
        gate_tx.send(2).unwrap();
        let mut done = 0;
        for s in &mut streams {
            let ev = s.collect(W).await.unwrap_or_default();
            if ev.last().is_some_and(|e| e.is_done()) {
                done += 1;
            }
        }
        assert_eq!(done, STREAMS - 8, "the held streams reached [DONE]");
        recv.expect_no_more_calls(8, Duration::from_millis(1500))
            .await
            .unwrap();
        assert_eq!(envoy.log().matches("mass stall:").count(), 1, "logged once");
        assert_vm_healthy(&envoy);
        task.abort();
    })
    .await
    .unwrap();
}
