//! What kvguard-leakcheck (an operator's command) and the integration harness share: HTTP
//! and SSE clients that read a stream event by event, disconnect at any point, or go
//! silent with the socket open ([`client`]), and the seeded load generator behind
//! `kvguard-load` ([`load`]). Every wait is bounded.
//!
//! It lives outside `kvguard-integration` so that product code never depends on the test
//! harness; the harness re-exports both modules under their old paths
//! (`kvguard_integration::client`, `kvguard_integration::load`).
#![forbid(unsafe_code)]

pub mod client;
pub mod load;
