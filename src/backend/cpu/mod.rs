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
mod matmul;
mod rmsnorm;
mod rope;
pub mod rounding;
mod scalar;
mod swiglu;

use std::cell::{Ref, RefCell, RefMut};
use std::marker::PhantomData;
use std::rc::Rc;

use anyhow::{Result, anyhow, bail, ensure};

pub use classifier::IGNORE_INDEX;
pub use scalar::Scalar;

use super::{
    AdamW, AdamWTensor, AttnShape, Backend, Fp8Sum, Matmul, Normalized, Scaled, UnsupportedDtype,
};
use crate::tensor::{DType, Tensor, TensorSpec};

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
            Some(amax) => self.abs_max(amax, t),
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

    /// The norm's output `x` describes, rounded to x's dtype as `rmsnorm_forward` stores it.
    fn normalized(&self, x: Normalized<'_, Self>) -> Result<Vec<T>> {
        let (inp, rstd, weight) = (
            self.floats(x.x)?,
            self.floats(x.rstd)?,
            self.floats(x.weight)?,
        );
        ensure!(
            inp.len() == rstd.len() * weight.len(),
            "the norm of {:?} with rstd {:?} and weight {:?}",
            x.x.shape,
            x.rstd.shape,
            x.weight.shape
        );
        let mut y = vec![T::zero(); inp.len()];
        rmsnorm::normalize(&mut y, &inp, &rstd, &weight);
        rounding::round_slice(x.x.dtype, &mut y);
        Ok(y)
    }

    /// `quantize` of the values `xs` of an `[r, c]` tensor.
    fn quantize_values(
        &self,
        (rows, cols): (Option<&Tensor<Self>>, Option<&Tensor<Self>>),
        descale: &Tensor<Self>,
        xs: &[T],
        [r, c]: [usize; 2],
        amax: &Tensor<Self>,
    ) -> Result<()> {
        let outputs = [(rows, false, [r, c]), (cols, true, [c, r])];
        let outputs: Vec<_> = outputs
            .into_iter()
            .filter_map(|(t, transpose, shape)| t.map(|t| (t, transpose, shape)))
            .collect();
        let Some(&(first, _, _)) = outputs.first() else {
            bail!("quantize: neither layout of [{r}, {c}] asked for");
        };
        let scale = fp8::scale(first.dtype, self.scalar(amax)?);
        for (out, transpose, shape) in outputs {
            ensure!(
                out.numel() == xs.len()
                    && (out.shape.len() != 2 || out.shape == shape)
                    && out.dtype == first.dtype,
                "quantize: [{r}, {c}] into {:?} {} (transposed: {transpose})",
                out.shape,
                out.dtype
            );
            self.update(out, |o| {
                fp8::quantize(o, xs, c, out.dtype, scale, transpose)
            })?;
        }
        self.update(descale, |d| d[0] = T::of((1.0 / scale) as f64))
    }
}

impl<T: Scalar> Backend for Cpu<T> {
    type Storage = Rc<RefCell<Buffer<T>>>;

    fn describe(&self) -> String {
        format!(
            "cpu ({}, {} threads)",
            T::DTYPE,
            rayon::current_num_threads()
        )
    }

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

    fn embedding_forward(
        &self,
        out: &Tensor<Self>,
        tokens: &Tensor<Self>,
        wte: &Tensor<Self>,
    ) -> Result<()> {
        let (tokens, wte_v) = (self.ints(tokens)?, self.floats(wte)?);
        self.update(out, |o| {
            embedding::embedding_forward(o, &tokens, &wte_v, wte.cols())
        })
    }

    fn embedding_backward(
        &self,
        dwte: &Tensor<Self>,
        tokens: &Tensor<Self>,
        dout: &Tensor<Self>,
        accumulate: bool,
    ) -> Result<()> {
        let (tokens, dout) = (self.ints(tokens)?, self.floats(dout)?);
        self.update(dwte, |d| {
            embedding::embedding_backward(d, &tokens, &dout, dwte.cols(), accumulate)
        })
    }

    fn rmsnorm_forward(
        &self,
        out: Option<&Tensor<Self>>,
        rstd: &Tensor<Self>,
        inp: &Tensor<Self>,
        weight: &Tensor<Self>,
        eps: f32,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()> {
        ensure!(
            out.is_none_or(|o| o.dtype == inp.dtype),
            "rmsnorm_forward: out {:?} is not inp's {}",
            out.map(|o| o.dtype),
            inp.dtype
        );
        {
            let inp_v = self.floats(inp)?;
            let c = weight.numel();
            self.update(rstd, |r| rmsnorm::rstd(r, &inp_v, c, eps as f64))?;
        }
        // From rstd as stored, as `quantize_normalized` reads it.
        let y = self.normalized(Normalized {
            x: inp,
            rstd,
            weight,
        })?;
        if let Some(amax) = amax {
            self.raise_abs_max(amax, &y)?;
        }
        match out {
            Some(out) => self.update(out, |o| o.copy_from_slice(&y)),
            None => Ok(()),
        }
    }

    fn residual_rmsnorm_forward(
        &self,
        residual_out: &Tensor<Self>,
        out: Option<&Tensor<Self>>,
        rstd: &Tensor<Self>,
        residual: &Tensor<Self>,
        branch: &Tensor<Self>,
        weight: &Tensor<Self>,
        eps: f32,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()> {
        {
            let (residual, branch) = (self.floats(residual)?, self.floats(branch)?);
            self.update(residual_out, |r| {
                r.iter_mut()
                    .zip(residual.iter().zip(branch.iter()))
                    .for_each(|(r, (&a, &b))| *r = a + b)
            })?;
        }
        // The norm reads the rounded sum, as a kernel reading back its bf16 output would.
        self.rmsnorm_forward(out, rstd, residual_out, weight, eps, amax)
    }

    fn rmsnorm_backward(
        &self,
        dinp: &Tensor<Self>,
        dweight: &Tensor<Self>,
        dout: &Tensor<Self>,
        inp: &Tensor<Self>,
        weight: &Tensor<Self>,
        rstd: &Tensor<Self>,
        accumulate: bool,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()> {
        let (dout, inp, weight, rstd) = (
            self.floats(dout)?,
            self.floats(inp)?,
            self.floats(weight)?,
            self.floats(rstd)?,
        );
        let mut dweight_v = self.floats_mut(dweight)?;
        self.update(dinp, |dx| {
            rmsnorm::rmsnorm_backward(dx, &mut dweight_v, &dout, &inp, &weight, &rstd, accumulate)
        })?;
        rounding::round_slice(dweight.dtype, &mut dweight_v);
        self.report_abs_max(amax, dinp)
    }

    fn matmul(
        &self,
        out: &Tensor<Self>,
        a: &Tensor<Self>,
        b: &Tensor<Self>,
        bias: Option<&Tensor<Self>>,
        spec: Matmul,
    ) -> Result<()> {
        let (a_v, b_v) = (self.floats(a)?, self.floats(b)?);
        let bias = bias.map(|t| self.floats(t)).transpose()?;
        let m = if spec.trans_a {
            a.cols()
        } else {
            a.matrix_rows()
        };
        let n = if spec.trans_b {
            b.matrix_rows()
        } else {
            b.cols()
        };
        ensure!(
            out.numel() == m * n,
            "matmul: output {:?} is not {m}x{n}",
            out.shape
        );
        self.update(out, |o| {
            matmul::matmul(o, &a_v, a.cols(), &b_v, b.cols(), bias.as_deref(), spec)
        })
    }

    fn bias_backward(
        &self,
        dbias: &Tensor<Self>,
        dout: &Tensor<Self>,
        accumulate: bool,
    ) -> Result<()> {
        let dout = self.floats(dout)?;
        self.update(dbias, |d| matmul::bias_backward(d, &dout, accumulate))
    }

    fn rope_forward(
        &self,
        qkv: &Tensor<Self>,
        freqs: &Tensor<Self>,
        shape: AttnShape,
    ) -> Result<()> {
        let freqs = self.floats(freqs)?;
        self.update(qkv, |x| rope::rope_rotate(x, &freqs, shape, false))
    }

    fn rope_backward(
        &self,
        dqkv: &Tensor<Self>,
        freqs: &Tensor<Self>,
        shape: AttnShape,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()> {
        let freqs = self.floats(freqs)?;
        self.update(dqkv, |x| rope::rope_rotate(x, &freqs, shape, true))?;
        self.report_abs_max(amax, dqkv)
    }

    fn attention_forward(
        &self,
        out: &Tensor<Self>,
        lse: &Tensor<Self>,
        qkv: &Tensor<Self>,
        shape: AttnShape,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()> {
        {
            let qkv = self.floats(qkv)?;
            let mut lse_v = self.floats_mut(lse)?;
            self.update(out, |o| {
                attention::attention_forward(o, &mut lse_v, &qkv, shape)
            })?;
            rounding::round_slice(lse.dtype, &mut lse_v);
        }
        self.report_abs_max(amax, out)
    }

    fn attention_decode(
        &self,
        out: &Tensor<Self>,
        qkv: &Tensor<Self>,
        shape: AttnShape,
    ) -> Result<()> {
        let qkv = self.floats(qkv)?;
        self.update(out, |o| attention::attention_decode(o, &qkv, shape))
    }

    fn attention_backward(
        &self,
        dqkv: &Tensor<Self>,
        dout: &Tensor<Self>,
        qkv: &Tensor<Self>,
        out: &Tensor<Self>,
        lse: &Tensor<Self>,
        shape: AttnShape,
    ) -> Result<()> {
        let (dout, qkv, out, lse) = (
            self.floats(dout)?,
            self.floats(qkv)?,
            self.floats(out)?,
            self.floats(lse)?,
        );
        self.update(dqkv, |d| {
            attention::attention_backward(d, &dout, &qkv, &out, &lse, shape)
        })
    }

    fn swiglu_forward(
        &self,
        out: &Tensor<Self>,
        gate_up: &Tensor<Self>,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()> {
        {
            let gu = self.floats(gate_up)?;
            self.update(out, |o| swiglu::swiglu_forward(o, &gu, out.cols()))?;
        }
        self.report_abs_max(amax, out)
    }

    fn swiglu_backward(
        &self,
        dgate_up: &Tensor<Self>,
        dout: &Tensor<Self>,
        gate_up: &Tensor<Self>,
        amax: Option<&Tensor<Self>>,
    ) -> Result<()> {
        {
            // gate_up copied, as the contract lets `dgate_up` be `gate_up` itself.
            let (dy, gu) = (self.floats(dout)?, self.values(gate_up)?);
            self.update(dgate_up, |d| {
                swiglu::swiglu_backward(d, &dy, &gu, dout.cols())
            })?;
        }
        self.report_abs_max(amax, dgate_up)
    }

    fn cross_entropy(
        &self,
        logits: &Tensor<Self>,
        losses: &Tensor<Self>,
        targets: &Tensor<Self>,
        z_loss: f32,
        grad_scale: Option<f32>,
    ) -> Result<()> {
        let targets = self.ints(targets)?;
        let mut losses_v = self.floats_mut(losses)?;
        self.update(logits, |l| {
            classifier::cross_entropy(
                l,
                &mut losses_v,
                &targets,
                z_loss as f64,
                grad_scale.map(f64::from),
            )
        })?;
        rounding::round_slice(losses.dtype, &mut losses_v);
        Ok(())
    }

    fn sum_squares(&self, sums: &Tensor<Self>, xs: &[Option<&Tensor<Self>>]) -> Result<()> {
        ensure!(
            sums.numel() == xs.len(),
            "sum_squares: {} sums for {} tensors",
            sums.numel(),
            xs.len()
        );
        let mut each = Vec::with_capacity(xs.len());
        for x in xs {
            each.push(match x {
                Some(x) => self.floats(x)?.iter().map(|&v| v * v).sum::<T>(),
                None => T::zero(),
            });
        }
        self.update(sums, |o| o.copy_from_slice(&each))
    }

    fn sum(&self, out: &Tensor<Self>, x: &Tensor<Self>) -> Result<()> {
        let total = self.floats(x)?.iter().copied().sum::<T>();
        self.update(out, |o| o[0] = total)
    }

    fn adamw(
        &self,
        tensors: &[AdamWTensor<'_, Self>],
        norm_sq: &Tensor<Self>,
        hp: &AdamW,
    ) -> Result<()> {
        let norm_sq = self.floats(norm_sq)?[0].f64();
        for t in tensors {
            {
                let grad_v = self.floats(t.grad)?;
                let (mut m_v, mut v_v, mut p_v) = (
                    self.floats_mut(t.m)?,
                    self.floats_mut(t.v)?,
                    self.floats_mut(t.param)?,
                );
                let mut master_v = t.master.map(|m| self.floats_mut(m)).transpose()?;
                let dtypes = adamw::StateDtypes {
                    param: t.param.dtype,
                    m: t.m.dtype,
                    v: t.v.dtype,
                    master: t.master.map_or(t.param.dtype, |m| m.dtype),
                };
                let tensor_hp = adamw::TensorHyper {
                    weight_decay: hp.weight_decay_for(t.decays),
                    seed: t.seed,
                };
                adamw::adamw(
                    &mut p_v,
                    master_v.as_deref_mut(),
                    &grad_v,
                    &mut m_v,
                    &mut v_v,
                    norm_sq,
                    hp,
                    &tensor_hp,
                    &dtypes,
                );
            }
            self.report_abs_max(t.amax, t.param)?;
        }
        Ok(())
    }

    fn abs_max(&self, amax: &Tensor<Self>, x: &Tensor<Self>) -> Result<()> {
        self.raise_abs_max(amax, &self.floats(x)?)
    }

    fn quantize_normalized(
        &self,
        rows: &Tensor<Self>,
        cols: &Tensor<Self>,
        descale: &Tensor<Self>,
        x: Normalized<'_, Self>,
        amax: &Tensor<Self>,
    ) -> Result<()> {
        let y = self.normalized(x)?;
        let shape = [x.x.matrix_rows(), x.x.cols()];
        self.quantize_values((Some(rows), Some(cols)), descale, &y, shape, amax)
    }

    fn quantize(
        &self,
        rows: Option<&Tensor<Self>>,
        cols: Option<&Tensor<Self>>,
        descale: &Tensor<Self>,
        x: &Tensor<Self>,
        amax: &Tensor<Self>,
    ) -> Result<()> {
        let xs = self.floats(x)?;
        self.quantize_values(
            (rows, cols),
            descale,
            &xs,
            [x.matrix_rows(), x.cols()],
            amax,
        )
    }

    fn matmul_scaled(
        &self,
        out: &Tensor<Self>,
        a: Scaled<'_, Self>,
        b: Scaled<'_, Self>,
        bias: Option<&Tensor<Self>>,
        _sum: Fp8Sum,
        accumulate: bool,
    ) -> Result<()> {
        let k = a.data.cols();
        ensure!(
            b.data.cols() == k && out.numel() == a.data.matrix_rows() * b.data.matrix_rows(),
            "matmul_scaled: a {:?} · b {:?}ᵀ into {:?}",
            a.data.shape,
            b.data.shape,
            out.shape
        );
        let (da, db) = (self.scalar(a.descale)?, self.scalar(b.descale)?);
        let (a_v, b_v) = (self.floats(a.data)?, self.floats(b.data)?);
        let bias = bias.map(|t| self.floats(t)).transpose()?;
        self.update(out, |o| {
            let (da, db) = (T::of(da as f64), T::of(db as f64));
            fp8::matmul_scaled(o, &a_v, da, &b_v, db, k, bias.as_deref(), accumulate)
        })
    }
}
