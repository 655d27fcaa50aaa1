//! The report: JSON (everything: settings, checks, series, per-request records, the
//! analysis), a text summary for the terminal, and an SVG plot in the spirit of the
//! demo's (KV usage over time; running, waiting and the orphan estimate below; phases
//! shaded; quiet checkpoints marked).

use crate::analyze::{Analysis, Verdict};
use crate::preflight::Ready;
use crate::workload::RunData;
use serde::Serialize;
use std::fmt::Write as _;

/// The JSON report.
#[derive(Debug, Clone, Serialize)]
pub struct Report<'a> {
    /// `kvguard-leakcheck <version>`.
    pub tool: String,
    /// The verdict.
    pub verdict: Verdict,
    /// The exit code it maps to.
    pub exit_code: u8,
    /// Why.
    pub reasons: &'a [String],
    /// The settings (the flags as given).
    pub settings: serde_json::Value,
    /// The checks before the run.
    pub preflight: &'a Ready,
    /// The analysis.
    pub analysis: &'a Analysis,
    /// The raw run.
    pub run: &'a RunData,
}

fn secs(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.2} s"))
}

/// The text summary.
pub fn text(a: &Analysis, ready: &Ready, run: &RunData) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "kvguard-leakcheck: {}", a.verdict.label());
    for r in &a.reasons {
        let _ = writeln!(o, "  - {r}");
    }
    let _ = writeln!(
        o,
        "\nmodel {:?}, engine metrics: {:?}, routing confirmed: {}, wall {:.0} s",
        ready.model,
        ready.flavour,
        match ready.routing_confirmed {
            Some(true) => "yes",
            Some(false) => "no",
            None => "not checkable",
        },
        run.wall_s
    );
    let _ = writeln!(
        o,
        "\n{:<24} {:>5} {:>9} {:>9} {:>7} {:>10} {:>12} {:>10} {:>12}  verdict",
        "kind",
        "sent",
        "abandoned",
        "completed",
        "errors",
        "orphan-s",
        "time-to-free",
        "drain",
        "if-not-freed"
    );
    for k in &a.kinds {
        let _ = writeln!(
            o,
            "{:<24} {:>5} {:>9} {:>9} {:>7} {:>10.1} {:>12} {:>10} {:>12}  {}",
            k.kind.label(),
            k.sent,
            k.abandoned,
            k.completed,
            k.errors,
            k.orphan_seconds,
            secs(k.mean_time_to_free_s),
            secs(k.drain_s),
            secs(k.expected_if_never_freed_s),
            k.verdict.label()
        );
    }
    let q = &a.quiet;
    let pct = |v: Option<f64>| v.map_or("-".into(), |v| format!("{:.1} %", 100.0 * v));
    let _ = writeln!(
        o,
        "\nquiet checkpoints: {} — KV baseline {}, last {}, highest {}, slope {}; peak under load {}, waiting peak {:.0}",
        q.checkpoints,
        pct(q.kv_baseline),
        pct(q.kv_last),
        pct(q.kv_max_quiet),
        q.kv_slope_per_min.map_or("-".into(), |s| format!("{:+.2} points/min", 100.0 * s)),
        pct(q.kv_peak),
        q.waiting_peak
    );
    if let Some(p) = &a.prefill {
        let _ = writeln!(
            o,
            "prefill side (P/D): {} — KV baseline {}, held with nothing running there: longest {:.1} s, {:.1} s in all, peak {}{}, {} early clients abandoned; prefill legs counted: {}",
            p.verdict.label(),
            pct(p.kv_baseline),
            p.held_longest_s,
            p.held_total_s,
            pct(Some(p.held_peak_kv)),
            p.held_block_seconds
                .map_or(String::new(), |b| format!(", {b:.0} block-seconds")),
            p.early_abandoned,
            match ready.prefill.as_ref().and_then(|r| r.routing_confirmed) {
                Some(true) => "yes",
                Some(false) => "no",
                None => "not checkable",
            }
        );
    }
    for f in &a.findings {
        let _ = writeln!(
            o,
            "  [{}] {}: {}",
            if f.fits { "x" } else { " " },
            f.class,
            f.detail
        );
    }
    for n in &ready.notes {
        let _ = writeln!(o, "note: {n}");
    }
    let _ = writeln!(o, "note: GPU memory {}", run.gpu);
    o
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The SVG plot.
pub fn svg(a: &Analysis, run: &RunData) -> String {
    let (w, h) = (960.0, 600.0);
    let (left, right) = (60.0, 20.0);
    let (top1, h1) = (50.0, 300.0);
    let (top2, h2) = (400.0, 150.0);
    let tmax = run.samples.last().map_or(1.0, |s| s.t).max(1.0);
    let x = |t: f64| left + (w - left - right) * t / tmax;
    let ymax2 = run
        .samples
        .iter()
        .map(|s| s.engine.running.max(s.engine.waiting).max(s.orphans()))
        .fold(1.0, f64::max)
        .ceil();
    let y1 = |kv: f64| top1 + h1 * (1.0 - kv.clamp(0.0, 1.0));
    let y2 = |v: f64| top2 + h2 * (1.0 - v / ymax2);
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(o, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        o,
        r#"<text x="{left}" y="24" font-size="16">kvguard-leakcheck: {} — engine KV usage (top), running / waiting / orphans (bottom)</text>"#,
        a.verdict.label()
    );
    let colors = ["#1f77b4", "#ff7f0e", "#9467bd", "#17becf"];
    for p in &run.phases {
        let end = p.quiet_s.unwrap_or(p.clients_done_s);
        let c = colors[p.kind as usize % colors.len()];
        for (top, hh) in [(top1, h1), (top2, h2)] {
            let _ = writeln!(
                o,
                r#"<rect x="{:.1}" y="{top}" width="{:.1}" height="{hh}" fill="{c}" opacity="0.08"/>"#,
                x(p.start_s),
                (x(end) - x(p.start_s)).max(0.5)
            );
        }
        let _ = writeln!(
            o,
            r#"<text x="{:.1}" y="{:.1}" fill="{c}" font-size="10">{}</text>"#,
            x(p.start_s) + 2.0,
            top1 + 12.0,
            esc(p.kind.label())
        );
    }
    for (top, hh) in [(top1, h1), (top2, h2)] {
        let _ = writeln!(
            o,
            r##"<rect x="{left}" y="{top}" width="{:.1}" height="{hh}" fill="none" stroke="#888"/>"##,
            w - left - right
        );
    }
    for k in 0..=4 {
        let v = f64::from(k) * 0.25;
        let _ = writeln!(
            o,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="end" fill="#555">{:.0} %</text>"##,
            left - 4.0,
            y1(v) + 4.0,
            v * 100.0
        );
    }
    let _ = writeln!(
        o,
        r##"<text x="{:.1}" y="{:.1}" text-anchor="end" fill="#555">{ymax2:.0}</text>"##,
        left - 4.0,
        top2 + 4.0
    );
    let _ = writeln!(
        o,
        r##"<text x="{:.1}" y="{:.1}" text-anchor="end" fill="#555">0</text>"##,
        left - 4.0,
        top2 + h2 + 4.0
    );
    let _ = writeln!(
        o,
        r##"<text x="{:.1}" y="{:.1}" text-anchor="end" fill="#555">{tmax:.0} s</text>"##,
        w - right,
        top2 + h2 + 18.0
    );
    let line = |o: &mut String, pts: Vec<(f64, f64)>, color: &str, dash: &str, width: f64| {
        if pts.is_empty() {
            return;
        }
        let d: Vec<String> = pts.iter().map(|(a, b)| format!("{a:.1},{b:.1}")).collect();
        let _ = writeln!(
            o,
            r#"<polyline fill="none" stroke="{color}" stroke-width="{width}" stroke-dasharray="{dash}" points="{}"/>"#,
            d.join(" ")
        );
    };
    line(
        &mut o,
        run.samples
            .iter()
            .filter_map(|s| Some((x(s.t), y1(s.engine.kv?))))
            .collect(),
        "#d62728",
        "",
        2.0,
    );
    line(
        &mut o,
        run.samples
            .iter()
            .filter_map(|s| Some((x(s.t), y1(s.prefill?.kv?))))
            .collect(),
        "#e377c2",
        "6 3",
        2.0,
    );
    line(
        &mut o,
        run.samples
            .iter()
            .map(|s| (x(s.t), y2(s.engine.running)))
            .collect(),
        "#2ca02c",
        "",
        1.5,
    );
    line(
        &mut o,
        run.samples
            .iter()
            .map(|s| (x(s.t), y2(s.engine.waiting)))
            .collect(),
        "#2ca02c",
        "4 3",
        1.5,
    );
    line(
        &mut o,
        run.samples
            .iter()
            .map(|s| (x(s.t), y2(s.orphans())))
            .collect(),
        "#8c564b",
        "",
        2.0,
    );
    for c in run.baseline.iter().chain(run.checkpoints.iter()) {
        if let Some(kv) = c.kv {
            let _ = writeln!(
                o,
                r#"<circle cx="{:.1}" cy="{:.1}" r="4" fill="black"/>"#,
                x(c.t),
                y1(kv)
            );
        }
    }
    let mut legend = vec![
        ("#d62728", "", "KV usage"),
        (
            "#8c564b",
            "",
            "orphans (running + waiting beyond this run's connected clients)",
        ),
        ("#2ca02c", "", "running"),
        ("#2ca02c", "4 3", "waiting"),
        ("black", "", "quiet checkpoints (dots)"),
    ];
    if run.prefill {
        legend.insert(1, ("#e377c2", "6 3", "prefill engine's KV usage (P/D)"));
    }
    let mut xx = left;
    let yy = h - 30.0;
    for (c, dash, label) in legend {
        let _ = writeln!(
            o,
            r#"<line x1="{xx}" y1="{yy}" x2="{:.1}" y2="{yy}" stroke="{c}" stroke-width="2" stroke-dasharray="{dash}"/>"#,
            xx + 20.0
        );
        let _ = writeln!(
            o,
            r#"<text x="{:.1}" y="{:.1}" font-size="10">{}</text>"#,
            xx + 24.0,
            yy + 4.0,
            esc(label)
        );
        xx += 40.0 + 5.5 * label.len() as f64;
    }
    let mut yy = top1 + 28.0;
    for k in &a.kinds {
        let _ = writeln!(
            o,
            r#"<text x="{:.1}" y="{yy:.1}" font-size="11">{}: {} — {:.1} orphan-seconds, {} abandoned</text>"#,
            left + 8.0,
            esc(k.kind.label()),
            k.verdict.label(),
            k.orphan_seconds,
            k.abandoned
        );
        yy += 14.0;
    }
    if let Some(p) = &a.prefill {
        let _ = writeln!(
            o,
            r#"<text x="{:.1}" y="{yy:.1}" font-size="11">prefill side: {} — held with nothing running up to {:.1} s</text>"#,
            left + 8.0,
            p.verdict.label(),
            p.held_longest_s
        );
    }
    o.push_str("</svg>\n");
    o
}
