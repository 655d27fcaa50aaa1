//! The response stamp `x-kvguard-control: <ip>:<port>;t=<unix>;v2=<hex HMAC-SHA256(key,
//! "kvguard-stamp-v2\0<ip>:<port>|<request_id>|<t>")>` that names the control replica
//! holding a request (contract §4). The prefix ([`Domain::Stamp`]) keeps a stamp's MAC
//! from ever verifying as a signed call's, and the reverse.
//!
//! A stamp from a kvguard-control that predates the prefix (`sig=` in place of `v2=`) is
//! refused as [`StampError::Outdated`], by name.

use crate::domain::Domain;
use crate::hex;
use crate::id::RequestId;
use crate::key::Key;
use core::fmt;
use std::net::SocketAddr;

/// The response header kvguard-control stamps and the filter strips.
pub const CONTROL_HEADER: &str = "x-kvguard-control";

/// A parsed (not yet verified) stamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    /// The control replica's admin address (an IP literal and port).
    pub addr: SocketAddr,
    /// Unix seconds it was stamped at.
    pub t: u64,
    /// The `v2` MAC.
    pub sig: [u8; 32],
}

/// Why a stamp was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StampError {
    /// Not `<ip>:<port>;t=<digits>;v2=<64 hex>`.
    Malformed,
    /// `sig=` in place of `v2=`: its kvguard-control predates the domain prefix.
    Outdated,
    /// No configured key produced this MAC for this request id.
    Mismatch,
}

impl fmt::Display for StampError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StampError::Malformed => "malformed x-kvguard-control header",
            StampError::Outdated => {
                "x-kvguard-control has sig= and no v2=: its kvguard-control predates the stamp's domain prefix and must be upgraded"
            }
            StampError::Mismatch => "x-kvguard-control signature does not verify",
        })
    }
}

impl std::error::Error for StampError {}

/// The header value for `addr` holding `request_id`, stamped at `t`.
pub fn stamp(key: &Key, addr: SocketAddr, request_id: &RequestId, t: u64) -> String {
    let a = addr.to_string();
    let ts = t.to_string();
    let tag = key.mac(
        Domain::Stamp,
        &[
            a.as_bytes(),
            b"|",
            request_id.as_str().as_bytes(),
            b"|",
            ts.as_bytes(),
        ],
    );
    format!("{a};t={ts};v2={}", hex::encode(&tag))
}

/// Parses a header value without verifying it.
pub fn parse(value: &[u8]) -> Result<Stamp, StampError> {
    let text = core::str::from_utf8(value).map_err(|_| StampError::Malformed)?;
    let mut parts = text.trim().split(';');
    let addr: SocketAddr = parts
        .next()
        .and_then(|a| a.trim().parse().ok())
        .ok_or(StampError::Malformed)?;
    let t = parts
        .next()
        .and_then(|p| p.trim().strip_prefix("t="))
        .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|d| d.parse::<u64>().ok())
        .ok_or(StampError::Malformed)?;
    let third = parts.next().map(str::trim).ok_or(StampError::Malformed)?;
    if third.starts_with("sig=") {
        return Err(StampError::Outdated);
    }
    let sig = third
        .strip_prefix("v2=")
        .and_then(|h| hex::decode32(h.as_bytes()))
        .ok_or(StampError::Malformed)?;
    if parts.next().is_some() {
        return Err(StampError::Malformed);
    }
    Ok(Stamp { addr, t, sig })
}

/// Parses and verifies a header value for `request_id` with any of `keys`.
///
/// The stamp's age is not checked: a stream may legitimately be aborted long after its
/// response headers; the MAC binds the address to this request id, which is what matters.
pub fn verify(keys: &[Key], value: &[u8], request_id: &RequestId) -> Result<Stamp, StampError> {
    let s = parse(value)?;
    let a = s.addr.to_string();
    let ts = s.t.to_string();
    let parts: [&[u8]; 5] = [
        a.as_bytes(),
        b"|",
        request_id.as_str().as_bytes(),
        b"|",
        ts.as_bytes(),
    ];
    let mut matched = false;
    for key in keys {
        matched |= key.verify(Domain::Stamp, &parts, &s.sig);
    }
    if matched {
        Ok(s)
    } else {
        Err(StampError::Mismatch)
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
    fn stamp_then_verify() {
        let id = RequestId::try_new(b"abc").unwrap();
        let other = RequestId::try_new(b"abd").unwrap();
        let addr: SocketAddr = "10.0.0.7:9902".parse().unwrap();
        let v = stamp(&key(), addr, &id, 42);
        assert_eq!(verify(&[key()], v.as_bytes(), &id).unwrap().addr, addr);
        assert_eq!(
            verify(&[key()], v.as_bytes(), &other),
            Err(StampError::Mismatch)
        );
        let forged = v.replace("10.0.0.7", "10.0.0.8");
        assert_eq!(
            verify(&[key()], forged.as_bytes(), &id),
            Err(StampError::Mismatch)
        );
    }

    #[test]
    fn a_stamp_never_verifies_as_a_signed_call_and_no_signed_call_as_a_stamp() {
        let id = RequestId::try_new(b"abc").unwrap();
        let addr: SocketAddr = "10.0.0.7:9902".parse().unwrap();
        let v = stamp(&key(), addr, &id, 42);
        let s = parse(v.as_bytes()).unwrap();
        // The stamp's MAC input under each other kind's prefix does not give its MAC.
        let input: [&[u8]; 5] = [b"10.0.0.7:9902", b"|", b"abc", b"|", b"42"];
        for d in Domain::ALL {
            assert_eq!(key().verify(d, &input, &s.sig), d == Domain::Stamp, "{d:?}");
        }
        // A signature over the stamp's input read as `<t>.<body>` ("10" . "0.0.7:...").
        for d in [Domain::Abort, Domain::Renewal, Domain::Envelope] {
            let h = crate::signature::sign(d, &key(), 10, b"0.0.7:9902|abc|42");
            let mac = crate::signature::parse(h.as_bytes()).unwrap().mac;
            let forged = format!("10.0.0.7:9902;t=42;v2={}", hex::encode(&mac));
            assert_eq!(
                verify(&[key()], forged.as_bytes(), &id),
                Err(StampError::Mismatch),
                "{d:?}"
            );
        }
    }

    #[test]
    fn a_stamp_from_a_control_before_the_prefix_is_refused_by_name() {
        let id = RequestId::try_new(b"abc").unwrap();
        let sig = key().mac_unprefixed(&[b"10.0.0.7:9902", b"|", b"abc", b"|", b"42"]);
        let old = format!("10.0.0.7:9902;t=42;sig={}", hex::encode(&sig));
        assert_eq!(parse(old.as_bytes()), Err(StampError::Outdated));
        assert_eq!(
            verify(&[key()], old.as_bytes(), &id),
            Err(StampError::Outdated)
        );
    }

    #[test]
    fn ipv6_and_malformed() {
        let id = RequestId::try_new(b"abc").unwrap();
        let addr: SocketAddr = "[fd00::1]:9902".parse().unwrap();
        let v = stamp(&key(), addr, &id, 1);
        assert!(verify(&[key()], v.as_bytes(), &id).is_ok());
        for bad in [
            "",
            "host:1;t=1;v2=00",
            "1.2.3.4:5;t=x;v2=00",
            "1.2.3.4:5;t=1",
            "1.2.3.4;t=1;v2=00",
        ] {
            assert_eq!(parse(bad.as_bytes()), Err(StampError::Malformed), "{bad}");
        }
    }

    #[test]
    fn t_must_be_plain_digits() {
        let sig = "00".repeat(32);
        assert_eq!(
            parse(format!("1.2.3.4:5;t=7;v2={sig}").as_bytes()).map(|s| s.t),
            Ok(7)
        );
        // Rust's integer parser would take a sign; the contract's `t` is digits only.
        for t in ["+7", "", " ", "-7", "7a", "0x7"] {
            let bad = format!("1.2.3.4:5;t={t};v2={sig}");
            assert_eq!(parse(bad.as_bytes()), Err(StampError::Malformed), "{bad}");
        }
        assert_eq!(
            parse(format!("1.2.3.4:5;t=7;v2={sig};x").as_bytes()),
            Err(StampError::Malformed)
        );
    }

    #[test]
    fn error_messages_name_the_header() {
        assert_eq!(
            StampError::Malformed.to_string(),
            "malformed x-kvguard-control header"
        );
        assert_eq!(
            StampError::Mismatch.to_string(),
            "x-kvguard-control signature does not verify"
        );
        assert!(StampError::Outdated
            .to_string()
            .starts_with("x-kvguard-control has sig="));
    }

    proptest! {
        #[test]
        fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = parse(&bytes);
        }
    }
}
