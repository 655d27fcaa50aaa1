//! A real Prometheus server for the live observability tests: it scrapes the stack's
//! Envoy (`/stats/prometheus`), kvguard-control (`/metrics`) and the engine (`/metrics`)
//! at a short interval and evaluates the shipped rules and alerts
//! (`envoy-config/prometheus/kvguard.{rules,alerts}.yaml`) with only their time windows,
//! offsets, `for:` and group intervals divided by a factor ([`scale_durations`]), so a
//! run of a minute exercises the expressions operators get.
//!
//! One server per [`Prometheus`]: its own temporary data directory and a port the kernel
//! picked (`--web.listen-address=127.0.0.1:0`, read back from its log), both gone when it
//! is dropped (the process group is killed by its [`ChildGuard`]).

use crate::proc::ChildGuard;
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A scrape target.
#[derive(Debug, Clone)]
pub struct Target {
    /// Prometheus `job` label.
    pub job: String,
    /// `host:port`.
    pub addr: SocketAddr,
    /// Metrics path.
    pub path: String,
}

impl Target {
    /// A target.
    pub fn new(job: &str, addr: SocketAddr, path: &str) -> Target {
        Target {
            job: job.into(),
            addr,
            path: path.into(),
        }
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct PromOptions {
    /// Scrape targets.
    pub targets: Vec<Target>,
    /// Scrape and rule-evaluation interval.
    pub interval: Duration,
    /// Rule files' time windows are divided by this (1 = as shipped).
    pub scale: u32,
    /// Rule files to load (scaled), normally [`shipped_rule_files`].
    pub rule_files: Vec<PathBuf>,
}

/// The shipped recording rules and alerts.
pub fn shipped_rule_files() -> Result<Vec<PathBuf>> {
    let dir = crate::paths::repo_root()?.join("envoy-config/prometheus");
    Ok(vec![
        dir.join("kvguard.rules.yaml"),
        dir.join("kvguard.alerts.yaml"),
    ])
}

/// The shipped `for:` of alert `name` (in [`shipped_rule_files`]), in seconds, unscaled:
/// what tests derive their workload and windows from.
pub fn shipped_alert_for(name: &str) -> Result<u64> {
    for f in shipped_rule_files()? {
        let text = std::fs::read_to_string(&f).with_context(|| f.display().to_string())?;
        let mut lines = text.lines().map(str::trim);
        while let Some(l) = lines.next() {
            if l.strip_prefix("- alert:").map(str::trim) != Some(name) {
                continue;
            }
            for l in lines.by_ref() {
                if let Some(d) = l.strip_prefix("for:") {
                    return parse_duration(d.trim());
                }
                if l.starts_with("- ") {
                    break;
                }
            }
            bail!("alert {name} in {} has no `for:`", f.display());
        }
    }
    bail!("no alert {name} in the shipped rule files")
}

/// The Prometheus binary: `$PROMETHEUS_BIN`, else `prometheus` on `PATH`
/// (`scripts/setup` installs Debian's package).
pub fn prometheus_bin() -> PathBuf {
    std::env::var_os("PROMETHEUS_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("prometheus"))
}

/// A running Prometheus.
pub struct Prometheus {
    guard: ChildGuard,
    _data: tempfile::TempDir,
    addr: SocketAddr,
}

/// One alert as `/api/v1/alerts` reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct Alert {
    /// `alertname`.
    pub name: String,
    /// `pending` or `firing`.
    pub state: String,
    /// Its labels (JSON object).
    pub labels: Value,
}

impl Prometheus {
    /// Starts Prometheus with `opts`; waits until it is ready.
    pub async fn start(opts: &PromOptions) -> Result<Prometheus> {
        let data = tempfile::Builder::new()
            .prefix("kvguard-prometheus-")
            .tempdir()?;
        let mut rule_paths = Vec::new();
        for (i, f) in opts.rule_files.iter().enumerate() {
            let text = std::fs::read_to_string(f)
                .with_context(|| format!("reading rule file {}", f.display()))?;
            let p = data.path().join(format!("rules-{i}.yaml"));
            std::fs::write(&p, scale_durations(&text, opts.scale)?)?;
            rule_paths.push(p.display().to_string());
        }
        let secs = format!("{}ms", opts.interval.as_millis().max(1));
        let scrape: Vec<Value> = opts
            .targets
            .iter()
            .map(|t| {
                json!({
                    "job_name": t.job,
                    "metrics_path": t.path,
                    "static_configs": [{"targets": [t.addr.to_string()]}],
                })
            })
            .collect();
        // JSON is YAML.
        let cfg = json!({
            "global": {"scrape_interval": secs, "evaluation_interval": secs, "scrape_timeout": secs},
            "rule_files": rule_paths,
            "scrape_configs": scrape,
        });
        let cfg_path = data.path().join("prometheus.yml");
        std::fs::write(&cfg_path, serde_json::to_vec_pretty(&cfg)?)?;
        let mut cmd = std::process::Command::new(prometheus_bin());
        cmd.arg(format!("--config.file={}", cfg_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                data.path().join("tsdb").display()
            ))
            .arg("--web.listen-address=127.0.0.1:0")
            .arg("--log.level=info");
        let mut guard = ChildGuard::spawn("prometheus", cmd).with_context(|| {
            format!(
                "starting {} (scripts/setup installs it: apt-get install prometheus)",
                prometheus_bin().display()
            )
        })?;
        let log = guard
            .wait_for_log(
                "msg=\"Server is ready to receive web requests.\"",
                Duration::from_secs(60),
            )
            .await?;
        let addr = listen_addr(&log)
            .with_context(|| format!("no \"Listening on\" address in Prometheus's log:\n{log}"))?;
        Ok(Prometheus {
            guard,
            _data: data,
            addr,
        })
    }

    /// Its HTTP address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        self.guard.log()
    }

    /// The data directory (removed on drop).
    pub fn data_dir(&self) -> &Path {
        self._data.path()
    }

    async fn api(&self, path: &str) -> Result<Value> {
        let v = crate::client::get_json(self.addr, path).await?;
        if v["status"] != "success" {
            bail!("Prometheus {path}: {v}");
        }
        Ok(v["data"].clone())
    }

    /// An instant query: the `data` object (`resultType`, `result`). Errors on a query
    /// Prometheus refuses.
    pub async fn query(&self, expr: &str) -> Result<Value> {
        self.api(&format!("/api/v1/query?query={}", urlencode(expr)))
            .await
            .with_context(|| format!("query {expr:?}"))
    }

    /// A range query over the last `range` with `step`.
    pub async fn query_range(&self, expr: &str, range: Duration, step: Duration) -> Result<Value> {
        let end = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs_f64();
        let start = end - range.as_secs_f64();
        self.api(&format!(
            "/api/v1/query_range?query={}&start={start:.3}&end={end:.3}&step={:.3}",
            urlencode(expr),
            step.as_secs_f64()
        ))
        .await
        .with_context(|| format!("range query {expr:?}"))
    }

    /// Alerts pending or firing now.
    pub async fn alerts(&self) -> Result<Vec<Alert>> {
        let d = self.api("/api/v1/alerts").await?;
        Ok(d["alerts"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default()
            .iter()
            .map(|a| Alert {
                name: a["labels"]["alertname"].as_str().unwrap_or("").to_string(),
                state: a["state"].as_str().unwrap_or("").to_string(),
                labels: a["labels"].clone(),
            })
            .collect())
    }

    /// Every rule group as loaded (`/api/v1/rules`), with each rule's `health` and
    /// `lastError`.
    pub async fn rules(&self) -> Result<Value> {
        self.api("/api/v1/rules").await
    }

    /// Scrape targets with their `health` and `lastError`.
    pub async fn targets(&self) -> Result<Value> {
        self.api("/api/v1/targets").await
    }

    /// Waits until every target has been scraped successfully at least once.
    pub async fn wait_targets_up(&self, timeout: Duration) -> Result<()> {
        let r = self.wait_up(timeout).await;
        match r {
            Ok(()) => Ok(()),
            Err(e) => Err(e.context(format!(
                "targets: {}",
                self.targets().await.unwrap_or_default()
            ))),
        }
    }

    async fn wait_up(&self, timeout: Duration) -> Result<()> {
        crate::wait::poll_until_async(
            "every Prometheus target up",
            timeout,
            Duration::from_millis(200),
            || async {
                let t = self.targets().await.ok()?;
                let active = t["activeTargets"].as_array()?.clone();
                (!active.is_empty() && active.iter().all(|x| x["health"] == "up")).then_some(())
            },
        )
        .await
    }
}

/// Percent-encodes a query parameter value.
pub fn urlencode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// The address after `msg="Listening on" address=` in Prometheus's log.
fn listen_addr(log: &str) -> Option<SocketAddr> {
    log.lines()
        .filter(|l| l.contains("msg=\"Listening on\""))
        .find_map(|l| {
            l.split("address=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
}

/// Prometheus rule text with every time window divided by `factor`: range selectors
/// (`[6h]`), `offset 6h`, `for: 15m` and group `interval: 1m`. Durations become whole
/// seconds (at least 1 s). Nothing else changes: thresholds, labels and expressions stay
/// as shipped.
pub fn scale_durations(text: &str, factor: u32) -> Result<String> {
    if factor == 0 {
        bail!("scale factor 0");
    }
    let scale = |d: &str| -> Result<String> {
        let secs = parse_duration(d).with_context(|| format!("duration {d:?}"))?;
        Ok(format!("{}s", (secs / u64::from(factor)).max(1)))
    };
    let mut out = String::with_capacity(text.len());
    for line in text.split_inclusive('\n') {
        let trimmed = line.trim_start();
        // `for:` and `interval:` keys.
        let key = ["for:", "interval:"]
            .into_iter()
            .find(|k| trimmed.starts_with(k));
        if let Some(k) = key {
            let indent = &line[..line.len() - trimmed.len()];
            let v = trimmed[k.len()..].trim();
            out.push_str(&format!("{indent}{k} {}\n", scale(v)?));
            continue;
        }
        if trimmed.starts_with('#') {
            out.push_str(line);
            continue;
        }
        out.push_str(&scale_in_expr(line, &scale)?);
    }
    Ok(out)
}

/// Scales `[d]`, `[d:r]` and `offset d` inside an expression line.
fn scale_in_expr(line: &str, scale: &dyn Fn(&str) -> Result<String>) -> Result<String> {
    let mut out = String::new();
    let mut rest = line;
    loop {
        let br = rest.find('[');
        let off = rest.find("offset ");
        match (br, off) {
            (None, None) => {
                out.push_str(rest);
                return Ok(out);
            }
            (Some(b), o) if o.is_none_or(|o| b < o) => {
                let close = rest[b..].find(']').map(|c| b + c).context("unclosed [")?;
                out.push_str(&rest[..=b]);
                let inner = &rest[b + 1..close];
                let parts: Vec<String> = inner
                    .split(':')
                    .map(|p| {
                        if p.is_empty() {
                            Ok(String::new())
                        } else {
                            scale(p.trim())
                        }
                    })
                    .collect::<Result<_>>()?;
                out.push_str(&parts.join(":"));
                out.push(']');
                rest = &rest[close + 1..];
            }
            (_, Some(o)) => {
                let start = o + "offset ".len();
                out.push_str(&rest[..start]);
                let end = rest[start..]
                    .find(|c: char| !c.is_ascii_alphanumeric())
                    .map_or(rest.len(), |e| start + e);
                out.push_str(&scale(&rest[start..end])?);
                rest = &rest[end..];
            }
            (Some(_), None) => unreachable!(),
        }
    }
}

/// A Prometheus duration (`1h30m`, `90s`, `2d`) in seconds.
pub fn parse_duration(d: &str) -> Result<u64> {
    let mut total = 0u64;
    let mut num = String::new();
    let mut chars = d.chars().peekable();
    let mut any = false;
    while let Some(c) = chars.next() {
        if c.is_ascii_digit() {
            num.push(c);
            continue;
        }
        let n: u64 = num.parse().context("no number before a unit")?;
        num.clear();
        let unit = if c == 'm' && chars.peek() == Some(&'s') {
            chars.next();
            bail!("millisecond durations are not scaled");
        } else {
            c
        };
        total += n * match unit {
            's' => 1,
            'm' => 60,
            'h' => 3600,
            'd' => 86400,
            'w' => 7 * 86400,
            'y' => 365 * 86400,
            _ => bail!("unit {unit:?}"),
        };
        any = true;
    }
    if !num.is_empty() || !any {
        bail!("not a duration");
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scales_windows_offsets_and_for() {
        let t = "    interval: 1m\n      - alert: X\n        expr: rate(a[5m]) > 0 and b offset 6h\n        for: 15m\n        # rate(c[1h])\n        expr: max_over_time(x[10m:1m])\n";
        let s = scale_durations(t, 60).unwrap();
        assert_eq!(
            s,
            "    interval: 1s\n      - alert: X\n        expr: rate(a[5s]) > 0 and b offset 360s\n        for: 15s\n        # rate(c[1h])\n        expr: max_over_time(x[10s:1s])\n"
        );
        assert_eq!(parse_duration("1h30m").unwrap(), 5400);
        assert!(parse_duration("5").is_err());
    }

    #[test]
    fn names_in_promql() {
        assert_eq!(
            promql_names("sum by (reason) (rate(kvguard_control_aborts_total{outcome=\"aborted\"}[5m])) / on (job) kvguard:requests:rate10m > 0.05"),
            vec!["kvguard_control_aborts_total", "kvguard:requests:rate10m"]
        );
        assert_eq!(
            promql_names("(up == 0) and on (job, instance) group by (job) (vllm:generation_tokens_total) offset 6h"),
            vec!["up", "vllm:generation_tokens_total"]
        );
    }

    #[test]
    fn listen_address_from_log() {
        let log = "ts=x level=info component=web msg=\"Start listening for connections\" address=127.0.0.1:0\nts=y caller=tls_config.go:232 level=info component=web msg=\"Listening on\" address=127.0.0.1:42119\n";
        assert_eq!(listen_addr(log), Some("127.0.0.1:42119".parse().unwrap()));
    }
}

/// One query of a dashboard panel.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PanelQuery {
    /// The panel's title.
    pub panel: String,
    /// The query, variables substituted.
    pub expr: String,
}

/// Every panel query of a Grafana dashboard (rows' nested panels included), with `$var`
/// and `${var}` replaced by `vars`.
pub fn dashboard_queries(dash: &Value, vars: &[(&str, &str)]) -> Vec<PanelQuery> {
    fn walk(panels: &Value, vars: &[(&str, &str)], out: &mut Vec<PanelQuery>) {
        for p in panels.as_array().map(Vec::as_slice).unwrap_or_default() {
            let title = p["title"].as_str().unwrap_or("").to_string();
            for t in p["targets"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default()
            {
                if let Some(e) = t["expr"].as_str() {
                    let mut expr = e.to_string();
                    for (k, v) in vars {
                        expr = expr
                            .replace(&format!("${{{k}}}"), v)
                            .replace(&format!("${k}"), v);
                    }
                    out.push(PanelQuery {
                        panel: title.clone(),
                        expr,
                    });
                }
            }
            walk(&p["panels"], vars, out);
        }
    }
    let mut out = Vec::new();
    walk(&dash["panels"], vars, &mut out);
    out
}

/// The metric and recording-rule names a PromQL expression reads (functions,
/// aggregations, keywords, label matchers, ranges and strings left out).
pub fn promql_names(expr: &str) -> Vec<String> {
    const WORDS: [&str; 18] = [
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "offset",
        "bool",
        "and",
        "or",
        "unless",
        "atan2",
        "inf",
        "nan",
        "Inf",
        "NaN",
        "start",
        "end",
    ];
    // Aggregations may be followed by `by (...)` before their parenthesis.
    const AGGREGATIONS: [&str; 12] = [
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
    ];
    // Blank out strings, label matchers and ranges.
    let mut s = String::with_capacity(expr.len());
    let mut depth_brace = 0;
    let mut depth_bracket = 0;
    let mut quote: Option<char> = None;
    for c in expr.chars() {
        match (quote, c) {
            (Some(q), _) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '"' | '\'' | '`') => quote = Some(c),
            (None, '{') => depth_brace += 1,
            (None, '}') => depth_brace -= 1,
            (None, '[') => depth_bracket += 1,
            (None, ']') => depth_bracket -= 1,
            (None, _) if depth_brace == 0 && depth_bracket == 0 => {
                s.push(c);
                continue;
            }
            _ => {}
        }
        s.push(' ');
    }
    let chars: Vec<char> = s.chars().collect();
    let mut names = Vec::new();
    let mut i = 0;
    let mut skip_list = false;
    while i < chars.len() {
        let c = chars[i];
        let prev = if i > 0 { chars[i - 1] } else { ' ' };
        if (c.is_ascii_alphabetic() || c == '_' || c == ':')
            && !(prev.is_ascii_alphanumeric() || prev == '_' || prev == '.' || prev == ':')
        {
            let start = i;
            while i < chars.len()
                && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
            {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let mut j = i;
            while j < chars.len() && chars[j] == ' ' {
                j += 1;
            }
            let call = j < chars.len() && chars[j] == '(';
            if [
                "by",
                "without",
                "on",
                "ignoring",
                "group_left",
                "group_right",
            ]
            .contains(&word.as_str())
            {
                skip_list = call;
            } else if skip_list {
                // label names inside by (...) and friends
            } else if !call
                && !WORDS.contains(&word.as_str())
                && !AGGREGATIONS.contains(&word.as_str())
            {
                names.push(word);
            }
            continue;
        }
        if c == ')' {
            skip_list = false;
        }
        i += 1;
    }
    names
}

impl Prometheus {
    /// Samples in an instant query's result (vector or matrix series; 1 for a scalar).
    pub async fn result_len(&self, expr: &str) -> Result<usize> {
        let d = self.query(expr).await?;
        Ok(match d["resultType"].as_str() {
            Some("scalar") | Some("string") => 1,
            _ => d["result"].as_array().map_or(0, Vec::len),
        })
    }

    /// Every metric name Prometheus has ingested.
    pub async fn metric_names(&self) -> Result<std::collections::BTreeSet<String>> {
        let d = self.api("/api/v1/label/__name__/values").await?;
        Ok(d.as_array()
            .map(Vec::as_slice)
            .unwrap_or_default()
            .iter()
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect())
    }
}
