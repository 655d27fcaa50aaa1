//! `x-kvguard-signature: t=<unix seconds>,v1=<hex HMAC-SHA256(key, "<t>.<body>")>` (contract §3).

use crate::hex;
use crate::key::Key;
use core::fmt;

/// The header carrying the abort call's signature.
pub const SIGNATURE_HEADER: &str = "x-kvguard-signature";

/// Largest accepted distance between the signer's `t` and the verifier's clock, in seconds.
pub const MAX_SKEW_SECS: u64 = 30;

/// Signs `body` at unix time `t`; returns the header value.
pub fn sign(key: &Key, t: u64, body: &[u8]) -> String {
    let ts = t.to_string();
    let tag = key.mac(&[ts.as_bytes(), b".", body]);
    format!("t={ts},v1={}", hex::encode(&tag))
}

/// A parsed signature header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Signature {
    /// Unix seconds the sender signed at.
    pub t: u64,
    /// The MAC.
    pub v1: [u8; 32],
}

/// Why a signature was refused. Every variant answers 401, except `Replay` (409).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignatureError {
    /// No header.
    Missing,
    /// The header is not `t=<digits>,v1=<64 hex>`.
    Malformed,
    /// `t` is more than [`MAX_SKEW_SECS`] away from now.
    Stale,
    /// No configured key produced this MAC.
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
            SignatureError::Stale => "signature timestamp outside the allowed skew",
            SignatureError::Mismatch => "signature does not match any configured key",
            SignatureError::Replay => "signature already used",
        })
    }
}

impl std::error::Error for SignatureError {}

/// Parses a header value. Fields may come in any order; unknown fields (future `v2=`)
/// are ignored; `t` and `v1` must each appear once.
pub fn parse(value: &[u8]) -> Result<Signature, SignatureError> {
    let mut t = None;
    let mut v1 = None;
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
        } else if let Some(hexed) = field.strip_prefix(b"v1=") {
            if v1.is_some() {
                return Err(SignatureError::Malformed);
            }
            v1 = Some(hex::decode32(hexed).ok_or(SignatureError::Malformed)?);
        }
    }
    match (t, v1) {
        (Some(t), Some(v1)) => Ok(Signature { t, v1 }),
        _ => Err(SignatureError::Malformed),
    }
}

/// Verifies a header value against `body` with any of `keys` at unix time `now`.
///
/// Checks, in order: present, well-formed, fresh (±[`MAX_SKEW_SECS`]), MAC (constant
/// time, every key tried). Replay memory is the caller's: it keys on the returned
/// [`Signature`].
pub fn verify(
    keys: &[Key],
    header: Option<&[u8]>,
    body: &[u8],
    now: u64,
) -> Result<Signature, SignatureError> {
    let sig = parse(header.ok_or(SignatureError::Missing)?)?;
    if sig.t.abs_diff(now) > MAX_SKEW_SECS {
        return Err(SignatureError::Stale);
    }
    verify_mac(keys, sig, body)
}

/// Verifies a header value against `body` with any of `keys`, whatever its `t`: for
/// calls whose freshness is proved otherwise (lease renewals carry a per-sender counter,
/// contract §8, so a gateway's clock step cannot make a live lease's renewals stale).
pub fn verify_any_time(
    keys: &[Key],
    header: Option<&[u8]>,
    body: &[u8],
) -> Result<Signature, SignatureError> {
    let sig = parse(header.ok_or(SignatureError::Missing)?)?;
    verify_mac(keys, sig, body)
}

fn verify_mac(keys: &[Key], sig: Signature, body: &[u8]) -> Result<Signature, SignatureError> {
    let ts = sig.t.to_string();
    let mut matched = false;
    for key in keys {
        // No early exit: the time taken does not say which key matched.
        matched |= key.verify(&[ts.as_bytes(), b".", body], &sig.v1);
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
        let h = sign(&key(), 1000, b"{}");
        assert!(verify(&[key()], Some(h.as_bytes()), b"{}", 1000).is_ok());
        assert!(verify(&[key()], Some(h.as_bytes()), b"{}", 1030).is_ok());
        assert_eq!(
            verify(&[key()], Some(h.as_bytes()), b"{}", 1031),
            Err(SignatureError::Stale)
        );
        assert_eq!(
            verify(&[key()], Some(h.as_bytes()), b"{}", 969),
            Err(SignatureError::Stale)
        );
        assert_eq!(
            verify(&[key()], Some(h.as_bytes()), b"{ }", 1000),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            verify(&[key()], None, b"{}", 1000),
            Err(SignatureError::Missing)
        );
    }

    #[test]
    fn any_configured_key_verifies() {
        let old = Key::try_new(b"old-key-old-key-old-key").unwrap();
        let h = sign(&old, 5, b"x");
        assert!(verify(&[key(), old.clone()], Some(h.as_bytes()), b"x", 5).is_ok());
        assert_eq!(
            verify(&[key()], Some(h.as_bytes()), b"x", 5),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            verify(&[], Some(h.as_bytes()), b"x", 5),
            Err(SignatureError::Mismatch)
        );
    }

    #[test]
    fn any_time_ignores_the_clock_not_the_mac() {
        let h = sign(&key(), 5, b"{}");
        assert!(verify_any_time(&[key()], Some(h.as_bytes()), b"{}").is_ok());
        assert_eq!(
            verify_any_time(&[key()], Some(h.as_bytes()), b"{ }"),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            verify_any_time(&[key()], None, b"{}"),
            Err(SignatureError::Missing)
        );
    }

    #[test]
    fn parse_rules() {
        let mac = "ab".repeat(32);
        assert!(parse(format!("v1={mac}, t=7").as_bytes()).is_ok());
        assert!(parse(format!("t=7,v1={mac},v2=zz").as_bytes()).is_ok());
        for bad in [
            String::new(),
            "t=7".into(),
            format!("v1={mac}"),
            format!("t=-7,v1={mac}"),
            format!("t=7,t=8,v1={mac}"),
            format!("t=99999999999999999999999,v1={mac}"),
            format!("t=7,v1={}", &mac[..62]),
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
            parse(format!("t=18446744073709551615,v1={mac}").as_bytes()),
            Ok(Signature {
                t: u64::MAX,
                v1: [0xcd; 32]
            })
        );
        assert_eq!(
            parse(format!("t=00000000000000000007,v1={mac}").as_bytes()).map(|s| s.t),
            Ok(7)
        );
        let h = sign(&key(), u64::MAX, b"{}");
        assert!(verify_any_time(&[key()], Some(h.as_bytes()), b"{}").is_ok());
        for bad in [
            format!("t=,v1={mac}"),
            format!("v1={mac},t="),
            format!("t=000000000000000000007,v1={mac}"),
            format!("t=18446744073709551616,v1={mac}"),
            format!("t=+7,v1={mac}"),
            format!("t=7 7,v1={mac}"),
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
