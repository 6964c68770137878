//! RoPE in place on the fused qkv rows (the gradient is the inverse rotation).

use anyhow::{Result, ensure};

use super::kernels::Kernel;
use super::{BLOCK, Cuda, blocks, ensure_dtype, float, ptr};
use crate::backend::AttnShape;
use crate::tensor::{DType, Tensor};

impl Cuda {
    pub(super) fn rope_impl(
        &self,
        qkv: &Tensor<Cuda>,
        freqs: &Tensor<Cuda>,
        shape: AttnShape,
        inverse: bool,
    ) -> Result<()> {
        ensure_dtype(freqs, DType::F32, "rope (freqs)")?;
        let (w, d) = (shape.qkv_width(), shape.head_dim);
        let rows = qkv.numel() / w;
        ensure!(
            qkv.cols() == w && rows.is_multiple_of(shape.seq) && freqs.numel() >= shape.seq * d,
            "rope: qkv {:?}, freqs {:?} for {shape:?}",
            qkv.shape,
            freqs.shape
        );
        let heads = shape.q_heads + shape.kv_heads;
        let threads = rows * heads * (d / 2);
        // SAFETY: one thread per (row, rotated head, pair) of qkv [rows, w]; freqs holds
        // [seq, d/2, 2] f32.
        unsafe {
            self.launch(
                Kernel::Rope,
                &[float(qkv)],
                (blocks(threads, BLOCK as usize), 1, 1),
                BLOCK,
                &[
                    ptr(qkv).into(),
                    ptr(freqs).into(),
                    (rows as i64).into(),
                    (shape.seq as i32).into(),
                    (heads as i32).into(),
                    (d as i32).into(),
                    (w as i32).into(),
                    (inverse as i32).into(),
                ],
            )
        }
    }
}
