//! Matmuls of one row (a generated token's): `kernels/gemv.cu`, one warp per output column,
//! in place of cuBLASLt, whose call costs the host about twice a kernel launch, and of smelt's
//! own matmul, whose 128-row tiles would be all but empty.

use anyhow::{Result, ensure};

use super::kernels::{Arg, Kernel};
use super::{BLOCK, Cuda, blocks, ensure_same_dtype, float, ptr, vec16};
use crate::tensor::{DType, Tensor};

/// Whether `out = x · wᵀ` is one row's product of storage types the kernels take.
pub(super) fn is_one_row(out: &Tensor<Cuda>, x: &Tensor<Cuda>) -> bool {
    x.matrix_rows() == 1 && out.matrix_rows() == 1 && matches!(x.dtype, DType::F32 | DType::BF16)
}

impl Cuda {
    /// `out [1, N] = x [1, K] · wᵀ (+ bias)`, w `[N, K]`, of one dtype: `matmul_impl`, the one
    /// caller, has checked the shapes and dtypes.
    pub(super) fn gemv(
        &self, out: &Tensor<Cuda>, x: &Tensor<Cuda>, w: &Tensor<Cuda>, bias: Option<&Tensor<Cuda>>,
    ) -> Result<()> {
        let (n, k) = (out.numel(), x.numel());
        let vec = vec16(&[x, w], k);
        // SAFETY: warp c reads x [k] and row c of w [n, k] (16-byte aligned runs with `vec`),
        // bias[c] unless null, and writes out[c], for c < n.
        unsafe {
            self.launch(
                Kernel::Gemv,
                &[float(out), Arg::Flag(vec)],
                (blocks(n, WARPS), 1, 1),
                BLOCK,
                &[
                    ptr(out).into(),
                    ptr(x).into(),
                    ptr(w).into(),
                    bias.map_or(0, ptr).into(),
                    (n as i32).into(),
                    (k as i32).into(),
                ],
            )
        }
    }

    /// `gate_up [1, 2F] = x [1, K] · wᵀ`, w `[2F, K]`, and `out [1, F]` its SwiGLU.
    pub(super) fn gemv_swiglu(
        &self, gate_up: &Tensor<Cuda>, out: &Tensor<Cuda>, x: &Tensor<Cuda>, w: &Tensor<Cuda>,
    ) -> Result<()> {
        ensure_same_dtype("gemv_swiglu", &[gate_up, out, x, w])?;
        let (f, k) = (out.numel(), x.numel());
        ensure!(
            gate_up.numel() == 2 * f && w.numel() == 2 * f * k,
            "gemv_swiglu: x {:?} · w {:?} into gate/up {:?} and out {:?}",
            x.shape,
            w.shape,
            gate_up.shape,
            out.shape
        );
        let vec = vec16(&[x, w], k);
        // SAFETY: warp j reads x [k] and rows j and f + j of w [2f, k] (16-byte aligned runs
        // with `vec`), and writes gate_up[j], gate_up[f + j] and out[j], for j < f.
        unsafe {
            self.launch(
                Kernel::GemvSwiglu,
                &[float(out), Arg::Flag(vec)],
                (blocks(f, WARPS), 1, 1),
                BLOCK,
                &[
                    ptr(gate_up).into(),
                    ptr(out).into(),
                    ptr(x).into(),
                    ptr(w).into(),
                    (f as i32).into(),
                    (k as i32).into(),
                ],
            )
        }
    }
}

/// Warps in a block of `BLOCK` threads: output columns per block.
const WARPS: usize = BLOCK as usize / 32;
