//! The fleet mode in CI, small: the product keeps every promise at a few gateways ×
//! replicas with a zone lost, and each known scale finding is still found (its
//! message's load on each replica grows with the fleet).

use kvguard_sim::fleet::{known, run, Fleet};
use std::collections::HashMap;

#[test]
fn a_fleet_with_a_zone_lost_keeps_every_promise() {
    for pd in [false, true] {
        let r = run(&Fleet {
            gateways: 6,
            replicas: 6,
            per_gateway: 40,
            zone_lost: true,
            replica_lost: pd,
            pd,
            seed: 1,
        });
        assert_eq!(r.violations.1, 0, "unknown violations: {r}");
        assert!(r.streams > 100, "{r}");
        assert!(r.abort_latency.n > 10, "no abort measured: {r}");
        assert!(
            r.lease_latency.n > 0,
            "no zone stream ended by the lease: {r}"
        );
        // The whole run's renewals reach the replicas: two per gateway per 5 s period.
        let want = 2.0 * 6.0 / 5.0 / 6.0;
        assert!(
            (r.renewals.mean - want).abs() < want / 2.0,
            "renewals per replica per s: {r}"
        );
    }
}

#[test]
fn every_known_scale_finding_is_still_found() {
    let mut runs = HashMap::new();
    for f in known() {
        let mut rate = |fleet: Fleet| (f.rate)(runs.entry(fleet).or_insert_with(|| run(&fleet)));
        let (small, big) = (rate(f.fleet), rate(f.fleet.times(3)));
        assert!(
            small > 0.0 && big > 2.0 * small,
            "scale finding {} ({}) is no longer found: {small:.3}/s per replica at {}x{}, {big:.3}/s at three times that. If it was fixed, move it to a regression and update docs/TESTING.md.",
            f.name,
            f.title,
            f.fleet.gateways,
            f.fleet.replicas
        );
    }
}
