//! Matmuls through cuBLASLt (see cublaslt.rs for the row-major to column-major swap), in the
//! model's dtype or FP8, but a forward product of one row (gemv.rs); and the bias gradient,
//! a column sum (rmsnorm.rs' colsum kernels).

use anyhow::{Result, bail, ensure};

use super::cublaslt::GemmPtrs;
use super::fp8::descale_ptr;
use super::matmul_algos::GemmKey;
use super::{Cuda, ensure_same_dtype, gemv, ptr, unsupported_dtype};
use crate::backend::op_times::matmul_name;
use crate::backend::{Fp8Sum, Matmul, MatmulOps, Operand, check_int8_product};
use crate::tensor::{DType, Tensor};

/// The `[rows, cols]` of `op(t)`: `t` read as a matrix, transposed when `trans`.
pub(super) fn op_dims(t: &Tensor<Cuda>, trans: bool) -> (usize, usize) {
    if trans {
        (t.cols(), t.matrix_rows())
    } else {
        (t.matrix_rows(), t.cols())
    }
}

impl MatmulOps for Cuda {
    fn matmul<'a>(
        &self, out: &Tensor<Cuda>, a: impl Into<Operand<'a, Cuda>>,
        b: impl Into<Operand<'a, Cuda>>, bias: Option<&Tensor<Cuda>>, spec: Matmul,
    ) -> Result<()>
    where
        Self: 'a,
    {
        let (a, b) = (a.into(), b.into());
        match (a.descale, b.descale) {
            (None, None) => {
                let k = op_dims(a.data, spec.trans_a).1;
                let _timing =
                    self.time_op_named(|| matmul_name(out.matrix_rows(), out.cols(), k))?;
                self.matmul_plain(out, a.data, b.data, bias, spec)
            }
            (Some(_), Some(_)) if a.data.dtype == DType::I8 || b.data.dtype == DType::I8 => {
                check_int8_product(out, a, b, spec)?;
                self.matmul_int8(out, a, b, bias, spec.accumulate)
            }
            (Some(_), Some(_)) => {
                ensure!(
                    !spec.trans_a && spec.trans_b,
                    "matmul: FP8 operands take K contiguous in both (Matmul::FORWARD's \
                     layouts), not {spec:?}"
                );
                let k = a.data.cols();
                let name = || format!("fp8 {}", matmul_name(out.matrix_rows(), out.cols(), k));
                let _timing = self.time_op_named(name)?;
                self.matmul_scaled(out, a, b, bias, spec.sum, spec.accumulate)
            }
            _ => bail!(
                "matmul: a {:?} {} and b {:?} {}: one operand is scaled and the other is not",
                a.data.shape,
                a.data.dtype,
                b.data.shape,
                b.data.dtype
            ),
        }
    }

    fn bias_backward(
        &self, dbias: &Tensor<Cuda>, dout: &Tensor<Cuda>, accumulate: bool,
    ) -> Result<()> {
        let _timing = self.time_op("bias_backward")?;
        self.column_sum(dbias, dout, accumulate)
    }
}

impl Cuda {
    /// A plain product through cuBLASLt, or a forward product of one row by `gemv`.
    fn matmul_plain(
        &self, out: &Tensor<Cuda>, a: &Tensor<Cuda>, b: &Tensor<Cuda>, bias: Option<&Tensor<Cuda>>,
        spec: Matmul,
    ) -> Result<()> {
        ensure_same_dtype("matmul", &[out, a, b])?;
        if let Some(bias) = bias {
            ensure_same_dtype("matmul (bias)", &[out, bias])?;
        }
        let (m, k) = op_dims(a, spec.trans_a);
        let (kb, n) = op_dims(b, spec.trans_b);
        ensure!(
            k == kb && out.numel() == m * n && bias.is_none_or(|t| t.numel() == n),
            "matmul: op(a) {m}x{k} · op(b) {kb}x{n} into {:?} (a {:?}, b {:?})",
            out.shape,
            a.shape,
            b.shape
        );
        if m == 0 || n == 0 {
            return Ok(());
        }
        if spec == Matmul::FORWARD && gemv::is_one_row(out, a) {
            return self.gemv(out, a, b, bias);
        }
        let ptrs = GemmPtrs {
            out: ptr(out),
            a: ptr(a),
            b: ptr(b),
            bias: bias.map(ptr),
            descales: None,
        };
        let key = GemmKey {
            m,
            n,
            k,
            trans_a: spec.trans_a,
            trans_b: spec.trans_b,
            dtypes: [out.dtype; 3],
            bias: bias.is_some(),
            align: ptrs.alignments(),
            fast_accum: false,
        };
        self.blas.gemm(key, &ptrs, spec.accumulate)
    }

    /// `out (+)= (a · a.descale) · (b · b.descale)ᵀ (+ bias)` through cuBLASLt.
    #[allow(clippy::too_many_arguments)]
    fn matmul_scaled(
        &self, out: &Tensor<Cuda>, a: Operand<'_, Cuda>, b: Operand<'_, Cuda>,
        bias: Option<&Tensor<Cuda>>, sum: Fp8Sum, accumulate: bool,
    ) -> Result<()> {
        let (major, minor) = self.compute_capability;
        ensure!(
            (major, minor) >= (8, 9),
            "FP8 matmuls need an Ada, Hopper or Blackwell GPU (compute capability 8.9 or newer), \
             and {} is {major}.{minor}: train with --matmul-dtype int8 (INT8 runs at twice bf16's \
             rate there) or bf16",
            self.name
        );
        let (m, n, k) = (a.data.matrix_rows(), b.data.matrix_rows(), a.data.cols());
        let shapes = || {
            format!(
                "a {:?} {} · b {:?} {}ᵀ into out {:?} {}{}",
                a.data.shape,
                a.data.dtype,
                b.data.shape,
                b.data.dtype,
                out.shape,
                out.dtype,
                bias.map_or(String::new(), |t| format!(
                    " + bias {:?} {}",
                    t.shape, t.dtype
                ))
            )
        };
        let both_e5m2 = a.data.dtype == DType::E5M2 && b.data.dtype == DType::E5M2;
        if !a.data.dtype.is_fp8()
            || !b.data.dtype.is_fp8()
            || both_e5m2
            || out.dtype != DType::BF16
            || bias.is_some_and(|t| t.dtype != DType::BF16)
        {
            let mut dtypes = vec![a.data.dtype, b.data.dtype, out.dtype];
            dtypes.extend(bias.map(|t| t.dtype));
            return Err(unsupported_dtype(
                "matmul_scaled (e4m3/e5m2 operands, not both e5m2, into bf16)",
                dtypes,
            ));
        }
        let (da, db) = (
            descale_ptr("matmul_scaled", &a)?,
            descale_ptr("matmul_scaled", &b)?,
        );
        ensure!(
            b.data.cols() == k && out.numel() == m * n && bias.is_none_or(|t| t.numel() == n),
            "matmul_scaled: mismatched shapes: {}",
            shapes()
        );
        ensure!(
            m.is_multiple_of(16) && n.is_multiple_of(16) && k.is_multiple_of(16),
            "matmul_scaled: cuBLASLt's FP8 matmuls need M, N and K to be multiples of 16, got \
             M={m}, N={n}, K={k}: {}",
            shapes()
        );
        // cuBLASLt refuses (NOT_SUPPORTED) an FP8 matmul whose descale is only 4-byte aligned,
        // as an element of a larger f32 tensor can be; require the 16 bytes that a tensor of
        // its own always has.
        for (name, descale) in [("a", da), ("b", db)] {
            ensure!(
                descale.is_multiple_of(16),
                "matmul_scaled: {name}'s descale must be 16-byte aligned (its own allocation, \
                 not a row of a larger tensor): {}",
                shapes()
            );
        }
        if m == 0 || n == 0 {
            return Ok(());
        }
        let ptrs = GemmPtrs {
            out: ptr(out),
            a: ptr(a.data),
            b: ptr(b.data),
            bias: bias.map(ptr),
            descales: Some((da, db)),
        };
        // out = a · bᵀ is the one FP8 form: trans_b only (cublaslt.rs makes it cuBLAS's TN).
        let key = GemmKey {
            m,
            n,
            k,
            trans_a: false,
            trans_b: true,
            dtypes: [a.data.dtype, b.data.dtype, out.dtype],
            bias: bias.is_some(),
            align: ptrs.alignments(),
            fast_accum: sum == Fp8Sum::Fast,
        };
        self.blas
            .gemm(key, &ptrs, accumulate)
            .map_err(|e| e.context(format!("matmul_scaled: {}", shapes())))
    }
}
