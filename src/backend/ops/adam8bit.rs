//! 8-bit Adam moments (`--opt-m-dtype q8 --opt-v-dtype q8`), blockwise dynamic quantization
//! as bitsandbytes' AdamW8bit keeps them: each moment is a byte per element, an index into a
//! 256-entry map of values in [-1, 1] (signed, for the first moment) or [0, 1] (the second),
//! and each block of `Q8_BLOCK` consecutive elements has an f32 abs-max that scales its codes.
//! The map is dynamic: most of its codes are near zero, where the moments of most weights are.
//!
//! An update reads a block's codes as `map[code] · absmax`, updates each element in f32 as the
//! wider states are updated, takes the block's new abs-max (1 where the block is all zeros)
//! and writes each element the code nearest to `value / absmax`, ties to the lower code, as
//! bitsandbytes' reference does (`argmin |x − map|`). Every backend does exactly this, so the
//! GPU writes the CPU's codes.

use std::sync::LazyLock;

use crate::tensor::DType;

/// Elements per abs-max: bitsandbytes' block size for its blockwise optimizers.
pub const Q8_BLOCK: usize = 256;

/// Tensors smaller than this keep f32 moments whatever was asked, as bitsandbytes'
/// `min_8bit_size` has it: norms and biases cost nothing in 32 bits and are the most
/// sensitive to quantization noise.
pub const Q8_MIN_NUMEL: usize = 4096;

/// The dtype of the moment of a tensor of `numel` elements when `requested` is asked for.
pub fn moment_dtype(requested: DType, numel: usize) -> DType {
    match requested {
        DType::Q8 if numel < Q8_MIN_NUMEL => DType::F32,
        other => other,
    }
}

/// The abs-maxes of a Q8 moment of `numel` elements: one per block, the last maybe partial.
pub fn absmax_len(numel: usize) -> usize {
    numel.div_ceil(Q8_BLOCK)
}

/// The 256 values a code stands for, ascending.
#[derive(Clone, Debug, PartialEq)]
pub struct DynamicMap(pub [f32; 256]);

impl DynamicMap {
    /// bitsandbytes' `create_dynamic_map(signed)` with its defaults (7 exponent bits, 8 bits
    /// in all): for each decade 10^(i−6), i = 0..6, the midpoints of `k + 1` points spaced
    /// evenly over [0.1, 1] (torch's f32 `linspace`), scaled by it, with k = 2^i signed (and
    /// their negatives) or 2^(i+1) unsigned; then 0 and 1. Built in f32 as torch builds it:
    /// `scripts/adam8bit_fixture.py` keeps bitsandbytes' own maps, which `tests/adam8bit.rs`
    /// compares bit for bit.
    pub fn new(signed: bool) -> DynamicMap {
        let mut data = Vec::with_capacity(256);
        for i in 0..7 {
            let k = if signed { 1 << i } else { 2 << i };
            let points = linspace(0.1, 1.0, k + 1);
            let decade = 10f64.powi(i - 6) as f32;
            for pair in points.windows(2) {
                let mean = (pair[0] + pair[1]) / 2.0;
                data.push(decade * mean);
                if signed {
                    data.push(-decade * mean);
                }
            }
        }
        data.extend([0.0, 1.0]);
        data.sort_by(f32::total_cmp);
        DynamicMap(
            data.try_into()
                .expect("7 decades of codes, 0 and 1 make 256"),
        )
    }

    /// The first moment's map, built once per process.
    pub fn signed() -> &'static DynamicMap {
        static MAP: LazyLock<DynamicMap> = LazyLock::new(|| DynamicMap::new(true));
        &MAP
    }

    /// The second moment's map, built once per process.
    pub fn unsigned() -> &'static DynamicMap {
        static MAP: LazyLock<DynamicMap> = LazyLock::new(|| DynamicMap::new(false));
        &MAP
    }

    /// The code nearest to `x` (ties, and NaN, to the lower code; below the first value the
    /// first code, above the last the last).
    pub fn quantize(&self, x: f32) -> u8 {
        let map = &self.0;
        // The last code whose value is ≤ x (0 when none is), by bisection as the GPU does it.
        let (mut lo, mut hi) = (0usize, 255usize);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if map[mid] <= x {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        if lo < 255 && map[lo + 1] - x < x - map[lo] {
            lo += 1;
        }
        lo as u8
    }

    /// The value code `code` stands for.
    pub fn value(&self, code: u8) -> f32 {
        self.0[code as usize]
    }
}

/// torch's f32 `linspace(start, end, steps)` on the CPU: the first half counted up from
/// `start`, the second down from `end`, by a step computed once, each point one fused
/// multiply-add (as torch's build contracts it; unfused, a few points differ in the last bit).
fn linspace(start: f32, end: f32, steps: usize) -> Vec<f32> {
    let step = (end - start) / (steps - 1) as f32;
    let halfway = steps / 2;
    (0..steps)
        .map(|i| match i < halfway {
            true => step.mul_add(i as f32, start),
            false => (-step).mul_add((steps - i - 1) as f32, end),
        })
        .collect()
}

/// A block's scale: its largest magnitude, or 1 for a block of zeros (whose codes are then
/// all the code of 0).
pub fn block_absmax(values: &[f32]) -> f32 {
    let largest = values.iter().fold(0f32, |a, &x| a.max(x.abs()));
    if largest == 0.0 { 1.0 } else { largest }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_span_their_ranges_with_distinct_ascending_values() {
        for (map, low) in [(DynamicMap::signed(), -1.0), (DynamicMap::unsigned(), 0.0)] {
            let v = &map.0;
            assert!(v.windows(2).all(|p| p[0] < p[1]), "{v:?}");
            assert_eq!(v[255], 1.0);
            assert!(v[0] >= low && v[0] < low + 0.01, "{}", v[0]);
            assert!(v.contains(&0.0));
            // Dynamic: a code within each decade down to 1e-6.
            assert!(v.iter().any(|&x| x > 0.0 && x < 1e-6 * 1.01));
        }
        // The signed map is symmetric but for 1, which has no negative.
        let s = DynamicMap::signed().0;
        for &x in &s[..255] {
            assert!(s.contains(&-x), "{x}");
        }
    }

    #[test]
    fn quantize_picks_the_nearest_code_and_the_lower_on_ties() {
        let map = DynamicMap::signed();
        let v = &map.0;
        for x in [
            -1.0, -0.5, -1e-7, 0.0, 3e-4, 0.031, 0.5, 0.99, 1.0, 2.0, -2.0,
        ] {
            let best = (0..256)
                .min_by(|&a, &b| (v[a] - x).abs().total_cmp(&(v[b] - x).abs()))
                .unwrap();
            assert_eq!(map.quantize(x) as usize, best, "{x}");
        }
        for code in 0..=255u8 {
            assert_eq!(map.quantize(map.value(code)), code);
        }
        // Halfway between two codes, in f32, goes to the lower.
        let (a, b) = (v[200], v[201]);
        let mid = a + (b - a) / 2.0;
        if b - mid == mid - a {
            assert_eq!(map.quantize(mid), 200);
        }
    }

    #[test]
    fn small_tensors_keep_f32_moments() {
        assert_eq!(moment_dtype(DType::Q8, Q8_MIN_NUMEL - 1), DType::F32);
        assert_eq!(moment_dtype(DType::Q8, Q8_MIN_NUMEL), DType::Q8);
        assert_eq!(moment_dtype(DType::BF16, 10), DType::BF16);
        assert_eq!(absmax_len(257), 2);
    }
}
