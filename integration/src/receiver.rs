//! A mock abort endpoint (`POST /v1/abort`) for the filter's tests: a test instrument
//! that answers per contract §3 (or misbehaves on purpose) and records every call.

use crate::http::{bytes_response, json_response, read_body, RespBody};
use anyhow::{bail, Context, Result};
use bytes::Bytes;
use hyper::body::Incoming;
use hyper::{Request, Response};
use kvguard_contract::abort::MAX_ABORT_BODY;
use kvguard_contract::signature::{self, SignatureError};
use kvguard_contract::{AbortAnswer, AbortRequest, Domain, Key, LEASE_PATH, SIGNATURE_HEADER};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::Notify;

/// How the receiver answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Behaviour {
    /// Per contract: verify the signature (401, replay 409), parse the body (400), then
    /// 200 for an id in flight (`aborted`, then `already_aborted`), 404 + tombstone else.
    Verify,
    /// Answer this status (with an empty JSON object body) without verifying.
    Status(u16),
    /// Wait this long, then behave as [`Behaviour::Verify`]. The call is recorded when it
    /// arrives (`verify` and `status` `None` until it is answered), so that attempts the
    /// sender gives up on before the answer are recorded too.
    Delay(Duration),
    /// Drop the connection without answering.
    Close,
    /// A tap in front of a real abort endpoint: pass each call on unchanged (method, path,
    /// headers, body) to this address and answer what it answers (502 when it cannot be
    /// reached). Recorded on arrival, `status` set once the answer is back; `verify` stays
    /// `None` (the endpoint behind verifies).
    Forward(SocketAddr),
}

/// Which ids count as in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IdPolicy {
    /// Every id not tombstoned and not aborted yet is in flight (the first abort of an id
    /// answers 200 `aborted`). The usual choice for filter tests.
    #[default]
    AllInFlight,
    /// Only ids added with [`Receiver::register`] are in flight; others answer 404 and
    /// leave a tombstone.
    Registered,
}

/// Receiver settings.
#[derive(Debug, Clone)]
pub struct ReceiverConfig {
    /// Keys accepted (any of them verifies).
    pub keys: Vec<Key>,
    /// Initial behaviour.
    pub behaviour: Behaviour,
    /// Which ids are in flight.
    pub ids: IdPolicy,
    /// Address to bind; `None` = `127.0.0.1:0`.
    pub listen: Option<SocketAddr>,
}

impl ReceiverConfig {
    /// Verifying receiver with these keys, every id in flight, on `127.0.0.1:0`.
    pub fn new(keys: Vec<Key>) -> Self {
        ReceiverConfig {
            keys,
            behaviour: Behaviour::Verify,
            ids: IdPolicy::AllInFlight,
            listen: None,
        }
    }
}

/// One received call.
#[derive(Debug, Clone)]
pub struct ReceivedCall {
    /// Method.
    pub method: String,
    /// Path (with query).
    pub path: String,
    /// Headers (lower-case names; repeated ones joined by `, `).
    pub headers: BTreeMap<String, String>,
    /// Raw body.
    pub body: Bytes,
    /// The parsed abort body, if it parsed.
    pub abort: Option<AbortRequest>,
    /// Signature check result (`None` when the behaviour did not verify).
    pub verify: Option<Result<(), SignatureError>>,
    /// Status answered (`None` for [`Behaviour::Close`]).
    pub status: Option<u16>,
    /// When it arrived.
    pub at: Instant,
}

impl ReceivedCall {
    /// The abort's request id, if the body parsed.
    pub fn request_id(&self) -> Option<&str> {
        self.abort.as_ref().map(|a| a.request_id.as_str())
    }
}

#[derive(Default)]
struct State {
    behaviour: Option<Behaviour>,
    calls: Vec<ReceivedCall>,
    seen_sigs: HashMap<(u64, [u8; 32]), u64>,
    in_flight: HashSet<String>,
    aborted: HashSet<String>,
    tombstones: HashSet<String>,
    /// Lease renewals (`POST /v1/lease`): answered 200, kept apart from the abort calls.
    renewals: Vec<Vec<u8>>,
}

struct Shared {
    keys: Vec<Key>,
    ids: IdPolicy,
    state: Mutex<State>,
    notify: Notify,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        match self.state.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }
}

/// A running receiver; dropping it stops it.
pub struct Receiver {
    shared: Arc<Shared>,
    server: crate::http::Server,
}

/// Starts a receiver on the current tokio runtime.
pub async fn spawn(config: ReceiverConfig) -> Result<Receiver> {
    let listener = crate::http::bind(config.listen)
        .await
        .context("binding the abort receiver")?;
    let shared = Arc::new(Shared {
        keys: config.keys,
        ids: config.ids,
        state: Mutex::new(State {
            behaviour: Some(config.behaviour),
            ..State::default()
        }),
        notify: Notify::new(),
    });
    let s2 = shared.clone();
    let server = crate::http::serve(listener, move |req, _peer| handle(s2.clone(), req))?;
    Ok(Receiver { shared, server })
}

impl Receiver {
    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.server.addr
    }

    /// Changes how later calls are answered.
    pub fn set_behaviour(&self, b: Behaviour) {
        self.shared.lock().behaviour = Some(b);
    }

    /// Marks `id` in flight (for [`IdPolicy::Registered`]). Returns `false` when a
    /// tombstone refuses it (an abort for it arrived first).
    pub fn register(&self, id: &str) -> bool {
        let mut g = self.shared.lock();
        if g.tombstones.contains(id) {
            return false;
        }
        g.in_flight.insert(id.to_string());
        true
    }

    /// Every call so far, oldest first.
    pub fn calls(&self) -> Vec<ReceivedCall> {
        self.shared.lock().calls.clone()
    }

    /// Calls whose abort body names `request_id`.
    pub fn calls_for(&self, request_id: &str) -> Vec<ReceivedCall> {
        self.calls()
            .into_iter()
            .filter(|c| c.request_id() == Some(request_id))
            .collect()
    }

    /// The bodies of the lease renewals received (not among [`Receiver::calls`]).
    pub fn renewals(&self) -> Vec<Vec<u8>> {
        self.shared.lock().renewals.clone()
    }

    /// Forgets the recorded calls (not the id or replay memory).
    pub fn clear_calls(&self) {
        self.shared.lock().calls.clear();
    }

    /// Waits until at least `n` calls arrived; returns them all.
    pub async fn wait_for_calls(&self, n: usize, timeout: Duration) -> Result<Vec<ReceivedCall>> {
        self.wait_until(
            timeout,
            |calls| calls.len() >= n,
            || format!("{n} abort call(s)"),
        )
        .await
    }

    /// Waits until at least one call names `request_id`; returns the calls that do.
    pub async fn wait_calls_for(
        &self,
        request_id: &str,
        timeout: Duration,
    ) -> Result<Vec<ReceivedCall>> {
        let named = |c: &ReceivedCall| c.request_id() == Some(request_id);
        let calls = self
            .wait_until(
                timeout,
                |calls| calls.iter().any(named),
                || format!("an abort call for {request_id}"),
            )
            .await?;
        Ok(calls.into_iter().filter(named).collect())
    }

    /// Waits (woken by each call) until `done` holds for the calls so far; returns them.
    async fn wait_until(
        &self,
        timeout: Duration,
        done: impl Fn(&[ReceivedCall]) -> bool,
        what: impl Fn() -> String,
    ) -> Result<Vec<ReceivedCall>> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.shared.notify.notified();
            let calls = self.calls();
            if done(&calls) {
                return Ok(calls);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                let calls = self.calls();
                if done(&calls) {
                    return Ok(calls);
                }
                bail!(
                    "timed out after {timeout:?} waiting for {}; got {}: {:?}",
                    what(),
                    calls.len(),
                    calls
                        .iter()
                        .map(|c| (c.request_id().map(str::to_string), c.status))
                        .collect::<Vec<_>>()
                );
            }
        }
    }

    /// Asserts (bounded wait) that no further call arrives within `quiet`: returns the
    /// calls so far if their count is still `n`.
    pub async fn expect_no_more_calls(
        &self,
        n: usize,
        quiet: Duration,
    ) -> Result<Vec<ReceivedCall>> {
        tokio::time::sleep(quiet).await;
        let calls = self.calls();
        if calls.len() != n {
            bail!("expected {n} abort call(s), got {}", calls.len());
        }
        Ok(calls)
    }
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn handle(
    shared: Arc<Shared>,
    req: Request<Incoming>,
) -> Result<Response<RespBody>, std::io::Error> {
    let at = Instant::now();
    let method = req.method().to_string();
    let path = req
        .uri()
        .path_and_query()
        .map(|p| p.to_string())
        .unwrap_or_default();
    let mut headers = BTreeMap::new();
    for (k, v) in req.headers() {
        let v = String::from_utf8_lossy(v.as_bytes()).into_owned();
        headers
            .entry(k.as_str().to_string())
            .and_modify(|e: &mut String| {
                e.push_str(", ");
                e.push_str(&v);
            })
            .or_insert(v);
    }
    let sig_header = req
        .headers()
        .get(SIGNATURE_HEADER)
        .map(|v| v.as_bytes().to_vec());
    let body = read_body(req.into_body(), MAX_ABORT_BODY * 4)
        .await
        .unwrap_or_default();
    let behaviour = shared.lock().behaviour.clone().unwrap_or(Behaviour::Verify);
    // Lease renewals are kept apart (the abort tests see aborts only): answered 200, or
    // passed on by a tap.
    if path == LEASE_PATH {
        shared.lock().renewals.push(body.to_vec());
        if let Behaviour::Forward(to) = behaviour {
            return Ok(forward(to, &method, &path, &headers, &body).await);
        }
        return Ok(json_response(200, &serde_json::json!({})));
    }
    let abort = AbortRequest::parse(&body).ok().map(|(a, _)| a);
    let record = |verify, status| {
        let mut g = shared.lock();
        g.calls.push(ReceivedCall {
            method: method.clone(),
            path: path.clone(),
            headers: headers.clone(),
            body: body.clone(),
            abort: abort.clone(),
            verify,
            status,
            at,
        });
        drop(g);
        shared.notify.notify_waiters();
    };
    match behaviour {
        Behaviour::Close => {
            record(None, None);
            return Err(std::io::Error::other("receiver behaviour: close"));
        }
        Behaviour::Status(s) => {
            record(None, Some(s));
            return Ok(json_response(s, &serde_json::json!({})));
        }
        Behaviour::Delay(d) => {
            // Recorded on arrival; the answer, if the sender still waits for it, completes
            // the record.
            record(None, None);
            tokio::time::sleep(d).await;
            let (verify, resp) = verify_and_answer(&shared, sig_header.as_deref(), &body);
            complete_record(&shared, at, &body, Some(verify), resp.status().as_u16());
            return Ok(resp);
        }
        Behaviour::Forward(to) => {
            record(None, None);
            let resp = forward(to, &method, &path, &headers, &body).await;
            complete_record(&shared, at, &body, None, resp.status().as_u16());
            return Ok(resp);
        }
        Behaviour::Verify => {}
    }
    let (verify, resp) = verify_and_answer(&shared, sig_header.as_deref(), &body);
    record(Some(verify), Some(resp.status().as_u16()));
    Ok(resp)
}

/// Sets the answer of the call recorded at `at` with `body` (if still recorded).
fn complete_record(
    shared: &Shared,
    at: Instant,
    body: &[u8],
    verify: Option<Result<(), SignatureError>>,
    status: u16,
) {
    let mut g = shared.lock();
    if let Some(c) = g.calls.iter_mut().find(|c| c.at == at && c.body == body) {
        c.verify = verify;
        c.status = Some(status);
    }
}

/// Passes a call on to `to` ([`Behaviour::Forward`]) and turns its answer into ours.
async fn forward(
    to: SocketAddr,
    method: &str,
    path: &str,
    headers: &BTreeMap<String, String>,
    body: &[u8],
) -> Response<RespBody> {
    // The hop's own framing headers are the client's to set.
    let pass: Vec<(&str, &str)> = headers
        .iter()
        .filter(|(k, _)| {
            !matches!(
                k.as_str(),
                "host" | "content-length" | "transfer-encoding" | "connection"
            )
        })
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let Ok(m) = hyper::Method::from_bytes(method.as_bytes()) else {
        return json_response(502, &serde_json::json!({"error": "forward: bad method"}));
    };
    let answer = crate::client::request(
        to,
        m,
        path,
        &pass,
        Bytes::copy_from_slice(body),
        false,
        Duration::from_secs(10),
    )
    .await;
    match answer {
        Ok(r) => {
            let ct = r
                .header("content-type")
                .unwrap_or("application/json")
                .to_owned();
            bytes_response(r.status, &ct, r.body)
        }
        Err(e) => json_response(
            502,
            &serde_json::json!({"error": format!("forward: {e:#}")}),
        ),
    }
}

fn verify_and_answer(
    shared: &Shared,
    sig: Option<&[u8]>,
    body: &[u8],
) -> (Result<(), SignatureError>, Response<RespBody>) {
    let now = now_unix();
    let s = match signature::verify(Domain::Abort, &shared.keys, sig, body, now) {
        Ok(s) => s,
        Err(e) => {
            return (
                Err(e),
                json_response(401, &serde_json::json!({"error": e.as_str()})),
            )
        }
    };
    let mut g = shared.lock();
    g.seen_sigs
        .retain(|_, t| now.abs_diff(*t) <= kvguard_contract::MAX_SKEW_SECS * 2);
    if g.seen_sigs.insert((s.t, s.mac), s.t).is_some() {
        return (
            Err(SignatureError::Replay),
            json_response(409, &serde_json::json!({"error": "replay"})),
        );
    }
    let (req, id) = match AbortRequest::parse(body) {
        Ok(x) => x,
        Err(e) => {
            return (
                Ok(()),
                bytes_response(
                    400,
                    "application/json",
                    serde_json::json!({"error": e.to_string()}).to_string(),
                ),
            )
        }
    };
    let id = id.as_str().to_string();
    let _ = req;
    let answer = if g.aborted.contains(&id) {
        Some(AbortAnswer {
            request_id: id.clone(),
            found: true,
            aborted: false,
            already_aborted: true,
            legs: Vec::new(),
            deferred: false,
        })
    } else if g.in_flight.remove(&id)
        || (shared.ids == IdPolicy::AllInFlight && !g.tombstones.contains(&id))
    {
        g.aborted.insert(id.clone());
        Some(AbortAnswer {
            request_id: id.clone(),
            found: true,
            aborted: true,
            already_aborted: false,
            legs: Vec::new(),
            deferred: false,
        })
    } else {
        g.tombstones.insert(id.clone());
        None
    };
    let resp = match answer {
        Some(a) => json_response(200, &serde_json::to_value(a).unwrap_or_default()),
        None => json_response(
            404,
            &serde_json::to_value(AbortAnswer {
                request_id: id,
                found: false,
                aborted: false,
                already_aborted: false,
                legs: Vec::new(),
                deferred: false,
            })
            .unwrap_or_default(),
        ),
    };
    (Ok(()), resp)
}
