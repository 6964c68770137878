//! RMSNorm forward (plain or fused with the residual add) and backward; the weight gradient
//! and the bias gradient share the deterministic column sum.

use anyhow::{Result, ensure};

use super::fp8::amax_ptr;
use super::kernels::{Arg, Kernel};
use super::{BLOCK, Cuda, blocks, ensure_dtype, ensure_same_dtype, float, ptr};
use crate::tensor::{DType, Tensor};

/// Rows per block of the column-sum partials: enough blocks to fill the GPU at training
/// sizes, few enough partials to add up quickly.
const COLSUM_ROWS: usize = 256;

impl Cuda {
    /// `residual_out = residual + branch` first when both are given.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rmsnorm_forward_impl(
        &self,
        out: &Tensor<Cuda>,
        rstd: &Tensor<Cuda>,
        residual_out: Option<&Tensor<Cuda>>,
        inp: &Tensor<Cuda>,
        branch: Option<&Tensor<Cuda>>,
        weight: &Tensor<Cuda>,
        eps: f32,
        amax: Option<&Tensor<Cuda>>,
    ) -> Result<()> {
        let amax = amax_ptr("rmsnorm_forward", amax)?;
        ensure_dtype(rstd, DType::F32, "rmsnorm_forward (rstd)")?;
        ensure_same_dtype("rmsnorm_forward", &[out, inp, weight])?;
        let (n, c) = (inp.matrix_rows(), weight.numel());
        ensure!(
            inp.cols() == c && out.numel() == n * c && rstd.numel() == n,
            "rmsnorm_forward: inp {:?}, out {:?}, rstd {:?}, weight {:?}",
            inp.shape,
            out.shape,
            rstd.shape,
            weight.shape
        );
        let fused = residual_out.zip(branch);
        if let Some((r, b)) = fused {
            ensure_same_dtype("residual_rmsnorm_forward", &[out, r, b])?;
            ensure!(r.numel() == n * c && b.numel() == n * c, "residual shapes");
        }
        let (res_ptr, branch_ptr) = fused.map_or((0, 0), |(r, b)| (ptr(r), ptr(b)));
        // SAFETY: block i reads row i of inp (and branch), writes row i of out (and
        // residual_out) and rstd[i]; all are [n, c] (rstd [n]); amax is one f32 or null.
        unsafe {
            self.launch(
                Kernel::RmsnormForward,
                &[float(out), Arg::Flag(fused.is_some())],
                (n as u32, 1, 1),
                BLOCK,
                &[
                    ptr(out).into(),
                    ptr(rstd).into(),
                    res_ptr.into(),
                    ptr(inp).into(),
                    branch_ptr.into(),
                    ptr(weight).into(),
                    (c as i32).into(),
                    eps.into(),
                    amax.into(),
                ],
            )
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn rmsnorm_backward_impl(
        &self,
        dinp: &Tensor<Cuda>,
        dweight: &Tensor<Cuda>,
        dout: &Tensor<Cuda>,
        inp: &Tensor<Cuda>,
        weight: &Tensor<Cuda>,
        rstd: &Tensor<Cuda>,
        accumulate: bool,
    ) -> Result<()> {
        ensure_dtype(rstd, DType::F32, "rmsnorm_backward (rstd)")?;
        ensure_same_dtype("rmsnorm_backward", &[dinp, dweight, dout, inp, weight])?;
        let (n, c) = (inp.matrix_rows(), weight.numel());
        ensure!(
            inp.cols() == c && dinp.numel() == n * c && dout.numel() == n * c && rstd.numel() == n,
            "rmsnorm_backward shapes"
        );
        // SAFETY: block i reads row i of dout, inp and rstd[i], and updates row i of dinp.
        unsafe {
            self.launch(
                Kernel::RmsnormBackward,
                &[float(dinp)],
                (n as u32, 1, 1),
                BLOCK,
                &[
                    ptr(dinp).into(),
                    ptr(dout).into(),
                    ptr(inp).into(),
                    ptr(weight).into(),
                    ptr(rstd).into(),
                    (c as i32).into(),
                ],
            )?;
        }
        self.column_sum(dweight, dout, Some((inp, rstd)), accumulate)
    }

    /// `out[c] (+)= Σ_n term(n, c)`: `dy[n, c]`, or with `norm = (x, rstd)`,
    /// `dy[n, c] · x[n, c] · rstd[n]`. Partials per chunk of rows, then a fixed-order sum.
    pub(super) fn column_sum(
        &self,
        out: &Tensor<Cuda>,
        dy: &Tensor<Cuda>,
        norm: Option<(&Tensor<Cuda>, &Tensor<Cuda>)>,
        accumulate: bool,
    ) -> Result<()> {
        ensure_same_dtype("column sum", &[out, dy])?;
        let c = out.numel();
        ensure!(
            dy.cols() == c,
            "column sum of {:?} into {:?}",
            dy.shape,
            out.shape
        );
        let n = dy.matrix_rows();
        let chunks = n.div_ceil(COLSUM_ROWS).max(1);
        let partials = self.scratch_f32(chunks * c)?;
        let (x_ptr, rstd_ptr) = norm.map_or((0, 0), |(x, r)| (ptr(x), ptr(r)));
        // SAFETY: partials are [chunks, c] f32 of scratch; the partial pass reads rows of dy
        // (and x, rstd) [n, c]; the finish pass reads the partials and updates out [c].
        unsafe {
            self.launch(
                Kernel::ColsumPartial,
                &[float(dy), Arg::Flag(norm.is_some())],
                (blocks(c, BLOCK as usize), chunks as u32, 1),
                BLOCK,
                &[
                    partials.into(),
                    ptr(dy).into(),
                    x_ptr.into(),
                    rstd_ptr.into(),
                    (n as i32).into(),
                    (c as i32).into(),
                    (COLSUM_ROWS as i32).into(),
                ],
            )?;
            self.launch(
                Kernel::ColsumFinish,
                &[float(out)],
                (blocks(c, BLOCK as usize), 1, 1),
                BLOCK,
                &[
                    ptr(out).into(),
                    partials.into(),
                    (chunks as i32).into(),
                    (c as i32).into(),
                    (accumulate as i32).into(),
                ],
            )
        }
    }
}
