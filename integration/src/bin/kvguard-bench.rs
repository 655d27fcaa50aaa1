//! `kvguard-bench`: kvguard's overhead, abort latency, stall detection and memory, measured
//! side by side (see `kvguard_integration::bench`). `scripts/bench` builds what it needs
//! and runs it. Writes JSON, a markdown table and an SVG chart.
use anyhow::{Context, Result};
use clap::Parser;
use kvguard_integration::bench::{self, report, BenchOptions};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    about = "kvguard benchmarks: overhead vs plain Envoy, abort latency, stall detection, memory"
)]
struct Args {
    /// Interleaved rounds of the overhead section (≥ 5 for a recorded run).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Smaller loads, for development.
    #[arg(long)]
    quick: bool,
    /// Sections: all, or a comma list of
    /// instructions,overhead,abort,stall,memory,control,relay,requests.
    #[arg(long, default_value = "all", value_delimiter = ',')]
    sections: Vec<String>,
    /// The do-nothing wasm filter (built by scripts/bench).
    #[arg(long)]
    noop_wasm: Option<PathBuf>,
    /// Disconnects per abort-latency setup.
    #[arg(long, default_value_t = 1000)]
    disconnects: usize,
    /// Tracked-stream levels of the memory section.
    #[arg(long, default_value = "1000,10000", value_delimiter = ',')]
    memory_levels: Vec<usize>,
    /// Memory waves.
    #[arg(long, default_value_t = 3)]
    memory_waves: usize,
    /// Do not pin the measured proxy to its own CPU (by default, with 2 or more CPUs,
    /// Envoy / kvguard-control run alone on the last CPU and the bench on the others).
    #[arg(long)]
    no_pin: bool,
    /// Another build of the filter to measure beside kvguard in the `requests` section,
    /// as `label=path` (repeatable), e.g. `--compare-wasm before=/tmp/kvguard-before.wasm`.
    #[arg(long, value_parser = parse_compare)]
    compare_wasm: Vec<(String, PathBuf)>,
    /// `requests` section: also measure single host calls (clock, header read, metric,
    /// histogram, filter-state write, property read), each made this many times per
    /// request by the do-nothing filter (e.g. 1000).
    #[arg(long)]
    host_call_costs: Option<u32>,
    /// `requests` section: only these clients (comma list of h2load-h1, h2load-h2,
    /// load-h1, load-h1-64; default all).
    #[arg(long, value_delimiter = ',')]
    clients: Vec<String>,
    /// Keys set in kvguard's filter configuration in the overhead and requests sections, as
    /// a JSON object. The bench's own check: `--kvguard-config '{"max_age_ms":1,"tick_ms":10}'`
    /// aborts healthy streams, and the bench must then exit non-zero.
    #[arg(long, value_parser = parse_kvguard_config)]
    kvguard_config: Option<serde_json::Map<String, serde_json::Value>>,
    /// Rounds of the `instructions` section (Envoy under callgrind; two show whether the
    /// counts agree).
    #[arg(long, default_value_t = 2)]
    instruction_rounds: usize,
    /// Headers added to every request of the `instructions` section (`x-bench-pad-<i>`,
    /// 40-byte values), for a client that sends more than the bench's five.
    #[arg(long, default_value_t = 0)]
    instruction_headers: usize,
    /// Run the soak instead of the benchmarks, for this many minutes (scripts/soak).
    #[arg(long)]
    soak_minutes: Option<f64>,
    /// Soak: allowed RSS growth (Envoy, kvguard-control) between quiet points, MiB.
    #[arg(long, default_value_t = 16)]
    soak_rss_slack_mib: u64,
    /// Soak: allowed wasm VM memory growth between quiet points, MiB.
    #[arg(long, default_value_t = 1)]
    soak_vm_slack_mib: u64,
    /// Soak, the mutation check: run the filter in observe mode (it sends no abort). The
    /// soak must then fail: its abandoned long streams outlive the quiet point.
    #[arg(long)]
    soak_filter_observe: bool,
    /// Only render <out>.md and <out>.svg again from this results JSON (no measurement).
    #[arg(long)]
    render: Option<PathBuf>,
    /// Output basename: writes <out>.json, <out>.md and <out>.svg.
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
}

/// `label=path` of `--compare-wasm` (the label names a listener: letters, digits, `-`, `_`).
fn parse_compare(s: &str) -> Result<(String, PathBuf), String> {
    let (label, path) = s
        .split_once('=')
        .ok_or_else(|| format!("--compare-wasm {s}: expected label=path"))?;
    if label.is_empty()
        || !label
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err(format!(
            "--compare-wasm {s}: the label must be letters, digits, '-' or '_'"
        ));
    }
    let path = PathBuf::from(path);
    if !path.is_file() {
        return Err(format!(
            "--compare-wasm {s}: {} is not a file",
            path.display()
        ));
    }
    Ok((label.to_owned(), path))
}

/// `--kvguard-config`: a JSON object.
fn parse_kvguard_config(s: &str) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    match serde_json::from_str(s) {
        Ok(serde_json::Value::Object(m)) => Ok(m),
        Ok(_) => Err(format!("--kvguard-config {s}: expected a JSON object")),
        Err(e) => Err(format!("--kvguard-config {s}: {e}")),
    }
}

/// Runs `fut` until it ends or SIGINT/SIGTERM arrives; on a signal the future is dropped,
/// and with it every child process guard (Envoy, kvguard-control are killed).
async fn interruptible<T>(fut: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = fut => r,
        _ = tokio::signal::ctrl_c() => anyhow::bail!("interrupted (SIGINT)"),
        _ = term.recv() => anyhow::bail!("interrupted (SIGTERM)"),
    }
}

/// Creates `<out>`'s directory and proves it writable before anything is measured, so a
/// bad `--out` fails in a second instead of after the whole run.
fn ensure_writable_out(out: &std::path::Path) -> Result<()> {
    let dir = match out.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&dir)
        .with_context(|| format!("--out {}: creating {}", out.display(), dir.display()))?;
    let probe = dir.join(format!(".kvguard-bench-write-test-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .with_context(|| format!("--out {}: {} is not writable", out.display(), dir.display()))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
    ensure_writable_out(&a.out)?;
    if let Some(json) = &a.render {
        let res: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(json)?)?;
        let with = |ext: &str| {
            let mut p = a.out.clone().into_os_string();
            p.push(ext);
            PathBuf::from(p)
        };
        std::fs::write(with(".md"), report::markdown(&res))?;
        std::fs::write(with(".svg"), report::svg(&res))?;
        println!("rendered {}.{{md,svg}}", a.out.display());
        return Ok(());
    }
    if let Some(minutes) = a.soak_minutes {
        let res = interruptible(bench::soak::run(bench::soak::SoakOptions {
            minutes,
            rss_slack: a.soak_rss_slack_mib << 20,
            vm_slack: a.soak_vm_slack_mib << 20,
            filter_observe: a.soak_filter_observe,
        }))
        .await?;
        let mut p = a.out.clone().into_os_string();
        p.push(".json");
        std::fs::write(&p, serde_json::to_string_pretty(&res)?).context("writing json")?;
        println!("{}", serde_json::to_string_pretty(&res["growth"])?);
        println!(
            "abandoned long streams: {}",
            serde_json::to_string(&res["abandoned_long_streams"])?
        );
        println!(
            "soak: {} waves, invariants held; report in {}",
            res["waves"],
            PathBuf::from(p).display()
        );
        return Ok(());
    }
    let opts = BenchOptions {
        rounds: a.rounds,
        quick: a.quick,
        sections: a.sections,
        noop_wasm: a.noop_wasm.unwrap_or_default(),
        disconnects: a.disconnects,
        memory_levels: a.memory_levels,
        memory_waves: a.memory_waves,
        pin: !a.no_pin,
        compare_wasm: a.compare_wasm,
        host_call_costs: a.host_call_costs,
        request_clients: a.clients,
        kvguard_config: a.kvguard_config.unwrap_or_default(),
        instruction_rounds: a.instruction_rounds,
        instruction_headers: a.instruction_headers,
        callgrind_dir: {
            let mut d = a.out.clone().into_os_string();
            d.push("-callgrind");
            PathBuf::from(d)
        },
    };
    let res = interruptible(bench::run(opts)).await?;
    let with = |ext: &str| {
        let mut p = a.out.clone().into_os_string();
        p.push(ext);
        PathBuf::from(p)
    };
    std::fs::write(with(".json"), serde_json::to_string_pretty(&res)?).context("writing json")?;
    let md = report::markdown(&res);
    std::fs::write(with(".md"), &md).context("writing markdown")?;
    std::fs::write(with(".svg"), report::svg(&res)).context("writing svg")?;
    println!("{md}");
    println!("wrote {}.{{json,md,svg}}", a.out.display());
    let aborted = bench::healthy_load_aborts(&res);
    if !aborted.is_empty() {
        anyhow::bail!(
            "{}: a healthy stream must never be aborted (results in {}.json)",
            aborted.join("; "),
            a.out.display()
        );
    }
    Ok(())
}
