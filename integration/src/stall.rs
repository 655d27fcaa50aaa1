//! Latency bounds that hold against the time the processes under test could run.
//!
//! On a small shared machine (CI has two cores, with vLLM generating on one) a process is
//! sometimes not scheduled for seconds. A bound such as "vLLM frees the sequence within
//! 2 s of the disconnect" then fails for a reason that is not the product's. [`within`]
//! checks a bound and credits it with the stalls *measured* meanwhile, and only with those:
//!
//! - this process's own: a thread sleeps [`METER_PERIOD`] in a loop and adds up every
//!   wake-up later than [`METER_GRACE`] beyond it, the one still to come included
//!   ([`process_stalls`]);
//! - kvguard-control's ([`StallMark::control`]): a task asks its `/healthz` one call after
//!   another and adds up how much later than [`ANSWER_GRACE`] each answer came, the call
//!   still waiting included. kvguard-control serves `/healthz` on the runtime that takes
//!   abort calls and closes engine connections: an answer it could not give is an abort it
//!   could not carry out.
//!
//! The credit is the larger of the two (a stall of the whole machine shows in both) and at
//! most [`MAX_CREDIT`]. A product slower than the bound on a machine that did not stall
//! still fails, and a failure says how much credit it had.

use anyhow::{bail, Result};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long the meter thread sleeps between looks.
pub const METER_PERIOD: Duration = Duration::from_millis(10);
/// Lateness of a wake-up that is still scheduling noise, not a stall.
pub const METER_GRACE: Duration = Duration::from_millis(50);
/// How long kvguard-control may take to answer `/healthz` before the rest is a stall.
pub const ANSWER_GRACE: Duration = Duration::from_millis(250);
/// The pause between two `/healthz` calls.
pub const PING_EVERY: Duration = Duration::from_millis(50);
/// The most a bound is ever extended by.
pub const MAX_CREDIT: Duration = Duration::from_secs(30);

/// The meter's reading: the lateness added up, and when it last woke.
struct Meter {
    stalled: Duration,
    woke: Instant,
}

static METER: OnceLock<Option<Arc<Mutex<Meter>>>> = OnceLock::new();

/// How long this process has stalled since the meter started (it starts on the first call,
/// and runs for the rest of the process). A stall still going on, as far as the meter
/// thread has not woken since, counts too: read just after the process runs again, the
/// figure already holds the stall.
pub fn process_stalls() -> Duration {
    let meter = METER.get_or_init(|| {
        let m = Arc::new(Mutex::new(Meter {
            stalled: Duration::ZERO,
            woke: Instant::now(),
        }));
        let m2 = m.clone();
        let spawned = std::thread::Builder::new()
            .name("stall-meter".into())
            .spawn(move || loop {
                std::thread::sleep(METER_PERIOD);
                let now = Instant::now();
                let mut g = lock(&m2);
                let late = lateness(now.saturating_duration_since(g.woke));
                g.stalled += late;
                g.woke = now;
            });
        match spawned {
            Ok(_) => Some(m),
            Err(e) => {
                eprintln!("stall meter: cannot start its thread ({e}); no stall is credited");
                None
            }
        }
    });
    meter.as_ref().map_or(Duration::ZERO, |m| {
        let g = lock(m);
        g.stalled + lateness(g.woke.elapsed())
    })
}

/// The part of a gap between two wake-ups of the meter that was a stall.
fn lateness(gap: Duration) -> Duration {
    let late = gap.saturating_sub(METER_PERIOD);
    if late > METER_GRACE {
        late
    } else {
        Duration::ZERO
    }
}

/// What the `/healthz` calls to kvguard-control found.
#[derive(Debug, Default)]
struct Pings {
    /// Lateness of the answers so far.
    late: Duration,
    /// When the call now waiting was made.
    waiting_since: Option<Instant>,
    answered: u32,
    failed: u32,
}

/// Measures stalls from a moment on, to credit a bound with them. Take it just before the
/// event the bound starts from; dropping it stops its `/healthz` calls.
#[derive(Debug)]
pub struct StallMark {
    process: Duration,
    control: Option<(Arc<Mutex<Pings>>, tokio::task::JoinHandle<()>)>,
}

impl Drop for StallMark {
    fn drop(&mut self) {
        if let Some((_, task)) = &self.control {
            task.abort();
        }
    }
}

impl StallMark {
    /// This process's stalls only.
    pub fn process() -> StallMark {
        StallMark {
            process: process_stalls(),
            control: None,
        }
    }

    /// This process's stalls and those of the kvguard-control on `admin` (its admin
    /// listener), on the current tokio runtime.
    pub fn control(admin: SocketAddr) -> StallMark {
        let pings = Arc::new(Mutex::new(Pings::default()));
        let p = pings.clone();
        let task = tokio::spawn(async move {
            loop {
                let asked = Instant::now();
                lock(&p).waiting_since = Some(asked);
                let r =
                    tokio::time::timeout(MAX_CREDIT, crate::client::get(admin, "/healthz")).await;
                let late = asked.elapsed().saturating_sub(ANSWER_GRACE);
                {
                    let mut g = lock(&p);
                    g.waiting_since = None;
                    match r {
                        Ok(Ok(_)) => {
                            g.answered += 1;
                            g.late += late;
                        }
                        // Not an answer: no measure of a stall (a stopped kvguard-control
                        // is the test's to notice).
                        _ => g.failed += 1,
                    }
                }
                tokio::time::sleep(PING_EVERY).await;
            }
        });
        StallMark {
            process: process_stalls(),
            control: Some((pings, task)),
        }
    }

    /// The stalls measured since the mark: the credit, and how it was made up.
    pub fn since(&self) -> (Duration, String) {
        let process = process_stalls().saturating_sub(self.process);
        let mut said = format!("this process stalled {process:?}");
        let mut credit = process;
        if let Some((pings, _)) = &self.control {
            let g = lock(pings);
            let waiting = g
                .waiting_since
                .map_or(Duration::ZERO, |t| t.elapsed().saturating_sub(ANSWER_GRACE));
            let c = g.late + waiting;
            said.push_str(&format!(
                ", kvguard-control answered /healthz {c:?} late in all ({} answers, {} failed calls)",
                g.answered, g.failed
            ));
            credit = credit.max(c);
        }
        (credit.min(MAX_CREDIT), said)
    }
}

fn lock<T>(p: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    p.lock().unwrap_or_else(|e| e.into_inner())
}

/// Polls `probe` every `interval` until it returns `Some`, for at most `bound` after
/// `from`, extended by the stalls measured since `mark` (looked at when the bound has run
/// out, then each time the extension has). A probe still running at the deadline is cut
/// there. The error names `what`, the bound and the credit.
pub async fn within<T, F, Fut>(
    what: &str,
    from: Instant,
    bound: Duration,
    mark: &StallMark,
    interval: Duration,
    mut probe: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let mut deadline = from + bound;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if let Ok(v) = crate::wait::poll_until_async(what, left, interval, &mut probe).await {
            return Ok(v);
        }
        let (credit, said) = mark.since();
        let extended = from + bound + credit;
        if Instant::now() >= extended {
            bail!(
                "{what}: not within {bound:?} (+{credit:?} credited for stalls measured meanwhile: {said})"
            );
        }
        deadline = extended;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_bound_without_stalls_fails_and_says_its_credit() {
        let mark = StallMark::process();
        let t0 = Instant::now();
        let e = within(
            "never",
            t0,
            Duration::from_millis(200),
            &mark,
            Duration::from_millis(20),
            || async { None::<()> },
        )
        .await
        .unwrap_err();
        let msg = format!("{e:#}");
        assert!(msg.contains("never: not within 200ms"), "{msg}");
        assert!(msg.contains("credited for stalls"), "{msg}");
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    }

    #[tokio::test]
    async fn a_stall_of_this_process_is_measured_and_credited() {
        let mark = StallMark::process();
        let t0 = Instant::now();
        // Every thread of the process is stopped for 1 s, the meter's too. The resuming
        // child starts first (a stopped process cannot start it), and says CONT twice.
        let pid = std::process::id().to_string();
        let mut cont = std::process::Command::new("sh")
            .args([
                "-c",
                &format!("sleep 1; kill -CONT {pid}; sleep 1; kill -CONT {pid}"),
            ])
            .spawn()
            .unwrap();
        let stopped = std::process::Command::new("kill")
            .args(["-STOP", &pid])
            .status()
            .unwrap();
        assert!(stopped.success());
        // Met 1.2 s after the start of a 500 ms bound: only the credit lets it through.
        let v = within(
            "after the stall",
            t0,
            Duration::from_millis(500),
            &mark,
            Duration::from_millis(20),
            || async { (t0.elapsed() > Duration::from_millis(1200)).then_some(()) },
        )
        .await;
        let (credit, said) = mark.since();
        let _ = cont.wait();
        assert!(credit >= Duration::from_millis(700), "{said}");
        v.unwrap();
    }
}
