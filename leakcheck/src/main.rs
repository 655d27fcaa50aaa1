//! `kvguard-leakcheck`: does *your* serving path free the engine work of clients that
//! left? An operator's command and a CI gate (docs/LEAKCHECK.md).
//!
//! It runs a seeded, bounded workload through the gateway (`--target`) against any
//! OpenAI-compatible engine, abandons a share of the requests in three ways (a stream
//! dropped, a stream gone silent, a non-streaming request dropped), watches the engine's
//! own metrics (`--engine-metrics`: vLLM or SGLang names) and reports, per kind, whether
//! the abandoned requests were freed and how fast, orphan-seconds, KV usage at quiet
//! checkpoints and its slope, and a verdict: leaks, no leak, or inconclusive with the
//! reason. Exit codes: see [`cli::Exit`].
#![forbid(unsafe_code)]

mod analyze;
mod cli;
mod engine;
mod preflight;
mod report;
mod workload;

use clap::Parser;
use cli::{Args, Exit};
use std::process::ExitCode;

fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => {
            use clap::error::ErrorKind;
            let _ = e.print();
            return match e.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => ExitCode::SUCCESS,
                _ => ExitCode::from(Exit::BadFlags.code()),
            };
        }
    };
    if let Err(e) = args.validate() {
        eprintln!("kvguard-leakcheck: {e}");
        return ExitCode::from(Exit::BadFlags.code());
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvguard-leakcheck: cannot start the runtime: {e}");
            return ExitCode::from(Exit::Output.code());
        }
    };
    let code = rt.block_on(run(args));
    // Client tasks still held (none should be) must not keep the process alive.
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    ExitCode::from(code.code())
}

async fn run(args: Args) -> Exit {
    eprintln!(
        "kvguard-leakcheck: checking {} (engine metrics {}{}) ...",
        args.target,
        args.engine_metrics,
        args.prefill_metrics
            .as_deref()
            .map_or(String::new(), |p| format!(", prefill engine metrics {p}"))
    );
    let ready = match preflight::run(&args).await {
        Ok(r) => r,
        Err(f) => {
            eprintln!("kvguard-leakcheck: {}", f.message);
            eprintln!("kvguard-leakcheck: exit {} ({:?})", f.exit.code(), f.exit);
            return f.exit;
        }
    };
    eprintln!(
        "kvguard-leakcheck: model {:?}, probe stream {} events at {:.0} ms each; running the workload ({:?} of arrivals at {}/s, {} rounds)",
        ready.model,
        ready.probe_events,
        ready.probe_s_per_event * 1000.0,
        args.duration,
        args.rate,
        args.rounds
    );
    let data = workload::run(&args, &ready).await;
    let th = analyze::Thresholds {
        free_within_s: args.free_within.as_secs_f64(),
        kv_tolerance: args.kv_tolerance,
        memory_tolerance: args.memory_tolerance,
        sample_interval_s: args.sample_interval.as_secs_f64(),
        pressure_kv: 0.8,
    };
    let a = analyze::analyze(
        &data,
        &th,
        ready.probe_s_per_event,
        f64::from(args.max_tokens),
    );
    let exit = match a.verdict {
        analyze::Verdict::Leaks => Exit::Leaks,
        analyze::Verdict::NoLeak => Exit::NoLeak,
        analyze::Verdict::Inconclusive => Exit::Inconclusive,
    };
    print!("{}", report::text(&a, &ready, &data));
    let settings = serde_json::json!({
        "target": args.target, "engine_metrics": args.engine_metrics, "model": ready.model,
        "prefill_metrics": args.prefill_metrics, "early_share": args.early_share(),
        "duration_s": args.duration.as_secs_f64(), "rate": args.rate,
        "disconnect_share": args.disconnect_share, "silent_share": args.silent_share,
        "non_streaming_share": args.non_streaming_share, "max_tokens": args.max_tokens,
        "rounds": args.rounds, "seed": args.seed, "kv_stop": args.kv_stop,
        "free_within_s": args.free_within.as_secs_f64(),
        "quiet_timeout_s": args.quiet_timeout.as_secs_f64(),
        "sample_interval_s": args.sample_interval.as_secs_f64(),
        "max_in_flight": args.max_in_flight, "api": args.api,
        "extra_body": args.extra_body, "headers": args.headers.iter().map(|(k, _)| k).collect::<Vec<_>>(),
    });
    let mut out = exit;
    if let Some(p) = &args.report {
        let rep = report::Report {
            tool: format!("kvguard-leakcheck {}", env!("CARGO_PKG_VERSION")),
            verdict: a.verdict,
            exit_code: exit.code(),
            reasons: &a.reasons,
            settings,
            preflight: &ready,
            analysis: &a,
            run: &data,
        };
        let written = serde_json::to_string_pretty(&rep)
            .map_err(|e| e.to_string())
            .and_then(|t| std::fs::write(p, t + "\n").map_err(|e| e.to_string()));
        match written {
            Ok(()) => eprintln!("kvguard-leakcheck: report {}", p.display()),
            Err(e) => {
                eprintln!(
                    "kvguard-leakcheck: cannot write --report {}: {e}",
                    p.display()
                );
                out = Exit::Output;
            }
        }
    }
    if let Some(p) = &args.plot {
        match std::fs::write(p, report::svg(&a, &data)) {
            Ok(()) => eprintln!("kvguard-leakcheck: plot {}", p.display()),
            Err(e) => {
                eprintln!(
                    "kvguard-leakcheck: cannot write --plot {}: {e}",
                    p.display()
                );
                out = Exit::Output;
            }
        }
    }
    eprintln!("kvguard-leakcheck: exit {} ({:?})", out.code(), out);
    out
}
