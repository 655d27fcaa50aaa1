//! The real `kvguard-control` binary: bad flags exit 64 naming the flag; the bound ports
//! are read back from its log line and its `--addr-file`; SIGTERM drains; idle RSS bound.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use kvguard_integration::client;
use kvguard_integration::proc::ChildGuard;
use kvguard_integration::stall::StallMark;
use kvguard_integration::wait::{bounded, poll_until_async};
use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_kvguard-control");

/// Idle RSS budget of the service (issue: < 30 MB).
const IDLE_RSS_LIMIT: u64 = 30 * 1024 * 1024;

fn run_bad(args: &[&str], envs: &[(&str, &str)]) -> (i32, String) {
    let mut c = Command::new(BIN);
    // Should a bad flag be accepted, the service must not take a real port.
    c.args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for (k, v) in envs {
        c.env(k, v);
    }
    let mut child = c.spawn().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("{args:?} {envs:?}: still running after 10 s (flag accepted?)");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    (out.status.code().unwrap_or(-1), text)
}

#[test]
fn bad_flags_exit_64_naming_the_flag() {
    for (args, envs, flag) in [
        (&["--max-age", "soon"][..], &[][..], "--max-age"),
        (&["--advertise", "pod.local:9902"], &[], "--advertise"),
        (&["--engine-url", "https://x"], &[], "--engine-url"),
        (&["--abort-strategy", "magic"], &[], "--abort-strategy"),
        (&["--no-such-flag"], &[], "--no-such-flag"),
        (&[], &[("KVGUARD_IDLE_TIMEOUT", "nope")], "--idle-timeout"),
        (&[], &[("KVGUARD_SECRET", "short")], "KVGUARD_SECRET"),
    ] {
        let (code, err) = run_bad(args, envs);
        assert_eq!(code, 64, "{args:?} {envs:?}: {err}");
        assert!(err.contains(flag), "{args:?} {envs:?}: {err}");
    }
    let (code, out) = run_bad(&["--help"], &[]);
    assert_eq!(code, 0, "{out}");
}

fn parse_listening(log: &str) -> (SocketAddr, SocketAddr) {
    let line = log
        .lines()
        .find(|l| l.contains("kvguard-control listening"))
        .unwrap();
    let field = |k: &str| -> SocketAddr {
        let start = line.find(&format!("{k}=")).unwrap() + k.len() + 1;
        line[start..]
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    (field("proxy"), field("admin"))
}

fn vmrss(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    kvguard_control::procfs::parse_vmrss(&s).unwrap()
}

#[tokio::test]
async fn real_binary_serves_reports_idle_rss_and_drains_on_sigterm() {
    bounded("test", Duration::from_secs(60), async {
        let sim = sim(slow_sim()).await;
        let dir = tempfile_dir();
        let addr_file = dir.join("addrs.json");
        let mut cmd = Command::new(BIN);
        cmd.args([
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--engine-url",
            &sim.url(),
            "--addr-file",
            addr_file.to_str().unwrap(),
        ])
        // Flags as KVGUARD_<NAME> variables.
        .env("KVGUARD_SAMPLE_INTERVAL", "200ms")
        .env("KVGUARD_DRAIN_TIMEOUT", "10s")
        .env("KVGUARD_SECRET", std::str::from_utf8(KEY).unwrap())
        .env("KVGUARD_LOG_FORMAT", "text");
        let (mut child, proxy, admin) = spawn_listening(cmd).await;
        let j: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&addr_file).unwrap()).unwrap();
        assert_eq!(j["proxy"], proxy.to_string());
        assert_eq!(j["admin"], admin.to_string());
        poll_until_async("readyz", T, Duration::from_millis(50), || async {
            (client::get(admin, "/readyz").await.ok()?.status == 200).then_some(())
        })
        .await
        .unwrap();
        // Idle RSS after start-up and a few samples: a memory bound, not a timing one.
        let rss = vmrss(child.pid());
        eprintln!("kvguard-control idle VmRSS: {} KiB", rss / 1024);
        assert!(
            rss < IDLE_RSS_LIMIT,
            "idle RSS {} KiB over the budget",
            rss / 1024
        );
        // A signed abort with the key from KVGUARD_SECRET works against the binary.
        let (status, _) = abort(admin, "bin-unknown", "operator").await;
        assert_eq!(status, 404);
        // SIGTERM while a stream runs: it finishes (drain), then the process exits 0.
        let mut s = client::stream_sse(
            proxy,
            "/v1/completions",
            &completion(20),
            &[("x-request-id", "bin-drain")],
            false,
        )
        .await
        .unwrap();
        s.next_data(Duration::from_secs(5)).await.unwrap().unwrap();
        child.signal(libc_sigterm()).unwrap();
        let ev = s.collect(Duration::from_secs(10)).await.unwrap();
        assert!(
            ev.last().unwrap().is_done(),
            "the stream finished during the drain: {ev:?}"
        );
        let status = child
            .wait_exit_async(Duration::from_secs(10))
            .await
            .unwrap();
        assert!(status.success(), "{status}; log:\n{}", child.log_tail(40));
        assert!(child.log().contains("kvguard-control stopped"));
    })
    .await
    .unwrap();
}

/// Writes `text` as `name` the way Kubernetes updates a Secret volume: a new timestamped
/// directory, then `..data` swapped to it by a rename; `name` is a symlink through `..data`.
fn k8s_secret_write(dir: &std::path::Path, name: &str, text: &str, gen: u32) {
    let data = dir.join(format!("..gen-{gen}"));
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(data.join(name), text).unwrap();
    let tmp = dir.join("..data_tmp");
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(format!("..gen-{gen}"), &tmp).unwrap();
    std::fs::rename(&tmp, dir.join("..data")).unwrap();
    let link = dir.join(name);
    if std::fs::symlink_metadata(&link).is_err() {
        std::os::unix::fs::symlink(format!("..data/{name}"), &link).unwrap();
    }
}

const OLD: &[u8] = KEY;
const NEW: &[u8] = b"kvguard-new-key-0123456789";

async fn abort_with(admin: SocketAddr, id: &str, k: &[u8]) -> u16 {
    let key = kvguard_contract::Key::try_new(k).unwrap();
    let body = serde_json::json!({"request_id": id, "reason": "operator"});
    abort_signed(admin, &body, Some(&key), now_unix()).await.0
}

/// The stamp of a proxied response, verified against one key.
async fn stamp_signed_by(proxy: SocketAddr, id: &str, k: &[u8]) -> bool {
    let r = client::request(
        proxy,
        hyper::Method::POST,
        "/v1/completions",
        &[("x-request-id", id), ("content-type", "application/json")],
        serde_json::to_vec(&completion(1)).unwrap(),
        false,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let v = r.header("x-kvguard-control").unwrap().to_owned();
    let key = kvguard_contract::Key::try_new(k).unwrap();
    let rid = kvguard_contract::RequestId::try_new(id.as_bytes()).unwrap();
    kvguard_contract::stamp::verify(&[key], v.as_bytes(), &rid).is_ok()
}

#[tokio::test]
async fn keys_rotate_without_a_restart_json_logs_and_sigint() {
    bounded("test", Duration::from_secs(60), async {
        let sim = sim(slow_sim()).await;
        let dir = tempfile_dir().join("rotation");
        let _ = std::fs::remove_dir_all(&dir);
        let (secrets, stamp) = (dir.join("secrets"), dir.join("stamp"));
        std::fs::create_dir_all(&secrets).unwrap();
        std::fs::create_dir_all(&stamp).unwrap();
        let old = String::from_utf8(OLD.to_vec()).unwrap();
        let new = String::from_utf8(NEW.to_vec()).unwrap();
        k8s_secret_write(&secrets, "keys", &format!("# the old key only\n{old}\n"), 1);
        k8s_secret_write(&stamp, "key", &format!("{old}\n"), 1);
        let mut cmd = Command::new(BIN);
        cmd.args([
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--engine-url",
            &sim.url(),
            "--log-format",
            "json",
            "--secret-file",
            secrets.join("keys").to_str().unwrap(),
            "--stamp-key-file",
            stamp.join("key").to_str().unwrap(),
            "--advertise",
            "127.0.0.1:9902",
            "--no-nvml",
        ]);
        let mut child = ChildGuard::spawn("kvguard-control-json", cmd).unwrap();
        let log = child
            .wait_for_log("kvguard-control listening", Duration::from_secs(10))
            .await
            .unwrap();
        let line = log
            .lines()
            .find(|l| l.contains("kvguard-control listening"))
            .unwrap();
        let j: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(j["level"], "INFO");
        assert_eq!(j["keys"], 1);
        let (proxy, admin) = parse_listening(j["message"].as_str().unwrap());
        assert_eq!(abort_with(admin, "r0", NEW).await, 401);
        assert!(stamp_signed_by(proxy, "s0", OLD).await);
        // 1. Add the new key (symlink swap, no signal): accepted once the file is re-read.
        k8s_secret_write(&secrets, "keys", &format!("{new}\n{old}\n"), 2);
        poll_until_async(
            "new key accepted",
            Duration::from_secs(10),
            Duration::from_millis(100),
            || async {
                (abort_with(admin, &format!("r{}", now_unix()), NEW).await == 404).then_some(())
            },
        )
        .await
        .unwrap();
        assert_eq!(
            abort_with(admin, "r-old", OLD).await,
            404,
            "the old key still works"
        );
        // 3. Switch signing: the stamp file names the new key.
        k8s_secret_write(&stamp, "key", &format!("{new}\n"), 2);
        poll_until_async(
            "stamps signed by the new key",
            Duration::from_secs(10),
            Duration::from_millis(100),
            || async {
                stamp_signed_by(proxy, &format!("s{}", now_unix()), NEW)
                    .await
                    .then_some(())
            },
        )
        .await
        .unwrap();
        // 4. Remove the old key.
        k8s_secret_write(&secrets, "keys", &format!("{new}\n"), 3);
        poll_until_async(
            "old key refused",
            Duration::from_secs(10),
            Duration::from_millis(100),
            || async {
                (abort_with(admin, &format!("o{}", now_unix()), OLD).await == 401).then_some(())
            },
        )
        .await
        .unwrap();
        // A broken file keeps the keys in use.
        k8s_secret_write(&secrets, "keys", "short\n", 4);
        poll_until_async(
            "reload error counted",
            Duration::from_secs(10),
            Duration::from_millis(100),
            || async {
                metric(admin, "kvguard_control_key_reloads_total{result=\"error\"}")
                    .await
                    .filter(|v| *v >= 1.0)
            },
        )
        .await
        .unwrap();
        assert_eq!(abort_with(admin, "r-after-error", NEW).await, 404);
        // SIGHUP re-reads the files at once, changed or not (here: the broken file again).
        let errors = metric(admin, "kvguard_control_key_reloads_total{result=\"error\"}")
            .await
            .unwrap();
        child.signal(1).unwrap();
        poll_until_async(
            "SIGHUP reload",
            Duration::from_secs(10),
            Duration::from_millis(50),
            || async {
                metric(admin, "kvguard_control_key_reloads_total{result=\"error\"}")
                    .await
                    .filter(|v| *v > errors)
            },
        )
        .await
        .unwrap();
        assert!(
            child.ensure_running().is_ok(),
            "SIGHUP does not end the process"
        );
        child.signal(2).unwrap();
        let status = child
            .wait_exit_async(Duration::from_secs(10))
            .await
            .unwrap();
        assert!(status.success(), "{status}");
    })
    .await
    .unwrap();
}

/// SIGHUP never ends the process: not during start-up (the handler is main's first
/// instruction), not without a key file (nothing to reload: it says so).
#[tokio::test]
async fn sighup_never_ends_the_process_from_start_up_on_and_is_logged() {
    bounded("test", Duration::from_secs(60), async {
        let sim = sim(slow_sim()).await;
        let dir = tempfile_dir().join("hup");
        std::fs::create_dir_all(&dir).unwrap();
        // A FIFO as the engine's key file holds start-up inside the configuration: the
        // process reads it after main's first lines and before it binds anything.
        let fifo = dir.join("engine-key");
        let _ = std::fs::remove_file(&fifo);
        let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
        assert!(made.success());
        let mut cmd = Command::new(BIN);
        cmd.args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
            .args(["--engine-url", &sim.url(), "--no-nvml"])
            .arg("--engine-api-key-file")
            .arg(&fifo)
            .env("KVGUARD_LOG_FORMAT", "text");
        let mut child = ChildGuard::spawn("kvguard-control", cmd).unwrap();
        // Opening the FIFO to write returns once the process has opened it to read.
        let path = fifo.clone();
        let mut w = tokio::task::spawn_blocking(move || {
            std::fs::OpenOptions::new().write(true).open(path).unwrap()
        })
        .await
        .unwrap();
        child.signal(1).unwrap();
        use std::io::Write;
        w.write_all(b"engine-api-key\n").unwrap();
        drop(w);
        child
            .wait_for_log("kvguard-control listening", Duration::from_secs(10))
            .await
            .unwrap();
        child.signal(1).unwrap();
        child
            .wait_for_log("SIGHUP: nothing to reload", Duration::from_secs(10))
            .await
            .unwrap();
        assert!(child.ensure_running().is_ok(), "SIGHUP ended the process");
        child.signal(libc_sigterm()).unwrap();
        let status = child
            .wait_exit_async(Duration::from_secs(10))
            .await
            .unwrap();
        assert!(status.success(), "{status}; log:\n{}", child.log_tail(40));
    })
    .await
    .unwrap();
}

/// The real binary with `KVGUARD_SECRET` and the simulator; its (proxy, admin) addresses.
async fn start_binary(engine: &str, extra: &[&str]) -> (ChildGuard, SocketAddr, SocketAddr) {
    let mut cmd = Command::new(BIN);
    cmd.args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .args([
            "--engine-url",
            engine,
            "--no-nvml",
            "--sample-interval",
            "200ms",
        ])
        .args(extra)
        .env("KVGUARD_SECRET", std::str::from_utf8(KEY).unwrap())
        .env("KVGUARD_LOG_FORMAT", "text");
    spawn_listening(cmd).await
}

/// Spawns `cmd` (the binary) and reads its (proxy, admin) addresses from its log.
async fn spawn_listening(cmd: Command) -> (ChildGuard, SocketAddr, SocketAddr) {
    let mut child = ChildGuard::spawn("kvguard-control", cmd).unwrap();
    let log = child
        .wait_for_log("kvguard-control listening", Duration::from_secs(10))
        .await
        .unwrap();
    let (proxy, admin) = parse_listening(&log);
    (child, proxy, admin)
}

/// Work on the admin port is limited per request, not per connection: 300 keep-alive
/// clients sending a request a second each (more than the old 256 connection slots) hold
/// no slot between requests, and a new connection's `/healthz` and a signed abort each
/// answer within 1 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn admin_answers_probes_and_aborts_within_a_second_beside_300_keep_alive_clients() {
    bounded("test", Duration::from_secs(90), async {
        let sim = sim(slow_sim()).await;
        let (mut child, _proxy, admin) = start_binary(&sim.url(), &[]).await;
        let load = KeepAliveClients::spawn(admin, 300, Duration::from_secs(1));
        poll_until_async(
            "every client answered once",
            Duration::from_secs(30),
            Duration::from_millis(100),
            || async {
                (load.started.load(std::sync::atomic::Ordering::Acquire) >= 300).then_some(())
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}; failures: {:?}", load.failed.lock().unwrap()));
        let mut slowest = Duration::ZERO;
        // Over 1 s only by the time the test or the binary waited for a CPU (the cores
        // are shared): `stall::within`'s credit.
        let within_a_second = |what: String, took: Duration, mark: &StallMark| {
            if took > Duration::from_secs(1) {
                let (credit, said) = mark.since();
                assert!(
                    took <= Duration::from_secs(1) + credit,
                    "{what}: {took:?} (credit {credit:?}: {said})"
                );
            }
        };
        for round in 0..5 {
            let mark = StallMark::control(child.pid());
            let t0 = std::time::Instant::now();
            let health = client::request(
                admin,
                hyper::Method::GET,
                "/healthz",
                &[],
                Vec::new(),
                false,
                Duration::from_secs(5),
            )
            .await
            .unwrap();
            assert_eq!(health.status, 200);
            within_a_second(format!("round {round}: /healthz"), t0.elapsed(), &mark);
            let mark = StallMark::control(child.pid());
            let t1 = std::time::Instant::now();
            let (status, _) = abort(admin, &format!("probe-abort-{round}"), "operator").await;
            assert_eq!(status, 404, "round {round}");
            within_a_second(format!("round {round}: signed abort"), t1.elapsed(), &mark);
            slowest = slowest.max(t1 - t0).max(t1.elapsed());
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        eprintln!("slowest probe or abort beside 300 keep-alive clients: {slowest:?}");
        let failed = load.stop().await;
        assert!(failed.is_empty(), "keep-alive clients failed: {failed:?}");
        assert!(child.ensure_running().is_ok());
    })
    .await
    .unwrap();
}

/// The reaper credits a stall of the process to every stream: the binary stopped
/// (SIGSTOP) for `--idle-timeout` + 1 s while streams flow cuts none of them once it runs
/// again (what the engine sent meanwhile waited in socket buffers), and a stream that is
/// really silent is still ended `stalled`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopped_process_cuts_no_flowing_stream_and_still_ends_a_silent_one() {
    bounded("test", Duration::from_secs(90), async {
        let sim = sim(slow_sim()).await;
        let idle = Duration::from_secs(1);
        let (mut child, proxy, admin) = start_binary(&sim.url(), &["--idle-timeout", "1s"]).await;
        let mut flowing = Vec::new();
        for i in 0..24 {
            let mut s = long_completion(proxy, &format!("flow-{i}")).await;
            s.next_data(Duration::from_secs(5)).await.unwrap().unwrap();
            flowing.push(s);
        }
        let mut silent = client::stream_sse(
            proxy,
            "/v1/completions",
            &completion(400),
            &[("x-request-id", "silent"), ("x-sim-stall-after", "3")],
            false,
        )
        .await
        .unwrap();
        for _ in 0..3 {
            silent
                .next_data(Duration::from_secs(5))
                .await
                .unwrap()
                .unwrap();
        }
        child.signal(19).unwrap(); // SIGSTOP
                                   // The stop is what is tested: it lasts past the idle timeout.
        tokio::time::sleep(idle + Duration::from_secs(1)).await;
        child.signal(18).unwrap(); // SIGCONT
        for (i, s) in flowing.iter_mut().enumerate() {
            let ev = s.read_events(20, Duration::from_secs(10)).await.unwrap();
            let cut = ev.iter().find(|e| e.event.as_deref() == Some("error"));
            assert!(cut.is_none(), "flow-{i} was cut: {cut:?}");
        }
        let ev = silent.collect(Duration::from_secs(10)).await.unwrap();
        let last = ev.last().and_then(|e| e.json()).unwrap_or_default();
        assert_eq!(last["error"]["reason"], "stalled", "{ev:?}");
        assert!(metric(admin, "kvguard_control_reaper_stalls_total").await >= Some(1.0));
        drop((flowing, silent));
        child.signal(libc_sigterm()).unwrap();
        let _ = child.wait_exit_async(Duration::from_secs(15)).await;
    })
    .await
    .unwrap();
}

fn libc_sigterm() -> i32 {
    15
}

fn tempfile_dir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kvguard-control-test-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}
