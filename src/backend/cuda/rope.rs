//! RoPE in place on the fused qkv rows (the gradient is the inverse rotation).

use anyhow::{Result, ensure};

use super::attention::documents_ptr;
use super::kernels::{Arg, Kernel};
use super::{BLOCK, Cuda, amax_ptr, ensure_dtype, float, ptr, vec16, width};
use crate::backend::{AttnShape, RopeOps};
use crate::tensor::{DType, Tensor};

/// At most this many blocks when reporting an abs-max.
const REPORTING_BLOCKS: usize = 1024;

impl RopeOps for Cuda {
    fn rope_forward(
        &self, qkv: &Tensor<Cuda>, freqs: &Tensor<Cuda>, shape: AttnShape,
        docs: Option<&Tensor<Cuda>>,
    ) -> Result<()> {
        let _timing = self.time_op("rope_forward")?;
        self.rope(qkv, freqs, shape, docs, false, None)
    }

    /// With a bias, in one pass where the heads fit `colsum_partial`'s strips (which report no
    /// abs-max, and take each position's angles for every sequence at once, so not with
    /// documents), else the two passes.
    fn rope_backward(
        &self, dqkv: &Tensor<Cuda>, freqs: &Tensor<Cuda>, shape: AttnShape,
        docs: Option<&Tensor<Cuda>>, amax: Option<&Tensor<Cuda>>,
        bias: Option<(&Tensor<Cuda>, bool)>,
    ) -> Result<()> {
        let Some((dbias, accumulate)) = bias else {
            let _timing = self.time_op("rope_backward")?;
            return self.rope(dqkv, freqs, shape, docs, true, amax);
        };
        let _timing = self.time_op("rope_backward_and_bias")?;
        let fused = amax.is_none() && docs.is_none();
        match RopeStrips::fit(dqkv, freqs, shape).filter(|_| fused) {
            Some(strips) => {
                check_shapes(dqkv, freqs, shape)?;
                self.column_sum_rotating(dbias, dqkv, accumulate, Some(strips))
            }
            // `rope` checks the shapes.
            None => {
                self.rope(dqkv, freqs, shape, docs, true, amax)?;
                self.column_sum(dbias, dqkv, accumulate)
            }
        }
    }
}

impl Cuda {
    /// RoPE's rotation of `qkv` in place, or with `inverse` its gradient's, reporting the
    /// abs-max of all of qkv as stored into `amax` where given.
    fn rope(
        &self, qkv: &Tensor<Cuda>, freqs: &Tensor<Cuda>, shape: AttnShape,
        docs: Option<&Tensor<Cuda>>, inverse: bool, amax: Option<&Tensor<Cuda>>,
    ) -> Result<()> {
        let amax = amax_ptr("rope", amax)?;
        check_shapes(qkv, freqs, shape)?;
        let docs = documents_ptr(docs, qkv.numel() / shape.qkv_width())?;
        let (w, d) = (shape.qkv_width(), shape.head_dim);
        let rows = qkv.numel() / w;
        let heads = shape.q_heads + shape.kv_heads;
        let vec = vec_fits(qkv, freqs, shape);
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
        // holds [seq, d/2, 2] f32; amax is null or one f32; docs is null or [2, rows] i32 (the
        // kernel keeps every position in [0, seq)).
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
                    docs.into(),
                ],
            )
        }
    }
}

/// qkv `[B·T, qkv_width]` of whole sequences, and freqs f32 with a (cos, sin) per position and
/// pair.
fn check_shapes(qkv: &Tensor<Cuda>, freqs: &Tensor<Cuda>, shape: AttnShape) -> Result<()> {
    ensure_dtype(freqs, DType::F32, "rope (freqs)")?;
    let w = shape.qkv_width();
    ensure!(
        qkv.cols() == w
            && (qkv.numel() / w).is_multiple_of(shape.seq)
            && freqs.numel() >= shape.seq * shape.head_dim,
        "rope: qkv {:?}, freqs {:?} for {shape:?}",
        qkv.shape,
        freqs.shape
    );
    Ok(())
}

/// Whether the rows and freqs take 16-byte accesses: every head half must start on a 16-byte
/// boundary too.
fn vec_fits(qkv: &Tensor<Cuda>, freqs: &Tensor<Cuda>, shape: AttnShape) -> bool {
    let half_bytes = shape.head_dim / 2 * qkv.dtype.size_bytes();
    vec16(&[qkv], shape.qkv_width())
        && half_bytes.is_multiple_of(16)
        && ptr(freqs).is_multiple_of(16)
}

/// RoPE's backward as `colsum_partial` applies it on its way (colsum.cu's ROPE): strips of
/// whole heads, as many as one warp's 16-byte accesses cover.
#[derive(Clone, Copy)]
pub(super) struct RopeStrips {
    pub freqs: u64,
    pub seq: usize,
    pub head_dim: usize,
    /// The q and k heads' columns, which rotate.
    pub rotated: usize,
    /// Columns a block covers.
    pub strip: usize,
}

impl RopeStrips {
    /// The strips for qkv, or `None` where a head would not fit one warp's accesses (or the
    /// accesses cannot be 16 bytes).
    pub(super) fn fit(qkv: &Tensor<Cuda>, freqs: &Tensor<Cuda>, shape: AttnShape) -> Option<Self> {
        let d = shape.head_dim;
        let warp_cols = 32 * width(qkv, true);
        (vec_fits(qkv, freqs, shape) && d <= warp_cols).then(|| RopeStrips {
            freqs: ptr(freqs),
            seq: shape.seq,
            head_dim: d,
            rotated: (shape.q_heads + shape.kv_heads) * d,
            strip: warp_cols / d * d,
        })
    }
}
