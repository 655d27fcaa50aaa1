//! `x-kvguard-signature: t=<unix seconds>,v1=<hex>,v2=<hex HMAC-SHA256(key, "<prefix><t>.<body>")>`
//! (contract §3), where the prefix is the message kind's ([`Domain`]): an abort, a lease
//! renewal and a replica's envelope each have their own, so a MAC for one kind never
//! verifies as another.
//!
//! Verifiers read `v2` only. Signers also send `v1` (the MAC of `"<t>.<body>"` with no
//! prefix) so that a kvguard-control that predates the prefixes still accepts the call
//! during a rolling upgrade; a header with `v1` and no `v2` is refused as
//! [`SignatureError::Outdated`], by name.

use crate::domain::Domain;
use crate::hex;
use crate::key::Key;
use core::fmt;

/// The header carrying the abort call's signature.
pub const SIGNATURE_HEADER: &str = "x-kvguard-signature";

/// Largest accepted distance between the signer's `t` and the verifier's clock, in seconds.
pub const MAX_SKEW_SECS: u64 = 30;

/// Signs `body`, a message of kind `domain`, at unix time `t`; returns the header value.
pub fn sign(domain: Domain, key: &Key, t: u64, body: &[u8]) -> String {
    let ts = t.to_string();
    let parts: [&[u8]; 3] = [ts.as_bytes(), b".", body];
    let v1 = key.mac_unprefixed(&parts);
    let v2 = key.mac(domain, &parts);
    format!("t={ts},v1={},v2={}", hex::encode(&v1), hex::encode(&v2))
}

/// A parsed signature header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Signature {
    /// Unix seconds the sender signed at.
    pub t: u64,
    /// The `v2` MAC.
    pub mac: [u8; 32],
}

/// Why a signature was refused. Every variant answers 401, except `Replay` (409).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignatureError {
    /// No header.
    Missing,
    /// The header is not `t=<digits>,v2=<64 hex>` (other fields aside).
    Malformed,
    /// The header carries `v1` and no `v2`: its sender predates the domain prefixes.
    Outdated,
    /// `t` is more than [`MAX_SKEW_SECS`] away from now.
    Stale,
    /// No configured key produced this MAC for this kind of message.
    Mismatch,
    /// This signature was already accepted within the window.
    Replay,
}

impl SignatureError {
    /// The metric/log label, e.g. `stale`.
    pub const fn as_str(self) -> &'static str {
        match self {
            SignatureError::Missing => "missing",
            SignatureError::Malformed => "malformed",
            SignatureError::Outdated => "outdated",
            SignatureError::Stale => "stale",
            SignatureError::Mismatch => "mismatch",
            SignatureError::Replay => "replay",
        }
    }
}

impl fmt::Display for SignatureError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SignatureError::Missing => "missing x-kvguard-signature header",
            SignatureError::Malformed => "malformed x-kvguard-signature header",
            SignatureError::Outdated => {
                "x-kvguard-signature has v1 and no v2: the sender predates the signature's domain prefixes and must be upgraded"
            }
            SignatureError::Stale => "signature timestamp outside the allowed skew",
            SignatureError::Mismatch => "signature does not match any configured key",
            SignatureError::Replay => "signature already used",
        })
    }
}

impl std::error::Error for SignatureError {}

/// Parses a header value. Fields may come in any order; `v1` and unknown fields (a
/// future `v3=`) are not read; `t` and `v2` must each appear once.
pub fn parse(value: &[u8]) -> Result<Signature, SignatureError> {
    let mut t = None;
    let mut v2 = None;
    let mut v1 = false;
    for field in value.split(|b| *b == b',') {
        let field = field.trim_ascii();
        if let Some(ts) = field.strip_prefix(b"t=") {
            if t.is_some() || ts.is_empty() || ts.len() > 20 || !ts.iter().all(u8::is_ascii_digit) {
                return Err(SignatureError::Malformed);
            }
            let parsed = ts.iter().try_fold(0u64, |acc, d| {
                acc.checked_mul(10)?.checked_add(u64::from(d - b'0'))
            });
            t = Some(parsed.ok_or(SignatureError::Malformed)?);
        } else if let Some(hexed) = field.strip_prefix(b"v2=") {
            if v2.is_some() {
                return Err(SignatureError::Malformed);
            }
            v2 = Some(hex::decode32(hexed).ok_or(SignatureError::Malformed)?);
        } else if field.starts_with(b"v1=") {
            v1 = true;
        }
    }
    match (t, v2) {
        (Some(t), Some(mac)) => Ok(Signature { t, mac }),
        (Some(_), None) if v1 => Err(SignatureError::Outdated),
        _ => Err(SignatureError::Malformed),
    }
}

/// Verifies a header value against `body`, a message of kind `domain`, with any of
/// `keys` at unix time `now`.
///
/// Checks, in order: present, well-formed, fresh (±[`MAX_SKEW_SECS`]), MAC (constant
/// time, every key tried). Replay memory is the caller's: it keys on the returned
/// [`Signature`].
pub fn verify(
    domain: Domain,
    keys: &[Key],
    header: Option<&[u8]>,
    body: &[u8],
    now: u64,
) -> Result<Signature, SignatureError> {
    let sig = parse(header.ok_or(SignatureError::Missing)?)?;
    if sig.t.abs_diff(now) > MAX_SKEW_SECS {
        return Err(SignatureError::Stale);
    }
    verify_mac(domain, keys, sig, body)
}

/// Verifies a header value against `body` with any of `keys`, whatever its `t`: for
/// calls whose freshness is proved otherwise (lease renewals carry a per-sender counter,
/// contract §8, so a gateway's clock step cannot make a live lease's renewals stale).
pub fn verify_any_time(
    domain: Domain,
    keys: &[Key],
    header: Option<&[u8]>,
    body: &[u8],
) -> Result<Signature, SignatureError> {
    let sig = parse(header.ok_or(SignatureError::Missing)?)?;
    verify_mac(domain, keys, sig, body)
}

fn verify_mac(
    domain: Domain,
    keys: &[Key],
    sig: Signature,
    body: &[u8],
) -> Result<Signature, SignatureError> {
    let ts = sig.t.to_string();
    let mut matched = false;
    for key in keys {
        // No early exit: the time taken does not say which key matched.
        matched |= key.verify(domain, &[ts.as_bytes(), b".", body], &sig.mac);
    }
    if matched {
        Ok(sig)
    } else {
        Err(SignatureError::Mismatch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key() -> Key {
        Key::try_new(b"kvguard-test-key-0123456789abcdef").unwrap()
    }

    #[test]
    fn sign_then_verify() {
        let h = sign(Domain::Abort, &key(), 1000, b"{}");
        assert!(verify(Domain::Abort, &[key()], Some(h.as_bytes()), b"{}", 1000).is_ok());
        assert!(verify(Domain::Abort, &[key()], Some(h.as_bytes()), b"{}", 1030).is_ok());
        assert_eq!(
            verify(Domain::Abort, &[key()], Some(h.as_bytes()), b"{}", 1031),
            Err(SignatureError::Stale)
        );
        assert_eq!(
            verify(Domain::Abort, &[key()], Some(h.as_bytes()), b"{}", 969),
            Err(SignatureError::Stale)
        );
        assert_eq!(
            verify(Domain::Abort, &[key()], Some(h.as_bytes()), b"{ }", 1000),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            verify(Domain::Abort, &[key()], None, b"{}", 1000),
            Err(SignatureError::Missing)
        );
    }

    #[test]
    fn any_configured_key_verifies() {
        let old = Key::try_new(b"old-key-old-key-old-key").unwrap();
        let h = sign(Domain::Abort, &old, 5, b"x");
        assert!(verify(
            Domain::Abort,
            &[key(), old.clone()],
            Some(h.as_bytes()),
            b"x",
            5
        )
        .is_ok());
        assert_eq!(
            verify(Domain::Abort, &[key()], Some(h.as_bytes()), b"x", 5),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            verify(Domain::Abort, &[], Some(h.as_bytes()), b"x", 5),
            Err(SignatureError::Mismatch)
        );
    }

    #[test]
    fn any_time_ignores_the_clock_not_the_mac() {
        let h = sign(Domain::Abort, &key(), 5, b"{}");
        assert!(verify_any_time(Domain::Abort, &[key()], Some(h.as_bytes()), b"{}").is_ok());
        assert_eq!(
            verify_any_time(Domain::Abort, &[key()], Some(h.as_bytes()), b"{ }"),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            verify_any_time(Domain::Abort, &[key()], None, b"{}"),
            Err(SignatureError::Missing)
        );
    }

    #[test]
    fn a_signature_of_one_kind_never_verifies_as_another() {
        let body = br#"{"request_id":"r1","reason":"operator","age_ms":1,"tokens":0}"#;
        for signed in [Domain::Abort, Domain::Renewal, Domain::Envelope] {
            let h = sign(signed, &key(), 1000, body);
            for checked in Domain::ALL {
                let want = if signed == checked {
                    Ok(())
                } else {
                    Err(SignatureError::Mismatch)
                };
                let at = verify(checked, &[key()], Some(h.as_bytes()), body, 1000).map(|_| ());
                assert_eq!(at, want, "signed {signed:?}, checked {checked:?}");
                let any = verify_any_time(checked, &[key()], Some(h.as_bytes()), body).map(|_| ());
                assert_eq!(any, want, "signed {signed:?}, checked {checked:?}");
            }
        }
    }

    #[test]
    fn the_header_carries_the_unprefixed_v1_and_the_prefixed_v2() {
        let h = sign(Domain::Renewal, &key(), 7, b"{}");
        let v1 = hex::encode(&key().mac_unprefixed(&[b"7", b".", b"{}"]));
        let v2 = hex::encode(&key().mac(Domain::Renewal, &[b"7", b".", b"{}"]));
        assert_eq!(h, format!("t=7,v1={v1},v2={v2}"));
        assert_eq!(
            parse(h.as_bytes()).map(|s| s.mac.to_vec()),
            Ok(key().mac(Domain::Renewal, &[b"7", b".", b"{}"]).to_vec())
        );
    }

    #[test]
    fn a_header_from_a_sender_before_the_prefixes_is_refused_by_name() {
        // What a signer before the prefixes sent: t and the unprefixed v1 only.
        let v1 = hex::encode(&key().mac_unprefixed(&[b"1000", b".", b"{}"]));
        let old = format!("t=1000,v1={v1}");
        assert_eq!(parse(old.as_bytes()), Err(SignatureError::Outdated));
        assert_eq!(
            verify(Domain::Abort, &[key()], Some(old.as_bytes()), b"{}", 1000),
            Err(SignatureError::Outdated)
        );
        assert_eq!(
            verify_any_time(Domain::Renewal, &[key()], Some(old.as_bytes()), b"{}"),
            Err(SignatureError::Outdated)
        );
        // Without t it is malformed, whatever else it carries.
        assert_eq!(
            parse(format!("v1={v1}").as_bytes()),
            Err(SignatureError::Malformed)
        );
    }

    #[test]
    fn parse_rules() {
        let mac = "ab".repeat(32);
        assert!(parse(format!("v2={mac}, t=7").as_bytes()).is_ok());
        assert!(parse(format!("t=7,v2={mac},v3=zz").as_bytes()).is_ok());
        // v1 is not read, whatever it holds.
        assert!(parse(format!("t=7,v1=zz,v2={mac}").as_bytes()).is_ok());
        for bad in [
            String::new(),
            "t=7".into(),
            format!("v2={mac}"),
            format!("t=-7,v2={mac}"),
            format!("t=7,t=8,v2={mac}"),
            format!("t=7,v2={mac},v2={mac}"),
            format!("t=7,v3={mac}"),
            format!("t=99999999999999999999999,v2={mac}"),
            format!("t=7,v2={}", &mac[..62]),
        ] {
            assert_eq!(
                parse(bad.as_bytes()),
                Err(SignatureError::Malformed),
                "{bad}"
            );
        }
    }

    #[test]
    fn t_takes_one_to_twenty_digits_up_to_u64_max() {
        let mac = "cd".repeat(32);
        assert_eq!(
            parse(format!("t=18446744073709551615,v2={mac}").as_bytes()),
            Ok(Signature {
                t: u64::MAX,
                mac: [0xcd; 32]
            })
        );
        assert_eq!(
            parse(format!("t=00000000000000000007,v2={mac}").as_bytes()).map(|s| s.t),
            Ok(7)
        );
        let h = sign(Domain::Abort, &key(), u64::MAX, b"{}");
        assert!(verify_any_time(Domain::Abort, &[key()], Some(h.as_bytes()), b"{}").is_ok());
        for bad in [
            format!("t=,v2={mac}"),
            format!("v2={mac},t="),
            format!("t=000000000000000000007,v2={mac}"),
            format!("t=18446744073709551616,v2={mac}"),
            format!("t=+7,v2={mac}"),
            format!("t=7 7,v2={mac}"),
        ] {
            assert_eq!(
                parse(bad.as_bytes()),
                Err(SignatureError::Malformed),
                "{bad}"
            );
        }
    }

    #[test]
    fn labels_and_messages_name_each_refusal() {
        let cases = [
            (
                SignatureError::Missing,
                "missing",
                "missing x-kvguard-signature header",
            ),
            (
                SignatureError::Malformed,
                "malformed",
                "malformed x-kvguard-signature header",
            ),
            (
                SignatureError::Stale,
                "stale",
                "signature timestamp outside the allowed skew",
            ),
            (
                SignatureError::Mismatch,
                "mismatch",
                "signature does not match any configured key",
            ),
            (SignatureError::Replay, "replay", "signature already used"),
            (
                SignatureError::Outdated,
                "outdated",
                "x-kvguard-signature has v1 and no v2: the sender predates the signature's domain prefixes and must be upgraded",
            ),
        ];
        for (err, label, message) in cases {
            assert_eq!(err.as_str(), label);
            assert_eq!(err.to_string(), message);
        }
    }

    proptest! {
        #[test]
        fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = parse(&bytes);
        }
    }
}
