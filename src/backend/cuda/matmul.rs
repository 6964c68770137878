//! Matmuls through cuBLASLt (see cublaslt.rs for the row-major to column-major swap).

use anyhow::{Result, ensure};

use super::cublaslt::{GemmKey, GemmPtrs, alignment};
use super::{Cuda, ensure_same_dtype, ptr};
use crate::backend::Matmul;
use crate::tensor::Tensor;

impl Cuda {
    pub(super) fn matmul_impl(
        &self,
        out: &Tensor<Cuda>,
        a: &Tensor<Cuda>,
        b: &Tensor<Cuda>,
        bias: Option<&Tensor<Cuda>>,
        spec: Matmul,
    ) -> Result<()> {
        ensure_same_dtype("matmul", &[out, a, b])?;
        if let Some(bias) = bias {
            ensure_same_dtype("matmul (bias)", &[out, bias])?;
        }
        let (m, k) = if spec.trans_a {
            (a.cols(), a.matrix_rows())
        } else {
            (a.matrix_rows(), a.cols())
        };
        let (kb, n) = if spec.trans_b {
            (b.cols(), b.matrix_rows())
        } else {
            (b.matrix_rows(), b.cols())
        };
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
            align: [alignment(ptrs.a), alignment(ptrs.b), alignment(ptrs.out)],
            fast_accum: false,
        };
        self.blas.gemm(key, &ptrs, spec.accumulate)
    }
}
