//! The prefill/decode (P/D) leak, without and with kvguard (`kvguard-demo --pd`,
//! `scripts/demo --pd`): client → Envoy [+ kvguard filter] → the P/D proxy (hiding
//! disconnects as vLLM's reference proxies do) → kvguard-control beside each engine → the
//! simulator's prefill and decode roles. The same seeded load runs twice; some clients
//! leave during prefill, some during decode, the rest read to the end.
//!
//! Measured from the engines' own records (the simulators run in this process):
//! - prefill side: blocks held for a decode leg that never read them, in block-seconds
//!   (from the prefill's end to the release), and why they were let go (the lease ran
//!   out, or the decode side gave them up); and prefill time spent after the client left;
//! - decode side: orphan-seconds, decode time after the client left;
//! - false aborts: a client planned to read to the end that did not get `[DONE]`.
//!
//! Without kvguard the controls only proxy (`--idle-timeout off --max-age off`, no P/D
//! flags) and Envoy has no filter; with kvguard, the filter aborts to the prefill side's
//! kvguard-control, which ends every leg (`--pd-role`, `--peers`, `--pd-decode-url`).

use super::stack::{self, Control};
use super::Mode;
use crate::client;
use crate::envoy::{Envoy, EnvoyOptions};
use crate::load::{Percentiles, Rng};
use crate::pd_proxy::{self, PdProxyConfig};
use crate::sim::{self, KvRelease, SimConfig, SimHandle};
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// The header that ties an engine's record to the planned client (the simulator records
/// every request header).
const INDEX_HEADER: &str = "x-demo-index";

/// kvguard's prefill-side held block-seconds and decode-side orphan-seconds must each be
/// at most this share of the run without it ([`verdict`]).
pub const PD_SHARE: f64 = 0.05;

/// The P/D demo's settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PdConfig {
    /// RNG seed.
    pub seed: u64,
    /// Seconds of arrivals.
    pub arrival_s: f64,
    /// Seconds observed after the last arrival (longer than the lease, so that the run
    /// without kvguard shows its expiries).
    pub drain_s: f64,
    /// Arrivals per second.
    pub rate: f64,
    /// Share of clients that leave during prefill.
    pub prefill_leave_share: f64,
    /// Share of clients that leave during decode.
    pub decode_leave_share: f64,
    /// The prefill engine's lease on blocks held for the decode side (ms; vLLM: 30 s).
    pub lease_ms: u64,
    /// Every request's prefill time (ms, the simulator's first-token delay).
    pub prefill_ms: u64,
    /// Tokens per second of each decode.
    pub token_rate: f64,
    /// Shortest completion (tokens).
    pub min_tokens: u32,
    /// Longest completion (tokens).
    pub max_tokens: u32,
    /// The kvguard run's filter in observe mode (it sends no abort): the verdict must fail.
    pub filter_observe: bool,
}

impl Default for PdConfig {
    fn default() -> Self {
        PdConfig {
            seed: 42,
            arrival_s: 20.0,
            drain_s: 8.0,
            rate: 2.0,
            prefill_leave_share: 0.25,
            decode_leave_share: 0.25,
            lease_ms: 3000,
            prefill_ms: 1500,
            token_rate: 20.0,
            min_tokens: 40,
            max_tokens: 120,
            filter_observe: false,
        }
    }
}

/// What a client does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PdKind {
    /// Reads to `[DONE]`.
    Complete,
    /// Leaves this many ms after sending (inside the prefill).
    LeavePrefill(u64),
    /// Leaves after this many data events.
    LeaveDecode(u32),
}

impl PdKind {
    fn label(self) -> &'static str {
        match self {
            PdKind::Complete => "complete",
            PdKind::LeavePrefill(_) => "leave_prefill",
            PdKind::LeaveDecode(_) => "leave_decode",
        }
    }
}

/// One planned request.
#[derive(Debug, Clone)]
pub struct PdPlanned {
    /// Index (the [`INDEX_HEADER`]).
    pub index: usize,
    /// Arrival, from the run's start.
    pub at: Duration,
    /// `max_tokens`.
    pub tokens: u32,
    /// What the client does.
    pub kind: PdKind,
}

/// The plan (deterministic in `cfg.seed`): steady arrivals at `cfg.rate`.
pub fn plan(cfg: &PdConfig) -> Vec<PdPlanned> {
    let mut rng = Rng::new(cfg.seed);
    let n = (cfg.arrival_s * cfg.rate).floor() as usize;
    let span = u64::from(cfg.max_tokens.saturating_sub(cfg.min_tokens)) + 1;
    (0..n)
        .map(|i| {
            let tokens = cfg.min_tokens + rng.below(span) as u32;
            let r = rng.unit();
            let kind = if r < cfg.prefill_leave_share {
                // Between a tenth and nine tenths of the prefill.
                let tenth = (cfg.prefill_ms / 10).max(1);
                PdKind::LeavePrefill(tenth + rng.below(tenth * 8))
            } else if r < cfg.prefill_leave_share + cfg.decode_leave_share {
                PdKind::LeaveDecode(1 + rng.below(u64::from(tokens / 2).max(1)) as u32)
            } else {
                PdKind::Complete
            };
            PdPlanned {
                index: i,
                at: Duration::from_secs_f64(i as f64 / cfg.rate),
                tokens,
                kind,
            }
        })
        .collect()
}

/// One client as it saw its request.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PdClient {
    /// Index in the plan.
    pub index: usize,
    /// `complete`, `leave_prefill`, `leave_decode`.
    pub plan: String,
    /// `done`, `left`, `closed`, `error`, `hung`.
    pub outcome: String,
    /// Seconds since the run's start when it left.
    pub gone_s: Option<f64>,
    /// Error text, if any.
    pub error: Option<String>,
}

/// One run's figures.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PdRun {
    /// `leak` or `kvguard`.
    pub mode: String,
    /// Requests sent.
    pub requests: usize,
    /// Read to `[DONE]`.
    pub completed: usize,
    /// Clients that left during prefill.
    pub left_in_prefill: usize,
    /// Clients that left during decode.
    pub left_in_decode: usize,
    /// Clients planned to complete that did not get `[DONE]` (must be 0).
    pub false_aborts: usize,
    /// Their plan indices and outcomes.
    pub false_abort_samples: Vec<String>,
    /// Prefill side: block-seconds held for a decode leg that never read them (released
    /// not pulled, expired, or still held at the end).
    pub p_held_block_seconds: f64,
    /// Prefill side: per such request, ms from the prefill's end to the release.
    pub p_held_ms: Percentiles,
    /// Prefill side: why it let go of blocks it held (`pulled`, `not_pulled`,
    /// `lease_expired`, `still_held`), every request.
    pub p_releases: BTreeMap<String, usize>,
    /// Prefill side: prefill time after the client left, summed (s).
    pub p_orphan_seconds: f64,
    /// Decode side: decode time after the client left, summed (s).
    pub d_orphan_seconds: f64,
    /// Decode side: per client that left during decode, ms from leaving to the decode's end.
    pub d_after_leaving_ms: Percentiles,
    /// Clients that left during decode found in the decode engine's records (must be all).
    pub d_matched: usize,
    /// Decode side: still generating at the end for a client that left.
    pub d_still_at_end: usize,
    /// The two kvguard-controls' aborts by reason (summed).
    pub aborts_by_reason: BTreeMap<String, f64>,
    /// Per-client records.
    pub clients: Vec<PdClient>,
    /// Wall time of the run (s).
    pub wall_s: f64,
}

/// Both runs and the settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PdResults {
    /// Settings.
    pub config: PdConfig,
    /// Without kvguard.
    pub leak: PdRun,
    /// With kvguard.
    pub kvguard: PdRun,
}

/// The running pieces of one run (dropped at its end: every process stops).
struct PdStack {
    p: SimHandle,
    d: SimHandle,
    pc: Control,
    dc: Control,
    envoy: Envoy,
    _proxy: pd_proxy::PdProxyHandle,
}

async fn start(cfg: &PdConfig, mode: Mode) -> Result<PdStack> {
    let pull_ms = SimConfig::default().kv_pull_ms;
    let (p, d) = sim::spawn_pd(cfg.lease_ms, pull_ms, cfg.token_rate).await?;
    let (pc, dc) = match mode {
        Mode::Leak => {
            let any = SocketAddr::from(([127, 0, 0, 1], 0));
            let off = ["--idle-timeout", "off", "--max-age", "off"].map(String::from);
            (
                Control::start(p.addr(), any, any, &off).await?,
                Control::start(d.addr(), any, any, &off).await?,
            )
        }
        Mode::Kvguard => {
            let lease = Duration::from_millis(cfg.lease_ms);
            Control::start_pd_pair(p.addr(), d.addr(), lease, &["--idle-timeout", "off"]).await?
        }
    };
    let proxy = pd_proxy::spawn(PdProxyConfig {
        listen: None,
        prefill: pc.proxy,
        decode: dc.proxy,
        hide_disconnects: true,
        hand_off: None,
    })
    .await?;
    let opts = match mode {
        Mode::Leak => EnvoyOptions::new(proxy.addr()),
        Mode::Kvguard => {
            let mut f = stack::filter_config(0, 0);
            if cfg.filter_observe {
                f["mode"] = json!("observe");
            }
            EnvoyOptions::with_filter(proxy.addr(), pc.admin, f)
                .vm_env("KVGUARD_SECRET", stack::SECRET)
        }
    };
    let envoy = Envoy::start(opts).await?;
    Ok(PdStack {
        p,
        d,
        pc,
        dc,
        envoy,
        _proxy: proxy,
    })
}

/// Runs one planned client through `entry`; every wait is bounded.
async fn pd_client(cfg: &PdConfig, entry: SocketAddr, p: &PdPlanned, t0: Instant) -> PdClient {
    let mut rec = PdClient {
        index: p.index,
        plan: p.kind.label().into(),
        ..PdClient::default()
    };
    let body = json!({"model": "tiny", "prompt": format!("pd demo request {} {}", p.index, "x".repeat(256)),
                      "stream": true, "max_tokens": p.tokens, "ignore_eos": true});
    let index = p.index.to_string();
    let prefill = cfg.prefill_ms.to_string();
    let hdrs = [
        (INDEX_HEADER, index.as_str()),
        ("x-sim-delay-first-ms", prefill.as_str()),
    ];
    let open = client::stream_sse(entry, "/v1/completions", &body, &hdrs, false);
    let opened = match p.kind {
        PdKind::LeavePrefill(ms) => {
            match tokio::time::timeout(Duration::from_millis(ms), open).await {
                // Dropping the pending request closes its connection: the client left.
                Err(_) => {
                    rec.outcome = "left".into();
                    rec.gone_s = Some(t0.elapsed().as_secs_f64());
                    return rec;
                }
                Ok(r) => r,
            }
        }
        _ => open.await,
    };
    let mut s = match opened {
        Ok(s) if s.status == 200 => s,
        Ok(s) => {
            rec.outcome = "error".into();
            rec.error = Some(format!("status {}", s.status));
            return rec;
        }
        Err(e) => {
            rec.outcome = "error".into();
            rec.error = Some(format!("{e:#}"));
            return rec;
        }
    };
    if let PdKind::LeavePrefill(_) = p.kind {
        // The answer came before the planned leave (a prefill faster than planned).
        rec.outcome = "left".into();
        rec.gone_s = Some(t0.elapsed().as_secs_f64());
        s.disconnect();
        return rec;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut events = 0u32;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match s.next_data(left).await {
            Ok(Some(ev)) if ev.is_done() => {
                rec.outcome = "done".into();
                return rec;
            }
            Ok(Some(ev)) if ev.event.as_deref() == Some("error") => {
                rec.outcome = "kvguard_error".into();
                rec.error = ev.data.clone();
                return rec;
            }
            Ok(Some(_)) => {
                events += 1;
                if let PdKind::LeaveDecode(k) = p.kind {
                    if events >= k {
                        rec.outcome = "left".into();
                        rec.gone_s = Some(t0.elapsed().as_secs_f64());
                        s.disconnect();
                        return rec;
                    }
                }
            }
            Ok(None) => {
                rec.outcome = "closed".into();
                return rec;
            }
            Err(e) => {
                rec.outcome = "error".into();
                rec.error = Some(format!("{e:#}"));
                return rec;
            }
        }
    }
}

/// Runs one mode: a fresh stack, the plan, then the engines' records.
pub async fn run_once(
    cfg: &PdConfig,
    mode: Mode,
    progress: &(dyn Fn(String) + Sync),
) -> Result<PdRun> {
    let started = Instant::now();
    let st = start(cfg, mode).await.context("starting the P/D stack")?;
    let plan = plan(cfg);
    let entry = st.envoy.listener_addr();
    let t0 = Instant::now();
    let t0_p = st.p.sim().now_ms() as f64;
    let t0_d = st.d.sim().now_ms() as f64;
    let mut tasks = Vec::new();
    for p in plan.clone() {
        let cfg = cfg.clone();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until((t0 + p.at).into()).await;
            pd_client(&cfg, entry, &p, t0).await
        }));
    }
    progress(format!(
        "{}: {} requests over {:.0}s, then {:.0}s of drain",
        mode.label(),
        plan.len(),
        cfg.arrival_s,
        cfg.drain_s
    ));
    tokio::time::sleep_until((t0 + Duration::from_secs_f64(cfg.arrival_s + cfg.drain_s)).into())
        .await;
    let mut clients = Vec::new();
    for (p, t) in plan.iter().zip(tasks) {
        let c = match tokio::time::timeout(Duration::from_secs(60), t).await {
            Ok(Ok(c)) => c,
            _ => PdClient {
                index: p.index,
                plan: p.kind.label().into(),
                outcome: "hung".into(),
                ..PdClient::default()
            },
        };
        clients.push(c);
    }
    let mut r = PdRun {
        mode: mode.label().into(),
        requests: plan.len(),
        ..PdRun::default()
    };
    for (p, c) in plan.iter().zip(&clients) {
        match (p.kind, c.outcome.as_str()) {
            (PdKind::Complete, "done") => r.completed += 1,
            (PdKind::Complete, o) => {
                r.false_aborts += 1;
                r.false_abort_samples
                    .push(format!("#{}: {o} {:?}", c.index, c.error));
            }
            (PdKind::LeavePrefill(_), _) => r.left_in_prefill += 1,
            (PdKind::LeaveDecode(_), _) => r.left_in_decode += 1,
        }
    }
    measure_prefill(&mut r, &st.p, t0_p, &clients);
    measure_decode(&mut r, &st.d, t0_d, &plan, &clients);
    for c in [&st.pc, &st.dc] {
        for (k, v) in c.aborts_by_reason().await? {
            *r.aborts_by_reason.entry(k).or_default() += v;
        }
    }
    r.clients = clients;
    r.wall_s = started.elapsed().as_secs_f64();
    drop(st);
    Ok(r)
}

fn index_of(rec: &sim::RequestRecord) -> Option<usize> {
    rec.headers.get(INDEX_HEADER)?.parse().ok()
}

/// The prefill engine's figures: held block-seconds nobody read, releases by why, and
/// prefill time after the client left.
fn measure_prefill(r: &mut PdRun, p: &SimHandle, t0_ms: f64, clients: &[PdClient]) {
    let now = p.sim().now_ms();
    let state = p.state();
    let mut held = Vec::new();
    for rec in &state.requests {
        if let Some(i) = index_of(rec) {
            if let Some(gone) = clients.get(i).and_then(|c| c.gone_s) {
                let end = rec.ended_ms.unwrap_or(now) as f64;
                r.p_orphan_seconds += (end - (t0_ms + gone * 1000.0)).max(0.0) / 1000.0;
            }
        }
        let Some(from) = rec.kv_held_ms else { continue };
        let (why, until) = match rec.kv_released {
            Some((KvRelease::Pulled, _)) => {
                *r.p_releases.entry("pulled".into()).or_default() += 1;
                continue;
            }
            Some((KvRelease::NotPulled, at)) => ("not_pulled", at),
            Some((KvRelease::LeaseExpired, at)) => ("lease_expired", at),
            None => ("still_held", now),
        };
        *r.p_releases.entry(why.into()).or_default() += 1;
        let ms = until.saturating_sub(from) as f64;
        held.push(ms);
        r.p_held_block_seconds += f64::from(rec.blocks) * ms / 1000.0;
    }
    r.p_held_ms = Percentiles::of(held);
}

/// The decode engine's figures: time after a client left during decode.
fn measure_decode(
    r: &mut PdRun,
    d: &SimHandle,
    t0_ms: f64,
    plan: &[PdPlanned],
    clients: &[PdClient],
) {
    let now = d.sim().now_ms() as f64;
    let state = d.state();
    let mut per = Vec::new();
    for (p, c) in plan.iter().zip(clients) {
        let (PdKind::LeaveDecode(_), Some(gone)) = (p.kind, c.gone_s) else {
            continue;
        };
        let Some(rec) = state
            .requests
            .iter()
            .find(|rec| index_of(rec) == Some(p.index))
        else {
            continue;
        };
        r.d_matched += 1;
        let end = match rec.ended_ms {
            Some(e) => e as f64,
            None => {
                r.d_still_at_end += 1;
                now
            }
        };
        let ms = (end - (t0_ms + gone * 1000.0)).max(0.0);
        per.push(ms);
        r.d_orphan_seconds += ms / 1000.0;
    }
    r.d_after_leaving_ms = Percentiles::of(per);
}

/// Both runs, without kvguard first.
pub async fn run(cfg: &PdConfig, progress: &(dyn Fn(String) + Sync)) -> Result<PdResults> {
    let leak = run_once(cfg, Mode::Leak, progress).await?;
    progress(format!("{}: done in {:.0}s", leak.mode, leak.wall_s));
    let kvguard = run_once(cfg, Mode::Kvguard, progress).await?;
    progress(format!("{}: done in {:.0}s", kvguard.mode, kvguard.wall_s));
    Ok(PdResults {
        config: cfg.clone(),
        leak,
        kvguard,
    })
}

/// The two runs side by side.
pub fn table(res: &PdResults) -> String {
    let (a, b) = (&res.leak, &res.kvguard);
    let mut t = format!(
        "P/D leak: client -> Envoy [+ filter] -> P/D proxy (hides disconnects) -> kvguard-control -> prefill / decode simulators\n\
         prefill lease {:.1} s (vLLM's default: 30 s), prefill {} ms, seed {}\n\n{:<48} {:>14} {:>14}\n",
        res.config.lease_ms as f64 / 1000.0,
        res.config.prefill_ms,
        res.config.seed,
        "",
        "without",
        "with kvguard"
    );
    let mut row = |name: &str, x: String, y: String| {
        t.push_str(&format!("{name:<48} {x:>14} {y:>14}\n"));
    };
    let n = |v: usize| v.to_string();
    let f = |v: f64| format!("{v:.2}");
    let rel = |r: &PdRun, k: &str| r.p_releases.get(k).copied().unwrap_or(0).to_string();
    row("requests", n(a.requests), n(b.requests));
    row("read to [DONE]", n(a.completed), n(b.completed));
    row(
        "left during prefill",
        n(a.left_in_prefill),
        n(b.left_in_prefill),
    );
    row(
        "left during decode",
        n(a.left_in_decode),
        n(b.left_in_decode),
    );
    row(
        "P: held block-seconds nobody read",
        f(a.p_held_block_seconds),
        f(b.p_held_block_seconds),
    );
    row(
        "P: held per request p50 / max (ms)",
        format!("{:.0}/{:.0}", a.p_held_ms.p50, a.p_held_ms.max),
        format!("{:.0}/{:.0}", b.p_held_ms.p50, b.p_held_ms.max),
    );
    for k in ["lease_expired", "not_pulled", "pulled", "still_held"] {
        row(&format!("P: released {k}"), rel(a, k), rel(b, k));
    }
    row(
        "P: prefill-seconds after the client left",
        f(a.p_orphan_seconds),
        f(b.p_orphan_seconds),
    );
    row(
        "D: orphan-seconds (decode after client left)",
        f(a.d_orphan_seconds),
        f(b.d_orphan_seconds),
    );
    row(
        "D: after leaving p50 / max (ms)",
        format!(
            "{:.0}/{:.0}",
            a.d_after_leaving_ms.p50, a.d_after_leaving_ms.max
        ),
        format!(
            "{:.0}/{:.0}",
            b.d_after_leaving_ms.p50, b.d_after_leaving_ms.max
        ),
    );
    row(
        "D: still generating at the end",
        n(a.d_still_at_end),
        n(b.d_still_at_end),
    );
    let aborts = |r: &PdRun| r.aborts_by_reason.values().sum::<f64>().to_string();
    row("kvguard-control aborts", aborts(a), aborts(b));
    row("false aborts", n(a.false_aborts), n(b.false_aborts));
    t
}

/// The verdict `kvguard-demo --pd` exits non-zero on: no false abort in either run, every
/// client that left during decode found in the decode engine's records, a leak to close
/// (the run without kvguard held blocks and decoded for nobody), and kvguard's
/// prefill-side held block-seconds and decode-side orphan-seconds each at most
/// [`PD_SHARE`] of the run without it.
pub fn verdict(res: &PdResults) -> Result<()> {
    let mut wrong = Vec::new();
    for r in [&res.leak, &res.kvguard] {
        if r.false_aborts > 0 {
            wrong.push(format!(
                "{}: {} false aborts: {:?}",
                r.mode, r.false_aborts, r.false_abort_samples
            ));
        }
        if r.d_matched != r.left_in_decode {
            wrong.push(format!(
                "{}: {} of {} clients that left during decode found in the decode engine's records",
                r.mode, r.d_matched, r.left_in_decode
            ));
        }
    }
    let (l, k) = (&res.leak, &res.kvguard);
    for (what, lv, kv) in [
        (
            "prefill-side held block-seconds",
            l.p_held_block_seconds,
            k.p_held_block_seconds,
        ),
        (
            "decode-side orphan-seconds",
            l.d_orphan_seconds,
            k.d_orphan_seconds,
        ),
    ] {
        if lv <= 0.0 {
            wrong.push(format!("without kvguard: no {what} (nothing to compare)"));
        } else if kv > PD_SHARE * lv {
            wrong.push(format!(
                "with kvguard: {what} {kv:.2}, more than {:.0} % of {lv:.2} without it",
                PD_SHARE * 100.0
            ));
        }
    }
    if wrong.is_empty() {
        Ok(())
    } else {
        anyhow::bail!("{}", wrong.join("\n"))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn run_with(p_held: f64, d_orphans: f64, false_aborts: usize) -> PdRun {
        PdRun {
            p_held_block_seconds: p_held,
            d_orphan_seconds: d_orphans,
            false_aborts,
            ..PdRun::default()
        }
    }

    fn res(leak: PdRun, kvguard: PdRun) -> PdResults {
        PdResults {
            config: PdConfig::default(),
            leak,
            kvguard,
        }
    }

    #[test]
    fn verdict_needs_both_figures_far_below_the_leak_and_no_false_abort() {
        assert!(verdict(&res(run_with(100.0, 20.0, 0), run_with(5.0, 1.0, 0))).is_ok());
        assert!(verdict(&res(run_with(100.0, 20.0, 0), run_with(5.1, 0.0, 0))).is_err());
        assert!(verdict(&res(run_with(100.0, 20.0, 0), run_with(0.0, 1.1, 0))).is_err());
        assert!(verdict(&res(run_with(100.0, 20.0, 0), run_with(0.0, 0.0, 1))).is_err());
        assert!(verdict(&res(run_with(100.0, 20.0, 1), run_with(0.0, 0.0, 0))).is_err());
        assert!(verdict(&res(run_with(0.0, 20.0, 0), run_with(0.0, 0.0, 0))).is_err());
        assert!(verdict(&res(run_with(100.0, 0.0, 0), run_with(0.0, 0.0, 0))).is_err());
        let mut k = run_with(0.0, 0.0, 0);
        k.left_in_decode = 1;
        assert!(verdict(&res(run_with(100.0, 20.0, 0), k)).is_err());
    }

    #[test]
    fn the_plan_is_seeded_and_has_every_kind() {
        let cfg = PdConfig::default();
        let a = plan(&cfg);
        let b = plan(&cfg);
        assert_eq!(a.len(), 40);
        assert_eq!(
            a.iter().map(|p| p.kind).collect::<Vec<_>>(),
            b.iter().map(|p| p.kind).collect::<Vec<_>>()
        );
        for p in &a {
            match p.kind {
                PdKind::LeavePrefill(ms) => assert!(ms > 0 && ms < cfg.prefill_ms),
                PdKind::LeaveDecode(k) => assert!(k >= 1 && k < p.tokens),
                PdKind::Complete => {}
            }
        }
        for kind in ["complete", "leave_prefill", "leave_decode"] {
            assert!(a.iter().any(|p| p.kind.label() == kind), "{kind}");
        }
    }
}
