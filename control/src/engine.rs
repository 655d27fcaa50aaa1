//! The engine, behind a trait: its metrics scrape, its health, and its own abort API
//! (per `--abort-strategy`). Closing the engine-side connection is the proxy's part.

use crate::config::{AbortStrategy, Config};
use bytes::Bytes;
use http::{Method, Request, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvguard_contract::RequestId;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

/// A boxed future.
pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Largest metrics text read from the engine.
pub const MAX_SCRAPE_BYTES: usize = 16 * 1024 * 1024;

/// Deadline of every call to the engine (scrape, health, abort).
pub const ENGINE_CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// What kvguard-control needs from the engine besides proxying.
pub trait Engine: Send + Sync + 'static {
    /// The metrics exposition text.
    fn scrape(&self) -> BoxFut<'_, Result<String, String>>;
    /// Whether its health endpoint answers 2xx.
    fn health(&self) -> BoxFut<'_, Result<(), String>>;
    /// Calls the engine's own abort for `id` (nothing for the `connection` strategy).
    fn abort(&self, id: RequestId) -> BoxFut<'_, Result<(), String>>;
    /// The body of the engine's `GET /v1/models` (the loaded LoRA adapters). Engines
    /// without one answer an error, and the adapter count stays absent.
    fn models(&self) -> BoxFut<'_, Result<String, String>> {
        Box::pin(async { Err("no /v1/models".to_owned()) })
    }
    /// Posts `body` ([`crate::pd::rejection_body`]) to `<base>/v1/completions` of a decode
    /// engine (or the kvguard-control in front of it) as request `id`; returns the status.
    fn release_prefill(
        &self,
        base: String,
        id: RequestId,
        body: Vec<u8>,
    ) -> BoxFut<'_, Result<u16, String>> {
        let _ = (base, id, body);
        Box::pin(async { Err("no HTTP client".to_owned()) })
    }
}

/// LoRA adapters in a `GET /v1/models` answer: vLLM lists each loaded adapter as a model
/// whose `parent` is the base model (the base model's `parent` is null). `None` when the
/// body is not such a list.
pub fn lora_adapters(models: &str) -> Option<u64> {
    let v: serde_json::Value = serde_json::from_str(models).ok()?;
    let data = v.get("data")?.as_array()?;
    Some(
        data.iter()
            .filter(|m| m.get("parent").is_some_and(|p| !p.is_null()))
            .count() as u64,
    )
}

/// The engine over HTTP.
pub struct HttpEngine {
    client: Client<HttpConnector, Full<Bytes>>,
    metrics_url: Uri,
    health_url: Uri,
    base: String,
    strategy: AbortStrategy,
    api_key: Option<http::HeaderValue>,
}

impl HttpEngine {
    /// From the validated configuration.
    pub fn new(cfg: &Config) -> HttpEngine {
        let mut conn = HttpConnector::new();
        conn.set_nodelay(true);
        conn.set_connect_timeout(Some(ENGINE_CALL_TIMEOUT));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(2))
            .pool_max_idle_per_host(2)
            .build(conn);
        HttpEngine {
            client,
            metrics_url: cfg.engine_metrics_url.clone(),
            health_url: cfg.engine_health_url.clone(),
            base: cfg.engine.base.clone(),
            strategy: cfg.abort_strategy,
            api_key: cfg.engine_api_key.as_ref().and_then(|k| {
                let mut v = http::HeaderValue::from_str(&format!("Bearer {k}")).ok()?;
                v.set_sensitive(true);
                Some(v)
            }),
        }
    }

    async fn call(
        &self,
        method: Method,
        uri: Uri,
        body: Option<Vec<u8>>,
        limit: usize,
    ) -> Result<(u16, Bytes), String> {
        self.call_as(method, uri, body, limit, None).await
    }

    async fn call_as(
        &self,
        method: Method,
        uri: Uri,
        body: Option<Vec<u8>>,
        limit: usize,
        request_id: Option<&RequestId>,
    ) -> Result<(u16, Bytes), String> {
        let mut b = Request::builder().method(method).uri(uri.clone());
        if let Some(id) = request_id {
            b = b.header(kvguard_contract::REQUEST_ID_HEADER, id.as_str());
        }
        if body.is_some() {
            b = b.header(http::header::CONTENT_TYPE, "application/json");
        }
        if let Some(k) = &self.api_key {
            // vLLM's --api-key guards /v1, /inference (its abort API); /metrics and
            // /health are open, and a key there is ignored.
            b = b.header(http::header::AUTHORIZATION, k.clone());
        }
        let req = b
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| format!("{uri}: {e}"))?;
        let fut = async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|e| format!("{uri}: {}", error_chain(&e)))?;
            let status = resp.status().as_u16();
            let bytes = Limited::new(resp.into_body(), limit)
                .collect()
                .await
                .map_err(|e| format!("{uri}: reading body: {e}"))?
                .to_bytes();
            Ok::<_, String>((status, bytes))
        };
        tokio::time::timeout(ENGINE_CALL_TIMEOUT, fut)
            .await
            .map_err(|_| format!("{uri}: no answer within {ENGINE_CALL_TIMEOUT:?}"))?
    }

    fn abort_call(&self, id: &RequestId) -> Option<(Uri, Vec<u8>)> {
        let (path, body) = match self.strategy {
            AbortStrategy::Connection => return None,
            AbortStrategy::Sglang => ("/abort_request", serde_json::json!({ "rid": id.as_str() })),
            AbortStrategy::VllmScaleOut => (
                "/inference/v1/abort_requests",
                serde_json::json!({ "request_ids": vllm_abort_ids(id) }),
            ),
        };
        let uri: Uri = format!("{}{path}", self.base).parse().ok()?;
        Some((uri, serde_json::to_vec(&body).unwrap_or_default()))
    }
}

impl Engine for HttpEngine {
    fn scrape(&self) -> BoxFut<'_, Result<String, String>> {
        Box::pin(async move {
            let (status, body) = self
                .call(
                    Method::GET,
                    self.metrics_url.clone(),
                    None,
                    MAX_SCRAPE_BYTES,
                )
                .await?;
            if !(200..300).contains(&status) {
                return Err(format!("{}: status {status}", self.metrics_url));
            }
            String::from_utf8(body.to_vec()).map_err(|_| "metrics text is not UTF-8".to_owned())
        })
    }

    fn health(&self) -> BoxFut<'_, Result<(), String>> {
        Box::pin(async move {
            let (status, _) = self
                .call(Method::GET, self.health_url.clone(), None, 64 * 1024)
                .await?;
            if (200..300).contains(&status) {
                Ok(())
            } else {
                Err(format!("{}: status {status}", self.health_url))
            }
        })
    }

    fn models(&self) -> BoxFut<'_, Result<String, String>> {
        Box::pin(async move {
            let uri: Uri = format!("{}/v1/models", self.base)
                .parse()
                .map_err(|e| format!("{}/v1/models: {e}", self.base))?;
            let (status, body) = self
                .call(Method::GET, uri.clone(), None, 1024 * 1024)
                .await?;
            if !(200..300).contains(&status) {
                return Err(format!("{uri}: status {status}"));
            }
            String::from_utf8(body.to_vec()).map_err(|_| format!("{uri}: not UTF-8"))
        })
    }

    fn release_prefill(
        &self,
        base: String,
        id: RequestId,
        body: Vec<u8>,
    ) -> BoxFut<'_, Result<u16, String>> {
        Box::pin(async move {
            let uri: Uri = format!("{base}/v1/completions")
                .parse()
                .map_err(|e| format!("{base}/v1/completions: {e}"))?;
            let (status, _) = self
                .call_as(Method::POST, uri, Some(body), 64 * 1024, Some(&id))
                .await?;
            Ok(status)
        })
    }

    fn abort(&self, id: RequestId) -> BoxFut<'_, Result<(), String>> {
        Box::pin(async move {
            let Some((uri, body)) = self.abort_call(&id) else {
                return Ok(());
            };
            let (status, answer) = self
                .call(Method::POST, uri.clone(), Some(body), 64 * 1024)
                .await?;
            if (200..300).contains(&status) {
                Ok(())
            } else {
                Err(format!(
                    "{uri}: status {status}: {}",
                    String::from_utf8_lossy(&answer[..answer.len().min(200)])
                ))
            }
        })
    }
}

/// The ids vLLM 0.32 knows a request by, for its abort API: a completion's sequence is
/// `cmpl-<id>-<prompt index>` (`-0` for one prompt), a chat completion's `chatcmpl-<id>`;
/// `cmpl-<id>` is kept for older versions. The sequences of a batched completion's other
/// prompts are ended by the closed connection.
pub fn vllm_abort_ids(id: &RequestId) -> [String; 3] {
    let id = id.as_str();
    [
        format!("cmpl-{id}-0"),
        format!("chatcmpl-{id}"),
        format!("cmpl-{id}"),
    ]
}

/// An error and its sources, `: `-separated (hyper's client errors hide the cause).
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lora_adapters_are_models_with_a_parent() {
        // vLLM's /v1/models with one LoRA module loaded (--lora-modules sql=/path).
        let two = r#"{"object":"list","data":[
            {"id":"base","object":"model","root":"base","parent":null,"max_model_len":2048},
            {"id":"sql","object":"model","root":"/path","parent":"base"}]}"#;
        assert_eq!(lora_adapters(two), Some(1));
        assert_eq!(
            lora_adapters(r#"{"object":"list","data":[{"id":"base","object":"model"}]}"#),
            Some(0)
        );
        assert_eq!(lora_adapters("not json"), None);
        assert_eq!(lora_adapters(r#"{"error":"unauthorized"}"#), None);
    }

    fn engine(strategy: &str) -> HttpEngine {
        let mut cfg = Config::for_tests("http://127.0.0.1:9", vec![]).unwrap();
        cfg.abort_strategy = match strategy {
            "sglang" => AbortStrategy::Sglang,
            "vllm" => AbortStrategy::VllmScaleOut,
            _ => AbortStrategy::Connection,
        };
        HttpEngine::new(&cfg)
    }

    #[tokio::test]
    async fn abort_calls_per_strategy() {
        let id = RequestId::try_new(b"abc").unwrap();
        assert!(engine("connection").abort_call(&id).is_none());
        let (u, b) = engine("sglang").abort_call(&id).unwrap();
        assert_eq!(u.to_string(), "http://127.0.0.1:9/abort_request");
        assert_eq!(b, br#"{"rid":"abc"}"#);
        let (u, b) = engine("vllm").abort_call(&id).unwrap();
        assert_eq!(
            u.to_string(),
            "http://127.0.0.1:9/inference/v1/abort_requests"
        );
        assert_eq!(
            b,
            br#"{"request_ids":["cmpl-abc-0","chatcmpl-abc","cmpl-abc"]}"#
        );
        // The connection strategy never calls the engine.
        assert!(engine("connection").abort(id.clone()).await.is_ok());
        // Nothing listens on port 9 (discard): an error, not a hang or a panic.
        assert!(engine("sglang").abort(id).await.is_err());
        assert!(engine("x").scrape().await.is_err());
    }
}
