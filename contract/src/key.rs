//! Shared secrets for HMAC-SHA256.

use crate::domain::Domain;
use core::fmt;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Shortest accepted secret, in bytes.
pub const MIN_KEY_LEN: usize = 16;

pub(crate) type HmacSha256 = Hmac<Sha256>;

/// A validated shared secret (at least [`MIN_KEY_LEN`] bytes). Its `Debug` hides it.
#[derive(Clone, PartialEq, Eq)]
pub struct Key(pub(crate) Vec<u8>);

/// Why a secret was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyError {
    /// Shorter than [`MIN_KEY_LEN`] bytes (the length is given).
    TooShort(usize),
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::TooShort(n) => {
                write!(
                    f,
                    "secret is {n} bytes, at least {MIN_KEY_LEN} are required"
                )
            }
        }
    }
}

impl std::error::Error for KeyError {}

impl Key {
    /// Validates a secret. Surrounding ASCII whitespace (a trailing newline from a file
    /// or an environment variable) is trimmed first.
    pub fn try_new(secret: &[u8]) -> Result<Self, KeyError> {
        let trimmed = secret.trim_ascii();
        if trimmed.len() < MIN_KEY_LEN {
            return Err(KeyError::TooShort(trimmed.len()));
        }
        Ok(Key(trimmed.to_vec()))
    }

    /// HMAC-SHA256 over `domain`'s prefix followed by the concatenation of `parts`.
    pub fn mac(&self, domain: Domain, parts: &[&[u8]]) -> [u8; 32] {
        let mut mac = self.hmac();
        mac.update(domain.prefix());
        for p in parts {
            mac.update(p);
        }
        mac.finalize().into_bytes().into()
    }

    /// Whether `tag` is [`Key::mac`] of `domain` and `parts`, compared in constant time.
    pub fn verify(&self, domain: Domain, parts: &[&[u8]], tag: &[u8; 32]) -> bool {
        let mut mac = self.hmac();
        mac.update(domain.prefix());
        for p in parts {
            mac.update(p);
        }
        mac.verify_slice(tag).is_ok()
    }

    /// HMAC-SHA256 over the concatenation of `parts`, with no domain prefix: only for the
    /// `v1=` field a signer adds for verifiers that predate the prefixes (contract §3),
    /// for a proof of life (its prefix is among the parts), and for hashing under a fixed
    /// public key.
    pub(crate) fn mac_unprefixed(&self, parts: &[&[u8]]) -> [u8; 32] {
        let mut mac = self.hmac();
        for p in parts {
            mac.update(p);
        }
        mac.finalize().into_bytes().into()
    }

    fn hmac(&self) -> HmacSha256 {
        // HMAC accepts keys of any length; this arm cannot be taken.
        match HmacSha256::new_from_slice(&self.0) {
            Ok(m) => m,
            Err(_) => <HmacSha256 as Mac>::new(&Default::default()),
        }
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key(<{} bytes>)", self.0.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn length_rule_and_trim() {
        assert_eq!(Key::try_new(b"short"), Err(KeyError::TooShort(5)));
        assert_eq!(
            Key::try_new(b"  0123456789abcde \n"),
            Err(KeyError::TooShort(15))
        );
        let k = Key::try_new(b"0123456789abcdef\n").unwrap();
        assert_eq!(k, Key::try_new(b"0123456789abcdef").unwrap());
        assert!(!format!("{k:?}").contains("0123"));
    }

    #[test]
    fn debug_shows_the_length_and_never_the_secret() {
        let k = Key::try_new(b"kvguard-secret-0123456789").unwrap();
        let shown = format!("{k:?}");
        assert_eq!(shown, "Key(<25 bytes>)");
        assert!(!shown.contains("secret"));
        assert_eq!(
            format!("{:?}", Some(Key::try_new(&[b'z'; MIN_KEY_LEN]).unwrap())),
            "Some(Key(<16 bytes>))"
        );
    }

    #[test]
    fn each_domain_gives_its_own_mac_and_none_is_the_unprefixed_one() {
        let k = Key::try_new(b"kvguard-test-key-0123456789abcdef").unwrap();
        let parts: [&[u8]; 3] = [b"1795960117", b".", b"{}"];
        let raw = k.mac_unprefixed(&parts);
        for a in Domain::ALL {
            let tag = k.mac(a, &parts);
            assert_ne!(tag, raw, "{a:?}");
            // The prefix is part of the input, not a separate key: spelling it out as the
            // first part gives the same MAC.
            let mut spelled = vec![a.prefix()];
            spelled.extend_from_slice(&parts);
            assert_eq!(tag, k.mac_unprefixed(&spelled), "{a:?}");
            for b in Domain::ALL {
                assert_eq!(k.verify(b, &parts, &tag), a == b, "{a:?} verified as {b:?}");
            }
            assert!(!k.verify(a, &parts, &raw), "{a:?}");
        }
    }

    #[test]
    fn too_short_message_gives_the_length_and_the_minimum() {
        assert_eq!(
            KeyError::TooShort(5).to_string(),
            "secret is 5 bytes, at least 16 are required"
        );
    }
}
