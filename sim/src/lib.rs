//! The whole kvguard protocol in one deterministic simulation (issue 35): gateways
//! running the REAL filter core and lease renewer behind a simulated host, kvguard-control
//! replicas composing the REAL control core as the service does, engines, a hop and
//! clients, in virtual time from one seed; both invariants and the figures are checked
//! on every run ([`oracles`]), a failing schedule shrinks to a minimal one ([`shrink`])
//! printed as a timeline ([`timeline`]), and the known findings are kept in
//! [`findings`].
//!
//! - [`schedule`]: a run's setup and operations, generated from a seed.
//! - [`world`]: the event queue, the buffers, and how the actors meet.
//! - [`gateway`]: one Envoy process (per worker VM a filter core, a renewer and a VM-table
//!   entry; the simulated host; a hot restart's draining parent).
//! - [`replica`]: one kvguard-control replica (the control core, composed).
//! - [`oracles`]: the promises and their bounds.
//! - [`ablation`]: which mechanism each promise needs.
//! - [`fleet`]: the messages each replica receives, and the abort latency, at fleet scale.

pub mod ablation;
pub mod findings;
pub mod fleet;
pub mod gateway;
pub mod oracles;
pub mod replica;
pub mod rng;
pub mod schedule;
pub mod shrink;
pub mod timeline;
pub mod world;

pub use ablation::{Mechanism, Mutations};
pub use schedule::Schedule;
pub use world::Report;

/// Runs `sched` with `mutations` (none: the product) and returns what happened.
pub fn run(sched: &Schedule, mutations: Mutations) -> Report {
    match world::World::new(sched.clone(), mutations) {
        Some(w) => w.run(),
        None => Report {
            violations: Vec::new(),
            timeline: timeline::Timeline::default(),
            simulated_ms: 0,
            streams: 0,
            stats: world::Stats::default(),
        },
    }
}
