//! The command line: flags, their checks (a bad value names the flag and the fix) and the
//! exit codes CI reads.

use clap::{Parser, ValueEnum};
use std::path::PathBuf;
use std::time::Duration;

/// Exit codes: distinct, so that CI can tell a leak from a run that could not decide and
/// from a setup that is wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Exit {
    /// 0: every tested kind of abandoned request was freed; KV returned at quiet checkpoints.
    NoLeak = 0,
    /// 1: the engine kept working for clients that had left, or KV (or memory) did not
    /// return at quiet checkpoints.
    Leaks = 1,
    /// 2: the signals do not decide (background traffic, no quiet checkpoint, requests too
    /// short to tell freed from finished, stopped early, too many errors).
    Inconclusive = 2,
    /// 3: a flag is wrong (the message names it).
    BadFlags = 3,
    /// 4: the target cannot be reached (DNS, connect, no answer in time).
    TargetUnreachable = 4,
    /// 5: the engine's metrics cannot be read, lack the names leakcheck needs, or belong
    /// to an engine the target does not route to.
    EngineMetrics = 5,
    /// 6: the model does not exist at the target.
    ModelNotFound = 6,
    /// 7: the target answers errors (auth, 5xx, not OpenAI-compatible).
    TargetErrors = 7,
    /// 8: the report or plot could not be written.
    Output = 8,
}

impl Exit {
    /// The process exit code.
    pub fn code(self) -> u8 {
        self as u8
    }
}

/// The text after `--help`: exit codes and the safety notes.
pub const AFTER_HELP: &str = "\
Exit codes: 0 no leak, 1 leaks, 2 inconclusive, 3 bad flags, 4 target unreachable,
5 engine metrics unusable, 6 model not found, 7 target answers errors, 8 report not written.

It abandons requests on purpose (orphans, if your path leaks): point it at a dedicated
replica, not at production traffic. It stops sending once KV usage passes --kv-stop, and
answers 'inconclusive' when other traffic keeps the engine from quiet checkpoints.";

/// Which OpenAI endpoint the requests use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Completions,
}

/// GPU memory at quiet checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Gpu {
    /// Through NVML when it loads on this host (meaningful when the engine runs here).
    Auto,
    /// Not read.
    Off,
}

/// `kvguard-leakcheck` flags.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "kvguard-leakcheck",
    version,
    about = "Does your serving path free the engine work of clients that left? Runs a seeded, \
             bounded workload through your gateway, abandons a share of the requests, watches \
             the engine's metrics and gives a verdict: leaks, no leak, or inconclusive.",
    after_help = AFTER_HELP
)]
pub struct Args {
    /// Your gateway's base URL, `http://host:port[/prefix]` (requests go to
    /// `<prefix>/v1/chat/completions`).
    #[arg(long)]
    pub target: String,
    /// The engine's own metrics, e.g. `http://engine:8000/metrics` (vLLM, SGLang). With
    /// prefill/decode disaggregation: the decode engine's (the one that streams).
    #[arg(long)]
    pub engine_metrics: String,
    /// Prefill/decode disaggregation: the prefill engine's own metrics, e.g.
    /// `http://prefill:8000/metrics`. Adds the prefill-side check: KV blocks held on the
    /// prefill engine with nothing running there (awaiting a decode side that never reads
    /// them), for how long, against --free-within.
    #[arg(long)]
    pub prefill_metrics: Option<String>,
    /// Model name to ask for; default: the only model `<target>/v1/models` lists.
    #[arg(long)]
    pub model: Option<String>,
    /// Extra request header `Name: value` (repeatable), e.g. `Authorization: Bearer sk-..`.
    #[arg(long = "header", value_parser = parse_header)]
    pub headers: Vec<(String, String)>,
    /// Arrival time in all (e.g. `60s`, `2m`), split into phases, one per request kind per
    /// round; each phase is followed by a quiet checkpoint.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Arrivals per second.
    #[arg(long, default_value_t = 1.0)]
    pub rate: f64,
    /// Share of requests (streaming and non-streaming) whose client disconnects before the end.
    #[arg(long, default_value_t = 0.3)]
    pub disconnect_share: f64,
    /// Share of streaming requests in the silent phases whose client stops reading, keeps
    /// its socket open for a while, then closes it.
    #[arg(long, default_value_t = 0.3)]
    pub silent_share: f64,
    /// Share of streaming requests in the early phases whose client leaves before the
    /// first token (at 10–40 % of the probe's time to first token: with prefill/decode
    /// disaggregation, during the prefill or the hand-off). Default: 0.3 with
    /// --prefill-metrics, else 0 (no early phase).
    #[arg(long)]
    pub early_share: Option<f64>,
    /// Share of the arrival time spent on non-streaming requests (0 = none, 1 = only).
    #[arg(long, default_value_t = 0.3)]
    pub non_streaming_share: f64,
    /// `max_tokens` of every request: long enough that an abandoned request that is not
    /// freed keeps the engine busy for well over --free-within.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: u32,
    /// Rounds: each round runs every kind's phase once (more quiet checkpoints, a slope).
    #[arg(long, default_value_t = 2)]
    pub rounds: u32,
    /// RNG seed (which requests are abandoned, and when).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Stop sending as soon as the engine's KV usage passes this (0..1].
    #[arg(long, default_value_t = 0.9)]
    pub kv_stop: f64,
    /// An abandoned request freed within this long after its client left counts as freed.
    #[arg(long, default_value = "3s", value_parser = parse_duration)]
    pub free_within: Duration,
    /// Longest wait for a quiet checkpoint (engine: nothing running, nothing waiting).
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    pub quiet_timeout: Duration,
    /// How often the engine's metrics are read.
    #[arg(long, default_value = "250ms", value_parser = parse_duration)]
    pub sample_interval: Duration,
    /// Most requests of this run in flight at once.
    #[arg(long, default_value_t = 16)]
    pub max_in_flight: usize,
    /// Bound on each request (and on each check before the run).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub request_timeout: Duration,
    /// The endpoint.
    #[arg(long, value_enum, default_value = "chat")]
    pub api: Api,
    /// JSON object merged into every request body (e.g. `{"ignore_eos": true}`).
    #[arg(long)]
    pub extra_body: Option<String>,
    /// KV usage above the baseline at a quiet checkpoint that counts as not returned.
    #[arg(long, default_value_t = 0.02)]
    pub kv_tolerance: f64,
    /// Memory growth across quiet checkpoints (share of the first) that counts as growth.
    #[arg(long, default_value_t = 0.10)]
    pub memory_tolerance: f64,
    /// GPU memory through NVML.
    #[arg(long, value_enum, default_value = "auto")]
    pub gpu: Gpu,
    /// Write the JSON report here.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Write an SVG plot (KV usage, running and waiting, the orphan estimate) here.
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

/// `Name: value`.
fn parse_header(s: &str) -> Result<(String, String), String> {
    let (k, v) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?}: expected `Name: value`"))?;
    let k = k.trim();
    if k.is_empty()
        || !k
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(format!("{s:?}: bad header name {k:?}"));
    }
    Ok((k.to_ascii_lowercase(), v.trim().to_string()))
}

/// `250ms`, `3s`, `2m`, or plain seconds (`1.5`).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, mult) = if let Some(n) = s.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = s.strip_suffix('h') {
        (n, 3600.0)
    } else {
        (s, 1.0)
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("{s:?}: expected a duration like 250ms, 3s, 2m"))?;
    if !v.is_finite() || v < 0.0 {
        return Err(format!("{s:?}: must be a positive duration"));
    }
    Ok(Duration::from_secs_f64(v * mult))
}

impl Args {
    /// `--early-share` as given, else its default (0.3 with `--prefill-metrics`, else 0).
    pub fn early_share(&self) -> f64 {
        match (self.early_share, &self.prefill_metrics) {
            (Some(v), _) => v,
            (None, Some(_)) => 0.3,
            (None, None) => 0.0,
        }
    }

    /// Checks values clap cannot: each error names the flag and what to pass.
    pub fn validate(&self) -> Result<(), String> {
        let share = |name: &str, v: f64| {
            if (0.0..=1.0).contains(&v) {
                Ok(())
            } else {
                Err(format!("--{name} {v}: must be between 0 and 1"))
            }
        };
        share("disconnect-share", self.disconnect_share)?;
        share("silent-share", self.silent_share)?;
        share("early-share", self.early_share())?;
        share("non-streaming-share", self.non_streaming_share)?;
        share("kv-tolerance", self.kv_tolerance)?;
        if !(self.rate > 0.0 && self.rate <= 50.0) {
            return Err(format!(
                "--rate {}: must be above 0 and at most 50 per second (it is a check, not a load test)",
                self.rate
            ));
        }
        if !(self.kv_stop > 0.0 && self.kv_stop <= 1.0) {
            return Err(format!("--kv-stop {}: must be in (0, 1]", self.kv_stop));
        }
        if self.duration < Duration::from_secs(1) || self.duration > Duration::from_secs(3600) {
            return Err("--duration: between 1s and 1h".into());
        }
        if !(8..=100_000).contains(&self.max_tokens) {
            return Err(format!(
                "--max-tokens {}: between 8 and 100000",
                self.max_tokens
            ));
        }
        if !(1..=50).contains(&self.rounds) {
            return Err(format!("--rounds {}: between 1 and 50", self.rounds));
        }
        if self.max_in_flight == 0 || self.max_in_flight > 1024 {
            return Err(format!(
                "--max-in-flight {}: between 1 and 1024",
                self.max_in_flight
            ));
        }
        if self.sample_interval < Duration::from_millis(50)
            || self.sample_interval > Duration::from_secs(10)
        {
            return Err("--sample-interval: between 50ms and 10s".into());
        }
        if self.free_within < self.sample_interval {
            return Err("--free-within: at least --sample-interval".into());
        }
        if self.request_timeout < Duration::from_secs(1) {
            return Err("--request-timeout: at least 1s".into());
        }
        if self.quiet_timeout < Duration::from_secs(1) {
            return Err("--quiet-timeout: at least 1s".into());
        }
        if !(self.memory_tolerance > 0.0 && self.memory_tolerance.is_finite()) {
            return Err("--memory-tolerance: above 0 (0.10 = 10 %)".into());
        }
        if self.disconnect_share == 0.0 && self.silent_share == 0.0 && self.early_share() == 0.0 {
            return Err(
                "--disconnect-share, --silent-share and --early-share are all 0: nothing would be abandoned"
                    .into(),
            );
        }
        if let Some(p) = &self.prefill_metrics {
            if p.trim_end_matches('/') == self.engine_metrics.trim_end_matches('/') {
                return Err(format!(
                    "--prefill-metrics {p}: the same as --engine-metrics; pass the prefill \
                     engine's own /metrics there, and the decode engine's (the one that \
                     streams) as --engine-metrics"
                ));
            }
            if self.quiet_timeout <= self.free_within {
                return Err(
                    "--quiet-timeout: above --free-within with --prefill-metrics (quiet \
                     checkpoints wait for the prefill engine's held blocks to return; vLLM \
                     holds them up to its kv_lease_duration, 30 s)"
                        .into(),
                );
            }
        }
        if let Some(e) = &self.extra_body {
            match serde_json::from_str::<serde_json::Value>(e) {
                Ok(serde_json::Value::Object(_)) => {}
                _ => return Err(format!("--extra-body {e:?}: must be a JSON object")),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_headers() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("3s"), Ok(Duration::from_secs(3)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("soon").is_err());
        assert_eq!(
            parse_header("Authorization: Bearer x:y"),
            Ok(("authorization".into(), "Bearer x:y".into()))
        );
        assert!(parse_header("no colon").is_err());
    }

    #[test]
    fn validation_names_the_flag() {
        let mut a = Args::parse_from([
            "kvguard-leakcheck",
            "--target",
            "http://127.0.0.1:1",
            "--engine-metrics",
            "http://127.0.0.1:2/metrics",
        ]);
        assert_eq!(a.validate(), Ok(()));
        a.disconnect_share = 1.5;
        assert!(a.validate().unwrap_err().contains("--disconnect-share"));
        a.disconnect_share = 0.3;
        a.rate = 0.0;
        assert!(a.validate().unwrap_err().contains("--rate"));
        a.rate = 1.0;
        a.extra_body = Some("[1]".into());
        assert!(a.validate().unwrap_err().contains("--extra-body"));
        a.extra_body = None;

        // P/D: the early phase is on by default with --prefill-metrics, off without.
        assert_eq!(a.early_share(), 0.0);
        a.prefill_metrics = Some("http://127.0.0.1:3/metrics".into());
        assert_eq!(a.early_share(), 0.3);
        assert_eq!(a.validate(), Ok(()));
        a.early_share = Some(0.0);
        assert_eq!(a.early_share(), 0.0);
        a.early_share = Some(1.5);
        assert!(a.validate().unwrap_err().contains("--early-share"));
        a.early_share = None;
        a.prefill_metrics = Some("http://127.0.0.1:2/metrics/".into());
        let e = a.validate().unwrap_err();
        assert!(
            e.contains("--prefill-metrics") && e.contains("decode"),
            "{e}"
        );
        a.prefill_metrics = Some("http://127.0.0.1:3/metrics".into());
        a.quiet_timeout = a.free_within;
        assert!(a.validate().unwrap_err().contains("--quiet-timeout"));
        a.quiet_timeout = Duration::from_secs(120);
        a.disconnect_share = 0.0;
        a.silent_share = 0.0;
        assert_eq!(a.validate(), Ok(()), "the early phase alone abandons");
        a.early_share = Some(0.0);
        assert!(a.validate().unwrap_err().contains("--early-share"));
    }
}
