//! Request ids: the abort key (contract §1).

use core::fmt;

/// Longest accepted request id, in bytes.
pub const MAX_ID_LEN: usize = 128;

/// A validated request id: 1–128 bytes of `[A-Za-z0-9._:-]`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(String);

/// Why a byte string is not a request id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdError {
    /// Zero bytes.
    Empty,
    /// More than [`MAX_ID_LEN`] bytes (the length is given).
    TooLong(usize),
    /// A byte outside `[A-Za-z0-9._:-]` (its offset is given).
    BadByte(usize),
}

impl fmt::Display for IdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IdError::Empty => write!(f, "request id is empty"),
            IdError::TooLong(n) => {
                write!(f, "request id is {n} bytes, at most {MAX_ID_LEN} allowed")
            }
            IdError::BadByte(i) => {
                write!(
                    f,
                    "request id has a byte outside [A-Za-z0-9._:-] at offset {i}"
                )
            }
        }
    }
}

impl std::error::Error for IdError {}

/// Whether `b` may appear in a request id.
#[inline]
pub fn is_id_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-')
}

impl RequestId {
    /// Validates raw header bytes as a request id.
    pub fn try_new(bytes: &[u8]) -> Result<Self, IdError> {
        if bytes.is_empty() {
            return Err(IdError::Empty);
        }
        if bytes.len() > MAX_ID_LEN {
            return Err(IdError::TooLong(bytes.len()));
        }
        if let Some(i) = bytes.iter().position(|b| !is_id_byte(*b)) {
            return Err(IdError::BadByte(i));
        }
        // Every byte is ASCII, so this is valid UTF-8.
        Ok(RequestId(bytes.iter().map(|b| char::from(*b)).collect()))
    }

    /// The id of a UUID's 16 bytes ([`uuid_text`]): always valid.
    pub fn from_uuid(raw: &[u8; 16]) -> Self {
        RequestId(uuid_text(raw).iter().map(|b| char::from(*b)).collect())
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// vLLM's engine-side ids for this request: `cmpl-<id>` (completions) and
    /// `chatcmpl-<id>` (chat).
    pub fn vllm_engine_ids(&self) -> [String; 2] {
        [format!("cmpl-{}", self.0), format!("chatcmpl-{}", self.0)]
    }
}

/// The length of a hyphenated UUID.
pub const UUID_LEN: usize = 36;

/// Where a hyphenated UUID's hyphens are.
const UUID_HYPHENS: [usize; 4] = [8, 13, 18, 23];

/// The 16 bytes of `text` when it is a lowercase hyphenated UUID (`8-4-4-4-12` hex
/// digits, as Envoy generates `x-request-id`): exactly the ids [`uuid_text`] writes back
/// byte for byte. `None` for anything else (uppercase digits included).
pub fn uuid_bytes(text: &[u8]) -> Option<[u8; 16]> {
    if text.len() != UUID_LEN
        || UUID_HYPHENS.iter().any(|&i| text.get(i) != Some(&b'-'))
        || text.iter().any(u8::is_ascii_uppercase)
    {
        return None;
    }
    let mut digits = [0u8; 32];
    let mut n = 0;
    for &b in text.iter().filter(|&&b| b != b'-') {
        *digits.get_mut(n)? = b;
        n += 1;
    }
    crate::hex::decode16(digits.get(..n)?)
}

/// A UUID's 16 bytes as lowercase hyphenated hex (the inverse of [`uuid_bytes`]).
pub fn uuid_text(raw: &[u8; 16]) -> [u8; UUID_LEN] {
    let mut out = [b'-'; UUID_LEN];
    let mut digits = raw.iter().flat_map(|b| [b >> 4, b & 0x0f]);
    for (i, o) in out.iter_mut().enumerate() {
        if !UUID_HYPHENS.contains(&i) {
            *o = crate::hex::digit(digits.next().unwrap_or(0));
        }
    }
    out
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RequestId({})", self.0)
    }
}

impl core::str::FromStr for RequestId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, IdError> {
        RequestId::try_new(s.as_bytes())
    }
}

impl AsRef<str> for RequestId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn accepts_uuid_and_edge_forms() {
        for ok in [
            "3f1c2a4e-9b7d-4c1e-8a2b-1234567890ab",
            "a",
            "fx-chat",
            "x.y_z:1-2",
        ] {
            assert_eq!(RequestId::try_new(ok.as_bytes()).unwrap().as_str(), ok);
        }
        assert!(RequestId::try_new(&[b'a'; MAX_ID_LEN]).is_ok());
    }

    #[test]
    fn refuses_bad_ids() {
        assert_eq!(RequestId::try_new(b""), Err(IdError::Empty));
        assert_eq!(RequestId::try_new(&[b'a'; 129]), Err(IdError::TooLong(129)));
        assert_eq!(RequestId::try_new(b"ab\r\nc"), Err(IdError::BadByte(2)));
        assert_eq!(RequestId::try_new(b"a b"), Err(IdError::BadByte(1)));
        assert_eq!(RequestId::try_new(&[0xff, b'a']), Err(IdError::BadByte(0)));
        assert_eq!(RequestId::try_new(b"a/b"), Err(IdError::BadByte(1)));
    }

    #[test]
    fn engine_ids_follow_vllm() {
        let id = RequestId::try_new(b"fx-chat").unwrap();
        assert_eq!(
            id.vllm_engine_ids(),
            ["cmpl-fx-chat".to_string(), "chatcmpl-fx-chat".to_string()]
        );
    }

    #[test]
    fn error_messages_name_the_rule_and_the_culprit() {
        assert_eq!(IdError::Empty.to_string(), "request id is empty");
        assert_eq!(
            IdError::TooLong(129).to_string(),
            "request id is 129 bytes, at most 128 allowed"
        );
        assert_eq!(
            IdError::BadByte(3).to_string(),
            "request id has a byte outside [A-Za-z0-9._:-] at offset 3"
        );
    }

    #[test]
    fn an_id_shows_as_its_text_in_display_debug_as_ref_and_parse() {
        let id: RequestId = "fx-chat.1:a_b".parse().unwrap();
        assert_eq!(id.to_string(), "fx-chat.1:a_b");
        assert_eq!(format!("[{id}]"), "[fx-chat.1:a_b]");
        assert_eq!(format!("{id:?}"), "RequestId(fx-chat.1:a_b)");
        let as_ref: &str = id.as_ref();
        assert_eq!(as_ref, "fx-chat.1:a_b");
        assert_eq!("a b".parse::<RequestId>(), Err(IdError::BadByte(1)));
    }

    #[test]
    fn a_lowercase_uuid_packs_into_16_bytes_and_reads_back_the_same() {
        let text = b"3f1c2a4e-9b7d-4c1e-8a2b-1234567890ab";
        let raw = uuid_bytes(text).unwrap();
        assert_eq!(raw[0], 0x3f);
        assert_eq!(raw[15], 0xab);
        assert_eq!(&uuid_text(&raw), text);
        assert_eq!(RequestId::from_uuid(&raw).as_str().as_bytes(), text);
    }

    #[test]
    fn only_the_exact_lowercase_uuid_form_packs() {
        for not in [
            &b"3F1C2A4E-9B7D-4C1E-8A2B-1234567890AB"[..],
            b"3f1c2a4e-9b7d-4c1e-8a2b-1234567890aB",
            b"3f1c2a4e9b7d-4c1e-8a2b-1234567890ab-",
            b"3f1c2a4e-9b7d-4c1e-8a2b-1234567890a",
            b"3f1c2a4e-9b7d-4c1e-8a2b-1234567890abc",
            b"3f1c2a4e-9b7d-4c1e-8a2b-1234567890ag",
            b"3f1c2a4e-9b7d-4c1e-8a2b-12345678-0ab",
            b"3f1c2a4e-9b7d-4c1e-8a2b-1234567890a.",
            b"",
        ] {
            assert_eq!(uuid_bytes(not), None, "{}", String::from_utf8_lossy(not));
        }
    }

    proptest! {
        #[test]
        fn every_uuid_reads_back_and_every_packed_text_is_its_uuid(raw in any::<[u8; 16]>(), text in "[0-9a-fA-F-]{36}") {
            prop_assert_eq!(uuid_bytes(&uuid_text(&raw)), Some(raw));
            if let Some(r) = uuid_bytes(text.as_bytes()) {
                prop_assert_eq!(&uuid_text(&r)[..], text.as_bytes());
            }
        }

        #[test]
        fn never_panics_and_valid_means_charset(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            match RequestId::try_new(&bytes) {
                Ok(id) => prop_assert_eq!(id.as_str().as_bytes(), &bytes[..]),
                Err(_) => prop_assert!(bytes.is_empty() || bytes.len() > MAX_ID_LEN || bytes.iter().any(|b| !is_id_byte(*b))),
            }
        }
    }
}
