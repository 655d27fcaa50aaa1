//! Latency bounds credited with the time the processes under test waited for a CPU.
//!
//! On a small shared machine (CI has two cores, with vLLM generating on one) a process is
//! sometimes runnable but not scheduled for a while. A bound such as "vLLM frees the
//! sequence within 2 s of the disconnect" then fails for a reason that is not the
//! product's. [`within`] checks a bound and credits it with that wait, *measured*
//! meanwhile, and with nothing else:
//!
//! - The measure is the kernel's own: the second field of `/proc/<pid>/task/<tid>/schedstat`
//!   is the time thread `tid` spent runnable on a run queue without a CPU (ns). A
//!   [`StallMark`] reads it for every thread of this process and of each process it
//!   watches (kvguard-control: [`StallMark::control`]), and [`StallMark::since`] reads it
//!   again; the difference is the wait meanwhile.
//! - Time a process spends *not runnable* is never credited: sleeping, blocked in a
//!   syscall, stopped by a signal. A stall of kvguard-control's own making (a blocking
//!   call on its runtime, a lock held across an await) therefore counts against the bound,
//!   as it must: that is the product's bug, and the bound is there to catch it (how late
//!   kvguard-control answers a probe would credit exactly such a stall).
//! - The credit is at most [`MAX_CREDIT`]: a machine so loaded that the product waits
//!   longer for a CPU says nothing about the product either way, and a bound that stretches
//!   without limit cannot fail.
//! - A figure that cannot be read (no `/proc`, a kernel without schedstats, a process that
//!   has exited) gives no credit, never a larger one, and the line says so.
//!
//! Every check prints one line, met or not: the bound, the time it took, the credit and
//! what the credit was made of.

use anyhow::{bail, Result};
use std::collections::BTreeMap;
use std::future::Future;
use std::time::{Duration, Instant};

/// The most a bound is ever extended by.
pub const MAX_CREDIT: Duration = Duration::from_secs(3);

/// One line of `/proc/<pid>/task/<tid>/schedstat` (see the kernel's
/// `Documentation/scheduler/sched-stats.rst`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedStat {
    /// Time spent on a CPU, ns.
    pub on_cpu_ns: u64,
    /// Time spent runnable on a run queue, waiting for a CPU, ns.
    pub run_wait_ns: u64,
    /// Number of timeslices run on a CPU.
    pub timeslices: u64,
}

/// Parses a `schedstat` line: three unsigned decimal fields separated by spaces (an
/// optional trailing newline). Anything else is `None`.
pub fn parse_schedstat(line: &str) -> Option<SchedStat> {
    let mut f = line.trim_end_matches('\n').split(' ');
    let on_cpu_ns = f.next()?.parse().ok()?;
    let run_wait_ns = f.next()?.parse().ok()?;
    let timeslices = f.next()?.parse().ok()?;
    if f.next().is_some() {
        return None;
    }
    Some(SchedStat {
        on_cpu_ns,
        run_wait_ns,
        timeslices,
    })
}

/// Run-queue wait of each thread of a process, ns, by thread id.
pub type Waits = BTreeMap<u32, u64>;

/// Reads the run-queue wait of every thread of process `pid` from
/// `/proc/<pid>/task/*/schedstat`. A thread that ends while it is read is left out. An
/// error (as text, for the line) when the process's task list cannot be listed, when no
/// thread's `schedstat` can be read or parsed, or when every thread reads zero time on a
/// CPU (a kernel with the statistics off prints `0 0 0`, and so does a process still in
/// its first time slice): in each case there is no figure to credit.
pub fn read_waits(pid: u32) -> std::result::Result<Waits, String> {
    let dir = format!("/proc/{pid}/task");
    let entries = std::fs::read_dir(&dir).map_err(|e| format!("cannot list {dir}: {e}"))?;
    let mut waits = Waits::new();
    let mut on_cpu = 0u64;
    let mut last_error = None;
    for entry in entries.flatten() {
        let Some(tid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let path = entry.path().join("schedstat");
        match std::fs::read_to_string(&path) {
            Ok(text) => match parse_schedstat(&text) {
                Some(s) => {
                    waits.insert(tid, s.run_wait_ns);
                    on_cpu = on_cpu.saturating_add(s.on_cpu_ns);
                }
                None => last_error = Some(format!("{}: unparsable {text:?}", path.display())),
            },
            Err(e) => last_error = Some(format!("{}: {e}", path.display())),
        }
    }
    if waits.is_empty() {
        return Err(last_error.unwrap_or_else(|| format!("{dir} lists no thread")));
    }
    if on_cpu == 0 {
        return Err(format!(
            "{dir}/*/schedstat read 0 time on a CPU for every thread (schedstats off, or not yet descheduled)"
        ));
    }
    Ok(waits)
}

/// How long a process's runtime could not run for want of a CPU between two readings:
/// the largest growth of one thread's run-queue wait. A thread not in `mark` (started
/// since) counts from 0; one no longer in `now` (ended since) is left out, its wait lost,
/// which errs towards less credit.
///
/// The largest, not the sum: when the machine is short of CPUs, the threads of a runtime
/// (tokio's workers, say) wait for one *at the same time*, so N threads each waiting 1 s
/// held the runtime up for about 1 s of wall time, not N s; a sum would credit a process
/// in proportion to its thread count, and more than the wall time that passed. The
/// largest one thread's wait never exceeds the time between the readings, and a thread
/// that sleeps (an idle worker, blocked in `epoll_wait`) adds nothing, so it cannot inflate
/// the figure. It can still exceed the stall of the work the bound waits on (one busy
/// thread preempted while the others ran): [`MAX_CREDIT`] bounds that error.
pub fn largest_wait(mark: &Waits, now: &Waits) -> Duration {
    let ns = now
        .iter()
        .map(|(tid, w)| w.saturating_sub(mark.get(tid).copied().unwrap_or(0)))
        .max()
        .unwrap_or(0);
    Duration::from_nanos(ns)
}

/// A watched process and its threads' waits at the mark.
#[derive(Debug)]
struct Watched {
    name: String,
    pid: u32,
    at_mark: std::result::Result<Waits, String>,
}

impl Watched {
    fn new(name: &str, pid: u32) -> Watched {
        Watched {
            name: name.to_string(),
            pid,
            at_mark: read_waits(pid),
        }
    }

    /// The run-queue wait since the mark, or why there is none to credit.
    fn since(&self) -> std::result::Result<Duration, String> {
        let mark = self
            .at_mark
            .as_ref()
            .map_err(|e| format!("at the mark: {e}"))?;
        let now = read_waits(self.pid).map_err(|e| format!("at the check: {e}"))?;
        Ok(largest_wait(mark, &now))
    }
}

/// The run-queue waits of this process and of the watched ones at a moment, to credit a
/// bound with their growth from then on. Take it just before the event the bound starts
/// from.
#[derive(Debug)]
pub struct StallMark {
    /// The watched processes, this one last.
    watched: Vec<Watched>,
}

impl StallMark {
    /// This process only (for a product that runs in this process, e.g. kvguard-control
    /// started in-process, or the simulator).
    pub fn process() -> StallMark {
        StallMark {
            watched: vec![Watched::new("this process", std::process::id())],
        }
    }

    /// This process and kvguard-control, process `pid`.
    pub fn control(pid: u32) -> StallMark {
        StallMark::process().and("kvguard-control", pid)
    }

    /// Also watch process `pid`, called `name` in the line.
    pub fn and(mut self, name: &str, pid: u32) -> StallMark {
        self.watched.insert(
            self.watched.len().saturating_sub(1),
            Watched::new(name, pid),
        );
        self
    }

    /// The credit for the time since the mark, and what it was made of (e.g.
    /// `kvguard-control run-queue wait 0.12 s, this process 0.00 s`). The credit is the
    /// largest of the watched processes' waits, not their sum (a machine short of CPUs
    /// makes them wait at the same time), and at most [`MAX_CREDIT`]. A process whose wait
    /// cannot be read adds nothing, and the text says why.
    pub fn since(&self) -> (Duration, String) {
        let mut credit = Duration::ZERO;
        let mut parts = Vec::with_capacity(self.watched.len());
        for (i, w) in self.watched.iter().enumerate() {
            let label = if i == 0 {
                format!("{} run-queue wait", w.name)
            } else {
                w.name.clone()
            };
            match w.since() {
                Ok(d) => {
                    credit = credit.max(d);
                    parts.push(format!("{label} {}", secs(d)));
                }
                Err(e) => parts.push(format!("{label} unknown, credited 0 ({e})")),
            }
        }
        let mut said = parts.join(", ");
        if credit > MAX_CREDIT {
            said.push_str(&format!("; capped at {}", secs(MAX_CREDIT)));
        }
        (credit.min(MAX_CREDIT), said)
    }
}

/// `d` in seconds with two decimals, e.g. `0.43 s`.
fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

/// The line a check prints, e.g. `vLLM frees it: bound 2.00 s: 0.43 s, met (credit 0.00 s:
/// kvguard-control run-queue wait 0.00 s, this process 0.00 s)`.
fn check_line(
    what: &str,
    bound: Duration,
    took: Duration,
    met: bool,
    credit: Duration,
    said: &str,
) -> String {
    let verdict = if met { "met" } else { "NOT met" };
    format!(
        "{what}: bound {}: {}{}, {verdict} (credit {}: {said})",
        secs(bound),
        if met { "" } else { "over " },
        secs(took),
        secs(credit)
    )
}

/// Polls `probe` every `interval` until it returns `Some`, for at most `bound` after
/// `from`, extended by the run-queue wait measured since `mark` (looked at when the bound
/// has run out, then each time the extension has; at most [`MAX_CREDIT`]). A probe still
/// running at the deadline is cut there. Prints one line either way (the bound, the time
/// taken, the credit and what it was made of); the error holds the same line.
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
            let took = from.elapsed();
            let (credit, said) = mark.since();
            eprintln!("{}", check_line(what, bound, took, true, credit, &said));
            return Ok(v);
        }
        let (credit, said) = mark.since();
        let extended = from + bound + credit;
        if Instant::now() >= extended {
            let line = check_line(what, bound, from.elapsed(), false, credit, &said);
            eprintln!("{line}");
            bail!("not within the bound: {line}");
        }
        deadline = extended;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proc::ChildGuard;
    use std::process::Command;

    /// A bound on every wait of a test.
    const T: Duration = Duration::from_secs(10);

    #[test]
    fn schedstat_lines_parse() {
        assert_eq!(
            parse_schedstat("15234573 22391479 53\n"),
            Some(SchedStat {
                on_cpu_ns: 15_234_573,
                run_wait_ns: 22_391_479,
                timeslices: 53
            })
        );
        assert_eq!(
            parse_schedstat("0 0 0"),
            Some(SchedStat {
                on_cpu_ns: 0,
                run_wait_ns: 0,
                timeslices: 0
            })
        );
        for bad in [
            "", "\n", "1 2", "1 2 3 4", "1  2 3", "-1 2 3", "a b c", "1 2 3x",
        ] {
            assert_eq!(parse_schedstat(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_largest_thread_wait_is_taken_new_threads_from_zero_ended_ones_left_out() {
        let mark: Waits = [(1, 100), (2, 1_000), (3, 5_000_000_000)].into();
        // Thread 1 waited 300 ns more, 2 waited 2 µs more, 3 ended, 4 is new with 500 ns.
        let now: Waits = [(1, 400), (2, 3_000), (4, 500)].into();
        assert_eq!(largest_wait(&mark, &now), Duration::from_nanos(2_000));
        // Not the sum, and a thread id reused with a smaller figure gives 0, not a wrap.
        let now: Waits = [(1, 1_100), (2, 2_000), (3, 7)].into();
        assert_eq!(largest_wait(&mark, &now), Duration::from_nanos(1_000));
        assert_eq!(largest_wait(&mark, &Waits::new()), Duration::ZERO);
    }

    #[test]
    fn this_process_reads() {
        let w = read_waits(std::process::id()).unwrap();
        assert!(w.contains_key(&std::process::id()), "{w:?}");
        let (_, said) = StallMark::process().since();
        assert!(said.starts_with("this process run-queue wait 0."), "{said}");
    }

    /// A process that does not exist gives no credit, and the line says so.
    #[test]
    fn an_unreadable_process_gives_no_credit_and_says_so() {
        // Above the kernel's largest pid_max (2^22).
        let mark = StallMark::process().and("ghost", 1 << 30);
        let (credit, said) = mark.since();
        assert!(credit < Duration::from_millis(100), "{said}");
        assert!(
            said.starts_with(
                "ghost run-queue wait unknown, credited 0 (at the mark: cannot list /proc/1073741824/task"
            ),
            "{said}"
        );
        assert!(said.contains("), this process 0."), "{said}");
    }

    /// The CPU this process may run on with the highest number.
    fn a_cpu() -> usize {
        // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity fills it.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: pid 0 is this thread; the size is the set's.
        let rc = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        (0..libc::CPU_SETSIZE as usize)
            // SAFETY: i is below CPU_SETSIZE.
            .rfind(|&i| unsafe { libc::CPU_ISSET(i, &set) })
            .unwrap()
    }

    /// A shell spinning forever on `cpu` at nice `nice`, killed (its group) on drop.
    fn spinner(name: &str, cpu: usize, nice: u8) -> ChildGuard {
        let mut cmd = Command::new("taskset");
        cmd.args(["-c", &cpu.to_string(), "nice", "-n", &nice.to_string()])
            .args(["sh", "-c", "while :; do :; done"]);
        ChildGuard::spawn(name, cmd).unwrap()
    }

    /// Waits until the kernel has accounted some of `p`'s time on a CPU: a process still in
    /// its first time slice reads `0 0 0`, as on a kernel without the statistics, and a
    /// mark taken then has no figure.
    fn on_a_cpu(p: &ChildGuard) {
        crate::wait::poll_until_blocking("on a CPU", T, Duration::from_millis(5), || {
            read_waits(p.pid()).ok()
        })
        .unwrap();
    }

    /// A process kept runnable on a CPU another busy process holds waits for it, and that
    /// wait is its credit.
    #[test]
    fn a_runnable_process_sharing_a_cpu_is_credited_its_wait() {
        let cpu = a_cpu();
        // The measured spinner at nice 10 gets about a tenth of the CPU against the hog at
        // nice 0 (weights 110 and 1024): it waits most of the time.
        let hog = spinner("hog", cpu, 0);
        let busy = spinner("busy", cpu, 10);
        on_a_cpu(&busy);
        let mark = StallMark::process().and("busy", busy.pid());
        let t0 = Instant::now();
        std::thread::sleep(Duration::from_secs(1));
        let (credit, said) = mark.since();
        let elapsed = t0.elapsed();
        drop((busy, hog));
        eprintln!("{elapsed:?} sharing a CPU: {said}");
        assert!(said.starts_with("busy run-queue wait"), "{said}");
        assert!(credit >= Duration::from_millis(500), "{said}");
        // One thread's wait never exceeds the wall time (plus the reading's own time).
        assert!(credit <= elapsed + Duration::from_millis(100), "{said}");
    }

    /// A process that sleeps is not waiting for a CPU: no credit.
    #[test]
    fn a_sleeping_process_gets_no_credit() {
        let sleeper = ChildGuard::spawn("sleeper", {
            let mut c = Command::new("sleep");
            c.arg("30");
            c
        })
        .unwrap();
        // Marked once asleep: starting up (exec, the loader) is runnable, and may wait
        // behind the other tests' spinners.
        let stat = format!("/proc/{}/stat", sleeper.pid());
        crate::wait::poll_until_blocking("sleep asleep", T, Duration::from_millis(5), || {
            let s = std::fs::read_to_string(&stat).ok()?;
            // `pid (comm) S ...`: the state follows the command's closing parenthesis.
            (s.rsplit_once(") ")?.1.starts_with('S')).then_some(())
        })
        .unwrap();
        let mark = StallMark::process().and("sleeper", sleeper.pid());
        std::thread::sleep(Duration::from_secs(1));
        let (_, said) = mark.since();
        let w = mark.watched[0].since().unwrap();
        eprintln!("1 s asleep: {w:?} ({said})");
        assert!(w < Duration::from_millis(50), "{said}");
        assert!(said.starts_with("sleeper run-queue wait 0.0"), "{said}");
    }

    /// A process that exits after the mark gives no credit (not its last figure).
    #[test]
    fn a_process_gone_at_the_check_gives_no_credit() {
        let mut spin = spinner("spin", a_cpu(), 0);
        on_a_cpu(&spin);
        let mark = StallMark::process().and("spin", spin.pid());
        spin.kill().unwrap();
        let (_, said) = mark.since();
        assert!(
            said.starts_with("spin run-queue wait unknown, credited 0 (at the check:"),
            "{said}"
        );
    }

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
        assert!(msg.contains("never: bound 0.20 s: over 0.2"), "{msg}");
        assert!(msg.contains("NOT met (credit 0.0"), "{msg}");
        assert!(msg.contains(": this process run-queue wait 0.0"), "{msg}");
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    }

    #[test]
    fn the_line_says_bound_time_credit_and_what_from() {
        assert_eq!(
            check_line(
                "vLLM frees it",
                Duration::from_secs(2),
                Duration::from_millis(430),
                true,
                Duration::ZERO,
                "kvguard-control run-queue wait 0.00 s, this process 0.00 s"
            ),
            "vLLM frees it: bound 2.00 s: 0.43 s, met (credit 0.00 s: kvguard-control run-queue wait 0.00 s, this process 0.00 s)"
        );
    }
}
