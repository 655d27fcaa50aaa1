//! From what the run recorded to a verdict, per request kind and overall, with the
//! figures behind it. Pure functions of [`RunData`], so every rule is unit-tested.
//!
//! The rules never claim more than the signals show: work at the engine beyond this run's
//! connected clients counts as orphans only while nothing else can explain it (the
//! engine never held more than this run had sent), a kind is "no leak" only when an
//! abandoned request that was *not* freed would have kept the engine busy long enough to
//! be seen, and memory growth over a few checkpoints is called warm-up-or-retention, not
//! a leak.

use crate::workload::{held_epsilon, Checkpoint, Kind, Outcome, RunData, Sample};
use serde::Serialize;
use std::collections::BTreeMap;

/// The answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Evidence of a leak.
    Leaks,
    /// Freed, and it would have shown if not.
    NoLeak,
    /// The signals do not decide.
    Inconclusive,
}

impl Verdict {
    /// As printed.
    pub fn label(self) -> &'static str {
        match self {
            Verdict::Leaks => "LEAKS",
            Verdict::NoLeak => "NO LEAK",
            Verdict::Inconclusive => "INCONCLUSIVE",
        }
    }
}

/// Thresholds (from the flags).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Thresholds {
    /// Freed within this long counts as freed (s).
    pub free_within_s: f64,
    /// KV above the baseline at a quiet checkpoint that counts as not returned.
    pub kv_tolerance: f64,
    /// Memory growth (share of the first checkpoint) that counts.
    pub memory_tolerance: f64,
    /// Sampling period (s): gaps in the series longer than 3 of these are not integrated.
    pub sample_interval_s: f64,
    /// KV usage that counts as pressure.
    pub pressure_kv: f64,
}

/// One request kind's result.
#[derive(Debug, Clone, Serialize)]
pub struct KindResult {
    /// The kind.
    pub kind: Kind,
    /// Requests sent in its phases.
    pub sent: usize,
    /// Requests whose client left on purpose.
    pub abandoned: usize,
    /// Meant to be abandoned, answered first.
    pub finished_before_leaving: usize,
    /// Read to the end.
    pub completed: usize,
    /// Failed.
    pub errors: usize,
    /// Engine time on requests whose client had gone (running + waiting beyond this run's
    /// connected clients, integrated over its phases), s.
    pub orphan_seconds: f64,
    /// `orphan_seconds / abandoned`: how long, on average, the engine kept an abandoned
    /// request after its client left (s).
    pub mean_time_to_free_s: Option<f64>,
    /// Longest wait from the phase's last client leaving to a quiet engine (s).
    pub drain_s: Option<f64>,
    /// How long an abandoned request would have kept the engine busy, on average, had it
    /// never been freed (its remaining generation at the run's pace), s.
    pub expected_if_never_freed_s: Option<f64>,
    /// Most orphans at one sample.
    pub peak_orphans: f64,
    /// Aborts the engine counted over its phases (`finished_reason="abort"`).
    pub engine_aborts: Option<f64>,
    /// The engine held more requests than this run could account for.
    pub other_traffic: bool,
    /// Verdict.
    pub verdict: Verdict,
    /// Why, with the figures.
    pub reason: String,
}

/// A classification the evidence may or may not fit.
#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    /// `orphans`, `kv_not_returned`, `kv_pressure`, `retention`.
    pub class: &'static str,
    /// Whether the evidence fits it.
    pub fits: bool,
    /// The figures.
    pub detail: String,
}

/// KV and memory at quiet checkpoints.
#[derive(Debug, Clone, Default, Serialize)]
pub struct QuietFigures {
    /// Checkpoints (baseline first).
    pub checkpoints: usize,
    /// KV at the baseline.
    pub kv_baseline: Option<f64>,
    /// KV at the last checkpoint.
    pub kv_last: Option<f64>,
    /// Highest KV at a checkpoint after the baseline.
    pub kv_max_quiet: Option<f64>,
    /// KV slope across checkpoints, per minute (least squares).
    pub kv_slope_per_min: Option<f64>,
    /// Peak KV under load.
    pub kv_peak: Option<f64>,
    /// Peak waiting under load.
    pub waiting_peak: f64,
    /// Memory used for the retention check: `gpu` (NVML) or `process_rss` (the metrics
    /// process's `process_resident_memory_bytes`), or none.
    pub memory_source: Option<&'static str>,
    /// Memory at the first and the last checkpoint (bytes).
    pub memory_first_bytes: Option<f64>,
    /// At the last.
    pub memory_last_bytes: Option<f64>,
    /// Memory slope, bytes per minute.
    pub memory_slope_per_min: Option<f64>,
    /// Memory never fell between checkpoints.
    pub memory_monotonic: bool,
}

/// P/D: the prefill engine's blocks held with nothing running there (awaiting a decode
/// side that never reads them: the client left before the decode leg, behind a proxy
/// that does not tell the prefill side).
#[derive(Debug, Clone, Serialize)]
pub struct PrefillFigures {
    /// The prefill engine's KV usage with nothing there (the lowest at any checkpoint).
    pub kv_baseline: Option<f64>,
    /// KV blocks in its pool (`vllm:cache_config_info`), when exported.
    pub num_blocks: Option<f64>,
    /// Longest stretch of readings that showed blocks held above the baseline with nothing
    /// running or waiting there (s; from its first reading to its last: a lower bound).
    pub held_longest_s: f64,
    /// Those stretches together (s).
    pub held_total_s: f64,
    /// KV usage above the baseline integrated over those readings (share of the pool × s).
    pub held_kv_seconds: f64,
    /// The same in blocks × s, when the pool size is known.
    pub held_block_seconds: Option<f64>,
    /// Most KV held at one such reading, above the baseline (share of the pool).
    pub held_peak_kv: f64,
    /// Stretches longer than --free-within.
    pub stretches_past_bound: usize,
    /// Abandoned requests of the early phases (clients gone before the first token: the
    /// case that strands the prefill side).
    pub early_abandoned: usize,
    /// Readings of the prefill engine.
    pub readings: usize,
    /// Verdict for the prefill side.
    pub verdict: Verdict,
    /// Why, with the figures.
    pub reason: String,
}

/// The whole analysis.
#[derive(Debug, Clone, Serialize)]
pub struct Analysis {
    /// Overall verdict.
    pub verdict: Verdict,
    /// Why.
    pub reasons: Vec<String>,
    /// Per kind.
    pub kinds: Vec<KindResult>,
    /// Quiet-checkpoint figures.
    pub quiet: QuietFigures,
    /// Classification.
    pub findings: Vec<Finding>,
    /// P/D: the prefill side (`--prefill-metrics`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill: Option<PrefillFigures>,
    /// The run's pace: seconds per data event of completed streams (median).
    pub s_per_event: Option<f64>,
    /// Median data events of completed streams.
    pub events_per_stream: Option<f64>,
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

/// Least-squares slope of `(x, y)`, per unit of x.
pub fn slope(points: &[(f64, f64)]) -> Option<f64> {
    if points.len() < 2 {
        return None;
    }
    let n = points.len() as f64;
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    if sxx <= 0.0 {
        return None;
    }
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    Some(sxy / sxx)
}

/// Samples that showed more engine work than this run could account for, three in a row.
fn other_traffic(samples: &[&Sample]) -> bool {
    let mut run = 0;
    for s in samples {
        if s.engine.in_engine() > (s.live + s.abandoned_open) as f64 + 0.5 {
            run += 1;
            if run >= 3 {
                return true;
            }
        } else {
            run = 0;
        }
    }
    false
}

/// The prefill side of a P/D run: stretches of readings where it held blocks above its
/// baseline with nothing running or waiting there.
pub fn prefill_figures(d: &RunData, th: &Thresholds) -> PrefillFigures {
    let f = th.free_within_s;
    let readings: Vec<(f64, crate::engine::Scrape)> = d
        .samples
        .iter()
        .filter_map(|s| Some((s.t, s.prefill?)))
        .collect();
    let num_blocks = readings.iter().find_map(|(_, p)| p.num_blocks);
    let eps = held_epsilon(num_blocks);
    let kv_baseline = d
        .baseline
        .iter()
        .chain(d.checkpoints.iter())
        .filter_map(|c| c.prefill_kv)
        .reduce(f64::min);
    let early_abandoned = d
        .requests
        .iter()
        .filter(|r| r.kind == Kind::StreamingEarly && r.outcome == Outcome::Abandoned)
        .count();
    let mut p = PrefillFigures {
        kv_baseline,
        num_blocks,
        held_longest_s: 0.0,
        held_total_s: 0.0,
        held_kv_seconds: 0.0,
        held_block_seconds: None,
        held_peak_kv: 0.0,
        stretches_past_bound: 0,
        early_abandoned,
        readings: readings.len(),
        verdict: Verdict::Inconclusive,
        reason: String::new(),
    };
    let Some(base) = kv_baseline else {
        p.reason = "the prefill engine was never quiet (nothing running or waiting there): no baseline for the blocks it holds".into();
        return p;
    };
    // Blocks held above the baseline with nothing running or waiting there.
    let held =
        |s: &crate::engine::Scrape| s.in_engine() == 0.0 && s.kv.is_some_and(|kv| kv - base > eps);
    let mut start: Option<f64> = None;
    let mut last = 0.0;
    let close = |p: &mut PrefillFigures, from: f64, to: f64| {
        let len = to - from;
        p.held_total_s += len;
        p.held_longest_s = p.held_longest_s.max(len);
        if len > f {
            p.stretches_past_bound += 1;
        }
    };
    for (i, (t, s)) in readings.iter().enumerate() {
        if held(s) {
            let above = s.kv.unwrap_or(base) - base;
            p.held_peak_kv = p.held_peak_kv.max(above);
            if let Some((t1, _)) = readings.get(i + 1) {
                p.held_kv_seconds += above * (t1 - t).min(3.0 * th.sample_interval_s);
            }
            // A gap in the readings ends a stretch: it is not known what happened there.
            if let Some(from) = start.filter(|_| t - last > 3.0 * th.sample_interval_s) {
                close(&mut p, from, last);
                start = None;
            }
            start.get_or_insert(*t);
            last = *t;
        } else if let Some(from) = start.take() {
            close(&mut p, from, last);
        }
    }
    if let Some(from) = start {
        close(&mut p, from, last);
    }
    p.held_block_seconds = num_blocks.map(|n| n * p.held_kv_seconds);
    let blocks = |kv: f64| match num_blocks {
        Some(n) => format!("{:.0} blocks", kv * n),
        None => format!("{:.1} % of its KV", 100.0 * kv),
    };
    let amount = match p.held_block_seconds {
        Some(b) => format!("{b:.0} block-seconds"),
        None => format!("{:.2} pool-seconds", p.held_kv_seconds),
    };
    if p.held_longest_s > f {
        p.verdict = Verdict::Leaks;
        p.reason = format!(
            "the prefill engine held blocks with nothing running there for up to {:.1} s (--free-within {f:.1} s): up to {} awaiting a decode side that never read them, {amount} in all over {} stretches past the bound",
            p.held_longest_s,
            blocks(p.held_peak_kv),
            p.stretches_past_bound
        );
    } else if readings.is_empty() {
        p.reason = "no reading of the prefill engine".into();
    } else {
        p.verdict = Verdict::NoLeak;
        p.reason = format!(
            "the prefill engine held blocks with nothing running there for at most {:.1} s ({amount}); {}",
            p.held_longest_s,
            if early_abandoned == 0 {
                "no client left before its first token (--early-share 0): a hand-off leak was not provoked".to_string()
            } else {
                format!("{early_abandoned} clients left before their first token")
            }
        );
    }
    p
}

/// Analyses a run.
pub fn analyze(
    d: &RunData,
    th: &Thresholds,
    fallback_s_per_event: f64,
    fallback_events: f64,
) -> Analysis {
    let completed_streams: Vec<_> = d
        .requests
        .iter()
        .filter(|r| r.outcome == Outcome::Completed && r.kind != Kind::NonStreamingDropped)
        .collect();
    let s_per_event = median(
        completed_streams
            .iter()
            .filter(|r| r.events > 1)
            .filter_map(|r| Some((r.ended_s - r.first_event_s?) / (r.events - 1) as f64))
            .collect(),
    );
    let events_per_stream = median(completed_streams.iter().map(|r| r.events as f64).collect());
    let tau = s_per_event.unwrap_or(fallback_s_per_event);
    let events_nat = events_per_stream.unwrap_or(fallback_events);
    let ttft = median(
        completed_streams
            .iter()
            .filter_map(|r| Some(r.first_event_s? - r.sent_s))
            .collect(),
    )
    .unwrap_or(tau);
    let natural_stream = ttft + events_nat * tau;
    let natural_nonstream = median(
        d.requests
            .iter()
            .filter(|r| r.outcome == Outcome::Completed && r.kind == Kind::NonStreamingDropped)
            .map(|r| r.ended_s - r.sent_s)
            .collect(),
    )
    .unwrap_or(natural_stream);

    let mut kinds: BTreeMap<Kind, Vec<usize>> = BTreeMap::new();
    for p in &d.phases {
        kinds.entry(p.kind).or_default().push(p.index);
    }
    let f = th.free_within_s;
    let mut results = Vec::new();
    for (kind, idx) in &kinds {
        let reqs: Vec<_> = d
            .requests
            .iter()
            .filter(|r| idx.contains(&r.phase))
            .collect();
        let count = |o: Outcome| reqs.iter().filter(|r| r.outcome == o).count();
        let abandoned = count(Outcome::Abandoned);
        let samples: Vec<&Sample> = d
            .samples
            .iter()
            .filter(|s| s.phase.is_some_and(|p| idx.contains(&p)))
            .collect();
        let mut orphan_seconds = 0.0;
        for w in samples.windows(2) {
            if w[0].phase == w[1].phase {
                let dt = (w[1].t - w[0].t).min(3.0 * th.sample_interval_s);
                orphan_seconds += w[0].orphans() * dt;
            }
        }
        let peak_orphans = samples.iter().map(|s| s.orphans()).fold(0.0, f64::max);
        let engine_aborts = {
            let by_phase: Vec<f64> = idx
                .iter()
                .filter_map(|p| {
                    let in_p: Vec<_> = samples.iter().filter(|s| s.phase == Some(*p)).collect();
                    Some(in_p.last()?.engine.aborted? - in_p.first()?.engine.aborted?)
                })
                .collect();
            (!by_phase.is_empty()).then(|| by_phase.iter().sum())
        };
        let phases: Vec<_> = d.phases.iter().filter(|p| idx.contains(&p.index)).collect();
        let all_quiet = phases.iter().all(|p| p.quiet_s.is_some());
        let drain_s = all_quiet
            .then(|| {
                phases
                    .iter()
                    .filter_map(|p| Some((p.quiet_s? - p.clients_done_s).max(0.0)))
                    .fold(0.0, f64::max)
            })
            .filter(|_| !phases.is_empty());
        let expected: Vec<f64> = reqs
            .iter()
            .filter(|r| r.outcome == Outcome::Abandoned)
            .filter_map(|r| {
                let held = r.gone_s? - r.sent_s;
                Some(match kind {
                    Kind::StreamingDropped => (events_nat - r.events as f64).max(0.0) * tau,
                    Kind::StreamingSilent | Kind::StreamingEarly => {
                        (natural_stream - held).max(0.0)
                    }
                    Kind::NonStreamingDropped => (natural_nonstream - held).max(0.0),
                })
            })
            .collect();
        let expected_if_never_freed_s =
            (!expected.is_empty()).then(|| expected.iter().sum::<f64>() / expected.len() as f64);
        let mean_time_to_free_s = (abandoned > 0).then(|| orphan_seconds / abandoned as f64);
        let other = other_traffic(&samples);
        let (verdict, reason) = if abandoned == 0 {
            (
                Verdict::Inconclusive,
                "no request of this kind was abandoned (each finished first, failed, or none was sent): raise --duration, --rate or the share".to_string(),
            )
        } else if other {
            (
                Verdict::Inconclusive,
                "the engine held more requests than this run had sent: other traffic (or a hop that resends requests) — run against a dedicated replica".to_string(),
            )
        } else if !all_quiet {
            (
                Verdict::Inconclusive,
                format!(
                    "no quiet checkpoint after a phase: the engine still held requests with every client gone ({orphan_seconds:.1} orphan-seconds so far) — a leak that outlives generation, or other traffic"
                ),
            )
        } else if mean_time_to_free_s.unwrap_or(0.0) > f || drain_s.unwrap_or(0.0) > f {
            (
                Verdict::Leaks,
                format!(
                    "abandoned requests kept the engine busy {:.1} s on average after their client left (--free-within {f:.1} s); the engine went quiet {:.1} s after the phase's last client; {orphan_seconds:.1} orphan-seconds for {abandoned} abandoned requests",
                    mean_time_to_free_s.unwrap_or(0.0),
                    drain_s.unwrap_or(0.0)
                ),
            )
        } else if expected_if_never_freed_s.unwrap_or(0.0) < 2.0 * f {
            (
                Verdict::Inconclusive,
                format!(
                    "an abandoned request would have ended by itself within {:.1} s on average, too soon to tell freed from finished (--free-within {f:.1} s): raise --max-tokens (vLLM: --extra-body '{{\"ignore_eos\": true}}')",
                    expected_if_never_freed_s.unwrap_or(0.0)
                ),
            )
        } else {
            (
                Verdict::NoLeak,
                format!(
                    "freed {:.2} s on average after the client left (it would have run {:.1} s more if never freed); quiet {:.1} s after the phase's last client",
                    mean_time_to_free_s.unwrap_or(0.0),
                    expected_if_never_freed_s.unwrap_or(0.0),
                    drain_s.unwrap_or(0.0)
                ),
            )
        };
        results.push(KindResult {
            kind: *kind,
            sent: reqs.len(),
            abandoned,
            finished_before_leaving: count(Outcome::FinishedBeforeLeaving),
            completed: count(Outcome::Completed),
            errors: count(Outcome::Error),
            orphan_seconds,
            mean_time_to_free_s,
            drain_s,
            expected_if_never_freed_s,
            peak_orphans,
            engine_aborts,
            other_traffic: other,
            verdict,
            reason,
        });
    }

    // Quiet checkpoints.
    let cps: Vec<&Checkpoint> = d.baseline.iter().chain(d.checkpoints.iter()).collect();
    let mut q = QuietFigures {
        checkpoints: cps.len(),
        kv_baseline: d.baseline.and_then(|b| b.kv),
        kv_last: d.checkpoints.last().and_then(|c| c.kv),
        kv_max_quiet: d.checkpoints.iter().filter_map(|c| c.kv).reduce(f64::max),
        kv_slope_per_min: slope(
            &cps.iter()
                .filter_map(|c| Some((c.t / 60.0, c.kv?)))
                .collect::<Vec<_>>(),
        ),
        kv_peak: d.kv_peak,
        waiting_peak: d
            .samples
            .iter()
            .map(|s| s.engine.waiting)
            .fold(0.0, f64::max),
        ..QuietFigures::default()
    };
    let gpu: Vec<(f64, f64)> = cps
        .iter()
        .filter_map(|c| Some((c.t, c.gpu_used_bytes?)))
        .collect();
    let rss: Vec<(f64, f64)> = cps
        .iter()
        .filter_map(|c| Some((c.t, c.rss_bytes?)))
        .collect();
    let (src, mem) = if gpu.len() == cps.len() && !gpu.is_empty() {
        (Some("gpu"), gpu)
    } else if rss.len() == cps.len() && !rss.is_empty() {
        (Some("process_rss"), rss)
    } else {
        (None, Vec::new())
    };
    q.memory_source = src;
    q.memory_first_bytes = mem.first().map(|m| m.1);
    q.memory_last_bytes = mem.last().map(|m| m.1);
    q.memory_slope_per_min = slope(&mem.iter().map(|(t, v)| (t / 60.0, *v)).collect::<Vec<_>>());
    q.memory_monotonic = mem.len() >= 2 && mem.windows(2).all(|w| w[1].1 >= w[0].1);

    let mut reasons = Vec::new();
    let mut findings = Vec::new();
    let leaking: Vec<_> = results
        .iter()
        .filter(|r| r.verdict == Verdict::Leaks)
        .collect();
    findings.push(Finding {
        class: "orphans",
        fits: !leaking.is_empty(),
        detail: if leaking.is_empty() {
            "no kind of abandoned request kept the engine busy past --free-within".into()
        } else {
            format!(
                "the engine kept working for clients that had left: {}",
                leaking
                    .iter()
                    .map(|r| format!(
                        "{} ({:.1} orphan-seconds, {:.1} s each)",
                        r.kind.label(),
                        r.orphan_seconds,
                        r.mean_time_to_free_s.unwrap_or(0.0)
                    ))
                    .collect::<Vec<_>>()
                    .join("; ")
            )
        },
    });
    let kv_delta = match (q.kv_baseline, q.kv_last) {
        (Some(b), Some(l)) => Some(l - b),
        _ => None,
    };
    let kv_not_returned = kv_delta.is_some_and(|x| x > th.kv_tolerance);
    if let Some(delta) = kv_delta {
        findings.push(Finding {
            class: "kv_not_returned",
            fits: kv_not_returned,
            detail: format!(
                "KV at the last quiet checkpoint {:.1} % vs {:.1} % at the baseline ({:+.1} points; tolerance {:.1}); slope across checkpoints {:+.2} points/min",
                100.0 * q.kv_last.unwrap_or(0.0),
                100.0 * q.kv_baseline.unwrap_or(0.0),
                100.0 * delta,
                100.0 * th.kv_tolerance,
                100.0 * q.kv_slope_per_min.unwrap_or(0.0)
            ),
        });
        if kv_not_returned {
            reasons.push(format!(
                "KV blocks not returned to the pool: {:.1} % in use at the last quiet checkpoint with nothing running, {:.1} % at the baseline",
                100.0 * q.kv_last.unwrap_or(0.0),
                100.0 * q.kv_baseline.unwrap_or(0.0)
            ));
        }
        let pressured = q.kv_peak.is_some_and(|p| p >= th.pressure_kv) || q.waiting_peak >= 1.0;
        findings.push(Finding {
            class: "kv_pressure",
            fits: pressured && !kv_not_returned,
            detail: format!(
                "under load KV peaked at {:.0} %, up to {:.0} requests waited; {}",
                100.0 * q.kv_peak.unwrap_or(0.0),
                q.waiting_peak,
                match (kv_not_returned, pressured) {
                    (true, _) => "KV did not return at quiet checkpoints, so not (only) pressure",
                    (false, true) => "KV returned to the baseline at quiet checkpoints: high usage under load is capacity, not a leak",
                    (false, false) => "no pressure (KV below 80 %, nothing waited)",
                }
            ),
        });
    }
    let mut retention_inconclusive = None;
    if let (Some(src), Some(first), Some(last)) =
        (q.memory_source, q.memory_first_bytes, q.memory_last_bytes)
    {
        let growth = last - first;
        let grows = q.memory_monotonic && first > 0.0 && growth > th.memory_tolerance * first;
        let what = if src == "gpu" {
            "GPU memory (NVML, this host)"
        } else {
            "the engine's process memory (process_resident_memory_bytes of the process serving its metrics)"
        };
        let fits = grows && !kv_not_returned;
        let n = q.checkpoints;
        findings.push(Finding {
            class: "retention",
            fits: fits && n >= 6,
            detail: format!(
                "{what}: {:.0} MiB at the first quiet checkpoint, {:.0} MiB at the last ({:+.1} %, {}) over {n} checkpoints",
                first / 1048576.0,
                last / 1048576.0,
                100.0 * growth / first.max(1.0),
                if q.memory_monotonic { "never fell" } else { "not monotonic" }
            ),
        });
        if fits && n >= 6 {
            reasons.push(format!(
                "memory outside the KV pool grows at quiet checkpoints while KV returns (retention or fragmentation): {what} rose {:.0} MiB over {n} checkpoints",
                growth / 1048576.0
            ));
        } else if fits {
            retention_inconclusive = Some(format!(
                "{what} rose {:.0} MiB over only {n} quiet checkpoints while KV returned: warm-up or retention — rerun with more --rounds to tell",
                growth / 1048576.0
            ));
        }
    } else {
        findings.push(Finding {
            class: "retention",
            fits: false,
            detail: "not measured: no GPU memory (NVML) and no process_resident_memory_bytes at every checkpoint".into(),
        });
    }

    let prefill = d.prefill.then(|| prefill_figures(d, th));
    if let Some(p) = &prefill {
        findings.push(Finding {
            class: "prefill_held",
            fits: p.verdict == Verdict::Leaks,
            detail: p.reason.clone(),
        });
        if p.verdict == Verdict::Leaks {
            reasons.push(format!("prefill side: {}", p.reason));
        }
    }
    for r in &results {
        if r.verdict == Verdict::Leaks {
            reasons.push(format!("{}: {}", r.kind.label(), r.reason));
        }
    }
    let errors = d
        .requests
        .iter()
        .filter(|r| r.outcome == Outcome::Error)
        .count();
    let verdict = if !reasons.is_empty() {
        Verdict::Leaks
    } else {
        let mut inc = Vec::new();
        if let Some(s) = &d.stopped {
            inc.push(format!("stopped early: {s}"));
        }
        if results.is_empty() {
            inc.push("no phase ran".into());
        }
        for r in &results {
            if r.verdict == Verdict::Inconclusive {
                inc.push(format!("{}: {}", r.kind.label(), r.reason));
            }
        }
        if !d.requests.is_empty() && errors * 5 > d.requests.len() {
            let first = d
                .requests
                .iter()
                .find_map(|r| r.error.clone())
                .unwrap_or_default();
            inc.push(format!(
                "{errors} of {} requests failed (first: {first})",
                d.requests.len()
            ));
        }
        if let Some(r) = retention_inconclusive {
            inc.push(r);
        }
        if let Some(p) = prefill
            .as_ref()
            .filter(|p| p.verdict == Verdict::Inconclusive)
        {
            inc.push(format!("prefill side: {}", p.reason));
        }
        if inc.is_empty() {
            for r in &results {
                reasons.push(format!("{}: {}", r.kind.label(), r.reason));
            }
            if let Some(p) = &prefill {
                reasons.push(format!("prefill side: {}", p.reason));
            }
            Verdict::NoLeak
        } else {
            reasons = inc;
            Verdict::Inconclusive
        }
    };
    Analysis {
        verdict,
        reasons,
        kinds: results,
        quiet: q,
        findings,
        prefill,
        s_per_event,
        events_per_stream,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Scrape;
    use crate::workload::{Phase, RequestRecord};

    const TH: Thresholds = Thresholds {
        free_within_s: 2.0,
        kv_tolerance: 0.02,
        memory_tolerance: 0.10,
        sample_interval_s: 0.25,
        pressure_kv: 0.8,
    };

    fn sample(t: f64, phase: usize, in_engine: f64, live: usize, open: usize) -> Sample {
        Sample {
            t,
            phase: Some(phase),
            engine: Scrape {
                running: in_engine,
                kv: Some(in_engine / 100.0),
                ..Scrape::default()
            },
            live,
            abandoned_open: open,
            prefill: None,
        }
    }

    fn req(
        kind: Kind,
        outcome: Outcome,
        sent: f64,
        gone: Option<f64>,
        ended: f64,
        events: u64,
    ) -> RequestRecord {
        RequestRecord {
            phase: 0,
            kind,
            abandon: outcome == Outcome::Abandoned,
            sent_s: sent,
            first_event_s: Some(sent + 0.1),
            gone_s: gone,
            ended_s: ended,
            events,
            drop_after_events: None,
            leave_after_s: None,
            outcome,
            status: Some(200),
            error: None,
        }
    }

    fn cp(t: f64, kv: f64, rss: Option<f64>) -> Checkpoint {
        Checkpoint {
            t,
            after_phase: None,
            kv: Some(kv),
            rss_bytes: rss,
            gpu_used_bytes: None,
            prefill_kv: None,
        }
    }

    /// One streaming-dropped phase from 0 to 20 s: one completed stream (0..10 s, 100
    /// events: 0.1 s per event), one stream dropped at 1 s after 10 events whose engine
    /// work ends at `freed_at`; quiet from `quiet` on.
    fn run(freed_at: f64, quiet: f64) -> RunData {
        let mut samples = Vec::new();
        let mut t = 0.0;
        while t < quiet + 1.0 {
            let live = usize::from(t < 10.0) + usize::from(t < 1.0);
            let open = usize::from(t >= 1.0);
            let e = f64::from(u8::from(t < 10.0)) + f64::from(u8::from(t < freed_at));
            samples.push(sample(t, 0, e, live, open));
            t += 0.25;
        }
        RunData {
            baseline: Some(cp(0.0, 0.0, None)),
            checkpoints: vec![cp(quiet, 0.0, None)],
            phases: vec![Phase {
                index: 0,
                kind: Kind::StreamingDropped,
                round: 0,
                start_s: 0.0,
                clients_done_s: 10.0,
                quiet_s: Some(quiet),
                skipped: 0,
            }],
            samples,
            requests: vec![
                req(
                    Kind::StreamingDropped,
                    Outcome::Completed,
                    0.0,
                    None,
                    10.1,
                    100,
                ),
                req(
                    Kind::StreamingDropped,
                    Outcome::Abandoned,
                    0.0,
                    Some(1.0),
                    1.0,
                    10,
                ),
            ],
            stopped: None,
            kv_peak: Some(0.02),
            scrape_failures: 0,
            gpu: "off".into(),
            wall_s: quiet + 1.0,
            prefill: false,
        }
    }

    #[test]
    fn freed_at_once_is_no_leak_with_the_figures() {
        let a = analyze(&run(1.25, 10.25), &TH, 0.1, 100.0);
        let k = &a.kinds[0];
        assert_eq!(k.verdict, Verdict::NoLeak, "{k:?}");
        assert!(k.orphan_seconds <= 0.25 + 1e-9, "{k:?}");
        // 90 events left at 0.1 s each: it would have run 9 s more.
        assert!(
            (k.expected_if_never_freed_s.unwrap() - 9.0).abs() < 0.2,
            "{k:?}"
        );
        assert_eq!(a.verdict, Verdict::NoLeak);
    }

    #[test]
    fn an_orphan_that_runs_on_leaks() {
        // Freed only at 10 s (ran to its end), 9 s after the client left.
        let a = analyze(&run(10.0, 10.25), &TH, 0.1, 100.0);
        let k = &a.kinds[0];
        assert_eq!(k.verdict, Verdict::Leaks, "{k:?}");
        assert!((k.orphan_seconds - 9.0).abs() < 0.3, "{k:?}");
        assert_eq!(a.verdict, Verdict::Leaks);
        assert!(a.findings.iter().any(|f| f.class == "orphans" && f.fits));
    }

    #[test]
    fn a_drain_past_free_within_leaks_even_with_few_orphan_seconds() {
        let mut d = run(1.25, 14.0);
        d.phases[0].quiet_s = Some(14.0);
        // The engine held one request from 10 s to 14 s with no client of this run left.
        for s in d.samples.iter_mut().filter(|s| s.t >= 10.0 && s.t < 14.0) {
            s.engine.running = 1.0;
        }
        let a = analyze(&d, &TH, 0.1, 100.0);
        assert_eq!(a.kinds[0].verdict, Verdict::Leaks, "{:?}", a.kinds[0]);
    }

    #[test]
    fn requests_too_short_to_tell_are_inconclusive() {
        // 12 events per stream: the dropped one had 2 left, 0.2 s: cannot tell.
        let mut d = run(1.25, 10.25);
        d.requests[0].events = 12;
        d.requests[0].ended_s = 1.2;
        d.requests[1].events = 10;
        let a = analyze(&d, &TH, 0.1, 12.0);
        assert_eq!(
            a.kinds[0].verdict,
            Verdict::Inconclusive,
            "{:?}",
            a.kinds[0]
        );
        assert!(
            a.kinds[0].reason.contains("--max-tokens"),
            "{}",
            a.kinds[0].reason
        );
        assert_eq!(a.verdict, Verdict::Inconclusive);
    }

    #[test]
    fn other_traffic_is_inconclusive_not_a_leak() {
        let mut d = run(1.25, 10.25);
        for s in d.samples.iter_mut().filter(|s| s.t >= 2.0 && s.t < 4.0) {
            s.engine.running += 3.0;
        }
        let a = analyze(&d, &TH, 0.1, 100.0);
        assert_eq!(
            a.kinds[0].verdict,
            Verdict::Inconclusive,
            "{:?}",
            a.kinds[0]
        );
        assert!(a.kinds[0].other_traffic);
        assert!(a.kinds[0].reason.contains("dedicated replica"));
    }

    #[test]
    fn no_quiet_checkpoint_is_inconclusive() {
        let mut d = run(1.25, 10.25);
        d.phases[0].quiet_s = None;
        d.stopped = Some("no quiet checkpoint".into());
        let a = analyze(&d, &TH, 0.1, 100.0);
        assert_eq!(a.verdict, Verdict::Inconclusive);
    }

    #[test]
    fn kv_not_returned_at_quiet_checkpoints_leaks_and_pressure_alone_does_not() {
        let mut d = run(1.25, 10.25);
        d.checkpoints[0].kv = Some(0.10);
        let a = analyze(&d, &TH, 0.1, 100.0);
        assert_eq!(a.verdict, Verdict::Leaks);
        assert!(a
            .findings
            .iter()
            .any(|f| f.class == "kv_not_returned" && f.fits));

        let mut d = run(1.25, 10.25);
        d.kv_peak = Some(0.95);
        let a = analyze(&d, &TH, 0.1, 100.0);
        assert_eq!(a.verdict, Verdict::NoLeak);
        assert!(a
            .findings
            .iter()
            .any(|f| f.class == "kv_pressure" && f.fits));
    }

    #[test]
    fn memory_growth_is_retention_only_over_enough_checkpoints() {
        let mib = 1048576.0;
        let grow = |n: usize| {
            let mut d = run(1.25, 10.25);
            d.baseline = Some(cp(0.0, 0.0, Some(1000.0 * mib)));
            d.checkpoints = (1..n)
                .map(|i| {
                    cp(
                        10.0 * i as f64,
                        0.0,
                        Some((1000.0 + 100.0 * i as f64) * mib),
                    )
                })
                .collect();
            analyze(&d, &TH, 0.1, 100.0)
        };
        let few = grow(3);
        assert_eq!(few.verdict, Verdict::Inconclusive, "{:?}", few.reasons);
        assert!(few
            .reasons
            .iter()
            .any(|r| r.contains("warm-up or retention")));
        let many = grow(6);
        assert_eq!(many.verdict, Verdict::Leaks, "{:?}", many.reasons);
        assert!(many
            .findings
            .iter()
            .any(|f| f.class == "retention" && f.fits));
    }

    /// `run(1.25, 10.25)` as a P/D run: the prefill engine (a pool of 100 blocks) holds
    /// `kv` of its pool from `from` to `to` s, running `running` requests meanwhile.
    fn pd(from: f64, to: f64, kv: f64, running: f64) -> RunData {
        let mut d = run(1.25, 10.25);
        d.prefill = true;
        d.baseline.as_mut().unwrap().prefill_kv = Some(0.0);
        d.checkpoints[0].prefill_kv = Some(0.0);
        for s in &mut d.samples {
            let on = s.t >= from && s.t < to;
            s.prefill = Some(Scrape {
                running: if on { running } else { 0.0 },
                kv: Some(if on { kv } else { 0.0 }),
                num_blocks: Some(100.0),
                ..Scrape::default()
            });
        }
        d
    }

    #[test]
    fn prefill_blocks_held_with_nothing_running_past_the_bound_leak() {
        // 5 blocks held from 2 s to 6 s with nothing running there.
        let a = analyze(&pd(2.0, 6.0, 0.05, 0.0), &TH, 0.1, 100.0);
        let p = a.prefill.as_ref().unwrap();
        assert_eq!(p.verdict, Verdict::Leaks, "{p:?}");
        // Readings every 0.25 s: the first at 2.0, the last at 5.75.
        assert!((p.held_longest_s - 3.75).abs() < 1e-9, "{p:?}");
        assert!((p.held_total_s - 3.75).abs() < 1e-9, "{p:?}");
        assert!((p.held_kv_seconds - 0.2).abs() < 1e-9, "{p:?}");
        assert!((p.held_block_seconds.unwrap() - 20.0).abs() < 1e-6, "{p:?}");
        assert!((p.held_peak_kv - 0.05).abs() < 1e-12, "{p:?}");
        assert_eq!(p.stretches_past_bound, 1);
        assert!(p.reason.contains("5 blocks"), "{}", p.reason);
        assert_eq!(a.verdict, Verdict::Leaks);
        assert!(a.reasons.iter().any(|r| r.starts_with("prefill side:")));
        assert!(a
            .findings
            .iter()
            .any(|f| f.class == "prefill_held" && f.fits));
    }

    #[test]
    fn prefill_blocks_held_briefly_or_while_running_are_no_leak() {
        // Held for one reading (the hand-off to the decode side).
        let a = analyze(&pd(2.0, 2.25, 0.05, 0.0), &TH, 0.1, 100.0);
        let p = a.prefill.as_ref().unwrap();
        assert_eq!(p.verdict, Verdict::NoLeak, "{p:?}");
        assert_eq!(p.held_longest_s, 0.0);
        assert!(p.reason.contains("--early-share 0"), "{}", p.reason);
        assert_eq!(a.verdict, Verdict::NoLeak, "{:?}", a.reasons);
        assert!(a
            .findings
            .iter()
            .any(|f| f.class == "prefill_held" && !f.fits));
        // Blocks in use while the prefill engine runs requests: its work, not held.
        let a = analyze(&pd(2.0, 6.0, 0.05, 1.0), &TH, 0.1, 100.0);
        assert_eq!(a.prefill.as_ref().unwrap().held_total_s, 0.0);
        assert_eq!(a.verdict, Verdict::NoLeak);
        // Exactly at the bound is not past it.
        let a = analyze(&pd(2.0, 4.25, 0.05, 0.0), &TH, 0.1, 100.0);
        let p = a.prefill.as_ref().unwrap();
        assert_eq!(p.held_longest_s, 2.0);
        assert_eq!(p.verdict, Verdict::NoLeak, "{p:?}");
    }

    #[test]
    fn prefill_stretches_end_at_a_gap_and_the_baseline_is_the_lowest_checkpoint() {
        // Held 2..6 s, but the readings from 3 to 5 s were lost: two stretches of 0.75 s.
        let mut d = pd(2.0, 6.0, 0.05, 0.0);
        d.samples.retain(|s| !(s.t >= 3.0 && s.t < 5.0));
        let a = analyze(&d, &TH, 0.1, 100.0);
        let p = a.prefill.as_ref().unwrap();
        assert!((p.held_longest_s - 0.75).abs() < 1e-9, "{p:?}");
        assert!((p.held_total_s - 1.5).abs() < 1e-9, "{p:?}");
        assert_eq!(p.verdict, Verdict::NoLeak);
        // A baseline taken while someone else's blocks were still held: the lowest
        // checkpoint is the baseline, and the rise above it shows.
        let mut d = pd(2.0, 6.0, 0.05, 0.0);
        d.baseline.as_mut().unwrap().prefill_kv = Some(0.10);
        let a = analyze(&d, &TH, 0.1, 100.0);
        let p = a.prefill.as_ref().unwrap();
        assert_eq!(p.kv_baseline, Some(0.0));
        assert_eq!(p.verdict, Verdict::Leaks);
        // Half a block above the baseline is noise, not a held block.
        let a = analyze(&pd(2.0, 6.0, 0.004, 0.0), &TH, 0.1, 100.0);
        assert_eq!(a.prefill.as_ref().unwrap().held_total_s, 0.0);
    }

    #[test]
    fn a_prefill_side_never_read_is_inconclusive() {
        let mut d = pd(2.0, 6.0, 0.05, 0.0);
        for s in &mut d.samples {
            s.prefill = None;
        }
        let a = analyze(&d, &TH, 0.1, 100.0);
        assert_eq!(a.prefill.as_ref().unwrap().verdict, Verdict::Inconclusive);
        assert_eq!(a.verdict, Verdict::Inconclusive, "{:?}", a.reasons);
        assert!(a
            .reasons
            .iter()
            .any(|r| r.contains("no reading of the prefill engine")));
        let mut d = pd(2.0, 6.0, 0.05, 0.0);
        d.baseline.as_mut().unwrap().prefill_kv = None;
        d.checkpoints[0].prefill_kv = None;
        let a = analyze(&d, &TH, 0.1, 100.0);
        assert!(
            a.prefill.as_ref().unwrap().reason.contains("never quiet"),
            "{:?}",
            a.prefill
        );
        assert_eq!(a.verdict, Verdict::Inconclusive);
    }

    #[test]
    fn slopes() {
        assert_eq!(slope(&[(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)]), Some(2.0));
        assert_eq!(slope(&[(0.0, 1.0)]), None);
    }
}
