//! Matmuls through cuBLASLt (see cublaslt.rs for the row-major to column-major swap), but a
//! forward product of one row (gemv.rs).

use anyhow::{Result, ensure};

use super::cublaslt::{GemmKey, GemmPtrs};
use super::{Cuda, ensure_same_dtype, gemv, ptr};
use crate::backend::Matmul;
use crate::tensor::Tensor;

/// The `[rows, cols]` of `op(t)`: `t` read as a matrix, transposed when `trans`.
pub(super) fn op_dims(t: &Tensor<Cuda>, trans: bool) -> (usize, usize) {
    if trans {
        (t.cols(), t.matrix_rows())
    } else {
        (t.matrix_rows(), t.cols())
    }
}

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
}
