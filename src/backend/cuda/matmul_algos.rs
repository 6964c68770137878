//! Which of cuBLASLt's candidate algorithms each matmul shape runs.
//!
//! The heuristic's first guess is up to 20% slower than its best candidate on some of the
//! models' shapes (docs/gpu.md), so a shape seen for the first time has its
//! candidates timed once and keeps the fastest. Candidates may sum in different orders, so
//! the choice is cached on disk, per GPU model and cuBLASLt version: a run and its
//! continuation in another process then compute bitwise the same.
//!
//! Timings vary by a percent or two from run to run, so a near tie could go either way on a
//! fresh cache, and two runs from scratch would then differ in their last bits (and, after
//! many steps, visibly). The earliest candidate within `TIE` of the fastest is taken, so
//! only clear wins move a shape off the heuristic's order. `SMELT_MATMUL_TUNING=off` keeps the
//! heuristic's first guess (no timing, no cache): bitwise-reproducible runs on any machine.

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use cudarc::cublaslt::sys::cublasLtMatmulAlgo_t;

use super::disk_cache;
use crate::tensor::DType;

/// Everything that decides the descriptors and the algorithm of one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmKey {
    /// Row-major `op(a)` is `[m, k]`, `op(b)` is `[k, n]`, out is `[m, n]`.
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub trans_a: bool,
    pub trans_b: bool,
    /// Storage types of a, b and out: all bf16 or all f32, or for FP8 e4m3/e5m2 operands
    /// (not both e5m2, and only as `a · bᵀ`) into bf16.
    pub dtypes: [DType; 3],
    pub bias: bool,
    /// The largest power of two (≤ 256) dividing each of the a, b and out addresses: the
    /// heuristic must only pick kernels that accept them.
    pub align: [u32; 3],
    /// FP8 only: CUBLASLT_MATMUL_DESC_FAST_ACCUM (see `Fp8Sum`).
    pub fast_accum: bool,
}

/// How much slower than the fastest a candidate may be and still count as tied with it.
const TIE: f32 = 0.03;

pub struct AlgoChooser {
    /// `None` when tuning is off.
    tuning: Option<Tuning>,
}

struct Tuning {
    /// `None` when there is no cache directory: every process times afresh.
    dir: Option<PathBuf>,
    /// The GPU model and the cuBLASLt version, part of every entry's name.
    device: String,
}

impl AlgoChooser {
    /// Tuning unless `SMELT_MATMUL_TUNING` is `off` (`on` is the default).
    pub fn new(gpu_name: &str, cublaslt_version: usize) -> Result<Self> {
        let on = tuning_on(std::env::var("SMELT_MATMUL_TUNING").ok().as_deref())?;
        Ok(AlgoChooser {
            tuning: on.then(|| Tuning {
                dir: disk_cache::dir("SMELT_MATMUL_CACHE", "matmul"),
                device: format!("{gpu_name} cublasLt {cublaslt_version}"),
            }),
        })
    }

    /// The index into `candidates` (the heuristic's list, best guess first) that `key` uses:
    /// the cached choice if it names the same algorithm, else the earliest within `TIE` of
    /// the fastest by `time` (each candidate's milliseconds, infinite for one that failed;
    /// `None` when it could not time), then cached.
    pub fn choose(
        &self, key: &GemmKey, candidates: &[cublasLtMatmulAlgo_t],
        time: impl FnOnce() -> Option<Vec<f32>>,
    ) -> usize {
        let Some(tuning) = &self.tuning else {
            return 0;
        };
        if candidates.len() < 2 {
            return 0;
        }
        let file = disk_cache::key(&[&tuning.device, &format!("{key:?}")]);
        if let Some(dir) = &tuning.dir
            && let Some(i) = read(&dir.join(&file), candidates)
        {
            return i;
        }
        let Some(times) = time() else {
            return 0;
        };
        let fastest = times.iter().copied().fold(f32::INFINITY, f32::min);
        let chosen = times
            .iter()
            .position(|&t| t <= fastest * (1.0 + TIE))
            .unwrap_or(0);
        if let Some(dir) = &tuning.dir {
            // A cache that cannot be written only costs another timing next run.
            let _ = disk_cache::write(dir, &file, entry(chosen, &candidates[chosen]).as_bytes());
        }
        chosen
    }
}

/// `SMELT_MATMUL_TUNING`'s value, if set.
fn tuning_on(value: Option<&str>) -> Result<bool> {
    match value {
        None | Some("on") => Ok(true),
        Some("off") => Ok(false),
        Some(other) => bail!("SMELT_MATMUL_TUNING={other}: set it to on or off"),
    }
}

/// An entry: the candidate's index and its algorithm's bytes, which must match on reading
/// (a different library or driver may rank other candidates).
fn entry(index: usize, algo: &cublasLtMatmulAlgo_t) -> String {
    let words: Vec<String> = algo.data.iter().map(|w| format!("{w:016x}")).collect();
    format!("{index} {}\n", words.join(""))
}

fn read(path: &Path, candidates: &[cublasLtMatmulAlgo_t]) -> Option<usize> {
    let text = std::fs::read_to_string(path).ok()?;
    let index: usize = text.split_whitespace().next()?.parse().ok()?;
    let algo = candidates.get(index)?;
    (text == entry(index, algo)).then_some(index)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;

    fn algo(seed: u64) -> cublasLtMatmulAlgo_t {
        cublasLtMatmulAlgo_t {
            data: std::array::from_fn(|i| seed * 100 + i as u64),
        }
    }

    fn key() -> GemmKey {
        GemmKey {
            m: 64,
            n: 32,
            k: 16,
            trans_a: false,
            trans_b: true,
            dtypes: [DType::BF16; 3],
            bias: false,
            align: [256; 3],
            fast_accum: false,
        }
    }

    fn chooser(dir: &Path, device: &str) -> AlgoChooser {
        AlgoChooser {
            tuning: Some(Tuning {
                dir: Some(dir.to_path_buf()),
                device: device.into(),
            }),
        }
    }

    #[test]
    fn times_once_then_reuses_the_cached_choice() {
        let dir = tempfile::tempdir().unwrap();
        let candidates = [algo(1), algo(2), algo(3)];
        let first = chooser(dir.path(), "gpu");
        assert_eq!(
            first.choose(&key(), &candidates, || Some(vec![2.0, 1.0, 3.0])),
            1
        );
        // Another process: the cache answers, even against different timings.
        let second = chooser(dir.path(), "gpu");
        let untimed = || -> Option<Vec<f32>> { panic!("a cached choice must not be timed") };
        assert_eq!(second.choose(&key(), &candidates, untimed), 1);
        // Another GPU or library version times afresh.
        let other = chooser(dir.path(), "other gpu");
        assert_eq!(
            other.choose(&key(), &candidates, || Some(vec![0.5, 1.0, 3.0])),
            0
        );
    }

    #[test]
    fn a_stale_or_damaged_entry_is_timed_again() {
        let dir = tempfile::tempdir().unwrap();
        let c = chooser(dir.path(), "gpu");
        assert_eq!(
            c.choose(&key(), &[algo(1), algo(2)], || Some(vec![2.0, 1.0])),
            1
        );
        // The heuristic now lists a different algorithm at index 1.
        assert_eq!(
            c.choose(&key(), &[algo(1), algo(7)], || Some(vec![1.0, 2.0])),
            0
        );
        for entry in std::fs::read_dir(dir.path()).unwrap() {
            std::fs::write(entry.unwrap().path(), "garbage").unwrap();
        }
        assert_eq!(
            c.choose(&key(), &[algo(1), algo(7)], || Some(vec![3.0, 2.0])),
            1
        );
    }

    #[test]
    fn the_switch_takes_on_or_off_and_names_itself_otherwise() {
        assert!(tuning_on(None).unwrap());
        assert!(tuning_on(Some("on")).unwrap());
        assert!(!tuning_on(Some("off")).unwrap());
        let err = tuning_on(Some("0")).unwrap_err().to_string();
        assert!(
            err.contains("SMELT_MATMUL_TUNING=0") && err.contains("on or off"),
            "{err}"
        );
    }

    #[test]
    fn ties_and_failures_keep_the_heuristic_order() {
        let dir = tempfile::tempdir().unwrap();
        let c = chooser(dir.path(), "gpu");
        let candidates = [algo(1), algo(2), algo(3)];
        assert_eq!(
            c.choose(&key(), &candidates, || Some(vec![f32::INFINITY, 1.0, 1.0])),
            1
        );
        // Within 3% of the fastest counts as a tie: the earlier candidate stays.
        let near = chooser(dir.path(), "near tie");
        assert_eq!(
            near.choose(&key(), &candidates, || Some(vec![1.02, 1.0, 1.1])),
            0
        );
        let failed = chooser(dir.path(), "all failed");
        assert_eq!(
            failed.choose(&key(), &candidates, || Some(vec![f32::INFINITY; 3])),
            0
        );
        let untimeable = chooser(dir.path(), "no scratch");
        assert_eq!(untimeable.choose(&key(), &candidates, || None), 0);
    }
}
