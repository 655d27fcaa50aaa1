//! The domain-separation prefix of each signed message kind (contract §3).
//!
//! Every MAC the contract computes with a shared key starts with its kind's prefix, so the
//! MAC input of one kind never equals the MAC input of another whatever their fields hold:
//! a stamp cannot be replayed as an abort signature, a renewal's signature as an abort's,
//! a gateway's signed call as a replica's envelope. Each prefix ends in a NUL byte, which
//! no other part of a MAC input contains and no prefix does before its end, so none is a
//! prefix of another.

/// A kind of signed message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Domain {
    /// `POST /v1/abort`, signed by the filter (`x-kvguard-signature`).
    Abort,
    /// A lease renewal, `POST /v1/lease` or `/v1/kvguard/lease`, signed by the filter
    /// (`x-kvguard-signature`).
    Renewal,
    /// An envelope one replica forwards to another, `/v1/peer/*` (`x-kvguard-signature`).
    Envelope,
    /// The response stamp `x-kvguard-control`, signed by kvguard-control.
    Stamp,
}

impl Domain {
    /// Every kind, for tests and documentation.
    pub const ALL: [Domain; 4] = [
        Domain::Abort,
        Domain::Renewal,
        Domain::Envelope,
        Domain::Stamp,
    ];

    /// The bytes the MAC input starts with.
    pub const fn prefix(self) -> &'static [u8] {
        match self {
            Domain::Abort => b"kvguard-abort-v2\0",
            Domain::Renewal => b"kvguard-renewal-v2\0",
            Domain::Envelope => b"kvguard-envelope-v2\0",
            Domain::Stamp => b"kvguard-stamp-v2\0",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_prefix_is_its_own_and_none_starts_another() {
        for a in Domain::ALL {
            let p = a.prefix();
            assert!(p.starts_with(b"kvguard-") && p.ends_with(b"-v2\0"), "{a:?}");
            assert_eq!(p.iter().filter(|b| **b == 0).count(), 1, "{a:?}");
            for b in Domain::ALL {
                if a != b {
                    assert!(!b.prefix().starts_with(p), "{a:?} starts {b:?}");
                }
            }
        }
    }
}
