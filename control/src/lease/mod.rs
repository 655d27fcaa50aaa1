//! Liveness leases of gateway processes (contract §8): the judgement is the core's
//! ([`kvguard_control_core::lease`], re-exported here); the renewal endpoints are in
//! [`endpoints`], the loop that enforces it in [`enforce`].

pub mod endpoints;
pub mod enforce;

pub use crate::config::LeaseMode;
pub use kvguard_control_core::lease::*;

#[cfg(test)]
mod tests {
    use super::LeaseMode;

    #[test]
    fn the_mode_names_its_flag_value() {
        assert_eq!(
            [LeaseMode::Off, LeaseMode::Observe, LeaseMode::Enforce].map(LeaseMode::as_str),
            ["off", "observe", "enforce"]
        );
    }
}
