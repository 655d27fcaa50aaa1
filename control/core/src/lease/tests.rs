use super::*;

const A: InstanceId = InstanceId([1; 16]);
const B: InstanceId = InstanceId([2; 16]);
const C: InstanceId = InstanceId([3; 16]);
const TTL: Duration = Duration::from_secs(30);
const P: u64 = 5_000;

fn s(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn body(id: InstanceId, counter: u64, via: Via) -> RenewalBody {
    RenewalBody {
        instance: id,
        counter,
        host: None,
        period_ms: Some(P),
        via,
        fanout: true,
        vms: None,
    }
}

fn on_host(id: InstanceId, counter: u64, via: Via, host: u8) -> RenewalBody {
    RenewalBody {
        host: Some(HostKey([host; 16])),
        ..body(id, counter, via)
    }
}

/// `id` renews on both paths with counters 1..=n, one period apart from `t0`; returns
/// the time of the last.
fn renew_both(l: &mut Leases, id: InstanceId, n: u64, t0: Instant) -> Instant {
    for c in 1..=n {
        let t = t0 + ms(P * (c - 1));
        l.renew(&body(id, c, Via::Admin), t).unwrap();
        l.renew(&body(id, c, Via::Data), t).unwrap();
    }
    t0 + ms(P * (n - 1))
}

fn expired(l: &mut Leases, now: Instant) -> Vec<(InstanceId, Expiry)> {
    l.judge(now).expired
}

#[test]
fn the_expiries_name_themselves_and_the_table_says_what_it_holds() {
    assert_eq!(
        [
            Expiry::Silent,
            Expiry::Replaced,
            Expiry::Unproven,
            Expiry::VmLost
        ]
        .map(Expiry::as_str),
        ["silent", "replaced", "unproven", "vm_lost"]
    );
    let mut l = Leases::new(TTL);
    assert_eq!(l.ttl(), TTL);
    assert!(l.is_empty());
    assert_eq!(l.len(), 0);
    l.renew(&body(A, 1, Via::Admin), Instant::now()).unwrap();
    assert!(!l.is_empty() && l.len() == 1 && l.holds(&A));
}

#[test]
fn a_lone_gateway_whose_data_path_renewed_expires_after_the_ttl_of_silence_on_both_paths() {
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    l.touch(A, t0); // never renewed: no lease, never judged
    assert!(l.is_empty());
    let last = renew_both(&mut l, A, 3, t0);
    assert_eq!(
        l.census(),
        Census {
            held: 1,
            enforceable: 1
        }
    );
    assert!(expired(&mut l, last + TTL).is_empty());
    l.touch(A, last + s(20)); // a tagged request is data-path evidence
    assert!(expired(&mut l, last + s(45)).is_empty());
    assert_eq!(expired(&mut l, last + s(51)), vec![(A, Expiry::Silent)]);
    assert!(l.is_empty() && !l.holds(&A));
}

#[test]
fn the_admin_path_silent_while_the_data_path_renews_expires_nothing() {
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    let mut t = renew_both(&mut l, A, 3, t0);
    for c in 4..40 {
        t += ms(P);
        l.renew(&body(A, c, Via::Data), t).unwrap();
        assert!(expired(&mut l, t).is_empty());
    }
    // And the reverse: the data path silent, the admin path renewing.
    for c in 40..80 {
        t += ms(P);
        l.renew(&body(A, c, Via::Admin), t).unwrap();
        assert!(expired(&mut l, t).is_empty(), "at counter {c}");
    }
}

#[test]
fn one_in_band_renewal_arms_the_lease_and_admin_renewals_alone_never_do() {
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    l.renew(&body(A, 1, Via::Admin), t0).unwrap();
    assert_eq!(l.census().enforceable, 0);
    l.renew(&body(A, 1, Via::Data), t0).unwrap();
    assert_eq!(
        l.census(),
        Census {
            held: 1,
            enforceable: 1
        }
    );
    assert!(expired(&mut l, t0 + TTL).is_empty());
    assert_eq!(expired(&mut l, t0 + TTL + ms(1)), vec![(A, Expiry::Silent)]);
    // Admin renewals alone never arm it: its silence is unproven.
    let mut l = Leases::new(TTL);
    for c in 1..=10 {
        l.renew(&body(B, c, Via::Admin), t0 + ms(P * c)).unwrap();
    }
    assert_eq!(l.census().enforceable, 0);
    assert_eq!(
        expired(&mut l, t0 + ms(P * 10) + TTL + ms(1)),
        vec![(B, Expiry::Unproven)]
    );
}

#[test]
fn two_gateways_renewing_out_of_phase_and_both_cut_hold_whatever_the_phase() {
    // A renews at t0 + k*P, B 2.5 s later; both paths of both are cut at `cut`.
    for offset_ms in [1, 500, 2_500, 4_000, 4_999] {
        for cut_ms in [1, 1_000, 2_600, 4_900] {
            let t0 = Instant::now();
            let mut l = Leases::new(TTL);
            renew_both(&mut l, A, 5, t0);
            renew_both(&mut l, B, 5, t0 + ms(offset_ms));
            let cut = t0 + ms(4 * P + cut_ms);
            // Whatever arrived before the cut; then silence for three TTLs.
            let mut held = 0;
            for k in 0..900 {
                let now = cut + ms(100 * k);
                let j = l.judge(now);
                assert!(
                    j.expired.is_empty(),
                    "offset {offset_ms} cut {cut_ms}: {j:?}"
                );
                held += j.held;
            }
            assert_eq!(held, 2, "each silent spell is counted once");
            assert_eq!(l.len(), 2);
        }
    }
}

#[test]
fn a_silent_gateway_expires_a_period_and_a_half_after_another_is_heard_after_its_silence() {
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    renew_both(&mut l, A, 3, t0);
    let last_b = renew_both(&mut l, B, 3, t0 + ms(2_500));
    let last_a = t0 + ms(2 * P);
    // Both silent: held (counted once, named at every judgement).
    let j = l.judge(last_a + TTL + ms(1));
    assert_eq!((j.held, j.holding), (1, vec![A]));
    let j = l.judge(last_a + TTL + ms(2));
    assert_eq!((j.held, j.holding), (0, vec![A]));
    // B comes back (the paths are back): A's own renewal may be due up to a period
    // later, so A is not ended at B's; still silent a period and a half after, it is.
    let back = last_b + s(29);
    l.renew(&body(B, 4, Via::Admin), back).unwrap();
    assert!(expired(&mut l, back).is_empty());
    assert!(expired(&mut l, back + ms(P * 3 / 2 - 1)).is_empty());
    assert_eq!(
        expired(&mut l, back + ms(P * 3 / 2)),
        vec![(A, Expiry::Silent)]
    );
    assert!(l.holds(&B));
    // A renewing within that time keeps its lease.
    let mut l = Leases::new(TTL);
    renew_both(&mut l, A, 3, t0);
    let last_b = renew_both(&mut l, B, 3, t0 + ms(2_500));
    let back = last_b + s(29);
    l.renew(&body(B, 4, Via::Admin), back).unwrap();
    l.renew(&body(A, 4, Via::Data), back + ms(P)).unwrap();
    assert!(expired(&mut l, back + ms(3 * P)).is_empty());
    assert!(l.holds(&A) && l.holds(&B));
    // The evidence must come after A's silence began (a period and a half after its
    // last renewal): evidence from before does not count.
    let mut l = Leases::new(TTL);
    renew_both(&mut l, A, 3, t0);
    renew_both(&mut l, C, 3, t0);
    l.touch(C, last_a + ms(P * 3 / 2));
    assert!(expired(&mut l, last_a + TTL + s(1)).is_empty());
    l.touch(C, last_a + ms(P * 3 / 2 + 1));
    assert_eq!(
        expired(&mut l, last_a + TTL + s(1)),
        vec![(A, Expiry::Silent)]
    );
}

#[test]
fn a_new_process_on_the_same_host_ends_the_old_one_a_ttl_after_its_last_renewal() {
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    l.renew(&on_host(A, 1, Via::Admin, 7), t0).unwrap();
    // The new process (B, same host key) renews from 1 s after A's last renewal; A's
    // admin-path-only lease would otherwise expire `unproven` (counted, never ended).
    let last_b = renew_on_host(&mut l, B, 1, 6, t0 + s(1));
    assert!(expired(&mut l, t0 + TTL).is_empty());
    assert_eq!(
        expired(&mut l, t0 + TTL + ms(1)),
        vec![(A, Expiry::Replaced)]
    );
    assert!(l.holds(&B) && last_b < t0 + TTL);
}

#[test]
fn a_draining_hot_restart_parent_that_still_renews_is_not_replaced() {
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    let mut t = t0;
    for c in 1..=20 {
        l.renew(&on_host(A, c, Via::Admin, 7), t).unwrap();
        l.renew(&on_host(B, c, Via::Admin, 7), t + s(1)).unwrap();
        assert!(expired(&mut l, t + s(2)).is_empty());
        t += ms(P);
    }
    // Another host's new process proves nothing about A.
    let mut l = Leases::new(TTL);
    l.renew(&on_host(A, 1, Via::Admin, 7), t0).unwrap();
    l.renew(&on_host(C, 1, Via::Admin, 8), t0 + s(1)).unwrap();
    l.renew(&on_host(C, 2, Via::Admin, 8), t0 + s(11)).unwrap();
    assert!(expired(&mut l, t0 + s(12)).is_empty());
    // Two processes started at the same instant: neither is the other's successor.
    let mut l = Leases::new(TTL);
    l.renew(&on_host(A, 1, Via::Admin, 7), t0).unwrap();
    renew_on_host(&mut l, B, 1, 7, t0);
    assert_eq!(
        expired(&mut l, t0 + TTL + ms(1)),
        vec![(A, Expiry::Unproven)]
    );
    // The newer process replaces the older, never the reverse.
    let mut l = Leases::new(TTL);
    l.renew(&on_host(B, 1, Via::Admin, 7), t0).unwrap();
    renew_on_host(&mut l, A, 1, 7, t0 + s(1));
    assert_eq!(
        expired(&mut l, t0 + TTL + ms(1)),
        vec![(B, Expiry::Replaced)]
    );
    assert!(l.holds(&A));
}

#[test]
fn counters_refuse_replays_per_path_and_a_duplicate_is_no_evidence() {
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    assert_eq!(l.renew(&body(A, 5, Via::Admin), t0), Ok(true));
    assert_eq!(
        l.renew(&body(A, 5, Via::Admin), t0),
        Err(RenewError::Duplicate)
    );
    assert_eq!(
        l.renew(&body(A, 4, Via::Admin), t0),
        Err(RenewError::Replay)
    );
    // The same counter on the other path is that path's evidence.
    assert_eq!(l.renew(&body(A, 5, Via::Data), t0), Ok(false));
    assert_eq!(l.renew(&body(A, 6, Via::Admin), t0), Ok(false));
    let later = t0 + s(20);
    assert_eq!(
        l.renew(&body(A, 6, Via::Admin), later),
        Err(RenewError::Duplicate)
    );
    assert_eq!(
        l.renew(&body(A, 3, Via::Data), later),
        Err(RenewError::Replay)
    );
    assert_eq!(expired(&mut l, t0 + s(31)), vec![(A, Expiry::Silent)]);
}

#[test]
fn an_expired_instance_keeps_its_counters_so_a_replay_cannot_revive_it() {
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    let last = renew_both(&mut l, A, 4, t0);
    assert_eq!(expired(&mut l, last + s(31)), vec![(A, Expiry::Silent)]);
    assert_eq!(
        l.renew(&body(A, 4, Via::Admin), last + s(32)),
        Err(RenewError::Replay)
    );
    assert_eq!(
        l.renew(&body(A, 2, Via::Data), last + s(32)),
        Err(RenewError::Replay)
    );
    assert!(!l.holds(&A));
    // A genuinely newer renewal takes it back (the gateway was alive after all).
    assert_eq!(l.renew(&body(A, 5, Via::Admin), last + s(33)), Ok(true));
    assert_eq!(
        l.renew(&body(A, 4, Via::Data), last + s(33)),
        Err(RenewError::Duplicate)
    );
}

#[test]
fn the_counters_kept_are_bounded_oldest_first() {
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    for i in 0..=MAX_GONE as u64 {
        let mut id = [0u8; 16];
        id[..8].copy_from_slice(&i.to_be_bytes());
        let t = t0 + ms(i);
        l.renew(&body(InstanceId(id), 9, Via::Admin), t).unwrap();
        l.judge(t + s(31));
    }
    assert_eq!(l.gone.len(), MAX_GONE);
    // The first expired is forgotten: its old counter is taken again.
    assert_eq!(
        l.renew(&body(InstanceId([0; 16]), 9, Via::Admin), t0 + s(100)),
        Ok(true)
    );
    let mut one = [0u8; 16];
    one[..8].copy_from_slice(&1u64.to_be_bytes());
    assert_eq!(
        l.renew(&body(InstanceId(one), 9, Via::Admin), t0 + s(100)),
        Err(RenewError::Replay)
    );
}

#[test]
fn a_renewal_period_over_a_third_of_the_ttl_is_refused() {
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    assert_eq!(l.max_period(), s(10));
    let mut r = body(A, 1, Via::Admin);
    r.period_ms = Some(10_001);
    assert_eq!(
        l.renew(&r, t0),
        Err(RenewError::PeriodTooLong {
            period_ms: 10_001,
            max_ms: 10_000
        })
    );
    assert!(l.is_empty());
    r.period_ms = Some(10_000);
    assert_eq!(l.renew(&r, t0), Ok(true));
}

#[test]
fn revive_takes_back_an_expired_lease_with_its_counters() {
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    let last = renew_both(&mut l, A, 3, t0);
    assert_eq!(expired(&mut l, last + s(31)), vec![(A, Expiry::Silent)]);
    l.revive(A, last + s(32));
    assert!(l.holds(&A));
    assert_eq!(l.census().enforceable, 0);
    assert_eq!(
        l.renew(&body(A, 3, Via::Admin), last + s(33)),
        Err(RenewError::Duplicate)
    );
    // It is judged from the revival.
    assert!(expired(&mut l, last + s(62)).is_empty());
    assert_eq!(expired(&mut l, last + s(63)), vec![(A, Expiry::Unproven)]);
    // Reviving what never expired does nothing.
    l.revive(B, last);
    assert!(!l.holds(&B));
}

#[test]
fn a_stall_extends_each_kind_of_evidence_and_the_host_key_rule() {
    let t0 = Instant::now();
    // The admin path is the latest evidence.
    let mut l = Leases::new(TTL);
    let last = renew_both(&mut l, A, 3, t0);
    l.renew(&body(A, 9, Via::Admin), last + s(10)).unwrap();
    l.extend(s(20));
    assert!(expired(&mut l, last + s(59)).is_empty());
    assert_eq!(expired(&mut l, last + s(61)), vec![(A, Expiry::Silent)]);
    // The data path is.
    let mut l = Leases::new(TTL);
    let last = renew_both(&mut l, A, 3, t0);
    l.touch(A, last + s(10));
    l.extend(s(20));
    assert!(expired(&mut l, last + s(59)).is_empty());
    assert_eq!(expired(&mut l, last + s(61)), vec![(A, Expiry::Silent)]);
    // A stall moves the replaced rule's clock too: B renewed before a 20 s stall, its
    // successor A renews after it.
    let mut l = Leases::new(TTL);
    l.renew(&on_host(B, 1, Via::Admin, 7), t0).unwrap();
    l.extend(s(20));
    renew_on_host(&mut l, A, 1, 12, t0 + s(21));
    assert!(
        expired(&mut l, t0 + s(50)).is_empty(),
        "B is 30 s silent after the stall, not 50"
    );
    assert_eq!(
        expired(&mut l, t0 + s(50) + ms(1)),
        vec![(B, Expiry::Replaced)]
    );
    // The successor's renewal after A's last evidence is still after it once both moved:
    // B renewed (8 s after A's last, once) before a 20 s stall; A is replaced at the TTL.
    let mut l = Leases::new(TTL);
    let last_a = renew_on_host(&mut l, A, 1, 3, t0);
    l.renew(&on_host(B, 1, Via::Admin, 7), last_a + s(8))
        .unwrap();
    l.extend(s(20));
    assert_eq!(
        expired(&mut l, last_a + s(20) + TTL + ms(1)),
        vec![(A, Expiry::Replaced)]
    );
}

#[test]
fn a_stall_moves_when_another_was_heard_too() {
    // A silent past the TTL, B heard at `h` (after A's silence began): A expires 1.5
    // periods after `h`; a 2 s stall of our own after `h` moves that by 2 s.
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    let last = renew_both(&mut l, A, 3, t0);
    let h = last + TTL + s(1);
    l.renew(&body(B, 1, Via::Admin), h).unwrap();
    l.extend(s(2));
    let due = h + ms(P * 3 / 2) + s(2);
    assert!(expired(&mut l, due - ms(1)).is_empty());
    assert_eq!(expired(&mut l, due), vec![(A, Expiry::Silent)]);
}

#[test]
fn a_sender_that_does_not_say_its_period_is_held_on_the_default_period() {
    // No period_ms: a sixth of the TTL (5 s), so B heard 7.5 s after A's last evidence
    // is not yet "since A went silent"; 7.6 s is.
    for (heard_ms, expires) in [(7_500, false), (7_600, true)] {
        let t0 = Instant::now();
        let mut l = Leases::new(TTL);
        for c in 1..=3 {
            let mut r = body(A, c, Via::Data);
            r.period_ms = None;
            l.renew(&r, t0).unwrap();
        }
        l.renew(&body(B, 1, Via::Admin), t0 + ms(heard_ms)).unwrap();
        let j = l.judge(t0 + s(31));
        assert_eq!(
            !j.expired.is_empty(),
            expires,
            "heard at {heard_ms} ms: {j:?}"
        );
    }
    // A revived lease is judged on the default period too.
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    let last = renew_both(&mut l, A, 3, t0);
    assert_eq!(expired(&mut l, last + s(31)), vec![(A, Expiry::Silent)]);
    l.revive(A, last + s(32));
    l.renew(&body(B, 1, Via::Admin), last + s(32) + ms(7_600))
        .unwrap();
    assert_eq!(expired(&mut l, last + s(63)), vec![(A, Expiry::Unproven)]);
}

#[test]
fn a_stall_of_our_own_extends_every_lease() {
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    let last = renew_both(&mut l, A, 3, t0);
    l.extend(s(20));
    assert!(expired(&mut l, last + s(45)).is_empty());
    assert_eq!(expired(&mut l, last + s(51)), vec![(A, Expiry::Silent)]);
    let p = ms(100);
    assert_eq!(stall(ms(150), p), Duration::ZERO);
    assert_eq!(stall(ms(200), p), Duration::ZERO);
    assert_eq!(stall(ms(1100), p), ms(1000));
}

fn with_vms(id: InstanceId, counter: u64, via: Via, vms: &[u32]) -> RenewalBody {
    RenewalBody {
        vms: Some(vms.to_vec()),
        ..body(id, counter, via)
    }
}

fn tagged(id: InstanceId, vm: u32) -> InstanceTag {
    InstanceTag {
        instance: id,
        vm: Some(vm),
    }
}

#[test]
fn a_vm_the_renewals_leave_out_for_the_ttl_is_lost_and_only_it() {
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    // VMs 1 and 2 listed; VM 3 known from a request only.
    l.renew(&with_vms(A, 1, Via::Data, &[1, 2]), t0).unwrap();
    l.touch(tagged(A, 3), t0 + s(1));
    // From t0 + 5 s, every period's renewal lists VM 1 only (VM 2 trapped at t0).
    let mut c = 1;
    let mut at = t0;
    let mut lost = Vec::new();
    while lost.is_empty() {
        c += 1;
        at += ms(P);
        l.renew(&with_vms(A, c, Via::Data, &[1]), at).unwrap();
        let j = l.judge(at);
        assert!(j.expired.is_empty());
        lost = j.lost;
        assert!(at < t0 + s(60), "never lost");
    }
    // Lost at the first renewal more than the TTL after the first that left it out (one
    // period after its last listing), with VM 3 (whose request came a second later),
    // left out by that same renewal.
    assert_eq!(at, t0 + TTL + ms(2 * P));
    assert_eq!(lost, vec![(A, 2), (A, 3)]);
    // Judged once: it left the list.
    assert!(!l.judge(at).lost.contains(&(A, 2)));
    // A request tagged with a lost VM brings it back: judged again from then, lost
    // again after another TTL of renewals without it.
    l.revive_vm(A, 2, at);
    let revived = at;
    let mut again = Vec::new();
    while again.is_empty() {
        c += 1;
        at += ms(P);
        l.renew(&with_vms(A, c, Via::Data, &[1]), at).unwrap();
        again = l.judge(at).lost;
        assert!(at < revived + s(60), "a revived VM is judged again");
    }
    assert_eq!((again, at), (vec![(A, 2)], revived + TTL + ms(2 * P)));
    // A VM the renewals list is never lost.
    l.revive_vm(A, 2, at);
    for _ in 0..3 {
        c += 1;
        at += ms(P);
        l.renew(&with_vms(A, c, Via::Data, &[1, 2]), at).unwrap();
        assert!(l.judge(at).lost.is_empty());
    }
}

#[test]
fn no_vm_is_judged_without_renewals_that_list_them_or_when_the_renewals_stop() {
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    // An older filter: no list; its requests name no VM, or one, nothing is judged.
    let last = renew_both(&mut l, A, 3, t0);
    l.touch(tagged(A, 7), last);
    let mut c = 3;
    let mut at = last;
    for _ in 0..12 {
        c += 1;
        at += ms(P);
        l.renew(&body(A, c, Via::Data), at).unwrap();
        assert!(l.judge(at).lost.is_empty());
    }
    // A listing instance that falls silent: its VMs are not judged one by one (the
    // instance's own expiry is the rule there), however long.
    l.renew(&with_vms(B, 1, Via::Data, &[1, 2]), at).unwrap();
    l.renew(&with_vms(B, 2, Via::Data, &[1]), at + ms(P))
        .unwrap();
    let j = l.judge(at + s(600));
    assert!(j.lost.is_empty(), "{j:?}");
    // A stall of kvguard-control: the gap runs from the first renewal that left the VM
    // out, after it.
    let mut l = Leases::new(TTL);
    l.renew(&with_vms(C, 1, Via::Data, &[1, 2]), t0).unwrap();
    l.extend(s(100));
    let out = t0 + s(100) + ms(P);
    l.renew(&with_vms(C, 2, Via::Data, &[1]), out).unwrap();
    assert!(l.judge(out).lost.is_empty());
    l.renew(&with_vms(C, 3, Via::Data, &[1]), out + TTL)
        .unwrap();
    assert!(l.judge(out + TTL).lost.is_empty());
    l.renew(&with_vms(C, 4, Via::Data, &[1]), out + TTL + ms(1))
        .unwrap();
    assert_eq!(l.judge(out + TTL + ms(1)).lost, vec![(C, 2)]);
    // A VM left out just before a stall of kvguard-control: the gap counts from the
    // stall's end (the renewals listing it again may still be unread).
    let mut l = Leases::new(TTL);
    l.renew(&with_vms(C, 1, Via::Data, &[1, 2]), t0).unwrap();
    l.renew(&with_vms(C, 2, Via::Data, &[1]), t0 + ms(P))
        .unwrap();
    l.extend(s(100));
    let after = t0 + ms(P) + s(100) + ms(1);
    l.renew(&with_vms(C, 3, Via::Data, &[1]), after).unwrap();
    assert!(l.judge(after).lost.is_empty());
    l.renew(&with_vms(C, 4, Via::Data, &[1, 2]), after + ms(P))
        .unwrap();
    assert!(l.judge(after + TTL).lost.is_empty());
}

#[test]
fn a_gateway_that_stalls_and_resumes_loses_no_vm() {
    // The whole Envoy stops for a minute; its first renewal after comes from the VM
    // whose tick fired first, before the others beat: it lists that VM only. The next
    // lists them all again.
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    l.renew(&with_vms(A, 1, Via::Data, &[1, 2, 3]), t0).unwrap();
    l.touch(tagged(A, 2), t0 + ms(10));
    let back = t0 + s(60);
    l.renew(&with_vms(A, 2, Via::Data, &[3]), back).unwrap();
    assert!(l.judge(back).lost.is_empty());
    l.renew(&with_vms(A, 3, Via::Data, &[1, 2, 3]), back + ms(P))
        .unwrap();
    for k in 2..20 {
        let at = back + ms(k * P);
        l.renew(&with_vms(A, 2 + k, Via::Data, &[1, 2, 3]), at)
            .unwrap();
        assert!(l.judge(at).lost.is_empty());
    }
    // A request of a VM after the renewals left it out brings it back too: absent
    // again from the first listing after the request.
    let out = back + ms(20 * P);
    l.renew(&with_vms(A, 100, Via::Data, &[1, 3]), out).unwrap();
    l.touch(tagged(A, 2), out + s(1));
    let n = TTL.as_millis() as u64 / P + 1;
    for k in 1..=n {
        let at = out + ms(k * P);
        l.renew(&with_vms(A, 100 + k, Via::Data, &[1, 3]), at)
            .unwrap();
        assert!(l.judge(at).lost.is_empty(), "{k}");
    }
    let at = out + ms((n + 1) * P);
    l.renew(&with_vms(A, 101 + n, Via::Data, &[1, 3]), at)
        .unwrap();
    assert_eq!(l.judge(at).lost, vec![(A, 2)]);
}

#[test]
fn a_lease_remembers_at_most_max_vms_the_longest_unseen_forgotten_first() {
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    l.renew(&body(A, 1, Via::Data), t0).unwrap();
    for v in 0..=MAX_VMS as u32 {
        l.touch(tagged(A, v + 1), t0 + ms(u64::from(v)));
    }
    let lease = &l.table[&A];
    assert_eq!(lease.vms.len(), MAX_VMS);
    assert!(!lease.vms.contains_key(&1), "the longest unseen went");
    // Seen again: kept at the later time, never moved back.
    let mut lease = lease.clone();
    lease.saw_vm(5, t0);
    assert_eq!(lease.vms[&5].seen, t0 + ms(4));
}

#[test]
fn a_renewal_that_leaves_a_vm_out_at_the_instant_it_was_seen_does_not_count_it_absent() {
    // The request (or listing) and the renewal carry the same receipt time: which came
    // first is unknown, so the VM is not absent from that renewal on.
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    l.renew(&with_vms(A, 1, Via::Data, &[1, 2]), t0).unwrap();
    l.renew(&with_vms(A, 2, Via::Data, &[1]), t0).unwrap();
    // Left out every period from then on: absent from the next listing, not from t0.
    let later = t0 + ms(P);
    let n = TTL.as_millis() as u64 / P;
    for k in 0..=n {
        let at = later + ms(k * P);
        l.renew(&with_vms(A, 3 + k, Via::Data, &[1]), at).unwrap();
        assert!(l.judge(at).lost.is_empty(), "absent from `later` only");
    }
    let at = later + ms(n * P) + ms(1);
    l.renew(&with_vms(A, 3 + n + 1, Via::Data, &[1]), at)
        .unwrap();
    assert_eq!(l.judge(at).lost, vec![(A, 2)]);
}

#[test]
fn a_listing_after_a_stall_of_its_gateway_marks_no_vm_absent() {
    // The gateway stopped 20 s (past the listing's 3 periods) and its VM renews before it
    // beats: the listings of that tick (both paths) leave it out; so does the first after
    // a second stop a second later. The next, a period on, lists it again.
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    l.renew(&with_vms(A, 1, Via::Data, &[1]), t0).unwrap();
    let back = t0 + s(20);
    l.renew(&with_vms(A, 2, Via::Data, &[]), back).unwrap();
    l.renew(&with_vms(A, 2, Via::Admin, &[]), back + ms(3))
        .unwrap();
    let again = back + s(32);
    l.renew(&with_vms(A, 3, Via::Data, &[]), again).unwrap();
    assert!(l.judge(again).lost.is_empty());
    l.renew(&with_vms(A, 4, Via::Data, &[1]), again + ms(P))
        .unwrap();
    assert!(l.judge(again + ms(P)).lost.is_empty());
    // A listing within the 3 periods after the last one does mark the VM absent.
    l.renew(&with_vms(A, 5, Via::Data, &[]), again + ms(2 * P))
        .unwrap();
    assert_eq!(l.table[&A].vms[&1].absent, Some(again + ms(2 * P)));
    // So does one exactly 3 periods after.
    l.renew(&with_vms(A, 6, Via::Data, &[1]), again + ms(3 * P))
        .unwrap();
    l.renew(&with_vms(A, 7, Via::Data, &[]), again + ms(6 * P))
        .unwrap();
    assert_eq!(l.table[&A].vms[&1].absent, Some(again + ms(6 * P)));
    // A stall of kvguard-control's own after a listing that followed the gateway's
    // stall: the listings it could not read meanwhile keep their period.
    let mut l = Leases::new(TTL);
    l.renew(&with_vms(B, 1, Via::Data, &[1]), t0).unwrap();
    l.renew(&with_vms(B, 2, Via::Data, &[]), back).unwrap();
    l.extend(s(10));
    l.renew(&with_vms(B, 3, Via::Data, &[]), back + s(10) + ms(1))
        .unwrap();
    assert_eq!(l.table[&B].vms[&1].absent, None);
}

#[test]
fn a_successor_silent_from_the_instant_of_the_judgement_no_longer_takes_the_listener() {
    // B proved its life on L_A (it answered); C, a later process with another host key,
    // proves its life there until exactly 1.5 periods before B's TTL passes: silent from
    // that instant, it no longer takes the socket, which is asked for B.
    let t0 = Instant::now() + s(1);
    let mut l = Leases::new(TTL);
    prove_on_host(&mut l, B, (1, 100), t0, (7, L_A));
    let last_b = t0 + ms(P * 99);
    judge_answering(&mut l, last_b, ProbeAnswer::Alive);
    let at_b = last_b + TTL + ms(1);
    let last_c = at_b - ms(P * 3 / 2);
    prove_on_host(&mut l, C, (1, 5), last_c - ms(4 * P), (9, L_A));
    let j = l.judge(at_b);
    assert!(j.expired.is_empty(), "{j:?}");
    assert!(j.probes.contains(&(B, L_A.parse().unwrap())), "{j:?}");
}

fn proof(counter: u64, host: Option<u8>, listener: Option<&str>) -> Proof {
    Proof {
        counter,
        host: host.map(|h| HostKey([h; 16])),
        listener: listener.map(|a| a.parse().unwrap()),
    }
}

const L_A: &str = "10.0.0.1:8080";
const L_B: &str = "10.0.0.2:8080";

/// `id` proves its life on requests with counters `from..=to`, one period apart from
/// `t0`, with host key `host`, from listener `listener`.
fn prove_on_host(
    l: &mut Leases,
    id: InstanceId,
    (from, to): (u64, u64),
    t0: Instant,
    (host, listener): (u8, &str),
) {
    for c in from..=to {
        let t = t0 + ms(P * (c - from));
        l.prove(tagged(id, 1), &proof(c, Some(host), Some(listener)), t)
            .unwrap();
    }
}

/// `id` proves its life on requests with counters 1..=n, one period apart from `t0`,
/// from listener `listener`; returns the time of the last.
fn prove_n(l: &mut Leases, id: InstanceId, n: u64, t0: Instant, listener: &str) -> Instant {
    for c in 1..=n {
        let t = t0 + ms(P * (c - 1));
        let _ = l.prove(tagged(id, 1), &proof(c, None, Some(listener)), t);
    }
    t0 + ms(P * (n - 1))
}

/// Answers every probe the judgement at `now` asks with `answer`; returns the judgement.
fn judge_answering(l: &mut Leases, now: Instant, answer: ProbeAnswer) -> Judgement {
    let j = l.judge(now);
    for (id, a) in &j.probes {
        l.probed(*id, *a, answer, now);
    }
    j
}

#[test]
fn the_first_proof_on_a_request_takes_and_arms_the_lease_and_a_replay_proves_nothing() {
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    assert_eq!(
        l.prove(tagged(A, 2), &proof(0, Some(7), None), t0),
        Ok(true)
    );
    assert!(l.holds(&A));
    // The period's counter again (another request, another VM): no new evidence.
    assert_eq!(
        l.prove(tagged(A, 1), &proof(0, None, None), t0 + s(20)),
        Err(RenewError::Duplicate)
    );
    // The in-band renewal of that counter is no new evidence either, but it shows the
    // path carries in-band renewals: silence is evidence from then on.
    assert_eq!(
        l.renew(&body(A, 0, Via::Data), t0 + s(20)),
        Err(RenewError::Duplicate)
    );
    assert_eq!(l.census().enforceable, 1);
    assert!(expired(&mut l, t0 + TTL).is_empty());
    assert_eq!(expired(&mut l, t0 + TTL + ms(1)), vec![(A, Expiry::Silent)]);
    // Its counters are kept: a replayed proof cannot take the lease back, a newer one can.
    assert_eq!(
        l.prove(tagged(A, 1), &proof(0, None, None), t0 + s(40)),
        Err(RenewError::Replay)
    );
    assert!(!l.holds(&A));
    assert_eq!(
        l.prove(tagged(A, 1), &proof(1, None, None), t0 + s(41)),
        Ok(true)
    );
    // Older than the last accepted on the data path: a replay, no evidence; but what it
    // says of the gateway is signed (a queueing hop delivers a period's proof after the
    // next period's renewal): its listener is taken, and asked.
    assert_eq!(
        l.prove(tagged(A, 1), &proof(0, None, Some(L_A)), t0 + s(42)),
        Err(RenewError::Replay)
    );
    assert_eq!(l.calibrate(A, t0 + s(42)), Some(L_A.parse().unwrap()));
    // A newer counter is evidence, as an in-band renewal is.
    assert_eq!(
        l.prove(tagged(A, 1), &proof(2, None, None), t0 + s(50)),
        Ok(false)
    );
    assert_eq!(
        l.renew(&body(A, 2, Via::Data), t0 + s(50)),
        Err(RenewError::Duplicate)
    );
    assert_eq!(l.renew(&body(A, 3, Via::Data), t0 + s(55)), Ok(false));
}

#[test]
fn proofs_alone_without_a_trusted_listener_leave_silence_unproven() {
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    for c in 1..=5 {
        l.prove(tagged(A, 1), &proof(c, None, None), t0 + ms(P * c))
            .unwrap();
    }
    let last = t0 + ms(5 * P);
    assert_eq!(
        l.census().enforceable,
        0,
        "no request is no evidence of death"
    );
    let j = l.judge(last + TTL + ms(1));
    assert!(j.probes.is_empty(), "no listener: nothing to ask");
    assert_eq!(j.expired, vec![(A, Expiry::Unproven)]);
}

#[test]
fn a_listener_is_asked_while_the_gateway_lives_and_trusted_once_it_answers() {
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    l.prove(tagged(A, 1), &proof(1, None, Some(L_A)), t0)
        .unwrap();
    let a: SocketAddr = L_A.parse().unwrap();
    // Asked at once (the shell, on the proof; else the judgement), then not again
    // within the TTL while it does not answer.
    assert_eq!(l.calibrate(A, t0), Some(a));
    assert_eq!(l.calibrate(A, t0), None);
    assert!(l.judge(t0).probes.is_empty());
    assert_eq!(l.calibrate(B, t0), None, "no lease");
    l.probed(A, a, ProbeAnswer::Refused, t0 + ms(1));
    assert!(l.judge(t0 + TTL - ms(1)).probes.is_empty());
    assert_eq!(
        l.census().enforceable,
        0,
        "refused while alive: not trusted"
    );
    l.prove(tagged(A, 1), &proof(2, None, Some(L_A)), t0 + s(25))
        .unwrap();
    assert_eq!(l.judge(t0 + TTL).probes, vec![(A, a)]);
    // An answer for another listener is not this one's.
    l.probed(A, L_B.parse().unwrap(), ProbeAnswer::Alive, t0 + TTL);
    l.probed(B, a, ProbeAnswer::Alive, t0 + TTL);
    assert_eq!(l.census().enforceable, 0);
    l.probed(A, a, ProbeAnswer::Alive, t0 + TTL);
    assert_eq!(l.census().enforceable, 1);
    assert_eq!(l.calibrate(A, t0 + s(100)), None, "trusted: nothing to ask");
    // Trusted: never asked again while it lives, and its listener stays.
    l.prove(tagged(A, 1), &proof(3, None, Some(L_B)), t0 + s(40))
        .unwrap();
    assert!(l.judge(t0 + s(41)).probes.is_empty());
    assert!(l.judge(t0 + s(41) + TTL - s(1)).probes.is_empty());
    // Silent past the TTL: asked, and the answer decides.
    let silent = t0 + s(40) + TTL + ms(1);
    let j = l.judge(silent);
    assert_eq!((j.probes, j.expired), (vec![(A, a)], vec![]));
    // Asked once a period while the answer is on its way.
    assert!(l.judge(silent + ms(P - 1)).probes.is_empty());
    l.probed(A, a, ProbeAnswer::Refused, silent + ms(5));
    assert_eq!(expired(&mut l, silent + ms(10)), vec![(A, Expiry::Dead)]);
}

#[test]
fn a_silent_gateway_whose_listener_does_not_answer_is_dead() {
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    let last = prove_n(&mut l, A, 2, t0, L_A);
    judge_answering(&mut l, last, ProbeAnswer::Alive);
    assert_eq!(l.census().enforceable, 1);
    let j = judge_answering(&mut l, last + TTL + ms(1), ProbeAnswer::Timeout);
    assert!(
        j.expired.is_empty(),
        "judged on the answer, at the next judgement"
    );
    assert_eq!(expired(&mut l, last + TTL + ms(2)), vec![(A, Expiry::Dead)]);
    // An answer from before the silence reached the TTL decides nothing.
    let mut l = Leases::new(TTL);
    let last = prove_n(&mut l, A, 2, t0, L_A);
    judge_answering(&mut l, last, ProbeAnswer::Alive);
    l.probed(
        A,
        L_A.parse().unwrap(),
        ProbeAnswer::Refused,
        last + TTL - ms(1),
    );
    let j = l.judge(last + TTL + ms(1));
    assert!(j.expired.is_empty() && j.probes.len() == 1, "{j:?}");
}

#[test]
fn a_frozen_gateway_whose_kernel_answers_is_held_asked_each_period_and_kept_when_it_resumes() {
    for inband in [false, true] {
        let t0 = Instant::now();
        let mut l = Leases::new(TTL);
        let last = prove_n(&mut l, A, 2, t0, L_A);
        if inband {
            l.renew(&body(A, 3, Via::Data), last).unwrap();
        }
        judge_answering(&mut l, last, ProbeAnswer::Alive);
        let mut now = last + TTL + ms(1);
        let j = judge_answering(&mut l, now, ProbeAnswer::Alive);
        assert!(j.expired.is_empty() && j.held == 0);
        // Held, counted once for the spell, asked again each period.
        now += ms(1);
        let j = l.judge(now);
        assert_eq!((j.held, j.probes.len(), j.expired.len()), (1, 0, 0));
        let mut asked = 0;
        for _ in 0..20 {
            now += ms(P / 2);
            let j = judge_answering(&mut l, now, ProbeAnswer::Alive);
            assert!(j.expired.is_empty() && j.held == 0);
            asked += j.probes.len();
        }
        assert_eq!(asked, 10, "one probe a period");
        // It resumes: its evidence takes the lease on; a later death is judged anew.
        l.prove(tagged(A, 1), &proof(9, None, Some(L_A)), now)
            .unwrap();
        assert!(l.judge(now + TTL).probes.is_empty());
        judge_answering(&mut l, now + TTL + ms(1), ProbeAnswer::Refused);
        assert_eq!(
            expired(&mut l, now + TTL + ms(2)),
            vec![(A, Expiry::Dead)],
            "inband {inband}"
        );
    }
}

#[test]
fn in_band_silence_without_a_trusted_listener_is_silent_and_others_still_hold_the_probe() {
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    let last = prove_n(&mut l, A, 2, t0, L_A);
    l.renew(&body(A, 3, Via::Data), last).unwrap();
    judge_answering(&mut l, last, ProbeAnswer::Timeout);
    let j = l.judge(last + TTL + ms(1));
    assert_eq!((j.expired, j.probes), (vec![(A, Expiry::Silent)], vec![]));
    // With another gateway not heard since: held (the network may be the suspect), the
    // listeners asked; a timeout keeps the hold, a refusal (a reachable host where
    // nothing listens) ends it.
    let mut l = Leases::new(TTL);
    let last = prove_n(&mut l, A, 2, t0, L_A);
    prove_n(&mut l, B, 2, t0, L_B);
    judge_answering(&mut l, last, ProbeAnswer::Alive);
    let silent = last + TTL + ms(1);
    let j = l.judge(silent);
    assert_eq!((j.held, j.probes.len(), j.expired.len()), (2, 2, 0));
    l.probed(A, L_A.parse().unwrap(), ProbeAnswer::Refused, silent);
    l.probed(B, L_B.parse().unwrap(), ProbeAnswer::Timeout, silent);
    let j = l.judge(silent + ms(1));
    assert_eq!(j.expired, vec![(A, Expiry::Dead)]);
    assert_eq!((j.held, j.probes.len()), (0, 0));
    assert!(l.holds(&B));
    // Alone now, B's unanswered handshake decides.
    let j = l.judge(silent + ms(2));
    assert_eq!(j.expired, vec![(B, Expiry::Dead)]);
}

#[test]
fn probes_per_judgement_are_bounded() {
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    for i in 0..(MAX_PROBES as u8 + 5) {
        let id = InstanceId([i; 16]);
        let addr = format!("10.0.1.{i}:8080");
        l.prove(tagged(id, 1), &proof(1, None, Some(&addr)), t0)
            .unwrap();
    }
    let j = l.judge(t0);
    assert_eq!(j.probes.len(), MAX_PROBES);
    // The rest are asked at the next judgement.
    assert_eq!(l.judge(t0 + ms(1)).probes.len(), 5);
}

#[test]
fn a_host_key_two_live_gateways_share_from_two_listeners_judges_neither() {
    let t0 = Instant::now();
    let shared = |l: &mut Leases, a: InstanceId, b: InstanceId, la: &str, lb: &str| {
        // Both renew with host 7, interleaved, for a while; then A falls silent.
        for c in 1..=4 {
            let t = t0 + ms(P * c);
            l.prove(tagged(a, 1), &proof(c, Some(7), Some(la)), t)
                .unwrap();
            l.prove(tagged(b, 1), &proof(c, Some(7), Some(lb)), t + s(1))
                .unwrap();
        }
        for c in 5..=8 {
            l.prove(
                tagged(b, 1),
                &proof(c, Some(7), Some(lb)),
                t0 + ms(P * c) + s(1),
            )
            .unwrap();
        }
    };
    let mut l = Leases::new(TTL);
    shared(&mut l, A, B, L_A, L_B);
    let j = judge_answering(&mut l, t0 + ms(P * 8) + s(1), ProbeAnswer::Alive);
    assert_eq!(j.shared, vec![(A, HostKey([7; 16])), (B, HostKey([7; 16]))]);
    assert!(j.expired.is_empty(), "A silent for 4 periods: not replaced");
    // Counted once.
    let j = judge_answering(&mut l, t0 + ms(P * 8 + 1) + s(1), ProbeAnswer::Alive);
    assert!(j.shared.is_empty());
    // Frozen past the TTL while B (started a second after it) renews on: neither replaced
    // nor robbed of its listener by B's renewals; the listener answers, A is held.
    for c in 9..=14 {
        let t = t0 + ms(P * c) + s(1);
        l.prove(tagged(B, 1), &proof(c, Some(7), Some(L_B)), t)
            .unwrap();
        let j = judge_answering(&mut l, t, ProbeAnswer::Alive);
        assert!(j.expired.is_empty(), "{j:?}");
    }
    assert!(l.holds(&A) && t0 + ms(P * 14) > t0 + ms(P * 4) + TTL);
    // The same listener (a hot restart's parent A and child B, both heard live): A is
    // replaced once silent for the TTL (a draining parent may be frozen), not before.
    let mut l = Leases::new(TTL);
    shared(&mut l, A, B, L_A, L_A);
    let j = l.judge(t0 + ms(P * 8) + s(1));
    assert!(j.shared.is_empty());
    assert!(j.expired.is_empty(), "A silent for 4 periods: {j:?}");
    let last_a = t0 + ms(P * 4);
    assert!(expired(&mut l, last_a + TTL).is_empty());
    assert_eq!(
        expired(&mut l, last_a + TTL + ms(1)),
        vec![(A, Expiry::Replaced)]
    );
    // A process restarted in place on another listener, heard only after the old one's
    // last evidence: replaced once the old one is silent for the TTL.
    let mut l = Leases::new(TTL);
    l.prove(tagged(A, 1), &proof(1, Some(7), Some(L_A)), t0)
        .unwrap();
    prove_on_host(&mut l, B, (1, 6), t0 + s(1), (7, L_B));
    let j = l.judge(t0 + TTL + ms(1));
    assert!(j.shared.is_empty());
    assert_eq!(j.expired, vec![(A, Expiry::Replaced)]);
}

#[test]
fn a_proof_value_is_verified_once_and_a_bad_one_never_remembered() {
    let mut l = Leases::new(TTL);
    let mut checks = 0;
    assert!(l.verified(b"v1", || {
        checks += 1;
        true
    }));
    assert!(l.verified(b"v1", || {
        checks += 1;
        false
    }));
    assert_eq!(checks, 1);
    assert!(!l.verified(b"bad", || false));
    assert!(l.verified(b"bad", || true));
    // Below the bound, each stays remembered beside the others.
    assert!(l.verified(b"v1", || false) && l.verified(b"bad", || false));
    // Bounded: all forgotten at once beyond the bound.
    for i in 0..MAX_VERIFIED {
        l.verified(format!("x{i}").as_bytes(), || true);
    }
    assert!(!l.verified(b"v1", || false));
    assert!(l.verified.len() <= MAX_VERIFIED);
}

#[test]
fn the_probe_waits_an_eighth_of_the_ttl_between_100_ms_and_1_s() {
    assert_eq!(probe_timeout(s(30)), s(1));
    assert_eq!(probe_timeout(s(2)), ms(250));
    assert_eq!(probe_timeout(ms(400)), ms(100));
    assert_eq!(
        [
            ProbeAnswer::Alive,
            ProbeAnswer::Refused,
            ProbeAnswer::Timeout
        ]
        .map(ProbeAnswer::as_str),
        ["alive", "refused", "timeout"]
    );
    assert_eq!(Expiry::Dead.as_str(), "dead");
}

#[test]
fn a_stall_moves_the_probes_and_their_answers() {
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    let last = prove_n(&mut l, A, 1, t0, L_A);
    judge_answering(&mut l, last, ProbeAnswer::Alive);
    let silent = last + TTL + ms(1);
    judge_answering(&mut l, silent, ProbeAnswer::Refused);
    // Our own stall: every lease (and the answer) moves by it, so nothing is judged.
    l.extend(s(60));
    assert!(l.judge(silent + s(1)).expired.is_empty());
    assert_eq!(
        expired(&mut l, silent + s(60) + ms(1)),
        vec![(A, Expiry::Dead)]
    );
}

#[test]
fn a_listener_another_instance_proved_its_life_on_since_no_longer_speaks_for_this_one() {
    // A hot restart without a node id: the child listens on the parent's socket, so a
    // handshake there says nothing of the parent; its silence is judged without it.
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    let last = prove_n(&mut l, A, 2, t0, L_A);
    l.renew(&body(A, 3, Via::Data), last).unwrap();
    judge_answering(&mut l, last, ProbeAnswer::Alive);
    // The child, on the same listener, renews and proves on.
    let mut t = last;
    for c in 1..=5 {
        t = last + ms(P * c);
        l.prove(tagged(B, 1), &proof(c, None, Some(L_A)), t)
            .unwrap();
        l.renew(&body(B, c, Via::Admin), t).unwrap();
        judge_answering(&mut l, t, ProbeAnswer::Alive);
    }
    let j = judge_answering(&mut l, last + TTL + ms(1), ProbeAnswer::Alive);
    assert!(j.probes.iter().all(|(id, _)| *id != A), "{j:?}");
    assert_eq!(j.expired, vec![(A, Expiry::Silent)]);
    assert!(l.holds(&B) && t < last + TTL);
}

#[test]
fn a_process_first_heard_at_the_instant_of_the_old_ones_last_evidence_succeeds_it() {
    // Restart in place on another listener, the new process's first proof at the very
    // instant of the old one's last: not both live, so the key is not shared.
    let t0 = Instant::now() + s(1);
    let mut l = Leases::new(TTL);
    l.prove(tagged(A, 1), &proof(1, Some(7), Some(L_A)), t0 - s(1))
        .unwrap();
    l.prove(tagged(A, 1), &proof(2, Some(7), Some(L_A)), t0)
        .unwrap();
    l.prove(tagged(B, 1), &proof(1, Some(7), Some(L_B)), t0)
        .unwrap();
    prove_on_host(&mut l, B, (2, 6), t0 + ms(P), (7, L_B));
    let j = l.judge(t0 + TTL + ms(1));
    assert!(j.shared.is_empty(), "{j:?}");
    assert_eq!(j.expired, vec![(A, Expiry::Replaced)]);
}

#[test]
fn another_gateway_heard_on_its_own_listener_leaves_this_ones_listener_speaking_for_it() {
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    let last = prove_n(&mut l, A, 2, t0, L_A);
    judge_answering(&mut l, last, ProbeAnswer::Alive);
    // B, on its own listener, lives on past A's silence.
    let mut t = last;
    for c in 1..=8 {
        t = last + ms(P * c);
        l.prove(tagged(B, 1), &proof(c, None, Some(L_B)), t)
            .unwrap();
    }
    let silent = last + TTL + ms(1);
    assert!(t > silent);
    let j = l.judge(silent);
    assert!(j.probes.contains(&(A, L_A.parse().unwrap())), "{j:?}");
    l.probed(A, L_A.parse().unwrap(), ProbeAnswer::Refused, silent);
    assert_eq!(expired(&mut l, silent + ms(1)), vec![(A, Expiry::Dead)]);
    // One heard on the same listener only at the instant of A's last evidence took
    // nothing over: A's listener is still asked for it.
    let mut l = Leases::new(TTL);
    let last = prove_n(&mut l, A, 2, t0, L_A);
    judge_answering(&mut l, last, ProbeAnswer::Alive);
    l.prove(tagged(C, 1), &proof(1, None, Some(L_A)), last)
        .unwrap();
    let j = l.judge(last + TTL + ms(1));
    assert_eq!(j.probes, vec![(A, L_A.parse().unwrap())], "{j:?}");
}

#[test]
fn a_stall_moves_the_last_probe_too() {
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    let last = prove_n(&mut l, A, 1, t0, L_A);
    judge_answering(&mut l, last, ProbeAnswer::Alive);
    let silent = last + TTL + ms(1);
    assert_eq!(l.judge(silent).probes.len(), 1);
    l.extend(s(60));
    // Asked again a period after the moved ask, not before.
    let asked = silent + s(60);
    assert!(l.judge(asked + ms(P - 1)).probes.is_empty());
    assert_eq!(l.judge(asked + ms(P)).probes.len(), 1);
}

#[test]
fn a_gateway_that_joins_a_shared_host_key_later_is_counted_once_too() {
    let t0 = Instant::now();
    let mut l = Leases::new(TTL);
    for c in 1..=3 {
        let t = t0 + ms(P * c);
        l.prove(tagged(A, 1), &proof(c, Some(7), Some(L_A)), t)
            .unwrap();
        l.prove(tagged(B, 1), &proof(c, Some(7), Some(L_B)), t)
            .unwrap();
    }
    assert_eq!(l.judge(t0 + ms(P * 3)).shared.len(), 2);
    let t = t0 + ms(P * 4);
    l.prove(tagged(C, 1), &proof(1, Some(7), Some("10.0.0.3:8080")), t)
        .unwrap();
    for id in [A, B] {
        l.prove(tagged(id, 1), &proof(4, Some(7), None), t + ms(1))
            .unwrap();
    }
    l.prove(tagged(C, 1), &proof(2, Some(7), None), t + ms(1))
        .unwrap();
    assert_eq!(l.judge(t + ms(1)).shared, vec![(C, HostKey([7; 16]))]);
    assert!(l.judge(t + ms(2)).shared.is_empty());
}

/// `id` renews on the admin path with host key 7 and counters `from..=to`, one period
/// apart from `t0`; returns the time of the last.
fn renew_on_host(l: &mut Leases, id: InstanceId, from: u64, to: u64, t0: Instant) -> Instant {
    for c in from..=to {
        l.renew(&on_host(id, c, Via::Admin, 7), t0 + ms(P * (c - from)))
            .unwrap();
    }
    t0 + ms(P * (to - from))
}

#[test]
fn a_hot_restart_child_silent_while_its_parent_drains_is_never_replaced_by_the_parent() {
    // The parent A has renewed 200 periods; its child B starts and renews 3, then is
    // frozen while A drains on, renewing. A's renewals say nothing of B: A started first.
    let t0 = Instant::now() + s(1);
    let check = |l: &mut Leases, last_b: Instant| {
        for k in 1..=12 {
            let t = last_b + ms(P * k);
            let j = l.judge(t);
            assert!(
                j.expired
                    .iter()
                    .all(|(id, why)| *id != B || *why != Expiry::Replaced),
                "B judged replaced by its parent at +{k} periods: {j:?}"
            );
        }
    };
    let mut l = Leases::new(TTL);
    let a = renew_on_host(&mut l, A, 1, 200, t0);
    let last_b = renew_on_host(&mut l, B, 1, 3, a + s(1));
    renew_on_host(&mut l, A, 201, 212, last_b + s(1));
    check(&mut l, last_b);
    // The same when this replica heard the child first (it restarted, forgetting both):
    // the counters, not the order of receipt, tell which process is the older.
    let mut l = Leases::new(TTL);
    let last_b = renew_on_host(&mut l, B, 1, 3, t0);
    renew_on_host(&mut l, A, 200, 212, t0 + s(1));
    check(&mut l, last_b);
    // A process restarted in place, its successor renewing on, is replaced once silent
    // for the TTL.
    let mut l = Leases::new(TTL);
    let last_a = renew_on_host(&mut l, A, 1, 200, t0);
    renew_on_host(&mut l, B, 1, 6, last_a + s(1));
    assert!(expired(&mut l, last_a + TTL).is_empty());
    assert_eq!(
        expired(&mut l, last_a + TTL + ms(1)),
        vec![(A, Expiry::Replaced)]
    );
}

#[test]
fn a_successor_replaces_only_on_evidence_heard_while_the_old_one_is_silent() {
    let t0 = Instant::now() + s(1);
    // kvguard-control cut off for 40 s: the first renewal back is the successor B's
    // (the old A may be a hot restart's parent, its own renewal a moment behind).
    let mut l = Leases::new(TTL);
    let last_a = renew_on_host(&mut l, A, 1, 200, t0);
    let back = last_a + s(40);
    l.renew(&on_host(B, 8, Via::Admin, 7), back).unwrap();
    assert!(expired(&mut l, back + ms(1)).is_empty(), "held");
    l.renew(&on_host(A, 201, Via::Admin, 7), back + ms(500))
        .unwrap();
    assert!(expired(&mut l, back + ms(P * 2)).is_empty());
    // A successor silent since the old one's last evidence proves nothing of it: another
    // gateway (host key 8) renews on; A ends as its own silence says (`unproven` here).
    let mut l = Leases::new(TTL);
    let last_a = renew_on_host(&mut l, A, 1, 200, t0);
    l.renew(&on_host(B, 3, Via::Admin, 7), last_a).unwrap();
    for c in 1..=8 {
        l.renew(&on_host(C, c, Via::Admin, 8), last_a + ms(P * c))
            .unwrap();
    }
    let j = l.judge(last_a + TTL + ms(1));
    assert!(j.expired.contains(&(A, Expiry::Unproven)), "{j:?}");
}

#[test]
fn a_refusal_at_a_successors_socket_ends_the_silent_predecessor_there_too() {
    // A hot restart: the parent B proved its life on L_A (trusted), its child C took the
    // socket and proved its life there; B exits, C dies a moment later, before B's
    // silence began, and another gateway A (L_B) freezes then: nobody is heard after, so
    // every lease is held until a listener answers.
    let t0 = Instant::now() + s(1);
    let mut l = Leases::new(TTL);
    prove_on_host(&mut l, B, (1, 100), t0, (7, L_A));
    let last_b = t0 + ms(P * 99);
    judge_answering(&mut l, last_b, ProbeAnswer::Alive);
    for c in 1..=2 {
        let t = last_b + ms(P * c - 4_000);
        l.prove(tagged(C, 1), &proof(c, Some(7), Some(L_A)), t)
            .unwrap();
        l.prove(tagged(A, 1), &proof(c, Some(8), Some(L_B)), t)
            .unwrap();
    }
    let last_c = last_b + ms(2 * P - 4_000);
    judge_answering(&mut l, last_c, ProbeAnswer::Alive);
    let (l_a, l_b) = (L_A.parse().unwrap(), L_B.parse().unwrap());
    // While C renews, B's silence does not make its listener, which its successor
    // proved, B's to answer for.
    let j = judge_answering(&mut l, last_c + ms(1), ProbeAnswer::Alive);
    assert!(j.probes.is_empty(), "{j:?}");
    // C is silent too when B passes the TTL: the socket speaks for both. Held (nobody
    // heard), and asked: it refuses.
    let at_b = last_b + TTL + ms(1);
    let j = l.judge(at_b);
    assert!(j.expired.is_empty(), "{j:?}");
    assert_eq!(j.probes, vec![(B, l_a)]);
    l.probed(B, l_a, ProbeAnswer::Refused, at_b);
    assert_eq!(l.judge(at_b + ms(1)).expired, vec![(B, Expiry::Dead)]);
    // Then C's and A's listeners are asked: A's answers, C's refuses.
    let at = last_c + TTL + ms(1);
    let j = l.judge(at);
    assert_eq!(j.probes, vec![(A, l_b), (C, l_a)]);
    l.probed(A, l_b, ProbeAnswer::Alive, at);
    l.probed(C, l_a, ProbeAnswer::Refused, at);
    assert_eq!(l.judge(at + ms(1)).expired, vec![(C, Expiry::Dead)]);
    assert!(l.holds(&A));
}

#[test]
fn a_silent_successors_socket_is_asked_for_its_predecessor_and_a_handshake_holds_it() {
    // The same, C frozen rather than dead: its socket answers for B, which is held.
    let t0 = Instant::now() + s(1);
    let mut l = Leases::new(TTL);
    prove_on_host(&mut l, B, (1, 100), t0, (7, L_A));
    let last_b = t0 + ms(P * 99);
    judge_answering(&mut l, last_b, ProbeAnswer::Alive);
    let t = last_b + ms(P - 4_000);
    l.prove(tagged(C, 1), &proof(1, Some(7), Some(L_A)), t)
        .unwrap();
    l.prove(tagged(A, 1), &proof(1, Some(8), Some(L_B)), t)
        .unwrap();
    let at_b = last_b + TTL + ms(1);
    let j = l.judge(at_b);
    let l_a = L_A.parse().unwrap();
    assert!(j.probes.contains(&(B, l_a)), "{j:?}");
    for (id, addr) in j.probes {
        l.probed(id, addr, ProbeAnswer::Alive, at_b);
    }
    let j = l.judge(at_b + ms(1));
    assert!(j.expired.is_empty(), "held: {j:?}");
    assert!(l.holds(&B) && l.holds(&C));
}

#[test]
fn processes_dated_more_than_the_jitter_apart_are_ordered_by_their_counters_closer_by_receipt() {
    let t0 = Instant::now() + s(20);
    // `a` first heard at t0 with counter 1 (dated a period before); `b` first heard `x`
    // later with counter `cb`, renewing on; `a` falls silent. How `a` ends says whether
    // `b` was taken for its successor.
    let ends = |x: Duration, cb: u64| {
        let mut l = Leases::new(TTL);
        l.renew(&on_host(A, 1, Via::Admin, 7), t0).unwrap();
        renew_on_host(&mut l, B, cb, cb + 7, t0 + x);
        expired(&mut l, t0 + TTL + ms(1))
    };
    // b dated exactly the jitter (a fifth of a period, 1 s) before a: too close to tell,
    // so the receipts order them (b heard after a: its successor).
    assert_eq!(ends(s(4), 2), vec![(A, Expiry::Replaced)]);
    // b dated 2 s before a: a predecessor, whatever the receipts.
    assert_eq!(ends(s(3), 2), vec![(A, Expiry::Unproven)]);
    // `b` heard first (counter 1 at t0), `a` `x` later with counter 2, and silent after.
    let heard_first = |x: Duration| {
        let mut l = Leases::new(TTL);
        l.renew(&on_host(B, 1, Via::Admin, 7), t0).unwrap();
        l.renew(&on_host(A, 2, Via::Admin, 7), t0 + x).unwrap();
        renew_on_host(&mut l, B, 2, 9, t0 + x + ms(1));
        expired(&mut l, t0 + x + TTL + ms(1))
    };
    // b dated exactly the jitter after a: too close, so b, heard first, is not a's
    // successor.
    assert_eq!(heard_first(s(4)), vec![(A, Expiry::Unproven)]);
    // b dated 2 s after a, though heard first: its successor.
    assert_eq!(heard_first(s(3)), vec![(A, Expiry::Replaced)]);
}

#[test]
fn an_expiry_is_counted_under_the_configured_mode_and_ends_only_under_enforce_when_proven() {
    for why in [
        Expiry::Silent,
        Expiry::Replaced,
        Expiry::Dead,
        Expiry::VmLost,
    ] {
        assert_eq!(
            why.acts(Mode::Enforce),
            Acts {
                ends: true,
                mode: Mode::Enforce
            },
            "{why:?}"
        );
        assert_eq!(
            why.acts(Mode::Observe),
            Acts {
                ends: false,
                mode: Mode::Observe
            },
            "{why:?}"
        );
    }
    // An unproven expiry ends nothing, and is still counted under `enforce` (37.5).
    assert_eq!(
        Expiry::Unproven.acts(Mode::Enforce),
        Acts {
            ends: false,
            mode: Mode::Enforce
        }
    );
    assert_eq!(Mode::Enforce.as_str(), "enforce");
    assert_eq!(Mode::Observe.as_str(), "observe");
}
