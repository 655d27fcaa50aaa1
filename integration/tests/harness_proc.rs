//! `ChildGuard` really cleans up, the path helpers answer, and a stall of a child
//! (kvguard-control) that is not a wait for a CPU is not credited to a latency bound.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvguard_integration::demo::stack::Control;
use kvguard_integration::paths;
use kvguard_integration::proc::{ChildGuard, GroupWatchdog};
use kvguard_integration::stall::{self, StallMark};
use kvguard_integration::vllm::metric_sum;
use kvguard_integration::wait::{bounded, poll_until, poll_until_async, poll_until_blocking};
use std::process::Command;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(20);

fn alive(pid: u32) -> bool {
    // A zombie is dead for our purpose.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.split_whitespace().nth(2).is_none_or(|st| st != "Z"))
        .unwrap_or(false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_kills_the_whole_group_and_log_is_kept() {
    bounded("group kill", T, async {
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("grandchild.pid");
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg(format!(
            "echo hello; sleep 300 & echo $! > {}; wait",
            pidfile.display()
        ));
        let mut g = ChildGuard::spawn("sleeper", cmd).unwrap();
        g.wait_for_log("hello", T).await.unwrap();
        let gpid: u32 = poll_until("grandchild pid", T, Duration::from_millis(10), || {
            std::fs::read_to_string(&pidfile).ok()?.trim().parse().ok()
        })
        .await
        .unwrap();
        let pid = g.pid();
        assert!(alive(pid) && alive(gpid));
        assert!(g.is_running());
        drop(g);
        poll_until_blocking("group gone", T, Duration::from_millis(10), || {
            (!alive(gpid)).then_some(())
        })
        .unwrap();
        assert!(!alive(pid));
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminate_is_graceful_then_forced() {
    bounded("terminate", T, async {
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg("trap 'echo bye; exit 3' TERM; echo ready; while true; do sleep 0.05; done");
        let mut g = ChildGuard::spawn("polite", cmd).unwrap();
        g.wait_for_log("ready", T).await.unwrap();
        let (status, graceful) = g.terminate(T).unwrap();
        assert!(graceful);
        assert_eq!(status.code(), Some(3));
        assert!(g.log().contains("bye"));

        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg("trap '' TERM; echo ready; while true; do sleep 0.05; done");
        let mut g = ChildGuard::spawn("stubborn", cmd).unwrap();
        g.wait_for_log("ready", T).await.unwrap();
        let (_, graceful) = g.terminate(Duration::from_millis(300)).unwrap();
        assert!(!graceful);
        assert!(!g.is_running());

        let mut g = ChildGuard::spawn_program("quick", "sh", ["-c", "exit 7"], &[]).unwrap();
        assert_eq!(g.wait_exit(T).unwrap().code(), Some(7));
        assert!(g.ensure_running().is_err());
        assert!(
            g.wait_for_log("never", T).await.is_err(),
            "exited processes fail fast"
        );
    })
    .await
    .unwrap();
}

#[test]
fn paths_resolve() {
    assert!(paths::repo_root().unwrap().join("Cargo.toml").is_file());
    assert!(paths::fixture("vllm-0.32-metrics.txt").unwrap().is_file());
    assert!(paths::engine_sim_bin().unwrap().is_file());
    let target = paths::target_dir().unwrap();
    assert!(target.join("debug").is_dir(), "{}", target.display());
    // scripts/build made them; the suite needs them.
    assert!(paths::wasm_path().unwrap().is_file());
    assert!(paths::control_bin().unwrap().is_file());
}

/// Not a test: the child that `panic_prints_the_log_tail_and_still_kills` runs (with
/// `--ignored`); it panics on purpose while a guard is alive.
#[test]
#[ignore = "a probe: only panic_prints_the_log_tail_and_still_kills runs it"]
fn panic_probe() {
    assert!(
        std::env::var_os("KVGUARD_PANIC_PROBE").is_some(),
        "panic_probe runs only as the child of panic_prints_the_log_tail_and_still_kills"
    );
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg("echo probe-line-1; echo probe-line-2; sleep 300");
    let mut g = ChildGuard::spawn("probe", cmd).unwrap();
    poll_until_blocking("probe output", T, Duration::from_millis(10), || {
        g.log().contains("probe-line-2").then_some(())
    })
    .unwrap();
    let pid = g.pid();
    std::fs::write(
        std::env::var("KVGUARD_PANIC_PROBE").unwrap(),
        pid.to_string(),
    )
    .unwrap();
    assert!(g.is_running());
    panic!("probe panics on purpose");
}

#[test]
fn panic_prints_the_log_tail_and_still_kills() {
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("pid");
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe);
    child
        .args([
            "--exact",
            "panic_probe",
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("KVGUARD_PANIC_PROBE", &pidfile)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut g = ChildGuard::spawn("probe-runner", child).unwrap();
    let status = g.wait_exit(T).unwrap();
    assert!(!status.success(), "the probe must fail");
    let out = g.log();
    assert!(out.contains("----- probe (pid"), "{out}");
    assert!(out.contains("probe-line-1\nprobe-line-2"), "{out}");
    let pid: u32 = std::fs::read_to_string(&pidfile).unwrap().parse().unwrap();
    poll_until_blocking("probe child killed", T, Duration::from_millis(10), || {
        (!alive(pid)).then_some(())
    })
    .unwrap();
}

/// Not a test: the child that `children_die_with_a_test_killed_for_its_time` runs (with
/// `--ignored`): a guarded child, and a guarded child with a worker of its own under a
/// [`GroupWatchdog`] (vLLM's shape); it names the three pids and waits to be killed.
#[test]
#[ignore = "a probe: only children_die_with_a_test_killed_for_its_time runs it"]
fn kill_probe() {
    let Some(pidfile) = std::env::var_os("KVGUARD_KILL_PROBE") else {
        panic!("kill_probe runs only as the child of children_die_with_a_test_killed_for_its_time");
    };
    let mut cmd = Command::new("sleep");
    cmd.arg("300");
    let single = ChildGuard::spawn("sleeper", cmd).unwrap();
    let mut cmd = Command::new("sh");
    cmd.arg("-c").arg("sleep 300 & echo $!; wait");
    let tree = ChildGuard::spawn("tree", cmd).unwrap();
    let _watchdog = GroupWatchdog::start(tree.pid()).unwrap();
    let worker: u32 =
        poll_until_blocking("the tree's worker", T, Duration::from_millis(10), || {
            tree.log().lines().next()?.trim().parse().ok()
        })
        .unwrap();
    let pids = format!("{} {} {worker}", single.pid(), tree.pid());
    std::fs::write(pidfile, pids).unwrap();
    std::thread::sleep(Duration::from_secs(300));
}

/// A test killed for its time (nextest's slow-timeout, SIGKILL) runs no Drop; its guarded
/// children, each in a process group of its own, must die with it all the same, and so
/// must the workers of a child under a [`GroupWatchdog`].
#[test]
fn children_die_with_a_test_killed_for_its_time() {
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("pid");
    let mut runner = Command::new(std::env::current_exe().unwrap());
    runner
        .args([
            "--exact",
            "kill_probe",
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("KVGUARD_KILL_PROBE", &pidfile);
    let mut g = ChildGuard::spawn("kill-probe-runner", runner).unwrap();
    let pids: Vec<u32> = poll_until_blocking(
        "the probe names its children",
        T,
        Duration::from_millis(10),
        || {
            let text = std::fs::read_to_string(&pidfile).ok()?;
            let p: Vec<u32> = text
                .split_whitespace()
                .filter_map(|t| t.parse().ok())
                .collect();
            (p.len() == 3).then_some(p)
        },
    )
    .unwrap();
    assert!(pids.iter().all(|&p| alive(p)), "{pids:?}");
    // SIGKILL the runner alone (not its group): as a timeout kills the test process.
    assert_eq!(unsafe { libc::kill(g.pid() as i32, libc::SIGKILL) }, 0);
    g.wait_exit(T).unwrap();
    for (what, pid) in [
        "the guarded child",
        "the tree's leader",
        "the tree's worker",
    ]
    .iter()
    .zip(&pids)
    {
        poll_until_blocking(
            &format!("{what} dies with the test"),
            T,
            Duration::from_millis(10),
            || (!alive(*pid)).then_some(()),
        )
        .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_kvguard_control_is_not_credited_to_a_bound() {
    bounded("control stall", T, async {
        // No engine answers on port 9: kvguard-control runs, its scrapes fail.
        let any = "127.0.0.1:0".parse().unwrap();
        let mut c = Control::start("127.0.0.1:9".parse().unwrap(), any, any, &[])
            .await
            .unwrap();
        let admin = c.admin;
        let pid = c.pid();
        let mark = StallMark::control(pid);
        // Stopped for 2 s: not runnable, so not waiting for a CPU. A stall that is not the
        // machine's (here a signal's; in the product's case, say, a blocking call on its
        // runtime) is no credit: the bound fails.
        let from = Instant::now();
        c.guard().signal(libc::SIGSTOP).unwrap();
        // Stopped once every thread is (a group stop completes thread by thread: one
        // still running could answer the first probe).
        let tasks = format!("/proc/{pid}/task");
        kvguard_integration::wait::poll_until_blocking(
            "every thread of kvguard-control stopped",
            T,
            Duration::from_millis(2),
            || {
                let stopped = std::fs::read_dir(&tasks).ok()?.all(|t| {
                    t.ok()
                        .and_then(|t| std::fs::read_to_string(t.path().join("stat")).ok())
                        .and_then(|s| Some(s.rsplit_once(") ")?.1.starts_with(['T', 't'])))
                        .unwrap_or(false)
                });
                stopped.then_some(())
            },
        )
        .unwrap();
        let resume = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(2));
            // SAFETY: kill(2) on the child's pid.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGCONT) };
        });
        // Bound: an answer within 500 ms, not met while it is stopped.
        let e = stall::within(
            "kvguard-control answers /healthz",
            from,
            Duration::from_millis(500),
            &mark,
            Duration::from_millis(50),
            || async move {
                let r = kvguard_integration::client::get(admin, "/healthz").await;
                r.ok().filter(|r| r.status == 200)
            },
        )
        .await
        .unwrap_err();
        let msg = format!("{e:#}");
        assert!(from.elapsed() < Duration::from_secs(2), "{msg}");
        assert!(
            msg.contains("bound 0.50 s: over ") && msg.contains("NOT met (credit "),
            "{msg}"
        );
        assert!(
            msg.contains("kvguard-control run-queue wait 0.0"),
            "a stopped kvguard-control credited: {msg}"
        );
        resume.join().unwrap();
        // kvguard-control's own measure saw it too.
        let c = &c;
        poll_until_async(
            "kvguard-control counts a lease-loop stall",
            T,
            Duration::from_millis(50),
            || async move {
                let text = c.metrics_text().await.ok()?;
                let n = metric_sum(&text, "kvguard_control_lease_loop_stalls_total")?;
                (n >= 1.0).then_some(())
            },
        )
        .await
        .unwrap();
    })
    .await
    .unwrap();
}
