//! The benchmark's outputs: the machine description, a markdown table and an SVG chart
//! (written directly, no plotting dependency).

use serde_json::{json, Value};
use std::fmt::Write as _;

/// Where it ran: CPU model, cores, memory, kernel, Envoy version.
pub fn machine() -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_owned())
        .unwrap_or_default();
    let mem = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .next()
        .unwrap_or_default()
        .to_owned();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let envoy = crate::paths::envoy_bin()
        .ok()
        .and_then(|b| std::process::Command::new(b).arg("--version").output().ok())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    json!({
        "cpu": model,
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "memory": mem,
        "kernel": kernel.trim(),
        "envoy": envoy,
        "loadavg_at_start": load.trim(),
    })
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

/// `median [q1…q3] (min…max)`; results recorded before the quartiles were (no `q1`)
/// read `median (min…max)`.
fn spread(v: &Value, scale: f64, digits: usize) -> String {
    let x = |k: &str| f(&v[k]) * scale;
    let iqr = if v["q1"].is_number() {
        format!(" [{:.*}…{:.*}]", digits, x("q1"), digits, x("q3"))
    } else {
        String::new()
    };
    format!(
        "{:.*}{iqr} ({:.*}…{:.*})",
        digits,
        x("median"),
        digits,
        x("min"),
        digits,
        x("max")
    )
}

/// A ratio's spread as percentages: `+m% [q1…q3] (min…max)`.
fn pct(v: &Value) -> String {
    let p = |k: &str| (f(&v[k]) - 1.0) * 100.0;
    let iqr = if v["q1"].is_number() {
        format!(" [{:+.1}…{:+.1}]", p("q1"), p("q3"))
    } else {
        String::new()
    };
    format!(
        "{:+.1}%{iqr} ({:+.1}…{:+.1})",
        p("median"),
        p("min"),
        p("max")
    )
}

/// How a spread across rounds reads, for table titles.
const SPREAD: &str = "median [interquartile range] (min…max) across rounds";

/// The markdown tables of a result.
pub fn markdown(res: &Value) -> String {
    let mut m = String::new();
    let _ = writeln!(
        m,
        "Machine: {} × {} cores, {}; kernel {}; {}; load average at start {}; CPU pinning: {}.\n",
        res["machine"]["cpu"].as_str().unwrap_or("?"),
        res["machine"]["cores"],
        res["machine"]["memory"]
            .as_str()
            .unwrap_or("?")
            .replace("MemTotal:", "memory")
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" "),
        res["machine"]["kernel"].as_str().unwrap_or("?"),
        res["machine"]["envoy"].as_str().unwrap_or("?"),
        res["machine"]["loadavg_at_start"].as_str().unwrap_or("?"),
        res["options"]["pinning"].as_str().unwrap_or("none")
    );
    instructions_md(&mut m, &res["instructions"]);
    if let Some(sum) = res["overhead"]["summary"].as_array() {
        let _ = writeln!(
            m,
            "### Filter overhead ({} interleaved rounds; {SPREAD})\n",
            res["overhead"]["rounds"]
        );
        let _ = writeln!(m, "| scenario | listener | Envoy CPU µs/event | TTFB p50 ms | TTFB p99 ms | inter-event p99 ms | events/s | errors |");
        let _ = writeln!(m, "|---|---|---|---|---|---|---|---|");
        for s in sum {
            let name = s["scenario"]["name"].as_str().unwrap_or("?");
            for v in ["none", "noop", "noop-read", "kvguard"] {
                let x = &s["variants"][v];
                let _ = writeln!(
                    m,
                    "| {name} | {v} | {} | {} | {} | {} | {} | {} |",
                    spread(&x["cpu_us_per_event"], 1.0, 2),
                    spread(&x["ttfb_p50_ms"], 1.0, 2),
                    spread(&x["ttfb_p99_ms"], 1.0, 2),
                    spread(&x["inter_event_p99_ms"], 1.0, 2),
                    spread(&x["throughput_events_per_s"], 1.0, 0),
                    x["errors"]
                );
            }
        }
        let _ = writeln!(m, "\nCPU per relayed event, ratios per round ({SPREAD}):\n");
        let _ = writeln!(m, "| scenario | kvguard vs noop (goal ≤ +3%) | kvguard vs none (goal ≤ +10%) | noop vs none (wasm runtime) | noop-read vs noop (body copy into the VM) | kvguard vs noop-read (scan + bookkeeping) |");
        let _ = writeln!(m, "|---|---|---|---|---|---|");
        for s in sum {
            let _ = writeln!(
                m,
                "| {} | {} | {} | {} | {} | {} |",
                s["scenario"]["name"].as_str().unwrap_or("?"),
                pct(&s["cpu_kvguard_over_noop"]),
                pct(&s["cpu_kvguard_over_none"]),
                pct(&s["cpu_noop_over_none"]),
                pct(&s["cpu_noop_read_over_noop"]),
                pct(&s["cpu_kvguard_over_noop_read"])
            );
        }
        let c = &res["overhead"]["cost_split"];
        if !c.is_null() {
            let _ = writeln!(
                m,
                "\nEnvoy CPU per stream split into a per-request and a per-event part (h1-sat-100 with 64 events per stream vs h1-sat-100-short with 4; per round, CPU per stream = per-request + events × per-event):\n"
            );
            let _ = writeln!(
                m,
                "| listener | per request µs | per event µs |\n|---|---|---|"
            );
            for v in [
                "none",
                "noop",
                "noop-read",
                "kvguard",
                "kvguard_minus_noop_read",
            ] {
                let _ = writeln!(
                    m,
                    "| {} | {} | {} |",
                    if v == "kvguard_minus_noop_read" {
                        "kvguard − noop-read"
                    } else {
                        v
                    },
                    spread(&c[v]["per_request_us"], 1.0, 2),
                    spread(&c[v]["per_event_us"], 1.0, 3)
                );
            }
        }
        let p = &res["overhead"]["ttfb_probe"];
        if !p.is_null() {
            let _ = writeln!(
                m,
                "\nTTFB of sequential probe requests (fresh connection each) with {}:\n",
                p["background"].as_str().unwrap_or("?")
            );
            let _ = writeln!(
                m,
                "| listener | probe TTFB p50 µs | probe TTFB p99 µs |\n|---|---|---|"
            );
            for v in ["none", "noop", "noop-read", "kvguard"] {
                let x = &p["variants"][v];
                let _ = writeln!(
                    m,
                    "| {v} | {} | {} |",
                    spread(&x["p50_us"], 1.0, 0),
                    spread(&x["p99_us"], 1.0, 0)
                );
            }
            let _ = writeln!(
                m,
                "\nkvguard's added TTFB at 1,000 streams (per-round differences): p50 {} µs vs none (goal ≤ 50), {} µs vs noop; p99 {} µs vs none (goal ≤ 200), {} µs vs noop.",
                spread(&p["kvguard_added_p50_us_vs_none"], 1.0, 0),
                spread(&p["kvguard_added_p50_us_vs_noop"], 1.0, 0),
                spread(&p["kvguard_added_p99_us_vs_none"], 1.0, 0),
                spread(&p["kvguard_added_p99_us_vs_noop"], 1.0, 0)
            );
        }
        let _ = writeln!(
            m,
            "\nAborts sent during the healthy overhead load: {} (must be 0).\n",
            res["overhead"]["aborts_sent_during_healthy_load"]
        );
    }
    let a = &res["abort"];
    if !a.is_null() {
        let _ = writeln!(m, "### Abort latency and stall detection\n");
        let _ = writeln!(m, "| measure | n | p50 | p90 | p99 | max | missing |");
        let _ = writeln!(m, "|---|---|---|---|---|---|---|");
        let row = |m: &mut String, label: &str, p: &Value, _n: &Value, miss: &Value| {
            if !p.is_null() {
                let _ = writeln!(
                    m,
                    "| {label} | {} | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms | {} |",
                    p["n"],
                    f(&p["p50"]),
                    f(&p["p90"]),
                    f(&p["p99"]),
                    f(&p["max"]),
                    miss.as_u64()
                        .map_or_else(|| "–".to_owned(), |v| v.to_string())
                );
            }
        };
        row(
            &mut m,
            "client disconnect → abort received (mock receiver)",
            &a["abort_to_receiver_ms"],
            &a["abort_to_receiver_n"],
            &a["abort_to_receiver_missing"],
        );
        row(
            &mut m,
            "client disconnect → engine connection closed (via lossy hop + kvguard-control)",
            &a["abort_to_engine_closed_ms"],
            &a["abort_to_engine_closed_n"],
            &a["abort_to_engine_closed_missing"],
        );
        row(
            &mut m,
            "stall, Envoy before the upstream: detected − idle_timeout (1000 ms; tick 250 ms)",
            &a["stall_minus_threshold_ms"],
            &a["stall_streams"],
            &Value::from(""),
        );
        row(
            &mut m,
            "stall, Envoy behind the lossy hop: detected − idle_timeout",
            &a["stall_minus_threshold_ms_lossy"],
            &a["stall_streams"],
            &Value::from(""),
        );
        if let Some(h) = a["stall_histogram"].as_object() {
            let _ = writeln!(
                m,
                "\nStall detection histogram (detected − threshold): {}\n",
                h.iter()
                    .map(|(k, v)| format!("{k}: {v}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        m.push('\n');
    }
    if let Some(points) = res["memory"]["points"].as_array() {
        let _ = writeln!(m, "### Memory (one Envoy worker; observe mode)\n");
        let _ = writeln!(m, "| point | tracked | wasm VM memory | Envoy RSS |");
        let _ = writeln!(m, "|---|---|---|---|");
        for p in points {
            let _ = writeln!(
                m,
                "| {} | {} | {:.2} MiB | {:.1} MiB |",
                p["label"].as_str().unwrap_or("?"),
                p["active_requests"],
                f(&p["vm_memory_bytes"]) / 1048576.0,
                f(&p["envoy_rss_bytes"]) / 1048576.0
            );
        }
        m.push('\n');
    }
    let c = &res["control"];
    if !c.is_null() {
        let _ = writeln!(m, "### kvguard-control\n");
        let _ = writeln!(m, "| measure | value |\n|---|---|");
        let _ = writeln!(
            m,
            "| RSS idle | {:.1} MiB |",
            f(&c["rss_idle_bytes"]) / 1048576.0
        );
        let _ = writeln!(
            m,
            "| RSS after the hop load | {:.1} MiB |",
            f(&c["rss_after_load_bytes"]) / 1048576.0
        );
        let _ = writeln!(
            m,
            "| TTFB p50 direct to the upstream | {} µs |",
            spread(&c["ttfb_p50_direct_us"], 1.0, 0)
        );
        let _ = writeln!(
            m,
            "| TTFB p50 through kvguard-control | {} µs |",
            spread(&c["ttfb_p50_via_control_us"], 1.0, 0)
        );
        let _ = writeln!(
            m,
            "| hop cost (p50, goal ≤ 100 µs) | {} µs |",
            spread(&c["hop_added_p50_us"], 1.0, 0)
        );
        if !c["plain_envoy_hop_added_p50_us"].is_null() {
            let _ = writeln!(
                m,
                "| reference: the same hop through a plain Envoy (router only, same CPU) | {} µs |",
                spread(&c["plain_envoy_hop_added_p50_us"], 1.0, 0)
            );
        }
        if !c["control_cpu_us_per_request"].is_null() {
            let _ = writeln!(
                m,
                "| kvguard-control CPU per proxied request (all threads, user + kernel) | {} µs |",
                spread(&c["control_cpu_us_per_request"], 1.0, 0)
            );
        }
        if !res["abort"]["control_rss_after_abort_storm_bytes"].is_null() {
            let _ = writeln!(
                m,
                "| RSS after the abort-latency storm | {:.1} MiB |",
                f(&res["abort"]["control_rss_after_abort_storm_bytes"]) / 1048576.0
            );
        }
        m.push('\n');
    }
    relay_md(&mut m, &res["relay"]);
    requests_md(&mut m, &res["requests"]);
    m
}

/// The `relay` section's table: kvguard-control against a plain Envoy relaying the same
/// paced streams.
fn relay_md(m: &mut String, r: &Value) {
    if r["cpu_us_per_event"].is_null() {
        return;
    }
    let _ = writeln!(
        m,
        "### kvguard-control on the data path vs a plain Envoy ({} interleaved rounds; {} streams × {} events, {} concurrent, {} µs apart; {SPREAD})\n",
        r["rounds"], r["load"]["requests"], r["load"]["events"], r["load"]["concurrency"], r["load"]["interval_us"]
    );
    let _ = writeln!(
        m,
        "| measure | kvguard-control | plain Envoy |\n|---|---|---|"
    );
    let row = |m: &mut String, what: &str, key: &str, digits: usize| {
        let _ = writeln!(
            m,
            "| {what} | {} | {} |",
            spread(&r[key]["kvguard-control"], 1.0, digits),
            spread(&r[key]["envoy"], 1.0, digits)
        );
    };
    row(m, "CPU per relayed event, µs", "cpu_us_per_event", 2);
    row(
        m,
        "added TTFB (sequential requests: p50 − direct p50), µs",
        "ttfb_added_p50_us",
        0,
    );
    if let Some(phases) = r["memory"].as_array() {
        for ph in phases {
            let mem = |p: &str| f(&ph[p]["bytes_per_stream"]);
            let _ = writeln!(
                m,
                "| memory per held stream ({} held, {}, {} per client connection; fresh process), bytes | {:.0} | {:.0} |",
                ph["kvguard-control"]["streams_held"],
                ph["protocol"].as_str().unwrap_or("?"),
                ph["streams_per_connection"],
                mem("kvguard-control"),
                mem("envoy")
            );
        }
    } else {
        // Runs before the h2c phase: one HTTP/1.1 phase, after the rounds.
        let mem = |p: &str| f(&r["memory"][p]["bytes_per_stream"]);
        let _ = writeln!(
            m,
            "| memory per held stream ({} held), bytes | {:.0} | {:.0} |",
            r["memory"]["kvguard-control"]["streams_held"],
            mem("kvguard-control"),
            mem("envoy")
        );
    }
    let _ = writeln!(
        m,
        "\nCPU per event, kvguard-control ÷ Envoy (per round): {}. Errors: {}.\n",
        spread(&r["cpu_control_over_envoy"], 1.0, 2),
        r["errors"]
    );
    if let Some(phases) = r["memory"].as_array() {
        let fds = |ph: &Value, p: &str| {
            let files = match (ph[p]["fds_before"].as_u64(), ph[p]["fds_held"].as_u64()) {
                (Some(a), Some(b)) => format!("{a} → {b} open files, "),
                _ => String::new(),
            };
            format!(
                "{files}RSS {:.1} → {:.1} MiB",
                f(&ph[p]["rss_before_bytes"]) / 1048576.0,
                f(&ph[p]["rss_held_bytes"]) / 1048576.0
            )
        };
        for ph in phases {
            let _ = writeln!(
                m,
                "Held over {} (before → held): kvguard-control {}; Envoy {}.",
                ph["protocol"].as_str().unwrap_or("?"),
                fds(ph, "kvguard-control"),
                fds(ph, "envoy")
            );
        }
        let _ = writeln!(m);
    }
}

/// The `instructions` section's tables (the headline): Envoy's instructions per request
/// and per event by listener, the differences and ratios, how far the rounds agree, and
/// where kvguard's instructions go (by object, the functions that grew most).
fn instructions_md(m: &mut String, r: &Value) {
    let Some(summary) = r["summary"].as_object() else {
        return;
    };
    let _ = writeln!(
        m,
        "### Instructions (Envoy under callgrind; {} rounds; per round {} one-event and {} × {}-event requests per listener, sequential over one connection, in lock step; net of the idle rate)\n",
        r["rounds"], r["requests_one_event"], r["requests_long"], r["long_events"]
    );
    let _ = writeln!(
        m,
        "| listener | instructions / request | − noop | − none | ÷ noop | rounds differ by | instructions / event | rounds differ by | − noop-read | − noop | ÷ noop at {} events |\n|---|---|---|---|---|---|---|---|---|---|---|",
        r["long_events"]
    );
    let variants: Vec<&str> = r["variants"]
        .as_array()
        .map(|v| v.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    for v in variants {
        let x = &summary[v];
        if x.is_null() {
            continue;
        }
        let _ = writeln!(
            m,
            "| {v} | {:.0} | {:+.0} | {:+.0} | {:.3} | {:.2} % | {:.0} | {:.2} % | {:+.0} | {:+.0} | {:.3} |",
            f(&x["per_request"]),
            f(&x["per_request_minus_noop"]),
            f(&x["per_request_minus_none"]),
            f(&x["per_request_over_noop"]),
            100.0 * f(&x["per_request_disagreement"]),
            f(&x["per_event"]),
            100.0 * f(&x["per_event_disagreement"]),
            f(&x["per_event_minus_noop_read"]),
            f(&x["per_event_minus_noop"]),
            f(&x["per_request_long_over_noop"]),
        );
    }
    for (key, what) in [
        ("kvguard_minus_noop_per_request", "kvguard − noop"),
        ("noop_minus_none_per_request", "noop − none"),
    ] {
        let b = &r[key];
        let Some(objs) = b["by_object"].as_array() else {
            continue;
        };
        let _ = writeln!(
            m,
            "\n{what}, self instructions per one-event request by object (last round):\n\n| object | {what} |\n|---|---|"
        );
        for o in objs {
            let _ = writeln!(
                m,
                "| {} | {:+.0} |",
                o["object"].as_str().unwrap_or("?"),
                f(&o["a_minus_b"])
            );
        }
        if key == "kvguard_minus_noop_per_request" {
            let _ = writeln!(
                m,
                "\nThe functions whose self instructions per request changed most, {what}:\n\n| object | function | {what} |\n|---|---|---|"
            );
            for t in b["top_functions"].as_array().into_iter().flatten() {
                let _ = writeln!(
                    m,
                    "| {} | `{}` | {:+.0} |",
                    t["object"].as_str().unwrap_or("?"),
                    t["function"].as_str().unwrap_or("?"),
                    f(&t["a_minus_b"])
                );
            }
        }
    }
    let _ = writeln!(
        m,
        "\nCallgrind dumps: {}; call graphs (`callgrind_annotate --inclusive=yes`): {}. Aborts sent during the healthy load: {} (must be 0).\n",
        r["callgrind_dir"].as_str().unwrap_or("?"),
        r["annotated"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(", "))
            .unwrap_or_default(),
        r["aborts_sent_during_healthy_load"]
    );
}

/// The `requests` section's table: Envoy CPU per request per client and variant, and
/// the per-round differences to the do-nothing filter and to no filter.
fn requests_md(m: &mut String, r: &Value) {
    let Some(summary) = r["summary"].as_object() else {
        return;
    };
    let _ = writeln!(
        m,
        "### Per request ({} rounds; {} one-event requests at {} concurrent per run; {SPREAD})\n",
        r["rounds"], r["requests_per_run"], r["concurrency"]
    );
    let _ = writeln!(
        m,
        "| client | listener | Envoy CPU µs/request | − noop µs | − none µs | − noop-read µs | req/s | failed |\n|---|---|---|---|---|---|---|---|"
    );
    let variants: Vec<&str> = r["variants"]
        .as_array()
        .map(|v| v.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    for (client, by_v) in summary {
        for v in &variants {
            let x = &by_v[*v];
            if x.is_null() {
                continue;
            }
            let _ = writeln!(
                m,
                "| {client} | {v} | {} | {} | {} | {} | {} | {} |",
                spread(&x["cpu_us_per_request"], 1.0, 2),
                spread(&x["minus_noop_us"], 1.0, 2),
                spread(&x["minus_none_us"], 1.0, 2),
                spread(&x["minus_noop_read_us"], 1.0, 2),
                spread(&x["req_per_s"], 1.0, 0),
                x["failed"]
            );
        }
    }
    let measured = |x: &Value| x["per_event_us"]["median"].is_number();
    if let Some(pe) = r["per_event"]
        .as_object()
        .filter(|o| o.values().any(measured))
    {
        let _ = writeln!(
            m,
            "\nPer event (load-h1-64 vs load-h1, per round: (CPU/request at 64 events − at 1) / 63):\n\n| listener | Envoy CPU µs/event | − noop-read µs | − noop µs |\n|---|---|---|---|"
        );
        for v in &variants {
            let x = &pe[*v];
            if !measured(x) {
                continue;
            }
            let _ = writeln!(
                m,
                "| {v} | {} | {} | {} |",
                spread(&x["per_event_us"], 1.0, 3),
                spread(&x["minus_noop_read_us"], 1.0, 3),
                spread(&x["minus_noop_us"], 1.0, 3)
            );
        }
    }
    if let Some(hc) = r["host_call_ns"].as_object().filter(|o| !o.is_empty()) {
        let _ = writeln!(
            m,
            "\nOne host call, measured (the do-nothing filter makes it {} times per request; h2load-h1; per round (CPU/request − noop's) / {}):\n\n| host call | ns each |\n|---|---|",
            r["host_call_repeats"], r["host_call_repeats"]
        );
        for (c, v) in hc {
            let _ = writeln!(m, "| {c} | {} |", spread(v, 1.0, 0));
        }
    }
    let _ = writeln!(
        m,
        "\nAborts sent during the healthy per-request load: {} (must be 0).\n",
        r["aborts_sent_during_healthy_load"]
    );
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// An SVG chart: Envoy CPU per event by scenario and listener (left), abort latency
/// percentiles (right).
pub fn svg(res: &Value) -> String {
    let colors = [
        ("none", "#7f7f7f"),
        ("noop", "#1f77b4"),
        ("noop-read", "#9467bd"),
        ("kvguard", "#2ca02c"),
    ];
    let sum = res["overhead"]["summary"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let (w, h) = (900.0, 360.0);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    // Left: grouped bars.
    let (x0, y0, pw, ph) = (50.0, 40.0, 520.0, 250.0);
    let _ = writeln!(
        s,
        r#"<text x="{x0}" y="20" font-size="13" font-weight="bold">Envoy CPU per relayed event (µs, median of rounds)</text>"#
    );
    let max = sum
        .iter()
        .flat_map(|sc| {
            colors
                .iter()
                .map(move |(v, _)| f(&sc["variants"][*v]["cpu_us_per_event"]["max"]))
        })
        .filter(|x| x.is_finite())
        .fold(0.0f64, f64::max)
        .max(1e-9);
    let _ = writeln!(
        s,
        r#"<line x1="{x0}" y1="{}" x2="{}" y2="{}" stroke="black"/>"#,
        y0 + ph,
        x0 + pw,
        y0 + ph
    );
    for i in 0..=4 {
        let v = max * i as f64 / 4.0;
        let y = y0 + ph - ph * i as f64 / 4.0;
        let _ = writeln!(
            s,
            r##"<line x1="{x0}" y1="{y}" x2="{}" y2="{y}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{v:.1}</text>"##,
            x0 + pw,
            x0 - 4.0,
            y + 4.0
        );
    }
    let n = sum.len().max(1) as f64;
    let gw = pw / n;
    let bw = gw / 5.0;
    for (i, sc) in sum.iter().enumerate() {
        let gx = x0 + gw * i as f64 + bw / 2.0;
        for (j, (v, c)) in colors.iter().enumerate() {
            let x = &sc["variants"][*v]["cpu_us_per_event"];
            let (med, lo, hi) = (f(&x["median"]), f(&x["min"]), f(&x["max"]));
            if !med.is_finite() {
                continue;
            }
            let bh = ph * med / max;
            let bx = gx + bw * j as f64;
            let _ = writeln!(
                s,
                r#"<rect x="{bx:.1}" y="{:.1}" width="{:.1}" height="{bh:.1}" fill="{c}"/>"#,
                y0 + ph - bh,
                bw * 0.9
            );
            if lo.is_finite() && hi.is_finite() {
                let cx = bx + bw * 0.45;
                let _ = writeln!(
                    s,
                    r#"<line x1="{cx:.1}" y1="{:.1}" x2="{cx:.1}" y2="{:.1}" stroke="black"/>"#,
                    y0 + ph - ph * lo / max,
                    y0 + ph - ph * hi / max
                );
            }
        }
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
            gx + bw * 2.0,
            y0 + ph + 16.0,
            esc(sc["scenario"]["name"].as_str().unwrap_or("?"))
        );
        let r = &sc["cpu_kvguard_over_noop"]["median"];
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{}" text-anchor="middle" fill="#2ca02c">{:+.1}% vs noop</text>"##,
            gx + bw * 2.0,
            y0 + ph + 30.0,
            (f(r) - 1.0) * 100.0
        );
    }
    for (j, (v, c)) in colors.iter().enumerate() {
        let lx = x0 + 10.0 + 100.0 * j as f64;
        let _ = writeln!(
            s,
            r#"<rect x="{lx}" y="{}" width="10" height="10" fill="{c}"/><text x="{}" y="{}">{v}</text>"#,
            h - 22.0,
            lx + 14.0,
            h - 13.0
        );
    }
    // Right: abort latency.
    let (ax, ay, aw, ah) = (640.0, 40.0, 230.0, 250.0);
    let _ = writeln!(
        s,
        r#"<text x="{ax}" y="20" font-size="13" font-weight="bold">Abort latency (ms)</text>"#
    );
    let rows = [
        ("→ receiver", &res["abort"]["abort_to_receiver_ms"]),
        (
            "→ engine closed",
            &res["abort"]["abort_to_engine_closed_ms"],
        ),
    ];
    let amax = rows
        .iter()
        .map(|(_, p)| f(&p["p99"]))
        .filter(|x| x.is_finite())
        .fold(10.0f64, f64::max);
    let _ = writeln!(
        s,
        r#"<line x1="{ax}" y1="{}" x2="{}" y2="{}" stroke="black"/>"#,
        ay + ah,
        ax + aw,
        ay + ah
    );
    let goal_y = ay + ah - ah * 10.0 / amax;
    let _ = writeln!(
        s,
        r#"<line x1="{ax}" y1="{goal_y:.1}" x2="{}" y2="{goal_y:.1}" stroke="red" stroke-dasharray="4 3"/><text x="{}" y="{:.1}" fill="red" text-anchor="end">goal p99 10 ms</text>"#,
        ax + aw,
        ax + aw,
        goal_y - 3.0
    );
    for (i, (label, p)) in rows.iter().enumerate() {
        let bx = ax + 20.0 + 110.0 * i as f64;
        for (k, (q, c)) in [("p50", "#9ecae1"), ("p99", "#3182bd")].iter().enumerate() {
            let v = f(&p[*q]);
            if !v.is_finite() {
                continue;
            }
            let bh = ah * v / amax;
            let x = bx + 40.0 * k as f64;
            let _ = writeln!(
                s,
                r#"<rect x="{x:.1}" y="{:.1}" width="36" height="{bh:.1}" fill="{c}"/><text x="{:.1}" y="{:.1}" text-anchor="middle">{q} {v:.1}</text>"#,
                ay + ah - bh,
                x + 18.0,
                ay + ah - bh - 3.0
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
            bx + 38.0,
            ay + ah + 16.0,
            esc(label)
        );
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spread_reads_with_its_interquartile_range_when_recorded() {
        let v = json!({"median": 2.0, "q1": 1.5, "q3": 3.0, "min": 1.0, "max": 4.0});
        assert_eq!(spread(&v, 1.0, 1), "2.0 [1.5…3.0] (1.0…4.0)");
        let r = json!({"median": 1.1, "q1": 1.05, "q3": 1.2, "min": 0.9, "max": 1.3});
        assert_eq!(pct(&r), "+10.0% [+5.0…+20.0] (-10.0…+30.0)");
        // Results recorded before the quartiles were.
        let old = json!({"median": 2.0, "min": 1.0, "max": 4.0});
        assert_eq!(spread(&old, 1.0, 1), "2.0 (1.0…4.0)");
    }

    #[test]
    fn the_relay_table_has_a_memory_row_per_phase_and_reads_runs_from_before_the_phases() {
        let s = json!({"median": 1.0, "min": 1.0, "max": 1.0});
        let both = json!({"kvguard-control": s, "envoy": s});
        let proxy = |b: f64, files: bool| {
            let mut v = json!({"streams_held": 10000, "bytes_per_stream": b,
                "rss_before_bytes": 1048576, "rss_held_bytes": 2097152});
            if files {
                v["fds_before"] = json!(14);
                v["fds_held"] = json!(10114);
            }
            v
        };
        let base = json!({"rounds": 3, "load": {}, "cpu_us_per_event": both,
            "ttfb_added_p50_us": both, "cpu_control_over_envoy": s, "errors": {}});
        let mut r = base.clone();
        r["memory"] = json!([
            {"protocol": "h2c", "streams_per_connection": 100,
             "kvguard-control": proxy(20830.2, true), "envoy": proxy(38757.0, true)},
            {"protocol": "HTTP/1.1", "streams_per_connection": 1,
             "kvguard-control": proxy(45738.0, false), "envoy": proxy(51613.0, false)},
        ]);
        let mut m = String::new();
        relay_md(&mut m, &r);
        assert!(m.contains("| memory per held stream (10000 held, h2c, 100 per client connection; fresh process), bytes | 20830 | 38757 |"), "{m}");
        assert!(m.contains("(10000 held, HTTP/1.1, 1 per client connection; fresh process), bytes | 45738 | 51613 |"), "{m}");
        assert!(
            m.contains("kvguard-control 14 → 10114 open files, RSS 1.0 → 2.0 MiB"),
            "{m}"
        );
        assert!(
            m.contains("Held over HTTP/1.1 (before → held): kvguard-control RSS 1.0 → 2.0 MiB;"),
            "{m}"
        );
        let mut old = base;
        old["memory"] =
            json!({"kvguard-control": proxy(44361.0, false), "envoy": proxy(49894.0, false)});
        let mut m = String::new();
        relay_md(&mut m, &old);
        assert!(
            m.contains("| memory per held stream (10000 held), bytes | 44361 | 49894 |"),
            "{m}"
        );
        assert!(!m.contains("Held over"), "{m}");
    }
}
