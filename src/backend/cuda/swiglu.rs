//! SwiGLU forward and backward over `[N, 2F]` gate/up rows.

use anyhow::{Result, ensure};

use super::fp8::amax_ptr;
use super::kernels::{Arg, Kernel};
use super::{BLOCK, Cuda, blocks, ensure_same_dtype, float, ptr, vec16, width};
use crate::tensor::Tensor;

impl Cuda {
    pub(super) fn swiglu_forward_impl(
        &self,
        out: &Tensor<Cuda>,
        gate_up: &Tensor<Cuda>,
        amax: Option<&Tensor<Cuda>>,
    ) -> Result<()> {
        let amax = amax_ptr("swiglu_forward", amax)?;
        ensure_same_dtype("swiglu_forward", &[out, gate_up])?;
        let f = out.cols();
        let rows = out.numel() / f;
        ensure!(
            gate_up.numel() == 2 * rows * f,
            "swiglu_forward: gate_up {:?}",
            gate_up.shape
        );
        let vec = vec16(&[out, gate_up], f);
        // SAFETY: one thread per `width` elements of out [rows, f] (16-byte aligned runs with
        // `vec`); gate_up is [rows, 2f]; amax is one f32 or null.
        unsafe {
            self.launch(
                Kernel::SwigluForward,
                &[float(out), Arg::Flag(vec)],
                (blocks(rows * f / width(out, vec), BLOCK as usize), 1, 1),
                BLOCK,
                &[
                    ptr(out).into(),
                    ptr(gate_up).into(),
                    (rows as i64).into(),
                    (f as i32).into(),
                    amax.into(),
                ],
            )
        }
    }

    pub(super) fn swiglu_backward_impl(
        &self,
        dgate_up: &Tensor<Cuda>,
        dout: &Tensor<Cuda>,
        gate_up: &Tensor<Cuda>,
        amax: Option<&Tensor<Cuda>>,
    ) -> Result<()> {
        let amax = amax_ptr("swiglu_backward", amax)?;
        ensure_same_dtype("swiglu_backward", &[dgate_up, dout, gate_up])?;
        let f = dout.cols();
        let rows = dout.numel() / f;
        ensure!(
            gate_up.numel() == 2 * rows * f && dgate_up.numel() == 2 * rows * f,
            "swiglu_backward: dout {:?} needs gate_up and dgate_up of {rows}×{} elements, got \
             {:?} and {:?}",
            dout.shape,
            2 * f,
            gate_up.shape,
            dgate_up.shape
        );
        let vec = vec16(&[dgate_up, dout, gate_up], f);
        // SAFETY: one thread per `width` elements of dout [rows, f] (16-byte aligned runs with
        // `vec`); gate_up and dgate_up are [rows, 2f], and may be one tensor, since each
        // thread reads its gate and up elements before it writes their gradients over them;
        // amax is one f32 or null.
        unsafe {
            self.launch(
                Kernel::SwigluBackward,
                &[float(dout), Arg::Flag(vec)],
                (blocks(rows * f / width(dout, vec), BLOCK as usize), 1, 1),
                BLOCK,
                &[
                    ptr(dgate_up).into(),
                    ptr(dout).into(),
                    ptr(gate_up).into(),
                    (rows as i64).into(),
                    (f as i32).into(),
                    amax.into(),
                ],
            )
        }
    }
}
