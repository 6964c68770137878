//! Rounding to narrower dtypes, so that CPU results carry the GPU's storage precision.
//!
//! Round-to-nearest-even everywhere (FP8 saturating at its largest finite value, as the
//! GPU's `satfinite` conversion does) except `stochastic_round_bf16`, which the optimizer
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
        DType::E4M3 => |x| round_fp8(x, DType::E4M3),
        DType::E5M2 => |x| round_fp8(x, DType::E5M2),
        // Written only as codes, which are whole numbers already.
        DType::I8 => |x| x.round_ties_even().clamp(-128.0, 127.0),
        DType::Q8 => |x| x.round_ties_even().clamp(0.0, 255.0),
        other => panic!("no CPU rounding to {other}; allocation should have refused it"),
    };
    for x in xs {
        *x = T::of(round(x.to_f32().unwrap_or(f32::NAN)) as f64);
    }
}

/// `x` rounded to the nearest e4m3 or e5m2 value, ties to even, clamped to ±max finite;
/// NaN stays NaN.
pub fn round_fp8(x: f32, dtype: DType) -> f32 {
    // (mantissa bits, exponent of the smallest normal, largest finite value)
    let (mantissa, min_exp, max) = match dtype {
        DType::E4M3 => (3, -6, 448.0),
        DType::E5M2 => (2, -14, 57344.0),
        other => panic!("{other} is not an fp8 dtype"),
    };
    if x.is_nan() {
        return x;
    }
    let a = (x as f64).abs();
    if a == 0.0 {
        return x;
    }
    // Below the smallest normal the spacing stays that of the subnormals.
    let exp = (((a.to_bits() >> 52) & 0x7FF) as i32 - 1023).max(min_exp);
    let step = (2.0f64).powi(exp - mantissa);
    let rounded = ((a / step).round_ties_even() * step).min(max);
    (rounded as f32).copysign(x)
}

/// A 32-bit hash of (seed, index), stateless and identical on every backend: the seed folded
/// to 32 bits, the index spread by the golden ratio, then the "lowbias32" finalizer. All in
/// 32-bit integer arithmetic, which the GPU does natively (AdamW hashes twice per
/// parameter; 64-bit multiplies are emulated there). `index` must be below 2³² (a tensor's
/// element index).
pub fn hash_u32(seed: u64, index: u64) -> u32 {
    debug_assert!(
        index <= u32::MAX as u64,
        "hash index {index} needs more than 32 bits"
    );
    let folded = (seed as u32) ^ ((seed >> 32) as u32).rotate_left(16);
    let mut z = folded ^ (index as u32).wrapping_mul(0x9E37_79B9);
    z ^= z >> 16;
    z = z.wrapping_mul(0x7FEB_352D);
    z ^= z >> 15;
    z = z.wrapping_mul(0x846C_A68B);
    z ^ (z >> 16)
}

/// Rounds `x` to bf16 up or down with probability proportional to its distance to each,
/// so that the expected value is `x` and small optimizer updates are not lost. `noise` is
/// 16 random bits (the low half of a `hash_u32`), added below bf16's mantissa.
pub fn stochastic_round_bf16(x: f32, noise: u32) -> f32 {
    debug_assert!(noise <= 0xFFFF, "noise {noise:#x} has more than 16 bits");
    if !x.is_finite() {
        return bf16::from_f32(x).to_f32();
    }
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

    /// Every finite value of the format, decoded from its bits by the format's definition.
    fn fp8_values(dtype: DType) -> Vec<f32> {
        let (mantissa, bias) = match dtype {
            DType::E4M3 => (3, 7),
            _ => (2, 15),
        };
        let mut values = vec![];
        for code in 0u32..128 {
            let (e, m) = ((code >> mantissa) as i32, code & ((1 << mantissa) - 1));
            let frac = m as f64 / (1 << mantissa) as f64;
            let v = if e == 0 {
                frac * 2f64.powi(1 - bias)
            } else {
                (1.0 + frac) * 2f64.powi(e - bias)
            };
            // e4m3fn's only NaN is S.1111.111; e5m2 keeps IEEE's top exponent for inf/NaN.
            let special = match dtype {
                DType::E4M3 => code == 0x7F,
                _ => e == 31,
            };
            if !special {
                values.push(v as f32);
            }
        }
        values
    }

    #[test]
    fn fp8_rounding_matches_the_formats() {
        for (dtype, max) in [(DType::E4M3, 448.0), (DType::E5M2, 57344.0)] {
            let values = fp8_values(dtype);
            assert_eq!(*values.last().unwrap(), max);
            for (i, &v) in values.iter().enumerate() {
                assert_eq!(round_fp8(v, dtype), v, "{dtype} {v} is representable");
                assert_eq!(round_fp8(-v, dtype), -v);
                let Some(&next) = values.get(i + 1) else {
                    continue;
                };
                // Halfway goes to the even code (the lower one when i is even); either
                // side of halfway goes to the nearer value.
                let mid = (v as f64 + next as f64) / 2.0;
                let even = if i % 2 == 0 { v } else { next };
                assert_eq!(
                    round_fp8(mid as f32, dtype),
                    even,
                    "{dtype} tie {v}..{next}"
                );
                let gap = (next - v) as f64;
                assert_eq!(round_fp8((mid - gap / 8.0) as f32, dtype), v);
                assert_eq!(round_fp8((mid + gap / 8.0) as f32, dtype), next);
            }
            for big in [max * 1.05, 1e30, f32::INFINITY] {
                assert_eq!(round_fp8(big, dtype), max, "{dtype} saturates");
                assert_eq!(round_fp8(-big, dtype), -max);
            }
            assert!(round_fp8(f32::NAN, dtype).is_nan());
        }
    }

    #[test]
    fn stochastic_rounding_is_unbiased() {
        // 1 + 1/512 sits a quarter of the way from 1 to the next bf16 (1 + 1/128).
        let x = 1.0f32 + 1.0 / 512.0;
        let n = 20_000;
        let mean = (0..n)
            .map(|i| stochastic_round_bf16(x, hash_u32(7, i) & 0xFFFF) as f64)
            .sum::<f64>()
            / n as f64;
        // The standard error of the mean is ~0.0078·sqrt(3/16)/sqrt(n) ≈ 2.4e-5; allow 5σ.
        assert!((mean - x as f64).abs() < 1.2e-4, "mean {mean}");
        for i in 0..100 {
            let r = stochastic_round_bf16(x, hash_u32(7, i) & 0xFFFF);
            assert!(r == 1.0 || r == 1.0 + 1.0 / 128.0);
        }
    }
}
