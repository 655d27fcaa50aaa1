//! The ablation finds what it must: each mechanism's witness keeps every promise with
//! everything on and breaks its promise with the mechanism off (a switch that does
//! nothing fails here).

use kvguard_sim::ablation::{witness_holds, ALL};

#[test]
fn each_mechanism_s_witness_breaks_its_promise_without_it() {
    let mut failed = Vec::new();
    for m in ALL {
        if witness_holds(m) == Some(false) {
            failed.push(m.name());
        }
    }
    assert!(failed.is_empty(), "witnesses that do not hold: {failed:?}");
}
