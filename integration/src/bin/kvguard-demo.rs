//! `kvguard-demo`: the KV-leak reproduction, without and with kvguard, side by side
//! (README command 1 runs it through `scripts/demo`). Also `--serve-vllm`: holds a real
//! vLLM for `scripts/vllm-server` (one per e2e suite run).

use anyhow::{bail, Context, Result};
use clap::Parser;
use kvguard_integration::demo::{self, DemoConfig, EngineKind, Mode};
use kvguard_integration::vllm::{self, Vllm, VllmOptions};
use std::path::PathBuf;

/// The KV-leak reproduction: the same seeded load through the same stack, without kvguard
/// and with it; prints both runs side by side and writes results JSON.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Engine: `sim` (the workspace's simulator, default) or `vllm` (real vLLM on CPU).
    #[arg(long, default_value = "sim")]
    engine: String,
    /// Use this running vLLM (http://ip:port) instead of starting one. The demo's own
    /// vLLM has a small KV pool (128 blocks of 32 tokens) so that the leak shows.
    #[arg(long)]
    vllm_url: Option<String>,
    /// Only this run: `leak` or `kvguard` (default: both).
    #[arg(long)]
    only: Option<String>,
    /// Seconds of arrivals per run.
    #[arg(long)]
    arrival_s: Option<f64>,
    /// Seconds observed after the last arrival.
    #[arg(long)]
    drain_s: Option<f64>,
    /// Arrivals per second.
    #[arg(long)]
    rate: Option<f64>,
    /// Share of clients that disconnect at a random point.
    #[arg(long)]
    disconnect_share: Option<f64>,
    /// Share of stalled streams.
    #[arg(long)]
    stall_share: Option<f64>,
    /// RNG seed.
    #[arg(long)]
    seed: Option<u64>,
    /// The hop between Envoy and kvguard-control: `lossy` (the suite's hop that passes no
    /// disconnect on, default) or `litellm` (LiteLLM's proxy 1.108.7 as shipped in
    /// envoy-config/litellm/, installed by scripts/setup-hops).
    #[arg(long, default_value = "lossy")]
    hop: String,
    /// Share of requests sent without streaming (default 0; 0.3 with `--hop litellm`).
    #[arg(long)]
    nonstream_share: Option<f64>,
    /// Run each scenario under a real Prometheus (the shipped rules and alerts, windows
    /// divided by 60) and print when each alert fired.
    #[arg(long)]
    prometheus: bool,
    /// The verdict's mutation check: the kvguard run's filter in observe mode (it sends
    /// no abort). The demo must then fail.
    #[arg(long)]
    filter_observe: bool,
    /// The prefill/decode leak instead: Envoy → the P/D proxy → kvguard-control beside a
    /// prefill and a decode simulator; clients leave during prefill or during decode
    /// (docs/DEMO.md). Takes --seed, --rate, --arrival-s, --drain-s, --filter-observe.
    #[arg(long)]
    pd: bool,
    /// With --pd: the prefill engine's lease on blocks held for the decode side (ms).
    #[arg(long)]
    pd_lease_ms: Option<u64>,
    /// Output directory (results.json, table.txt).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Hold a real vLLM until SIGTERM and write its URL to this file once ready
    /// (what `scripts/vllm-server start` runs).
    #[arg(long)]
    serve_vllm: Option<PathBuf>,
}

async fn serve_vllm(url_file: PathBuf) -> Result<()> {
    let mut v = Vllm::start(VllmOptions::default()).await?;
    if let Some(g) = v.guard() {
        // Its process group, so that `scripts/vllm-server stop` can end it even if this
        // holder was killed.
        vllm::write_atomic(&url_file.with_extension("pgid"), &g.pid().to_string())?;
        vllm::write_atomic(
            &url_file.with_extension("log"),
            &g.log_path().display().to_string(),
        )?;
    }
    vllm::write_atomic(&url_file, &v.url())?;
    println!("vLLM ready at {}", v.url());
    kvguard_integration::cli::wait_for_signal().await;
    drop(v);
    Ok(())
}

async fn demo_pd(a: Args) -> Result<()> {
    let mut cfg = demo::pd::PdConfig::default();
    for (field, v) in [
        (&mut cfg.arrival_s, a.arrival_s),
        (&mut cfg.drain_s, a.drain_s),
        (&mut cfg.rate, a.rate),
    ] {
        if let Some(v) = v {
            *field = v;
        }
    }
    if let Some(x) = a.seed {
        cfg.seed = x;
    }
    if let Some(x) = a.pd_lease_ms {
        cfg.lease_ms = x;
    }
    cfg.filter_observe = a.filter_observe;
    let out = match a.out {
        Some(o) => o,
        None => demo::stack::default_out_dir()?.join("pd"),
    };
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let progress = |s: String| eprintln!("{s}");
    let res = demo::pd::run(&cfg, &progress).await?;
    let text = demo::pd::table(&res);
    println!("\n{text}");
    std::fs::write(out.join("table.txt"), &text)?;
    std::fs::write(
        out.join("results.json"),
        serde_json::to_string_pretty(&res)?,
    )?;
    println!("results: {}", out.join("results.json").display());
    if let Err(e) = demo::pd::verdict(&res) {
        bail!("demo verdict: FAIL\n{e:#}");
    }
    println!(
        "demo verdict: PASS (with kvguard: prefill-side held block-seconds {:.2} and decode-side orphan-seconds {:.2}, each at most {:.0} % of the run without it ({:.2}, {:.2}); no false abort)",
        res.kvguard.p_held_block_seconds,
        res.kvguard.d_orphan_seconds,
        demo::pd::PD_SHARE * 100.0,
        res.leak.p_held_block_seconds,
        res.leak.d_orphan_seconds
    );
    Ok(())
}

async fn demo(a: Args) -> Result<()> {
    if a.pd {
        return demo_pd(a).await;
    }
    let engine = match a.engine.as_str() {
        "sim" => EngineKind::Sim,
        "vllm" => EngineKind::Vllm,
        other => bail!("--engine {other:?}: expected sim or vllm"),
    };
    let mut cfg = DemoConfig::new(engine);
    if let Some(x) = a.arrival_s {
        cfg.arrival_s = x;
    }
    if let Some(x) = a.drain_s {
        cfg.drain_s = x;
    }
    if let Some(x) = a.rate {
        cfg.rate = x;
    }
    if let Some(x) = a.disconnect_share {
        cfg.disconnect_share = x;
    }
    if let Some(x) = a.stall_share {
        cfg.stall_share = x;
    }
    if let Some(x) = a.seed {
        cfg.seed = x;
    }
    cfg.hop = match a.hop.as_str() {
        "lossy" => demo::Hop::Lossy,
        "litellm" => demo::Hop::Litellm,
        other => bail!("--hop {other:?}: expected lossy or litellm"),
    };
    cfg.nonstream_share = match (a.nonstream_share, cfg.hop) {
        (Some(x), _) if (0.0..=1.0).contains(&x) => x,
        (Some(x), _) => bail!("--nonstream-share {x}: expected a share between 0 and 1"),
        (None, demo::Hop::Litellm) => 0.3,
        (None, demo::Hop::Lossy) => 0.0,
    };
    cfg.prometheus = a.prometheus;
    cfg.filter_observe = a.filter_observe;
    let modes: Vec<Mode> = match a.only.as_deref() {
        None => vec![Mode::Leak, Mode::Kvguard],
        Some("leak") => vec![Mode::Leak],
        Some("kvguard") => vec![Mode::Kvguard],
        Some(o) => bail!("--only {o:?}: expected leak or kvguard"),
    };
    let out = match a.out {
        Some(o) => o,
        None => demo::stack::default_out_dir()?,
    };
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let mut own_vllm = None;
    let url = a
        .vllm_url
        .clone()
        .or_else(|| std::env::var(vllm::URL_ENV).ok());
    let vllm_addr = match (engine, &url) {
        (EngineKind::Sim, _) => None,
        (EngineKind::Vllm, Some(u)) => Some(Vllm::connect(u).await?.addr()),
        (EngineKind::Vllm, None) => {
            eprintln!("starting real vLLM (tiny random Llama, CPU; a minute or two)...");
            let v = Vllm::start(demo::demo_vllm_options()).await?;
            let addr = v.addr();
            own_vllm = Some(v);
            Some(addr)
        }
    };
    let plan = demo::plan(&cfg);
    eprintln!(
        "workload: {} streams over {:.0}s ({} disconnect at a random point, {} stall), seed {}, engine {:?}",
        plan.len(),
        cfg.arrival_s,
        plan.iter().filter(|p| matches!(p.kind, demo::Kind::Disconnect(_))).count(),
        plan.iter().filter(|p| matches!(p.kind, demo::Kind::Stall(_))).count(),
        cfg.seed,
        engine
    );
    let progress = |s: String| eprintln!("{s}");
    let res = demo::run_demo(&cfg, &modes, vllm_addr, &progress).await?;
    drop(own_vllm);
    let series = demo::series_table(&res, 5.0);
    let table = demo::table(&res);
    let mut text = format!(
        "engine KV usage and running / waiting requests over time (t = seconds since the first arrival; arrivals stop at {:.0}s)\n\n{series}\n{table}",
        cfg.arrival_s
    );
    for r in [&res.leak, &res.kvguard].into_iter().flatten() {
        if let Some(o) = &r.observed {
            let tl = demo::observe::timeline(&o.alerts);
            text.push_str(&format!(
                "\nalerts ({}; shipped rules, windows and `for:` divided by {}):\n{}",
                r.mode,
                demo::observe::SCALE,
                if tl.is_empty() {
                    "  none\n".to_string()
                } else {
                    tl
                }
            ));
        }
    }
    println!("\n{text}");
    std::fs::write(out.join("table.txt"), &text)?;
    let json = serde_json::to_string_pretty(&res)?;
    std::fs::write(out.join("results.json"), json)?;
    println!("results: {}", out.join("results.json").display());
    // Both verdicts, every reason printed: no false abort (and kvguard-control's figures),
    // and the absolute one from the engine's side.
    let wrong: Vec<String> = [demo::verdict(&res), demo::engine_verdict(&res)]
        .into_iter()
        .filter_map(|v| v.err().map(|e| format!("{e:#}")))
        .collect();
    if !wrong.is_empty() {
        bail!("demo verdict: FAIL\n{}", wrong.join("\n"));
    }
    if let (Some(l), Some(k)) = (
        res.leak.as_ref().and_then(|r| r.engine_orphans.as_ref()),
        res.kvguard.as_ref().and_then(|r| r.engine_orphans.as_ref()),
    ) {
        println!(
            "demo verdict: PASS (engine side: kvguard {:.3} orphan-seconds, at most {:.0} % of {:.1} without it and at most {} s; no false abort)",
            k.orphan_seconds,
            demo::ENGINE_ORPHAN_SHARE * 100.0,
            l.orphan_seconds,
            demo::ENGINE_ORPHAN_BOUND_S
        );
    } else {
        println!(
            "demo verdict: PASS (no false abort; no engine-side figure on this engine or hop)"
        );
    }
    Ok(())
}

fn main() -> Result<()> {
    let a = Args::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        match a.serve_vllm.clone() {
            Some(f) => serve_vllm(f).await,
            // On SIGINT/SIGTERM the demo future is dropped, and with it every process it
            // started (Envoy, kvguard-control, vLLM: each in its own process group).
            None => tokio::select! {
                r = demo(a) => r,
                _ = kvguard_integration::cli::wait_for_signal() => {
                    bail!("interrupted: stopping every process the demo started")
                }
            },
        }
    })
}
