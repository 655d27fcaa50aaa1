//! A small, tolerant parser for the Prometheus text exposition format, and the engine
//! figures kvguard re-exports (vLLM and SGLang names).
//!
//! Tolerant means: comments, `# HELP`/`# TYPE`, unknown metrics, timestamps, exemplars,
//! escaped label values and malformed lines are skipped without failing the scrape.

/// One sample line: `name{labels} value`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample<'a> {
    /// Metric name.
    pub name: &'a str,
    /// The raw label block without braces (may be empty).
    pub labels: &'a str,
    /// The value.
    pub value: f64,
}

/// Parses one line; `None` for comments, blanks and anything malformed.
pub fn parse_line(line: &str) -> Option<Sample<'_>> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line
        .find(|c: char| c == '{' || c.is_ascii_whitespace())
        .unwrap_or(line.len());
    let name = &line[..name_end];
    if name.is_empty()
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':')
    {
        return None;
    }
    let mut rest = &line[name_end..];
    let mut labels = "";
    if rest.starts_with('{') {
        // Find the closing brace outside quoted values (values may hold `}` and `\"`).
        let bytes = rest.as_bytes();
        let mut in_quotes = false;
        let mut escaped = false;
        let mut close = None;
        for (i, &b) in bytes.iter().enumerate().skip(1) {
            if in_quotes {
                if escaped {
                    escaped = false;
                } else if b == b'\\' {
                    escaped = true;
                } else if b == b'"' {
                    in_quotes = false;
                }
            } else if b == b'"' {
                in_quotes = true;
            } else if b == b'}' {
                close = Some(i);
                break;
            }
        }
        let close = close?;
        labels = &rest[1..close];
        rest = &rest[close + 1..];
    }
    let value_text = rest.split_ascii_whitespace().next()?;
    let value = match value_text {
        "+Inf" | "Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        v => v.parse::<f64>().ok()?,
    };
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// Every parseable sample of a text.
pub fn samples(text: &str) -> impl Iterator<Item = Sample<'_>> {
    text.lines().filter_map(parse_line)
}

/// Which engine's names a scrape matched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineFlavour {
    /// `vllm:` names.
    Vllm,
    /// `sglang:` names.
    Sglang,
    /// Neither.
    Unknown,
}

/// The engine figures of one scrape. `None`: the engine did not report it.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct EngineFigures {
    /// KV-cache usage, 0..1 (the highest across engines/models: the fullest pool is the
    /// one that queues and preempts; a sum of ratios would exceed 1).
    pub kv_usage: Option<f64>,
    /// Sequences running (summed across label sets).
    pub running: Option<f64>,
    /// Sequences waiting (summed).
    pub waiting: Option<f64>,
    /// Cumulative preemptions (summed).
    pub preemptions: Option<f64>,
}

impl EngineFigures {
    /// Whose names matched.
    pub fn flavour(text: &str) -> EngineFlavour {
        let mut flavour = EngineFlavour::Unknown;
        for s in samples(text) {
            if s.name.starts_with("vllm:") {
                return EngineFlavour::Vllm;
            }
            if s.name.starts_with("sglang:") {
                flavour = EngineFlavour::Sglang;
            }
        }
        flavour
    }

    /// Extracts the figures from an exposition text (vLLM or SGLang names).
    pub fn from_text(text: &str) -> EngineFigures {
        fn add(slot: &mut Option<f64>, v: f64) {
            if v.is_finite() {
                *slot = Some(slot.unwrap_or(0.0) + v);
            }
        }
        fn max(slot: &mut Option<f64>, v: f64) {
            if v.is_finite() {
                *slot = Some(slot.map_or(v, |s| s.max(v)));
            }
        }
        let mut f = EngineFigures::default();
        let mut kv_current = None;
        let mut kv_deprecated = None;
        for s in samples(text) {
            match s.name {
                "vllm:kv_cache_usage_perc" => max(&mut kv_current, s.value),
                "vllm:gpu_cache_usage_perc" => max(&mut kv_deprecated, s.value),
                "sglang:token_usage" => max(&mut kv_current, s.value),
                "vllm:num_requests_running" | "sglang:num_running_reqs" => {
                    add(&mut f.running, s.value)
                }
                "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => {
                    add(&mut f.waiting, s.value)
                }
                "vllm:num_preemptions_total" | "vllm:num_preemptions" => {
                    add(&mut f.preemptions, s.value)
                }
                _ => {}
            }
        }
        // The current name wins; the deprecated one (vLLM < 0.10) is the fallback.
        f.kv_usage = kv_current.or(kv_deprecated);
        f
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SGLANG: &str = r#"# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.128902e+06
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:num_running_reqs The number of running requests
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 11.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
"#;

    fn vllm_fixture() -> String {
        let p = format!(
            "{}/../integration/fixtures/vllm-0.32-metrics.txt",
            env!("CARGO_MANIFEST_DIR")
        );
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{p}: {e}"))
    }

    #[test]
    fn recorded_vllm_fixture() {
        let text = vllm_fixture();
        assert_eq!(EngineFigures::flavour(&text), EngineFlavour::Vllm);
        let f = EngineFigures::from_text(&text);
        assert_eq!(f.kv_usage, Some(0.0));
        assert_eq!(f.running, Some(0.0));
        assert_eq!(f.waiting, Some(0.0));
        assert_eq!(f.preemptions, Some(0.0));
        // Every non-comment line of the fixture parses (the parser is not lossy on real text).
        let lines = text
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
            .count();
        assert_eq!(samples(&text).count(), lines);
        // The long info line with many labels.
        let info = samples(&text)
            .find(|s| s.name == "vllm:cache_config_info")
            .unwrap();
        assert!(info.labels.contains("num_gpu_blocks=\"32768\""));
        assert_eq!(info.value, 1.0);
    }

    #[test]
    fn sglang_text() {
        assert_eq!(EngineFigures::flavour(SGLANG), EngineFlavour::Sglang);
        let f = EngineFigures::from_text(SGLANG);
        assert_eq!(f.kv_usage, Some(0.28));
        assert_eq!(f.running, Some(11.0));
        assert_eq!(f.waiting, Some(3.0));
        assert_eq!(f.preemptions, None);
    }

    #[test]
    fn sums_across_label_sets_and_deprecated_name() {
        let text = "\
vllm:num_requests_running{engine=\"0\",model_name=\"a\"} 3\n\
vllm:num_requests_running{engine=\"1\",model_name=\"a\"} 4 1700000000000\n\
vllm:num_requests_waiting{model_name=\"b\"} 2.0\n\
vllm:num_requests_waiting{model_name=\"c\"} 5.0\n\
vllm:gpu_cache_usage_perc{engine=\"0\"} 0.5\n\
vllm:gpu_cache_usage_perc{engine=\"1\"} 0.7\n\
vllm:num_preemptions_total{engine=\"0\"} 1e3\n\
vllm:num_preemptions_total{engine=\"1\"} 10\n";
        let f = EngineFigures::from_text(text);
        assert_eq!(f.running, Some(7.0));
        assert_eq!(f.waiting, Some(7.0));
        assert_eq!(f.kv_usage, Some(0.7));
        assert_eq!(f.preemptions, Some(1010.0));
        let both = format!("{text}vllm:kv_cache_usage_perc{{engine=\"0\"}} 0.25\n");
        assert_eq!(EngineFigures::from_text(&both).kv_usage, Some(0.25));
    }

    #[test]
    fn tolerant() {
        let text = "garbage line\n{x} 1\nm{a=\"}\\\"{\"} 2\nbad-name 1\nn 1.5 # {trace_id=\"x\"} 1\nz{a=\"1\"\nq NaN\n";
        let v: Vec<_> = samples(text).collect();
        assert_eq!(v.len(), 3, "{v:?}");
        assert_eq!(v[0].name, "m");
        assert_eq!(v[0].labels, "a=\"}\\\"{\"");
        assert_eq!(v[1].value, 1.5);
        assert!(v[2].value.is_nan());
        assert_eq!(EngineFigures::from_text(""), EngineFigures::default());
        assert_eq!(EngineFigures::flavour("x 1"), EngineFlavour::Unknown);
    }
}
