//! 64-bit FNV-1a: the same on every platform and Rust version, for hashes that are stored or
//! compared across runs (checkpoint config hashes, logged data hashes, disk-cache names).

/// The hash of no bytes, where every hash starts.
pub const FNV1A_START: u64 = 0xcbf2_9ce4_8422_2325;

/// Continues hash `h` over `bytes`.
pub fn fnv1a_extend(h: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(h, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// The hash of `bytes`.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    fnv1a_extend(FNV1A_START, bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_published_test_vectors() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
        assert_eq!(fnv1a_extend(fnv1a(b"foo"), b"bar"), fnv1a(b"foobar"));
    }
}
