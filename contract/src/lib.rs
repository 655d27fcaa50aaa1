//! The wire contract shared by the kvguard filter (wasm, in Envoy) and kvguard-control
//! (beside the engine): request ids, abort reasons, the abort body and its answers, the
//! `x-kvguard-signature` HMAC scheme and the signed `x-kvguard-control` response stamp, each
//! kind of signed message under its own domain prefix ([`Domain`]).
//!
//! Both sides depend on this crate so they cannot drift; `tests/vectors.rs` pins the
//! formats to values computed by an independent implementation (Python's `hmac`).
//! The crate is host-free, builds for `wasm32-wasip1` and never panics.
#![forbid(unsafe_code)]

pub mod abort;
pub mod domain;
mod hex;
pub mod id;
pub mod key;
pub mod lease;
pub mod peer;
pub mod reason;
pub mod signature;
pub mod sse;
pub mod stamp;

pub use abort::{AbortAnswer, AbortRequest, Disposition, Leg, LegResult, ABORT_PATH};
pub use domain::Domain;
pub use id::{IdError, RequestId, MAX_ID_LEN};
pub use key::{Key, KeyError, MIN_KEY_LEN};
pub use lease::{
    sign_proof, unsigned_proof, HostKey, InstanceId, InstanceTag, Proof, Renewal, RenewalBody,
    SignedProof, TagHeader, Via, DATA_LEASE_PATH, INSTANCE_HEADER, LEASE_PATH,
};
pub use peer::{Forwarded, PEER_ABORT_PATH, PEER_LEASE_PATH};
pub use reason::AbortReason;
pub use signature::{SignatureError, MAX_SKEW_SECS, SIGNATURE_HEADER};
pub use stamp::{Stamp, StampError, CONTROL_HEADER};

/// The header the edge mints and every hop passes on; the key of every request.
pub const REQUEST_ID_HEADER: &str = "x-request-id";
