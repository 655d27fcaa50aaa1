//! The request id as a tracked stream keeps it: 16 bytes inline for the UUID Envoy
//! generates, a [`RequestId`] for any other id.
//!
//! Every tracked stream holds its id for its whole life; as a `String` a 36-byte UUID
//! costs a 48-byte heap block besides the string's own 12 bytes, a quarter of a tracked
//! stream's memory. Only ids that read back byte for byte are packed (lowercase
//! `8-4-4-4-12` hex, [`id::uuid_bytes`]); every other valid id, of any length, is kept as
//! it came.

use core::fmt;
use kvguard_contract::id::{self, IdError, RequestId};

/// A validated request id, packed when it is a lowercase UUID.
#[derive(Clone, PartialEq, Eq)]
pub enum TrackedId {
    /// A lowercase hyphenated UUID: its 16 bytes.
    Uuid([u8; 16]),
    /// Any other valid id.
    Other(RequestId),
}

impl TrackedId {
    /// Validates raw header bytes as a request id (the rules of [`RequestId::try_new`]).
    pub fn try_new(bytes: &[u8]) -> Result<Self, IdError> {
        match id::uuid_bytes(bytes) {
            Some(raw) => Ok(TrackedId::Uuid(raw)),
            None => RequestId::try_new(bytes).map(TrackedId::Other),
        }
    }

    /// The id as the contract carries it (an abort, a stamp check).
    pub fn to_request_id(&self) -> RequestId {
        match self {
            TrackedId::Uuid(raw) => RequestId::from_uuid(raw),
            TrackedId::Other(id) => id.clone(),
        }
    }
}

impl fmt::Display for TrackedId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TrackedId::Uuid(raw) => {
                // Hex digits and hyphens: ASCII.
                let text = id::uuid_text(raw);
                f.write_str(core::str::from_utf8(&text).unwrap_or_default())
            }
            TrackedId::Other(id) => f.write_str(id.as_str()),
        }
    }
}

impl fmt::Debug for TrackedId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TrackedId({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envoys_uuid_is_packed_and_reads_back_alike() {
        let text = "3f1c2a4e-9b7d-4c1e-8a2b-1234567890ab";
        let id = TrackedId::try_new(text.as_bytes()).unwrap();
        assert!(matches!(id, TrackedId::Uuid(_)));
        assert_eq!(id.to_string(), text);
        assert_eq!(format!("{id:?}"), format!("TrackedId({text})"));
        assert_eq!(id.to_request_id().as_str(), text);
    }

    #[test]
    fn any_other_valid_id_is_kept_as_it_came() {
        for text in [
            "3F1C2A4E-9B7D-4C1E-8A2B-1234567890AB",
            "a",
            "fx-chat.1:a_b",
            &"x".repeat(kvguard_contract::MAX_ID_LEN),
        ] {
            let id = TrackedId::try_new(text.as_bytes()).unwrap();
            assert!(matches!(id, TrackedId::Other(_)), "{text}");
            assert_eq!(id.to_string(), text);
            assert_eq!(id.to_request_id().as_str(), text);
        }
    }

    #[test]
    fn invalid_ids_are_refused_as_the_contract_refuses_them() {
        for bad in [
            &b""[..],
            b"a b",
            &[b'a'; 129],
            b"3f1c2a4e-9b7d-4c1e-8a2b-1234567890a/",
        ] {
            assert_eq!(
                TrackedId::try_new(bad).map(|i| i.to_string()),
                RequestId::try_new(bad).map(|i| i.as_str().to_owned())
            );
            assert!(TrackedId::try_new(bad).is_err());
        }
    }

    #[cfg(not(target_family = "wasm"))]
    mod props {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #[test]
            fn every_id_reads_back_byte_for_byte(text in "[0-9a-fA-F._:-]{1,40}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}") {
                let id = TrackedId::try_new(text.as_bytes()).unwrap();
                prop_assert_eq!(id.to_string(), text.clone());
                let back = id.to_request_id();
                prop_assert_eq!(back.as_str(), text.as_str());
            }
        }
    }
}
