//! Real LLM hops that people run between their gateway and the engine, as child processes:
//! LiteLLM's proxy (PyPI `litellm[proxy]==1.108.7`) and vllm-router (PyPI
//! `vllm-router==0.1.17`), both installed by `scripts/setup-hops` into
//! `$KVGUARD_HOPS_VENV` (default `$KVGUARD_CACHE/hops-venv`).
//!
//! Each hop listens on a free local port, forwards to one OpenAI-compatible upstream
//! (kvguard-control's proxy listener, or an engine), is waited for with a bounded
//! readiness poll (failing early, with its log, if it exits), LiteLLM then warmed up (see
//! `Hop::warm_up_litellm`), and is killed with its process group on drop ([`ChildGuard`]).

use crate::proc::ChildGuard;
use anyhow::{bail, Context, Result};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The LiteLLM release the suite runs (`locks/hops.in`).
pub const LITELLM_VERSION: &str = "1.108.7";
/// The vllm-router release the suite runs.
pub const VLLM_ROUTER_VERSION: &str = "0.1.17";

/// How long a hop may take to answer its readiness endpoint. LiteLLM imports a large
/// Python tree: ~12 s on an idle 2-core machine, much more under load.
const READY_TIMEOUT: Duration = Duration::from_secs(180);

/// The model [`Hop`]'s LiteLLM warm-up asks for: no deployment serves it.
const WARM_UP_MODEL: &str = "kvguard-warm-up";

/// The virtualenv `scripts/setup-hops` fills: `KVGUARD_HOPS_VENV`, else
/// `$KVGUARD_CACHE/hops-venv`, else `~/.cache/kvguard/hops-venv`.
pub fn venv() -> Result<PathBuf> {
    if let Some(v) = std::env::var_os("KVGUARD_HOPS_VENV") {
        return Ok(PathBuf::from(v));
    }
    Ok(crate::vllm::cache_dir()?.join("hops-venv"))
}

fn venv_bin(name: &str) -> Result<PathBuf> {
    let p = venv()?.join("bin").join(name);
    if !p.is_file() {
        bail!(
            "{} not found: run scripts/setup-hops (installs LiteLLM {LITELLM_VERSION} and \
             vllm-router {VLLM_ROUTER_VERSION}), or set KVGUARD_HOPS_VENV",
            p.display()
        );
    }
    Ok(p)
}

/// How LiteLLM is configured (the settings that decide what reaches kvguard-control).
#[derive(Debug, Clone, PartialEq)]
pub struct LiteLlmOptions {
    /// Model name clients ask for; LiteLLM sends `openai/<model>` upstream.
    pub model: String,
    /// `general_settings.forward_client_headers_to_llm_api`: forwards the client's `x-*`
    /// headers (the request id kvguard keys on). Off in LiteLLM by default.
    pub forward_client_headers: bool,
    /// `general_settings.cancel_on_disconnect`: close the upstream call of a
    /// non-streaming request whose client left. Off in LiteLLM by default.
    pub cancel_on_disconnect: bool,
    /// `router_settings.num_retries` (0 = none).
    pub num_retries: u32,
    /// Per-attempt upstream timeout (`litellm_params.timeout`), seconds.
    pub timeout_s: Option<f64>,
    /// A second deployment `<model>-fallback` (same upstream) and
    /// `router_settings.fallbacks: [{<model>: [<model>-fallback]}]`.
    pub fallback: bool,
}

impl LiteLlmOptions {
    /// What the shipped example (`envoy-config/litellm/config.yaml`) sets for kvguard:
    /// client headers forwarded, everything else at LiteLLM's defaults.
    pub fn kvguard(model: &str) -> Self {
        LiteLlmOptions {
            model: model.to_string(),
            forward_client_headers: true,
            cancel_on_disconnect: false,
            num_retries: 0,
            timeout_s: None,
            fallback: false,
        }
    }
}

/// LiteLLM's proxy config for `opts`, forwarding to `upstream` (`http://<upstream>/v1`).
/// No master key: the hop listens on loopback only, for the tests and the demo.
pub fn litellm_config(upstream: SocketAddr, opts: &LiteLlmOptions) -> String {
    let deployment = |name: &str| {
        let mut d = format!(
            "  - model_name: {name}\n    litellm_params:\n      model: openai/{}\n      \
             api_base: http://{upstream}/v1\n      api_key: dummy\n",
            opts.model
        );
        if let Some(t) = opts.timeout_s {
            d.push_str(&format!("      timeout: {t}\n"));
        }
        d
    };
    let mut y = String::from("model_list:\n");
    y.push_str(&deployment(&opts.model));
    if opts.fallback {
        y.push_str(&deployment(&format!("{}-fallback", opts.model)));
    }
    y.push_str(&format!(
        "general_settings:\n  dangerously_permit_weak_or_unset_master_key: true\n  \
         forward_client_headers_to_llm_api: {}\n  cancel_on_disconnect: {}\n",
        opts.forward_client_headers, opts.cancel_on_disconnect
    ));
    y.push_str("litellm_settings:\n  drop_params: true\n  telemetry: false\n");
    y.push_str(&format!(
        "router_settings:\n  num_retries: {}\n  retry_after: 0\n",
        opts.num_retries
    ));
    if opts.fallback {
        y.push_str(&format!(
            "  fallbacks: [{{\"{m}\": [\"{m}-fallback\"]}}]\n",
            m = opts.model
        ));
    }
    y
}

/// A hop process and the address clients (Envoy) send to.
pub struct Hop {
    guard: ChildGuard,
    addr: SocketAddr,
    kind: &'static str,
}

/// Which real hop to run.
#[derive(Debug, Clone, PartialEq)]
pub enum HopKind {
    /// LiteLLM's proxy with these settings.
    LiteLlm(LiteLlmOptions),
    /// LiteLLM's proxy with a config file as shipped (e.g. `envoy-config/litellm/`), and
    /// environment variables for its `os.environ/…` values. `{upstream}` in a value is
    /// replaced by the upstream's address.
    LiteLlmFile {
        /// The config file.
        path: PathBuf,
        /// Extra environment.
        env: Vec<(String, String)>,
    },
    /// vllm-router, round robin over the one upstream.
    VllmRouter,
}

impl HopKind {
    /// `litellm` or `vllm-router`.
    pub fn name(&self) -> &'static str {
        match self {
            HopKind::LiteLlm(_) | HopKind::LiteLlmFile { .. } => "litellm",
            HopKind::VllmRouter => "vllm-router",
        }
    }
}

impl Hop {
    /// Starts `kind` forwarding to `upstream` and waits (bounded) until it is ready.
    pub async fn start(kind: &HopKind, upstream: SocketAddr) -> Result<Hop> {
        let port = crate::demo::stack::closed_port().await?.port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        match kind {
            HopKind::LiteLlm(o) => {
                let dir = tempfile::Builder::new()
                    .prefix("kvguard-litellm-")
                    .tempdir()?;
                let conf = dir.path().join("config.yaml");
                std::fs::write(&conf, litellm_config(upstream, o))
                    .with_context(|| format!("writing {}", conf.display()))?;
                Self::litellm(addr, &conf, &[]).await
            }
            HopKind::LiteLlmFile { path, env } => {
                let env: Vec<(String, String)> = env
                    .iter()
                    .map(|(k, v)| (k.clone(), v.replace("{upstream}", &upstream.to_string())))
                    .collect();
                Self::litellm(addr, path, &env).await
            }
            HopKind::VllmRouter => Self::vllm_router(upstream, addr).await,
        }
    }

    async fn litellm(addr: SocketAddr, conf: &Path, env: &[(String, String)]) -> Result<Hop> {
        let bin = venv_bin("litellm")?;
        let mut cmd = std::process::Command::new(bin);
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
        cmd.arg("--config")
            .arg(conf)
            .args(["--host", "127.0.0.1", "--port"])
            .arg(addr.port().to_string())
            .args(["--num_workers", "1"])
            // No network here: the bundled model cost map, no telemetry.
            .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
            .env("LITELLM_TELEMETRY", "False")
            .env("NO_PROXY", "*");
        let guard = ChildGuard::spawn("litellm", cmd)?;
        let mut hop = Hop {
            guard,
            addr,
            kind: "litellm",
        };
        hop.wait_ready("/health/readiness").await?;
        let key = env
            .iter()
            .find(|(k, _)| k == "LITELLM_MASTER_KEY")
            .map(|(_, v)| format!("Bearer {v}"));
        hop.warm_up_litellm(key.as_deref()).await?;
        // The config file is read at start-up; keep it beside the log for a failed test.
        let _ = std::fs::copy(conf, hop.guard.dir().join("config.yaml"));
        Ok(hop)
    }

    /// Makes LiteLLM load what its first chat call would: it imports the modules of that
    /// path and its default tokenizer on first use, in its one event loop (~0.4 s of CPU
    /// on an idle machine, seconds on a busy 2-core one, by `python -X importtime`), and
    /// a request that paid it in a test reached the engine or answered its client that
    /// much later. A LiteLLM in service did so long ago. The calls name a model no
    /// deployment serves, or only count tokens: none reaches the upstream.
    async fn warm_up_litellm(&mut self, authorization: Option<&str>) -> Result<()> {
        let mut headers = vec![("content-type", "application/json")];
        headers.extend(authorization.map(|a| ("authorization", a)));
        let chat = serde_json::json!({"model": WARM_UP_MODEL, "stream": true,
            "messages": [{"role": "user", "content": "warm up"}]});
        let completion = serde_json::json!({"model": WARM_UP_MODEL, "prompt": "warm up"});
        for (path, body) in [
            ("/v1/chat/completions", &chat),
            ("/v1/completions", &completion),
            ("/utils/token_counter", &chat),
        ] {
            self.guard.ensure_running()?;
            crate::client::request(
                self.addr,
                hyper::Method::POST,
                path,
                &headers,
                bytes::Bytes::from(serde_json::to_vec(body)?),
                false,
                READY_TIMEOUT,
            )
            .await
            .with_context(|| {
                format!(
                    "litellm: warm-up POST {path} got no answer; last log lines:\n{}",
                    self.guard.log_tail(60)
                )
            })?;
        }
        Ok(())
    }

    async fn vllm_router(upstream: SocketAddr, addr: SocketAddr) -> Result<Hop> {
        let bin = venv_bin("vllm-router")?;
        // Its metrics listener defaults to the fixed port 29000: a second router on the
        // machine (another test, another checkout's suite) would fail to start on it.
        let metrics = crate::demo::stack::closed_port().await?.port();
        let mut cmd = std::process::Command::new(bin);
        cmd.args(["--host", "127.0.0.1", "--port"])
            .arg(addr.port().to_string())
            .args(["--prometheus-host", "127.0.0.1", "--prometheus-port"])
            .arg(metrics.to_string())
            .arg("--worker-urls")
            .arg(format!("http://{upstream}"))
            .args(["--policy", "round_robin", "--log-level", "info"])
            .args(["--worker-startup-timeout-secs", "60"]);
        let guard = ChildGuard::spawn("vllm-router", cmd)?;
        let mut hop = Hop {
            guard,
            addr,
            kind: "vllm-router",
        };
        hop.wait_ready("/health").await?;
        Ok(hop)
    }

    /// Polls `GET path` until it answers 200, at most [`READY_TIMEOUT`]; fails at once if
    /// the process exits.
    async fn wait_ready(&mut self, path: &str) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            self.guard.ensure_running()?;
            if let Ok(r) = crate::client::request(
                self.addr,
                hyper::Method::GET,
                path,
                &[],
                bytes::Bytes::new(),
                false,
                Duration::from_secs(5),
            )
            .await
            {
                if r.status == 200 {
                    return Ok(());
                }
            }
            if Instant::now() >= deadline {
                bail!(
                    "{} did not answer 200 on {path} within {READY_TIMEOUT:?}; last log lines:\n{}",
                    self.kind,
                    self.guard.log_tail(60)
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Where to send requests.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `litellm` or `vllm-router`.
    pub fn kind(&self) -> &'static str {
        self.kind
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        self.guard.log()
    }

    /// The process guard.
    pub fn guard(&mut self) -> &mut ChildGuard {
        &mut self.guard
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn litellm_config_names_the_upstream_and_the_settings() {
        let up: SocketAddr = "127.0.0.1:8001".parse().unwrap();
        let mut o = LiteLlmOptions::kvguard("tiny");
        o.num_retries = 2;
        o.fallback = true;
        o.timeout_s = Some(3.0);
        let y = litellm_config(up, &o);
        assert!(y.contains("api_base: http://127.0.0.1:8001/v1"), "{y}");
        assert!(y.contains("model: openai/tiny"), "{y}");
        assert!(y.contains("model_name: tiny-fallback"), "{y}");
        assert!(y.contains("forward_client_headers_to_llm_api: true"), "{y}");
        assert!(y.contains("cancel_on_disconnect: false"), "{y}");
        assert!(y.contains("num_retries: 2"), "{y}");
        assert!(y.contains("timeout: 3"), "{y}");
        assert!(
            y.contains(r#"fallbacks: [{"tiny": ["tiny-fallback"]}]"#),
            "{y}"
        );
    }
}
