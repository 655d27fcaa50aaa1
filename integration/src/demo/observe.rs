//! The demo under a real Prometheus ([`crate::prom`]): it scrapes the run's Envoy,
//! kvguard-control and engine every [`SCRAPE`], evaluates the shipped rules and alerts
//! with their windows divided by [`SCALE`], and the run records when each alert went
//! pending and firing, what every dashboard panel's queries returned while the load ran,
//! and which metric names the scrapes held.

use super::stack::Stack;
use crate::prom::{self, PanelQuery, PromOptions, Prometheus, Target};
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Duration;

/// Scrape and evaluation interval.
pub const SCRAPE: Duration = Duration::from_secs(1);

/// The shipped rules' windows and `for:` are divided by this: 15 min → 15 s, 5 min → 5 s.
pub const SCALE: u32 = 60;

/// The `stats_config` block of the shipped `envoy-config/envoy/local.yaml` (its
/// `stats_tags` turn the filter's tag-encoded stat names into Prometheus labels), for
/// the demo's Envoy.
pub fn shipped_stats_config() -> Result<String> {
    let path = crate::paths::repo_root()?.join("envoy-config/envoy/local.yaml");
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    let mut out = String::new();
    let mut inside = false;
    for line in text.lines() {
        if line.starts_with("stats_config:") {
            inside = true;
        } else if inside && !line.is_empty() && !line.starts_with(' ') && !line.starts_with('#') {
            break;
        }
        if inside {
            out.push_str(line);
            out.push('\n');
        }
    }
    if !out.contains("tag_name") {
        anyhow::bail!("no stats_config with stats_tags in {}", path.display());
    }
    Ok(out)
}

/// When an alert first reached a state during a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AlertMark {
    /// `alertname`.
    pub name: String,
    /// `pending` or `firing`.
    pub state: String,
    /// Seconds since the run's first arrival.
    pub t: f64,
}

/// What one dashboard query returned.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PanelResult {
    /// The panel and its query (variables substituted).
    pub query: PanelQuery,
    /// Series (or 1 for a scalar) in the answer.
    pub samples: usize,
    /// Prometheus's error, if it refused the query.
    pub error: Option<String>,
}

/// What Prometheus saw of one run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Observed {
    /// First pending and first firing time of each alert.
    pub alerts: Vec<AlertMark>,
    /// Every dashboard query, run once at the end of the arrival phase.
    pub panels: Vec<PanelResult>,
    /// Every metric name Prometheus had ingested at that point.
    pub scraped_names: BTreeSet<String>,
    /// The `instance` the dashboard's variable resolved to (kvguard-control's).
    pub instance: String,
    /// [`FIGURES`] at the end of the run (query → value; absent when empty).
    pub figures: BTreeMap<String, f64>,
    /// Alerting rules Prometheus had evaluated at the end (`health` = `ok`).
    pub rules_evaluated: usize,
    /// Rules whose last evaluation failed (`name: lastError`).
    pub rule_errors: Vec<String>,
    /// Every rule's `health` at the end (`ok`, `err`, `unknown` = never evaluated), by
    /// alert or recorded name.
    #[serde(default)]
    pub rule_health: BTreeMap<String, String>,
    /// Every dashboard query over the whole run, as Prometheus answered it (a range query
    /// at the end): what the dashboard would draw (`scripts/plot_demo.py` renders it).
    #[serde(default)]
    pub dashboard: Vec<PanelSeries>,
}

/// One dashboard query's answer over the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PanelSeries {
    /// The panel and its query (variables substituted).
    pub query: PanelQuery,
    /// Each series: its labels (`name=value` joined by commas) and `[t, value]` points,
    /// `t` in seconds since Prometheus started.
    pub series: Vec<(String, Vec<(f64, f64)>)>,
}

/// Figures read at the end of each run.
pub const FIGURES: [&str; 10] = [
    "sum(kvguard_control_orphan_seconds_total)",
    "sum(kvguard_control_wasted_tokens_total)",
    "sum(kvguard_control_orphan_ends_total)",
    "max_over_time(kvguard:engine_requests_without_client[1h])",
    "kvguard_control_nvml_available",
    "max(kvguard_control_engine_lora_adapters)",
    "max(kvguard_control_engine_processes)",
    "max(kvguard_control_engine_process_open_fds)",
    "max(instance:vllm_generation_tokens:rate1h)",
    "max(instance:vllm_uptime_seconds)",
];

/// A Prometheus watching one run.
pub struct Observer {
    prom: Prometheus,
    /// When its Prometheus was up (the start of the dashboard's time range).
    started: std::time::Instant,
    /// What it has seen so far.
    pub seen: Observed,
}

impl Observer {
    /// Starts Prometheus on `st`'s Envoy, kvguard-control and `engine`; waits for a first
    /// good scrape of each.
    pub async fn start(st: &Stack, engine: SocketAddr) -> Result<Observer> {
        let opts = PromOptions {
            targets: vec![
                Target::new("envoy", st.envoy.admin_addr(), "/stats/prometheus"),
                Target::new("kvguard-control", st.control.admin, "/metrics"),
                Target::new("engine", engine, "/metrics"),
            ],
            interval: SCRAPE,
            scale: SCALE,
            rule_files: prom::shipped_rule_files()?,
        };
        let prom = Prometheus::start(&opts).await?;
        prom.wait_targets_up(Duration::from_secs(30)).await?;
        Ok(Observer {
            prom,
            started: std::time::Instant::now(),
            seen: Observed {
                instance: st.control.admin.to_string(),
                ..Observed::default()
            },
        })
    }

    /// The server.
    pub fn prometheus(&self) -> &Prometheus {
        &self.prom
    }

    /// Polls `/api/v1/alerts` (every 250 ms, marks kept as [`Observer::poll`] does, `t` in
    /// seconds since `since`) until `name` fires with every label of `labels`, at most
    /// `timeout`. The firing alert's labels.
    pub async fn wait_firing(
        &mut self,
        name: &str,
        labels: &[(&str, &str)],
        since: std::time::Instant,
        timeout: Duration,
    ) -> Result<serde_json::Value> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            self.poll(since.elapsed().as_secs_f64()).await?;
            let found = self.prom.alerts().await?.into_iter().find(|a| {
                a.name == name
                    && a.state == "firing"
                    && labels.iter().all(|(k, v)| a.labels[*k] == *v)
            });
            if let Some(a) = found {
                return Ok(a.labels);
            }
            if std::time::Instant::now() >= deadline {
                anyhow::bail!(
                    "{name} {labels:?} did not fire within {timeout:?}; alerts so far:\n{}",
                    timeline(&self.seen.alerts)
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Reads `/api/v1/alerts` and marks each alert's first pending and firing time `t`.
    pub async fn poll(&mut self, t: f64) -> Result<()> {
        for a in self.prom.alerts().await? {
            let known = self
                .seen
                .alerts
                .iter()
                .any(|m| m.name == a.name && m.state == a.state);
            if !known {
                self.seen.alerts.push(AlertMark {
                    name: a.name,
                    state: a.state,
                    t,
                });
            }
        }
        Ok(())
    }

    /// Runs every query of the shipped dashboard (its `$instance` set to kvguard-control's)
    /// and records the metric names ingested so far.
    pub async fn probe_dashboard(&mut self) -> Result<()> {
        let path = crate::paths::repo_root()?.join("envoy-config/grafana/kvguard-dashboard.json");
        let dash: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(&path).with_context(|| path.display().to_string())?,
        )?;
        let instance = self.seen.instance.clone();
        let mut out = Vec::new();
        for q in prom::dashboard_queries(&dash, &[("instance", &instance)]) {
            let (samples, error) = match self.prom.result_len(&q.expr).await {
                Ok(n) => (n, None),
                Err(e) => (0, Some(format!("{e:#}"))),
            };
            out.push(PanelResult {
                query: q,
                samples,
                error,
            });
        }
        self.seen.panels = out;
        self.seen.scraped_names = self.prom.metric_names().await?;
        Ok(())
    }
}

impl Observer {
    /// Reads [`FIGURES`], the rules' health and every dashboard query over the run (at
    /// the end of a run).
    pub async fn finish(&mut self) -> Result<()> {
        self.dashboard_over_run().await?;
        for q in FIGURES {
            let d = self.prom.query(q).await?;
            let v = d["result"][0]["value"][1]
                .as_str()
                .and_then(|x| x.parse::<f64>().ok());
            if let Some(v) = v {
                self.seen.figures.insert(q.to_string(), v);
            }
        }
        let rules = self.prom.rules().await?;
        for g in rules["groups"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default()
        {
            for r in g["rules"].as_array().map(Vec::as_slice).unwrap_or_default() {
                self.seen.rule_health.insert(
                    r["name"].as_str().unwrap_or("").to_string(),
                    r["health"].as_str().unwrap_or("").to_string(),
                );
                if r["health"] == "ok" && r["type"] == "alerting" {
                    self.seen.rules_evaluated += 1;
                }
                if r["health"] == "err" {
                    self.seen.rule_errors.push(format!(
                        "{}: {}",
                        r["name"].as_str().unwrap_or(""),
                        r["lastError"].as_str().unwrap_or("")
                    ));
                }
            }
        }
        Ok(())
    }
}

impl Observer {
    /// Range queries of every dashboard query from Prometheus's start to now, one point
    /// per scrape interval.
    async fn dashboard_over_run(&mut self) -> Result<()> {
        let path = crate::paths::repo_root()?.join("envoy-config/grafana/kvguard-dashboard.json");
        let dash: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(&path).with_context(|| path.display().to_string())?,
        )?;
        let range = self.started.elapsed();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs_f64();
        let t_start = now - range.as_secs_f64();
        let instance = self.seen.instance.clone();
        let mut out = Vec::new();
        for q in prom::dashboard_queries(&dash, &[("instance", &instance)]) {
            // A refused query draws nothing (`panels` holds its error).
            let Ok(d) = self.prom.query_range(&q.expr, range, SCRAPE).await else {
                out.push(PanelSeries {
                    query: q,
                    series: Vec::new(),
                });
                continue;
            };
            let series = d["result"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default()
                .iter()
                .map(|r| {
                    let labels = r["metric"]
                        .as_object()
                        .map(|m| {
                            m.iter()
                                .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or("")))
                                .collect::<Vec<_>>()
                                .join(",")
                        })
                        .unwrap_or_default();
                    let points = r["values"]
                        .as_array()
                        .map(Vec::as_slice)
                        .unwrap_or_default()
                        .iter()
                        .filter_map(|p| {
                            let t = p[0].as_f64()?;
                            let v = p[1].as_str()?.parse::<f64>().ok()?;
                            v.is_finite().then_some((t - t_start, v))
                        })
                        .collect();
                    (labels, points)
                })
                .collect();
            out.push(PanelSeries { query: q, series });
        }
        self.seen.dashboard = out;
        Ok(())
    }
}

/// The alert timeline of a run, one line per mark, in time order.
pub fn timeline(marks: &[AlertMark]) -> String {
    let mut m = marks.to_vec();
    m.sort_by(|a, b| a.t.total_cmp(&b.t));
    m.iter()
        .map(|a| format!("{:>6.1}s  {:<8} {}\n", a.t, a.state, a.name))
        .collect()
}
