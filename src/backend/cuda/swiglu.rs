//! SwiGLU forward and backward over `[N, 2F]` gate/up rows, and the MLP ops that fuse it
//! with the matmul beside it where one kernel of ours does both (gemm.rs, gemv.rs).

use anyhow::{Result, ensure};

use super::kernels::{Arg, Kernel};
use super::{BLOCK, Cuda, amax_ptr, blocks, ensure_same_dtype, float, gemv, ptr, vec16, width};
use crate::backend::ops::swiglu::{unfused_gate_up_swiglu, unfused_swiglu_backward_through_down};
use crate::backend::{Operand, SwigluOps};
use crate::tensor::{DType, Tensor};

impl SwigluOps for Cuda {
    fn swiglu_forward(
        &self, out: &Tensor<Cuda>, gate_up: &Tensor<Cuda>, amax: Option<&Tensor<Cuda>>,
    ) -> Result<()> {
        let _timing = self.time_op("swiglu_forward")?;
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

    fn swiglu_backward(
        &self, dgate_up: &Tensor<Cuda>, dout: &Tensor<Cuda>, gate_up: &Tensor<Cuda>,
        amax: Option<&Tensor<Cuda>>,
    ) -> Result<()> {
        let _timing = self.time_op("swiglu_backward")?;
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

    /// One kernel where one of ours runs on the operands: a plain kernel for one row
    /// (generation's token pass), our matmul with SwiGLU in its epilogue (Hopper); else
    /// cuBLASLt and `swiglu_forward`.
    fn gate_up_swiglu<'a>(
        &self, gate_up: &Tensor<Cuda>, out: &Tensor<Cuda>, x: impl Into<Operand<'a, Cuda>>,
        w: impl Into<Operand<'a, Cuda>>, amax: Option<&Tensor<Cuda>>,
    ) -> Result<()>
    where
        Self: 'a,
    {
        let (x, w) = (x.into(), w.into());
        let plain = x.descale.is_none() && w.descale.is_none() && amax.is_none();
        if plain && gemv::is_one_row(gate_up, x.data) {
            let _timing = self.time_op("gate_up_swiglu")?;
            return self.gemv_swiglu(gate_up, out, x.data, w.data);
        }
        if plain && self.fuses(&[gate_up, out, x.data, w.data]) {
            let _timing = self.time_op("gate_up_swiglu")?;
            return self.gemm(gate_up, Some(out), x.data, w.data);
        }
        let scaled = x.descale.is_some() && w.descale.is_some();
        if scaled && self.fuses_fp8(&[gate_up, out], (x.data, DType::E4M3), w.data) {
            let _timing = self.time_op("gate_up_swiglu")?;
            return self.gemm_scaled(gate_up, Some(out), x, w, amax);
        }
        unfused_gate_up_swiglu(self, gate_up, out, x, w, amax)
    }

    /// One kernel of ours (Hopper) where it runs on the operands, which never stores `dh`;
    /// else cuBLASLt and `swiglu_backward`.
    fn swiglu_backward_through_down<'a>(
        &self, gate_up: &Tensor<Cuda>, dh: &Tensor<Cuda>, dy: impl Into<Operand<'a, Cuda>>,
        w: impl Into<Operand<'a, Cuda>>, amax: Option<&Tensor<Cuda>>,
    ) -> Result<()>
    where
        Self: 'a,
    {
        let (dy, w) = (dy.into(), w.into());
        let plain = dy.descale.is_none() && w.descale.is_none() && amax.is_none();
        if plain && self.fuses(&[gate_up, dy.data, w.data]) {
            let _timing = self.time_op("swiglu_backward_through_down")?;
            return self.fused_swiglu_backward(gate_up, dy.data, w.data);
        }
        let scaled = dy.descale.is_some() && w.descale.is_some();
        if scaled && self.fuses_fp8(&[gate_up], (dy.data, dy.data.dtype), w.data) {
            let _timing = self.time_op("swiglu_backward_through_down")?;
            return self.fused_swiglu_backward_scaled(gate_up, dy, w, amax);
        }
        unfused_swiglu_backward_through_down(self, gate_up, dh, dy, w, amax)
    }
}
