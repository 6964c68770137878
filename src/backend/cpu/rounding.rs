//! Rounding to narrower dtypes, so that CPU results carry the GPU's storage precision.
//!
//! Round-to-nearest-even everywhere except `stochastic_round_bf16`, which the optimizer
//! uses when it writes bf16 weights or states: its random bits come from a hash of
//! (seed, index), the same function the CUDA kernel uses, so both round identically.

use half::{bf16, f16};

use super::Scalar;
use crate::tensor::DType;

/// Rounds every value of `xs` to `dtype` in place.
pub fn round_slice<T: Scalar>(dtype: DType, xs: &mut [T]) {
    if dtype == T::DTYPE || dtype == DType::F64 {
        return;
    }
    let round: fn(f32) -> f32 = match dtype {
        DType::F32 => |x| x,
        DType::BF16 => |x| bf16::from_f32(x).to_f32(),
        DType::F16 => |x| f16::from_f32(x).to_f32(),
        other => panic!("no CPU rounding to {other}; allocation should have refused it"),
    };
    for x in xs {
        *x = T::of(round(x.to_f32().unwrap_or(f32::NAN)) as f64);
    }
}

/// A 32-bit hash of (seed, index): cheap, stateless, identical on every backend.
pub fn hash_u32(seed: u64, index: u64) -> u32 {
    let mut z = seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) as u32
}

/// Rounds `x` to bf16 up or down with probability proportional to its distance to each,
/// so that the expected value is `x` and small optimizer updates are not lost.
pub fn stochastic_round_bf16(x: f32, seed: u64, index: u64) -> f32 {
    if !x.is_finite() {
        return bf16::from_f32(x).to_f32();
    }
    let noise = hash_u32(seed, index) & 0xFFFF;
    let bits = x.to_bits().wrapping_add(noise) & 0xFFFF_0000;
    f32::from_bits(bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_is_nearest_even() {
        let mut xs = [1.0f32 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, 3.0];
        round_slice(DType::BF16, &mut xs);
        assert_eq!(xs, [1.0, 1.0 + 4.0 / 256.0, 3.0]);
    }

    #[test]
    fn stochastic_rounding_is_unbiased() {
        // 1 + 1/512 sits a quarter of the way from 1 to the next bf16 (1 + 1/128).
        let x = 1.0f32 + 1.0 / 512.0;
        let n = 20_000;
        let mean = (0..n)
            .map(|i| stochastic_round_bf16(x, 7, i) as f64)
            .sum::<f64>()
            / n as f64;
        // The standard error of the mean is ~0.0078·sqrt(3/16)/sqrt(n) ≈ 2.4e-5; allow 5σ.
        assert!((mean - x as f64).abs() < 1.2e-4, "mean {mean}");
        for i in 0..100 {
            let r = stochastic_round_bf16(x, 7, i);
            assert!(r == 1.0 || r == 1.0 + 1.0 / 128.0);
        }
    }
}
