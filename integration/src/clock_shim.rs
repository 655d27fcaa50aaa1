//! A wall-clock step for a real process: `clock_shim.c` (beside this file) compiled with
//! the machine's `cc` into an `LD_PRELOAD` library that adds an offset, read from a file
//! the test rewrites, to `CLOCK_REALTIME`, `gettimeofday` and `time` (monotonic clocks
//! untouched). Debian's libfaketime deadlocks the PyPI Envoy at start-up; this does not
//! (every call is a raw syscall).

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The C source.
const SOURCE: &str = include_str!("clock_shim.c");

/// A compiled shim and its offset file.
#[derive(Debug)]
pub struct ClockShim {
    dir: tempfile::TempDir,
}

impl ClockShim {
    /// Compiles the shim (`cc -shared -fPIC`) into a temp dir; the offset starts at 0.
    pub fn build() -> Result<ClockShim> {
        let dir = tempfile::Builder::new()
            .prefix("kvguard-clock-shim-")
            .tempdir()?;
        let src = dir.path().join("clock_shim.c");
        std::fs::write(&src, SOURCE)?;
        let out = Command::new("cc")
            .args(["-shared", "-fPIC", "-O2", "-o"])
            .arg(dir.path().join("libclockshim.so"))
            .arg(&src)
            .output()
            .context("running cc (a C compiler is needed for the clock shim)")?;
        if !out.status.success() {
            bail!(
                "cc failed to build the clock shim:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let shim = ClockShim { dir };
        shim.set_offset_s(0)?;
        Ok(shim)
    }

    /// The library for `LD_PRELOAD`.
    pub fn library(&self) -> PathBuf {
        self.dir.path().join("libclockshim.so")
    }

    /// The file holding the offset.
    pub fn offset_file(&self) -> PathBuf {
        self.dir.path().join("offset")
    }

    /// The environment a process needs to run under the shim.
    pub fn env(&self) -> [(String, String); 2] {
        [
            ("LD_PRELOAD".into(), path_str(&self.library())),
            (
                "KVGUARD_CLOCK_OFFSET_FILE".into(),
                path_str(&self.offset_file()),
            ),
        ]
    }

    /// Steps the wall clock of every process under the shim to real time + `secs`
    /// (seen within 50 ms; written by rename, so never half-read).
    pub fn set_offset_s(&self, secs: i64) -> Result<()> {
        let tmp = self.dir.path().join("offset.tmp");
        std::fs::write(&tmp, secs.to_string())?;
        std::fs::rename(&tmp, self.offset_file())?;
        Ok(())
    }
}

fn path_str(p: &Path) -> String {
    p.display().to_string()
}
