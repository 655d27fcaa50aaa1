//! The fuzz oracles: one function per target, each taking the raw fuzz input.
//!
//! This file has no dependency beyond the kvguard crates, `tokio`, `tower` and `axum`
//! (for the control handler), so the same checks run under libFuzzer (`fuzz_targets/`)
//! and, as ordinary stable tests, over the committed corpus
//! (`integration/tests/fuzz_corpus_replay.rs` includes this file with `#[path]`).
//!
//! Each check panics (the fuzzer's signal) when the code under test panics or breaks
//! one of the properties written next to it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvguard_contract::{signature, stamp, AbortReason, AbortRequest, Domain, Key, RequestId};
use kvguard_filter_core::engine::{Action, Engine, Verdict};
use kvguard_filter_core::host::{Call, Clock, DispatchError, Host, Level};
use kvguard_filter_core::metrics::{Metric, Metrics};
use kvguard_filter_core::scan::{Event, Framing, Scanner};
use kvguard_filter_core::{Config, OutcomeTag};
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;

/// The key every target signs with.
pub const KEY: &[u8] = b"kvguard-fuzz-key-0123456789abcdef";

/// A tiny reader over the fuzz input (no `arbitrary` dependency, so the corpus replay
/// needs nothing but this file).
pub struct Bytes<'a> {
    data: &'a [u8],
}

impl<'a> Bytes<'a> {
    /// Reads from `data`.
    pub fn new(data: &'a [u8]) -> Self {
        Bytes { data }
    }
    /// One byte (0 when exhausted).
    pub fn byte(&mut self) -> u8 {
        match self.data.split_first() {
            Some((b, rest)) => {
                self.data = rest;
                *b
            }
            None => 0,
        }
    }
    /// A little-endian u16.
    pub fn u16(&mut self) -> u16 {
        u16::from(self.byte()) | (u16::from(self.byte()) << 8)
    }
    /// A length-prefixed slice (one length byte, or two when the first is 255).
    pub fn slice(&mut self) -> &'a [u8] {
        let mut n = usize::from(self.byte());
        if n == 255 {
            n = usize::from(self.u16());
        }
        let n = n.min(self.data.len());
        let (s, rest) = self.data.split_at(n);
        self.data = rest;
        s
    }
    /// Everything left.
    pub fn rest(&mut self) -> &'a [u8] {
        core::mem::take(&mut self.data)
    }
    /// Whether the input is used up.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

// ---------------------------------------------------------------------------------------
// Filter: the incremental SSE / NDJSON scanner.
// ---------------------------------------------------------------------------------------

/// What a scanner run saw, for comparing two chunkings of one body.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ScanTrace {
    /// Each event: `Some((data, completes))` or `None` for an oversized one.
    pub events: Vec<Option<(Vec<u8>, bool)>>,
    /// Sums of `Fed`.
    pub n_events: u64,
    /// Oversized events.
    pub oversized: u64,
    /// Events whose JSON could not be followed.
    pub malformed: u64,
    /// Completed, and by which event (index).
    pub completed_at: Option<usize>,
}

/// Feeds `body` to a fresh scanner in the chunks given by `cuts` (offsets).
pub fn scan_trace(framing: Framing, max_event: usize, body: &[u8], cuts: &[usize]) -> ScanTrace {
    let mut sc = Scanner::new(framing, max_event);
    let mut t = ScanTrace::default();
    let mut start = 0;
    let push = |sc: &mut Scanner, t: &mut ScanTrace, chunk: &[u8], fin: bool| {
        let mut evs = Vec::new();
        let mut on = |e: Event<'_>| match e {
            Event::Data(d, c) => evs.push(Some((d.to_vec(), c))),
            Event::Oversized => evs.push(None),
            Event::Idle(_) => {}
        };
        let fed = if fin {
            sc.finish(&mut on)
        } else {
            sc.feed_with(chunk, &mut on)
        };
        if fed.completed {
            assert!(t.completed_at.is_none(), "completed twice");
            // Completion comes with the event that completes (flag `true`).
            let at = evs.iter().position(|e| matches!(e, Some((_, true))));
            assert!(at.is_some(), "completed without a completing event");
            t.completed_at = at.map(|i| t.events.len() + i);
        }
        t.events.extend(evs);
        t.n_events += u64::from(fed.events);
        t.oversized += u64::from(fed.oversized);
        t.malformed += u64::from(fed.malformed);
    };
    for &c in cuts {
        let c = c.min(body.len()).max(start);
        push(&mut sc, &mut t, &body[start..c], false);
        start = c;
    }
    push(&mut sc, &mut t, &body[start..], false);
    push(&mut sc, &mut t, &[], true);
    assert_eq!(
        sc.completed(),
        t.completed_at.is_some(),
        "completed() disagrees with Fed"
    );
    t
}

/// Target `sse_scanner`: no panic; the result does not depend on where the body is cut
/// (one chunk, the fuzzer's cuts, byte by byte); every event is bounded by
/// `max_event_bytes`; counts agree with the events reported.
pub fn sse_scanner(data: &[u8]) {
    let mut b = Bytes::new(data);
    let mode = b.byte();
    let framing = match mode % 3 {
        0 => Framing::Sse,
        1 => Framing::Ndjson,
        _ => Framing::Opaque,
    };
    let max_event = [16usize, 64, 1024, 65536][usize::from(mode >> 2) % 4];
    let ncuts = usize::from(b.byte() % 16);
    let raw_cuts: Vec<u16> = (0..ncuts).map(|_| b.u16()).collect();
    let body = b.rest();
    let mut cuts: Vec<usize> = raw_cuts
        .iter()
        .map(|c| usize::from(*c) % (body.len() + 1))
        .collect();
    cuts.sort_unstable();

    let whole = scan_trace(framing, max_event, body, &[]);
    let split = scan_trace(framing, max_event, body, &cuts);
    assert_eq!(whole, split, "chunking changed the result (cuts {cuts:?})");
    if body.len() <= 4096 {
        let every: Vec<usize> = (1..body.len()).collect();
        let bytewise = scan_trace(framing, max_event, body, &every);
        assert_eq!(whole, bytewise, "byte-by-byte feeding changed the result");
    }
    if framing == Framing::Opaque {
        assert_eq!(
            whole,
            ScanTrace::default(),
            "an opaque body produced events"
        );
    }
    assert_eq!(whole.events.len() as u64, whole.n_events);
    assert_eq!(
        whole.events.iter().filter(|e| e.is_none()).count() as u64,
        whole.oversized
    );
    for e in whole.events.iter().flatten() {
        assert!(e.0.len() <= max_event, "event of {} bytes kept", e.0.len());
    }
    // Once complete, the stream stays complete; the flag comes with an event.
    if let Some(at) = whole.completed_at {
        assert!(matches!(whole.events[at], Some((_, true))));
    }
}

/// Target `json_look`: the light JSON look never panics, agrees with serde_json on what
/// it reports for well-formed objects, and has nothing to say about any event the
/// scanner's pre-check (`json::inert`) lets skip it.
pub fn json_look(data: &[u8]) {
    let look = kvguard_filter_core::json::look(data);
    if kvguard_filter_core::json::inert(data) {
        // The scanner skips the look on such events: it must have had nothing to say.
        assert!(
            look.malformed || (!look.terminal_type && !look.done),
            "inert event the look has something to say about"
        );
    }
    let Ok(serde_json::Value::Object(obj)) = serde_json::from_slice::<serde_json::Value>(data)
    else {
        return;
    };
    if look.malformed {
        // Deeper than the look follows, or a shape it refuses: then it reports nothing.
        return;
    }
    let done = obj.get("done") == Some(&serde_json::Value::Bool(true));
    assert_eq!(look.done, done, "done disagrees with serde_json");
    let terminal = matches!(
        obj.get("type").and_then(|t| t.as_str()),
        Some("response.completed" | "response.failed" | "response.incomplete")
    );
    assert_eq!(
        look.terminal_type, terminal,
        "type disagrees with serde_json"
    );
}

// ---------------------------------------------------------------------------------------
// Filter: the plugin configuration.
// ---------------------------------------------------------------------------------------

/// Target `filter_config`: `Config::parse` never panics; an accepted configuration keeps
/// the contract's invariants (secret ≥ 16 bytes, tick > 0, routes ordered longest prefix
/// first, limits_for never panics).
pub fn filter_config(data: &[u8]) {
    let env = |name: &str| match name {
        "KVGUARD_SECRET" => Some("kvguard-fuzz-secret-0123456789".to_owned()),
        "SHORT" => Some("short".to_owned()),
        "EMPTY" => Some(String::new()),
        _ => None,
    };
    let Ok(cfg) = Config::parse(data, &env) else {
        return;
    };
    assert!(!cfg.control_cluster.is_empty());
    assert!(cfg.tick_ms > 0, "tick_ms 0 accepted");
    assert!(cfg.max_pending_aborts > 0, "max_pending_aborts 0 accepted");
    for w in cfg.routes.windows(2) {
        assert!(
            w[0].path_prefix.len() >= w[1].path_prefix.len(),
            "routes not longest-prefix first"
        );
    }
    for p in ["/v1/chat/completions", "/", "", "/v1/completions?x=1"] {
        let _ = cfg.limits_for(p.as_bytes());
    }
    let _ = cfg.limits_for(data);
    // The engine builds on any accepted configuration.
    let _ = Engine::new(cfg, 1);
}

// ---------------------------------------------------------------------------------------
// Contract: the x-kvguard-control stamp and the x-kvguard-signature header.
// ---------------------------------------------------------------------------------------

/// Target `control_header`: `stamp::parse`/`verify` and `signature::parse` never panic;
/// what parses re-serialises to a value that parses to the same thing; a stamp verifies
/// only with the key and request id it was made for.
pub fn control_header(data: &[u8]) {
    let key = Key::try_new(KEY).unwrap();
    let other = Key::try_new(b"another-fuzz-key-0123456789abcdef").unwrap();
    let mut b = Bytes::new(data);
    let mode = b.byte();
    let id_bytes = b.slice();
    let value = b.rest();

    // Raw parsing of both headers.
    if let Ok(s) = stamp::parse(value) {
        let again = format!("{};t={};v2={}", s.addr, s.t, hex(&s.sig));
        assert_eq!(stamp::parse(again.as_bytes()), Ok(s), "stamp round trip");
    }
    if let Ok(s) = signature::parse(value) {
        let again = format!("t={},v2={}", s.t, hex(&s.mac));
        assert_eq!(
            signature::parse(again.as_bytes()),
            Ok(s),
            "signature round trip"
        );
    }
    let Ok(id) = RequestId::try_new(id_bytes) else {
        return;
    };
    // A fuzzer-made value never verifies (it would have to forge the MAC).
    if let Ok(s) = stamp::verify(core::slice::from_ref(&key), value, &id) {
        let real = stamp::stamp(&key, s.addr, &id, s.t);
        assert_eq!(stamp::parse(real.as_bytes()).map(|x| x.sig), Ok(s.sig));
    }
    // A genuine stamp for an address taken from the input verifies for its id only.
    let addr: SocketAddr = if mode & 1 == 0 {
        SocketAddr::from(([10, mode, 0, 1], u16::from(mode) * 97))
    } else {
        SocketAddr::from((
            [0xfd00, 0, 0, 0, 0, 0, 0, u16::from(mode)],
            u16::from(mode) + 1,
        ))
    };
    let t = u64::from(mode) * 1_000_003;
    let genuine = stamp::stamp(&key, addr, &id, t);
    let ok = stamp::verify(core::slice::from_ref(&key), genuine.as_bytes(), &id);
    assert_eq!(
        ok.map(|s| (s.addr, s.t)),
        Ok((addr, t)),
        "genuine stamp refused"
    );
    assert_eq!(
        stamp::verify(core::slice::from_ref(&other), genuine.as_bytes(), &id),
        Err(stamp::StampError::Mismatch),
        "stamp verified with the wrong key"
    );
    let mut other_id = id.as_str().to_owned();
    other_id.push('x');
    if let Ok(other_id) = RequestId::try_new(other_id.as_bytes()) {
        assert_eq!(
            stamp::verify(core::slice::from_ref(&key), genuine.as_bytes(), &other_id),
            Err(stamp::StampError::Mismatch),
            "stamp verified for another request id"
        );
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

// ---------------------------------------------------------------------------------------
// Contract + control: the abort body and its signature.
// ---------------------------------------------------------------------------------------

/// Target `abort_request`: `AbortRequest::parse` and `signature::verify` never panic; an
/// accepted body round-trips; a fuzzer-made signature never verifies; a genuine one
/// verifies only within ±30 s and only for the exact body.
pub fn abort_request(data: &[u8]) {
    let key = Key::try_new(KEY).unwrap();
    let mut b = Bytes::new(data);
    let skew = i64::from(b.byte() as i8);
    let header = b.slice();
    let body = b.rest();
    const NOW: u64 = 1_800_000_000;

    if let Ok((req, id)) = AbortRequest::parse(body) {
        assert_eq!(req.request_id, id.as_str());
        let json = req.to_json();
        let (again, id2) = AbortRequest::parse(&json).expect("re-serialised body refused");
        assert_eq!((&again, &id2), (&req, &id));
    }
    let keys = [key.clone()];
    assert!(
        signature::verify(Domain::Abort, &keys, Some(header), body, NOW).is_err(),
        "a fuzzer-made signature verified"
    );
    let _ = signature::verify(Domain::Abort, &keys, None, body, NOW);
    let t = NOW.saturating_add_signed(skew);
    let genuine = signature::sign(Domain::Abort, &key, t, body);
    let r = signature::verify(Domain::Abort, &keys, Some(genuine.as_bytes()), body, NOW);
    if skew.unsigned_abs() <= signature::MAX_SKEW_SECS {
        assert!(r.is_ok(), "genuine signature refused at skew {skew}");
    } else {
        assert_eq!(r, Err(signature::SignatureError::Stale));
    }
    if !body.is_empty() {
        let mut tampered = body.to_vec();
        tampered[0] ^= 1;
        assert!(
            signature::verify(
                Domain::Abort,
                &keys,
                Some(genuine.as_bytes()),
                &tampered,
                NOW
            )
            .is_err(),
            "signature verified for another body"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Control: the abort handler, through the real axum router (no sockets).
// ---------------------------------------------------------------------------------------

mod control_api {
    use super::*;
    use kvguard_control::config::Config as ControlConfig;
    use kvguard_control::engine::{BoxFut, Engine as ControlEngine};
    use kvguard_control::gpu::GpuTracker;
    use kvguard_control::state::AppState;
    use kvguard_control::testing::ManualClock;
    use std::sync::OnceLock;
    use tower::ServiceExt;

    pub const NOW: u64 = 1_800_000_000;

    struct NoEngine;
    impl ControlEngine for NoEngine {
        fn scrape(&self) -> BoxFut<'_, Result<String, String>> {
            Box::pin(async { Err("fuzz".into()) })
        }
        fn health(&self) -> BoxFut<'_, Result<(), String>> {
            Box::pin(async { Err("fuzz".into()) })
        }
        fn abort(&self, _id: RequestId) -> BoxFut<'_, Result<(), String>> {
            Box::pin(async { Ok(()) })
        }
    }

    fn runtime() -> &'static tokio::runtime::Runtime {
        static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
        RT.get_or_init(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
        })
    }

    pub fn state() -> Arc<AppState> {
        let cfg = ControlConfig::for_tests("http://127.0.0.1:9", vec![Key::try_new(KEY).unwrap()])
            .unwrap();
        AppState::new(
            cfg,
            Arc::new(ManualClock::new(NOW)),
            Arc::new(NoEngine),
            GpuTracker::unavailable("fuzz".into()),
        )
    }

    /// Posts to the admin router; returns the status and body.
    pub fn post(
        st: &Arc<AppState>,
        path: &str,
        headers: &[(&[u8], &[u8])],
        body: Vec<u8>,
    ) -> Option<(u16, Vec<u8>)> {
        let mut b = http::Request::post(path);
        for (n, v) in headers {
            let (Ok(n), Ok(v)) = (
                http::HeaderName::from_bytes(n),
                http::HeaderValue::from_bytes(v),
            ) else {
                return None;
            };
            b = b.header(n, v);
        }
        let req = b.body(axum::body::Body::from(body)).ok()?;
        let app = kvguard_control::admin::app(st.clone());
        runtime().block_on(async move {
            let resp = app.oneshot(req).await.unwrap();
            let status = resp.status().as_u16();
            let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
                .await
                .unwrap();
            Some((status, body.to_vec()))
        })
    }
}

/// Target `control_abort_api`: the control service's `POST /v1/abort` handler through its
/// real router. Properties: it answers only the contract's statuses; an unsigned or
/// fuzzer-signed call is always 401 and never reaches the table; a genuinely signed call
/// is 400 exactly when the body is refused by `AbortRequest::parse` (or too large), else
/// 200/404 per the table; the same signed call again is 409 (replay).
pub fn control_abort_api(data: &[u8]) {
    use control_api::{post, state, NOW};
    let key = Key::try_new(KEY).unwrap();
    let mut b = Bytes::new(data);
    let mode = b.byte();
    let hname = b.slice();
    let hvalue = b.slice();
    let body = b.rest().to_vec();
    let st = state();

    // 1. Fuzzer-made headers (often a fuzzer-made x-kvguard-signature).
    let name: &[u8] = if mode & 1 == 0 {
        b"x-kvguard-signature"
    } else {
        hname
    };
    if let Some((status, _)) = post(&st, "/v1/abort", &[(name, hvalue)], body.clone()) {
        assert_eq!(
            status, 401,
            "unsigned / forged abort call answered {status}"
        );
    }
    assert!(
        st.inner().tombstones() == 0,
        "a refused call left a tombstone"
    );

    // 2. The same body genuinely signed, at a skew taken from the input.
    let skew = i64::from((mode >> 1) as i8 >> 1); // -32..=31
    let t = NOW.saturating_add_signed(skew);
    let sig = signature::sign(Domain::Abort, &key, t, &body);
    let headers: [(&[u8], &[u8]); 1] = [(b"x-kvguard-signature", sig.as_bytes())];
    let (status, answer) = post(&st, "/v1/abort", &headers, body.clone()).unwrap();
    if skew.unsigned_abs() > signature::MAX_SKEW_SECS {
        assert_eq!(status, 401, "stale signature answered {status}");
        return;
    }
    let parsed = AbortRequest::parse(&body);
    match &parsed {
        Err(_) => assert_eq!(status, 400, "bad body answered {status}"),
        Ok((_, id)) => {
            assert_eq!(status, 404, "unknown id answered {status}");
            let v: serde_json::Value = serde_json::from_slice(&answer).unwrap();
            assert_eq!(v["request_id"], id.as_str());
            assert_eq!(v["found"], false);
        }
    }
    // 3. Replayed: 409 whatever the body.
    let (again, _) = post(&st, "/v1/abort", &headers, body.clone()).unwrap();
    assert_eq!(again, 409, "replayed signature answered {again}");
    // 4. A fresh signature for a tombstoned id: already aborted.
    if parsed.is_ok() {
        let t2 = if t == NOW + 1 { NOW + 2 } else { NOW + 1 };
        let sig2 = signature::sign(Domain::Abort, &key, t2, &body);
        let h2: [(&[u8], &[u8]); 1] = [(b"x-kvguard-signature", sig2.as_bytes())];
        let (s2, a2) = post(&st, "/v1/abort", &h2, body).unwrap();
        assert_eq!(s2, 200);
        let v: serde_json::Value = serde_json::from_slice(&a2).unwrap();
        assert_eq!(v["already_aborted"], true);
    }
}

/// Target `control_scanner`: kvguard-control's own progress scanner never panics and
/// counts the same whatever the chunking.
pub fn control_scanner(data: &[u8]) {
    use kvguard_control::scan::{BodyKind, Scanner as CScanner};
    let mut b = Bytes::new(data);
    let mode = b.byte();
    let kind = match mode % 3 {
        0 => BodyKind::Sse,
        1 => BodyKind::Ndjson,
        _ => BodyKind::Other,
    };
    let ncuts = usize::from(b.byte() % 16);
    let raw: Vec<u16> = (0..ncuts).map(|_| b.u16()).collect();
    let body = b.rest();
    let mut cuts: Vec<usize> = raw
        .iter()
        .map(|c| usize::from(*c) % (body.len() + 1))
        .collect();
    cuts.sort_unstable();
    let count = |cuts: &[usize]| {
        let mut s = CScanner::new(kind);
        let mut n = 0u64;
        let mut start = 0;
        for &c in cuts {
            let c = c.max(start);
            n += s.feed(&body[start..c]);
            start = c;
        }
        n + s.feed(&body[start..])
    };
    let whole = count(&[]);
    assert_eq!(whole, count(&cuts), "chunking changed the count");
    if body.len() <= 4096 {
        let every: Vec<usize> = (1..body.len()).collect();
        assert_eq!(whole, count(&every), "byte-by-byte changed the count");
    }
    if kind == BodyKind::Other {
        assert_eq!(whole, 0);
    }
    // No more events than blank-line/newline terminators.
    let newlines = body.iter().filter(|b| **b == b'\n' || **b == b'\r').count() as u64;
    assert!(whole <= newlines);
}

/// Target `control_text`: the Prometheus text parser and the secret-file parser of
/// kvguard-control never panic.
pub fn control_text(data: &[u8]) {
    if let Ok(text) = core::str::from_utf8(data) {
        for line in text.lines() {
            if let Some(s) = kvguard_control::expo::parse_line(line) {
                assert!(!s.name.is_empty());
            }
        }
        let _ = kvguard_control::expo::EngineFigures::from_text(text);
        let _ = kvguard_control::expo::EngineFigures::flavour(text);
        let _ = kvguard_control::procfs::parse_vmrss(text);
    }
    if let Ok(keys) = kvguard_control::config::parse_secret_file(data) {
        assert!(!keys.is_empty());
    }
}

// ---------------------------------------------------------------------------------------
// Filter: the whole per-VM engine, driven by a sequence of host callbacks.
// ---------------------------------------------------------------------------------------

/// A recording platform for the engine.
#[derive(Default)]
pub struct FakeHost {
    /// Host clock, ms.
    pub now: u64,
    /// Metric values.
    pub metrics: HashMap<usize, i64>,
    /// Calls dispatched: (token, body, signature header).
    pub calls: Vec<(u32, Vec<u8>, String)>,
    /// Refuse dispatches.
    pub refuse: bool,
    next_token: u32,
}

impl Clock for FakeHost {
    fn now_ms(&self) -> u64 {
        self.now
    }
    fn unix_secs(&self) -> u64 {
        1_800_000_000 + self.now / 1000
    }
}

impl Host for FakeHost {
    fn dispatch(&mut self, call: &Call<'_>) -> Result<u32, DispatchError> {
        if self.refuse {
            return Err(DispatchError::Other);
        }
        self.next_token += 1;
        let sig = call
            .headers
            .iter()
            .find(|(n, _)| *n == signature::SIGNATURE_HEADER)
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        self.calls.push((self.next_token, call.body.clone(), sig));
        Ok(self.next_token)
    }
    fn log(&mut self, _level: Level, msg: &str) {
        assert!(!msg.contains('\n'), "a log line holds a newline: {msg:?}");
    }
}

impl Metrics for FakeHost {
    fn add(&mut self, m: Metric, delta: i64) {
        *self.metrics.entry(m.index()).or_default() += delta;
    }
    fn record(&mut self, _m: Metric, _value: u64) {}
}

/// Target `filter_engine`: the per-VM engine fed any sequence of host callbacks.
/// Properties: no panic; the active-requests gauge equals the table size; pending aborts
/// stay within `max_pending_aborts`; every abort call is signed and its body parses; a
/// request whose body completed is never aborted; one decision per request; observe mode
/// sends nothing.
pub fn filter_engine(data: &[u8]) {
    let mut b = Bytes::new(data);
    let mode = b.byte();
    let observe = mode & 1 == 1;
    let cfg_json = format!(
        r#"{{"control_cluster":"kvguard_control","secret":"{}","mode":"{}","idle_timeout_ms":{},"first_token_timeout_ms":{},"max_age_ms":{},"tick_ms":10,"max_pending_aborts":4,"max_event_bytes":{},"abort_retries":2,"abort_timeout_ms":50,"control_target_cluster":"kvguard_target","control_target_cidrs":["127.0.0.0/8","10.0.0.0/8"]}}"#,
        core::str::from_utf8(KEY).unwrap(),
        if observe { "observe" } else { "enforce" },
        [0u64, 100, 1000][usize::from(mode >> 1) % 3],
        [0u64, 50][usize::from(mode >> 3) % 2],
        [0u64, 500, 5000][usize::from(mode >> 4) % 3],
        [256usize, 1024][usize::from(mode >> 6) % 2],
    );
    let cfg = Config::parse(cfg_json.as_bytes(), &|_| None).expect("fuzz base config");
    let max_pending = cfg.max_pending_aborts;
    let key = Key::try_new(KEY).unwrap();
    let mut eng = Engine::new(cfg, u64::from(mode));
    let mut host = FakeHost::default();
    let active = Metric::ActiveRequests.index();

    // Per stream context: the live request's id, whether its body completed, decisions.
    let mut live: HashMap<u32, (String, bool, u32)> = HashMap::new();
    let mut answered: HashSet<u32> = HashSet::new();
    let paths: [&[u8]; 4] = [
        b"/v1/chat/completions",
        b"/v1/completions",
        b"/healthz",
        b"/v1/responses?x",
    ];
    let cts: [Option<&[u8]>; 5] = [
        Some(b"text/event-stream"),
        Some(b"text/event-stream; charset=utf-8"),
        Some(b"application/x-ndjson"),
        Some(b"application/json"),
        None,
    ];
    let mut steps = 0;
    while !b.is_empty() && steps < 256 {
        steps += 1;
        let op = b.byte();
        let ctx = u32::from(b.byte() % 8) + 2;
        match op % 9 {
            0 => {
                let path = paths[usize::from(b.byte()) % paths.len()];
                let id_mode = b.byte();
                let id: Vec<u8> = match id_mode % 4 {
                    0 => format!("req-{ctx}-{steps}").into_bytes(),
                    1 => b.slice().to_vec(),
                    2 => b"dup-id".to_vec(),
                    _ => Vec::new(),
                };
                let idopt = if id_mode % 4 == 3 {
                    None
                } else {
                    Some(&id[..])
                };
                let v =
                    eng.on_request_headers(&mut host, ctx, Some(path), idopt, id_mode & 0x10 != 0);
                if v == Verdict::Tracked {
                    live.insert(ctx, (String::from_utf8(id).unwrap(), false, 0));
                } else if eng.request(ctx).is_none() {
                    live.remove(&ctx);
                }
            }
            1 => {
                let ct = cts[usize::from(b.byte()) % cts.len()];
                let enc_mode = b.byte();
                let enc: Option<&[u8]> = match enc_mode % 3 {
                    0 => None,
                    1 => Some(b"gzip"),
                    _ => Some(b"identity"),
                };
                let stamp_v: Option<Vec<u8>> = match (enc_mode >> 2) % 3 {
                    0 => None,
                    1 => Some(b.slice().to_vec()),
                    _ => live.get(&ctx).and_then(|(id, _, _)| {
                        let id = RequestId::try_new(id.as_bytes()).ok()?;
                        let a = SocketAddr::from(([127, 0, 0, 1], 9902));
                        Some(stamp::stamp(&key, a, &id, 1).into_bytes())
                    }),
                };
                let eos = enc_mode & 0x80 != 0;
                let _ = eng.on_response_headers(&mut host, ctx, ct, enc, stamp_v.as_deref(), eos);
            }
            2 => {
                let chunk = b.slice();
                let eos = b.byte() & 1 == 1;
                let r = eng.on_chunk(&mut host, ctx, chunk.len(), eos, || Some(chunk.to_vec()));
                if r == Some(OutcomeTag::Completed) {
                    if let Some(l) = live.get_mut(&ctx) {
                        l.1 = true;
                    }
                }
            }
            3 => {
                // Envoy's code details never hold whitespace (it writes `_` instead);
                // the engine logs them as they are.
                let owned: Vec<u8>;
                let details: &[u8] = match b.byte() % 6 {
                    0 => b"via_upstream",
                    1 => b"downstream_remote_disconnect",
                    2 => b"upstream_reset_after_response_started{remote_reset}",
                    3 => b"stream_idle_timeout",
                    4 => b"",
                    _ => {
                        owned = b
                            .slice()
                            .iter()
                            .copied()
                            .filter(u8::is_ascii_graphic)
                            .collect();
                        &owned
                    }
                };
                let flags = u64::from(b.u16()) << (b.byte() % 16);
                let tag = eng.on_log(&mut host, ctx, details, flags);
                if let Some((_, completed, decisions)) = live.remove(&ctx) {
                    if completed {
                        assert!(
                            !matches!(tag, Some(OutcomeTag::Aborted(_))),
                            "a completed request was aborted at its end: {tag:?}"
                        );
                    }
                    if decisions > 0 {
                        assert!(
                            matches!(tag, Some(OutcomeTag::Aborted(_) | OutcomeTag::Observed(_))),
                            "a decided request ended as {tag:?}"
                        );
                    }
                } else {
                    assert_eq!(tag, None, "an untracked context got an outcome");
                }
            }
            4 | 5 => {
                host.now += u64::from(b.byte()) * if op % 9 == 4 { 1 } else { 20 };
                for a in eng.tick(&mut host) {
                    let (Action::Close { ctx, tag } | Action::Mark { ctx, tag }) = a;
                    if observe {
                        assert!(
                            matches!(a, Action::Mark { .. }),
                            "observe mode closed a stream"
                        );
                    }
                    let l = live
                        .get_mut(&ctx)
                        .expect("an action for an unknown context");
                    assert!(!l.1, "a completed request was decided: {tag:?}");
                    l.2 += 1;
                    assert_eq!(l.2, 1, "two decisions for one request");
                }
            }
            6 => {
                let pending: Vec<u32> = host
                    .calls
                    .iter()
                    .map(|c| c.0)
                    .filter(|t| !answered.contains(t))
                    .collect();
                if let Some(&tok) = pending.get(usize::from(b.byte()) % pending.len().max(1)) {
                    let status = match b.byte() % 8 {
                        0 => Some(200),
                        1 => Some(404),
                        2 => Some(401),
                        3 => Some(409),
                        4 => Some(503),
                        5 => Some(429),
                        6 => None,
                        _ => Some(b.u16()),
                    };
                    let body = b.slice();
                    answered.insert(tok);
                    eng.on_abort_answer(&mut host, tok, status, body);
                } else {
                    // An answer nobody asked for.
                    eng.on_abort_answer(&mut host, u32::from(b.u16()) + 10_000, Some(200), b"");
                }
            }
            7 => {
                eng.forget(&mut host, ctx);
                live.remove(&ctx);
            }
            _ => {
                host.refuse = !host.refuse;
                eng.pump(&mut host);
            }
        }
        assert_eq!(
            host.metrics.get(&active).copied().unwrap_or(0),
            eng.tracked() as i64,
            "active-requests gauge drifted from the table"
        );
        assert!(
            eng.pending_aborts() <= max_pending,
            "abort queue over its bound"
        );
        if observe {
            assert!(host.calls.is_empty(), "observe mode sent an abort");
        }
    }
    for (_, body, sig) in &host.calls {
        let (req, _) = AbortRequest::parse(body).expect("abort body refused");
        assert!(AbortReason::ALL.contains(&req.reason));
        let now = host.unix_secs();
        // Signed at the time it was sent: within the run's clock span.
        let s = signature::parse(sig.as_bytes()).expect("abort call signature malformed");
        assert!(s.t <= now);
        assert!(signature::verify(
            Domain::Abort,
            std::slice::from_ref(&key),
            Some(sig.as_bytes()),
            body,
            s.t
        )
        .is_ok());
    }
}
