//! The worker VMs of one Envoy process, in proxy-wasm shared data ([`VMS_KEY`]): each VM
//! draws a small id when it starts, beats (writes when it was last seen) from its tick,
//! and records there what it has added to the process-wide gauges `active_requests`,
//! `pending_aborts` and `vm_memory_bytes` (its [`Share`]).
//!
//! Why: a VM that traps is gone without a word (`FAIL_RELOAD` starts a fresh one in the
//! same process, `FAIL_OPEN` runs that worker without the filter), while the process's
//! other VMs go on renewing its lease. So
//! - the renewing VM lists the live VMs ([`live`]) in each renewal, and kvguard-control
//!   ends the streams tagged with a VM the renewals have left out for its TTL (Envoy cuts
//!   a trapped VM's streams at their next callback, so none of them is read);
//! - the VM that finds an entry silent for [`SILENT_PERIODS`] lease periods removes it
//!   and takes its share back out of the gauges (exactly once: the removal is a
//!   compare-and-swap write).
//!
//! A VM's entry is written before its batched gauge deltas reach the host, so the share
//! taken back is what the VM added (pending aborts, which move at once, reach the entry
//! at the next tick). A VM removed while it was merely silent (a stalled worker) adds
//! itself again at its next beat, with what was taken back.
//!
//! Value (binary: it is read and written every tick): `v1`, the next id (u32), then per VM
//! its id (u32), when it was last seen (u64, the process's monotonic ms) and its share
//! (three i64), all little-endian.

use crate::host::{Clock, SharedData, SharedError};
use crate::metrics::Metric;

/// Shared-data key of the VM table.
pub const VMS_KEY: &str = "kvguard.vms.v1";
/// A VM not seen for this many lease periods is gone: no longer listed live, its entry
/// removed and its share taken back. A live VM beats every half period.
pub const SILENT_PERIODS: u64 = 3;
/// Compare-and-swap attempts per write (a lost race is retried at once).
const TRIES: usize = 4;

/// The gauges a VM's [`Share`] covers, in its order.
pub const GAUGES: [Metric; 3] = [
    Metric::ActiveRequests,
    Metric::PendingAborts,
    Metric::VmMemoryBytes,
];

/// What one VM has added to each of the [`GAUGES`].
pub type Share = [i64; 3];

fn plus(a: Share, b: Share, sign: i64) -> Share {
    let mut out = a;
    for (o, x) in out.iter_mut().zip(b) {
        *o = o.saturating_add(x.saturating_mul(sign));
    }
    out
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    id: u32,
    seen: u64,
    share: Share,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Table {
    next: u32,
    entries: Vec<Entry>,
}

const ENTRY: usize = 36;

fn int<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    let mut out = [0; N];
    if let Some(s) = b.get(at..at + N) {
        out.copy_from_slice(s);
    }
    out
}

fn parse(v: &[u8]) -> Option<Table> {
    let rest = v.strip_prefix(b"v1")?;
    let (next, rest) = rest.split_first_chunk::<4>()?;
    if rest.len() % ENTRY != 0 {
        return None;
    }
    let entries = rest
        .chunks_exact(ENTRY)
        .map(|c| Entry {
            id: u32::from_le_bytes(int(c, 0)),
            seen: u64::from_le_bytes(int(c, 4)),
            share: [12, 20, 28].map(|at| i64::from_le_bytes(int(c, at))),
        })
        .collect();
    Some(Table {
        next: u32::from_le_bytes(*next),
        entries,
    })
}

fn value(t: &Table) -> Vec<u8> {
    let mut v = Vec::with_capacity(6 + t.entries.len() * ENTRY);
    v.extend_from_slice(b"v1");
    v.extend_from_slice(&t.next.to_le_bytes());
    for e in &t.entries {
        v.extend_from_slice(&e.id.to_le_bytes());
        v.extend_from_slice(&e.seen.to_le_bytes());
        for x in e.share {
            v.extend_from_slice(&x.to_le_bytes());
        }
    }
    v
}

/// The VMs seen within [`SILENT_PERIODS`] periods at `now_ms`, by a [`VMS_KEY`] value
/// (`None`: unreadable; the renewal then lists none and no VM is judged).
pub fn live(current: &[u8], now_ms: u64, period_ms: u64) -> Option<Vec<u32>> {
    let horizon = period_ms.saturating_mul(SILENT_PERIODS);
    Some(
        parse(current)?
            .entries
            .iter()
            .filter(|e| now_ms.saturating_sub(e.seen) <= horizon)
            .map(|e| e.id)
            .collect(),
    )
}

/// One VM's membership in the table.
#[derive(Debug, Default)]
pub struct Member {
    id: Option<u32>,
    /// What this VM has handed to the host.
    share: Share,
    /// Its share as its entry last had it (what a VM that removes the entry takes back).
    entry: Share,
    /// When this VM's entry was last written.
    written: Option<u64>,
    /// Left the table (stopped): gauge changes no longer go through it.
    left: bool,
    /// The lease period, ms.
    period_ms: u64,
}

impl Member {
    /// This VM's id (`None` before [`Member::join`] landed, or after it left).
    pub fn id(&self) -> Option<u32> {
        self.id.filter(|_| !self.left)
    }

    /// Whether gauge deltas go through [`Member::settle`].
    pub fn joined(&self) -> bool {
        self.id().is_some()
    }

    /// Draws this VM's id (the table's next) and writes its first entry; a VM that has
    /// one keeps it. `period_ms` is the lease period (the beat is half of it). Returns
    /// the id, `None` if shared data failed (the VM then tags no VM and its gauges move
    /// as before: its streams are never judged by VM).
    pub fn join<H: SharedData + Clock + ?Sized>(
        &mut self,
        h: &mut H,
        period_ms: u64,
    ) -> Option<u32> {
        self.period_ms = period_ms;
        if self.id.is_none() {
            let now = h.now_ms();
            self.update(h, now, Share::default(), false)?;
        }
        self.id()
    }

    /// Gauge `m` moved by `delta` straight at the host (not through
    /// [`Member::settle`]): part of this VM's share from now on, written to its entry at
    /// the next settlement.
    pub fn note(&mut self, m: Metric, delta: i64) {
        if let Some(k) = GAUGES.iter().position(|g| *g == m) {
            let mut d = Share::default();
            d[k] = delta;
            self.share = plus(self.share, d, 1);
            self.written = None;
        }
    }

    /// Settles `deltas` (this VM's gauge changes not yet handed to the host) at `now_ms`:
    /// writes this VM's entry (its share after them, seen now) when they are not zero
    /// or half a period passed since the last write, removing every other entry silent
    /// for [`SILENT_PERIODS`] periods. Returns the deltas to hand to the host (this VM's
    /// own, the shares of the VMs found gone taken back, and this VM's whole share again
    /// if its entry had been removed while it was silent), or `None` when nothing could
    /// be written (a lost race, no shared data): keep `deltas` for the next settlement
    /// and hand nothing now. A VM that is not a member hands `deltas` as they are.
    pub fn settle<H: SharedData + ?Sized>(
        &mut self,
        h: &mut H,
        now_ms: u64,
        deltas: Share,
    ) -> Option<Share> {
        let quiet = deltas == Share::default()
            && self
                .written
                .is_some_and(|t| now_ms.saturating_sub(t) < self.period_ms / 2);
        if !self.joined() || quiet {
            return Some(deltas);
        }
        self.update(h, now_ms, deltas, false)
    }

    /// This VM stops (the host is done with it): its entry goes. Returns the deltas that
    /// take its share out of the gauges (`None`: not a member, or the entry could not be
    /// removed; it is then taken back once silent).
    pub fn leave<H: SharedData + ?Sized>(&mut self, h: &mut H, now_ms: u64) -> Option<Share> {
        if !self.joined() {
            return None;
        }
        self.update(h, now_ms, Share::default(), true)
    }

    /// One compare-and-swap write of the table: this VM's entry (drawn when it has no id,
    /// removed when `leave`), the silent ones removed. Returns the deltas to hand over.
    fn update<H: SharedData + ?Sized>(
        &mut self,
        h: &mut H,
        now: u64,
        deltas: Share,
        leave: bool,
    ) -> Option<Share> {
        let horizon = self.period_ms.saturating_mul(SILENT_PERIODS);
        let share = plus(self.share, deltas, 1);
        for _ in 0..TRIES {
            let Some((v, cas)) = h.shared_get(VMS_KEY).ok()? else {
                // None yet: a write with cas 0 is unconditional, so create the empty
                // table, then write under a real cas.
                let empty = Table {
                    next: 1,
                    entries: Vec::new(),
                };
                h.shared_set(VMS_KEY, &value(&empty), 0).ok()?;
                continue;
            };
            let mut t = parse(&v)?;
            let id = match self.id {
                Some(id) => id,
                None => {
                    let id = t.next.max(1);
                    t.next = id.checked_add(1)?;
                    id
                }
            };
            let mut out = deltas;
            let mut found = false;
            t.entries.retain(|e| {
                let gone = now.saturating_sub(e.seen) > horizon;
                if e.id == id {
                    found = true;
                } else if gone {
                    out = plus(out, e.share, -1);
                }
                e.id != id && !gone
            });
            if leave {
                out = plus(out, share, -1);
            } else {
                if !found && self.id.is_some() {
                    // Removed while this VM was silent, its entry's share taken back: it
                    // is here again, and so is that.
                    out = plus(out, self.entry, 1);
                }
                t.entries.push(Entry {
                    id,
                    seen: now,
                    share,
                });
            }
            match h.shared_set(VMS_KEY, &value(&t), cas) {
                Ok(()) => {
                    self.id = Some(id);
                    self.share = share;
                    self.entry = share;
                    self.written = Some(now);
                    self.left = leave;
                    return Some(out);
                }
                Err(SharedError::CasMismatch) => continue,
                Err(SharedError::Other) => return None,
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::MockHost;

    const P: u64 = 1000;

    fn share(active: i64, pending: i64, memory: i64) -> Share {
        [active, pending, memory]
    }

    fn table(h: &MockHost) -> Table {
        parse(&h.shared[VMS_KEY].0).unwrap()
    }

    fn apply(s: Option<Share>) -> Share {
        s.expect("settled")
    }

    #[test]
    fn vms_draw_distinct_ids_and_keep_them() {
        let mut h = MockHost::default();
        let (mut a, mut b) = (Member::default(), Member::default());
        assert_eq!(a.id(), None);
        assert_eq!(a.join(&mut h, P), Some(1));
        assert_eq!(b.join(&mut h, P), Some(2));
        assert_eq!(a.join(&mut h, P), Some(1), "kept");
        assert_eq!(table(&h).next, 3);
        let mut live_now = live(&h.shared[VMS_KEY].0, 0, P).unwrap();
        live_now.sort();
        assert_eq!(live_now, vec![1, 2]);
        // The table survives the VMs: a fresh one draws the next id.
        assert_eq!(Member::default().join(&mut h, P), Some(3));
        // Shared data broken: no id.
        let mut broken = MockHost {
            shared_broken: true,
            ..MockHost::default()
        };
        let mut c = Member::default();
        assert_eq!(c.join(&mut broken, P), None);
        assert!(!c.joined());
        assert_eq!(
            c.settle(&mut broken, 0, share(1, 0, 0)),
            Some(share(1, 0, 0)),
            "not a member: deltas go to the host as they are"
        );
    }

    #[test]
    fn a_silent_vm_is_unlisted_and_its_share_taken_back_once() {
        let mut h = MockHost::default();
        let (mut a, mut b, mut c) = (Member::default(), Member::default(), Member::default());
        a.join(&mut h, P);
        b.join(&mut h, P);
        c.join(&mut h, P);
        assert_eq!(
            apply(a.settle(&mut h, 10, share(5, 2, 1000))),
            share(5, 2, 1000)
        );
        assert_eq!(
            apply(b.settle(&mut h, 10, share(3, 1, 900))),
            share(3, 1, 900)
        );
        // b goes silent (it trapped); a and c beat.
        let mut t = 10;
        let mut back = Share::default();
        while t <= 10 + SILENT_PERIODS * P + P {
            t += P / 4;
            back = plus(back, apply(a.settle(&mut h, t, Share::default())), 1);
            back = plus(back, apply(c.settle(&mut h, t, Share::default())), 1);
            let l = live(&h.shared[VMS_KEY].0, t, P).unwrap();
            assert_eq!(
                l.contains(&2),
                t - 10 <= SILENT_PERIODS * P,
                "at {t}: {l:?}"
            );
        }
        // Taken back exactly once, by whichever VM removed it.
        assert_eq!(back, share(-3, -1, -900));
        assert!(table(&h).entries.iter().all(|e| e.id != 2));
        // Within half a period a quiet VM writes nothing; half a period after its last
        // write it beats.
        let version = h.shared[VMS_KEY].1;
        let last = a.written.unwrap();
        assert_eq!(
            apply(a.settle(&mut h, last + P / 2 - 1, Share::default())),
            Share::default()
        );
        assert_eq!(h.shared[VMS_KEY].1, version);
        a.settle(&mut h, last + P / 2, Share::default());
        assert_eq!(h.shared[VMS_KEY].1, version + 1);
    }

    #[test]
    fn a_stalled_vm_removed_while_silent_comes_back_with_its_whole_share() {
        let mut h = MockHost::default();
        let (mut a, mut b) = (Member::default(), Member::default());
        a.join(&mut h, P);
        b.join(&mut h, P);
        apply(b.settle(&mut h, 0, share(4, 0, 500)));
        let late = SILENT_PERIODS * P + 1;
        assert_eq!(
            apply(a.settle(&mut h, late, Share::default())),
            share(-4, 0, -500)
        );
        // b noted a pending abort straight at the host before it was removed: the entry
        // never had it, so it was not taken back and is not handed again.
        b.note(Metric::PendingAborts, 1);
        // b's worker resumes: its entry is back, and so is what was taken back.
        assert_eq!(
            apply(b.settle(&mut h, late + 1, share(-1, 0, 0))),
            share(3, 0, 500)
        );
        let e = table(&h).entries.into_iter().find(|e| e.id == 2).unwrap();
        assert_eq!((e.seen, e.share), (late + 1, share(3, 1, 500)));
        // A note is written at the next settlement, within the half period.
        b.note(Metric::PendingAborts, -1);
        assert_eq!(
            apply(b.settle(&mut h, late + 2, Share::default())),
            Share::default()
        );
        let e = table(&h).entries.into_iter().find(|e| e.id == 2).unwrap();
        assert_eq!((e.seen, e.share), (late + 2, share(3, 0, 500)));
    }

    #[test]
    fn a_lost_race_keeps_the_deltas_and_a_vm_that_leaves_takes_its_share_out() {
        let mut h = MockHost::default();
        let mut a = Member::default();
        a.join(&mut h, P);
        apply(a.settle(&mut h, 0, share(2, 1, 100)));
        // Unreadable shared data: nothing written, the deltas wait.
        h.shared_broken = true;
        assert_eq!(a.settle(&mut h, 1, share(1, 0, 0)), None);
        assert_eq!(a.leave(&mut h, 3), None);
        h.shared_broken = false;
        assert_eq!(apply(a.settle(&mut h, 2, share(1, 0, 0))), share(1, 0, 0));
        a.note(Metric::VmMemoryBytes, -40);
        a.note(Metric::RequestsTracked, 5);
        assert_eq!(a.leave(&mut h, 3), Some(share(-3, -1, -60)));
        assert!(table(&h).entries.is_empty());
        assert!(!a.joined());
        assert_eq!(a.leave(&mut h, 3), None, "once");
        // A table that is not one: the VM cannot beat; the deltas wait.
        let mut b = Member::default();
        b.join(&mut h, P);
        h.shared
            .insert(VMS_KEY.to_owned(), (b"garbage".to_vec(), 9));
        assert_eq!(b.settle(&mut h, 3, share(1, 0, 0)), None);
        assert_eq!(live(b"garbage", 0, P), None);
    }

    #[test]
    fn the_value_round_trips_and_an_unreadable_one_is_none() {
        let t = Table {
            next: 7,
            entries: vec![Entry {
                id: 3,
                seen: 42,
                share: share(1, -2, 3),
            }],
        };
        let v = value(&t);
        assert_eq!(v.len(), 6 + ENTRY);
        assert_eq!(parse(&v), Some(t));
        assert_eq!(parse(&v[..v.len() - 1]), None);
        assert_eq!(parse(b"v2\0\0\0\0"), None);
        assert_eq!(parse(b"v1\0\0"), None);
        assert_eq!(int::<4>(b"ab", 0), [0; 4], "out of range: zeros, no panic");
    }
}
