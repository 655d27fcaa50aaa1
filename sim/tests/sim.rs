//! The simulator's promises in CI: the known findings are still found (a fix makes its
//! test fail: move the finding to the regression list), a seed campaign finds no unknown
//! violation, and named mutations of the rules are caught.

use kvguard_sim::ablation::slow_readers;
use kvguard_sim::findings::{guards, known, regressions};
use kvguard_sim::{run, Mechanism, Mutations, Schedule};

/// Seeds the campaign runs here (`KVGUARD_SIM_SEEDS`, default 500: a debug build runs
/// about 15 seeds a second); CI's release stage runs 10 000 (`scripts/sim --seeds 10000`).
fn seeds() -> u64 {
    std::env::var("KVGUARD_SIM_SEEDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(500)
}

#[test]
fn every_known_finding_is_still_found() {
    for f in known() {
        let r = run(&f.schedule, Mutations::default());
        assert!(
            r.violations.iter().any(|v| v.finding == Some(f.name)),
            "finding {} ({}) is no longer found: if it was fixed, move it from findings::known to findings::regressions (every_regression_stays_fixed) and its row in docs/TESTING.md.\n{}",
            f.name,
            f.title,
            f.schedule
        );
    }
}

#[test]
fn a_seed_campaign_finds_no_unknown_violation() {
    let mut unknown = Vec::new();
    let mut streams = 0;
    for seed in 0..seeds() {
        let s = Schedule::generate(seed);
        let r = run(&s, Mutations::default());
        streams += r.streams;
        for v in r.violations.into_iter().filter(|v| v.finding.is_none()) {
            unknown.push(format!("seed {seed}: {v}"));
        }
    }
    assert!(
        streams as u64 > seeds(),
        "the campaign ran {streams} streams"
    );
    assert!(
        unknown.is_empty(),
        "{} unknown violation(s); `scripts/sim --seed N` prints one with its timeline:\n{}",
        unknown.len(),
        unknown.join("\n")
    );
}

#[test]
fn slow_readers_at_the_shipped_defaults_are_never_cut() {
    let r = run(&slow_readers(), Mutations::default());
    assert!(r.violations.is_empty(), "{:?}", r.violations);
    assert!(
        r.timeline.lines.iter().any(|l| l.what.contains("deferred")),
        "no stall ask was deferred: the schedule does not exercise the deferral"
    );
}

#[test]
fn the_deferral_mutation_is_caught() {
    let m = Mutations::default().without(Mechanism::Deferral);
    let r = run(&slow_readers(), m);
    assert!(
        r.violations
            .iter()
            .any(|v| v.finding.is_none() && format!("{v}").contains("Invariant1")),
        "kvguard-control without its deferral cut no reader: {:?}",
        r.violations
    );
}

#[test]
fn a_run_is_deterministic() {
    let s = Schedule::generate(42);
    let (a, b) = (run(&s, Mutations::default()), run(&s, Mutations::default()));
    assert_eq!(a.timeline.lines, b.timeline.lines);
    // Also where the order of the filter's own tables decides: which streams of a mass
    // stall the valve cuts and which it holds.
    let (_, valve) = kvguard_sim::ablation::Mechanism::MassStallValve
        .witness()
        .expect("the valve's witness");
    let (a, b) = (
        run(&valve, Mutations::default()),
        run(&valve, Mutations::default()),
    );
    assert_eq!(a.timeline.lines, b.timeline.lines);
}

#[test]
fn the_guards_of_the_filter_s_rules_pass() {
    // Each fails with its rule removed from filter/core/src/cut.rs (docs/TESTING.md).
    for g in guards() {
        let r = run(&g.schedule, Mutations::default());
        assert!(
            r.violations.is_empty(),
            "{}: {:?}\n{}",
            g.rule,
            r.violations,
            r.violations
                .first()
                .map(|v| r.timeline.story(v.stream))
                .unwrap_or_default()
        );
    }
}

#[test]
fn every_regression_stays_fixed() {
    for f in regressions() {
        let r = run(&f.schedule, Mutations::default());
        assert!(
            r.violations.is_empty(),
            "fixed finding {} ({}) is back: {:?}",
            f.name,
            f.title,
            r.violations
        );
    }
}

/// An admin listener that answers late for 20 s, under the filter's 30 s abort deadline
/// (each call handled 2.5 s after it came: past the filter's 1 s timeout, so it retries,
/// and the late original is handled after its retry), and a gateway whose wall clock
/// steps back 25 s (inside the signatures' window) change nothing: the pausing reader is
/// kept, the client that leaves has its engine ended by its abort.
#[test]
fn a_late_admin_listener_and_a_stepped_wall_clock_change_nothing() {
    use kvguard_sim::schedule::{Client, Op, Setup};
    let s = Schedule {
        seed: 7,
        setup: Setup {
            idle_ms: 30_000,
            hop_hides: true,
            ..Setup::default()
        },
        ops: vec![
            Op::ClockStep {
                at: 1_000,
                gw: 0,
                step_s: -25,
            },
            Op::SlowAdmin {
                at: 30_000,
                for_ms: 20_000,
                delay_ms: 2_500,
            },
            Op::stream(
                2_000,
                0,
                0,
                Client::Pausing {
                    bps: 2_700,
                    after_ms: 10_000,
                    pause_ms: 50_000,
                },
                277,
                41,
            ),
            Op::stream(3_000, 0, 0, Client::Leaves { after_ms: 30_000 }, 3_000, 30),
        ],
    };
    let r = run(&s, Mutations::default());
    assert!(r.violations.is_empty(), "{:?}", r.violations);
    let said = |what: &str| r.timeline.lines.iter().any(|l| l.what.contains(what));
    assert!(
        said("deferred"),
        "the reader's stall ask was never answered"
    );
    assert!(
        said("ends the request (downstream_reset"),
        "the engine of the client that left was not ended by its abort"
    );
}
