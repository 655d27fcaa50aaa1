//! Lowercase hex for 32-byte MACs (tiny; not worth a dependency in the wasm).

const DIGITS: &[u8; 16] = b"0123456789abcdef";

/// Lowercase hex of `bytes`.
pub(crate) fn encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(DIGITS[usize::from(b >> 4)] as char);
        out.push(DIGITS[usize::from(b & 0x0f)] as char);
    }
    out
}

fn nibble(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// Decodes exactly 64 hex digits into 32 bytes.
pub(crate) fn decode32(s: &[u8]) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in s.chunks_exact(2).enumerate() {
        out[i] = (nibble(pair[0])? << 4) | nibble(pair[1])?;
    }
    Some(out)
}

/// Decodes exactly 32 hex digits into 16 bytes.
pub(crate) fn decode16(s: &[u8]) -> Option<[u8; 16]> {
    if s.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, pair) in s.chunks_exact(2).enumerate() {
        out[i] = (nibble(pair[0])? << 4) | nibble(pair[1])?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let bytes: [u8; 32] = core::array::from_fn(|i| (i * 37) as u8);
        assert_eq!(decode32(encode(&bytes).as_bytes()), Some(bytes));
    }

    #[test]
    fn rejects_bad_digits_and_lengths() {
        assert_eq!(decode32(b"zz"), None);
        assert_eq!(decode32(&[b'g'; 64]), None);
        assert_eq!(decode32(&[b'a'; 63]), None);
    }
}
