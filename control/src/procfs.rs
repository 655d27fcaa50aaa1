//! The engine's open file descriptors and resident memory, from `/proc`, summed over its
//! process tree: the process given (`--engine-pid`) and every descendant. vLLM V1 runs
//! its EngineCore (which holds the model, the KV cache's host side and most of the
//! memory) as a child of the API server, so one pid alone misses most of the engine.
//!
//! What the sums mean, per figure:
//! - **fds**: entries of each process's `/proc/<pid>/fd`, added. A descriptor a child
//!   inherited counts once per process holding it, as the kernel's per-process limit
//!   (`RLIMIT_NOFILE`) sees it. Reading another user's `fd` directory needs the same uid
//!   or `CAP_SYS_PTRACE`: without it the read fails and the figure is not exported.
//! - **memory**: `VmRSS` of each process's `/proc/<pid>/status` (world-readable), added.
//!   Pages shared between the processes (libraries, shared memory between the API server
//!   and EngineCore) count once per process, so the sum is an upper bound of what the
//!   tree holds; its slope is what a leak shows in.
//!
//! Descendants are found from the parent pid of every process under the proc root (one
//! small `stat` read per process each sample), which works on any kernel (the
//! `task/*/children` files need `CONFIG_PROC_CHILDREN`).

use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::path::Path;

/// Open fds and RSS bytes of a process (or summed over a tree, [`read_tree`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProcStats {
    /// Entries in `/proc/<pid>/fd`.
    pub open_fds: u64,
    /// `VmRSS` of `/proc/<pid>/status`, bytes.
    pub rss_bytes: u64,
}

/// A process tree's figures ([`read_tree`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeStats {
    /// The pids summed, the root first, then descendants breadth-first.
    pub pids: Vec<u32>,
    /// Their figures, added.
    pub total: ProcStats,
}

/// `VmRSS` in bytes from a `/proc/<pid>/status` text.
pub fn parse_vmrss(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let mut parts = line["VmRSS:".len()..].split_whitespace();
    let n: u64 = parts.next()?.parse().ok()?;
    let unit = parts.next().unwrap_or("kB");
    // Checked: a value the kernel would never write must not overflow (no panic, no wrap).
    match unit {
        "kB" | "KB" | "kb" => n.checked_mul(1024),
        "mB" | "MB" => n.checked_mul(1024 * 1024),
        _ => Some(n),
    }
}

/// The parent pid from a `/proc/<pid>/stat` text (`pid (comm) state ppid ...`). The
/// command name may hold spaces and parentheses, so the fields are read after the last
/// `)`.
pub fn parse_ppid(stat: &str) -> Option<u32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    fields.next()?; // state
    fields.next()?.parse().ok()
}

/// A read failure, with whether the process was simply gone (it exited meanwhile).
struct ReadError {
    gone: bool,
    message: String,
}

fn read_one(proc_root: &Path, pid: u32) -> Result<ProcStats, ReadError> {
    let dir = proc_root.join(pid.to_string());
    let fail = |what: &Path, e: std::io::Error| ReadError {
        // ESRCH shows as NotFound or as an "other" error depending on the file.
        gone: e.kind() == ErrorKind::NotFound || e.raw_os_error() == Some(3),
        message: format!("{}: {e}", what.display()),
    };
    let status_path = dir.join("status");
    let status = std::fs::read_to_string(&status_path).map_err(|e| fail(&status_path, e))?;
    let rss_bytes = parse_vmrss(&status).ok_or_else(|| ReadError {
        // No VmRSS: the process has no address space. It is exiting (the kernel drops its
        // memory before it shows as a zombie, still `R` or `S` meanwhile), a zombie, or a
        // kernel thread: it holds no memory, and is left out like one that has gone.
        gone: true,
        message: format!("{}: no VmRSS line", status_path.display()),
    })?;
    let fd_path = dir.join("fd");
    let open_fds = std::fs::read_dir(&fd_path)
        .map_err(|e| fail(&fd_path, e))?
        .count() as u64;
    Ok(ProcStats {
        open_fds,
        rss_bytes,
    })
}

/// Reads one process's figures under `proc_root` (normally `/proc`).
pub fn read(proc_root: &Path, pid: u32) -> Result<ProcStats, String> {
    read_one(proc_root, pid).map_err(|e| e.message)
}

/// `pid` and its descendants (breadth-first, `pid` first), from the parent pid of every
/// process listed under `proc_root`.
pub fn tree_pids(proc_root: &Path, pid: u32) -> Result<Vec<u32>, String> {
    let entries =
        std::fs::read_dir(proc_root).map_err(|e| format!("{}: {e}", proc_root.display()))?;
    let mut children: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for e in entries.flatten() {
        let Some(p) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        // A process that exited since the listing has no stat: skip it.
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        if let Some(pp) = parse_ppid(&stat) {
            children.entry(pp).or_default().push(p);
        }
    }
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        if let Some(c) = children.get(&out[i]) {
            // A pid cycle cannot happen in /proc, but a bound costs nothing.
            for &k in c {
                if !out.contains(&k) {
                    out.push(k);
                }
            }
        }
        i += 1;
    }
    Ok(out)
}

/// The figures of `pid` and every descendant, added. Fails when `pid` itself cannot be
/// read, or when a descendant that still exists cannot (permissions: a partial sum
/// would look like a drop); descendants that exited meanwhile are left out.
pub fn read_tree(proc_root: &Path, pid: u32) -> Result<TreeStats, String> {
    let total = read(proc_root, pid)?;
    let mut out = TreeStats {
        pids: vec![pid],
        total,
    };
    for p in tree_pids(proc_root, pid)?.into_iter().skip(1) {
        match read_one(proc_root, p) {
            Ok(s) => {
                out.pids.push(p);
                out.total.open_fds = out.total.open_fds.saturating_add(s.open_fds);
                out.total.rss_bytes = out.total.rss_bytes.saturating_add(s.rss_bytes);
            }
            Err(e) if e.gone => {}
            Err(e) => return Err(format!("descendant {p} of {pid}: {}", e.message)),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    #[test]
    fn own_process() {
        let s = read(Path::new("/proc"), std::process::id()).unwrap();
        assert!(s.open_fds >= 3);
        assert!(s.rss_bytes > 1024 * 1024);
        assert!(read(Path::new("/proc"), u32::MAX).is_err());
        assert!(read_tree(Path::new("/proc"), u32::MAX).is_err());
    }

    #[test]
    fn vmrss() {
        assert_eq!(
            parse_vmrss("Name:\tx\nVmRSS:\t   12345 kB\nThreads: 3\n"),
            Some(12345 * 1024)
        );
        assert_eq!(parse_vmrss("Name: x\n"), None);
        assert_eq!(parse_vmrss("VmRSS:\t44444444444444444 kB"), None);
        assert_eq!(parse_vmrss("VmRSS:\t18446744073709551615 MB"), None);
    }

    #[test]
    fn ppid() {
        assert_eq!(
            parse_ppid("4242 (VLLM::EngineCore) S 4100 4242 4100 0 -1"),
            Some(4100)
        );
        assert_eq!(parse_ppid("7 (a) (b) c) R 1 7 7"), Some(1));
        assert_eq!(parse_ppid("7 no parens R 1"), None);
        assert_eq!(parse_ppid("7 (x) R"), None);
    }

    /// Kills the child's process group when dropped (the test's processes never outlive
    /// it, also when an assertion fails).
    struct Group(Child);
    impl Drop for Group {
        fn drop(&mut self) {
            // The child leads its own process group (process_group(0)).
            let _ = Command::new("kill")
                .args(["-s", "KILL", "--"])
                .arg(format!("-{}", self.0.id()))
                .status();
            let _ = self.0.wait();
        }
    }

    /// A directory removed when dropped.
    struct TempDir(std::path::PathBuf);
    impl TempDir {
        fn new() -> TempDir {
            let p = std::env::temp_dir().join(format!(
                "kvguard-procfs-test-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            ));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            TempDir(p)
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A descendant without a VmRSS line has no address space (exiting, a zombie, a kernel
    /// thread): it is left out of the sum, not an error that would blank the metric.
    #[test]
    fn a_descendant_without_an_address_space_is_left_out() {
        let dir = TempDir::new();
        let root = dir.0.as_path();
        let proc_entry = |pid: u32, ppid: u32, status: &str| {
            let d = root.join(pid.to_string());
            std::fs::create_dir_all(d.join("fd")).unwrap();
            std::fs::write(d.join("fd/0"), "").unwrap();
            std::fs::write(d.join("stat"), format!("{pid} (x) S {ppid} 0 0")).unwrap();
            std::fs::write(d.join("status"), status).unwrap();
        };
        proc_entry(10, 1, "State:\tS (sleeping)\nVmRSS:\t    100 kB\n");
        proc_entry(11, 10, "State:\tR (running)\n");
        proc_entry(12, 10, "State:\tS (sleeping)\nVmRSS:\t      2 kB\n");
        let t = read_tree(root, 10).unwrap();
        assert_eq!(t.pids, vec![10, 12]);
        assert_eq!(t.total.rss_bytes, 102 * 1024);
        assert_eq!(t.total.open_fds, 2);
    }

    /// Real processes: a shell that starts two children, one of which starts a
    /// grandchild; each of the three holds 20 extra fds and a 32 MiB string. The tree sum
    /// equals the sum of each process read alone, counts every process, and exceeds the
    /// parent alone by at least what the three hold.
    #[test]
    fn sums_a_real_process_tree() {
        const MIB: u64 = 1024 * 1024;
        let dir = TempDir::new();
        let d = dir.0.as_path();
        // One `exec` per descriptor (bash keeps only part of a multi-redirection `exec`).
        let fds: String = (10..30).map(|n| format!("exec {n}</dev/null\n")).collect();
        // The holder: fds, memory (written, so resident), a child `sleep` to wait on, and
        // only then its ready file.
        std::fs::write(
            d.join("holder.sh"),
            format!(
                "{fds}big=$(head -c {} /dev/zero | tr '\\0' x)\nsleep 600 &\ntouch \"$1/ready.$$\"\nwait\n",
                32 * MIB
            ),
        )
        .unwrap();
        // A child that starts a grandchild holder, then becomes a holder itself.
        std::fs::write(
            d.join("mid.sh"),
            "bash \"$1/holder.sh\" \"$1\" &\nexec bash \"$1/holder.sh\" \"$1\"\n",
        )
        .unwrap();
        std::fs::write(
            d.join("root.sh"),
            "bash \"$1/holder.sh\" \"$1\" &\nbash \"$1/mid.sh\" \"$1\" &\nwait\n",
        )
        .unwrap();
        let mut cmd = Command::new("bash");
        cmd.arg(d.join("root.sh")).arg(d).stdin(Stdio::null());
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let g = Group(cmd.spawn().unwrap());
        let root = g.0.id();
        // Ready: the three holders wrote their files (an event, not a sleep).
        let ready = || {
            std::fs::read_dir(d)
                .unwrap()
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("ready."))
                .count()
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while ready() < 3 {
            assert!(
                Instant::now() < deadline,
                "holders not ready: {} of 3",
                ready()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let proc_root = Path::new("/proc");
        let t = read_tree(proc_root, root).unwrap();
        let alone = read(proc_root, root).unwrap();
        // root, two children, a grandchild, and the three holders' sleeps.
        assert_eq!(t.pids.len(), 7, "pids {:?}", t.pids);
        assert_eq!(t.pids[0], root);
        let mut sum = ProcStats::default();
        for &p in &t.pids {
            let s = read(proc_root, p).unwrap();
            sum.open_fds += s.open_fds;
            sum.rss_bytes += s.rss_bytes;
        }
        assert_eq!(t.total.open_fds, sum.open_fds);
        // RSS can move a little between two reads: within 1 MiB.
        assert!(
            t.total.rss_bytes.abs_diff(sum.rss_bytes) < MIB,
            "{t:?} vs {sum:?}"
        );
        assert!(
            t.total.open_fds >= alone.open_fds + 3 * 20,
            "{t:?}, parent alone {alone:?}"
        );
        assert!(
            t.total.rss_bytes >= alone.rss_bytes + 3 * 32 * MIB,
            "{t:?}, parent alone {alone:?}"
        );
        drop(g);
    }
}
