//! The reference backend: plain loops in f32 (or f64 for gradient checks), a real GEMM, and
//! rayon where rows are independent. Every result is deterministic, whatever the thread
//! count, so recompute and resume can be checked bit for bit.
//!
//! Each tensor gets its own buffer. A tensor of a narrower dtype than `T` (bf16, say) holds
//! values rounded to that dtype after every write, which is how the CPU predicts the GPU.

mod adamw;
mod attention;
mod classifier;
mod embedding;
mod fp8;
pub mod int8;
mod matmul;
mod memory;
mod rmsnorm;
mod rope;
pub mod rounding;
mod scalar;
mod swiglu;

use std::cell::{Ref, RefMut};
use std::marker::PhantomData;

use anyhow::{Result, anyhow, ensure};

pub use classifier::IGNORE_INDEX;
pub use scalar::Scalar;
use scalar::{add_column_sums, sum_f64};

use super::Backend;
use crate::tensor::Tensor;

pub enum Buffer<T> {
    Float(Vec<T>),
    Int(Vec<i32>),
}

/// The CPU backend computing in `T`.
#[derive(Default)]
pub struct Cpu<T: Scalar = f32> {
    _scalar: PhantomData<T>,
}

impl<T: Scalar> Cpu<T> {
    pub fn new() -> Self {
        Cpu {
            _scalar: PhantomData,
        }
    }

    fn floats<'a>(&self, t: &'a Tensor<Self>) -> Result<Ref<'a, [T]>> {
        let range = t.offset..t.offset + t.numel();
        Ref::filter_map(t.storage.borrow(), |b| match b {
            Buffer::Float(v) => Some(&v[range]),
            Buffer::Int(_) => None,
        })
        .map_err(|_| anyhow!("expected a float tensor, got {:?} {}", t.shape, t.dtype))
    }

    fn floats_mut<'a>(&self, t: &'a Tensor<Self>) -> Result<RefMut<'a, [T]>> {
        let range = t.offset..t.offset + t.numel();
        let buffer = t
            .storage
            .try_borrow_mut()
            .map_err(|_| anyhow!("an output tensor {:?} aliases an input", t.shape))?;
        RefMut::filter_map(buffer, |b| match b {
            Buffer::Float(v) => Some(&mut v[range]),
            Buffer::Int(_) => None,
        })
        .map_err(|_| anyhow!("expected a float tensor, got {:?} {}", t.shape, t.dtype))
    }

    fn ints<'a>(&self, t: &'a Tensor<Self>) -> Result<Ref<'a, [i32]>> {
        let range = t.offset..t.offset + t.numel();
        Ref::filter_map(t.storage.borrow(), |b| match b {
            Buffer::Int(v) => Some(&v[range]),
            Buffer::Float(_) => None,
        })
        .map_err(|_| anyhow!("expected an i32 tensor, got {:?} {}", t.shape, t.dtype))
    }

    /// Runs `f` on the tensor's values at full precision, then rounds them to its dtype: how
    /// every op writes its output, and how gradient checks nudge one weight without a round
    /// trip through f32.
    pub fn update(&self, t: &Tensor<Self>, f: impl FnOnce(&mut [T])) -> Result<()> {
        let mut values = self.floats_mut(t)?;
        f(&mut values);
        rounding::round_slice(t.dtype, &mut values);
        Ok(())
    }

    /// Raises `amax[0]` to the abs-max of `values`.
    fn raise_abs_max(&self, amax: &Tensor<Self>, values: &[T]) -> Result<()> {
        let found = fp8::abs_max(values);
        self.update(amax, |a| a[0] = a[0].max(T::of(found as f64)))
    }

    /// Raises `amax[0]` to the abs-max of `t`: the `amax` argument of the producing ops.
    fn report_abs_max(&self, amax: Option<&Tensor<Self>>, t: &Tensor<Self>) -> Result<()> {
        match amax {
            Some(amax) => self.raise_abs_max(amax, &self.floats(t)?),
            None => Ok(()),
        }
    }

    /// The one value of a `[1]` tensor (an abs-max or a descale).
    fn scalar(&self, t: &Tensor<Self>) -> Result<f32> {
        ensure!(
            t.numel() == 1,
            "expected a one-element tensor, got {:?}",
            t.shape
        );
        Ok(self.floats(t)?[0].f64() as f32)
    }

    /// The tensor's values at full precision.
    pub fn values(&self, t: &Tensor<Self>) -> Result<Vec<T>> {
        Ok(self.floats(t)?.to_vec())
    }
}

impl<T: Scalar> Backend for Cpu<T> {
    /// The CPU runs each op as it is called, and records none.
    type Recording = std::convert::Infallible;

    fn replay(&self, recording: &Self::Recording) -> Result<()> {
        match *recording {}
    }

    fn describe(&self) -> String {
        format!(
            "cpu ({}, {} threads)",
            T::DTYPE,
            rayon::current_num_threads()
        )
    }
}
