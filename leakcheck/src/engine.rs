//! Where requests go ([`Endpoint`]: `http://host:port[/path]`) and what the engine's
//! metrics say ([`Scrape`]): running and waiting requests, KV usage, requests finished and
//! aborted, the serving process's resident memory. Names are vLLM's (checked against the
//! recorded vLLM 0.32 fixture) and SGLang's where it has one; the parser is
//! kvguard-control's (`expo`), tolerant of comments, timestamps and unknown metrics.

use anyhow::{anyhow, bail, Context, Result};
use kvguard_control::expo::{self, EngineFigures, EngineFlavour};
use kvguard_loadgen::client;
use std::net::SocketAddr;
use std::time::Duration;

/// A parsed `http://host:port[/path]`, resolved.
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// The URL as given.
    pub url: String,
    /// Resolved address.
    pub addr: SocketAddr,
    /// `host[:port]` as given (the `Host` header).
    pub authority: String,
    /// The path (no trailing `/`; empty for none).
    pub path: String,
}

/// Splits an `http://` URL; `https` and other schemes are refused with the fix.
pub fn split_url(url: &str) -> Result<(String, u16, String, String), String> {
    let rest = match url.split_once("://") {
        Some(("http", rest)) => rest,
        Some(("https", _)) => {
            return Err(format!(
                "{url}: https is not supported; reach the gateway over plain http from inside \
                 its network (or through a port-forward, e.g. kubectl port-forward)"
            ))
        }
        _ => return Err(format!("{url}: expected http://host:port[/path]")),
    };
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
        None => (rest, ""),
    };
    if authority.is_empty() {
        return Err(format!("{url}: no host"));
    }
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => match p.parse::<u16>() {
            Ok(p) => (h.trim_matches(|c| c == '[' || c == ']'), p),
            Err(_) => return Err(format!("{url}: bad port {p:?}")),
        },
        _ => (authority, 80),
    };
    Ok((
        host.to_string(),
        port,
        authority.to_string(),
        path.to_string(),
    ))
}

impl Endpoint {
    /// Parses and resolves (bounded: 5 s).
    pub async fn resolve(url: &str) -> Result<Endpoint, EndpointError> {
        let (host, port, authority, path) = split_url(url).map_err(EndpointError::Bad)?;
        let lookup = tokio::time::timeout(
            Duration::from_secs(5),
            tokio::net::lookup_host((host.as_str(), port)),
        )
        .await
        .map_err(|_| EndpointError::Unreachable(format!("{url}: resolving {host} timed out")))?
        .map_err(|e| EndpointError::Unreachable(format!("{url}: cannot resolve {host}: {e}")))?;
        let mut addrs: Vec<SocketAddr> = lookup.collect();
        addrs.sort_by_key(|a| !a.is_ipv4());
        let addr = addrs
            .first()
            .copied()
            .ok_or_else(|| EndpointError::Unreachable(format!("{url}: {host} has no address")))?;
        Ok(Endpoint {
            url: url.to_string(),
            addr,
            authority,
            path,
        })
    }
}

/// Why an endpoint is unusable.
#[derive(Debug)]
pub enum EndpointError {
    /// The URL itself is wrong.
    Bad(String),
    /// It does not resolve.
    Unreachable(String),
}

/// One reading of the engine's metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Scrape {
    /// Requests running (`vllm:num_requests_running`, `sglang:num_running_reqs`).
    pub running: f64,
    /// Requests waiting (`vllm:num_requests_waiting`, `sglang:num_queue_reqs`).
    pub waiting: f64,
    /// KV usage 0..1 (`vllm:kv_cache_usage_perc`, older `vllm:gpu_cache_usage_perc`,
    /// `sglang:token_usage`).
    pub kv: Option<f64>,
    /// Requests the engine finished, any reason (`vllm:request_success_total`).
    pub finished: Option<f64>,
    /// Of those, aborted (`finished_reason="abort"`).
    pub aborted: Option<f64>,
    /// `process_resident_memory_bytes` of the process serving the metrics.
    pub rss_bytes: Option<f64>,
    /// KV blocks in the pool (`vllm:cache_config_info`'s `num_gpu_blocks` label): turns KV
    /// usage into blocks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_blocks: Option<f64>,
}

impl Scrape {
    /// Requests at the engine (running + waiting).
    pub fn in_engine(&self) -> f64 {
        self.running + self.waiting
    }
}

/// Parses an exposition text; errors name the missing metrics.
pub fn parse(text: &str) -> Result<(Scrape, EngineFlavour), String> {
    let f = EngineFigures::from_text(text);
    let flavour = EngineFigures::flavour(text);
    let (Some(running), Some(waiting)) = (f.running, f.waiting) else {
        return Err(format!(
            "no running/waiting gauges (vllm:num_requests_running and vllm:num_requests_waiting, \
             or sglang:num_running_reqs and sglang:num_queue_reqs) — engine names seen: {}",
            match flavour {
                EngineFlavour::Vllm => "vllm:",
                EngineFlavour::Sglang => "sglang:",
                EngineFlavour::Unknown => "none",
            }
        ));
    };
    let mut s = Scrape {
        running,
        waiting,
        kv: f.kv_usage,
        ..Scrape::default()
    };
    for x in expo::samples(text) {
        if !x.value.is_finite() {
            continue;
        }
        match x.name {
            "vllm:request_success_total" => {
                *s.finished.get_or_insert(0.0) += x.value;
                if x.labels.contains("finished_reason=\"abort\"") {
                    *s.aborted.get_or_insert(0.0) += x.value;
                } else {
                    s.aborted.get_or_insert(0.0);
                }
            }
            "process_resident_memory_bytes" => {
                *s.rss_bytes.get_or_insert(0.0) += x.value;
            }
            "vllm:cache_config_info" => {
                s.num_blocks = label(x.labels, "num_gpu_blocks")
                    .and_then(|v| v.parse::<f64>().ok())
                    .filter(|v| v.is_finite() && *v > 0.0);
            }
            _ => {}
        }
    }
    Ok((s, flavour))
}

/// The value of label `name` in an `a="x",b="y"` label set (no escapes inside: the
/// labels read here are numbers).
fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    let pat = format!("{name}=\"");
    let mut from = 0;
    while let Some(i) = labels[from..].find(&pat) {
        let at = from + i;
        // A whole label name: at the start, or after `{` or `,`.
        if at == 0 || matches!(labels.as_bytes()[at - 1], b',' | b' ') {
            let rest = &labels[at + pat.len()..];
            return rest.split_once('"').map(|(v, _)| v);
        }
        from = at + pat.len();
    }
    None
}

/// Reads the engine's metrics once (bounded by `timeout`).
pub async fn scrape(ep: &Endpoint, timeout: Duration) -> Result<(Scrape, EngineFlavour)> {
    let path = if ep.path.is_empty() {
        "/metrics"
    } else {
        ep.path.as_str()
    };
    let r = client::request(
        ep.addr,
        hyper::Method::GET,
        path,
        &[("host", ep.authority.as_str())],
        bytes::Bytes::new(),
        false,
        timeout,
    )
    .await
    .with_context(|| format!("reading {}", ep.url))?;
    if r.status != 200 {
        bail!("{} answered {}: {}", ep.url, r.status, snippet(&r.text()));
    }
    parse(&r.text()).map_err(|e| anyhow!("{}: {e}", ep.url))
}

/// The first 200 characters of a body, on one line.
pub fn snippet(s: &str) -> String {
    let one: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
    match one.char_indices().nth(200) {
        Some((i, _)) => format!("{}…", &one[..i]),
        None => one,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recorded_vllm_fixture() {
        let p = format!(
            "{}/../integration/fixtures/vllm-0.32-metrics.txt",
            env!("CARGO_MANIFEST_DIR")
        );
        let text = std::fs::read_to_string(&p).unwrap();
        let (s, flavour) = parse(&text).unwrap();
        assert_eq!(flavour, EngineFlavour::Vllm);
        assert_eq!(s.running, 0.0);
        assert_eq!(s.waiting, 0.0);
        assert_eq!(s.kv, Some(0.0));
        assert_eq!(s.finished, Some(2.0));
        assert_eq!(s.aborted, Some(0.0));
        assert_eq!(s.rss_bytes, Some(9.52127488e8));
        assert_eq!(s.num_blocks, Some(32768.0));
    }

    #[test]
    fn labels_by_whole_name() {
        let l = r#"cpu_num_gpu_blocks="1",num_gpu_blocks="64",x="y""#;
        assert_eq!(label(l, "num_gpu_blocks"), Some("64"));
        assert_eq!(label(l, "x"), Some("y"));
        assert_eq!(label(l, "z"), None);
        assert_eq!(label(r#"a_num_gpu_blocks="1""#, "num_gpu_blocks"), None);
    }

    #[test]
    fn sglang_names() {
        let t = "sglang:num_running_reqs{model_name=\"m\"} 3\nsglang:num_queue_reqs{model_name=\"m\"} 1\n\
                 sglang:token_usage{model_name=\"m\"} 0.5\n";
        let (s, flavour) = parse(t).unwrap();
        assert_eq!(flavour, EngineFlavour::Sglang);
        assert_eq!((s.running, s.waiting, s.kv), (3.0, 1.0, Some(0.5)));
        assert_eq!(s.finished, None);
    }

    #[test]
    fn a_gateway_page_is_refused_naming_the_metrics() {
        let e = parse("envoy_cluster_upstream_rq_total 5\n").unwrap_err();
        assert!(e.contains("vllm:num_requests_running"), "{e}");
    }

    #[test]
    fn urls() {
        assert_eq!(
            split_url("http://gw.local:8080/openai/"),
            Ok((
                "gw.local".into(),
                8080,
                "gw.local:8080".into(),
                "/openai".into()
            ))
        );
        assert_eq!(
            split_url("http://10.0.0.1"),
            Ok(("10.0.0.1".into(), 80, "10.0.0.1".into(), "".into()))
        );
        assert!(split_url("https://x").unwrap_err().contains("https"));
        assert!(split_url("x:80").is_err());
        assert!(split_url("http://h:99999").is_err());
    }
}
