//! Child processes that cannot outlive a test.
//!
//! [`ChildGuard`] starts a process in its own process group with stdout and stderr going
//! to a log file in a temporary directory, and kills the whole group on `Drop` — also when
//! the test panics, in which case it first prints the last lines of the log to stderr.
//! Set `KVGUARD_KEEP_LOGS=1` to keep the temp directory (its path is printed).

use anyhow::{bail, Context, Result};
use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Lines of log printed when a guard is dropped during a panic.
pub const PANIC_TAIL_LINES: usize = 200;

/// How long `Drop` waits for a killed group to be reaped.
const REAP_TIMEOUT: Duration = Duration::from_secs(5);

/// A running child process (and its process group), killed on drop.
#[derive(Debug)]
pub struct ChildGuard {
    name: String,
    child: Child,
    dir: Option<tempfile::TempDir>,
    log_path: PathBuf,
    exited: Option<ExitStatus>,
}

impl ChildGuard {
    /// Starts `cmd` as `name` (used in messages). The command's stdout and stderr are
    /// replaced by the log file; stdin is null. The process gets its own process group.
    pub fn spawn(name: &str, mut cmd: Command) -> Result<Self> {
        use std::os::unix::process::CommandExt;
        let dir = tempfile::Builder::new()
            .prefix(&format!("kvguard-{}-", sanitize(name)))
            .tempdir()
            .context("creating a temp dir for the child's log")?;
        let log_path = dir.path().join(format!("{}.log", sanitize(name)));
        let log =
            File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
        let log2 = log.try_clone().context("cloning the log file handle")?;
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log2))
            .process_group(0);
        // Dies with the process that spawned it: a test killed for its time (nextest's
        // slow-timeout, a SIGKILL) runs no Drop, and a child in a process group of its
        // own outlives it (two vLLM servers were found running 78 min after such a kill).
        // The signal follows the spawning *thread*: callers spawn from async tasks, whose
        // runtime threads live as long as the runtime.
        let parent = std::process::id();
        // SAFETY: between fork and exec only async-signal-safe calls (prctl, getppid).
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent died before prctl: no signal will come.
                if libc::getppid() as u32 != parent {
                    return Err(std::io::Error::other("the spawning process has exited"));
                }
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("spawning {name}: {cmd:?}"))?;
        Ok(ChildGuard {
            name: name.to_string(),
            child,
            dir: Some(dir),
            log_path,
            exited: None,
        })
    }

    /// Starts `program args...` as `name`, with extra environment variables.
    pub fn spawn_program<I, S>(
        name: &str,
        program: impl AsRef<Path>,
        args: I,
        envs: &[(&str, &str)],
    ) -> Result<Self>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        let mut cmd = Command::new(program.as_ref());
        cmd.args(args);
        for (k, v) in envs {
            cmd.env(k, v);
        }
        Self::spawn(name, cmd)
    }

    /// The name given at spawn.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The process id (also its process group id).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The temp directory that holds the log; also a good place for the child's own files
    /// (config, address files). Removed on drop unless `KVGUARD_KEEP_LOGS` is set.
    pub fn dir(&self) -> &Path {
        self.log_path.parent().unwrap_or(Path::new("."))
    }

    /// The log file (stdout and stderr interleaved).
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The whole log so far (lossy UTF-8).
    pub fn log(&self) -> String {
        std::fs::read(&self.log_path)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// The last `n` lines of the log.
    pub fn log_tail(&self, n: usize) -> String {
        let log = self.log();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// The exit status if the process has ended (never blocks).
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        if let Some(s) = self.exited {
            return Ok(Some(s));
        }
        let s = self
            .child
            .try_wait()
            .with_context(|| format!("waiting for {}", self.name))?;
        self.exited = s;
        Ok(s)
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.try_wait(), Ok(None))
    }

    /// Fails (with the log tail) if the process has exited.
    pub fn ensure_running(&mut self) -> Result<()> {
        if let Some(s) = self.try_wait()? {
            bail!(
                "{} exited early with {s}; last log lines:\n{}",
                self.name,
                self.log_tail(60)
            );
        }
        Ok(())
    }

    /// Waits (polling, blocking the thread) at most `timeout` for the process to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.try_wait()? {
                return Ok(s);
            }
            if Instant::now() >= deadline {
                bail!("{} did not exit within {timeout:?}", self.name);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Async flavour of [`ChildGuard::wait_exit`].
    pub async fn wait_exit_async(&mut self, timeout: Duration) -> Result<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.try_wait()? {
                return Ok(s);
            }
            if Instant::now() >= deadline {
                bail!("{} did not exit within {timeout:?}", self.name);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Sends `sig` to the whole process group.
    pub fn signal(&self, sig: i32) -> Result<()> {
        let pgid = self.child.id() as libc::pid_t;
        // SAFETY: kill(2) with a negative pid signals the process group we created.
        let rc = unsafe { libc::kill(-pgid, sig) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ESRCH) {
                return Err(e).with_context(|| format!("signalling {}", self.name));
            }
        }
        Ok(())
    }

    /// SIGKILLs the process group and reaps the child (bounded).
    pub fn kill(&mut self) -> Result<ExitStatus> {
        if let Some(s) = self.exited {
            let _ = self.signal(libc::SIGKILL);
            return Ok(s);
        }
        self.signal(libc::SIGKILL)?;
        self.wait_exit(REAP_TIMEOUT)
    }

    /// SIGTERMs the group, waits up to `grace` for the exit, then SIGKILLs.
    /// Returns the exit status and whether the process ended within the grace time.
    pub fn terminate(&mut self, grace: Duration) -> Result<(ExitStatus, bool)> {
        if let Some(s) = self.try_wait()? {
            return Ok((s, true));
        }
        self.signal(libc::SIGTERM)?;
        match self.wait_exit(grace) {
            Ok(s) => {
                // Children of the group may linger.
                let _ = self.signal(libc::SIGKILL);
                Ok((s, true))
            }
            Err(_) => Ok((self.kill()?, false)),
        }
    }

    /// Waits until the log contains `needle` (bounded); returns the log. Fails early if
    /// the process exits.
    pub async fn wait_for_log(&mut self, needle: &str, timeout: Duration) -> Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let log = self.log();
            if log.contains(needle) {
                return Ok(log);
            }
            if let Some(s) = self.try_wait()? {
                bail!(
                    "{} exited ({s}) before logging {needle:?}; last log lines:\n{}",
                    self.name,
                    self.log_tail(60)
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "{} did not log {needle:?} within {timeout:?}; last log lines:\n{}",
                    self.name,
                    self.log_tail(60)
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until `path` holds a socket address (as written by `--addr-file` of the
    /// instruments, or `--admin-address-path` of Envoy). Fails early if the process exits.
    pub async fn wait_for_addr_file(
        &mut self,
        path: &Path,
        timeout: Duration,
    ) -> Result<SocketAddr> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(text) = std::fs::read_to_string(path) {
                if let Ok(a) = text.trim().parse::<SocketAddr>() {
                    return Ok(a);
                }
            }
            if let Some(s) = self.try_wait()? {
                bail!(
                    "{} exited ({s}) before writing {}; last log lines:\n{}",
                    self.name,
                    path.display(),
                    self.log_tail(60)
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "{} did not write an address to {} within {timeout:?}; last log lines:\n{}",
                    self.name,
                    path.display(),
                    self.log_tail(60)
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Runs `program args... --addr-file <tmp>` and waits for the address it writes
    /// (how `engine-sim`, `lossy-hop` report their port).
    pub async fn spawn_with_addr_file<I, S>(
        name: &str,
        program: impl AsRef<Path>,
        args: I,
        envs: &[(&str, &str)],
        timeout: Duration,
    ) -> Result<(ChildGuard, SocketAddr)>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        let dir = tempfile::Builder::new()
            .prefix("kvguard-addr-")
            .tempdir()
            .context("creating a temp dir")?;
        let file = dir.path().join("addr");
        let mut cmd = Command::new(program.as_ref());
        cmd.args(args).arg("--addr-file").arg(&file);
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut guard = ChildGuard::spawn(name, cmd)?;
        let addr = guard.wait_for_addr_file(&file, timeout).await?;
        Ok((guard, addr))
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "----- {} (pid {}) last {PANIC_TAIL_LINES} log lines ({}) -----\n{}\n----- end of {} log -----",
                self.name,
                self.child.id(),
                self.log_path.display(),
                self.log_tail(PANIC_TAIL_LINES),
                self.name
            );
        }
        let _ = self.signal(libc::SIGKILL);
        if self.exited.is_none() {
            let deadline = Instant::now() + REAP_TIMEOUT;
            while Instant::now() < deadline {
                match self.child.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        }
        if std::env::var_os("KVGUARD_KEEP_LOGS").is_some() {
            if let Some(dir) = self.dir.take() {
                let kept = dir.keep();
                eprintln!("kept {} log in {}", self.name, kept.display());
            }
        }
    }
}

fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Kills a whole process group when this process dies, however it dies: for a child that
/// forks workers of its own (vLLM's API server, EngineCore and workers share its group),
/// which the death signal [`ChildGuard::spawn`] sets does not reach. A `sh` in a group of
/// its own (a test killed for its time has its group killed; this must outlive it) waits
/// on a pipe whose only writer is this process: the end of this process closes it, and the
/// `sh` kills the group. Dropped normally, it is killed first and does nothing.
#[derive(Debug)]
pub struct GroupWatchdog {
    child: Child,
    _writer: std::io::PipeWriter,
}

impl GroupWatchdog {
    /// Watches process group `pgid` (a [`ChildGuard`]'s pid).
    pub fn start(pgid: u32) -> Result<Self> {
        use std::os::unix::process::CommandExt;
        // Both ends close on exec: only the `sh` (its stdin) and this process hold them.
        let (reader, writer) = std::io::pipe().context("creating the watchdog's pipe")?;
        let child = Command::new("sh")
            .arg("-c")
            .arg(r#"read -r _ || kill -9 "-$1""#)
            .arg("kvguard-watchdog")
            .arg(pgid.to_string())
            .stdin(Stdio::from(reader))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .context("spawning the process-group watchdog (sh)")?;
        Ok(GroupWatchdog {
            child,
            _writer: writer,
        })
    }
}

impl Drop for GroupWatchdog {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
