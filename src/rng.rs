//! A small seeded random generator (xoshiro256**) whose whole state is four integers, so
//! that checkpoints can save and restore it exactly.

use rayon::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// Seeds through splitmix64, so that nearby seeds give unrelated streams.
    pub fn new(seed: u64) -> Self {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            x ^ (x >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    /// An independent stream for sub-task `index` of the stream seeded by `seed`.
    pub fn derived(seed: u64, index: u64) -> Self {
        Rng::new(seed ^ index.wrapping_mul(0xD1B5_4A32_D192_ED03).rotate_left(17))
    }

    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.uniform() * n as f64) as usize
    }

    /// Standard normal, by Box–Muller.
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// Fisher–Yates.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i + 1));
        }
    }
}

/// Fills `out` with draws of N(0, std²). Each block of 2^16 values takes its own stream,
/// derived from `seed`, `stream` and the block's index, so that large tensors fill in
/// parallel and the values do not depend on the thread count.
pub fn fill_normal(out: &mut [f32], std: f64, seed: u64, stream: u64) {
    const BLOCK: usize = 1 << 16;
    out.par_chunks_mut(BLOCK)
        .enumerate()
        .for_each(|(j, chunk)| {
            let mut rng = Rng::derived(seed, (stream << 32) | j as u64);
            chunk
                .iter_mut()
                .for_each(|x| *x = (rng.normal() * std) as f32);
        });
}

#[cfg(test)]
mod tests {
    use super::Rng;

    #[test]
    fn normal_has_unit_moments() {
        let mut r = Rng::new(3);
        let xs: Vec<f64> = (0..100_000).map(|_| r.normal()).collect();
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / xs.len() as f64;
        // Standard errors: mean 1/sqrt(n) ≈ 0.003, variance sqrt(2/n) ≈ 0.0045; allow ~4σ.
        assert!(
            mean.abs() < 0.013 && (var - 1.0).abs() < 0.02,
            "mean {mean} var {var}"
        );
    }

    #[test]
    fn same_seed_same_stream() {
        let (mut a, mut b) = (Rng::new(9), Rng::new(9));
        assert!((0..10).all(|_| a.next_u64() == b.next_u64()));
        assert_ne!(Rng::new(9).next_u64(), Rng::new(10).next_u64());
    }
}
