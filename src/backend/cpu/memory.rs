//! The CPU's memory: a buffer of `T` (or i32) per tensor, so nothing needs moving.

use std::cell::RefCell;
use std::rc::Rc;

use anyhow::{Result, ensure};

use super::{Buffer, Cpu, Scalar};
use crate::backend::{MemoryOps, UnsupportedDtype};
use crate::tensor::{DType, Tensor, TensorSpec};

impl<T: Scalar> MemoryOps for Cpu<T> {
    type Storage = Rc<RefCell<Buffer<T>>>;

    fn allocate(&self, _category: &str, specs: &[TensorSpec]) -> Result<Vec<Tensor<Self>>> {
        specs
            .iter()
            .map(|spec| {
                let representable = match spec.dtype {
                    DType::F64 => T::DTYPE == DType::F64,
                    _ => true,
                };
                if !representable {
                    return Err(UnsupportedDtype {
                        backend: "cpu",
                        op: "allocate",
                        dtypes: vec![spec.dtype],
                    }
                    .into());
                }
                let buffer = match spec.dtype {
                    DType::I32 => Buffer::Int(vec![0; spec.numel()]),
                    _ => Buffer::Float(vec![T::zero(); spec.numel()]),
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

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}
