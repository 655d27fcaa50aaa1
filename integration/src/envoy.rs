//! Runs a real Envoy (1.40, from `paths::envoy_bin()`) for a test: writes a bootstrap to a
//! temp dir, starts Envoy with the admin and listener on port 0, reads both back, and
//! waits for `/ready`. With `filter_config: Some(..)` the kvguard wasm filter is loaded;
//! with `None` it is a plain Envoy.
//!
//! The bootstrap (see [`bootstrap`]) has one listener (`ingress`, HCM with `codec_type:
//! AUTO` so HTTP/1.1 and h2c both work, `generate_request_id: true`,
//! `preserve_external_request_id: false`, `use_remote_address: true`, an
//! `internal_address_config` with no CIDRs so that loopback clients do not keep their own
//! ids, one route `/` → cluster `upstream` with `timeout: 0s`), the `upstream` cluster,
//! the control cluster (`kvguard_control`) when an abort target is given, and optionally
//! an ORIGINAL_DST cluster (`use_http_header: true`) for per-replica aborts.
//!
//! Hot restart (`hot_restart: true`): epoch 0 picks a free base id
//! (`--use-dynamic-base-id`); [`Envoy::hot_restart`] starts the next epoch with it and the
//! listener ports pinned. The PyPI build supports it (shared memory in `/dev/shm`,
//! abstract unix sockets); Envoy leaves its `/dev/shm/envoy_shared_memory_<id>` region
//! behind, so the harness removes it when the family's last epoch is dropped.

use crate::proc::ChildGuard;
use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

/// The wasm filter's name, root id and vm id in generated bootstraps.
pub const FILTER_NAME: &str = "kvguard";
/// Default name of the abort cluster (`control_cluster` in the filter config).
pub const CONTROL_CLUSTER: &str = "kvguard_control";
/// Default name of the ORIGINAL_DST cluster (`control_target_cluster`).
pub const CONTROL_TARGET_CLUSTER: &str = "kvguard_control_target";
/// Name of the upstream cluster.
pub const UPSTREAM_CLUSTER: &str = "upstream";
/// Access log format written to Envoy's stdout (so into [`Envoy::log`]).
pub const ACCESS_LOG_FORMAT: &str = "ACCESS [%START_TIME%] \"%REQ(:METHOD)% %REQ(:PATH)% %PROTOCOL%\" %RESPONSE_CODE% %RESPONSE_FLAGS% %RESPONSE_CODE_DETAILS% id=%REQ(X-REQUEST-ID)% dur=%DURATION% rx=%BYTES_RECEIVED% tx=%BYTES_SENT% outcome=%FILTER_STATE(wasm.kvguard.outcome:PLAIN)%\n";

/// The CIDR the generated `internal_address_config` pins (`255.255.255.255/32`: no client
/// comes from it), so that every client, loopback included, is external.
pub static NO_CLIENT_CIDR: std::sync::LazyLock<Value> =
    std::sync::LazyLock::new(|| json!({"address_prefix": "255.255.255.255", "prefix_len": 32}));

/// A function that edits the generated bootstrap before it is written.
pub type BootstrapPatch = Arc<dyn Fn(&mut Value) + Send + Sync>;

/// What Envoy to run.
#[derive(Clone)]
pub struct EnvoyOptions {
    /// The filter's JSON configuration; `None` runs Envoy without the filter.
    pub filter_config: Option<Value>,
    /// The wasm module; `None` = [`crate::paths::wasm_path`] (only read with a filter).
    pub wasm_path: Option<PathBuf>,
    /// Environment variables of the wasm VM (`vm_config.environment_variables.key_values`).
    pub vm_env: BTreeMap<String, String>,
    /// `failure_policy` of the wasm plugin (`FAIL_OPEN`, `FAIL_CLOSED`, `FAIL_RELOAD`).
    pub failure_policy: String,
    /// Where the route sends traffic (the simulator, control, a lossy hop).
    pub upstream: SocketAddr,
    /// Speak h2c to the upstream (default HTTP/1.1).
    pub upstream_http2: bool,
    /// The abort endpoint (receiver or control admin) behind `control_cluster_name`.
    pub control: Option<SocketAddr>,
    /// Name of the abort cluster.
    pub control_cluster_name: String,
    /// Add an ORIGINAL_DST cluster of this name (`use_http_header: true`).
    pub original_dst_cluster: Option<String>,
    /// `--concurrency` (worker threads, so wasm VMs).
    pub concurrency: u32,
    /// `-l`.
    pub log_level: String,
    /// `--component-log-level` (e.g. `wasm:debug`); `None` = not passed.
    pub component_log_level: Option<String>,
    /// HCM `stream_idle_timeout`; `None` = Envoy's default (5 min).
    pub stream_idle_timeout: Option<Duration>,
    /// `per_connection_buffer_limit_bytes` on the listener and the upstream cluster.
    pub per_connection_buffer_limit_bytes: Option<u32>,
    /// `SO_SNDBUF` of the listener socket (accepted sockets inherit it): with a small
    /// value and `per_connection_buffer_limit_bytes`, a client that stops reading
    /// back-pressures Envoy's upstream reads within a few tens of KB.
    pub downstream_sndbuf: Option<u32>,
    /// Edits the bootstrap JSON before it is written (the raw hook for special cases).
    pub patch: Option<BootstrapPatch>,
    /// YAML merged over the bootstrap by Envoy itself (`--config-yaml`; repeated fields
    /// such as clusters are appended).
    pub extra_yaml: Option<String>,
    /// Extra command-line arguments (the harness passes `--file-flush-interval-msec 100`
    /// unless this sets it).
    pub extra_args: Vec<String>,
    /// Access log on stdout with [`ACCESS_LOG_FORMAT`].
    pub access_log: bool,
    /// Bound on start-up (admin address, `/ready`, listener read-back).
    pub ready_timeout: Duration,
    /// Run with hot restart enabled (epoch 0: `--use-dynamic-base-id`, so that parallel
    /// tests never share a base id; [`Envoy::hot_restart`] starts the next epoch). `false`
    /// = `--disable-hot-restart`.
    pub hot_restart: bool,
    /// `--drain-time-s` (0 by default): how long this Envoy drains its connections
    /// (HTTP/1.1 `connection: close`, HTTP/2 GOAWAY) once the next hot-restart epoch tells
    /// it to. Give every epoch the same flags.
    pub drain_time_s: u64,
    /// `--parent-shutdown-time-s`: how long after it is up a new epoch lets the previous
    /// one live. `None` = not passed (Envoy's default: 900 s).
    pub parent_shutdown_time_s: Option<u64>,
    /// `--drain-strategy` (`gradual`, Envoy's default, or `immediate`); `None` = not passed.
    pub drain_strategy: Option<String>,
    /// Environment variables of the Envoy process itself (e.g. `LD_PRELOAD`, see
    /// [`crate::clock_shim`]); the VM sees none of them unless `vm_env` says so.
    pub process_env: BTreeMap<String, String>,
    /// Serve the listeners from files instead of `static_resources` (LDS over a watched
    /// directory, see [`DynamicListeners`]).
    pub dynamic_listeners: Option<DynamicListeners>,
    /// The bootstrap's `node.id` (the filter's lease host key derives from it: two
    /// Envoys with the same id are one host, e.g. a restart in place). `None`: no node,
    /// so no host key.
    pub node_id: Option<String>,
    /// The program (and its leading arguments) that runs Envoy in place of
    /// `paths::envoy_bin()`, Envoy's own arguments appended: e.g. Valgrind and its flags
    /// followed by Envoy's ELF file. `None`: Envoy itself.
    pub command: Option<Vec<String>>,
}

/// Listeners served by LDS from a file in a watched directory: Envoy loads
/// `<dir>/lds.json` at start and again whenever a file is moved into `<dir>`, so
/// [`DynamicListeners::update`] (write a new file, rename it over) is a config push.
#[derive(Debug, Clone)]
pub struct DynamicListeners {
    dir: Arc<tempfile::TempDir>,
    version: Arc<std::sync::atomic::AtomicU64>,
}

impl DynamicListeners {
    /// A fresh directory.
    pub fn new() -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("kvguard-lds-").tempdir()?;
        Ok(DynamicListeners {
            dir: Arc::new(dir),
            version: Arc::new(std::sync::atomic::AtomicU64::new(0)),
        })
    }

    /// The file Envoy reads.
    pub fn path(&self) -> PathBuf {
        self.dir.path().join("lds.json")
    }

    /// The listeners now served.
    pub fn listeners(&self) -> Result<Vec<Value>> {
        let v: Value = serde_json::from_slice(&std::fs::read(self.path())?)?;
        Ok(v.get("resources")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default())
    }

    /// Writes `listeners` to a new file and renames it over `lds.json` (atomic: Envoy never
    /// reads a half-written file).
    pub fn write(&self, listeners: &[Value]) -> Result<()> {
        let version = self
            .version
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            + 1;
        let resources: Vec<Value> = listeners
            .iter()
            .map(|l| {
                let mut l = l.clone();
                l["@type"] = json!("type.googleapis.com/envoy.config.listener.v3.Listener");
                l
            })
            .collect();
        let doc = json!({"version_info": version.to_string(), "resources": resources});
        let tmp = self.dir.path().join(format!(".lds.{version}.json"));
        std::fs::write(&tmp, serde_json::to_vec_pretty(&doc)?)?;
        std::fs::rename(&tmp, self.path()).context("renaming the new LDS file into place")?;
        Ok(())
    }

    /// A config push: edits the listeners now served and writes them back.
    pub fn update(&self, edit: impl FnOnce(&mut Vec<Value>)) -> Result<()> {
        let mut l = self.listeners()?;
        edit(&mut l);
        self.write(&l)
    }

    /// Moves the bootstrap's static listeners into the LDS file.
    fn take_over(&self, boot: &mut Value) -> Result<()> {
        let listeners = boot
            .pointer_mut("/static_resources/listeners")
            .map(Value::take)
            .and_then(|v| v.as_array().cloned())
            .unwrap_or_default();
        if let Some(sr) = boot
            .get_mut("static_resources")
            .and_then(Value::as_object_mut)
        {
            sr.remove("listeners");
        }
        self.write(&listeners)?;
        // xDS (file-based too) needs a node identity.
        if boot.get("node").is_none() {
            boot["node"] = json!({"id": "kvguard-test", "cluster": "kvguard-test"});
        }
        boot["dynamic_resources"] = json!({"lds_config": {
            "resource_api_version": "V3",
            "path_config_source": {
                "path": self.path().display().to_string(),
                "watched_directory": {"path": self.dir.path().display().to_string()}
            }
        }});
        Ok(())
    }
}

/// The kvguard filter's JSON configuration inside a listener (the first HCM's wasm
/// filter), for editing in [`DynamicListeners::update`].
pub fn listener_filter_config(listener: &mut Value) -> Option<(&mut Value, Value)> {
    let filters = listener
        .pointer_mut("/filter_chains/0/filters/0/typed_config/http_filters")?
        .as_array_mut()?;
    let f = filters
        .iter_mut()
        .find(|f| f.get("name").and_then(Value::as_str) == Some(FILTER_NAME))?;
    let value = f.pointer_mut("/typed_config/config/configuration/value")?;
    let parsed = serde_json::from_str(value.as_str()?).ok()?;
    Some((value, parsed))
}

impl EnvoyOptions {
    /// A plain Envoy (no filter) in front of `upstream`.
    pub fn new(upstream: SocketAddr) -> Self {
        EnvoyOptions {
            filter_config: None,
            wasm_path: None,
            vm_env: BTreeMap::new(),
            failure_policy: "FAIL_OPEN".into(),
            upstream,
            upstream_http2: false,
            control: None,
            control_cluster_name: CONTROL_CLUSTER.into(),
            original_dst_cluster: None,
            concurrency: 1,
            log_level: "info".into(),
            component_log_level: Some("wasm:debug".into()),
            stream_idle_timeout: None,
            per_connection_buffer_limit_bytes: None,
            downstream_sndbuf: None,
            patch: None,
            extra_yaml: None,
            extra_args: Vec::new(),
            access_log: true,
            ready_timeout: Duration::from_secs(60),
            hot_restart: false,
            drain_time_s: 0,
            parent_shutdown_time_s: None,
            drain_strategy: None,
            process_env: BTreeMap::new(),
            dynamic_listeners: None,
            node_id: None,
            command: None,
        }
    }

    /// Envoy with the kvguard filter (`config`) whose aborts go to `control`.
    pub fn with_filter(upstream: SocketAddr, control: SocketAddr, config: Value) -> Self {
        let mut o = Self::new(upstream);
        o.filter_config = Some(config);
        o.control = Some(control);
        o
    }

    /// Sets one VM environment variable.
    pub fn vm_env(mut self, key: &str, value: &str) -> Self {
        self.vm_env.insert(key.into(), value.into());
        self
    }
}

/// A small filter configuration: `control_cluster` = [`CONTROL_CLUSTER`],
/// `secret_env` = `KVGUARD_SECRET`, everything else default. Extend it in tests.
pub fn basic_filter_config() -> Value {
    json!({"control_cluster": CONTROL_CLUSTER, "secret_env": "KVGUARD_SECRET"})
}

fn socket(addr: SocketAddr) -> Value {
    json!({"socket_address": {"address": addr.ip().to_string(), "port_value": addr.port()}})
}

fn static_cluster(name: &str, addr: SocketAddr, http2: bool, buffer: Option<u32>) -> Value {
    let mut c = json!({
        "name": name,
        "type": "STATIC",
        "connect_timeout": "2s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": socket(addr)}}]}]
        }
    });
    if http2 {
        c["typed_extension_protocol_options"] = json!({
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}
            }
        });
    }
    if let Some(b) = buffer {
        c["per_connection_buffer_limit_bytes"] = json!(b);
    }
    c
}

fn duration(d: Duration) -> String {
    format!("{}.{:03}s", d.as_secs(), d.subsec_millis())
}

/// The bootstrap for `opts` (as JSON, which Envoy reads as YAML). `wasm` is the module
/// path used when a filter is configured.
pub fn bootstrap(opts: &EnvoyOptions, wasm: Option<&Path>) -> Result<Value> {
    let mut http_filters = Vec::new();
    if let Some(cfg) = &opts.filter_config {
        let wasm = wasm.context("a filter config needs a wasm path")?;
        http_filters.push(json!({
            "name": FILTER_NAME,
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
                "config": {
                    "name": FILTER_NAME,
                    "root_id": FILTER_NAME,
                    "failure_policy": opts.failure_policy,
                    "configuration": {
                        "@type": "type.googleapis.com/google.protobuf.StringValue",
                        "value": serde_json::to_string(cfg)?
                    },
                    "vm_config": {
                        "vm_id": FILTER_NAME,
                        "runtime": "envoy.wasm.runtime.v8",
                        "code": {"local": {"filename": wasm.display().to_string()}},
                        "environment_variables": {"key_values": opts.vm_env}
                    }
                }
            }
        }));
    }
    http_filters.push(json!({
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}
    }));
    let mut hcm = json!({
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "ingress_http",
        "codec_type": "AUTO",
        "generate_request_id": true,
        "preserve_external_request_id": false,
        "use_remote_address": true,
        // An empty `cidr_ranges` makes Envoy 1.40 treat loopback clients as internal (they
        // keep their x-request-id): pin one CIDR that no client can come from instead.
        "internal_address_config": {"unix_sockets": false, "cidr_ranges": [NO_CLIENT_CIDR.clone()]},
        "route_config": {
            "name": "local",
            "virtual_hosts": [{
                "name": "all",
                "domains": ["*"],
                "routes": [{"match": {"prefix": "/"}, "route": {"cluster": UPSTREAM_CLUSTER, "timeout": "0s"}}]
            }]
        },
        "http_filters": http_filters
    });
    if let Some(t) = opts.stream_idle_timeout {
        hcm["stream_idle_timeout"] = json!(duration(t));
    }
    if opts.access_log {
        hcm["access_log"] = json!([{
            "name": "envoy.access_loggers.stdout",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog",
                "log_format": {"text_format_source": {"inline_string": ACCESS_LOG_FORMAT}}
            }
        }]);
    }
    let mut listener = json!({
        "name": "ingress",
        "address": socket(SocketAddr::from(([127, 0, 0, 1], 0))),
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": hcm
        }]}]
    });
    if let Some(b) = opts.per_connection_buffer_limit_bytes {
        listener["per_connection_buffer_limit_bytes"] = json!(b);
    }
    if let Some(b) = opts.downstream_sndbuf {
        // SOL_SOCKET = 1, SO_SNDBUF = 7 on Linux.
        listener["socket_options"] =
            json!([{"level": 1, "name": 7, "int_value": b, "state": "STATE_PREBIND"}]);
    }
    let mut clusters = vec![static_cluster(
        UPSTREAM_CLUSTER,
        opts.upstream,
        opts.upstream_http2,
        opts.per_connection_buffer_limit_bytes,
    )];
    // The shipped edge.yaml's inference cluster thresholds (Envoy's default, 1,024, would
    // refuse streams past it with 503s).
    clusters[0]["circuit_breakers"] = json!({"thresholds": [{
        "max_connections": 10_000,
        "max_pending_requests": 10_000,
        "max_requests": 10_000,
        "max_retries": 3
    }]});
    if let Some(c) = opts.control {
        clusters.push(static_cluster(&opts.control_cluster_name, c, false, None));
    }
    if let Some(name) = &opts.original_dst_cluster {
        clusters.push(json!({
            "name": name,
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "2s",
            "original_dst_lb_config": {"use_http_header": true}
        }));
    }
    let mut b = json!({
        "admin": {"address": socket(SocketAddr::from(([127, 0, 0, 1], 0)))},
        "static_resources": {"listeners": [listener], "clusters": clusters}
    });
    if let Some(id) = &opts.node_id {
        b["node"] = json!({"id": id, "cluster": "kvguard-test"});
    }
    if let Some(p) = &opts.patch {
        p(&mut b);
    }
    Ok(b)
}

/// Removes a hot-restart family's shared memory region (`/dev/shm/envoy_shared_memory_<base
/// id × 10>`, which Envoy leaves behind) once the last epoch holding it is dropped.
#[derive(Debug)]
struct ShmCleanup(u64);

impl Drop for ShmCleanup {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(format!("/dev/shm/envoy_shared_memory_{}", self.0 * 10));
    }
}

/// The hot-restart identity of a running Envoy.
#[derive(Debug, Clone)]
struct HotState {
    base_id: u64,
    epoch: u32,
    _shm: Arc<ShmCleanup>,
}

/// A running Envoy; dropping it kills it.
pub struct Envoy {
    guard: ChildGuard,
    dir: Option<tempfile::TempDir>,
    admin: SocketAddr,
    listener: SocketAddr,
    bootstrap_path: PathBuf,
    opts: EnvoyOptions,
    // After `guard`: the region is removed once the process is gone.
    hot: Option<HotState>,
}

impl Envoy {
    /// Writes the bootstrap and starts Envoy; returns once `/ready` answers 200 and the
    /// listener's port is known.
    pub async fn start(opts: EnvoyOptions) -> Result<Envoy> {
        Self::start_epoch(opts, None, &BTreeMap::new()).await
    }

    /// Hot restart: starts the next epoch (same base id) with `opts` (usually
    /// [`Envoy::options`], edited), every listener that `opts` binds to port 0 pinned to
    /// the port this epoch's listener of that name holds, so that the new epoch takes over
    /// the listen sockets. Returns once the new epoch is ready: it has the sockets and has
    /// told this one to drain; this epoch exits `opts.parent_shutdown_time_s` later (see
    /// [`ChildGuard::wait_exit_async`] through [`Envoy::guard`]). Needs `hot_restart`.
    pub async fn hot_restart(&self, mut opts: EnvoyOptions) -> Result<Envoy> {
        let hot = self
            .hot
            .clone()
            .context("hot restart needs an Envoy started with `hot_restart: true`")?;
        opts.hot_restart = true;
        let v = crate::client::get_json(self.admin, "/listeners?format=json").await?;
        let mut ports = BTreeMap::new();
        for l in v
            .get("listener_statuses")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default()
        {
            if let Some(name) = l.get("name").and_then(Value::as_str) {
                if let Some(a) = listener_from(&v, name) {
                    ports.insert(name.to_string(), a.port());
                }
            }
        }
        let next = HotState {
            epoch: hot.epoch + 1,
            ..hot
        };
        Self::start_epoch(opts, Some(next), &ports).await
    }

    /// The options this Envoy was started with.
    pub fn options(&self) -> &EnvoyOptions {
        &self.opts
    }

    /// The hot-restart base id and epoch (`None` with `--disable-hot-restart`).
    pub fn hot_restart_epoch(&self) -> Option<(u64, u32)> {
        self.hot.as_ref().map(|h| (h.base_id, h.epoch))
    }

    async fn start_epoch(
        opts: EnvoyOptions,
        hot: Option<HotState>,
        pin_ports: &BTreeMap<String, u16>,
    ) -> Result<Envoy> {
        let bin = crate::paths::envoy_bin()?;
        let wasm = match (&opts.filter_config, &opts.wasm_path) {
            (None, _) => None,
            (Some(_), Some(p)) => Some(p.clone()),
            (Some(_), None) => Some(crate::paths::wasm_path()?),
        };
        let mut boot = bootstrap(&opts, wasm.as_deref())?;
        pin_listener_ports(&mut boot, pin_ports);
        if let Some(d) = &opts.dynamic_listeners {
            d.take_over(&mut boot)?;
        }
        let dir = tempfile::Builder::new()
            .prefix("kvguard-envoy-")
            .tempdir()
            .context("creating a temp dir for Envoy")?;
        let bootstrap_path = dir.path().join("bootstrap.yaml");
        std::fs::write(&bootstrap_path, serde_json::to_string_pretty(&boot)?)
            .context("writing the bootstrap")?;
        let admin_path = dir.path().join("admin.addr");
        let base_id_path = dir.path().join("base-id");
        let mut cmd = match opts.command.as_deref() {
            Some([program, args @ ..]) => {
                let mut c = Command::new(program);
                c.args(args);
                c
            }
            _ => Command::new(&bin),
        };
        cmd.arg("-c")
            .arg(&bootstrap_path)
            .arg("--concurrency")
            .arg(opts.concurrency.to_string())
            .arg("--admin-address-path")
            .arg(&admin_path)
            .arg("-l")
            .arg(&opts.log_level)
            .arg("--drain-time-s")
            .arg(opts.drain_time_s.to_string());
        match (&hot, opts.hot_restart) {
            (_, false) => {
                cmd.arg("--disable-hot-restart");
            }
            // Epoch 0: Envoy picks a base id no running Envoy holds and writes it down.
            (None, true) => {
                cmd.arg("--use-dynamic-base-id")
                    .arg("--base-id-path")
                    .arg(&base_id_path);
            }
            (Some(h), true) => {
                cmd.arg("--base-id")
                    .arg(h.base_id.to_string())
                    .arg("--restart-epoch")
                    .arg(h.epoch.to_string());
            }
        }
        if let Some(t) = opts.parent_shutdown_time_s {
            cmd.arg("--parent-shutdown-time-s").arg(t.to_string());
        }
        if let Some(s) = &opts.drain_strategy {
            cmd.arg("--drain-strategy").arg(s);
        }
        if let Some(c) = &opts.component_log_level {
            cmd.arg("--component-log-level").arg(c);
        }
        if let Some(y) = &opts.extra_yaml {
            cmd.arg("--config-yaml").arg(y);
        }
        // The stdout access log is flushed every 10 s by default: flush often so that tests
        // see lines at once (Envoy refuses a repeated flag, so only when not given).
        if !opts
            .extra_args
            .iter()
            .any(|a| a.starts_with("--file-flush-interval-msec"))
        {
            cmd.arg("--file-flush-interval-msec").arg("100");
        }
        cmd.args(&opts.extra_args);
        cmd.envs(&opts.process_env);
        let name = match &hot {
            Some(h) => format!("envoy-epoch{}", h.epoch),
            None => "envoy".to_string(),
        };
        let mut guard = ChildGuard::spawn(&name, cmd)?;
        let result = Self::await_ready(&mut guard, &admin_path, opts.ready_timeout).await;
        // Epoch 0 wrote its base id before it got ready (read also after a failed start,
        // so that the region it made is removed).
        let hot = match (hot, opts.hot_restart) {
            (Some(h), _) => Some(h),
            (None, true) => std::fs::read_to_string(&base_id_path)
                .ok()
                .and_then(|t| t.trim().parse::<u64>().ok())
                .map(|base_id| HotState {
                    base_id,
                    epoch: 0,
                    _shm: Arc::new(ShmCleanup(base_id)),
                }),
            (None, false) => None,
        };
        let result = match result {
            Ok(_) if opts.hot_restart && hot.is_none() => Err(anyhow!(
                "Envoy wrote no base id to {}",
                base_id_path.display()
            )),
            r => r,
        };
        match result {
            Ok((admin, listener)) => Ok(Envoy {
                guard,
                dir: Some(dir),
                admin,
                listener,
                bootstrap_path,
                opts,
                hot,
            }),
            Err(e) => Err(e.context(format!(
                "starting Envoy ({}; bootstrap kept at {}); last log lines:\n{}",
                bin.display(),
                dir.keep().join("bootstrap.yaml").display(),
                guard.log_tail(80)
            ))),
        }
    }

    async fn await_ready(
        guard: &mut ChildGuard,
        admin_path: &Path,
        timeout: Duration,
    ) -> Result<(SocketAddr, SocketAddr)> {
        let deadline = tokio::time::Instant::now() + timeout;
        let admin = guard.wait_for_addr_file(admin_path, timeout).await?;
        loop {
            guard.ensure_running()?;
            if let Ok(r) = crate::client::get(admin, "/ready").await {
                if r.status == 200 {
                    break;
                }
            }
            if tokio::time::Instant::now() >= deadline {
                bail!("Envoy admin {admin} /ready not 200 within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        loop {
            guard.ensure_running()?;
            if let Ok(v) = crate::client::get_json(admin, "/listeners?format=json").await {
                if let Some(a) = listener_from(&v, "ingress") {
                    return Ok((admin, a));
                }
            }
            if tokio::time::Instant::now() >= deadline {
                bail!("Envoy listener address not known within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// The `ingress` listener's address.
    pub fn listener_addr(&self) -> SocketAddr {
        self.listener
    }

    /// The admin address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin
    }

    /// Another listener's address by name (for bootstraps patched with more listeners).
    pub async fn listener_named(&self, name: &str) -> Result<SocketAddr> {
        let v = crate::client::get_json(self.admin, "/listeners?format=json").await?;
        listener_from(&v, name).ok_or_else(|| anyhow!("no listener {name:?} in {v}"))
    }

    /// The bootstrap file used.
    pub fn bootstrap_path(&self) -> &Path {
        &self.bootstrap_path
    }

    /// Envoy's log so far (stderr and stdout: the access log goes there too).
    pub fn log(&self) -> String {
        self.guard.log()
    }

    /// The process guard (pid, signals, exit status).
    pub fn guard(&mut self) -> &mut ChildGuard {
        &mut self.guard
    }

    /// Counters and gauges from admin `/stats?format=json` (histograms left out). Custom
    /// wasm metrics appear under their full Envoy names (see the README for the prefix).
    pub async fn stats(&self) -> Result<BTreeMap<String, f64>> {
        let v = crate::client::get_json(self.admin, "/stats?format=json").await?;
        let mut out = BTreeMap::new();
        for s in v
            .get("stats")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default()
        {
            if let (Some(n), Some(val)) = (s.get("name").and_then(Value::as_str), s.get("value")) {
                if let Some(f) = val.as_f64() {
                    out.insert(n.to_string(), f);
                }
            }
        }
        Ok(out)
    }

    /// One stat by name; also tried with the `wasmcustom.` prefix (custom wasm metrics).
    pub async fn stat(&self, name: &str) -> Result<Option<f64>> {
        let s = self.stats().await?;
        Ok(s.get(name)
            .or_else(|| s.get(&format!("wasmcustom.{name}")))
            .copied())
    }

    /// Stats whose name contains `part`.
    pub async fn stats_matching(&self, part: &str) -> Result<BTreeMap<String, f64>> {
        Ok(self
            .stats()
            .await?
            .into_iter()
            .filter(|(k, _)| k.contains(part))
            .collect())
    }

    /// Waits (polling every 50 ms, bounded) until stat `name` satisfies `pred`.
    pub async fn wait_stat(
        &self,
        name: &str,
        timeout: Duration,
        pred: impl Fn(f64) -> bool,
    ) -> Result<f64> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut last = None;
        loop {
            if let Ok(Some(v)) = self.stat(name).await {
                if pred(v) {
                    return Ok(v);
                }
                last = Some(v);
            }
            if tokio::time::Instant::now() >= deadline {
                bail!("stat {name} did not reach the expected value within {timeout:?} (last: {last:?})");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Runs `envoy --mode validate -c <bootstrap>`; returns the output on success.
    pub fn validate(bootstrap: &Value) -> Result<String> {
        let dir = tempfile::Builder::new()
            .prefix("kvguard-envoy-validate-")
            .tempdir()?;
        let p = dir.path().join("bootstrap.yaml");
        std::fs::write(&p, serde_json::to_string_pretty(bootstrap)?)?;
        Self::validate_file(&p)
    }

    /// Runs `envoy --mode validate -c <file>` (bounded: 60 s); returns the output on success.
    pub fn validate_file(path: &Path) -> Result<String> {
        let bin = crate::paths::envoy_bin()?;
        let mut cmd = Command::new(&bin);
        cmd.arg("--mode")
            .arg("validate")
            .arg("-c")
            .arg(path)
            .arg("--disable-hot-restart")
            .arg("-l")
            .arg("warn");
        let mut g = ChildGuard::spawn("envoy-validate", cmd)?;
        let status = g.wait_exit(Duration::from_secs(60))?;
        let log = g.log();
        if !status.success() {
            bail!(
                "envoy --mode validate {} failed ({status}):\n{log}",
                path.display()
            );
        }
        Ok(log)
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        if std::env::var_os("KVGUARD_KEEP_LOGS").is_some() {
            if let Some(d) = self.dir.take() {
                eprintln!("kept Envoy bootstrap in {}", d.keep().display());
            }
        }
    }
}

/// Sets `port_value` of every listener in `boot` that binds port 0 and has a port in `ports`.
fn pin_listener_ports(boot: &mut Value, ports: &BTreeMap<String, u16>) {
    let Some(listeners) = boot
        .pointer_mut("/static_resources/listeners")
        .and_then(Value::as_array_mut)
    else {
        return;
    };
    for l in listeners {
        let Some(port) = l
            .get("name")
            .and_then(Value::as_str)
            .and_then(|n| ports.get(n))
            .copied()
        else {
            continue;
        };
        if let Some(p) = l.pointer_mut("/address/socket_address/port_value") {
            if p.as_u64() == Some(0) {
                *p = json!(port);
            }
        }
    }
}

fn listener_from(v: &Value, name: &str) -> Option<SocketAddr> {
    v.get("listener_statuses")?
        .as_array()?
        .iter()
        .find(|l| l.get("name").and_then(Value::as_str) == Some(name))
        .and_then(|l| {
            let sa = l.pointer("/local_address/socket_address")?;
            let ip = sa.get("address")?.as_str()?;
            let port = sa.get("port_value")?.as_u64()?;
            if port == 0 {
                return None;
            }
            format!("{ip}:{port}").parse().ok()
        })
}
