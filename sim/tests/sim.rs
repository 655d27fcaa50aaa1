//! The simulator's promises in CI: the known findings are still found (a fix makes its
//! test fail: move the finding to the regression list), a seed campaign finds no unknown
//! violation, and named mutations of the rules are caught.

use kvguard_contract::AbortReason;
use kvguard_sim::ablation::slow_readers;
use kvguard_sim::findings::{guards, known, regressions};
use kvguard_sim::oracles::{Cause, Promise};
use kvguard_sim::schedule::{Client, Op};
use kvguard_sim::world::EngineEnd;
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

/// A fixed finding's schedule runs with no violation but those of a finding still open
/// (labelled: a fixed one's shape is no label).
#[test]
fn every_regression_stays_fixed() {
    for f in regressions() {
        let r = run(&f.schedule, Mutations::default());
        let back: Vec<_> = r
            .violations
            .iter()
            .filter(|v| v.finding.is_none())
            .collect();
        assert!(
            back.is_empty(),
            "fixed finding {} ({}) is back: {:?}",
            f.name,
            f.title,
            back
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

/// Runs seed 1 of `setup` and `ops`; every promise must hold. Returns its report.
fn clean_run(setup: kvguard_sim::schedule::Setup, ops: Vec<Op>) -> kvguard_sim::Report {
    let s = Schedule {
        seed: 1,
        setup,
        ops,
    };
    let r = run(&s, Mutations::default());
    assert!(
        r.violations.is_empty(),
        "{:?}\n{}",
        r.violations,
        r.timeline.story(usize::MAX)
    );
    r
}

/// Each of `ends` was read to its end: nobody stopped reading, its engine finished.
fn read_in_full(ends: &[kvguard_sim::world::StreamEnd]) {
    for s in ends {
        assert!(s.orphan.is_none(), "{s:?}");
        assert!(
            matches!(s.engine_end, Some((_, EngineEnd::Finished))),
            "{s:?}"
        );
    }
}

#[test]
fn a_hot_restart_s_parent_serves_its_streams_until_it_exits_and_the_lease_ends_the_rest() {
    // Behind a hop that hides disconnects: only the lease can end what the parent's exit
    // cut (its filter's aborts die with it).
    let setup = kvguard_sim::schedule::Setup {
        hop_hides: true,
        ..Default::default()
    };
    let exits = 2_000 + 6_000;
    let r = clean_run(
        setup,
        vec![
            // Runs 90 s: cut when the parent exits.
            Op::stream(0, 0, 0, Client::Fast, 3_000, 30),
            // A reader that ends inside the drain: served in full by the parent.
            Op::stream(0, 0, 0, Client::Steady { bps: 20_000 }, 200, 20),
            Op::HotRestart {
                at: 2_000,
                gw: 0,
                parent_ms: 6_000,
            },
            // After the restart: the child's.
            Op::stream(3_000, 0, 0, Client::Fast, 300, 30),
        ],
    );
    let ends = &r.stats.ends;
    assert_eq!(ends.len(), 3);
    let (cut, served, child) = (ends[0], ends[1], ends[2]);
    match cut.engine_end {
        Some((t, EngineEnd::Ended(AbortReason::GatewayLost))) => assert!(
            t > exits && t <= exits + 35_000,
            "ended at {t} ms, the parent exited at {exits} ms"
        ),
        other => panic!("the parent's cut stream: {other:?}"),
    }
    assert_eq!(cut.gateway_died, Some(exits));
    assert!(
        r.timeline
            .lines
            .iter()
            .any(|l| l.what.contains("expired (replaced)")),
        "{}",
        r.timeline.story(usize::MAX)
    );
    read_in_full(&[served, child]);
}

#[test]
fn a_trapped_worker_vm_s_orphans_end_by_vm_lost_and_the_other_vms_streams_run_on() {
    let setup = kvguard_sim::schedule::Setup {
        hop_hides: true,
        vms: 3,
        ..Default::default()
    };
    // One stream per VM (spread in turn: the second is on VM 0), each 90 s.
    let ops = (0..3)
        .map(|i| Op::stream(i * 100, 0, 0, Client::Fast, 3_000, 30))
        .chain([Op::Trap {
            at: 10_000,
            gw: 0,
            vm: 0,
        }])
        .collect();
    let r = clean_run(setup, ops);
    let ends = &r.stats.ends;
    let lost = ends[1];
    assert!(matches!(lost.orphan, Some((Cause::VmLost, _))), "{lost:?}");
    match lost.engine_end {
        Some((t, EngineEnd::Ended(AbortReason::GatewayLost))) => {
            assert!(t < 10_000 + Cause::VmLost.bound_ms(60_000), "{t}")
        }
        other => panic!("the trapped VM's stream: {other:?}"),
    }
    assert!(r
        .timeline
        .lines
        .iter()
        .any(|l| l.what.contains("expired (vm_lost)")));
    read_in_full(&[ends[0], ends[2]]);
}

#[test]
fn the_shared_host_key_detection_mutation_is_caught() {
    // Finding 37.4: passes with the product (every_regression_stays_fixed), and a live
    // gateway's read stream is ended `replaced` without the detection.
    let f = regressions()
        .into_iter()
        .find(|f| f.name == "37.4")
        .expect("37.4");
    let m = Mutations::default().without(Mechanism::SharedHostKey);
    let r = run(&f.schedule, m);
    assert!(
        r.violations
            .iter()
            .any(|v| v.promise == Promise::Invariant1 && v.what.contains("lease: replaced")),
        "{:?}",
        r.violations
    );
}

#[test]
fn a_hot_restart_s_parent_keeps_a_slow_reader_through_envoy_s_default_drain() {
    // Envoy's default --parent-shutdown-time-s (900 s): a reader above the floor of an
    // engine ten times faster is served by the draining parent to its end, its stall
    // asks deferred while the child renews with the same host key.
    let r = clean_run(
        kvguard_sim::schedule::Setup::default(),
        vec![
            Op::stream(0, 0, 0, Client::Steady { bps: 450 }, 1_000, 30),
            Op::HotRestart {
                at: 5_000,
                gw: 0,
                parent_ms: 900_000,
            },
        ],
    );
    read_in_full(&r.stats.ends);
    assert!(
        r.timeline.lines.iter().any(|l| l.what.contains("deferred")),
        "no stall ask was deferred: the schedule does not exercise the drain's reader\n{}",
        r.timeline.story(usize::MAX)
    );
}

/// An HTTP/2 client's cancel (`RST_STREAM`: `http2.remote_reset`, flag DR) is a
/// disconnect: behind a hop that hides it, its abort ends the engine within the bound,
/// counted `downstream_reset`.
#[test]
fn an_http2_cancel_ends_its_engine_as_a_disconnect_does() {
    let setup = kvguard_sim::schedule::Setup {
        h2: true,
        hop_hides: true,
        ..Default::default()
    };
    let r = clean_run(
        setup,
        vec![Op::stream(
            0,
            0,
            0,
            Client::Leaves { after_ms: 5_000 },
            3_000,
            20,
        )],
    );
    let end = r.stats.ends[0];
    let Some((Cause::Left, left)) = end.orphan else {
        panic!("{end:?}");
    };
    match end.engine_end {
        Some((t, EngineEnd::Ended(AbortReason::DownstreamReset))) => {
            assert!(t - left <= Cause::Left.bound_ms(60_000), "{end:?}")
        }
        other => panic!("{other:?}\n{}", r.timeline.story(0)),
    }
}
