//! A header map as the proxy-wasm host serializes it (`proxy_get_header_map_pairs`):
//! the values of a few headers found in one pass, so that one host call (and one copy into
//! the VM) replaces a call per header.
//!
//! Layout (little-endian): a `u32` count; per header a `u32` name length and a `u32` value
//! length; then per header its name, a NUL, its value, a NUL.

/// The first value of each of `names` (lowercase, as the host keeps header names; the
/// first of several, as a single read returns) in `map`; `None` where a header is absent.
/// `None` when `map` does not follow the layout (the caller then reads the headers one by
/// one). An empty `map` is an empty header map.
pub fn values<'a, const N: usize>(
    map: &'a [u8],
    names: [&str; N],
) -> Option<[Option<&'a [u8]>; N]> {
    let mut out = [None; N];
    fill(map, &names, &mut out).then_some(out)
}

/// [`values`] for any number of names (one copy of the code in the module).
fn fill<'a>(map: &'a [u8], names: &[&str], out: &mut [Option<&'a [u8]>]) -> bool {
    if map.is_empty() {
        return true;
    }
    let word = |at: usize| -> Option<usize> {
        let b = map.get(at..at.checked_add(4)?)?;
        usize::try_from(u32::from_le_bytes(<[u8; 4]>::try_from(b).ok()?)).ok()
    };
    // A field of `len` bytes at `at`, then its NUL; returns it and where the next starts.
    let field = |at: usize, len: usize| -> Option<(&'a [u8], usize)> {
        let end = at.checked_add(len)?;
        let bytes = map.get(at..end)?;
        (map.get(end) == Some(&0)).then_some((bytes, end + 1))
    };
    let mut walk = || -> Option<usize> {
        let count = word(0)?;
        let mut at = count.checked_mul(8)?.checked_add(4)?;
        for i in 0..count {
            let (name, next) = field(at, word(4 + 8 * i)?)?;
            let (value, next) = field(next, word(8 + 8 * i)?)?;
            at = next;
            for (slot, want) in out.iter_mut().zip(names) {
                if slot.is_none() && name.eq_ignore_ascii_case(want.as_bytes()) {
                    *slot = Some(value);
                }
            }
        }
        Some(at)
    };
    walk() == Some(map.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host's serialization of `pairs`.
    fn serialize(pairs: &[(&str, &[u8])]) -> Vec<u8> {
        let mut out = (pairs.len() as u32).to_le_bytes().to_vec();
        for (k, v) in pairs {
            out.extend((k.len() as u32).to_le_bytes());
            out.extend((v.len() as u32).to_le_bytes());
        }
        for (k, v) in pairs {
            out.extend(k.as_bytes());
            out.push(0);
            out.extend(*v);
            out.push(0);
        }
        out
    }

    #[test]
    fn finds_each_first_value_and_absent_ones() {
        let map = serialize(&[
            (":status", b"200"),
            ("content-type", b"text/event-stream"),
            ("x-kvguard-control", b"s1"),
            ("x-kvguard-control", b"s2"),
            ("date", b""),
            ("x-bytes", &[0xff, 0x00, 0xfe]),
        ]);
        assert_eq!(
            values(
                &map,
                [
                    "x-kvguard-control",
                    "content-type",
                    "content-encoding",
                    "date",
                    "x-bytes"
                ]
            ),
            Some([
                Some(&b"s1"[..]),
                Some(&b"text/event-stream"[..]),
                None,
                Some(&b""[..]),
                Some(&[0xff, 0x00, 0xfe][..]),
            ])
        );
        assert_eq!(values(&serialize(&[]), ["a"]), Some([None]));
        assert_eq!(values(&[], ["a"]), Some([None]));
    }

    #[test]
    fn names_match_whatever_their_case() {
        let map = serialize(&[("Content-Type", b"a")]);
        assert_eq!(values(&map, ["content-type"]), Some([Some(&b"a"[..])]));
    }

    #[test]
    fn a_map_off_the_layout_is_refused_never_misread() {
        let good = serialize(&[("a", b"1"), ("bb", b"22")]);
        assert!(values(&good, ["a"]).is_some());
        // Cut anywhere, or a byte more.
        for n in 1..good.len() {
            assert_eq!(values(&good[..n], ["a"]), None, "cut at {n}");
        }
        let mut longer = good.clone();
        longer.push(0);
        assert_eq!(values(&longer, ["a"]), None);
        // A field not followed by its NUL.
        let mut no_nul = good.clone();
        let first_nul = 4 + 2 * 8 + 1;
        no_nul[first_nul] = b'x';
        assert_eq!(values(&no_nul, ["a"]), None);
        // Counts and lengths that overflow or point past the end.
        let mut huge = good.clone();
        huge[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(values(&huge, ["a"]), None);
        let mut long_name = good;
        long_name[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(values(&long_name, ["a"]), None);
    }
}
