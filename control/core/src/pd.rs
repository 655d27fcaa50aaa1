//! Prefill/decode disaggregation (docs/PD-ENGINES.md, docs/DESIGN.md "P/D"): what
//! kvguard-control reads from a request's body and its prefill answer, and the table of
//! prefill hand-offs. The calls that release a hand-off's blocks are the shell's
//! (`kvguard_control::pd`).
//!
//! - A request whose body carries `kv_transfer_params` is a **leg** of a disaggregated
//!   request: `do_remote_decode` makes it the prefill leg, `do_remote_prefill` the decode
//!   leg ([`leg_of`]). An abort of such an id reaches every peer (the shell's `abort`).
//! - A prefill leg that finished (2xx) answered the `kv_transfer_params` the decode side
//!   reads its blocks with; the prefill engine holds those blocks until the decode side
//!   notifies it or its lease runs out (vLLM NixlConnector: `kv_lease_duration`, 30 s), and
//!   nothing on the prefill engine frees them. They are recorded in [`Handoffs`] for
//!   `--pd-kv-lease`. An abort of that id sends [`rejection_body`] to a decode engine
//!   (`--pd-decode-url`): the decode engine rejects it (vLLM: streaming beam search,
//!   refused in `_create_completion`, inside `_with_kv_transfer_rejection_cleanup`) and so
//!   tells the prefill engine to let the blocks go (vllm#41269).
//! - A decode leg whose id is tombstoned is not only refused: its transfer parameters go
//!   to the decode engine as [`rejection_body`] first, so that the prefill engine is told
//!   (the shell's `proxy`).
//! - SGLang takes its request id from the body's `rid` and ignores `x-request-id`: with
//!   `--abort-strategy sglang` the id is written into the body ([`inject_rid`]).

use kvguard_contract::RequestId;
use serde_json::{json, Value};
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Which leg of a disaggregated request a body asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PdLeg {
    /// `kv_transfer_params.do_remote_decode`: compute the prompt, hold its blocks for a
    /// remote decode.
    Prefill,
    /// `kv_transfer_params.do_remote_prefill`: read the prompt's blocks from a prefill
    /// engine, then generate.
    Decode,
}

impl PdLeg {
    /// `prefill` or `decode`.
    pub const fn as_str(self) -> &'static str {
        match self {
            PdLeg::Prefill => "prefill",
            PdLeg::Decode => "decode",
        }
    }
}

const PARAMS: &[u8] = b"kv_transfer_params";

fn parse_if_pd(body: &[u8]) -> Option<Value> {
    // Most bodies carry no transfer parameters: no JSON parse for them.
    if !body.windows(PARAMS.len()).any(|w| w == PARAMS) {
        return None;
    }
    serde_json::from_slice(body).ok()
}

fn flag(params: &Value, name: &str) -> bool {
    params.get(name).and_then(Value::as_bool).unwrap_or(false)
}

/// The leg a request body asks for, if it carries `kv_transfer_params`.
pub fn leg_of(body: &[u8]) -> Option<PdLeg> {
    let v = parse_if_pd(body)?;
    let p = v.get(std::str::from_utf8(PARAMS).ok()?)?;
    if flag(p, "do_remote_decode") {
        Some(PdLeg::Prefill)
    } else if flag(p, "do_remote_prefill") {
        Some(PdLeg::Decode)
    } else {
        None
    }
}

/// The `kv_transfer_params` object of a JSON body (a prefill answer, or a decode leg's
/// request), if it has one.
pub fn params_of(body: &[u8]) -> Option<Value> {
    let mut v = parse_if_pd(body)?;
    match v.get_mut("kv_transfer_params").map(Value::take) {
        Some(p @ Value::Object(_)) => Some(p),
        _ => None,
    }
}

/// The transfer parameters of a decode leg (`do_remote_prefill` set), if `body` is one.
pub fn remote_prefill_params(body: &[u8]) -> Option<Value> {
    params_of(body).filter(|p| flag(p, "do_remote_prefill"))
}

/// A completion request that a decode engine rejects before it schedules anything, and
/// that carries `params` (a prefill engine's answer): rejecting it, the decode engine
/// tells that prefill engine it is done with the blocks. vLLM 0.32 refuses streaming beam
/// search first thing in `_create_completion` (before the model check), inside
/// `_with_kv_transfer_rejection_cleanup`, which then calls
/// `notify_kv_transfer_request_rejected` (NixlConnector: an empty read and the
/// notification `"<remote_request_id>:<n>"`).
pub fn rejection_body(params: &Value) -> Vec<u8> {
    let mut params = params.clone();
    if let Some(p) = params.as_object_mut() {
        p.insert("do_remote_prefill".into(), Value::Bool(true));
        p.insert("do_remote_decode".into(), Value::Bool(false));
    }
    let body = json!({
        "prompt": "kvguard: release the prefill side's blocks",
        "max_tokens": 1,
        "stream": true,
        "use_beam_search": true,
        "kv_transfer_params": params,
    });
    serde_json::to_vec(&body).unwrap_or_default()
}

/// Whether a decode engine's answer to [`rejection_body`] is the rejection that releases
/// the prefill side: a 400 (vLLM's `ErrorResponse`, SGLang's and the suite simulator's
/// validation error). Anything else (an accepted request, a 5xx, a refusal by a proxy in
/// front) proves nothing.
pub fn is_rejection(status: u16) -> bool {
    status == 400
}

/// `body` with `"rid": id` added, for SGLang (which takes its request id from the body,
/// never from `x-request-id`, and aborts by it: `POST /abort_request {"rid"}`). `None`
/// when the body is not a JSON object, already has a `rid`, or makes several sequences
/// (a batch or `n > 1`, where SGLang wants one rid per sequence): then it is sent as it
/// is and only the closed connection ends it.
pub fn inject_rid(body: &[u8], id: &RequestId) -> Option<Vec<u8>> {
    let mut v: Value = serde_json::from_slice(body).ok()?;
    if crate::request::engine_sequences(body) != 1 {
        return None;
    }
    let o = v.as_object_mut()?;
    if o.contains_key("rid") {
        return None;
    }
    o.insert("rid".into(), Value::String(id.as_str().to_owned()));
    serde_json::to_vec(&v).ok()
}

/// One finished prefill whose blocks the prefill engine may still hold for a decode side.
#[derive(Debug, Clone)]
struct Handoff {
    params: Value,
    at: Instant,
    seq: u64,
}

/// Prefill hand-offs by request id, for `--pd-kv-lease` at most, bounded (the oldest
/// forgotten first). A hand-off the decode side pulled is not seen here (the read is
/// between the engines): it stays until the lease, so the table counts hand-offs that
/// may still hold blocks, an upper bound.
#[derive(Debug)]
pub struct Handoffs {
    by_id: HashMap<RequestId, Handoff>,
    order: VecDeque<(Instant, u64, RequestId)>,
    lease: Duration,
    max: usize,
    seq: u64,
    evicted: u64,
}

impl Handoffs {
    /// An empty table: entries live `lease`, at most `max` of them.
    pub fn new(lease: Duration, max: usize) -> Handoffs {
        Handoffs {
            by_id: HashMap::new(),
            order: VecDeque::new(),
            lease,
            max: max.max(1),
            seq: 0,
            evicted: 0,
        }
    }

    /// Records the hand-off of `id` at `now` (a newer one replaces an older one).
    pub fn insert(&mut self, id: RequestId, params: Value, now: Instant) {
        self.purge(now);
        self.seq += 1;
        let seq = self.seq;
        self.order.push_back((now, seq, id.clone()));
        self.by_id.insert(
            id,
            Handoff {
                params,
                at: now,
                seq,
            },
        );
        while self.by_id.len() > self.max {
            // Every live entry has its slot in `order`, so this finds one; never loop on.
            if self.pop_oldest().is_none() {
                break;
            }
            self.evicted += 1;
        }
    }

    /// Removes and returns the oldest live entry's id.
    fn pop_oldest(&mut self) -> Option<RequestId> {
        while let Some((_, seq, id)) = self.order.pop_front() {
            if self.by_id.get(&id).is_some_and(|h| h.seq == seq) {
                self.by_id.remove(&id);
                return Some(id);
            }
        }
        None
    }

    /// Takes the live hand-off of `id` (its transfer parameters), if any.
    pub fn take(&mut self, id: &RequestId, now: Instant) -> Option<Value> {
        self.purge(now);
        self.by_id.remove(id).map(|h| h.params)
    }

    /// Whether `id` has a live hand-off.
    pub fn holds(&mut self, id: &RequestId, now: Instant) -> bool {
        self.purge(now);
        self.by_id.contains_key(id)
    }

    /// Forgets the hand-offs whose lease ran out (the prefill engine let go by itself).
    pub fn purge(&mut self, now: Instant) {
        while let Some((at, seq, id)) = self.order.front() {
            let live = self.by_id.get(id).is_some_and(|h| h.seq == *seq);
            if live && now.saturating_duration_since(*at) < self.lease {
                return;
            }
            if live {
                self.by_id.remove(id);
            }
            self.order.pop_front();
        }
    }

    /// Live hand-offs.
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Whether none is live.
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// Age of the oldest live hand-off (zero when none).
    pub fn oldest_age(&self, now: Instant) -> Duration {
        self.order
            .iter()
            .find(|(_, seq, id)| self.by_id.get(id).is_some_and(|h| h.seq == *seq))
            .map(|(at, _, _)| now.saturating_duration_since(*at))
            .unwrap_or_default()
    }

    /// Entries forgotten early because the table was full.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    /// When `id`'s hand-off was recorded (tests).
    pub fn recorded_at(&self, id: &RequestId) -> Option<Instant> {
        self.by_id.get(id).map(|h| h.at)
    }
}

/// What happened to a hand-off's blocks when its id was aborted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// A decode engine rejected the request carrying its parameters: the prefill engine
    /// was told to let go.
    Released,
    /// `--dry-run`: found, nothing sent.
    DryRun,
    /// Not released (no `--pd-decode-url`, or the decode side did not reject it): held
    /// until the prefill engine's lease.
    HeldUntilLease,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> RequestId {
        RequestId::try_new(s.as_bytes()).unwrap()
    }

    #[test]
    fn legs_from_bodies() {
        assert_eq!(leg_of(br#"{"prompt":"x"}"#), None);
        assert_eq!(
            leg_of(br#"{"prompt":"x","kv_transfer_params":{"do_remote_decode":true}}"#),
            Some(PdLeg::Prefill)
        );
        assert_eq!(
            leg_of(
                br#"{"kv_transfer_params":{"do_remote_decode":false,"do_remote_prefill":true}}"#
            ),
            Some(PdLeg::Decode)
        );
        assert_eq!(leg_of(br#"{"kv_transfer_params":{}}"#), None);
        assert_eq!(leg_of(br#"{"kv_transfer_params":null}"#), None);
        assert_eq!(leg_of(b"kv_transfer_params but not JSON"), None);
        assert_eq!(PdLeg::Prefill.as_str(), "prefill");
        assert_eq!(PdLeg::Decode.as_str(), "decode");
    }

    #[test]
    fn params_and_the_rejection() {
        let answer = br#"{"id":"cmpl-1","kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_request_id":"cmpl-r-0-ab","remote_port":5600}}"#;
        let p = params_of(answer).unwrap();
        assert_eq!(p["remote_request_id"], "cmpl-r-0-ab");
        assert_eq!(remote_prefill_params(answer), Some(p.clone()));
        assert_eq!(params_of(br#"{"kv_transfer_params":null}"#), None);
        assert_eq!(params_of(br#"{"choices":[]}"#), None);
        assert_eq!(
            remote_prefill_params(br#"{"kv_transfer_params":{"do_remote_decode":true}}"#),
            None
        );
        let r: Value = serde_json::from_slice(&rejection_body(&json!({
            "remote_request_id": "cmpl-r-0-ab",
            "do_remote_prefill": false,
            "do_remote_decode": true
        })))
        .unwrap();
        assert_eq!(r["stream"], true);
        assert_eq!(r["use_beam_search"], true);
        assert_eq!(r["max_tokens"], 1);
        assert_eq!(r["kv_transfer_params"]["remote_request_id"], "cmpl-r-0-ab");
        assert_eq!(r["kv_transfer_params"]["do_remote_prefill"], true);
        assert_eq!(r["kv_transfer_params"]["do_remote_decode"], false);
        assert!(is_rejection(400));
        for s in [200, 409, 404, 500, 502] {
            assert!(!is_rejection(s), "{s}");
        }
    }

    #[test]
    fn rid_is_injected_once_for_one_sequence() {
        let r = id("req-1");
        let out: Value =
            serde_json::from_slice(&inject_rid(br#"{"text":"hi","stream":true}"#, &r).unwrap())
                .unwrap();
        assert_eq!(out["rid"], "req-1");
        assert_eq!(out["text"], "hi");
        assert_eq!(inject_rid(br#"{"text":"hi","rid":"theirs"}"#, &r), None);
        assert_eq!(inject_rid(br#"{"prompt":["a","b"]}"#, &r), None);
        assert_eq!(inject_rid(br#"{"prompt":"a","n":2}"#, &r), None);
        assert_eq!(inject_rid(b"[1,2]", &r), None);
        assert_eq!(inject_rid(b"not json", &r), None);
    }

    #[test]
    fn handoffs_live_for_the_lease_bounded_oldest_first() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut h = Handoffs::new(ms(1000), 2);
        assert!(h.is_empty());
        assert_eq!(h.evicted(), 0);
        assert_eq!(h.oldest_age(t0), Duration::ZERO);
        h.insert(id("a"), json!({"n": 1}), t0);
        h.insert(id("b"), json!({"n": 2}), t0 + ms(100));
        assert_eq!(h.len(), 2);
        assert!(!h.is_empty());
        assert_eq!(h.oldest_age(t0 + ms(400)), ms(400));
        assert_eq!(h.recorded_at(&id("a")), Some(t0));
        // A third evicts the oldest.
        h.insert(id("c"), json!({"n": 3}), t0 + ms(200));
        assert_eq!((h.len(), h.evicted()), (2, 1));
        assert!(!h.holds(&id("a"), t0 + ms(200)));
        assert_eq!(h.oldest_age(t0 + ms(300)), ms(200));
        // Taken once.
        assert_eq!(h.take(&id("b"), t0 + ms(300)), Some(json!({"n": 2})));
        assert_eq!(h.take(&id("b"), t0 + ms(300)), None);
        assert_eq!(h.oldest_age(t0 + ms(300)), ms(100));
        // Re-recorded: the newer one counts, the older one's slot is stale.
        h.insert(id("c"), json!({"n": 4}), t0 + ms(900));
        assert!(
            h.holds(&id("c"), t0 + ms(1100)),
            "the lease runs from the newer record"
        );
        assert_eq!(h.oldest_age(t0 + ms(1100)), ms(200));
        // At the lease it is gone.
        assert!(h.holds(&id("c"), t0 + ms(1899)));
        assert!(!h.holds(&id("c"), t0 + ms(1900)));
        assert!(h.is_empty());
        assert_eq!(h.evicted(), 1);
    }
}
