//! Command line and environment configuration, validated into a typed [`Config`].
//!
//! Every flag can also be given as a `KVGUARD_<NAME>` environment variable (clap's `env`).
//! The shared secret itself is read only from `--secret-file` or the `KVGUARD_SECRET`
//! variable, never from the command line (where `ps` would show it).

use clap::{Parser, ValueEnum};
use http::Uri;
use kvguard_contract::Key;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Exit status for bad flags (`EX_USAGE`).
pub const EXIT_USAGE: i32 = 64;

/// Name of the environment variable holding one shared secret.
pub const SECRET_ENV: &str = "KVGUARD_SECRET";

/// How an abort ends the engine-side sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AbortStrategy {
    /// Close the engine-side connection (vLLM, TGI and llama.cpp abort on disconnect).
    Connection,
    /// Close the connection and call SGLang's `POST /abort_request {"rid": "<id>"}`.
    Sglang,
    /// Close the connection and call `POST /inference/v1/abort_requests`
    /// (vLLM scale-out / production-stack abort API).
    #[value(name = "vllm-scale-out")]
    VllmScaleOut,
}

impl AbortStrategy {
    /// The flag and log form.
    pub const fn as_str(self) -> &'static str {
        match self {
            AbortStrategy::Connection => "connection",
            AbortStrategy::Sglang => "sglang",
            AbortStrategy::VllmScaleOut => "vllm-scale-out",
        }
    }
}

/// This replica's part in prefill/decode disaggregation (`--pd-role`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PdRole {
    /// Not disaggregated, or not known: an abort is fanned out to the peers only for a
    /// request whose body carried `kv_transfer_params`.
    None,
    /// Beside a prefill engine.
    Prefill,
    /// Beside a decode engine.
    Decode,
}

impl PdRole {
    /// The flag form, `None` for [`PdRole::None`].
    pub const fn name(self) -> Option<&'static str> {
        match self {
            PdRole::None => None,
            PdRole::Prefill => Some("prefill"),
            PdRole::Decode => Some("decode"),
        }
    }
}

/// Most prefill hand-offs held for a remote decode ([`crate::pd`]); beyond, the oldest
/// is forgotten (counted).
pub const MAX_PD_HANDOFFS: usize = 100_000;

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable text.
    Text,
    /// One JSON object per line.
    Json,
}

/// Raw flags, as clap parses them. Validate with [`Config::try_new`].
#[derive(Debug, Clone, Parser)]
#[command(
    name = "kvguard-control",
    version,
    about = "kvguard-control: proxies inference traffic to the engine, carries out signed aborts, \
             reaps idle and over-age sequences, reports NVML and engine KV signals."
)]
pub struct Args {
    /// Proxy listener (inference traffic in, HTTP/1.1 and h2c).
    #[arg(long, env = "KVGUARD_LISTEN", default_value = "0.0.0.0:8001")]
    pub listen: String,
    /// Admin listener: POST /v1/abort, GET /v1/requests, /v1/gpu, /metrics, /healthz, /readyz.
    #[arg(long, env = "KVGUARD_ADMIN_LISTEN", default_value = "0.0.0.0:9902")]
    pub admin_listen: String,
    /// The engine's base URL (http only).
    #[arg(
        long,
        env = "KVGUARD_ENGINE_URL",
        default_value = "http://127.0.0.1:8000"
    )]
    pub engine_url: String,
    /// The engine's Prometheus metrics URL (default: <engine-url>/metrics).
    #[arg(long, env = "KVGUARD_ENGINE_METRICS_URL")]
    pub engine_metrics_url: Option<String>,
    /// The engine's health URL used by /readyz when metrics do not answer (default: <engine-url>/health).
    #[arg(long, env = "KVGUARD_ENGINE_HEALTH_URL")]
    pub engine_health_url: Option<String>,
    /// This replica's admin address as others reach it (IP literal and port); enables the
    /// signed x-kvguard-control response stamp.
    #[arg(long, env = "KVGUARD_ADVERTISE")]
    pub advertise: Option<String>,
    /// File of shared secrets, one per line (all accepted; blank lines and `#` comments skipped).
    #[arg(long, env = "KVGUARD_SECRET_FILE")]
    pub secret_file: Option<PathBuf>,
    /// How an abort ends the engine-side sequence.
    #[arg(
        long,
        env = "KVGUARD_ABORT_STRATEGY",
        value_enum,
        default_value = "connection"
    )]
    pub abort_strategy: AbortStrategy,
    /// Hard cap on a request's age, whatever its progress (humantime; `off`, the default,
    /// or `0` disables): a cap cuts streams that are still progressing.
    #[arg(long, env = "KVGUARD_MAX_AGE", default_value = "off")]
    pub max_age: String,
    /// Abort a stream with no data event for this long, counted from the first one.
    #[arg(long, env = "KVGUARD_IDLE_TIMEOUT", default_value = "120s")]
    pub idle_timeout: String,
    /// Abort a request with no data event this long after it started.
    #[arg(long, env = "KVGUARD_FIRST_TOKEN_TIMEOUT", default_value = "off")]
    pub first_token_timeout: String,
    /// End a stream whose gateway side has taken none of its response for this long (its
    /// client, or a hop, does not read): the idle timeout then counts only the engine's
    /// own silence, and a gateway's `stalled` abort is deferred while the drain
    /// progresses (`off`: the idle timeout counts from the last data event, whoever is
    /// slow, and every abort is carried out).
    #[arg(long, env = "KVGUARD_READER_TIMEOUT", default_value = "90s")]
    pub reader_timeout: String,
    /// Observe only: log and count what would be aborted, abort nothing.
    #[arg(long, env = "KVGUARD_DRY_RUN", default_value_t = false)]
    pub dry_run: bool,
    /// Engine metrics, NVML and /proc sampling period.
    #[arg(long, env = "KVGUARD_SAMPLE_INTERVAL", default_value = "5s")]
    pub sample_interval: String,
    /// How long an abort for an unknown id keeps refusing that id.
    #[arg(long, env = "KVGUARD_TOMBSTONE_TTL", default_value = "60s")]
    pub tombstone_ttl: String,
    /// Most tombstones kept (the oldest are evicted first).
    #[arg(long, env = "KVGUARD_MAX_TOMBSTONES", default_value_t = 100_000)]
    pub max_tombstones: usize,
    /// On SIGTERM/SIGINT: how long in-flight requests may finish before they are ended.
    #[arg(long, env = "KVGUARD_DRAIN_TIMEOUT", default_value = "30s")]
    pub drain_timeout: String,
    /// A sample is a quiet checkpoint when at most this many requests are in flight.
    #[arg(long, env = "KVGUARD_QUIET_MAX_INFLIGHT", default_value_t = 0)]
    pub quiet_max_inflight: usize,
    /// The engine's pid on this host (or in a pod sharing its process namespace): the open
    /// fds and RSS of it and its descendant processes (vLLM V1's EngineCore) are exported.
    #[arg(long, env = "KVGUARD_ENGINE_PID")]
    pub engine_pid: Option<u32>,
    /// Most requests in flight; more are answered 503.
    #[arg(long, env = "KVGUARD_MAX_INFLIGHT", default_value_t = 4096)]
    pub max_inflight: usize,
    /// Largest request body proxied to the engine, in bytes.
    #[arg(long, env = "KVGUARD_MAX_REQUEST_BODY", default_value_t = 16 * 1024 * 1024)]
    pub max_request_body: usize,
    /// Log format.
    #[arg(long, env = "KVGUARD_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// Log filter (tracing-subscriber EnvFilter syntax).
    #[arg(long, env = "KVGUARD_LOG", default_value = "info")]
    pub log: String,
    /// Write the bound addresses as JSON `{"proxy":"ip:port","admin":"ip:port"}` here.
    #[arg(long, env = "KVGUARD_ADDR_FILE")]
    pub addr_file: Option<PathBuf>,
    /// Tokio worker threads (default: the CPUs available, at most 4).
    #[arg(long, env = "KVGUARD_WORKER_THREADS")]
    pub worker_threads: Option<usize>,
    /// Do not load NVML (machines where it must not be touched).
    #[arg(long, env = "KVGUARD_NO_NVML", default_value_t = false)]
    pub no_nvml: bool,
    /// Serve `GET /v1/requests` (the ids in flight, their paths and progress) on the admin
    /// listener; off by default: the ids are the abort API's targets.
    #[arg(long, env = "KVGUARD_LIST_REQUESTS", default_value_t = false)]
    pub list_requests: bool,
    /// After kvguard ends a request, how long its client may take to read the end (the
    /// final SSE event) before the downstream side is cut: the HTTP/2 stream is reset,
    /// an HTTP/1.1 connection closed.
    #[arg(long, env = "KVGUARD_ABORT_FLUSH_TIMEOUT", default_value = "2s")]
    pub abort_flush_timeout: String,
    /// Liveness leases of gateways (contract §8): `enforce` ends the in-flight requests
    /// of a gateway that is dead (its renewals on both paths silent for the TTL, once its
    /// data path has carried renewals; or replaced on its host), reason `gateway_lost`;
    /// `observe` (the rollout step) judges and counts only; `off` ignores renewals.
    #[arg(
        long,
        env = "KVGUARD_LEASE_MODE",
        value_enum,
        default_value = "enforce"
    )]
    pub lease_mode: LeaseMode,
    /// A gateway's lease expires after this long with no renewal and no request from it
    /// (the filter renews every `lease_renew_ms`; a renewal whose period is over a third
    /// of this is refused, 422).
    #[arg(long, env = "KVGUARD_LEASE_TTL", default_value = "30s")]
    pub lease_ttl: String,
    /// File holding the one key that signs the x-kvguard-control response stamp (watched
    /// like --secret-file). Required with --advertise unless the only key is KVGUARD_SECRET.
    #[arg(long, env = "KVGUARD_STAMP_KEY_FILE")]
    pub stamp_key_file: Option<PathBuf>,
    /// The other kvguard-control replicas in front of the same engines' gateways
    /// (contract §4, §8), comma-separated base URLs of their admin listeners
    /// (`http://host:port`). A name resolving to several addresses (a Kubernetes headless
    /// Service) names every one of them; this replica leaves itself out by
    /// `--peer-self`. An abort for an id not in flight here is forwarded to them, a
    /// renewal accepted here too (signed, one hop).
    #[arg(long, env = "KVGUARD_PEERS", value_delimiter = ',')]
    pub peers: Vec<String>,
    /// This replica's own admin address among `--peers` (IP literal and port), so it
    /// never forwards to itself. Default: `--advertise`, else `--admin-listen` when that
    /// is a specific address.
    #[arg(long, env = "KVGUARD_PEER_SELF")]
    pub peer_self: Option<String>,
    /// Prefill/decode disaggregation: `prefill` beside a prefill engine, `decode` beside a
    /// decode engine. With `--peers`, every abort reaching a replica with a role is fanned
    /// out to every peer (each leg of the request is ended); `none` fans out only aborts of
    /// requests whose body carried `kv_transfer_params`.
    #[arg(long, env = "KVGUARD_PD_ROLE", value_enum, default_value = "none")]
    pub pd_role: PdRole,
    /// Where a prefill replica sends the request that releases a finished prefill's held
    /// blocks (a decode engine's base URL, or the proxy listener of the kvguard-control
    /// beside it): the decode engine rejects it and tells the prefill engine to let go.
    #[arg(long, env = "KVGUARD_PD_DECODE_URL")]
    pub pd_decode_url: Option<String>,
    /// How long a finished prefill's blocks stay held for the decode side at most (the
    /// prefill engine's lease: vLLM NixlConnector `kv_lease_duration`, 30 s); a hand-off
    /// is remembered this long.
    #[arg(long, env = "KVGUARD_PD_KV_LEASE", default_value = "30s")]
    pub pd_kv_lease: String,
    /// File holding the engine's API key (vLLM --api-key), sent as `Authorization: Bearer`
    /// on kvguard-control's own calls to the engine (abort API, metrics, health).
    #[arg(long, env = "KVGUARD_ENGINE_API_KEY_FILE")]
    pub engine_api_key_file: Option<PathBuf>,
}

/// A flag that failed validation: exit 64 naming it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The flag, e.g. `--max-age`.
    pub flag: &'static str,
    /// What is wrong and what is allowed.
    pub message: String,
}

impl ConfigError {
    fn new(flag: &'static str, message: impl Into<String>) -> Self {
        ConfigError {
            flag,
            message: message.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.flag, self.message)
    }
}

impl std::error::Error for ConfigError {}

/// An `http://host:port` base (no path), as the proxy dials it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineUrl {
    /// `host:port` (port defaulted to 80).
    pub authority: String,
    /// The base as text, no trailing slash.
    pub base: String,
}

impl EngineUrl {
    /// Validates an engine base URL: `http://`, a host, no path, query or user info.
    pub fn try_new(flag: &'static str, s: &str) -> Result<Self, ConfigError> {
        let uri: Uri = s
            .parse()
            .map_err(|e| ConfigError::new(flag, format!("{s:?} is not a URL: {e}")))?;
        if uri.scheme_str() != Some("http") {
            return Err(ConfigError::new(
                flag,
                format!("{s:?}: only http:// is supported (the engine is local)"),
            ));
        }
        let auth = uri
            .authority()
            .ok_or_else(|| ConfigError::new(flag, format!("{s:?} has no host")))?;
        if auth.as_str().contains('@') {
            return Err(ConfigError::new(
                flag,
                format!("{s:?}: no user info allowed"),
            ));
        }
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            return Err(ConfigError::new(
                flag,
                format!("{s:?}: give the base URL only, without a path or query"),
            ));
        }
        let authority = match auth.port_u16() {
            Some(_) => auth.as_str().to_owned(),
            None => format!("{}:80", auth.host()),
        };
        Ok(EngineUrl {
            base: format!("http://{}", auth.as_str()),
            authority,
        })
    }
}

/// A full `http://` URL (metrics, health).
fn http_url(flag: &'static str, s: &str) -> Result<Uri, ConfigError> {
    let uri: Uri = s
        .parse()
        .map_err(|e| ConfigError::new(flag, format!("{s:?} is not a URL: {e}")))?;
    if uri.scheme_str() != Some("http") || uri.authority().is_none() {
        return Err(ConfigError::new(
            flag,
            format!("{s:?}: an http:// URL with a host is required"),
        ));
    }
    Ok(uri)
}

/// Parses a duration in humantime form; `off` or `0` means disabled (`None`).
pub fn parse_optional_duration(
    flag: &'static str,
    s: &str,
) -> Result<Option<Duration>, ConfigError> {
    let t = s.trim();
    if t.eq_ignore_ascii_case("off") || t == "0" {
        return Ok(None);
    }
    let d = humantime::parse_duration(t).map_err(|e| {
        ConfigError::new(
            flag,
            format!("{s:?} is not a duration ({e}); use e.g. 15m, 120s, 500ms, or off"),
        )
    })?;
    Ok(if d.is_zero() { None } else { Some(d) })
}

fn parse_required_duration(flag: &'static str, s: &str) -> Result<Duration, ConfigError> {
    parse_optional_duration(flag, s)?
        .ok_or_else(|| ConfigError::new(flag, format!("{s:?}: must be a positive duration")))
}

fn parse_listen(flag: &'static str, s: &str) -> Result<SocketAddr, ConfigError> {
    s.trim().parse().map_err(|_| {
        ConfigError::new(
            flag,
            format!("{s:?} is not an IP:port (e.g. 0.0.0.0:8001, [::]:8001)"),
        )
    })
}

/// Validates `--advertise`: an IP literal and a non-zero port, not an unspecified address
/// (Envoy's ORIGINAL_DST override accepts only an IP literal and port).
pub fn parse_advertise(s: &str) -> Result<SocketAddr, ConfigError> {
    const FLAG: &str = "--advertise";
    let addr: SocketAddr = s.trim().parse().map_err(|_| {
        ConfigError::new(
            FLAG,
            format!("{s:?} must be an IP literal and port, e.g. 10.0.0.7:9902 or [fd00::1]:9902"),
        )
    })?;
    if addr.port() == 0 {
        return Err(ConfigError::new(
            FLAG,
            format!("{s:?}: port 0 is not routable"),
        ));
    }
    if addr.ip().is_unspecified() {
        return Err(ConfigError::new(
            FLAG,
            format!("{s:?}: an unspecified address (0.0.0.0, ::) is not routable"),
        ));
    }
    Ok(addr)
}

/// Parses a secret file: one key per line, blank lines and `#` comments skipped.
pub fn parse_secret_file(text: &[u8]) -> Result<Vec<Key>, ConfigError> {
    let mut keys = Vec::new();
    for (i, line) in text.split(|b| *b == b'\n').enumerate() {
        let l = line.trim_ascii();
        if l.is_empty() || l.starts_with(b"#") {
            continue;
        }
        let key = Key::try_new(l)
            .map_err(|e| ConfigError::new("--secret-file", format!("line {}: {e}", i + 1)))?;
        keys.push(key);
    }
    if keys.is_empty() {
        return Err(ConfigError::new("--secret-file", "the file holds no key"));
    }
    Ok(keys)
}

/// Reads one file of keys (`--secret-file`, `--stamp-key-file`), naming `flag` on error.
fn read_key_file(flag: &'static str, path: &Path) -> Result<Vec<Key>, ConfigError> {
    let text = std::fs::read(path)
        .map_err(|e| ConfigError::new(flag, format!("cannot read {}: {e}", path.display())))?;
    parse_secret_file(&text).map_err(|e| ConfigError::new(flag, e.message))
}

/// The keys accepted on abort calls: `--secret-file`'s, then `KVGUARD_SECRET`.
pub fn accepted_keys(
    secret_file: Option<&Path>,
    env_key: Option<&Key>,
) -> Result<Vec<Key>, ConfigError> {
    let mut keys = match secret_file {
        Some(p) => read_key_file("--secret-file", p)?,
        None => Vec::new(),
    };
    keys.extend(env_key.cloned());
    Ok(keys)
}

/// The stamp-signing key: `--stamp-key-file` holds exactly one.
pub fn read_stamp_key(path: &Path) -> Result<Key, ConfigError> {
    const FLAG: &str = "--stamp-key-file";
    let mut keys = read_key_file(FLAG, path)?;
    match (keys.pop(), keys.is_empty()) {
        (Some(k), true) => Ok(k),
        _ => Err(ConfigError::new(
            FLAG,
            format!("{} must hold exactly one key", path.display()),
        )),
    }
}

/// The engine's API key: the file's content, trimmed, one line, printable ASCII.
pub fn read_engine_api_key(path: &Path) -> Result<String, ConfigError> {
    const FLAG: &str = "--engine-api-key-file";
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::new(FLAG, format!("cannot read {}: {e}", path.display())))?;
    let key = text.trim();
    if key.is_empty() || !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ConfigError::new(
            FLAG,
            format!("{}: one line of printable ASCII expected", path.display()),
        ));
    }
    Ok(key.to_owned())
}

/// What the lease does when it expires (`--lease-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LeaseMode {
    /// No lease handling: renewals are answered 404, requests' instances ignored.
    Off,
    /// Expiries are judged, logged and counted; nothing is ended (the rollout step).
    Observe,
    /// An expiry ends every in-flight request of the instance (reason `gateway_lost`).
    Enforce,
}

impl LeaseMode {
    /// The flag value.
    pub const fn as_str(self) -> &'static str {
        match self {
            LeaseMode::Off => "off",
            LeaseMode::Observe => "observe",
            LeaseMode::Enforce => "enforce",
        }
    }

    /// The mode leases are judged in; `None`: `off`, not judged.
    pub const fn judged(self) -> Option<kvguard_control_core::lease::Mode> {
        use kvguard_control_core::lease::Mode;
        match self {
            LeaseMode::Off => None,
            LeaseMode::Observe => Some(Mode::Observe),
            LeaseMode::Enforce => Some(Mode::Enforce),
        }
    }
}

pub use kvguard_control_core::limits::Limits;

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Proxy listener.
    pub listen: SocketAddr,
    /// Admin listener.
    pub admin_listen: SocketAddr,
    /// Engine base.
    pub engine: EngineUrl,
    /// Engine metrics URL.
    pub engine_metrics_url: Uri,
    /// Engine health URL.
    pub engine_health_url: Uri,
    /// Stamp address, if any.
    pub advertise: Option<SocketAddr>,
    /// Accepted keys at start. Empty: every abort call is refused (401).
    pub keys: Vec<Key>,
    /// The key signing the response stamp at start.
    pub stamp_key: Option<Key>,
    /// `--secret-file`, watched for changes.
    pub secret_file: Option<PathBuf>,
    /// `--stamp-key-file`, watched for changes.
    pub stamp_key_file: Option<PathBuf>,
    /// `KVGUARD_SECRET` at start (kept across reloads of the files).
    pub env_key: Option<Key>,
    /// The engine's API key (`--engine-api-key-file`).
    pub engine_api_key: Option<String>,
    /// Abort strategy.
    pub abort_strategy: AbortStrategy,
    /// Reaper limits.
    pub limits: Limits,
    /// Observe only.
    pub dry_run: bool,
    /// Sampling period.
    pub sample_interval: Duration,
    /// Tombstone TTL.
    pub tombstone_ttl: Duration,
    /// Tombstone bound.
    pub max_tombstones: usize,
    /// Drain time on shutdown.
    pub drain_timeout: Duration,
    /// Quiet checkpoint threshold.
    pub quiet_max_inflight: usize,
    /// Engine pid for /proc figures.
    pub engine_pid: Option<u32>,
    /// In-flight bound.
    pub max_inflight: usize,
    /// Request body bound.
    pub max_request_body: usize,
    /// Log format.
    pub log_format: LogFormat,
    /// Log filter.
    pub log: String,
    /// Address file.
    pub addr_file: Option<PathBuf>,
    /// Worker threads.
    pub worker_threads: usize,
    /// Skip NVML.
    pub no_nvml: bool,
    /// Serve `GET /v1/requests`.
    pub list_requests: bool,
    /// Post-abort deadline before the downstream side is cut.
    pub abort_flush_timeout: Duration,
    /// Lease handling.
    pub lease_mode: LeaseMode,
    /// Lease TTL.
    pub lease_ttl: Duration,
    /// The other replicas (`--peers`), with this one's own address; `None` without peers.
    pub peers: Option<PeerConfig>,
    /// Most signatures the replay memory holds ([`MAX_REPLAY_ENTRIES`]; not a flag).
    pub max_replay_entries: usize,
    /// `--pd-role`.
    pub pd_role: PdRole,
    /// `--pd-decode-url`.
    pub pd_decode_url: Option<EngineUrl>,
    /// `--pd-kv-lease`.
    pub pd_kv_lease: Duration,
    /// Most hand-offs remembered ([`MAX_PD_HANDOFFS`]; not a flag).
    pub max_pd_handoffs: usize,
}

/// One `--peers` entry: a host (IP literal or DNS name) and a port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerUrl {
    /// Host as written (an IPv6 literal without brackets).
    pub host: String,
    /// Port.
    pub port: u16,
}

impl fmt::Display for PeerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "http://[{}]:{}", self.host, self.port)
        } else {
            write!(f, "http://{}:{}", self.host, self.port)
        }
    }
}

/// `--peers` and `--peer-self`, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerConfig {
    /// The replicas to forward to (this one is left out when a name resolves to it).
    pub urls: Vec<PeerUrl>,
    /// This replica's own admin address.
    pub self_addr: SocketAddr,
}

/// Parses one `--peers` entry: `http://host:port`, nothing after the port but an optional `/`.
pub fn parse_peer_url(s: &str) -> Result<PeerUrl, ConfigError> {
    const FLAG: &str = "--peers";
    let bad = |why: &str| {
        ConfigError::new(
            FLAG,
            format!("{s:?}: {why}; give comma-separated admin base URLs such as http://10.0.0.7:9902,http://kvguard-peers.ns.svc:9902"),
        )
    };
    let t = s.trim();
    let rest = t
        .strip_prefix("http://")
        .ok_or_else(|| bad("only http:// is supported"))?;
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains('/') || rest.contains('@') || rest.contains('?') {
        return Err(bad("a base URL has no path, user or query"));
    }
    let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
        let (h, p) = v6
            .split_once("]:")
            .ok_or_else(|| bad("the port is missing"))?;
        (h, p)
    } else {
        rest.rsplit_once(':')
            .ok_or_else(|| bad("the port is missing"))?
    };
    let port: u16 = port.parse().map_err(|_| bad("the port is not a number"))?;
    if port == 0 || host.is_empty() {
        return Err(bad("host and a non-zero port are required"));
    }
    Ok(PeerUrl {
        host: host.to_owned(),
        port,
    })
}

/// Most signatures remembered for replay detection.
pub const MAX_REPLAY_ENTRIES: usize = 100_000;

impl Config {
    /// Validates flags. `secret_env` is the value of `KVGUARD_SECRET`, if set.
    pub fn try_new(args: Args, secret_env: Option<Vec<u8>>) -> Result<Config, ConfigError> {
        let listen = parse_listen("--listen", &args.listen)?;
        let admin_listen = parse_listen("--admin-listen", &args.admin_listen)?;
        if listen == admin_listen && listen.port() != 0 {
            return Err(ConfigError::new(
                "--admin-listen",
                "must differ from --listen",
            ));
        }
        let engine = EngineUrl::try_new("--engine-url", &args.engine_url)?;
        let engine_metrics_url = match &args.engine_metrics_url {
            Some(u) => http_url("--engine-metrics-url", u)?,
            None => http_url("--engine-url", &format!("{}/metrics", engine.base))?,
        };
        let engine_health_url = match &args.engine_health_url {
            Some(u) => http_url("--engine-health-url", u)?,
            None => http_url("--engine-url", &format!("{}/health", engine.base))?,
        };
        let env_key = match secret_env {
            Some(s) => {
                Some(Key::try_new(&s).map_err(|e| ConfigError::new(SECRET_ENV, e.to_string()))?)
            }
            None => None,
        };
        let keys = accepted_keys(args.secret_file.as_deref(), env_key.as_ref())?;
        let advertise = match &args.advertise {
            Some(a) => Some(parse_advertise(a)?),
            None => None,
        };
        if advertise.is_some() && keys.is_empty() {
            return Err(ConfigError::new(
                "--advertise",
                "the stamp is signed: give --secret-file or KVGUARD_SECRET too",
            ));
        }
        let stamp_key =
            match (&args.stamp_key_file, advertise) {
                (Some(path), _) => Some(read_stamp_key(path)?),
                (None, Some(_)) if args.secret_file.is_none() => env_key.clone(),
                (None, Some(_)) => return Err(ConfigError::new(
                    "--advertise",
                    "name the key that signs the x-kvguard-control stamp with --stamp-key-file \
                     (with --secret-file the signing key is never guessed)",
                )),
                (None, None) => None,
            };
        let engine_api_key = match &args.engine_api_key_file {
            Some(path) => Some(read_engine_api_key(path)?),
            None => None,
        };
        let limits = Limits {
            max_age: parse_optional_duration("--max-age", &args.max_age)?,
            idle_timeout: parse_optional_duration("--idle-timeout", &args.idle_timeout)?,
            first_token_timeout: parse_optional_duration(
                "--first-token-timeout",
                &args.first_token_timeout,
            )?,
            reader_timeout: parse_optional_duration("--reader-timeout", &args.reader_timeout)?,
        };
        let sample_interval = parse_required_duration("--sample-interval", &args.sample_interval)?;
        if sample_interval < Duration::from_millis(10) {
            return Err(ConfigError::new("--sample-interval", "at least 10ms"));
        }
        let tombstone_ttl = parse_required_duration("--tombstone-ttl", &args.tombstone_ttl)?;
        let drain_timeout =
            parse_optional_duration("--drain-timeout", &args.drain_timeout)?.unwrap_or_default();
        if args.max_tombstones == 0 {
            return Err(ConfigError::new("--max-tombstones", "must be at least 1"));
        }
        if args.max_inflight == 0 {
            return Err(ConfigError::new("--max-inflight", "must be at least 1"));
        }
        if args.max_request_body == 0 {
            return Err(ConfigError::new("--max-request-body", "must be at least 1"));
        }
        let abort_flush_timeout =
            parse_required_duration("--abort-flush-timeout", &args.abort_flush_timeout)?;
        let peer_urls = args
            .peers
            .iter()
            .filter(|p| !p.trim().is_empty())
            .map(|p| parse_peer_url(p))
            .collect::<Result<Vec<_>, _>>()?;
        let peers = if peer_urls.is_empty() {
            if args.peer_self.is_some() {
                return Err(ConfigError::new(
                    "--peer-self",
                    "only meaningful with --peers; give --peers too or drop it",
                ));
            }
            None
        } else {
            if keys.is_empty() {
                return Err(ConfigError::new(
                    "--peers",
                    "forwarded messages are signed: give --secret-file or KVGUARD_SECRET too",
                ));
            }
            let specific_admin = (!admin_listen.ip().is_unspecified() && admin_listen.port() != 0)
                .then_some(admin_listen);
            let self_addr = match &args.peer_self {
                Some(s) => Some(
                    parse_advertise(s).map_err(|e| ConfigError::new("--peer-self", e.message))?,
                ),
                None => advertise.or(specific_admin),
            };
            let Some(self_addr) = self_addr else {
                return Err(ConfigError::new(
                    "--peers",
                    "this replica must leave itself out of the list: give --peer-self <ip:port> (or --advertise, or a specific --admin-listen)",
                ));
            };
            Some(PeerConfig {
                urls: peer_urls,
                self_addr,
            })
        };
        let lease_ttl = parse_required_duration("--lease-ttl", &args.lease_ttl)?;
        if lease_ttl < Duration::from_millis(100) {
            return Err(ConfigError::new("--lease-ttl", "at least 100ms"));
        }
        let pd_decode_url = match &args.pd_decode_url {
            Some(u) => Some(EngineUrl::try_new("--pd-decode-url", u)?),
            None => None,
        };
        let pd_kv_lease = parse_required_duration("--pd-kv-lease", &args.pd_kv_lease)?;
        tracing_subscriber::EnvFilter::try_new(&args.log)
            .map_err(|e| ConfigError::new("--log", format!("{:?}: {e}", args.log)))?;
        let worker_threads = match args.worker_threads {
            Some(0) => return Err(ConfigError::new("--worker-threads", "must be at least 1")),
            Some(n) => n,
            None => std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
                .min(4),
        };
        Ok(Config {
            listen,
            admin_listen,
            engine,
            engine_metrics_url,
            engine_health_url,
            advertise,
            keys,
            abort_strategy: args.abort_strategy,
            limits,
            dry_run: args.dry_run,
            sample_interval,
            tombstone_ttl,
            max_tombstones: args.max_tombstones,
            drain_timeout,
            quiet_max_inflight: args.quiet_max_inflight,
            engine_pid: args.engine_pid,
            max_inflight: args.max_inflight,
            max_request_body: args.max_request_body,
            log_format: args.log_format,
            log: args.log,
            addr_file: args.addr_file,
            worker_threads,
            no_nvml: args.no_nvml,
            list_requests: args.list_requests,
            abort_flush_timeout,
            lease_mode: args.lease_mode,
            lease_ttl,
            max_replay_entries: MAX_REPLAY_ENTRIES,
            peers,
            pd_role: args.pd_role,
            pd_decode_url,
            pd_kv_lease,
            max_pd_handoffs: MAX_PD_HANDOFFS,
            stamp_key,
            secret_file: args.secret_file,
            stamp_key_file: args.stamp_key_file,
            env_key,
            engine_api_key,
        })
    }

    /// A configuration for tests: loopback port 0 listeners, the given engine, defaults
    /// elsewhere, these keys (the first also signs stamps).
    pub fn for_tests(engine_url: &str, keys: Vec<Key>) -> Result<Config, ConfigError> {
        let args = Args::try_parse_from([
            "kvguard-control",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--engine-url",
            engine_url,
            "--no-nvml",
        ])
        .map_err(|e| ConfigError::new("args", e.to_string()))?;
        let mut c = Config::try_new(args, None)?;
        // Tests read the table.
        c.list_requests = true;
        c.stamp_key = keys.first().cloned();
        c.keys = keys;
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> Args {
        let mut v = vec!["kvguard-control"];
        v.extend_from_slice(extra);
        Args::try_parse_from(v).unwrap()
    }

    #[test]
    fn defaults() {
        let c = Config::try_new(args(&[]), None).unwrap();
        assert_eq!(c.listen.to_string(), "0.0.0.0:8001");
        assert_eq!(c.admin_listen.to_string(), "0.0.0.0:9902");
        assert_eq!(c.engine.authority, "127.0.0.1:8000");
        assert_eq!(
            c.engine_metrics_url.to_string(),
            "http://127.0.0.1:8000/metrics"
        );
        assert_eq!(
            c.limits.max_age, None,
            "no default may cut a progressing stream"
        );
        assert_eq!(c.limits.idle_timeout, Some(Duration::from_secs(120)));
        assert_eq!(c.limits.first_token_timeout, None);
        assert_eq!(c.limits.reader_timeout, Some(Duration::from_secs(90)));
        assert_eq!(c.sample_interval, Duration::from_secs(5));
        assert_eq!(c.tombstone_ttl, Duration::from_secs(60));
        assert_eq!(c.drain_timeout, Duration::from_secs(30));
        assert_eq!(c.abort_strategy, AbortStrategy::Connection);
        assert!(c.keys.is_empty());
        assert!(!c.dry_run);
        assert!(
            !c.list_requests,
            "the in-flight ids are not listed unless asked"
        );
        assert_eq!(c.abort_flush_timeout, Duration::from_secs(2));
    }

    #[test]
    fn peers_are_validated_and_need_keys_and_an_identity() {
        let sf = "peers-test-secret";
        let dir = std::env::temp_dir().join(format!("kvguard-peers-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let secret = dir.join(sf);
        std::fs::write(&secret, "0123456789abcdef0123\n").unwrap();
        let secret = secret.to_str().unwrap();
        let ok = Config::try_new(
            args(&[
                "--peers",
                "http://10.0.0.2:9902,http://kvguard-peers.ns.svc:9902/, http://[fd00::3]:9902",
                "--admin-listen",
                "10.0.0.1:9902",
                "--secret-file",
                secret,
            ]),
            None,
        )
        .unwrap();
        let p = ok.peers.unwrap();
        assert_eq!(p.self_addr.to_string(), "10.0.0.1:9902");
        assert_eq!(
            p.urls.iter().map(ToString::to_string).collect::<Vec<_>>(),
            [
                "http://10.0.0.2:9902",
                "http://kvguard-peers.ns.svc:9902",
                "http://[fd00::3]:9902"
            ]
        );
        for (extra, flag, part) in [
            (
                vec![
                    "--peers",
                    "https://10.0.0.2:9902",
                    "--peer-self",
                    "10.0.0.1:9902",
                ],
                "--peers",
                "http://",
            ),
            (
                vec!["--peers", "http://10.0.0.2", "--peer-self", "10.0.0.1:9902"],
                "--peers",
                "port",
            ),
            (
                vec![
                    "--peers",
                    "http://10.0.0.2:9902/v1",
                    "--peer-self",
                    "10.0.0.1:9902",
                ],
                "--peers",
                "path",
            ),
            (
                vec!["--peers", "http://10.0.0.2:9902"],
                "--peers",
                "--peer-self",
            ),
            (
                vec!["--peers", "http://10.0.0.2:9902", "--peer-self", "pod:1"],
                "--peer-self",
                "IP literal",
            ),
            (
                vec!["--peer-self", "10.0.0.1:9902"],
                "--peer-self",
                "--peers",
            ),
        ] {
            let mut a = extra.clone();
            a.extend(["--secret-file", secret]);
            let e = Config::try_new(args(&a), None).unwrap_err();
            assert_eq!(e.flag, flag, "{extra:?}: {e}");
            assert!(e.message.contains(part), "{extra:?}: {e}");
        }
        let e = Config::try_new(
            args(&[
                "--peers",
                "http://10.0.0.2:9902",
                "--peer-self",
                "10.0.0.1:9902",
            ]),
            None,
        )
        .unwrap_err();
        assert_eq!(e.flag, "--peers");
        assert!(e.message.contains("signed"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn bad_flags_name_the_flag() {
        let cases: &[(&[&str], &str)] = &[
            (&["--max-age", "soon"], "--max-age"),
            (&["--idle-timeout", "5 parsecs"], "--idle-timeout"),
            (&["--listen", "localhost:80"], "--listen"),
            (&["--engine-url", "https://x:1"], "--engine-url"),
            (&["--engine-url", "http://x:1/v1"], "--engine-url"),
            (
                &["--engine-metrics-url", "ftp://x/metrics"],
                "--engine-metrics-url",
            ),
            (&["--advertise", "pod.local:9902"], "--advertise"),
            (&["--advertise", "0.0.0.0:9902"], "--advertise"),
            (&["--sample-interval", "off"], "--sample-interval"),
            (&["--tombstone-ttl", "0"], "--tombstone-ttl"),
            (&["--max-inflight", "0"], "--max-inflight"),
            (&["--secret-file", "/nonexistent/kvguard"], "--secret-file"),
            (&["--abort-flush-timeout", "off"], "--abort-flush-timeout"),
            (&["--stamp-key-file", "/nonexistent/k"], "--stamp-key-file"),
            (
                &["--engine-api-key-file", "/nonexistent/k"],
                "--engine-api-key-file",
            ),
        ];
        for (a, flag) in cases {
            let e = Config::try_new(args(a), None).unwrap_err();
            assert_eq!(e.flag, *flag, "{a:?}: {e}");
        }
        // --advertise needs a key.
        let e = Config::try_new(args(&["--advertise", "10.0.0.7:9902"]), None).unwrap_err();
        assert_eq!(e.flag, "--advertise");
        let e = Config::try_new(args(&[]), Some(b"short".to_vec())).unwrap_err();
        assert_eq!(e.flag, SECRET_ENV);
    }

    #[test]
    fn durations_and_off() {
        assert_eq!(parse_optional_duration("--x", "off").unwrap(), None);
        assert_eq!(parse_optional_duration("--x", "0").unwrap(), None);
        assert_eq!(parse_optional_duration("--x", "0s").unwrap(), None);
        assert_eq!(
            parse_optional_duration("--x", "15m").unwrap(),
            Some(Duration::from_secs(900))
        );
        assert_eq!(
            parse_optional_duration("--x", "250ms").unwrap(),
            Some(Duration::from_millis(250))
        );
        let c = Config::try_new(
            args(&["--first-token-timeout", "30s", "--max-age", "off"]),
            None,
        )
        .unwrap();
        assert_eq!(c.limits.first_token_timeout, Some(Duration::from_secs(30)));
        assert_eq!(c.limits.max_age, None);
    }

    #[test]
    fn secrets_and_advertise() {
        let keys = parse_secret_file(
            b"# rotation\nkvguard-new-key-0123456789\n\n  kvguard-old-key-0123456789  \n",
        )
        .unwrap();
        assert_eq!(keys.len(), 2);
        let e = parse_secret_file(b"kvguard-new-key-0123456789\nshort\n").unwrap_err();
        assert!(e.message.contains("line 2"), "{e}");
        assert!(parse_secret_file(b"\n# none\n").is_err());
        let c = Config::try_new(
            args(&["--advertise", "[fd00::1]:9902"]),
            Some(b"kvguard-env-key-0123456789\n".to_vec()),
        )
        .unwrap();
        assert_eq!(c.keys.len(), 1);
        assert_eq!(
            c.stamp_key,
            c.keys.first().cloned(),
            "the only key, from the environment"
        );
        assert_eq!(c.advertise.unwrap().port(), 9902);
        assert!(parse_advertise("10.0.0.1:0").is_err());
        // With a secret file the signing key is named, never guessed.
        let dir = std::env::temp_dir().join(format!("kvguard-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let secrets = dir.join("secrets");
        let stamp = dir.join("stamp");
        std::fs::write(
            &secrets,
            "kvguard-new-key-0123456789\nkvguard-old-key-0123456789\n",
        )
        .unwrap();
        std::fs::write(&stamp, "kvguard-old-key-0123456789\n").unwrap();
        let (sf, kf) = (secrets.to_str().unwrap(), stamp.to_str().unwrap());
        let e = Config::try_new(
            args(&["--advertise", "10.0.0.7:9902", "--secret-file", sf]),
            None,
        )
        .unwrap_err();
        assert_eq!(e.flag, "--advertise");
        assert!(e.message.contains("--stamp-key-file"), "{e}");
        let c = Config::try_new(
            args(&[
                "--advertise",
                "10.0.0.7:9902",
                "--secret-file",
                sf,
                "--stamp-key-file",
                kf,
            ]),
            None,
        )
        .unwrap();
        assert_eq!(c.keys.len(), 2);
        assert_eq!(c.stamp_key, Some(c.keys[1].clone()));
        // A stamp file with two keys is refused.
        let e = Config::try_new(args(&["--stamp-key-file", sf]), None).unwrap_err();
        assert_eq!(e.flag, "--stamp-key-file");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn env_vars_are_read() {
        // clap's `env` is exercised through the real binary test; here just the strategy names.
        let c = Config::try_new(args(&["--abort-strategy", "vllm-scale-out"]), None).unwrap();
        assert_eq!(c.abort_strategy, AbortStrategy::VllmScaleOut);
        assert_eq!(c.abort_strategy.as_str(), "vllm-scale-out");
        assert!(Args::try_parse_from(["kvguard-control", "--abort-strategy", "nope"]).is_err());
    }
}
