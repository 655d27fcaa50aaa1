//! The JSON plugin configuration (contract §5): parsed with serde (unknown keys refused),
//! then validated and compiled into a typed [`Config`]. Every error names the field and
//! what is allowed.

use crate::cidr::Cidr;
use core::fmt;
use kvguard_contract::{Key, ABORT_PATH};
use serde_json::Value;

/// Largest timeout accepted, in ms (24 h).
pub const MAX_TIMEOUT_MS: u64 = 86_400_000;

/// A configuration error (the text names the field).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

fn err<T>(msg: impl Into<String>) -> Result<T, ConfigError> {
    Err(ConfigError(msg.into()))
}

/// What the filter does with a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Send aborts and close streams.
    Enforce,
    /// Count and log what would be aborted; send and close nothing.
    Observe,
}

impl Mode {
    /// `enforce` or `observe`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Mode::Enforce => "enforce",
            Mode::Observe => "observe",
        }
    }

    /// Parses `enforce` / `observe`.
    pub fn parse(value: &[u8]) -> Option<Mode> {
        match value {
            b"enforce" => Some(Mode::Enforce),
            b"observe" => Some(Mode::Observe),
            _ => None,
        }
    }
}

/// The three clocks of a request, in ms (0 = off).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// From the last data event, after the first one.
    pub idle_timeout_ms: u64,
    /// From the request until the first data event.
    pub first_token_timeout_ms: u64,
    /// From the request.
    pub max_age_ms: u64,
}

/// A `routes` entry: overrides for a path prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// The prefix.
    pub path_prefix: String,
    /// The resolved limits (unset fields inherit the global ones).
    pub limits: Limits,
}

/// The per-replica route (contract §4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetRoute {
    /// The ORIGINAL_DST cluster.
    pub cluster: String,
    /// Networks a stamped address must be inside.
    pub cidrs: Vec<Cidr>,
    /// Ports a stamped address may name (kvguard-control's admin port).
    pub ports: Vec<u16>,
}

/// The default of `control_target_ports`: kvguard-control's default admin port.
pub const DEFAULT_CONTROL_PORT: u16 = 9902;

/// `abort_retries` when unset: with the backoff (200 ms doubling to 5 s) and a 1 s call
/// timeout, 9 attempts span the 30 s abort deadline, so an abort outlives a
/// kvguard-control unreachable for less than that (behind a hop that hides disconnects,
/// nothing else would end the orphan).
pub const DEFAULT_ABORT_RETRIES: u32 = 8;

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Cluster of the control service's admin listener.
    pub control_cluster: String,
    /// `:authority` of abort calls.
    pub control_authority: String,
    /// The per-replica route, when configured.
    pub target: Option<TargetRoute>,
    /// Path of the abort endpoint.
    pub abort_path: String,
    /// The key that signs aborts: the first line of `secret` / `secret_env`.
    pub key: Key,
    /// Every key of the rotation list (each line of `secret` / `secret_env`, the signing
    /// key first): a control stamp verifies with any of them.
    pub stamp_keys: Vec<Key>,
    /// Enforce or observe.
    pub mode: Mode,
    /// Whether the configuration names its `mode` (only a named mode moves the kill
    /// switch: [`first_load`]).
    pub mode_named: bool,
    /// Global limits.
    pub limits: Limits,
    /// Tick period, ms.
    pub tick_ms: u64,
    /// Tracked path prefixes.
    pub paths: Vec<String>,
    /// Overrides, longest prefix first.
    pub routes: Vec<Route>,
    /// Per-call timeout of an abort, ms.
    pub abort_timeout_ms: u64,
    /// Retries after the first attempt (transient answers only).
    pub abort_retries: u32,
    /// Bound of the abort queue (queued + in flight + backing off).
    pub max_pending_aborts: usize,
    /// Largest event inspected, bytes.
    pub max_event_bytes: usize,
    /// The event names that are not progress (SSE `event:` or a JSON event's top-level
    /// `"type"`), after the three terminal Responses API events: [`Config::event_words`].
    pub event_words: Vec<Box<[u8]>>,
    /// Period of the liveness-lease renewal, ms (0 = off; contract §8).
    pub lease_renew_ms: u64,
    /// Path of the renewal endpoint.
    pub lease_path: String,
}

/// The Responses API events that end a stream (SSE `event:` or JSON `"type"`).
pub const TERMINAL_EVENTS: [&str; 3] = [
    "response.completed",
    "response.failed",
    "response.incomplete",
];

/// Default `non_progress_events`: heartbeats, and the Responses API preamble a server may
/// send before the engine has scheduled the request.
pub const DEFAULT_NON_PROGRESS_EVENTS: [&str; 7] = [
    "ping",
    "heartbeat",
    "keepalive",
    "keep-alive",
    "response.created",
    "response.in_progress",
    "response.queued",
];

/// Most `non_progress_events` (the scanner matches them and the terminal events as they
/// arrive, one bit each in a `u16`).
pub const MAX_NON_PROGRESS_EVENTS: usize = 13;

/// `non_progress_events`: up to [`MAX_NON_PROGRESS_EVENTS`] distinct names of 1..=64
/// bytes, none a terminal event. Returns the terminal events followed by them.
fn event_words(v: Option<&Value>) -> Result<Vec<Box<[u8]>>, ConfigError> {
    const FIELD: &str = "non_progress_events";
    let names: Vec<String> = match v {
        None => DEFAULT_NON_PROGRESS_EVENTS
            .iter()
            .map(|s| (*s).to_owned())
            .collect(),
        Some(Value::Array(items)) if items.len() <= MAX_NON_PROGRESS_EVENTS => {
            let mut out = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                match item {
                    Value::String(s)
                        if !s.is_empty()
                            && s.len() <= 64
                            && !TERMINAL_EVENTS.contains(&s.as_str())
                            && !out.contains(s) =>
                    {
                        out.push(s.clone())
                    }
                    v => {
                        return err(format!(
                            "{FIELD}[{i}]: expected a new event name of 1..=64 bytes that does not end a stream (not {}), got {}",
                            TERMINAL_EVENTS.join(", "),
                            shown(v)
                        ))
                    }
                }
            }
            out
        }
        Some(v) => {
            return err(format!(
                "{FIELD}: expected a list of at most {MAX_NON_PROGRESS_EVENTS} event names ([] = every event is progress), got {}",
                shown(v)
            ))
        }
    };
    Ok(TERMINAL_EVENTS
        .iter()
        .map(|s| (*s).to_owned())
        .chain(names)
        .map(|s| s.into_bytes().into_boxed_slice())
        .collect())
}

/// The digest of a configuration's bytes (64-bit FNV-1a): which configurations an Envoy
/// process has loaded ([`first_load`]).
pub fn config_digest(raw: &[u8]) -> u64 {
    raw.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Most configuration digests remembered per plugin name.
pub const MAX_SEEN_CONFIGS: usize = 64;

/// The kill switch: whether a configuration being loaded is new to this Envoy process.
/// `seen` is the shared-data list of the digests loaded so far (16 hex digits each, one
/// per line, the newest last). Returns the list with `digest` added when it was not
/// there (the caller writes it, and only then, if the configuration names its `mode`,
/// publishes that mode); `None` when the configuration was loaded before (another
/// worker, a VM reloaded after a trap, a draining listener's configuration): such a
/// load never moves the mode, so a pushed `observe` stays until a new configuration
/// names `enforce`.
pub fn first_load(seen: Option<&[u8]>, digest: u64) -> Option<Vec<u8>> {
    let me = format!("{digest:016x}");
    let seen = seen.unwrap_or_default();
    let lines: Vec<&[u8]> = seen
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .collect();
    if lines.contains(&me.as_bytes()) {
        return None;
    }
    let keep = lines.len().saturating_sub(MAX_SEEN_CONFIGS - 1);
    let mut out = Vec::with_capacity(seen.len() + 17);
    for l in lines.iter().skip(keep) {
        out.extend_from_slice(l);
        out.push(b'\n');
    }
    out.extend_from_slice(me.as_bytes());
    out.push(b'\n');
    Some(out)
}

/// Default renewal period: a sixth of kvguard-control's default 30 s TTL, so
/// three renewals in a row can be lost before a lease expires.
pub const DEFAULT_LEASE_RENEW_MS: u64 = 5_000;

/// The top-level keys (contract §5).
const KEYS: [&str; 22] = [
    "control_cluster",
    "control_authority",
    "control_target_cluster",
    "control_target_cidrs",
    "control_target_ports",
    "abort_path",
    "secret",
    "secret_env",
    "mode",
    "idle_timeout_ms",
    "first_token_timeout_ms",
    "max_age_ms",
    "tick_ms",
    "paths",
    "routes",
    "abort_timeout_ms",
    "abort_retries",
    "max_pending_aborts",
    "max_event_bytes",
    "non_progress_events",
    "lease_renew_ms",
    "lease_path",
];

/// The keys of a `routes` entry.
const ROUTE_KEYS: [&str; 4] = [
    "path_prefix",
    "idle_timeout_ms",
    "first_token_timeout_ms",
    "max_age_ms",
];

/// The members of an object, refusing unknown keys (serde's `deny_unknown_fields`,
/// by hand: the derived deserializer costs the wasm module ~30 KB).
fn members<'a>(
    what: &str,
    v: &'a Value,
    allowed: &[&str],
) -> Result<&'a serde_json::Map<String, Value>, ConfigError> {
    let Value::Object(m) = v else {
        return err(format!("{what}: expected a JSON object, got {}", shown(v)));
    };
    if let Some(k) = m.keys().find(|k| !allowed.contains(&k.as_str())) {
        let expected: Vec<String> = allowed.iter().map(|a| format!("`{a}`")).collect();
        return err(format!(
            "{what}: unknown field `{k}`, expected one of {}",
            expected.join(", ")
        ));
    }
    Ok(m)
}

/// The default tracked prefixes.
pub const DEFAULT_PATHS: [&str; 3] = ["/v1/chat/completions", "/v1/completions", "/v1/responses"];

/// A short description of a JSON value for error messages (no float formatting: it
/// costs the wasm module ~15 KB).
fn shown(v: &Value) -> String {
    match v {
        Value::Null => "null".to_owned(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => u.to_string(),
            (None, Some(i)) => i.to_string(),
            _ => "a number with a fraction".to_owned(),
        },
        Value::String(s) => {
            let mut cut = s.len().min(57);
            while !s.is_char_boundary(cut) {
                cut -= 1;
            }
            if cut < s.len() {
                format!("{:?}...", &s[..cut])
            } else {
                format!("{s:?}")
            }
        }
        Value::Array(_) => "a list".to_owned(),
        Value::Object(_) => "an object".to_owned(),
    }
}

fn int(
    field: &str,
    v: Option<&Value>,
    min: u64,
    max: u64,
    default: u64,
    what: &str,
) -> Result<u64, ConfigError> {
    match v {
        None => Ok(default),
        // Integral floats (`60000.0`) are accepted: Istio's `pluginConfig` is a protobuf
        // Struct, whose numbers are doubles.
        Some(v) => match v.as_u64().or_else(|| {
            v.as_f64()
                .filter(|f| f.fract() == 0.0 && (0.0..9.0e15).contains(f))
                .map(|f| f as u64)
        }) {
            Some(n) if (min..=max).contains(&n) => Ok(n),
            _ => err(format!(
                "{field}: expected an integer {min}..={max}{what}, got {}",
                shown(v)
            )),
        },
    }
}

fn timeout(field: &str, v: Option<&Value>, default: u64) -> Result<u64, ConfigError> {
    int(field, v, 0, MAX_TIMEOUT_MS, default, " (0 = off)")
}

fn string(field: &str, v: Option<&Value>, what: &str) -> Result<Option<String>, ConfigError> {
    match v {
        None => Ok(None),
        Some(Value::String(s)) if !s.is_empty() => Ok(Some(s.clone())),
        Some(v) => err(format!("{field}: expected {what}, got {}", shown(v))),
    }
}

/// The keys of a secret: one per line (blank lines skipped), the first signs.
fn key_list(field: &str, text: &str) -> Result<Vec<Key>, ConfigError> {
    let mut keys = Vec::new();
    let several = text.lines().filter(|l| !l.trim().is_empty()).count() > 1;
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        keys.push(Key::try_new(line.as_bytes()).map_err(|e| {
            ConfigError(if several {
                format!("{field}: line {}: {e}", i + 1)
            } else {
                format!("{field}: {e}")
            })
        })?);
    }
    if keys.is_empty() {
        return err(format!(
            "{field}: expected at least one key of 16 bytes or more (one per line), got none"
        ));
    }
    Ok(keys)
}

fn path_prefix(field: &str, v: &Value) -> Result<String, ConfigError> {
    match v {
        Value::String(s) if s.starts_with('/') && s.len() <= 1024 => Ok(s.clone()),
        v => err(format!(
            "{field}: expected a path prefix starting with \"/\", got {}",
            shown(v)
        )),
    }
}

impl Config {
    /// Parses and validates the plugin configuration. `env` looks up VM environment
    /// variables (for `secret_env`).
    pub fn parse(json: &[u8], env: &dyn Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        if json.trim_ascii().is_empty() {
            return err("configuration is empty: expected a JSON object with at least \"control_cluster\" and \"secret\" or \"secret_env\"");
        }
        if json.trim_ascii().first() != Some(&b'{') {
            return err("configuration must be a JSON object");
        }
        let value: Value =
            serde_json::from_slice(json).map_err(|e| ConfigError(format!("configuration: {e}")))?;
        let raw = members("configuration", &value, &KEYS)?;
        let control_cluster = string(
            "control_cluster",
            raw.get("control_cluster"),
            "a non-empty cluster name",
        )?
        .map_or_else(
            || err("control_cluster: required (the cluster of kvguard-control's admin listener)"),
            Ok,
        )?;
        let control_authority = string(
            "control_authority",
            raw.get("control_authority"),
            "a non-empty authority",
        )?
        .unwrap_or_else(|| control_cluster.clone());
        let target_cluster = string(
            "control_target_cluster",
            raw.get("control_target_cluster"),
            "a non-empty cluster name",
        )?;
        let cidrs = match raw.get("control_target_cidrs") {
            None => None,
            Some(Value::Array(items)) if !items.is_empty() => {
                let mut out = Vec::with_capacity(items.len());
                for (i, item) in items.iter().enumerate() {
                    match item {
                        Value::String(s) => out.push(Cidr::parse(s).map_err(|e| {
                            ConfigError(format!("control_target_cidrs[{i}]: {e}"))
                        })?),
                        v => {
                            return err(format!(
                                "control_target_cidrs[{i}]: expected a CIDR string like \"10.0.0.0/8\", got {}",
                                shown(v)
                            ))
                        }
                    }
                }
                Some(out)
            }
            Some(v) => {
                return err(format!(
                    "control_target_cidrs: expected a non-empty list of CIDR strings, got {}",
                    shown(v)
                ))
            }
        };
        let ports = match raw.get("control_target_ports") {
            None => vec![DEFAULT_CONTROL_PORT],
            Some(Value::Array(items)) if !items.is_empty() && items.len() <= 16 => {
                let mut out = Vec::with_capacity(items.len());
                for (i, item) in items.iter().enumerate() {
                    let port = int(
                        &format!("control_target_ports[{i}]"),
                        Some(item),
                        1,
                        65_535,
                        0,
                        "",
                    )?;
                    out.push(u16::try_from(port).unwrap_or(DEFAULT_CONTROL_PORT));
                }
                out
            }
            Some(v) => {
                return err(format!(
                    "control_target_ports: expected a list of 1 to 16 ports, got {}",
                    shown(v)
                ))
            }
        };
        let target = match (target_cluster, cidrs) {
            (Some(cluster), Some(cidrs)) => Some(TargetRoute {
                cluster,
                cidrs,
                ports,
            }),
            (None, None) => None,
            (Some(_), None) => {
                return err("control_target_cidrs: required with control_target_cluster (the networks stamped control addresses must be in)")
            }
            (None, Some(_)) => {
                return err("control_target_cluster: required with control_target_cidrs (an ORIGINAL_DST cluster)")
            }
        };
        let abort_path = match raw.get("abort_path") {
            None => ABORT_PATH.to_owned(),
            Some(v) => path_prefix("abort_path", v)?,
        };
        let stamp_keys = match (raw.get("secret"), raw.get("secret_env")) {
            (Some(_), Some(_)) => {
                return err("secret, secret_env: set exactly one of them, not both")
            }
            (None, None) => return err(
                "secret: required, or secret_env (name of a VM environment variable holding it)",
            ),
            (Some(Value::String(s)), None) => key_list("secret", s)?,
            (Some(v), None) => {
                let kind = match v {
                    Value::Null => "null",
                    Value::Bool(_) => "a boolean",
                    Value::Number(_) => "a number",
                    Value::Array(_) => "a list",
                    Value::Object(_) => "an object",
                    Value::String(_) => "a string",
                };
                return err(format!(
                    "secret: expected a string of at least 16 bytes, got {kind}"
                ));
            }
            (None, Some(v)) => {
                let name = string("secret_env", Some(v), "the name of an environment variable")?
                    .unwrap_or_default();
                match env(&name) {
                    None => {
                        return err(format!(
                            "secret_env: environment variable {name:?} is not set in the VM: export {name} in Envoy's process environment (the VM sees it through vm_config.environment_variables.host_env_keys; Istio: WasmPlugin vmConfig.env)"
                        ))
                    }
                    Some(value) => key_list(&format!("secret_env: variable {name:?}"), &value)?,
                }
            }
        };
        let Some(key) = stamp_keys.first().cloned() else {
            return err("secret: no key");
        };
        let mode = match raw.get("mode") {
            None => Mode::Enforce,
            Some(Value::String(s)) if s == "enforce" => Mode::Enforce,
            Some(Value::String(s)) if s == "observe" => Mode::Observe,
            Some(v) => {
                return err(format!(
                    "mode: expected \"enforce\" or \"observe\", got {}",
                    shown(v)
                ))
            }
        };
        let limits = Limits {
            idle_timeout_ms: timeout("idle_timeout_ms", raw.get("idle_timeout_ms"), 60_000)?,
            first_token_timeout_ms: timeout(
                "first_token_timeout_ms",
                raw.get("first_token_timeout_ms"),
                0,
            )?,
            max_age_ms: timeout("max_age_ms", raw.get("max_age_ms"), 0)?,
        };
        let tick_ms = int("tick_ms", raw.get("tick_ms"), 10, 60_000, 250, "")?;
        let paths = match raw.get("paths") {
            None => DEFAULT_PATHS.iter().map(|s| (*s).to_owned()).collect(),
            Some(Value::Array(items)) if !items.is_empty() && items.len() <= 256 => {
                let mut out = Vec::with_capacity(items.len());
                for (i, item) in items.iter().enumerate() {
                    out.push(path_prefix(&format!("paths[{i}]"), item)?);
                }
                out
            }
            Some(v) => {
                return err(format!(
                    "paths: expected a list of 1..=256 path prefixes, got {}",
                    shown(v)
                ))
            }
        };
        let mut routes = Vec::new();
        match raw.get("routes") {
            None => {}
            Some(Value::Array(items)) if items.len() <= 256 => {
                for (i, item) in items.iter().enumerate() {
                    let f = format!("routes[{i}]");
                    let r = match item {
                        Value::Object(_) => members(&f, item, &ROUTE_KEYS)?,
                        _ => {
                            return err(format!(
                                "{f}: expected an object {{path_prefix, idle_timeout_ms?, first_token_timeout_ms?, max_age_ms?}}, got {}",
                                shown(item)
                            ))
                        }
                    };
                    let prefix = match r.get("path_prefix") {
                        Some(v) => path_prefix(&format!("{f}.path_prefix"), v)?,
                        None => return err(format!("{f}.path_prefix: required")),
                    };
                    let limits = Limits {
                        idle_timeout_ms: timeout(
                            &format!("{f}.idle_timeout_ms"),
                            r.get("idle_timeout_ms"),
                            limits.idle_timeout_ms,
                        )?,
                        first_token_timeout_ms: timeout(
                            &format!("{f}.first_token_timeout_ms"),
                            r.get("first_token_timeout_ms"),
                            limits.first_token_timeout_ms,
                        )?,
                        max_age_ms: timeout(
                            &format!("{f}.max_age_ms"),
                            r.get("max_age_ms"),
                            limits.max_age_ms,
                        )?,
                    };
                    if routes.iter().any(|x: &Route| x.path_prefix == prefix) {
                        return err(format!("{f}.path_prefix: {prefix:?} appears twice"));
                    }
                    routes.push(Route {
                        path_prefix: prefix,
                        limits,
                    });
                }
            }
            Some(v) => {
                return err(format!(
                    "routes: expected a list of at most 256 objects, got {}",
                    shown(v)
                ))
            }
        }
        // Longest prefix first, in configuration order among equals: an insertion sort
        // (at most 256 routes, once per load) rather than the standard library's, whose
        // code would cost the size-bound module ~4 KB.
        for i in 1..routes.len() {
            let mut j = i;
            while j > 0 && routes[j - 1].path_prefix.len() < routes[j].path_prefix.len() {
                routes.swap(j - 1, j);
                j -= 1;
            }
        }
        let lease_renew_ms = int(
            "lease_renew_ms",
            raw.get("lease_renew_ms"),
            0,
            60_000,
            DEFAULT_LEASE_RENEW_MS,
            " (0 = off; at most a third of kvguard-control's --lease-ttl)",
        )?;
        if (1..100).contains(&lease_renew_ms) {
            return err(format!(
                "lease_renew_ms: expected 0 (off) or 100..=60000, got {lease_renew_ms}"
            ));
        }
        let lease_path = match raw.get("lease_path") {
            None => kvguard_contract::LEASE_PATH.to_owned(),
            Some(v) => path_prefix("lease_path", v)?,
        };
        Ok(Config {
            lease_renew_ms,
            lease_path,
            control_cluster,
            control_authority,
            target,
            abort_path,
            key,
            stamp_keys,
            mode,
            mode_named: raw.contains_key("mode"),
            limits,
            tick_ms,
            paths,
            routes,
            abort_timeout_ms: int(
                "abort_timeout_ms",
                raw.get("abort_timeout_ms"),
                1,
                60_000,
                1000,
                "",
            )?,
            abort_retries: u32::try_from(int(
                "abort_retries",
                raw.get("abort_retries"),
                0,
                10,
                u64::from(DEFAULT_ABORT_RETRIES),
                "",
            )?)
            .unwrap_or(DEFAULT_ABORT_RETRIES),
            max_pending_aborts: usize::try_from(int(
                "max_pending_aborts",
                raw.get("max_pending_aborts"),
                1,
                1_000_000,
                10_000,
                "",
            )?)
            .unwrap_or(10_000),
            max_event_bytes: usize::try_from(int(
                "max_event_bytes",
                raw.get("max_event_bytes"),
                256,
                16 * 1024 * 1024,
                65_536,
                "",
            )?)
            .unwrap_or(65_536),
            event_words: event_words(raw.get("non_progress_events"))?,
        })
    }

    /// The longest idle timeout of any route (the mass-stall window), ms.
    pub fn max_idle_timeout_ms(&self) -> u64 {
        self.routes
            .iter()
            .map(|r| r.limits.idle_timeout_ms)
            .fold(self.limits.idle_timeout_ms, u64::max)
    }

    /// The limits for a request path, or `None` when the path is not tracked. A path is
    /// tracked when it starts with one of `paths` or with a `routes` prefix; the longest
    /// matching route prefix gives its limits.
    pub fn limits_for(&self, path: &[u8]) -> Option<Limits> {
        if let Some(r) = self
            .routes
            .iter()
            .find(|r| path.starts_with(r.path_prefix.as_bytes()))
        {
            return Some(r.limits);
        }
        if self.paths.iter().any(|p| path.starts_with(p.as_bytes())) {
            return Some(self.limits);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "0123456789abcdef0123";

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn parse(json: &str) -> Result<Config, ConfigError> {
        Config::parse(json.as_bytes(), &no_env)
    }

    /// The deepest stack use of the filter: serde_json's recursion, up to its limit of
    /// 128 levels, and past it. Runs in wasm with the module's 256 KiB stack too
    /// (`.cargo/config.toml`): an overflow there would trap this test.
    #[test]
    fn deeply_nested_configuration() {
        for depth in [120, 127, 500, 10_000] {
            let json = format!(
                r#"{{"control_cluster":"c","secret":"{SECRET}","routes":{}1{}}}"#,
                "[".repeat(depth),
                "]".repeat(depth)
            );
            let e = parse(&json).unwrap_err().to_string();
            assert!(
                e.contains("routes") || e.contains("recursion"),
                "{depth}: {e}"
            );
        }
    }

    fn msg(json: &str) -> String {
        parse(json).unwrap_err().0
    }

    #[test]
    fn minimal_and_defaults() {
        let c = parse(&format!(
            r#"{{"control_cluster":"kvguard","secret":"{SECRET}"}}"#
        ))
        .unwrap();
        assert_eq!(c.control_authority, "kvguard");
        assert_eq!(c.abort_path, "/v1/abort");
        assert_eq!(c.mode, Mode::Enforce);
        assert!(!c.mode_named);
        assert_eq!(
            c.limits,
            Limits {
                idle_timeout_ms: 60_000,
                first_token_timeout_ms: 0,
                max_age_ms: 0
            }
        );
        assert_eq!(c.tick_ms, 250);
        assert_eq!(c.paths, DEFAULT_PATHS.to_vec());
        assert_eq!(c.abort_timeout_ms, 1000);
        assert_eq!(c.abort_retries, 8);
        assert_eq!(c.max_pending_aborts, 10_000);
        assert_eq!(c.max_event_bytes, 65_536);
        assert!(c.target.is_none());
        assert!(c.limits_for(b"/v1/chat/completions").is_some());
        assert!(c.limits_for(b"/v1/completions?x=1").is_some());
        assert!(c.limits_for(b"/v1/models").is_none());
        assert!(c.limits_for(b"/healthz").is_none());
    }

    #[test]
    fn full() {
        let c = parse(&format!(
            r#"{{"control_cluster":"c","control_authority":"kvguard-control","control_target_cluster":"t",
            "control_target_cidrs":["10.0.0.0/8","fd00::/8"],"abort_path":"/x/abort","secret":"{SECRET}",
            "mode":"observe","idle_timeout_ms":0,"first_token_timeout_ms":5000,"max_age_ms":86400000,"tick_ms":10,
            "paths":["/a"],"routes":[{{"path_prefix":"/a"}},{{"path_prefix":"/a/long","idle_timeout_ms":7}},{{"path_prefix":"/b","max_age_ms":1}}],
            "abort_timeout_ms":60000,"abort_retries":0,"max_pending_aborts":1,"max_event_bytes":256}}"#
        ))
        .unwrap();
        assert_eq!(c.mode, Mode::Observe);
        assert!(c.mode_named);
        assert_eq!(c.target.as_ref().unwrap().cidrs.len(), 2);
        let lens: Vec<usize> = c.routes.iter().map(|r| r.path_prefix.len()).collect();
        assert_eq!(lens, vec![7, 2, 2], "longest first");
        assert_eq!(
            c.routes[1].path_prefix, "/a",
            "configuration order among equals"
        );
        let l = c.limits_for(b"/a/long/x").unwrap();
        assert_eq!(l.idle_timeout_ms, 7);
        assert_eq!(l.first_token_timeout_ms, 5000);
        assert_eq!(c.limits_for(b"/a/other").unwrap().idle_timeout_ms, 0);
        // A route prefix is tracked even outside `paths`.
        assert_eq!(c.limits_for(b"/b").unwrap().max_age_ms, 1);
        assert!(c.limits_for(b"/c").is_none());
    }

    #[test]
    fn secret_env() {
        let env = |n: &str| (n == "KVGUARD_SECRET").then(|| format!("{SECRET}\n"));
        let c = Config::parse(
            br#"{"control_cluster":"c","secret_env":"KVGUARD_SECRET"}"#,
            &env,
        )
        .unwrap();
        assert_eq!(c.key, Key::try_new(SECRET.as_bytes()).unwrap());
        let e = Config::parse(br#"{"control_cluster":"c","secret_env":"NOPE"}"#, &env).unwrap_err();
        assert!(
            e.0.starts_with("secret_env: environment variable \"NOPE\""),
            "{e}"
        );
        assert!(
            e.0.contains("export NOPE in Envoy's process environment"),
            "{e}"
        );
        let short = |_: &str| Some("short".to_string());
        let e = Config::parse(br#"{"control_cluster":"c","secret_env":"X"}"#, &short).unwrap_err();
        assert!(e.0.contains("at least 16"), "{e}");
    }

    #[test]
    fn errors_name_the_field() {
        let base = format!(r#""control_cluster":"c","secret":"{SECRET}""#);
        assert_eq!(
            msg(&format!(r#"{{{base},"idle_timeout_ms":"abc"}}"#)),
            "idle_timeout_ms: expected an integer 0..=86400000 (0 = off), got \"abc\""
        );
        assert!(msg(&format!(r#"{{{base},"max_age_ms":-1}}"#)).starts_with("max_age_ms: expected"));
        assert!(msg(&format!(r#"{{{base},"first_token_timeout_ms":1.5}}"#))
            .starts_with("first_token_timeout_ms:"));
        assert!(msg(&format!(r#"{{{base},"tick_ms":5}}"#))
            .starts_with("tick_ms: expected an integer 10..=60000"));
        assert!(msg(&format!(r#"{{{base},"abort_retries":11}}"#)).starts_with("abort_retries:"));
        assert!(
            msg(&format!(r#"{{{base},"abort_timeout_ms":0}}"#)).starts_with("abort_timeout_ms:")
        );
        assert!(msg(&format!(r#"{{{base},"max_pending_aborts":0}}"#))
            .starts_with("max_pending_aborts:"));
        assert!(msg(&format!(r#"{{{base},"max_event_bytes":10}}"#)).starts_with("max_event_bytes:"));
        let m = msg(&format!(r#"{{{base},"idle_timeout":5}}"#));
        assert!(
            m.contains("unknown field `idle_timeout`") && m.contains("idle_timeout_ms"),
            "{m}"
        );
        assert!(msg(&format!(r#"{{{base},"mode":"enforcing"}}"#))
            .starts_with("mode: expected \"enforce\" or \"observe\""));
        assert!(msg(&format!(r#"{{{base},"paths":[]}}"#)).starts_with("paths:"));
        assert!(msg(&format!(r#"{{{base},"paths":["v1"]}}"#)).starts_with("paths[0]:"));
        assert!(msg(&format!(r#"{{{base},"abort_path":"abort"}}"#)).starts_with("abort_path:"));
        assert!(
            msg(&format!(r#"{{{base},"routes":[{{"idle_timeout_ms":1}}]}}"#))
                .starts_with("routes[0].path_prefix: required")
        );
        assert!(msg(&format!(
            r#"{{{base},"routes":[{{"path_prefix":"/a","idle":1}}]}}"#
        ))
        .starts_with("routes[0]: unknown field `idle`"));
        assert!(msg(&format!(
            r#"{{{base},"routes":[{{"path_prefix":"/a","max_age_ms":"x"}}]}}"#
        ))
        .starts_with("routes[0].max_age_ms:"));
        assert!(msg(&format!(
            r#"{{{base},"routes":[{{"path_prefix":"/a"}},{{"path_prefix":"/a"}}]}}"#
        ))
        .contains("twice"));
        assert!(msg(&format!(r#"{{{base},"routes":[1]}}"#))
            .starts_with("routes[0]: expected an object"));
        assert!(msg(&format!(r#"{{{base},"control_target_cluster":"t"}}"#))
            .starts_with("control_target_cidrs: required"));
        assert!(msg(&format!(
            r#"{{{base},"control_target_cidrs":["10.0.0.0/8"]}}"#
        ))
        .starts_with("control_target_cluster: required"));
        assert!(msg(&format!(
            r#"{{{base},"control_target_cluster":"t","control_target_cidrs":["10.0.0.1/8"]}}"#
        ))
        .starts_with("control_target_cidrs[0]:"));
        assert!(msg(&format!(
            r#"{{{base},"control_target_cluster":"t","control_target_cidrs":[]}}"#
        ))
        .starts_with("control_target_cidrs:"));
        assert!(
            msg(&format!(r#"{{{base},"control_authority":""}}"#)).starts_with("control_authority:")
        );
        assert!(
            msg(&format!(r#"{{"secret":"{SECRET}"}}"#)).starts_with("control_cluster: required")
        );
        assert!(msg(r#"{"control_cluster":"c"}"#).starts_with("secret: required"));
        assert!(msg(r#"{"control_cluster":"c","secret":"short"}"#)
            .starts_with("secret: secret is 5 bytes"));
        assert!(msg(&format!(
            r#"{{"control_cluster":"c","secret":"{SECRET}\nshort"}}"#
        ))
        .starts_with("secret: line 2: secret is 5 bytes"));
        let target = r#""control_target_cluster":"t","control_target_cidrs":["10.0.0.0/8"]"#;
        assert!(msg(&format!(
            r#"{{{base},{target},"control_target_ports":[0]}}"#
        ))
        .starts_with("control_target_ports[0]: expected an integer 1..=65535"));
        assert!(
            msg(&format!(r#"{{{base},{target},"control_target_ports":[]}}"#))
                .starts_with("control_target_ports: expected a list")
        );
        assert!(
            msg(r#"{"control_cluster":"c","secret":12}"#).starts_with("secret: expected a string")
        );
        assert!(msg(&format!(r#"{{{base},"secret_env":"X"}}"#)).contains("exactly one"));
        assert!(msg("[1]").starts_with("configuration must be a JSON object"));
        assert!(msg("").starts_with("configuration is empty"));
        assert!(msg("{").starts_with("configuration:"));
        // Secrets are never echoed.
        assert!(!msg(r#"{"control_cluster":"c","secret":"tooshort"}"#).contains("tooshort"));
    }

    #[test]
    fn integral_floats_are_integers() {
        let c = parse(&format!(
            r#"{{"control_cluster":"c","secret":"{SECRET}","idle_timeout_ms":60000.0,"abort_retries":2e0}}"#
        ))
        .unwrap();
        assert_eq!(c.limits.idle_timeout_ms, 60_000);
        assert_eq!(c.abort_retries, 2);
        assert!(parse(&format!(
            r#"{{"control_cluster":"c","secret":"{SECRET}","idle_timeout_ms":1e300}}"#
        ))
        .is_err());
    }

    #[test]
    fn long_values_are_shortened_in_errors() {
        let long = "x".repeat(500);
        let m = msg(&format!(
            r#"{{"control_cluster":"c","secret":"{SECRET}","mode":"{long}"}}"#
        ));
        assert!(m.len() < 140, "{m}");
    }

    /// Issue 27.3: the non-progress events, their defaults and their checks.
    #[test]
    fn non_progress_events_default_and_validate() {
        let base = format!(r#""control_cluster":"c","secret":"{SECRET}""#);
        let words = |c: &Config| -> Vec<String> {
            c.event_words
                .iter()
                .map(|w| String::from_utf8_lossy(w).into_owned())
                .collect()
        };
        let c = parse(&format!("{{{base}}}")).unwrap();
        let defaults: Vec<String> = crate::scan::DEFAULT_EVENT_WORDS
            .iter()
            .map(|w| String::from_utf8_lossy(w).into_owned())
            .collect();
        assert_eq!(
            words(&c),
            defaults,
            "the scanner's defaults are the config's"
        );
        assert_eq!(
            defaults[crate::scan::TERMINAL..],
            DEFAULT_NON_PROGRESS_EVENTS.map(String::from)
        );
        let c = parse(&format!(r#"{{{base},"non_progress_events":["beat"]}}"#)).unwrap();
        assert_eq!(
            words(&c),
            [
                "response.completed",
                "response.failed",
                "response.incomplete",
                "beat"
            ]
        );
        let c = parse(&format!(r#"{{{base},"non_progress_events":[]}}"#)).unwrap();
        assert_eq!(c.event_words.len(), 3);
        let many: Vec<String> = (0..=MAX_NON_PROGRESS_EVENTS)
            .map(|i| format!("\"e{i}\""))
            .collect();
        let max = &many[..MAX_NON_PROGRESS_EVENTS];
        assert!(parse(&format!(
            r#"{{{base},"non_progress_events":[{}]}}"#,
            max.join(",")
        ))
        .is_ok());
        for (bad, field) in [
            (format!("[{}]", many.join(",")), "non_progress_events:"),
            (r#""ping""#.to_owned(), "non_progress_events:"),
            (r#"["ping",""]"#.to_owned(), "non_progress_events[1]:"),
            (r#"["ping","ping"]"#.to_owned(), "non_progress_events[1]:"),
            (
                r#"["response.completed"]"#.to_owned(),
                "non_progress_events[0]:",
            ),
            (r#"[1]"#.to_owned(), "non_progress_events[0]:"),
            (
                format!(r#"["{}"]"#, "x".repeat(65)),
                "non_progress_events[0]:",
            ),
        ] {
            let m = msg(&format!(r#"{{{base},"non_progress_events":{bad}}}"#));
            assert!(m.starts_with(field), "{bad}: {m}");
        }
        assert!(parse(&format!(
            r#"{{{base},"non_progress_events":["{}"]}}"#,
            "x".repeat(64)
        ))
        .is_ok());
    }

    /// Issue 27.6: a configuration loaded again (another worker, a reloaded VM, a
    /// draining listener) is not new; a new one is remembered, the oldest forgotten past
    /// the bound.
    #[test]
    fn the_kill_switch_moves_only_on_a_new_configuration() {
        let a = config_digest(br#"{"mode":"enforce"}"#);
        let b = config_digest(br#"{"mode":"observe"}"#);
        assert_ne!(a, b);
        assert_eq!(config_digest(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(config_digest(b"a"), 0xaf63_dc4c_8601_ec8c);
        let seen = first_load(None, a).unwrap();
        assert_eq!(seen, format!("{a:016x}\n").into_bytes());
        assert_eq!(first_load(Some(&seen), a), None, "loaded again");
        let seen = first_load(Some(&seen), b).unwrap();
        assert_eq!(first_load(Some(&seen), a), None);
        assert_eq!(first_load(Some(&seen), b), None);
        // Bounded: the oldest is forgotten.
        let mut seen = seen;
        for d in 0..MAX_SEEN_CONFIGS as u64 {
            seen = first_load(Some(&seen), 1000 + d).unwrap();
        }
        assert_eq!(
            seen.split(|c| *c == b'\n')
                .filter(|l| !l.is_empty())
                .count(),
            MAX_SEEN_CONFIGS
        );
        assert!(first_load(Some(&seen), a).is_some(), "forgotten");
        assert_eq!(first_load(Some(&seen), 1000 + 63), None);
        assert!(first_load(Some(&seen), 1000).is_none());
        assert!(first_load(Some(b"junk\n\n"), a).is_some());
    }
}
