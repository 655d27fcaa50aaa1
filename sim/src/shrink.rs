//! Shrinking a failing schedule to a minimal one: operations are removed one at a time
//! (then faults shortened) while the run still breaks the same promise the same way
//! (the same finding, or unknown), as proptest shrinks a generated operation sequence.
//! Deterministic: the run's own randomness comes from the schedule's seed.

use crate::ablation::Mutations;
use crate::oracles::{Promise, Violation};
use crate::schedule::{Op, Schedule};

/// What a failure is, for "the same failure".
fn signature(v: &Violation) -> (Promise, Option<&'static str>) {
    (v.promise, v.finding)
}

/// The smallest schedule found that still fails like `first` does.
pub fn shrink(sched: &Schedule, mutations: Mutations, first: &Violation) -> Schedule {
    let want = signature(first);
    let fails = |s: &Schedule| {
        crate::run(s, mutations)
            .violations
            .iter()
            .any(|v| signature(v) == want)
    };
    let mut best = sched.clone();
    let mut progress = true;
    while progress {
        progress = false;
        let mut i = 0;
        while i < best.ops.len() {
            let mut cand = best.clone();
            cand.ops.remove(i);
            if fails(&cand) {
                best = cand;
                progress = true;
            } else {
                i += 1;
            }
        }
        // Simpler setups.
        for simpler in simpler_setups(&best) {
            if fails(&simpler) {
                best = simpler;
                progress = true;
                break;
            }
        }
    }
    best.ops.sort_by_key(Op::at);
    best
}

fn simpler_setups(s: &Schedule) -> Vec<Schedule> {
    let mut out = Vec::new();
    let used_gw = s.ops.iter().map(|op| match *op {
        Op::Stream { gw, .. }
        | Op::Kill { gw, .. }
        | Op::Freeze { gw, .. }
        | Op::ClockStep { gw, .. }
        | Op::HotRestart { gw, .. }
        | Op::Trap { gw, .. } => gw,
        Op::LoseCalls { .. }
        | Op::EnginePause { .. }
        | Op::ReplicaLost { .. }
        | Op::PartitionPeers { .. }
        | Op::ReplicaRestart { .. }
        | Op::HopRetries { .. }
        | Op::SlowAdmin { .. }
        | Op::PartitionData { .. } => 0,
    });
    let used_gw = used_gw.max().unwrap_or(0);
    if s.setup.gateways > used_gw + 1 {
        let mut c = s.clone();
        c.setup.gateways = used_gw + 1;
        out.push(c);
    }
    let traps = s.ops.iter().any(|op| matches!(op, Op::Trap { .. }));
    if s.setup.vms > 1 && !traps {
        let mut c = s.clone();
        c.setup.vms = 1;
        out.push(c);
    }
    if s.setup.shared_host_key {
        let mut c = s.clone();
        c.setup.shared_host_key = false;
        out.push(c);
    }
    if s.setup.h2 {
        let mut c = s.clone();
        c.setup.h2 = false;
        out.push(c);
    }
    if s.setup.replicas > 1 {
        let mut c = s.clone();
        c.setup.replicas = 1;
        for op in &mut c.ops {
            if let Op::Stream { replica, .. }
            | Op::EnginePause { replica, .. }
            | Op::ReplicaLost { replica, .. }
            | Op::ReplicaRestart { replica, .. }
            | Op::PartitionData { replica, .. } = op
            {
                *replica = 0;
            }
        }
        out.push(c);
    }
    out
}
