//! Causal grouped-query attention, forward and backward: on the tensor cores for 16-byte
//! aligned bf16 (kernels/attention_tc.cu: wgmma on Hopper, mma.sync elsewhere), on the CUDA
//! cores otherwise (kernels/attention.cu, which is also the simple reference the tensor-core
//! versions are tested against).

use anyhow::{Result, ensure};

use super::kernel_choice::AttentionKernels;
use super::kernels::{
    ATTENTION_TC_THREADS, ATTENTION_TC_TILE, ATTENTION_TILE, Arg, HEAD_DIMS, KArg, Kernel,
    wgmma_head_dim,
};
use super::tma::{TensorMap, TensorMaps2};
use super::{BLOCK, Cuda, amax_ptr, blocks, ensure_dtype, ensure_same_dtype, float, ptr, vec16};
use crate::backend::{AttentionOps, AttnShape};
use crate::tensor::{DType, Tensor};

/// The blocks a head of the CUDA-core `attention_decode` shares its keys out to: one per
/// `DECODE_KEYS` positions of the cache's capacity, at most `DECODE_SPLITS`.
const DECODE_KEYS: usize = 64;
const DECODE_SPLITS: usize = 16;

/// Shared memory for the two TMA barriers (mbarriers of 8 bytes) of a tensor-core kernel.
const TMA_BARRIERS: usize = 2 * 8;

/// The tensor-core kernels of one call, and their shared-memory tiles: 64 rows of
/// `head_dim` bf16, padded by 8 for mma.sync's ldmatrix.
struct TensorCoreKernels {
    forward: Kernel,
    dkdv: Kernel,
    dq: Kernel,
    padding: usize,
    /// Whether the kernels' tiles arrive by TMA (Hopper), through the maps of `tile_maps`.
    tma: bool,
}

impl TensorCoreKernels {
    const WGMMA: Self = TensorCoreKernels {
        forward: Kernel::AttentionForwardWgmma,
        dkdv: Kernel::AttentionBackwardDkDvWgmma,
        dq: Kernel::AttentionBackwardDqWgmma,
        padding: 0,
        tma: true,
    };
    const MMA_SYNC: Self = TensorCoreKernels {
        forward: Kernel::AttentionForwardMma,
        dkdv: Kernel::AttentionBackwardDkDvMma,
        dq: Kernel::AttentionBackwardDqMma,
        padding: 8,
        tma: false,
    };

    /// Dynamic shared memory for `tiles` 64-row tiles plus `extra` bytes.
    fn smem(&self, head_dim: usize, tiles: usize, extra: usize) -> u32 {
        (tiles * ATTENTION_TC_TILE * (head_dim + self.padding) * 2 + extra) as u32
    }

    /// The forward stages Q, K and V tiles, and K's and V's TMA barriers.
    fn forward_smem(&self, head_dim: usize) -> u32 {
        self.smem(head_dim, 3, TMA_BARRIERS)
    }

    /// dK/dV stages K and V, two buffers of Q and dout tiles and of the query tile's lse and
    /// delta, and the two buffers' TMA barriers.
    fn dkdv_smem(&self, head_dim: usize) -> u32 {
        self.smem(head_dim, 6, 2 * 2 * ATTENTION_TC_TILE * 4 + TMA_BARRIERS)
    }

    /// dQ stages Q and dout, two buffers of K and V tiles, and the two buffers' TMA barriers.
    fn dq_smem(&self, head_dim: usize) -> u32 {
        self.smem(head_dim, 6, TMA_BARRIERS)
    }

    /// The TMA maps of qkv and dout ([B, T, columns] as (column, token, batch), in boxes of
    /// one 64-column slab of 64 tokens) that the kernels read their tiles through where `tma`
    /// (the forward has no dout).
    fn tile_maps(
        &self, s: &AttnShape, qkv: &Tensor<Cuda>, dout: Option<&Tensor<Cuda>>,
    ) -> Result<KArg> {
        let map = |t: &Tensor<Cuda>, heads: usize| {
            let cols = heads * s.head_dim;
            let row = (cols * 2) as u64;
            TensorMap::swizzled(
                ptr(t),
                DType::BF16,
                [cols as u64, s.seq as u64, s.batch as u64],
                &[row, row * s.seq as u64],
                [64, ATTENTION_TC_TILE as u32, 1],
            )
        };
        let maps = match (self.tma, dout) {
            (false, _) => [TensorMap::unused(); 2],
            (true, None) => [map(qkv, s.q_heads + 2 * s.kv_heads)?, TensorMap::unused()],
            (true, Some(dout)) => [map(qkv, s.q_heads + 2 * s.kv_heads)?, map(dout, s.q_heads)?],
        };
        Ok(KArg::Maps(Box::new(TensorMaps2(maps))))
    }
}

/// Lanes per (row, head) of `attention_backward_delta`, as the kernel derives them: the
/// largest power of two, up to 32, that divides a head's accesses (16 bytes each with `vec`).
fn delta_lanes(head_dim: usize, dtype: DType, vec: bool) -> usize {
    let accesses = if vec {
        head_dim * dtype.size_bytes() / 16
    } else {
        head_dim
    };
    (1 << accesses.trailing_zeros()).min(32)
}

/// Into how many shares the dK/dV kernel splits each kv head's group of query heads, given
/// `slots` blocks running at once. A dK/dV block's work is its group's query heads times the
/// query tiles at or after its key tile, so the first key tile's blocks do `tiles` times the
/// last one's, and the kernel lasts at least as long as they do. Each share writes its partial
/// dK and dV in f32 and `attention_dkdv_sum` adds them: the result is deterministic, but not
/// the same bits as unsplit.
/// - A grid that fills at most half the slots (small batches) leaves the rest idle while its
///   heaviest blocks work through the whole group: it takes the fewest shares that bring
///   its heaviest block (a share's heads times `tiles`) within the average load of a slot, or
///   one query head per share where nothing does. Shares may differ by a head. Their traffic
///   is small at such sizes.
/// - Otherwise, where the heaviest blocks outweigh the average (at 3B's shape on an H100,
///   twice the average), an even group is halved, and no more: shares multiply their traffic
///   (seven at 0.5B's shape with batch 16 cost its backward 7% on an H100).
fn dkdv_splits(s: &AttnShape, slots: usize) -> usize {
    let group = s.q_heads / s.kv_heads;
    let tiles = s.seq.div_ceil(ATTENTION_TC_TILE);
    let blocks = tiles * s.kv_heads * s.batch;
    let tile_pairs = group * tiles * (tiles + 1) / 2 * s.kv_heads * s.batch;
    if 2 * blocks <= slots {
        return (1..=group)
            .find(|&shares| group.div_ceil(shares) * tiles * slots <= tile_pairs)
            .unwrap_or(group);
    }
    let heaviest_outlasts_average = group * tiles * slots > tile_pairs;
    if heaviest_outlasts_average && group.is_multiple_of(2) {
        2
    } else {
        1
    }
}

fn scale(s: &AttnShape) -> f32 {
    (1.0 / (s.head_dim as f64).sqrt()) as f32
}

fn check(s: &AttnShape, qkv: &Tensor<Cuda>, lse: &Tensor<Cuda>) -> Result<()> {
    ensure_dtype(lse, DType::F32, "attention (lse)")?;
    check_qkv(s, qkv)?;
    ensure!(
        lse.numel() == s.batch * s.q_heads * s.seq,
        "attention: lse {:?} for {s:?}",
        lse.shape
    );
    Ok(())
}

/// The device address of `docs` (`AttentionOps`), checked to be `[2, tokens]` i32, or 0
/// (null) without documents. The kernels clamp every start and end into its token's sequence,
/// so no values read through it take them out of bounds.
pub(super) fn documents_ptr(docs: Option<&Tensor<Cuda>>, tokens: usize) -> Result<u64> {
    let Some(docs) = docs else { return Ok(0) };
    ensure_dtype(docs, DType::I32, "attention (docs)")?;
    ensure!(
        docs.numel() == 2 * tokens,
        "attention: docs {:?} for {tokens} tokens (want [2, B, T])",
        docs.shape
    );
    Ok(ptr(docs))
}

fn check_qkv(s: &AttnShape, qkv: &Tensor<Cuda>) -> Result<()> {
    ensure!(
        HEAD_DIMS.contains(&s.head_dim),
        "attention: head_dim {} is not supported on CUDA (supported: {HEAD_DIMS:?}); use \
         --device cpu",
        s.head_dim
    );
    ensure!(
        s.kv_heads > 0 && s.q_heads.is_multiple_of(s.kv_heads),
        "attention: {} query heads are not a multiple of {} kv heads",
        s.q_heads,
        s.kv_heads
    );
    ensure!(
        qkv.numel() == s.batch * s.seq * s.qkv_width(),
        "attention: qkv {:?} for {s:?}",
        qkv.shape
    );
    Ok(())
}

impl AttentionOps for Cuda {
    fn attention_forward(
        &self, out: &Tensor<Cuda>, lse: &Tensor<Cuda>, qkv: &Tensor<Cuda>, s: AttnShape,
        docs: Option<&Tensor<Cuda>>, amax: Option<&Tensor<Cuda>>,
    ) -> Result<()> {
        let _timing = self.time_op("attention_forward")?;
        let amax = amax_ptr("attention_forward", amax)?;
        let docs = documents_ptr(docs, s.batch * s.seq)?;
        check(&s, qkv, lse)?;
        ensure_same_dtype("attention_forward", &[out, qkv])?;
        ensure!(
            out.numel() == s.batch * s.seq * s.q_heads * s.head_dim,
            "attention_forward: out {:?}",
            out.shape
        );
        let args = [
            ptr(out).into(),
            ptr(lse).into(),
            ptr(qkv).into(),
            (s.seq as i32).into(),
            (s.q_heads as i32).into(),
            (s.kv_heads as i32).into(),
            scale(&s).into(),
            amax.into(),
            docs.into(),
        ];
        // SAFETY: block (tile, h, b) reads qkv rows of batch b up to its last query and writes
        // its rows of head h in out [B·T, Hq·D] and lse [B, Hq, T], and amax (one f32 or
        // null), reading docs (null or [2, B, T] i32) at its sequence's tokens; the tensor-core
        // kernels, only where qkv and out are 16-byte aligned (with TMA,
        // reading qkv through a map of exactly it), stage Q, K and V tiles and their barriers
        // in exactly `forward_smem(D)` bytes.
        unsafe {
            if let Some(tc) = self.tensor_cores(&[qkv, out], s.head_dim) {
                self.launch_with_smem(
                    tc.forward,
                    &[Arg::HeadDim(s.head_dim)],
                    (
                        blocks(s.seq, ATTENTION_TC_TILE),
                        s.q_heads as u32,
                        s.batch as u32,
                    ),
                    ATTENTION_TC_THREADS,
                    tc.forward_smem(s.head_dim),
                    &[&args[..], &[tc.tile_maps(&s, qkv, None)?]].concat(),
                )
            } else {
                self.launch(
                    Kernel::AttentionForward,
                    &[float(qkv), Arg::HeadDim(s.head_dim)],
                    (
                        blocks(s.seq, ATTENTION_TILE),
                        s.q_heads as u32,
                        s.batch as u32,
                    ),
                    BLOCK,
                    &args,
                )
            }
        }
    }

    /// Generation's attention: a grid sized by the cache's capacity, whichever position the
    /// query holds, so that a recorded pass has the grid of every position (each block takes
    /// its share of the keys that the position has); where that makes more than one block a
    /// head, a second kernel merging the blocks' states.
    fn attention_decode(
        &self, out: &Tensor<Cuda>, qkv: &Tensor<Cuda>, at: &Tensor<Cuda>, s: AttnShape,
    ) -> Result<()> {
        let _timing = self.time_op("attention_decode")?;
        check_qkv(&s, qkv)?;
        ensure_same_dtype("attention_decode", &[out, qkv])?;
        ensure_dtype(at, DType::I32, "attention_decode (at)")?;
        ensure!(
            s.batch == 1 && s.seq > 0 && out.numel() == s.q_heads * s.head_dim && at.numel() == 1,
            "attention_decode: out {:?}, at {:?} for {s:?} (one sequence, one query)",
            out.shape,
            at.shape
        );
        let splits = s.seq.div_ceil(DECODE_KEYS).min(DECODE_SPLITS);
        let partial = match splits {
            1 => 0,
            _ => self.scratch_f32(s.q_heads * splits * (s.head_dim + 2))?,
        };
        let instance = [float(qkv), Arg::HeadDim(s.head_dim)];
        // SAFETY: block (h, k) reads the i32 at `at`, clamped into [0, T) for the capacity T,
        // head h's query in that row of qkv [T, stride] and the k-th of `splits` runs of the
        // keys and values up to it of h's KV head, and writes head h's D values of out
        // [1, Hq·D] (one block a head) or its D + 2 floats of partial [Hq, splits, D + 2],
        // which the combine kernel (block h) then reads for out's head h.
        unsafe {
            self.launch(
                Kernel::AttentionDecode,
                &instance,
                (s.q_heads as u32, splits as u32, 1),
                BLOCK,
                &[
                    ptr(out).into(),
                    partial.into(),
                    ptr(qkv).into(),
                    (s.seq as i32).into(),
                    ptr(at).into(),
                    (s.q_heads as i32).into(),
                    (s.kv_heads as i32).into(),
                    scale(&s).into(),
                ],
            )?;
            if splits > 1 {
                self.launch(
                    Kernel::AttentionDecodeCombine,
                    &instance,
                    (s.q_heads as u32, 1, 1),
                    s.head_dim as u32,
                    &[ptr(out).into(), partial.into(), (splits as i32).into()],
                )?;
            }
        }
        Ok(())
    }

    /// delta = rowsum(dout ⊙ out) into scratch, dK/dV per key tile and dQ per query tile: on
    /// the tensor cores dQ goes first and writes delta for dK/dV, elsewhere a pass of its own
    /// does.
    fn attention_backward(
        &self, dqkv: &Tensor<Cuda>, dout: &Tensor<Cuda>, qkv: &Tensor<Cuda>, out: &Tensor<Cuda>,
        lse: &Tensor<Cuda>, s: AttnShape, docs: Option<&Tensor<Cuda>>,
    ) -> Result<()> {
        let _timing = self.time_op("attention_backward")?;
        check(&s, qkv, lse)?;
        let docs = documents_ptr(docs, s.batch * s.seq)?;
        ensure_same_dtype("attention_backward", &[dqkv, dout, qkv, out])?;
        let q_numel = s.batch * s.seq * s.q_heads * s.head_dim;
        ensure!(
            dqkv.numel() == qkv.numel() && dout.numel() == q_numel && out.numel() == q_numel,
            "attention_backward: dqkv {:?}, dout {:?}, qkv {:?}, out {:?} for {s:?}",
            dqkv.shape,
            dout.shape,
            qkv.shape,
            out.shape
        );
        let targs = [float(qkv), Arg::HeadDim(s.head_dim)];
        let rows = s.batch * s.seq * s.q_heads;
        let tc = self.tensor_cores(&[qkv, dout, dqkv, out], s.head_dim);
        let dims = [Arg::HeadDim(s.head_dim)];
        let splits = match tc {
            Some(tc) => {
                let smem = tc.dkdv_smem(s.head_dim);
                dkdv_splits(
                    &s,
                    self.block_slots(tc.dkdv, &dims, ATTENTION_TC_THREADS, smem)?,
                )
            }
            None => 1,
        };
        // delta, then (when the group is split) the dK/dV shares, 16-byte aligned.
        let tokens = s.batch * s.seq;
        let share_floats = if splits > 1 {
            splits * 2 * tokens * s.kv_heads * s.head_dim
        } else {
            0
        };
        let delta_floats = rows.next_multiple_of(4);
        let delta = self.scratch_f32(delta_floats + share_floats)?;
        let shares = delta + delta_floats as u64 * 4;
        // The arguments the dK/dV and dQ kernels take first; then the tensor-core dK/dV kernel
        // takes its shares and their count, and the tensor-core dQ kernel `out`.
        let common = || -> Vec<KArg> {
            vec![
                ptr(dqkv).into(),
                ptr(dout).into(),
                ptr(qkv).into(),
                ptr(lse).into(),
                delta.into(),
                (s.seq as i32).into(),
                (s.q_heads as i32).into(),
                (s.kv_heads as i32).into(),
                scale(&s).into(),
                docs.into(),
            ]
        };
        // SAFETY: delta is [B, Hq, T] f32 of scratch, written from dout and out [B·T, Hq·D]:
        // on the tensor cores by the dQ blocks, each for its own rows (bf16 pairs), before
        // dK/dV reads it; otherwise by `delta_lanes` threads per (row, head) (16-byte loads
        // only where `delta_vec`).
        // The dK/dV blocks write disjoint k and v columns of dqkv, or with splits, disjoint rows
        // of the shares ([splits][2][B·T][Hkv][D] f32 of scratch after delta, 16-byte aligned),
        // which the sum reads back; the dQ blocks write disjoint q columns; all read qkv, dout,
        // lse and delta in bounds (with TMA, through maps of exactly qkv and dout), and docs
        // (null or [2, B, T] i32) at their sequence's tokens. The
        // tensor-core kernels run only where qkv, dout, out and dqkv are 16-byte aligned, and
        // take exactly the shared memory they stage: `dkdv_smem(D)` bytes for dK/dV (K, V, two
        // buffers of Q and dout tiles and of their lse and delta, the barriers), `dq_smem(D)`
        // for dQ (Q, dout, two buffers of K and V, the barriers).
        unsafe {
            let Some(tc) = tc else {
                let delta_vec = vec16(&[dout, out], s.head_dim);
                self.launch(
                    Kernel::AttentionBackwardDelta,
                    &[targs[0], targs[1], Arg::Flag(delta_vec)],
                    (
                        blocks(
                            rows * delta_lanes(s.head_dim, dout.dtype, delta_vec),
                            BLOCK as usize,
                        ),
                        1,
                        1,
                    ),
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
                    (
                        blocks(s.seq, ATTENTION_TILE),
                        s.kv_heads as u32,
                        s.batch as u32,
                    ),
                    BLOCK,
                    &common(),
                )?;
                return self.launch(
                    Kernel::AttentionBackwardDq,
                    &targs,
                    (
                        blocks(s.seq, ATTENTION_TILE),
                        s.q_heads as u32,
                        s.batch as u32,
                    ),
                    BLOCK,
                    &common(),
                );
            };
            // dK/dV and dQ read their tiles through the same maps.
            let maps = tc.tile_maps(&s, qkv, Some(dout))?;
            self.launch_with_smem(
                tc.dq,
                &dims,
                (
                    blocks(s.seq, ATTENTION_TC_TILE),
                    s.q_heads as u32,
                    s.batch as u32,
                ),
                ATTENTION_TC_THREADS,
                tc.dq_smem(s.head_dim),
                &[common(), vec![ptr(out).into(), maps.clone()]].concat(),
            )?;
            self.launch_with_smem(
                tc.dkdv,
                &dims,
                (
                    blocks(s.seq, ATTENTION_TC_TILE),
                    (s.kv_heads * splits) as u32,
                    s.batch as u32,
                ),
                ATTENTION_TC_THREADS,
                tc.dkdv_smem(s.head_dim),
                &[
                    common(),
                    vec![
                        if splits > 1 { shares } else { 0 }.into(),
                        (splits as i32).into(),
                        maps,
                    ],
                ]
                .concat(),
            )?;
            if splits > 1 {
                self.launch(
                    Kernel::AttentionDkDvSum,
                    &[],
                    (
                        blocks(2 * tokens * s.kv_heads * s.head_dim / 4, BLOCK as usize),
                        1,
                        1,
                    ),
                    BLOCK,
                    &[
                        ptr(dqkv).into(),
                        shares.into(),
                        (tokens as i64).into(),
                        (s.q_heads as i32).into(),
                        (s.kv_heads as i32).into(),
                        (s.head_dim as i32).into(),
                        (splits as i32).into(),
                    ],
                )?;
            }
            Ok(())
        }
    }
}

impl Cuda {
    /// Chooses the attention kernels for the calls that follow (tests compare the three).
    pub fn set_attention_kernels(&self, kernels: AttentionKernels) {
        self.attention.set(kernels);
    }

    /// The tensor-core kernels for this call, or None for the CUDA-core ones. `tensors` are
    /// those the tensor-core kernels copy 16 bytes at a time from (qkv, dout) or move in pairs
    /// (out, dqkv): each must be bf16 and 16-byte aligned.
    fn tensor_cores(
        &self, tensors: &[&Tensor<Cuda>], head_dim: usize,
    ) -> Option<&'static TensorCoreKernels> {
        let choice = self.attention.get();
        if choice == AttentionKernels::Simple
            || tensors.iter().any(|t| t.dtype != DType::BF16)
            || !vec16(tensors, head_dim)
            || self.compute_capability.0 < 8
        {
            None
        } else if choice == AttentionKernels::Wgmma
            && self.compute_capability.0 == 9
            && wgmma_head_dim(head_dim)
        {
            Some(&TensorCoreKernels::WGMMA)
        } else {
            Some(&TensorCoreKernels::MMA_SYNC)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(batch: usize, q_heads: usize, kv_heads: usize) -> AttnShape {
        AttnShape {
            batch,
            seq: 1024,
            q_heads,
            kv_heads,
            head_dim: 128,
        }
    }

    #[test]
    fn dkdv_splits_fill_idle_slots_or_halve_the_heaviest_blocks() {
        // An H100's 132 multiprocessors at 2 or 3 dK/dV blocks each.
        // 0.5B, batch 32: 1,024 blocks; the heaviest (112 tile pairs) under the average (154).
        assert_eq!(dkdv_splits(&shape(32, 14, 2), 396), 1);
        // 1.5B, batch 16: the heaviest (96) just under the average (98.9).
        assert_eq!(dkdv_splits(&shape(16, 12, 2), 264), 1);
        // 3B, batch 8: 256 blocks, the heaviest (128) twice the average (65.9); halved, 64.
        assert_eq!(dkdv_splits(&shape(8, 16, 2), 264), 2);
        // 0.5B at batch 16: the heaviest (112) above the average (76.9), but the group is odd.
        assert_eq!(dkdv_splits(&shape(16, 14, 2), 396), 1);
        // Small batches: 32 blocks for 264 or 396 slots, whose average load (8.2 or 4.8 tile
        // pairs) is under one head's 16: one share per query head.
        assert_eq!(dkdv_splits(&shape(1, 16, 2), 264), 8);
        assert_eq!(dkdv_splits(&shape(1, 14, 2), 396), 7);
        // 0.5B at batch 4: 128 blocks averaging 19.2 pairs; only single heads (16) fit.
        assert_eq!(dkdv_splits(&shape(4, 14, 2), 396), 7);
        // 3B at batch 4: 128 blocks averaging 33.0; shares of 2 heads (32) fit.
        assert_eq!(dkdv_splits(&shape(4, 16, 2), 264), 4);
        // 4 tiles of 64, 48 sequences of a group of 7: 192 blocks averaging 8.5; shares of
        // 2 heads (8) fit, so 4 shares of 1, 2, 2 and 2 heads.
        let short = AttnShape {
            seq: 256,
            ..shape(48, 7, 1)
        };
        assert_eq!(dkdv_splits(&short, 396), 4);
    }

    #[test]
    fn delta_lanes_share_each_head_by_the_largest_power_of_two_that_divides_it() {
        // bf16 with 16-byte accesses: 8, 10, 12 and 16 accesses a head.
        let bf16 = [64, 80, 96, 128].map(|d| delta_lanes(d, DType::BF16, true));
        assert_eq!(bf16, [8, 2, 4, 16]);
        // f32, 16 bytes at a time and one element at a time (at most 32 lanes).
        assert_eq!(delta_lanes(128, DType::F32, true), 32);
        assert_eq!(delta_lanes(64, DType::F32, false), 32);
        assert_eq!(delta_lanes(80, DType::BF16, false), 16);
    }
}
