//! RoPE in place on the fused qkv rows (the gradient is the inverse rotation).

use anyhow::{Result, ensure};

use super::fp8::amax_ptr;
use super::kernels::{Arg, Kernel};
use super::{BLOCK, Cuda, ensure_dtype, float, ptr, vec16, width};
use crate::backend::AttnShape;
use crate::tensor::{DType, Tensor};

/// At most this many blocks when reporting an abs-max.
const REPORTING_BLOCKS: usize = 1024;

impl Cuda {
    pub(super) fn rope_impl(
        &self,
        qkv: &Tensor<Cuda>,
        freqs: &Tensor<Cuda>,
        shape: AttnShape,
        inverse: bool,
        amax: Option<&Tensor<Cuda>>,
    ) -> Result<()> {
        let amax = amax_ptr("rope", amax)?;
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
        // 16-byte accesses need every head half to start on a 16-byte boundary too.
        let half_bytes = d / 2 * qkv.dtype.size_bytes();
        let vec =
            vec16(&[qkv], w) && half_bytes.is_multiple_of(16) && ptr(freqs).is_multiple_of(16);
        // One thread per `width` pairs; short rows share a block. With an abs-max to report,
        // more threads read the value heads `width` at a time.
        let rotated = heads * d / 2 / width(qkv, vec);
        let values = if amax != 0 {
            (w - heads * d) / width(qkv, vec)
        } else {
            0
        };
        let units = rotated + values;
        let mut rows_per_block = (BLOCK as usize / units).max(1);
        if amax != 0 {
            // Fewer, longer blocks: each ends in a block-wide reduction and an atomic.
            rows_per_block = rows_per_block.max(rows.div_ceil(REPORTING_BLOCKS));
        }
        let block = (rows_per_block * units)
            .next_multiple_of(32)
            .min(BLOCK as usize);
        // SAFETY: block i rotates rows [i·R, (i+1)·R) of qkv [rows, w] in place (16-byte
        // aligned runs with `vec`), and reads the rest of each row when `values` > 0; freqs
        // holds [seq, d/2, 2] f32; amax is null or one f32.
        unsafe {
            self.launch(
                Kernel::Rope,
                &[float(qkv), Arg::Flag(vec)],
                (rows.div_ceil(rows_per_block).max(1) as u32, 1, 1),
                block as u32,
                &[
                    ptr(qkv).into(),
                    ptr(freqs).into(),
                    (rows as i64).into(),
                    (shape.seq as i32).into(),
                    (d as i32).into(),
                    (w as i32).into(),
                    (rotated as i32).into(),
                    (units as i32).into(),
                    (rows_per_block as i32).into(),
                    (inverse as i32).into(),
                    amax.into(),
                ],
            )
        }
    }
}
