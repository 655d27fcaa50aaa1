//! The end-to-end stack of the demo and the e2e suites, assembled from the harness:
//! client → Envoy [+ kvguard filter] → lossy hop or a real hop (LiteLLM, vllm-router) →
//! kvguard-control → engine.
//!
//! Every piece is a real process or the workspace's own instrument: Envoy
//! ([`crate::envoy::Envoy`]), the lossy hop ([`crate::lossy`], in process), kvguard-control
//! (the built binary, in a [`ChildGuard`]), and an engine given by address (the simulator
//! or real vLLM, started by the caller).

use crate::envoy::{Envoy, EnvoyOptions};
use crate::hops::{Hop, HopKind};
use crate::lossy::{self, LossyConfig, LossyHandle};
use crate::proc::ChildGuard;
use crate::receiver::{self, Behaviour, Receiver, ReceiverConfig};
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The shared secret the demo and tests use (filter and control).
pub const SECRET: &str = "kvguard-demo-secret-0123456789abcdef";

/// The filter's tick in [`filter_config`], ms: its clocks fire at most this late.
pub const FILTER_TICK_MS: u64 = 250;

/// A filter configuration: aborts to [`crate::envoy::CONTROL_CLUSTER`], the secret from
/// the VM environment, the given idle timeout and max age (ms, 0 = off), a
/// [`FILTER_TICK_MS`] tick.
pub fn filter_config(idle_timeout_ms: u64, max_age_ms: u64) -> Value {
    json!({
        "control_cluster": crate::envoy::CONTROL_CLUSTER,
        "secret_env": "KVGUARD_SECRET",
        "idle_timeout_ms": idle_timeout_ms,
        "max_age_ms": max_age_ms,
        "tick_ms": FILTER_TICK_MS
    })
}

/// kvguard-control run as a process.
pub struct Control {
    guard: ChildGuard,
    /// Proxy listener (inference traffic).
    pub proxy: SocketAddr,
    /// Admin listener (`/v1/abort`, `/metrics`, `/v1/requests`).
    pub admin: SocketAddr,
    engine: SocketAddr,
    args: Vec<String>,
}

impl Control {
    /// Starts kvguard-control in front of `engine` on `listen`/`admin_listen` (port 0 for
    /// any), with extra flags `args` (e.g. `--idle-timeout off`). Waits for its address
    /// file and `/healthz`.
    pub async fn start(
        engine: SocketAddr,
        listen: SocketAddr,
        admin_listen: SocketAddr,
        args: &[String],
    ) -> Result<Control> {
        let bin = crate::paths::control_bin()?;
        let dir = tempfile::Builder::new()
            .prefix("kvguard-control-addr-")
            .tempdir()?;
        let addr_file = dir.path().join("addr.json");
        let mut cmd = std::process::Command::new(&bin);
        cmd.arg("--listen")
            .arg(listen.to_string())
            .arg("--admin-listen")
            .arg(admin_listen.to_string())
            .arg("--engine-url")
            .arg(format!("http://{engine}"))
            .arg("--addr-file")
            .arg(&addr_file)
            .arg("--no-nvml")
            .arg("--worker-threads")
            .arg("2")
            // The demo and the harness read the in-flight table.
            .arg("--list-requests")
            .args(args)
            .env("KVGUARD_SECRET", SECRET);
        let mut guard = ChildGuard::spawn("kvguard-control", cmd)?;
        let deadline = Instant::now() + Duration::from_secs(30);
        let (proxy, admin) = loop {
            if let Ok(t) = std::fs::read_to_string(&addr_file) {
                if let Ok(v) = serde_json::from_str::<Value>(&t) {
                    let p = v["proxy"].as_str().and_then(|s| s.parse().ok());
                    let a = v["admin"].as_str().and_then(|s| s.parse().ok());
                    if let (Some(p), Some(a)) = (p, a) {
                        break (p, a);
                    }
                }
            }
            guard.ensure_running()?;
            if Instant::now() >= deadline {
                bail!(
                    "kvguard-control did not write {} within 30 s:\n{}",
                    addr_file.display(),
                    guard.log_tail(60)
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        crate::wait::poll_until_async(
            "kvguard-control /healthz",
            Duration::from_secs(20),
            Duration::from_millis(50),
            || async move {
                crate::client::get(admin, "/healthz")
                    .await
                    .ok()
                    .filter(|r| r.status == 200)
            },
        )
        .await
        .with_context(|| guard.log_tail(60))?;
        Ok(Control {
            guard,
            proxy,
            admin,
            engine,
            args: args.to_vec(),
        })
    }

    /// Kills it at once (SIGKILL: a crash).
    pub fn kill(&mut self) -> Result<()> {
        self.guard.kill()?;
        Ok(())
    }

    /// Starts it again on the same ports, with the same flags.
    pub async fn restart(&mut self) -> Result<()> {
        let _ = self.guard.kill();
        let fresh = Control::start(self.engine, self.proxy, self.admin, &self.args).await?;
        *self = fresh;
        Ok(())
    }

    /// Its process id (for [`crate::stall::StallMark::control`]).
    pub fn pid(&self) -> u32 {
        self.guard.pid()
    }

    /// The process guard.
    pub fn guard(&mut self) -> &mut ChildGuard {
        &mut self.guard
    }

    /// `n` replicas in front of `engine`, each with `--peers` naming all of them (each
    /// leaves itself out by its `--admin-listen`), and the flags `extra`; with `advertise`,
    /// each stamps its responses with its admin address.
    pub async fn start_replicas(
        engine: SocketAddr,
        n: usize,
        extra: &[&str],
        advertise: bool,
    ) -> Result<Vec<Control>> {
        crate::with_free_addrs(n, |admins| async move {
            let peers = admins
                .iter()
                .map(|a| format!("http://{a}"))
                .collect::<Vec<_>>()
                .join(",");
            let any = SocketAddr::from(([127, 0, 0, 1], 0));
            let mut args: Vec<String> = vec!["--peers".into(), peers];
            args.extend(extra.iter().map(|s| s.to_string()));
            let mut controls = Vec::new();
            for admin in &admins {
                let mut args = args.clone();
                if advertise {
                    // Each stamps its responses with its admin address (the per-replica route).
                    args.extend(["--advertise".to_owned(), admin.to_string()]);
                }
                controls.push(Control::start(engine, any, *admin, &args).await?);
            }
            Ok(controls)
        })
        .await
    }

    /// A prefill/decode pair's kvguard-controls: one in front of `prefill`, one in front
    /// of `decode`, peers of each other, with `--pd-role`, `--pd-kv-lease lease` (the
    /// engines' KV lease) and, beside P, `--pd-decode-url` naming D's proxy listener (the
    /// route that releases P's held blocks); `extra` flags on both.
    pub async fn start_pd_pair(
        prefill: SocketAddr,
        decode: SocketAddr,
        lease: Duration,
        extra: &[&str],
    ) -> Result<(Control, Control)> {
        crate::with_free_addrs(4, |a| async move {
            let (p_proxy, p_admin, d_proxy, d_admin) = (a[0], a[1], a[2], a[3]);
            let args = |role: &str| -> Vec<String> {
                let mut v: Vec<String> = vec![
                    "--peers".into(),
                    format!("http://{p_admin},http://{d_admin}"),
                    "--pd-role".into(),
                    role.into(),
                    "--pd-kv-lease".into(),
                    format!("{}ms", lease.as_millis()),
                ];
                if role == "prefill" {
                    v.extend(["--pd-decode-url".into(), format!("http://{d_proxy}")]);
                }
                v.extend(extra.iter().map(|s| s.to_string()));
                v
            };
            let pc = Control::start(prefill, p_proxy, p_admin, &args("prefill")).await?;
            let dc = Control::start(decode, d_proxy, d_admin, &args("decode")).await?;
            Ok((pc, dc))
        })
        .await
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        self.guard.log()
    }

    /// `/metrics` text.
    pub async fn metrics_text(&self) -> Result<String> {
        Ok(crate::client::get(self.admin, "/metrics").await?.text())
    }

    /// `kvguard_control_aborts_total` by reason (outcome summed), from `/metrics`. Errors
    /// when `/metrics` has no sample of it (kvguard-control exports every reason from the
    /// start: an absent family is not "0 aborts").
    pub async fn aborts_by_reason(&self) -> Result<BTreeMap<String, f64>> {
        let m = labelled(
            &self.metrics_text().await?,
            "kvguard_control_aborts_total",
            "reason",
        );
        if m.is_empty() {
            bail!("kvguard-control's /metrics has no kvguard_control_aborts_total sample");
        }
        Ok(m)
    }

    /// Sends it a signed abort of `id` as the filter does (`POST /v1/abort`, contract §3,
    /// signed with [`SECRET`] now); returns the status and the JSON answer.
    pub async fn abort(
        &self,
        id: &str,
        reason: kvguard_contract::AbortReason,
    ) -> Result<(u16, Value)> {
        let id = kvguard_contract::RequestId::try_new(id.as_bytes())?;
        let body = kvguard_contract::AbortRequest::new(&id, reason, 0, 0).to_json();
        let key = kvguard_contract::Key::try_new(SECRET.as_bytes())?;
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs();
        let sig =
            kvguard_contract::signature::sign(kvguard_contract::Domain::Abort, &key, t, &body);
        let r = crate::client::request(
            self.admin,
            hyper::Method::POST,
            kvguard_contract::ABORT_PATH,
            &[
                ("content-type", "application/json"),
                (kvguard_contract::SIGNATURE_HEADER, &sig),
            ],
            body,
            false,
            Duration::from_secs(10),
        )
        .await?;
        let v = serde_json::from_slice(r.body.as_ref()).unwrap_or(Value::Null);
        Ok((r.status, v))
    }

    /// Request ids in flight (`GET /v1/requests`).
    pub async fn inflight_ids(&self) -> Result<Vec<String>> {
        let v = crate::client::get_json(self.admin, "/v1/requests").await?;
        Ok(v["requests"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default()
            .iter()
            .filter_map(|r| r["request_id"].as_str().map(str::to_string))
            .collect())
    }
}

/// Samples of metric `name` summed by the value of label `label`.
pub fn labelled(text: &str, name: &str, label: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let pat = format!("{label}=\"");
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let Some(labels) = rest.strip_prefix('{') else {
            continue;
        };
        let Some((labels, value)) = labels.rsplit_once('}') else {
            continue;
        };
        let Some(i) = labels.find(&pat) else { continue };
        let v = &labels[i + pat.len()..];
        let Some(end) = v.find('"') else { continue };
        if let Ok(x) = value.trim().parse::<f64>() {
            *out.entry(v[..end].to_string()).or_insert(0.0) += x;
        }
    }
    out
}

/// What stack to run.
#[derive(Clone)]
pub struct StackOptions {
    /// The engine (simulator or vLLM).
    pub engine: SocketAddr,
    /// The kvguard filter's configuration; `None` = Envoy without the filter.
    pub filter: Option<Value>,
    /// Extra kvguard-control flags (e.g. `--idle-timeout off --max-age off`).
    pub control_args: Vec<String>,
    /// Put the lossy hop between Envoy and kvguard-control (the leak); else Envoy talks to
    /// kvguard-control directly.
    pub lossy: bool,
    /// Envoy `per_connection_buffer_limit_bytes` and the listener's `SO_SNDBUF` (small:
    /// a silent client back-pressures the stream, so the filter stops seeing tokens).
    pub buffer_limit: Option<u32>,
    /// Send the filter's aborts here instead of kvguard-control's admin listener (e.g. a
    /// closed port: the abort endpoint unreachable).
    pub abort_target: Option<SocketAddr>,
    /// Put a recording tap ([`crate::receiver::Behaviour::Forward`]) between the filter
    /// and the abort endpoint: [`Stack::abort_tap`] then holds every abort call the
    /// filter sent, body included (its `idle_ms`, `gone_ms`).
    pub abort_tap: bool,
    /// Envoy `--concurrency`.
    pub envoy_concurrency: u32,
    /// A real hop (LiteLLM, vllm-router) between Envoy and kvguard-control; when set it
    /// takes the place of the lossy hop (`lossy` is then ignored).
    pub real_hop: Option<HopKind>,
    /// YAML Envoy merges over its bootstrap (`--config-yaml`), e.g. the shipped
    /// `stats_config` ([`super::observe::shipped_stats_config`]).
    pub envoy_extra_yaml: Option<String>,
}

impl StackOptions {
    /// The leak topology with `filter` (None = no kvguard at the edge).
    pub fn new(engine: SocketAddr, filter: Option<Value>) -> Self {
        StackOptions {
            engine,
            filter,
            control_args: Vec::new(),
            lossy: true,
            buffer_limit: Some(16 * 1024),
            abort_target: None,
            abort_tap: false,
            envoy_concurrency: 1,
            real_hop: None,
            envoy_extra_yaml: None,
        }
    }
}

/// A running stack; dropping it stops every piece.
pub struct Stack {
    /// Envoy (the client's entry point: [`Stack::entry`]).
    pub envoy: Envoy,
    /// The lossy hop, when in the path.
    pub hop: Option<LossyHandle>,
    /// The real hop, when `StackOptions::real_hop` asked for one.
    pub real_hop: Option<Hop>,
    /// kvguard-control.
    pub control: Control,
    /// The recording tap in front of the abort endpoint (`StackOptions::abort_tap`).
    pub abort_tap: Option<Receiver>,
    /// The options it was started with.
    pub opts: StackOptions,
}

impl Stack {
    /// Starts kvguard-control, the lossy hop and Envoy, in that order.
    pub async fn start(opts: StackOptions) -> Result<Stack> {
        let any: SocketAddr = SocketAddr::from(([127, 0, 0, 1], 0));
        let control = Control::start(opts.engine, any, any, &opts.control_args).await?;
        let real_hop = match &opts.real_hop {
            Some(kind) => Some(Hop::start(kind, control.proxy).await?),
            None => None,
        };
        let (hop, upstream) = if let Some(h) = &real_hop {
            (None, h.addr())
        } else if opts.lossy {
            let h = lossy::spawn(LossyConfig::to(control.proxy)).await?;
            let a = h.addr();
            (Some(h), a)
        } else {
            (None, control.proxy)
        };
        let abort_to = opts.abort_target.unwrap_or(control.admin);
        let abort_tap = match opts.abort_tap {
            true => {
                let mut rc = ReceiverConfig::new(Vec::new());
                rc.behaviour = Behaviour::Forward(abort_to);
                Some(receiver::spawn(rc).await?)
            }
            false => None,
        };
        let abort_to = abort_tap.as_ref().map_or(abort_to, Receiver::addr);
        let mut eo = match &opts.filter {
            Some(cfg) => EnvoyOptions::with_filter(upstream, abort_to, cfg.clone())
                .vm_env("KVGUARD_SECRET", SECRET),
            None => EnvoyOptions::new(upstream),
        };
        eo.per_connection_buffer_limit_bytes = opts.buffer_limit;
        eo.downstream_sndbuf = opts.buffer_limit;
        eo.concurrency = opts.envoy_concurrency;
        eo.extra_yaml = opts.envoy_extra_yaml.clone();
        eo.component_log_level = Some("wasm:info".into());
        let envoy = Envoy::start(eo).await?;
        Ok(Stack {
            envoy,
            hop,
            real_hop,
            control,
            abort_tap,
            opts,
        })
    }

    /// Where clients connect (Envoy's listener).
    pub fn entry(&self) -> SocketAddr {
        self.envoy.listener_addr()
    }

    /// Envoy's and kvguard-control's log tails (for failure messages).
    pub fn logs(&self, n: usize) -> String {
        let tail = |s: String| {
            let l: Vec<&str> = s.lines().collect();
            l[l.len().saturating_sub(n)..].join("\n")
        };
        let hop = match &self.real_hop {
            Some(h) => format!("\n----- {} -----\n{}", h.kind(), tail(h.log())),
            None => String::new(),
        };
        format!(
            "----- envoy -----\n{}\n----- kvguard-control -----\n{}{hop}",
            tail(self.envoy.log()),
            tail(self.control.log())
        )
    }

    /// The filter's stats whose name contains `kvguard_filter` (counters and gauges).
    /// Errors when Envoy's admin does not answer, and when the stack has the filter but
    /// Envoy shows none of its stats (the filter is not loaded): "0 aborts" must not pass
    /// on a missing filter. Empty for a stack without the filter.
    pub async fn filter_stats(&self) -> Result<BTreeMap<String, f64>> {
        let s = self
            .envoy
            .stats_matching("kvguard_filter")
            .await
            .context("reading Envoy's /stats")?;
        if self.opts.filter.is_some() && s.is_empty() {
            bail!("Envoy shows no kvguard_filter stats although the stack has the filter");
        }
        Ok(s)
    }
}

/// The value of the one stat in `stats` whose name ends with `suffix`; errors when none
/// does (a stat that does not exist is not 0).
pub fn stat_ending(stats: &BTreeMap<String, f64>, suffix: &str) -> Result<f64> {
    let mut found = stats.iter().filter(|(k, _)| k.ends_with(suffix));
    match (found.next(), found.next()) {
        (Some((_, v)), None) => Ok(*v),
        (None, _) => bail!("no stat ending with {suffix:?} among {stats:?}"),
        (Some(_), Some(_)) => bail!("more than one stat ends with {suffix:?}: {stats:?}"),
    }
}

/// A local address nothing listens on (bound, read back, released).
pub async fn closed_port() -> Result<SocketAddr> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let a = l.local_addr()?;
    drop(l);
    Ok(a)
}

/// Where the demo writes by default: `<repo>/target/demo` is avoided (the cargo target
/// dir lives outside); `$KVGUARD_CACHE/demo`.
pub fn default_out_dir() -> Result<PathBuf> {
    Ok(crate::vllm::cache_dir()?.join("demo"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labelled_sums_by_label() {
        let t = "kvguard_control_aborts_total{reason=\"stalled\",outcome=\"aborted\"} 2\n\
                 kvguard_control_aborts_total{reason=\"stalled\",outcome=\"dry_run\"} 1\n\
                 kvguard_control_aborts_total{reason=\"downstream_reset\",outcome=\"aborted\"} 5\n\
                 # HELP x\n";
        let m = labelled(t, "kvguard_control_aborts_total", "reason");
        assert_eq!(m.get("stalled"), Some(&3.0));
        assert_eq!(m.get("downstream_reset"), Some(&5.0));
    }
}
