//! The in-flight table with the tombstones: admission (a
//! superseding retry included), what an abort finds here, how a request leaves. One value,
//! so that the shell keeps it under one lock and admission and abort see one view (an
//! abort cannot slip between a tombstone check and an insert).
//!
//! Generic over the shell's handle of a request ([`Held`]): the table decides, the shell
//! carries out (closes the engine connection, answers the client, counts).

use crate::cut::{self, Ask, Cut, Here};
use crate::limits::Limits;
use crate::request::Times;
use crate::tombstones::{Tombstone, Tombstones};
use kvguard_contract::{AbortReason, RequestId};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The shell's handle of a request in flight, as the table needs it.
pub trait Held {
    /// Its id.
    fn id(&self) -> &RequestId;
    /// A number unique to this attempt (two attempts may share an id over time).
    fn seq(&self) -> u64;
    /// Marks it as being ended for `reason`; `false` if it already was (the first reason
    /// wins).
    fn mark_ended(&self, reason: AbortReason) -> bool;
    /// Its clocks now.
    fn times(&self) -> Times;
}

impl<T: Held + ?Sized> Held for std::sync::Arc<T> {
    fn id(&self) -> &RequestId {
        T::id(self)
    }

    fn seq(&self) -> u64 {
        T::seq(self)
    }

    fn mark_ended(&self, reason: AbortReason) -> bool {
        T::mark_ended(self, reason)
    }

    fn times(&self) -> Times {
        T::times(self)
    }
}

/// The table's bounds and modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InflightConfig {
    /// Most requests in flight (`--max-inflight`).
    pub max_inflight: usize,
    /// `--dry-run`: nothing is ended or forgotten; a superseded attempt stays in flight.
    pub dry_run: bool,
    /// How long an aborted id is refused (`--tombstone-ttl`).
    pub tombstone_ttl: Duration,
    /// Most tombstones (`--max-tombstones`).
    pub max_tombstones: usize,
}

/// Why a request was not admitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Its id is tombstoned.
    Tombstoned(Tombstone),
    /// The table is full.
    Full(usize),
    /// Shutting down.
    Draining,
}

/// What an abort found here ([`Inflight::abort_here`]), and what the shell carries out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AbortHere<E> {
    /// In flight: it left the table and its id is tombstoned; the shell ends it.
    End(E),
    /// In flight, `--dry-run`: observed only.
    Observe(E),
    /// Already being ended, or tombstoned.
    Already,
    /// Not in flight; `tombstoned`: its id is refused from now (it was asked for, and
    /// this is no dry run).
    NotFound {
        /// Whether the id was tombstoned now.
        tombstoned: bool,
    },
}

/// Requests in flight and refused ids.
#[derive(Debug)]
pub struct Inflight<E> {
    cfg: InflightConfig,
    table: HashMap<RequestId, E>,
    /// `--dry-run` only: attempts a retry with the same id replaced in `table`, still
    /// running (a dry run ends nothing and forgets nothing), by their sequence number.
    superseded: HashMap<u64, E>,
    tombstones: Tombstones,
}

impl<E: Held + Clone> Inflight<E> {
    /// An empty table.
    pub fn new(cfg: InflightConfig) -> Self {
        Inflight {
            cfg,
            table: HashMap::new(),
            superseded: HashMap::new(),
            tombstones: Tombstones::new(cfg.tombstone_ttl, cfg.max_tombstones),
        }
    }

    /// Admits `entry` at `now` unless `draining`: refuses a tombstoned id and a full
    /// table. An id already in flight is a retry of the same logical request: the new
    /// attempt replaces the older one, which is returned for the shell to close (a dry
    /// run keeps it in flight too).
    pub fn admit(&mut self, entry: E, draining: bool, now: Instant) -> Result<Option<E>, Refusal> {
        if draining {
            return Err(Refusal::Draining);
        }
        if let Some(t) = self.tombstones.get(entry.id(), now) {
            return Err(Refusal::Tombstoned(t));
        }
        let retry = self.table.contains_key(entry.id());
        // A dry run keeps the older attempt too: one more in flight.
        let grows = !retry || self.cfg.dry_run;
        if grows && self.len() >= self.cfg.max_inflight {
            return Err(Refusal::Full(self.cfg.max_inflight));
        }
        let old = self.table.insert(entry.id().clone(), entry);
        if let (Some(old), true) = (&old, self.cfg.dry_run) {
            self.superseded.insert(old.seq(), old.clone());
        }
        Ok(old)
    }

    /// The request in flight under `id` (the newest attempt).
    pub fn get(&self, id: &RequestId) -> Option<&E> {
        self.table.get(id)
    }

    /// Every request in flight (superseded attempts of a dry run included).
    pub fn entries(&self) -> impl Iterator<Item = &E> {
        self.table.values().chain(self.superseded.values())
    }

    /// Requests in flight (superseded attempts of a dry run included).
    pub fn len(&self) -> usize {
        self.table.len() + self.superseded.len()
    }

    /// Whether none is in flight.
    pub fn is_empty(&self) -> bool {
        self.table.is_empty() && self.superseded.is_empty()
    }

    /// Removes `entry` (only this attempt, not a newer one with the same id).
    pub fn remove(&mut self, entry: &E) {
        if self
            .table
            .get(entry.id())
            .is_some_and(|e| e.seq() == entry.seq())
        {
            self.table.remove(entry.id());
        } else {
            self.superseded.remove(&entry.seq());
        }
    }

    /// May the request `id` be ended now, on `ask` ([`cut::may_end`] on what is known here:
    /// in flight with its clocks, or not)? Nothing changes: the answer is only an answer.
    pub fn judge(&self, id: &RequestId, ask: Ask, now: Instant, limits: &Limits) -> Cut {
        let here = match self.table.get(id) {
            Some(e) => Here::InFlight(e.times()),
            None => Here::Unknown,
        };
        cut::may_end(here, ask, now, limits)
    }

    /// The reaper's pass at `now`: every request in flight that is due to be ended, and why.
    pub fn due(&self, now: Instant, limits: &Limits) -> Vec<(E, AbortReason)> {
        self.entries()
            .filter_map(|e| {
                match cut::may_end(Here::InFlight(e.times()), Ask::Reaper, now, limits) {
                    Cut::End(r) => Some((e.clone(), r)),
                    Cut::Defer(_) | Cut::Keep => None,
                }
            })
            .collect()
    }

    /// Tombstones `id` at `now`: it is refused for the TTL. Returns the tombstones
    /// evicted early to make room.
    pub fn tombstone(&mut self, id: RequestId, reason: AbortReason, now: Instant) -> u64 {
        let before = self.tombstones.evicted();
        self.tombstones.insert(id, reason, now);
        self.tombstones.evicted() - before
    }

    /// The live tombstone of `id`, if any.
    pub fn tombstoned(&self, id: &RequestId, now: Instant) -> Option<Tombstone> {
        self.tombstones.get(id, now)
    }

    /// Drops expired tombstones.
    pub fn purge(&mut self, now: Instant) {
        self.tombstones.purge(now);
    }

    /// Live tombstones (after a purge).
    pub fn tombstones(&self) -> usize {
        self.tombstones.len()
    }

    /// Tombstones evicted early to make room, since the table was made.
    pub fn tombstones_evicted(&self) -> u64 {
        self.tombstones.evicted()
    }

    /// Ends `entry` for `reason` at `now`: it leaves the table and its id is tombstoned.
    /// `None` if it was already being ended; else the tombstones evicted to make room.
    pub fn end(&mut self, entry: &E, reason: AbortReason, now: Instant) -> Option<u64> {
        if !entry.mark_ended(reason) {
            return None;
        }
        self.remove(entry);
        Some(self.tombstone(entry.id().clone(), reason, now))
    }

    /// What an abort of `id` for `reason` finds here at `now`, decided at once: the
    /// request is in flight (it is ended: see [`AbortHere::End`]), already ended or
    /// tombstoned, or not here — then, if `tombstone_missing`, its id is tombstoned so
    /// that it is refused when it arrives (an abort racing its request's admission either
    /// ends it or refuses it, never answers 404 while it runs). Without
    /// `tombstone_missing` an id not here is left alone: a peer may hold it.
    pub fn abort_here(
        &mut self,
        id: &RequestId,
        reason: AbortReason,
        now: Instant,
        tombstone_missing: bool,
    ) -> AbortHere<E> {
        if let Some(entry) = self.table.get(id).cloned() {
            if self.cfg.dry_run {
                return AbortHere::Observe(entry);
            }
            return match self.end(&entry, reason, now) {
                Some(_) => AbortHere::End(entry),
                None => AbortHere::Already,
            };
        }
        if self.tombstones.get(id, now).is_some() {
            return AbortHere::Already;
        }
        let tombstoned = tombstone_missing && !self.cfg.dry_run;
        if tombstoned {
            self.tombstone(id.clone(), reason, now);
        }
        AbortHere::NotFound { tombstoned }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cut::Deferral;
    use std::sync::{Arc, Mutex};

    #[derive(Debug, Clone)]
    struct H {
        id: RequestId,
        seq: u64,
        ended: Arc<Mutex<Option<AbortReason>>>,
        times: Arc<Mutex<Option<Times>>>,
    }

    impl PartialEq for H {
        fn eq(&self, o: &H) -> bool {
            self.seq == o.seq
        }
    }

    impl Eq for H {}

    impl Held for H {
        fn id(&self) -> &RequestId {
            &self.id
        }
        fn seq(&self) -> u64 {
            self.seq
        }
        fn mark_ended(&self, reason: AbortReason) -> bool {
            let mut e = self.ended.lock().unwrap();
            e.is_none() && e.replace(reason).is_none()
        }
        fn times(&self) -> Times {
            self.times.lock().unwrap().expect("clocks set by the test")
        }
    }

    fn h(id: &str, seq: u64) -> H {
        H {
            id: RequestId::try_new(id.as_bytes()).unwrap(),
            seq,
            ended: Arc::default(),
            times: Arc::default(),
        }
    }

    fn cfg() -> InflightConfig {
        InflightConfig {
            max_inflight: 2,
            dry_run: false,
            tombstone_ttl: Duration::from_secs(60),
            max_tombstones: 10,
        }
    }

    #[test]
    fn admission_refuses_tombstoned_full_and_draining_and_a_retry_supersedes() {
        let t0 = Instant::now();
        let mut t = Inflight::new(cfg());
        assert_eq!(t.admit(h("a", 1), true, t0), Err(Refusal::Draining));
        assert_eq!(t.admit(h("a", 1), false, t0), Ok(None));
        assert_eq!(t.admit(h("b", 2), false, t0), Ok(None));
        assert_eq!(t.admit(h("c", 3), false, t0), Err(Refusal::Full(2)));
        // A retry of a replaces it, even when full.
        assert_eq!(t.admit(h("a", 4), false, t0), Ok(Some(h("a", 1))));
        assert_eq!(t.len(), 2);
        assert_eq!(t.get(h("a", 0).id()).map(|e| e.seq), Some(4));
        // The older attempt's removal leaves the retry in.
        t.remove(&h("a", 1));
        assert_eq!(t.get(h("a", 0).id()).map(|e| e.seq), Some(4));
        t.remove(&h("a", 4));
        assert!(t.get(h("a", 0).id()).is_none());
        assert_eq!(
            t.tombstone(h("a", 0).id().clone(), AbortReason::Operator, t0),
            0
        );
        assert!(matches!(
            t.admit(h("a", 5), false, t0),
            Err(Refusal::Tombstoned(_))
        ));
        assert!(t.tombstoned(h("a", 0).id(), t0).is_some());
        assert_eq!(t.tombstones(), 1);
        t.purge(t0 + Duration::from_secs(60));
        assert_eq!(t.tombstones(), 0);
        assert_eq!(
            t.admit(h("a", 6), false, t0 + Duration::from_secs(60)),
            Ok(None)
        );
    }

    #[test]
    fn a_dry_run_keeps_the_superseded_attempt_in_flight_and_bounded() {
        let t0 = Instant::now();
        let mut t = Inflight::new(InflightConfig {
            dry_run: true,
            ..cfg()
        });
        assert_eq!(t.admit(h("a", 1), false, t0), Ok(None));
        assert_eq!(t.admit(h("a", 2), false, t0), Ok(Some(h("a", 1))));
        assert_eq!(t.len(), 2, "both attempts run");
        assert_eq!(t.entries().count(), 2);
        assert_eq!(t.admit(h("a", 3), false, t0), Err(Refusal::Full(2)));
        t.remove(&h("a", 1));
        assert_eq!(t.len(), 1);
        assert!(!t.is_empty());
        // An abort observes; nothing leaves, nothing is tombstoned.
        assert_eq!(
            t.abort_here(h("a", 0).id(), AbortReason::Stalled, t0, true),
            AbortHere::Observe(h("a", 2))
        );
        assert_eq!(
            t.abort_here(h("z", 0).id(), AbortReason::Stalled, t0, true),
            AbortHere::NotFound { tombstoned: false }
        );
        assert_eq!(t.tombstones(), 0);
        t.remove(&h("a", 2));
        assert!(t.is_empty());
    }

    #[test]
    fn an_abort_ends_once_then_finds_it_already_and_tombstones_a_missing_id_if_asked() {
        let t0 = Instant::now();
        let mut t = Inflight::new(cfg());
        let a = h("a", 1);
        t.admit(a.clone(), false, t0).unwrap();
        assert_eq!(
            t.abort_here(a.id(), AbortReason::DownstreamReset, t0, false),
            AbortHere::End(a.clone())
        );
        assert_eq!(*a.ended.lock().unwrap(), Some(AbortReason::DownstreamReset));
        assert!(t.is_empty());
        assert_eq!(
            t.abort_here(a.id(), AbortReason::Stalled, t0, false),
            AbortHere::Already
        );
        // Ending twice: the first reason wins, the second finds it ended.
        let b = h("b", 2);
        t.admit(b.clone(), false, t0).unwrap();
        assert_eq!(t.end(&b, AbortReason::MaxAge, t0), Some(0));
        assert_eq!(t.end(&b, AbortReason::Stalled, t0), None);
        let c = h("c", 3);
        t.admit(c.clone(), false, t0).unwrap();
        Held::mark_ended(&c, AbortReason::MaxAge);
        assert_eq!(
            t.abort_here(c.id(), AbortReason::Stalled, t0, true),
            AbortHere::Already,
            "being ended already"
        );
        // Missing: left alone, or tombstoned.
        let m = h("m", 0);
        assert_eq!(
            t.abort_here(m.id(), AbortReason::Stalled, t0, false),
            AbortHere::NotFound { tombstoned: false }
        );
        assert!(t.tombstoned(m.id(), t0).is_none());
        assert_eq!(
            t.abort_here(m.id(), AbortReason::Stalled, t0, true),
            AbortHere::NotFound { tombstoned: true }
        );
        assert!(t.tombstoned(m.id(), t0).is_some());
        assert_eq!(
            t.abort_here(m.id(), AbortReason::Stalled, t0, true),
            AbortHere::Already
        );
    }

    #[test]
    fn tombstones_are_bounded_and_each_early_eviction_is_counted() {
        let t0 = Instant::now();
        let mut t: Inflight<H> = Inflight::new(InflightConfig {
            max_tombstones: 2,
            ..cfg()
        });
        let r = AbortReason::Stalled;
        assert_eq!(t.tombstone(h("a", 0).id().clone(), r, t0), 0);
        assert_eq!(t.tombstone(h("b", 0).id().clone(), r, t0), 0);
        assert_eq!(t.tombstones_evicted(), 0);
        assert_eq!(t.tombstone(h("c", 0).id().clone(), r, t0), 1);
        assert_eq!(t.tombstone(h("c", 0).id().clone(), r, t0), 0, "a refresh");
        assert_eq!(t.tombstones(), 2);
        assert_eq!(t.tombstones_evicted(), 1);
        assert!(
            t.tombstoned(h("a", 0).id(), t0).is_none(),
            "the oldest went"
        );
    }

    /// A stream whose last data event came at `t0` and waits on its reader since.
    fn draining(t0: Instant) -> Times {
        Times {
            started: t0,
            first_data: Some(t0),
            last_data: Some(t0),
            stalled: Duration::ZERO,
            flow: Some(crate::request::Flow::Reader(t0)),
            drained: Duration::ZERO,
            gateway: false,
        }
    }

    fn limits() -> Limits {
        Limits {
            max_age: None,
            idle_timeout: Some(Duration::from_secs(60)),
            first_token_timeout: None,
            reader_timeout: Some(Duration::from_secs(90)),
        }
    }

    #[test]
    fn judged_on_what_is_here_a_deferred_tail_is_kept_and_the_reaper_finds_what_is_due() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let stalled = Ask::Abort {
            reason: AbortReason::Stalled,
            recheck: true,
            sender_idle: Some(s(61)),
        };
        let mut t = Inflight::new(cfg());
        let a = h("a", 1);
        *a.times.lock().unwrap() = Some(draining(t0));
        t.admit(a.clone(), false, t0).unwrap();
        assert_eq!(
            t.judge(a.id(), stalled, t0 + s(61), &limits()),
            Cut::Defer(Deferral::Draining)
        );
        assert!(t.due(t0 + s(89), &limits()).is_empty());
        assert_eq!(
            t.due(t0 + s(90), &limits()),
            vec![(a.clone(), AbortReason::Stalled)]
        );
        // Gone from here: nothing here defers it (held nowhere is the shell's to judge,
        // once the peers answered).
        t.remove(&a);
        assert_eq!(
            t.judge(a.id(), stalled, t0 + s(105), &limits()),
            Cut::End(AbortReason::Stalled)
        );
        assert_eq!(
            t.judge(h("z", 0).id(), stalled, t0, &limits()),
            Cut::End(AbortReason::Stalled)
        );
    }

    #[test]
    fn a_shared_handle_is_held_as_its_request() {
        let t0 = Instant::now();
        let mut t = Inflight::new(cfg());
        let a = Arc::new(h("a", 7));
        assert_eq!(Held::seq(&a), 7);
        assert_eq!(Held::id(&a), a.id());
        t.admit(a.clone(), false, t0).unwrap();
        assert_eq!(t.end(&a, AbortReason::Operator, t0), Some(0));
        assert_eq!(*a.ended.lock().unwrap(), Some(AbortReason::Operator));
        assert!(!Held::mark_ended(&a, AbortReason::Stalled), "ended once");
        assert!(t.is_empty());
    }
}
