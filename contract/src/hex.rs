//! Lowercase hex for 32-byte MACs (tiny; not worth a dependency in the wasm).

const DIGITS: &[u8; 16] = b"0123456789abcdef";

/// The lowercase hex digit of a nibble (its low 4 bits).
pub(crate) fn digit(nibble: u8) -> u8 {
    DIGITS[usize::from(nibble & 0x0f)]
}

/// Lowercase hex of `bytes`.
pub(crate) fn encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(digit(b >> 4) as char);
        out.push(digit(*b) as char);
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

    #[test]
    fn uppercase_digits_decode_to_the_same_bytes_as_lowercase() {
        // A verifier keys its replay memory on the decoded MAC, so an upper-case copy of a
        // signature it accepted must decode to the very same bytes (and be a replay).
        let bytes: [u8; 32] = core::array::from_fn(|i| (i * 37 + 0xa0) as u8);
        let lower = encode(&bytes);
        let upper = lower.to_ascii_uppercase();
        assert_ne!(lower, upper);
        assert_eq!(decode32(upper.as_bytes()), Some(bytes));
        let mut every_letter = [0u8; 32];
        every_letter[..6].copy_from_slice(&[0xab, 0xcd, 0xef, 0xAF, 0xFA, 0xBE]);
        let mixed = format!("ABcdEFaffABe{}", "0".repeat(52));
        assert_eq!(decode32(mixed.as_bytes()), Some(every_letter));
        assert_eq!(
            decode16(b"0123456789ABCDEFabcdef0123456789"),
            Some([
                0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0xab, 0xcd, 0xef, 0x01, 0x23, 0x45,
                0x67, 0x89
            ])
        );
        for bad in [b'G', b'@', b'[', b'`', b'g', b'/', b':'] {
            let mut s = [b'0'; 32];
            s[31] = bad;
            assert_eq!(decode16(&s), None, "{}", char::from(bad));
        }
    }

    #[test]
    fn decode16_takes_exactly_32_digits() {
        let bytes: [u8; 16] = core::array::from_fn(|i| (i * 17) as u8);
        assert_eq!(decode16(encode(&bytes).as_bytes()), Some(bytes));
        assert_eq!(decode16(&[b'a'; 31]), None);
        assert_eq!(decode16(&[b'a'; 33]), None);
        assert_eq!(decode16(&[b'a'; 64]), None);
    }
}
