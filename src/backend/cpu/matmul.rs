//! Matrix products through a real GEMM, plus the bias gradient.

use anyhow::{Result, bail, ensure};

use super::int8::int8_matmul;
use super::{Cpu, Scalar, add_column_sums};
use crate::backend::{Matmul, MatmulOps, Operand, check_int8_product};
use crate::tensor::{DType, Tensor};

/// Row-major strides of `op(x)` for an `[rows, cols]` matrix: `(rows_of_op, cols_of_op, rs, cs)`.
fn op_view(rows: usize, cols: usize, transpose: bool) -> (usize, usize, isize, isize) {
    if transpose {
        (cols, rows, 1, cols as isize)
    } else {
        (rows, cols, cols as isize, 1)
    }
}

/// `out[M, N] (+)= op(a) · op(b) (+ bias)`, with `a` stored `[a_rows, a_cols]` and `b`
/// stored `[b_rows, b_cols]`.
#[allow(clippy::too_many_arguments)]
pub fn matmul<T: Scalar>(
    out: &mut [T], a: &[T], a_cols: usize, b: &[T], b_cols: usize, bias: Option<&[T]>, spec: Matmul,
) {
    let (m, k, rsa, csa) = op_view(a.len() / a_cols, a_cols, spec.trans_a);
    let (kb, n, rsb, csb) = op_view(b.len() / b_cols, b_cols, spec.trans_b);
    assert_eq!(k, kb, "matmul inner dimensions");
    assert_eq!(out.len(), m * n, "matmul output size");
    let beta = if spec.accumulate { T::one() } else { T::zero() };
    // SAFETY: the strides above address exactly `a`, `b` and `out`, whose lengths were
    // checked, and `out` is a distinct mutable borrow.
    unsafe {
        T::gemm(
            m,
            k,
            n,
            T::one(),
            a.as_ptr(),
            rsa,
            csa,
            b.as_ptr(),
            rsb,
            csb,
            beta,
            out.as_mut_ptr(),
            n as isize,
            1,
        );
    }
    if let Some(bias) = bias {
        for row in out.chunks_mut(n) {
            for (o, &b) in row.iter_mut().zip(bias) {
                *o += b;
            }
        }
    }
}

/// `dbias[N] (+)= Σ_m dout[m, N]`, each sum accumulated in f64.
pub fn bias_backward<T: Scalar>(dbias: &mut [T], dout: &[T], accumulate: bool) {
    if !accumulate {
        dbias.fill(T::zero());
    }
    add_column_sums(
        dbias,
        dout.chunks(dbias.len()).map(|row| row.iter().copied()),
    );
}

impl<T: Scalar> MatmulOps for Cpu<T> {
    fn matmul<'a>(
        &self, out: &Tensor<Self>, a: impl Into<Operand<'a, Self>>,
        b: impl Into<Operand<'a, Self>>, bias: Option<&Tensor<Self>>, spec: Matmul,
    ) -> Result<()>
    where
        Self: 'a,
    {
        let (a, b) = (a.into(), b.into());
        let bias = bias.map(|t| self.floats(t)).transpose()?;
        match (a.descale, b.descale) {
            (None, None) => {
                let (a, b) = (a.data, b.data);
                let (a_v, b_v) = (self.floats(a)?, self.floats(b)?);
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
                    matmul(o, &a_v, a.cols(), &b_v, b.cols(), bias.as_deref(), spec)
                })
            }
            (Some(da), Some(db)) if a.data.dtype == DType::I8 || b.data.dtype == DType::I8 => {
                check_int8_product(out, a, b, spec)?;
                let (qa, qb, k) = (a.data, b.data, a.data.cols());
                let f32s = |t: &Tensor<Self>| -> Result<Vec<f32>> {
                    Ok(self.floats(t)?.iter().map(|x| x.f64() as f32).collect())
                };
                let bias = bias.map(|b| b.iter().map(|x| x.f64() as f32).collect::<Vec<_>>());
                let old = spec.accumulate.then(|| f32s(out)).transpose()?;
                let values = int8_matmul(
                    &f32s(qa)?,
                    &f32s(da)?,
                    &f32s(qb)?,
                    &f32s(db)?,
                    k,
                    bias.as_deref(),
                    old.as_deref(),
                );
                self.update(out, |o| {
                    o.iter_mut()
                        .zip(&values)
                        .for_each(|(o, &v)| *o = T::of(v as f64))
                })
            }
            (Some(da), Some(db)) => {
                let (a, b) = (a.data, b.data);
                let k = a.cols();
                ensure!(
                    !spec.trans_a
                        && spec.trans_b
                        && b.cols() == k
                        && out.numel() == a.matrix_rows() * b.matrix_rows(),
                    "matmul of scaled operands: a {:?} · b {:?}ᵀ into {:?} ({spec:?}; FP8 \
                     operands take K contiguous in both)",
                    a.shape,
                    b.shape,
                    out.shape
                );
                let (da, db) = (self.scalar(da)?, self.scalar(db)?);
                let (a_v, b_v) = (self.floats(a)?, self.floats(b)?);
                self.update(out, |o| {
                    let (da, db) = (T::of(da as f64), T::of(db as f64));
                    // The real values of the operands formed first and multiplied in `T`.
                    let a: Vec<T> = a_v.iter().map(|&x| x * da).collect();
                    let b: Vec<T> = b_v.iter().map(|&x| x * db).collect();
                    matmul(o, &a, k, &b, k, bias.as_deref(), spec)
                })
            }
            _ => bail!("matmul: one operand scaled and the other not"),
        }
    }

    fn bias_backward(
        &self, dbias: &Tensor<Self>, dout: &Tensor<Self>, accumulate: bool,
    ) -> Result<()> {
        let dout = self.floats(dout)?;
        self.update(dbias, |d| bias_backward(d, &dout, accumulate))
    }
}
