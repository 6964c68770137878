//! Causal grouped-query attention, forward and backward (see kernels/attention.cu).

use anyhow::{Result, ensure};

use super::kernels::{Arg, Kernel};
use super::{BLOCK, Cuda, blocks, ensure_dtype, ensure_same_dtype, float, ptr};
use crate::backend::AttnShape;
use crate::tensor::{DType, Tensor};

/// Query (or key) rows per block; the kernels' TILE.
const TILE: usize = 32;

fn scale(s: &AttnShape) -> f32 {
    (1.0 / (s.head_dim as f64).sqrt()) as f32
}

fn check(s: &AttnShape, qkv: &Tensor<Cuda>, lse: &Tensor<Cuda>) -> Result<()> {
    ensure_dtype(lse, DType::F32, "attention (lse)")?;
    ensure!(
        s.kv_heads > 0 && s.q_heads.is_multiple_of(s.kv_heads),
        "attention: {} query heads are not a multiple of {} kv heads",
        s.q_heads,
        s.kv_heads
    );
    ensure!(
        qkv.numel() == s.batch * s.seq * s.qkv_width()
            && lse.numel() == s.batch * s.q_heads * s.seq,
        "attention: qkv {:?}, lse {:?} for {s:?}",
        qkv.shape,
        lse.shape
    );
    Ok(())
}

impl Cuda {
    pub(super) fn attention_forward_impl(
        &self,
        out: &Tensor<Cuda>,
        lse: &Tensor<Cuda>,
        qkv: &Tensor<Cuda>,
        s: AttnShape,
    ) -> Result<()> {
        check(&s, qkv, lse)?;
        ensure_same_dtype("attention_forward", &[out, qkv])?;
        ensure!(
            out.numel() == s.batch * s.seq * s.q_heads * s.head_dim,
            "attention_forward: out {:?}",
            out.shape
        );
        // SAFETY: block (tile, h, b) reads qkv rows of batch b up to its last query and writes
        // its 32 rows of head h in out [B·T, Hq·D] and lse [B, Hq, T].
        unsafe {
            self.launch(
                Kernel::AttentionForward,
                &[float(qkv), Arg::HeadDim(s.head_dim)],
                (blocks(s.seq, TILE), s.q_heads as u32, s.batch as u32),
                BLOCK,
                &[
                    ptr(out).into(),
                    ptr(lse).into(),
                    ptr(qkv).into(),
                    (s.seq as i32).into(),
                    (s.q_heads as i32).into(),
                    (s.kv_heads as i32).into(),
                    scale(&s).into(),
                ],
            )
        }
    }

    /// delta = rowsum(dout ⊙ out) into scratch, then dK/dV per key tile and dQ per query tile.
    pub(super) fn attention_backward_impl(
        &self,
        dqkv: &Tensor<Cuda>,
        dout: &Tensor<Cuda>,
        qkv: &Tensor<Cuda>,
        out: &Tensor<Cuda>,
        lse: &Tensor<Cuda>,
        s: AttnShape,
    ) -> Result<()> {
        check(&s, qkv, lse)?;
        ensure_same_dtype("attention_backward", &[dqkv, dout, qkv, out])?;
        let q_numel = s.batch * s.seq * s.q_heads * s.head_dim;
        ensure!(
            dqkv.numel() == qkv.numel() && dout.numel() == q_numel && out.numel() == q_numel,
            "attention_backward shapes"
        );
        let targs = [float(qkv), Arg::HeadDim(s.head_dim)];
        let rows = s.batch * s.seq * s.q_heads;
        let delta = self.scratch_f32(rows)?;
        let common = |d: u64| -> Vec<super::kernels::KArg> {
            vec![
                ptr(dqkv).into(),
                ptr(dout).into(),
                ptr(qkv).into(),
                ptr(lse).into(),
                d.into(),
                (s.seq as i32).into(),
                (s.q_heads as i32).into(),
                (s.kv_heads as i32).into(),
                scale(&s).into(),
            ]
        };
        // SAFETY: delta is [B, Hq, T] f32 of scratch, written by one warp per (row, head) from
        // dout and out [B·T, Hq·D]. The dK/dV blocks write disjoint k and v columns of dqkv,
        // the dQ blocks disjoint q columns; all read qkv, dout, lse and delta in bounds.
        unsafe {
            self.launch(
                Kernel::AttentionBackwardDelta,
                &targs,
                (blocks(rows, 8), 1, 1),
                BLOCK,
                &[
                    delta.into(),
                    ptr(dout).into(),
                    ptr(out).into(),
                    (s.batch as i32).into(),
                    (s.seq as i32).into(),
                    (s.q_heads as i32).into(),
                ],
            )?;
            self.launch(
                Kernel::AttentionBackwardDkDv,
                &targs,
                (blocks(s.seq, TILE), s.kv_heads as u32, s.batch as u32),
                BLOCK,
                &common(delta),
            )?;
            self.launch(
                Kernel::AttentionBackwardDq,
                &targs,
                (blocks(s.seq, TILE), s.q_heads as u32, s.batch as u32),
                BLOCK,
                &common(delta),
            )
        }
    }
}
