//! The run: phases of arrivals, one request kind each, every phase followed by a quiet
//! checkpoint; a sampler reading the engine's metrics throughout.
//!
//! Attribution comes from the structure, not from guesses: inside a phase the only
//! requests this run abandons are of the phase's kind, and at every sample leakcheck knows
//! how many of its clients are still connected (`live`). The engine's running + waiting
//! beyond `live` is work for clients that have gone — orphans — as long as nothing else
//! uses the engine (checked: more than this run could account for is reported as other
//! traffic, and makes the result inconclusive).

use crate::cli::{Args, Gpu};
use crate::engine::{self, Scrape};
use crate::preflight::{self, Ready};
use kvguard_control::gpu::{GpuProbe, NvmlProbe};
use kvguard_loadgen::client;
use kvguard_loadgen::load::Rng;
use serde::Serialize;
use serde_json::Value;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How the client of an abandoned request leaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// A stream whose client disconnects after a few events.
    StreamingDropped,
    /// A stream whose client never reads, holds its socket open for a while, then closes it.
    StreamingSilent,
    /// A non-streaming request whose client closes the connection before the answer.
    NonStreamingDropped,
    /// A stream whose client leaves before the first token (with prefill/decode
    /// disaggregation: during the prefill or the hand-off to the decode side).
    StreamingEarly,
}

impl Kind {
    /// Label in the text report.
    pub fn label(self) -> &'static str {
        match self {
            Kind::StreamingDropped => "streaming, dropped",
            Kind::StreamingSilent => "streaming, silent",
            Kind::NonStreamingDropped => "non-streaming, dropped",
            Kind::StreamingEarly => "streaming, left before the first token",
        }
    }
}

/// One reading of the engine, with what this run had in flight at that moment.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Sample {
    /// Seconds since the run started.
    pub t: f64,
    /// The phase running (index into the phases), if any.
    pub phase: Option<usize>,
    /// The engine's figures.
    #[serde(flatten)]
    pub engine: Scrape,
    /// This run's clients still connected.
    pub live: usize,
    /// This run's clients that left since the last quiet checkpoint.
    pub abandoned_open: usize,
    /// P/D: the prefill engine's figures at the same time (`--prefill-metrics`); `None`
    /// without it, or when that read failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill: Option<Scrape>,
}

impl Sample {
    /// Engine work beyond this run's connected clients (0 if none).
    pub fn orphans(&self) -> f64 {
        (self.engine.in_engine() - self.live as f64).max(0.0)
    }
}

/// The engine's state at a quiet checkpoint (nothing running or waiting, no client of
/// this run connected, for a settle time).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Checkpoint {
    /// When (s since the start).
    pub t: f64,
    /// After which phase (`None`: the baseline, before any load).
    pub after_phase: Option<usize>,
    /// KV usage.
    pub kv: Option<f64>,
    /// The metrics process's resident memory (bytes).
    pub rss_bytes: Option<f64>,
    /// GPU memory used on this host (NVML, bytes, all devices).
    pub gpu_used_bytes: Option<f64>,
    /// P/D: the prefill engine's KV usage (it too had nothing running or waiting).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_kv: Option<f64>,
}

/// One phase.
#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    /// Index.
    pub index: usize,
    /// The kind of abandoned request it sends.
    pub kind: Kind,
    /// Round (0-based).
    pub round: u32,
    /// Arrivals began (s).
    pub start_s: f64,
    /// Every client of the phase had finished or left (s).
    pub clients_done_s: f64,
    /// The engine was quiet (s); `None`: not within --quiet-timeout.
    pub quiet_s: Option<f64>,
    /// Arrivals skipped because --max-in-flight was reached.
    pub skipped: usize,
}

/// What happened to a request, as its client saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Read to the end.
    Completed,
    /// Its client left on purpose.
    Abandoned,
    /// Meant to be abandoned, but the answer came first.
    FinishedBeforeLeaving,
    /// Failed (status, reset, timeout).
    Error,
}

/// One request.
#[derive(Debug, Clone, Serialize)]
pub struct RequestRecord {
    /// Phase index.
    pub phase: usize,
    /// The phase's kind.
    pub kind: Kind,
    /// Planned to be abandoned.
    pub abandon: bool,
    /// Sent (s).
    pub sent_s: f64,
    /// First data event (streams), s.
    pub first_event_s: Option<f64>,
    /// Its client left (s).
    pub gone_s: Option<f64>,
    /// Finished, left or failed (s).
    pub ended_s: f64,
    /// Data events read.
    pub events: u64,
    /// A dropped stream: leave after this many events.
    pub drop_after_events: Option<u64>,
    /// Silent / non-streaming: leave after this long (s).
    pub leave_after_s: Option<f64>,
    /// Outcome.
    pub outcome: Outcome,
    /// Response status, when one came.
    pub status: Option<u16>,
    /// Error text.
    pub error: Option<String>,
}

/// Everything the run recorded.
#[derive(Debug, Clone, Serialize)]
pub struct RunData {
    /// The checkpoint before any load; `None`: the engine never went quiet.
    pub baseline: Option<Checkpoint>,
    /// Checkpoints after each phase.
    pub checkpoints: Vec<Checkpoint>,
    /// The phases.
    pub phases: Vec<Phase>,
    /// The samples.
    pub samples: Vec<Sample>,
    /// Every request.
    pub requests: Vec<RequestRecord>,
    /// Why the run stopped before its end, if it did.
    pub stopped: Option<String>,
    /// Peak KV usage seen.
    pub kv_peak: Option<f64>,
    /// Failed metric reads.
    pub scrape_failures: usize,
    /// Whether GPU memory was read, or why not.
    pub gpu: String,
    /// Wall time (s).
    pub wall_s: f64,
    /// P/D: the prefill engine was read too (`--prefill-metrics`).
    pub prefill: bool,
}

struct Shared {
    t0: Instant,
    live: AtomicUsize,
    abandoned_open: AtomicUsize,
    phase: Mutex<Option<usize>>,
    stop: AtomicBool,
    stop_reason: Mutex<Option<String>>,
}

impl Shared {
    fn now(&self) -> f64 {
        self.t0.elapsed().as_secs_f64()
    }
    fn stop(&self, why: String) {
        if let Ok(mut r) = self.stop_reason.lock() {
            r.get_or_insert(why);
        }
        self.stop.store(true, Ordering::SeqCst);
    }
    fn phase(&self) -> Option<usize> {
        self.phase.lock().map(|p| *p).unwrap_or(None)
    }
    fn set_phase(&self, p: Option<usize>) {
        if let Ok(mut g) = self.phase.lock() {
            *g = p;
        }
    }
}

/// Counts a client as connected until it finishes or leaves.
struct LiveGuard {
    sh: Arc<Shared>,
    counted: bool,
}

impl LiveGuard {
    fn enter(sh: &Arc<Shared>) -> LiveGuard {
        sh.live.fetch_add(1, Ordering::SeqCst);
        LiveGuard {
            sh: sh.clone(),
            counted: true,
        }
    }
    /// The client leaves on purpose: no longer connected, and one more orphan candidate.
    fn abandon(&mut self) -> f64 {
        self.sh.abandoned_open.fetch_add(1, Ordering::SeqCst);
        self.release();
        self.sh.now()
    }
    fn release(&mut self) {
        if self.counted {
            self.counted = false;
            self.sh.live.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.release();
    }
}

struct Ctx {
    sh: Arc<Shared>,
    ready: Ready,
    args: Args,
    extra: Value,
}

impl Ctx {
    fn headers(&self, with_host: bool) -> Vec<(String, String)> {
        let mut h: Vec<(String, String)> = self
            .args
            .headers
            .iter()
            .filter(|(k, _)| k != "host")
            .cloned()
            .collect();
        if with_host {
            h.push(("host".into(), self.ready.target.authority.clone()));
        }
        h
    }
    fn body(&self, stream: bool, n: usize) -> Value {
        preflight::body(
            self.args.api,
            &self.ready.model,
            stream,
            self.args.max_tokens,
            &format!(
                "kvguard-leakcheck request {n} (seed {}): tell a long story.",
                self.args.seed
            ),
            &self.extra,
        )
    }
}

fn refs(h: &[(String, String)]) -> Vec<(&str, &str)> {
    h.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

async fn streaming(ctx: Arc<Ctx>, mut rec: RequestRecord, n: usize) -> RequestRecord {
    let mut guard = LiveGuard::enter(&ctx.sh);
    let h = ctx.headers(true);
    let deadline = tokio::time::Instant::now() + ctx.args.request_timeout;
    match client::stream_sse(
        ctx.ready.target.addr,
        &ctx.ready.path,
        &ctx.body(true, n),
        &refs(&h),
        false,
    )
    .await
    {
        Err(e) => {
            rec.outcome = Outcome::Error;
            rec.error = Some(format!("{e:#}"));
        }
        Ok(mut s) => {
            rec.status = Some(s.status);
            if s.status != 200 {
                let b = s
                    .collect_bytes(Duration::from_secs(2))
                    .await
                    .unwrap_or_default();
                rec.outcome = Outcome::Error;
                rec.error = Some(format!(
                    "status {}: {}",
                    s.status,
                    engine::snippet(&String::from_utf8_lossy(&b))
                ));
            } else {
                loop {
                    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                    match s.next_data(left).await {
                        Ok(Some(ev)) if ev.is_done() => {
                            rec.outcome = if rec.abandon {
                                Outcome::FinishedBeforeLeaving
                            } else {
                                Outcome::Completed
                            };
                            break;
                        }
                        Ok(Some(_)) => {
                            rec.events += 1;
                            rec.first_event_s.get_or_insert_with(|| ctx.sh.now());
                            if rec.drop_after_events.is_some_and(|k| rec.events >= k) {
                                rec.gone_s = Some(guard.abandon());
                                s.disconnect();
                                rec.outcome = Outcome::Abandoned;
                                break;
                            }
                        }
                        Ok(None) => {
                            rec.outcome = Outcome::Error;
                            rec.error = Some("the stream ended without data: [DONE]".into());
                            break;
                        }
                        Err(e) => {
                            rec.outcome = Outcome::Error;
                            rec.error = Some(format!("{e:#}"));
                            break;
                        }
                    }
                }
            }
        }
    }
    drop(guard);
    rec.ended_s = ctx.sh.now();
    rec
}

/// A silent stream (`silent`) or a non-streaming request that leaves after
/// `leave_after_s`, on a raw socket.
async fn leave_later(
    ctx: Arc<Ctx>,
    mut rec: RequestRecord,
    n: usize,
    silent: bool,
) -> RequestRecord {
    let mut guard = LiveGuard::enter(&ctx.sh);
    let h = ctx.headers(false);
    let wait = Duration::from_secs_f64(rec.leave_after_s.unwrap_or(1.0));
    // A silent client: a small receive buffer, so the server side is back-pressured.
    let buf = if silent { 4096 } else { 1 << 20 };
    match client::silent_client(
        ctx.ready.target.addr,
        &ctx.ready.path,
        &ctx.body(silent, n),
        &refs(&h),
        buf,
        false,
    )
    .await
    {
        Err(e) => {
            rec.outcome = Outcome::Error;
            rec.error = Some(format!("{e:#}"));
        }
        Ok(mut c) => {
            let until = tokio::time::Instant::now() + wait;
            rec.outcome = Outcome::Abandoned;
            if silent {
                tokio::time::sleep_until(until).await;
            } else {
                // Leave at `until`, unless the whole answer came first.
                loop {
                    let left = until.saturating_duration_since(tokio::time::Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    match c.read_some(left).await {
                        Ok(0) => {
                            rec.outcome = Outcome::Error;
                            rec.error =
                                Some("the target closed the connection before answering".into());
                            break;
                        }
                        Ok(_) => {
                            if c.head().is_some() {
                                rec.status = c.status();
                                rec.outcome = if rec.status == Some(200) {
                                    Outcome::FinishedBeforeLeaving
                                } else {
                                    rec.error = Some(format!("status {:?}", rec.status));
                                    Outcome::Error
                                };
                                break;
                            }
                        }
                        // The wait ran out (nothing to read): time to leave.
                        Err(_) if tokio::time::Instant::now() >= until => break,
                        Err(e) => {
                            rec.outcome = Outcome::Error;
                            rec.error = Some(format!("{e:#}"));
                            break;
                        }
                    }
                }
            }
            if rec.outcome == Outcome::Abandoned {
                rec.gone_s = Some(guard.abandon());
            }
            c.close();
        }
    }
    drop(guard);
    rec.ended_s = ctx.sh.now();
    rec
}

async fn complete_nonstream(ctx: Arc<Ctx>, mut rec: RequestRecord, n: usize) -> RequestRecord {
    let guard = LiveGuard::enter(&ctx.sh);
    let h = ctx.headers(true);
    let body = serde_json::to_vec(&ctx.body(false, n)).unwrap_or_default();
    match client::request(
        ctx.ready.target.addr,
        hyper::Method::POST,
        &ctx.ready.path,
        &refs(&h),
        body,
        false,
        ctx.args.request_timeout,
    )
    .await
    {
        Ok(r) if r.status == 200 => {
            rec.status = Some(200);
            rec.outcome = Outcome::Completed;
        }
        Ok(r) => {
            rec.status = Some(r.status);
            rec.outcome = Outcome::Error;
            rec.error = Some(format!(
                "status {}: {}",
                r.status,
                engine::snippet(&r.text())
            ));
        }
        Err(e) => {
            rec.outcome = Outcome::Error;
            rec.error = Some(format!("{e:#}"));
        }
    }
    drop(guard);
    rec.ended_s = ctx.sh.now();
    rec
}

async fn sampler(
    sh: Arc<Shared>,
    ready: Ready,
    args: Args,
    out: Arc<Mutex<Vec<Sample>>>,
    tx: watch::Sender<Option<Sample>>,
    failures: Arc<AtomicUsize>,
) {
    let interval = args.sample_interval;
    let timeout = (interval * 4).clamp(Duration::from_secs(1), Duration::from_secs(5));
    let max_misses =
        ((Duration::from_secs(10).as_secs_f64() / interval.as_secs_f64()).ceil() as usize).max(3);
    let mut misses = 0usize;
    let mut prefill_misses = 0usize;
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        // Read the run's counters before the scrape: a client counted as connected here
        // has not left yet (orphans are never over-counted by the race).
        let live = sh.live.load(Ordering::SeqCst);
        let open = sh.abandoned_open.load(Ordering::SeqCst);
        let prefill_read = async {
            match &ready.prefill {
                Some(p) => Some(engine::scrape(&p.metrics, timeout).await),
                None => None,
            }
        };
        let (decode, prefill) = tokio::join!(engine::scrape(&ready.metrics, timeout), prefill_read);
        let prefill = match prefill {
            None => None,
            Some(Ok((p, _))) => {
                prefill_misses = 0;
                Some(p)
            }
            Some(Err(e)) => {
                prefill_misses += 1;
                failures.fetch_add(1, Ordering::SeqCst);
                if prefill_misses >= max_misses {
                    sh.stop(format!(
                        "the prefill engine's metrics stopped answering: {e:#}"
                    ));
                    let _ = tx.send(None);
                }
                None
            }
        };
        match decode {
            Ok((e, _)) => {
                misses = 0;
                // ... and after it: a client that arrived during the scrape may be in the
                // engine's figures. The larger of the two never over-counts orphans.
                let s = Sample {
                    t: sh.now(),
                    phase: sh.phase(),
                    engine: e,
                    live: live.max(sh.live.load(Ordering::SeqCst)),
                    abandoned_open: open.max(sh.abandoned_open.load(Ordering::SeqCst)),
                    prefill,
                };
                for (which, kv) in [
                    ("", e.kv),
                    ("the prefill engine's ", prefill.and_then(|p| p.kv)),
                ] {
                    if let Some(kv) = kv {
                        if kv >= args.kv_stop && !sh.stop.load(Ordering::SeqCst) {
                            sh.stop(format!(
                                "{which}KV usage reached {:.0} % (--kv-stop {:.0} %) at {:.1} s: stopped sending",
                                kv * 100.0,
                                args.kv_stop * 100.0,
                                s.t
                            ));
                        }
                    }
                }
                if let Ok(mut o) = out.lock() {
                    o.push(s);
                }
                let _ = tx.send(Some(s));
            }
            Err(e) => {
                misses += 1;
                failures.fetch_add(1, Ordering::SeqCst);
                if misses >= max_misses {
                    sh.stop(format!("the engine's metrics stopped answering: {e:#}"));
                    let _ = tx.send(None);
                }
            }
        }
    }
}

/// KV usage above the prefill engine's baseline that counts as blocks held: half a block
/// when its pool size is known, else any rise (vLLM's usage is exactly its baseline when
/// nothing is allocated: cached blocks nobody references count as free).
pub fn held_epsilon(num_blocks: Option<f64>) -> f64 {
    num_blocks.map_or(1e-6, |n| 0.5 / n)
}

/// Whether `s` is quiet: nothing running or waiting, no client of this run connected;
/// with a prefill engine (`prefill_kv_limit`), nothing running or waiting there either and
/// its KV usage at most the limit (its held blocks returned).
pub fn is_quiet(s: &Sample, prefill_kv_limit: Option<f64>) -> bool {
    let prefill_quiet = match prefill_kv_limit {
        None => true,
        Some(limit) => s
            .prefill
            .is_some_and(|p| p.in_engine() == 0.0 && p.kv.is_some_and(|kv| kv <= limit)),
    };
    s.engine.in_engine() == 0.0 && s.live == 0 && prefill_quiet
}

/// Waits for `need` consecutive quiet samples ([`is_quiet`]); returns the first and the
/// last of them, or `None` at `timeout`.
async fn wait_quiet(
    rx: &mut watch::Receiver<Option<Sample>>,
    need: usize,
    timeout: Duration,
    prefill_kv_limit: Option<f64>,
) -> Option<(Sample, Sample)> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut first: Option<Sample> = None;
    let mut count = 0usize;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            return None;
        }
        match tokio::time::timeout(left, rx.changed()).await {
            Ok(Ok(())) => {}
            _ => return None,
        }
        let s = (*rx.borrow_and_update())?;
        if is_quiet(&s, prefill_kv_limit) {
            count += 1;
            let f = *first.get_or_insert(s);
            if count >= need {
                return Some((f, s));
            }
        } else {
            first = None;
            count = 0;
        }
    }
}

async fn gpu_used(probe: &Option<Arc<NvmlProbe>>) -> Option<f64> {
    let p = probe.clone()?;
    let r = tokio::time::timeout(
        Duration::from_secs(5),
        tokio::task::spawn_blocking(move || p.sample()),
    )
    .await;
    match r {
        Ok(Ok(Ok(snap))) => Some(snap.devices.iter().map(|d| d.used_bytes as f64).sum()),
        _ => None,
    }
}

/// The phases in order: for each round, each kind the shares ask for, with its arrival time.
pub fn plan_phases(args: &Args) -> Vec<(Kind, u32, Duration)> {
    let mut kinds: Vec<(Kind, f64)> = Vec::new();
    let stream_time = 1.0 - args.non_streaming_share;
    let early = args.early_share();
    let n_stream = usize::from(args.disconnect_share > 0.0)
        + usize::from(args.silent_share > 0.0)
        + usize::from(early > 0.0);
    if stream_time > 0.0 && n_stream > 0 {
        if args.disconnect_share > 0.0 {
            kinds.push((Kind::StreamingDropped, stream_time / n_stream as f64));
        }
        if args.silent_share > 0.0 {
            kinds.push((Kind::StreamingSilent, stream_time / n_stream as f64));
        }
        if early > 0.0 {
            kinds.push((Kind::StreamingEarly, stream_time / n_stream as f64));
        }
    }
    if args.non_streaming_share > 0.0 && args.disconnect_share > 0.0 {
        kinds.push((Kind::NonStreamingDropped, args.non_streaming_share));
    }
    let total: f64 = kinds.iter().map(|(_, w)| w).sum();
    let mut out = Vec::new();
    if total <= 0.0 {
        return out;
    }
    let per_round = args.duration.as_secs_f64() / f64::from(args.rounds);
    for round in 0..args.rounds {
        for (k, w) in &kinds {
            out.push((*k, round, Duration::from_secs_f64(per_round * w / total)));
        }
    }
    out
}

/// Runs the whole check after the preflight.
pub async fn run(args: &Args, ready: &Ready) -> RunData {
    let sh = Arc::new(Shared {
        t0: Instant::now(),
        live: AtomicUsize::new(0),
        abandoned_open: AtomicUsize::new(0),
        phase: Mutex::new(None),
        stop: AtomicBool::new(false),
        stop_reason: Mutex::new(None),
    });
    let (probe, gpu) = match args.gpu {
        Gpu::Off => (None, "off (--gpu off)".to_string()),
        Gpu::Auto => match tokio::task::spawn_blocking(NvmlProbe::init).await {
            Ok(Ok(p)) => (Some(Arc::new(p)), "NVML on this host".to_string()),
            Ok(Err(e)) => (None, format!("not read: {e}")),
            Err(e) => (None, format!("not read: {e}")),
        },
    };
    let samples = Arc::new(Mutex::new(Vec::new()));
    let failures = Arc::new(AtomicUsize::new(0));
    let (tx, mut rx) = watch::channel(None);
    let sampler_task = tokio::spawn(sampler(
        sh.clone(),
        ready.clone(),
        args.clone(),
        samples.clone(),
        tx,
        failures.clone(),
    ));
    let need = ((1.0 / args.sample_interval.as_secs_f64()).ceil() as usize).max(2);
    let extra = args
        .extra_body
        .as_deref()
        .and_then(|e| serde_json::from_str(e).ok())
        .unwrap_or(Value::Null);
    let ctx = Arc::new(Ctx {
        sh: sh.clone(),
        ready: ready.clone(),
        args: args.clone(),
        extra,
    });
    let mut checkpoints = Vec::new();
    let mut phases = Vec::new();
    let mut requests = Vec::new();
    let mut rng = Rng::new(args.seed);
    let natural = ready.natural_estimate_s(args.max_tokens).clamp(0.5, 600.0);

    // The baseline asks the prefill engine only to run nothing: what it holds then is its
    // baseline (the blocks of someone else's abandoned prefills return at their lease).
    let idle_only = ready.prefill.as_ref().map(|_| f64::INFINITY);
    let baseline = match wait_quiet(&mut rx, need, args.quiet_timeout, idle_only).await {
        Some((_, s)) => Some(Checkpoint {
            t: s.t,
            after_phase: None,
            kv: s.engine.kv,
            rss_bytes: s.engine.rss_bytes,
            gpu_used_bytes: gpu_used(&probe).await,
            prefill_kv: s.prefill.and_then(|p| p.kv),
        }),
        None => {
            sh.stop(format!(
                "the engine was never quiet (nothing running or waiting) within --quiet-timeout {:?} before the run: other traffic uses it; run leakcheck against a dedicated replica",
                args.quiet_timeout
            ));
            None
        }
    };
    // After a phase, the prefill engine's KV must be back at its baseline: its held blocks
    // returned (read by the decode side, or their lease ran out).
    let prefill_limit = ready
        .prefill
        .as_ref()
        .map(|p| baseline.and_then(|b| b.prefill_kv).unwrap_or(0.0) + held_epsilon(p.num_blocks));
    let mut n = 0usize;
    for (index, (kind, round, arrival)) in plan_phases(args).into_iter().enumerate() {
        if sh.stop.load(Ordering::SeqCst) {
            break;
        }
        sh.set_phase(Some(index));
        let start_s = sh.now();
        let gap = Duration::from_secs_f64(1.0 / args.rate);
        let end = tokio::time::Instant::now() + arrival;
        let mut next = tokio::time::Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        let mut skipped = 0usize;
        while next < end && !sh.stop.load(Ordering::SeqCst) {
            tokio::time::sleep_until(next).await;
            next += gap;
            if sh.stop.load(Ordering::SeqCst) {
                break;
            }
            if sh.live.load(Ordering::SeqCst) >= args.max_in_flight {
                skipped += 1;
                continue;
            }
            let share = match kind {
                Kind::StreamingSilent => args.silent_share,
                Kind::StreamingEarly => args.early_share(),
                _ => args.disconnect_share,
            };
            let abandon = rng.unit() < share;
            let before = match kind {
                // Before the first token: a share of the probe's time to it.
                Kind::StreamingEarly => ready.probe_ttft_s,
                _ => natural,
            };
            let leave_after = before * (0.1 + 0.3 * rng.unit());
            let drop_after = 1 + rng.below(u64::from(args.max_tokens / 2).max(1));
            n += 1;
            let rec = RequestRecord {
                phase: index,
                kind,
                abandon,
                sent_s: sh.now(),
                first_event_s: None,
                gone_s: None,
                ended_s: 0.0,
                events: 0,
                drop_after_events: (abandon && kind == Kind::StreamingDropped)
                    .then_some(drop_after),
                leave_after_s: (abandon && kind != Kind::StreamingDropped).then_some(leave_after),
                outcome: Outcome::Error,
                status: None,
                error: None,
            };
            let c = ctx.clone();
            match (kind, abandon) {
                (Kind::NonStreamingDropped, false) => tasks.spawn(complete_nonstream(c, rec, n)),
                (Kind::NonStreamingDropped, true) => tasks.spawn(leave_later(c, rec, n, false)),
                (Kind::StreamingSilent | Kind::StreamingEarly, true) => {
                    tasks.spawn(leave_later(c, rec, n, true))
                }
                _ => tasks.spawn(streaming(c, rec, n)),
            };
        }
        while let Some(r) = tasks.join_next().await {
            if let Ok(r) = r {
                requests.push(r);
            }
        }
        let clients_done_s = sh.now();
        let quiet = wait_quiet(&mut rx, need, args.quiet_timeout, prefill_limit).await;
        let quiet_s = quiet.map(|(f, _)| f.t);
        if let Some((_, last)) = quiet {
            checkpoints.push(Checkpoint {
                t: last.t,
                after_phase: Some(index),
                kv: last.engine.kv,
                rss_bytes: last.engine.rss_bytes,
                gpu_used_bytes: gpu_used(&probe).await,
                prefill_kv: last.prefill.and_then(|p| p.kv),
            });
            sh.abandoned_open.store(0, Ordering::SeqCst);
        } else {
            let last = *rx.borrow();
            let held = last
                .and_then(|s| s.prefill)
                .filter(|p| p.in_engine() == 0.0)
                .and_then(|p| p.kv)
                .filter(|kv| prefill_limit.is_some_and(|l| *kv > l));
            sh.stop(match held {
                Some(kv) => format!(
                    "no quiet checkpoint within --quiet-timeout {:?} after phase {index} ({}): the prefill engine still held {:.1} % of its KV with nothing running there",
                    args.quiet_timeout,
                    kind.label(),
                    100.0 * kv
                ),
                None => format!(
                    "no quiet checkpoint within --quiet-timeout {:?} after phase {index} ({}): the engine kept running or queueing requests with every client of this run gone",
                    args.quiet_timeout,
                    kind.label()
                ),
            });
        }
        phases.push(Phase {
            index,
            kind,
            round,
            start_s,
            clients_done_s,
            quiet_s,
            skipped,
        });
    }
    sh.set_phase(None);
    sampler_task.abort();
    let samples = samples.lock().map(|s| s.clone()).unwrap_or_default();
    let kv_peak = samples
        .iter()
        .filter_map(|s| s.engine.kv)
        .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))));
    RunData {
        baseline,
        checkpoints,
        phases,
        samples,
        requests,
        stopped: sh.stop_reason.lock().ok().and_then(|r| r.clone()),
        kv_peak,
        scrape_failures: failures.load(Ordering::SeqCst),
        gpu,
        wall_s: sh.now(),
        prefill: ready.prefill.is_some(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn quiet_with_a_prefill_engine_needs_its_held_blocks_back() {
        let idle = Scrape {
            kv: Some(0.0),
            ..Scrape::default()
        };
        let mut s = Sample {
            prefill: Some(idle),
            ..Sample::default()
        };
        assert!(is_quiet(&s, None));
        assert!(is_quiet(&s, Some(0.001)));
        // Blocks held for a decode side, nothing running: quiet for the baseline only.
        s.prefill = Some(Scrape {
            kv: Some(0.01),
            ..idle
        });
        assert!(!is_quiet(&s, Some(0.001)));
        assert!(is_quiet(&s, Some(f64::INFINITY)));
        // A prefill running, or no reading of the prefill engine: not quiet.
        s.prefill = Some(Scrape {
            running: 1.0,
            ..idle
        });
        assert!(!is_quiet(&s, Some(f64::INFINITY)));
        s.prefill = None;
        assert!(!is_quiet(&s, Some(f64::INFINITY)));
        // The decode engine, or a client still connected: not quiet.
        s.prefill = Some(idle);
        s.engine.waiting = 1.0;
        assert!(!is_quiet(&s, Some(0.001)));
        s.engine.waiting = 0.0;
        s.live = 1;
        assert!(!is_quiet(&s, None));
        assert_eq!(held_epsilon(Some(100.0)), 0.005);
        assert_eq!(held_epsilon(None), 1e-6);
    }

    #[test]
    fn the_early_phase_runs_with_prefill_metrics_and_shares_the_streaming_time() {
        let base = [
            "kvguard-leakcheck",
            "--target",
            "http://127.0.0.1:1",
            "--engine-metrics",
            "http://127.0.0.1:2/metrics",
            "--duration",
            "10s",
            "--rounds",
            "1",
            "--non-streaming-share",
            "0.4",
        ];
        let kinds = |extra: &[&str]| {
            let a = Args::parse_from(base.iter().chain(extra.iter()));
            plan_phases(&a)
                .into_iter()
                .map(|(k, _, d)| (k, d.as_secs_f64()))
                .collect::<Vec<_>>()
        };
        let one = kinds(&[]);
        assert_eq!(
            one.iter().map(|k| k.0).collect::<Vec<_>>(),
            [
                Kind::StreamingDropped,
                Kind::StreamingSilent,
                Kind::NonStreamingDropped
            ]
        );
        let pd = kinds(&["--prefill-metrics", "http://127.0.0.1:3/metrics"]);
        assert_eq!(pd.len(), 4);
        assert_eq!(pd[2].0, Kind::StreamingEarly);
        // 6 s of streaming over three kinds, 4 s of non-streaming.
        for (_, d) in &pd[..3] {
            assert!((d - 2.0).abs() < 1e-9, "{pd:?}");
        }
        assert!((pd[3].1 - 4.0).abs() < 1e-9, "{pd:?}");
        let off = kinds(&[
            "--prefill-metrics",
            "http://127.0.0.1:3/metrics",
            "--early-share",
            "0",
        ]);
        assert!(off.iter().all(|k| k.0 != Kind::StreamingEarly), "{off:?}");
    }
}
