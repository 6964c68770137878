//! The CPU's memory: a buffer of `T` (or i32) per tensor, so nothing needs moving. A
//! category that cannot fit the host is refused before anything of it is allocated, with
//! its size and what to change, rather than aborting the process on a failed allocation.

use std::cell::RefCell;
use std::rc::Rc;

use anyhow::{Result, anyhow, ensure};

use super::{Buffer, Cpu, Scalar};
use crate::backend::ops::memory::check_row_copy;
use crate::backend::{MemoryOps, RowAt, UnsupportedDtype};
use crate::tensor::{DType, Tensor, TensorSpec};

impl<T: Scalar> MemoryOps for Cpu<T> {
    type Storage = Rc<RefCell<Buffer<T>>>;

    fn allocate(&self, category: &str, specs: &[TensorSpec]) -> Result<Vec<Tensor<Self>>> {
        if let Some(spec) = specs
            .iter()
            .find(|s| s.dtype == DType::F64 && T::DTYPE != DType::F64)
        {
            return Err(UnsupportedDtype {
                backend: "cpu",
                op: "allocate",
                dtypes: vec![spec.dtype],
            }
            .into());
        }
        let bytes = host_bytes::<T>(specs);
        match (bytes, available_bytes()) {
            (None, _) => return Err(too_large(category, "more than 2^64 bytes".into())),
            (Some(bytes), Some(available)) if bytes > available => {
                let size = format!(
                    "{}, more than the host's {} available",
                    human(bytes),
                    human(available)
                );
                return Err(too_large(category, size));
            }
            _ => {}
        }
        specs
            .iter()
            .map(|spec| {
                let n = spec.numel();
                let buffer = match spec.dtype {
                    DType::I32 => Buffer::Int(zeroed(n, 0, category)?),
                    _ => Buffer::Float(zeroed(n, T::zero(), category)?),
                };
                Ok(Tensor::new(
                    Rc::new(RefCell::new(buffer)),
                    spec.shape.clone(),
                    spec.dtype,
                ))
            })
            .collect()
    }

    fn upload(&self, dst: &Tensor<Self>, src: &[f32]) -> Result<()> {
        ensure!(
            src.len() == dst.numel(),
            "upload of {} values into {:?}",
            src.len(),
            dst.shape
        );
        self.update(dst, |d| {
            d.iter_mut()
                .zip(src)
                .for_each(|(d, &s)| *d = T::of(s as f64))
        })
    }

    fn upload_i32(&self, dst: &Tensor<Self>, src: &[i32]) -> Result<()> {
        ensure!(
            src.len() == dst.numel(),
            "upload of {} values into {:?}",
            src.len(),
            dst.shape
        );
        let range = dst.offset..dst.offset + dst.numel();
        match &mut *dst.storage.borrow_mut() {
            Buffer::Int(v) => v[range].copy_from_slice(src),
            Buffer::Float(_) => anyhow::bail!("upload_i32 into a float tensor {:?}", dst.shape),
        }
        Ok(())
    }

    fn download(&self, src: &Tensor<Self>) -> Result<Vec<f32>> {
        Ok(self.floats(src)?.iter().map(|x| x.f64() as f32).collect())
    }

    fn download_f64(&self, src: &Tensor<Self>) -> Result<Vec<f64>> {
        Ok(self.floats(src)?.iter().map(|x| x.f64()).collect())
    }

    fn fill(&self, dst: &Tensor<Self>, value: f32) -> Result<()> {
        self.update(dst, |d| d.fill(T::of(value as f64)))
    }

    fn copy(&self, dst: &Tensor<Self>, src: &Tensor<Self>) -> Result<()> {
        ensure!(
            dst.numel() == src.numel(),
            "copy {:?} into {:?}",
            src.shape,
            dst.shape
        );
        let src = self.floats(src)?;
        self.update(dst, |d| d.copy_from_slice(&src))
    }

    fn copy_row_at(
        &self, dst: &Tensor<Self>, src: &Tensor<Self>, at: &Tensor<Self>, side: RowAt,
    ) -> Result<()> {
        let (rows, cols) = check_row_copy(dst, src, at, side)?;
        let row = (self.ints(at)?[0].max(0) as usize).min(rows - 1);
        let (dst_row, src_row) = match side {
            RowAt::Dst => (row, 0),
            RowAt::Src => (0, row),
        };
        let src = self.floats(src)?;
        let src = &src[src_row * cols..(src_row + 1) * cols];
        self.update(dst, |d| {
            d[dst_row * cols..(dst_row + 1) * cols].copy_from_slice(src)
        })
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}

/// The bytes `specs` take in host memory (a float tensor is held in `T` whatever its dtype),
/// or `None` where that overflows.
fn host_bytes<T>(specs: &[TensorSpec]) -> Option<usize> {
    specs.iter().try_fold(0usize, |sum, spec| {
        let size = match spec.dtype {
            DType::I32 => size_of::<i32>(),
            _ => size_of::<T>(),
        };
        sum.checked_add(spec.checked_numel()?.checked_mul(size)?)
    })
}

/// `n` copies of `zero`, or an error where the allocator refuses the memory.
fn zeroed<X: Clone>(n: usize, zero: X, category: &str) -> Result<Vec<X>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|e| {
        let size = format!(
            "{} for one tensor ({e})",
            human(n.saturating_mul(size_of::<X>()))
        );
        too_large(category, size)
    })?;
    v.resize(n, zero);
    Ok(v)
}

/// The host memory that new allocations can take without swapping (MemAvailable), where
/// the kernel says.
fn available_bytes() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: usize = text
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

/// The error for a category that cannot be allocated: its size and what sets it.
fn too_large(category: &str, size: String) -> anyhow::Error {
    let fix = match category {
        "activations" | "fp8" => {
            "they grow with --batch-size and --seq-len: lower those, or turn on recompute \
             (--recompute-block) and raise --lmhead-chunks"
        }
        "losses" => "they grow with --grad-accumulation, --batch-size and --seq-len: lower those",
        "kv cache" => "it grows with the context: lower --max-new-tokens or shorten the prompt",
        _ => {
            "they grow with the model: its config.json sets the size (vocab_size, hidden_size, \
             intermediate_size, num_hidden_layers); choose a smaller model"
        }
    };
    anyhow!("cannot allocate the {category} in host memory: {size}; {fix}")
}

/// Bytes in binary units, e.g. `5.9 TiB`.
fn human(bytes: usize) -> String {
    let units = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < units.len() {
        value /= 1024.0;
        unit += 1;
    }
    match unit {
        0 => format!("{bytes} bytes"),
        _ => format!("{value:.1} {}", units[unit]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_beyond_the_host_are_refused_before_allocating() {
        let cpu = Cpu::<f32>::new();
        // 2^60 elements: exabytes, more than any host has.
        let huge = TensorSpec::new("logits", &[1 << 30, 1 << 30], DType::F32);
        let err = format!("{:#}", cpu.allocate("activations", &[huge]).unwrap_err());
        assert!(
            err.contains("cannot allocate the activations in host memory: 4.0 EiB")
                && err.contains("--batch-size"),
            "{err}"
        );
        // A shape whose size overflows 64 bits.
        let overflow = TensorSpec::new("embed", &[1 << 40, 1 << 40], DType::BF16);
        let err = format!("{:#}", cpu.allocate("weights", &[overflow]).unwrap_err());
        assert!(
            err.contains("weights in host memory: more than 2^64 bytes")
                && err.contains("vocab_size"),
            "{err}"
        );
        // What fits is allocated, zeroed.
        let small = TensorSpec::new("x", &[3, 2], DType::BF16);
        let t = cpu.allocate("weights", &[small]).unwrap();
        assert_eq!(cpu.download(&t[0]).unwrap(), [0.0; 6]);
    }
}
