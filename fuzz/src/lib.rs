//! kvguard's fuzz oracles (see `checks`). The libFuzzer entry points are in `fuzz_targets/`.
pub mod checks;
