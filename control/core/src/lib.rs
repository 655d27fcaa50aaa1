//! kvguard-control's decisions without I/O. Every function here takes the time as an
//! input and touches no socket, task or clock: the service (`kvguard-control`) feeds it
//! what it saw and carries out what it decides, and the simulator runs it in virtual time.
//!
//! - [`abort`]: where an abort is decided (here, a peer, every leg) and what its answer
//!   says.
//! - [`cut`]: **may this request be ended now?** The one answer, for the reaper and for
//!   a gateway's abort.
//! - [`inflight`]: the in-flight table with the tombstones and recent completions:
//!   admission, what an abort finds, how a request leaves.
//! - [`request`]: one request's progress (its clocks, data events, who its response waits
//!   on) and what its body claims.
//! - [`limits`]: the reaper's verdicts on those clocks, and when a `stalled` abort is
//!   deferred.
//! - [`tombstones`]: aborted ids refused if they arrive, and recent completions.
//! - [`replay`]: signatures already seen, so a captured call cannot be replayed.
//! - [`lease`]: the liveness leases of the gateways and their verdicts.
//! - [`pd`]: prefill/decode legs read from bodies, and the prefill hand-offs held.
//! - [`scan`]: the SSE/NDJSON scanner that counts a response's data events.
#![forbid(unsafe_code)]

pub mod abort;
pub mod cut;
pub mod inflight;
pub mod lease;
pub mod limits;
pub mod pd;
pub mod replay;
pub mod request;
pub mod scan;
pub mod tombstones;
