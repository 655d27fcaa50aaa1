//! The engine process's open file descriptors and resident memory, from `/proc`.

use std::path::Path;

/// Open fds and RSS bytes of a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStats {
    /// Entries in `/proc/<pid>/fd`.
    pub open_fds: u64,
    /// `VmRSS` of `/proc/<pid>/status`, bytes.
    pub rss_bytes: u64,
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

/// Reads a process's figures under `proc_root` (normally `/proc`).
pub fn read(proc_root: &Path, pid: u32) -> Result<ProcStats, String> {
    let dir = proc_root.join(pid.to_string());
    let status = std::fs::read_to_string(dir.join("status"))
        .map_err(|e| format!("{}: {e}", dir.join("status").display()))?;
    let rss_bytes = parse_vmrss(&status).ok_or_else(|| "no VmRSS line".to_owned())?;
    let open_fds = std::fs::read_dir(dir.join("fd"))
        .map_err(|e| format!("{}: {e}", dir.join("fd").display()))?
        .count() as u64;
    Ok(ProcStats {
        open_fds,
        rss_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_process() {
        let s = read(Path::new("/proc"), std::process::id()).unwrap();
        assert!(s.open_fds >= 3);
        assert!(s.rss_bytes > 1024 * 1024);
        assert!(read(Path::new("/proc"), u32::MAX).is_err());
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
}
