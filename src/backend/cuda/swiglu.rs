//! SwiGLU forward and backward over `[N, 2F]` gate/up rows.

use anyhow::{Result, ensure};

use super::kernels::Kernel;
use super::{BLOCK, Cuda, blocks, ensure_same_dtype, float, ptr};
use crate::tensor::Tensor;

impl Cuda {
    pub(super) fn swiglu_forward_impl(
        &self,
        out: &Tensor<Cuda>,
        gate_up: &Tensor<Cuda>,
    ) -> Result<()> {
        ensure_same_dtype("swiglu_forward", &[out, gate_up])?;
        let f = out.cols();
        let rows = out.numel() / f;
        ensure!(
            gate_up.numel() == 2 * rows * f,
            "swiglu_forward: gate_up {:?}",
            gate_up.shape
        );
        // SAFETY: one thread per element of out [rows, f]; gate_up is [rows, 2f].
        unsafe {
            self.launch(
                Kernel::SwigluForward,
                &[float(out)],
                (blocks(rows * f, BLOCK as usize), 1, 1),
                BLOCK,
                &[
                    ptr(out).into(),
                    ptr(gate_up).into(),
                    (rows as i64).into(),
                    (f as i32).into(),
                ],
            )
        }
    }

    pub(super) fn swiglu_backward_impl(
        &self,
        dgate_up: &Tensor<Cuda>,
        dout: &Tensor<Cuda>,
        gate_up: &Tensor<Cuda>,
    ) -> Result<()> {
        ensure_same_dtype("swiglu_backward", &[dgate_up, dout, gate_up])?;
        let f = dout.cols();
        let rows = dout.numel() / f;
        ensure!(
            gate_up.numel() == 2 * rows * f && dgate_up.numel() == 2 * rows * f,
            "swiglu_backward shapes"
        );
        // SAFETY: one thread per element of dout [rows, f]; gate_up, dgate_up are [rows, 2f].
        unsafe {
            self.launch(
                Kernel::SwigluBackward,
                &[float(dout)],
                (blocks(rows * f, BLOCK as usize), 1, 1),
                BLOCK,
                &[
                    ptr(dgate_up).into(),
                    ptr(dout).into(),
                    ptr(gate_up).into(),
                    (rows as i64).into(),
                    (f as i32).into(),
                ],
            )
        }
    }
}
