//! RMSNorm forward (plain or fused with the residual add) and backward (which also makes the
//! weight gradient's column-sum partials), and the bias gradient's deterministic column sum
//! (QKV's with RoPE's backward on the way, rope.rs).

use anyhow::{Result, ensure};

use super::kernels::{Arg, COLSUM_FINISH_THREADS, DEFAULT_SHARED_LIMIT, HELD, Kernel};
use super::rope::RopeStrips;
use super::{
    BLOCK, Cuda, amax_ptr, blocks, ensure_dtype, ensure_same_dtype, float, ptr, vec16, width,
};
use crate::backend::{AttnShape, NormOps, ResidualAdd};
use crate::tensor::{DType, Tensor};

/// Rows per block of the forward: one per warp.
const FORWARD_ROWS: usize = BLOCK as usize / 32;

/// Shared memory a backward block may take for its warps' weight-gradient sums: the limit
/// that needs no opt-in, which holds a full block's sums up to C = 1536. Where the sums fill
/// it (at C = 1536, say), the static shared memory of `report_amax` comes on top, so
/// `function_with_smem` opts in.
const BACKWARD_SMEM: usize = DEFAULT_SHARED_LIMIT as usize;

/// Shared memory one block may take on every GPU smelt compiles for (sm_80 allows 163 KB,
/// sm_86 and sm_89 99 KB).
const MAX_SMEM: usize = 99 * 1024;

impl NormOps for Cuda {
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_forward(
        &self, out: Option<&Tensor<Cuda>>, rstd: &Tensor<Cuda>, inp: &Tensor<Cuda>,
        residual: Option<ResidualAdd<'_, Cuda>>, weight: &Tensor<Cuda>, eps: f32,
        amax: Option<&Tensor<Cuda>>,
    ) -> Result<()> {
        let _timing = self.time_op(match residual {
            Some(_) => "residual_rmsnorm_forward",
            None => "rmsnorm_forward",
        })?;
        let residual_add = residual.map(|r| (r.out, r.branch));
        let amax = amax_ptr("rmsnorm_forward", amax)?;
        ensure_dtype(rstd, DType::F32, "rmsnorm_forward (rstd)")?;
        let mut rows: Vec<&Tensor<Cuda>> = out.into_iter().chain([inp, weight]).collect();
        ensure_same_dtype("rmsnorm_forward", &rows)?;
        let (n, c) = (inp.matrix_rows(), weight.numel());
        ensure!(
            inp.cols() == c && out.is_none_or(|o| o.numel() == n * c) && rstd.numel() == n,
            "rmsnorm_forward: inp {:?}, out {:?}, rstd {:?}, weight {:?}",
            inp.shape,
            out.map(|o| &o.shape),
            rstd.shape,
            weight.shape
        );
        if let Some((r, b)) = residual_add {
            ensure_same_dtype("residual_rmsnorm_forward", &[inp, r, b])?;
            ensure!(
                r.numel() == n * c && b.numel() == n * c,
                "residual_rmsnorm_forward: residual_out {:?}, branch {:?}, inp {:?}",
                r.shape,
                b.shape,
                inp.shape
            );
        }
        let (res_ptr, branch_ptr) = residual_add.map_or((0, 0), |(r, b)| (ptr(r), ptr(b)));
        rows.extend(residual_add.iter().flat_map(|(r, b)| [*r, *b]));
        let vec = vec16(&rows, c);
        // SAFETY: warp i reads row i of inp (and branch) and all of weight [c], writes row i
        // of out (unless null; and residual_out) and rstd[i]; the rows are [n, c] (rstd [n]),
        // all 16-byte aligned with `vec`; amax is one f32 or null.
        unsafe {
            self.launch(
                Kernel::RmsnormForward,
                &[
                    float(inp),
                    Arg::Flag(residual_add.is_some()),
                    Arg::Flag(vec),
                ],
                (blocks(n, FORWARD_ROWS), 1, 1),
                BLOCK,
                &[
                    out.map_or(0, ptr).into(),
                    ptr(rstd).into(),
                    res_ptr.into(),
                    ptr(inp).into(),
                    branch_ptr.into(),
                    ptr(weight).into(),
                    (n as i64).into(),
                    (c as i32).into(),
                    eps.into(),
                    amax.into(),
                ],
            )
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_backward(
        &self, dinp: &Tensor<Cuda>, dweight: &Tensor<Cuda>, dout: &Tensor<Cuda>,
        inp: &Tensor<Cuda>, weight: &Tensor<Cuda>, rstd: &Tensor<Cuda>, accumulate: bool,
        amax: Option<&Tensor<Cuda>>,
    ) -> Result<()> {
        let _timing = self.time_op("rmsnorm_backward")?;
        let amax = amax_ptr("rmsnorm_backward", amax)?;
        ensure_dtype(rstd, DType::F32, "rmsnorm_backward (rstd)")?;
        ensure_same_dtype("rmsnorm_backward", &[dinp, dweight, dout, inp, weight])?;
        let (n, c) = (inp.matrix_rows(), weight.numel());
        ensure!(
            inp.cols() == c && dinp.numel() == n * c && dout.numel() == n * c && rstd.numel() == n,
            "rmsnorm_backward: dinp {:?}, dout {:?}, inp {:?}, rstd {:?}, weight {:?}",
            dinp.shape,
            dout.shape,
            inp.shape,
            rstd.shape,
            weight.shape
        );
        let vec = vec16(&[dinp, dout, inp, weight], c);
        // Each warp keeps its own column sums: as many warps as fit the shared memory.
        let acc_floats = c.next_multiple_of(32 * width(dinp, vec));
        let warps = (BACKWARD_SMEM / (acc_floats * 4)).clamp(1, BLOCK as usize / 32);
        let smem = warps * acc_floats * 4;
        ensure!(
            smem <= MAX_SMEM,
            "rmsnorm_backward: a row of {c} is wider than this kernel supports"
        );
        // The fewest accesses per lane that hold a whole row, where some do. Holding 8 takes
        // 128 registers and so 2 blocks per SM, which pays only with full blocks (16 warps per
        // SM): on an H100, 8% faster than streaming at 1536 columns, 22% slower at 2048
        // columns with 6 warps a block.
        let full_blocks = warps == BLOCK as usize / 32;
        let held = HELD
            .into_iter()
            .find(|&h| h > 0 && c <= 32 * width(dinp, vec) * h && (h <= 4 || full_blocks))
            .unwrap_or(0);
        let targs = [float(dinp), Arg::Flag(vec), Arg::Held(held)];
        // One wave: as many blocks as the GPU holds at once, each with an equal share of the
        // rows (at least one a warp), so that no partly filled last wave runs on alone and
        // the partials, one row a block, are as few as can keep every SM busy.
        let slots = self.block_slots(
            Kernel::RmsnormBackward,
            &targs,
            (warps * 32) as u32,
            smem as u32,
        )?;
        let rows_per_block = n.div_ceil(slots).max(warps);
        let chunks = n.div_ceil(rows_per_block);
        let partials = self.scratch_f32(chunks * c)?;
        // SAFETY: block i updates rows [i·R, (i+1)·R) of dinp [n, c] from the same rows of
        // dout and inp [n, c] and rstd [n], reads weight [c], and writes row i of partials
        // [chunks, c] (scratch); `smem` is its warps' sums; 16-byte aligned with `vec`; amax
        // is one f32 or null.
        unsafe {
            self.launch_with_smem(
                Kernel::RmsnormBackward,
                &targs,
                (chunks as u32, 1, 1),
                (warps * 32) as u32,
                smem as u32,
                &[
                    ptr(dinp).into(),
                    partials.into(),
                    ptr(dout).into(),
                    ptr(inp).into(),
                    ptr(weight).into(),
                    ptr(rstd).into(),
                    (n as i64).into(),
                    (c as i32).into(),
                    (rows_per_block as i32).into(),
                    amax.into(),
                ],
            )?;
        }
        self.colsum_finish(dweight, partials, chunks, accumulate)
    }

    fn head_rmsnorm_forward(
        &self, out: &Tensor<Cuda>, rstd: &Tensor<Cuda>, x: &Tensor<Cuda>,
        (q_weight, k_weight): (&Tensor<Cuda>, &Tensor<Cuda>), shape: AttnShape, eps: f32,
    ) -> Result<()> {
        let _timing = self.time_op("head_rmsnorm_forward")?;
        let rows = check_head_norm(
            "head_rmsnorm_forward",
            out,
            x,
            (q_weight, k_weight),
            rstd,
            shape,
        )?;
        let items = rows * (shape.q_heads + shape.kv_heads + 1);
        // SAFETY: warp i of the grid takes item i of the rows' (heads + 1) items: it reads
        // one head of x [rows, W] and the weight of its kind ([D] each), and writes that head
        // of out and its rstd [rows, heads] (the last item of a row copies its value heads).
        unsafe {
            self.launch(
                Kernel::HeadRmsnormForward,
                &[float(x), Arg::HeadDim(shape.head_dim)],
                (blocks(items, FORWARD_ROWS), 1, 1),
                BLOCK,
                &[
                    ptr(out).into(),
                    ptr(rstd).into(),
                    ptr(x).into(),
                    ptr(q_weight).into(),
                    ptr(k_weight).into(),
                    (rows as i64).into(),
                    (shape.q_heads as i32).into(),
                    (shape.kv_heads as i32).into(),
                    eps.into(),
                ],
            )
        }
    }

    fn head_rmsnorm_backward(
        &self, dqkv: &Tensor<Cuda>, (dq_weight, dk_weight): (&Tensor<Cuda>, &Tensor<Cuda>),
        x: &Tensor<Cuda>, weights: (&Tensor<Cuda>, &Tensor<Cuda>), rstd: &Tensor<Cuda>,
        shape: AttnShape, accumulate: bool, amax: Option<&Tensor<Cuda>>,
    ) -> Result<()> {
        let _timing = self.time_op("head_rmsnorm_backward")?;
        let amax = amax_ptr("head_rmsnorm_backward", amax)?;
        let rows = check_head_norm("head_rmsnorm_backward", dqkv, x, weights, rstd, shape)?;
        ensure_same_dtype("head_rmsnorm_backward", &[dqkv, dq_weight, dk_weight])?;
        let d = shape.head_dim;
        ensure!(
            dq_weight.numel() == d && dk_weight.numel() == d,
            "head_rmsnorm_backward: weight gradients {:?} and {:?} for a head of {d}",
            dq_weight.shape,
            dk_weight.shape
        );
        let targs = [float(x), Arg::HeadDim(d)];
        // One wave, as `rmsnorm_backward`: as many blocks as the GPU holds at once, each with
        // an equal share of the rows, so the partials are as few as keep every SM busy.
        let slots = self.block_slots(Kernel::HeadRmsnormBackward, &targs, BLOCK, 0)?;
        let rows_per_block = rows.div_ceil(slots).max(1);
        let chunks = rows.div_ceil(rows_per_block).max(1);
        let partials = self.scratch_f32(2 * chunks * d)?;
        // SAFETY: block i rewrites the query and key heads of rows [i·R, (i+1)·R) of dqkv
        // [rows, W] in place, reading the same heads of x, rstd [rows, heads] and the weights
        // [D]; it writes row i of each of the two [chunks, D] planes of partials (scratch,
        // 2·chunks·D f32); amax is one f32 or null.
        unsafe {
            self.launch(
                Kernel::HeadRmsnormBackward,
                &targs,
                (chunks as u32, 1, 1),
                BLOCK,
                &[
                    ptr(dqkv).into(),
                    partials.into(),
                    ptr(x).into(),
                    ptr(weights.0).into(),
                    ptr(weights.1).into(),
                    ptr(rstd).into(),
                    (rows as i64).into(),
                    (shape.q_heads as i32).into(),
                    (shape.kv_heads as i32).into(),
                    (rows_per_block as i32).into(),
                    amax.into(),
                ],
            )?;
        }
        self.colsum_finish(dq_weight, partials, chunks, accumulate)?;
        let keys = partials + (4 * chunks * d) as u64;
        self.colsum_finish(dk_weight, keys, chunks, accumulate)
    }
}

impl Cuda {
    /// `out[c] (+)= Σ_n dy[n, c]`: partials per chunk of rows, then a fixed-order sum.
    pub(super) fn column_sum(
        &self, out: &Tensor<Cuda>, dy: &Tensor<Cuda>, accumulate: bool,
    ) -> Result<()> {
        self.column_sum_rotating(out, dy, accumulate, None)
    }

    /// `column_sum`, and with `rope` RoPE's backward applied to dy in place on the way, the
    /// sums then of the rotated values (colsum.cu's ROPE): the caller has checked that it
    /// fits (`RopeStrips`).
    pub(super) fn column_sum_rotating(
        &self, out: &Tensor<Cuda>, dy: &Tensor<Cuda>, accumulate: bool, rope: Option<RopeStrips>,
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
        let vec = vec16(&[dy], c);
        ensure!(
            vec || rope.is_none(),
            "column sum with RoPE: {:?} is not 16-byte aligned",
            dy.shape
        );
        let targs = [float(dy), Arg::Flag(vec), Arg::Flag(rope.is_some())];
        let strip = rope.map_or(32 * width(dy, vec), |r| r.strip);
        let strips = blocks(c, strip);
        // One wave, as `rmsnorm_backward_impl`: each strip of columns split into as many
        // chunks as fill the GPU's block slots. A chunk is rows, at least one a warp, or with
        // RoPE positions, a whole number of them a warp (the warps walk a position's rows of
        // every sequence).
        let slots = self.block_slots(Kernel::ColsumPartial, &targs, BLOCK, 0)?;
        let chunks_wanted = slots.div_ceil(strips as usize);
        let warps = BLOCK as usize / 32;
        let (per_chunk, chunks) = match rope {
            Some(r) => {
                let per = r.seq.div_ceil(chunks_wanted).next_multiple_of(warps);
                (per, r.seq.div_ceil(per))
            }
            None => {
                let per = n.div_ceil(chunks_wanted).max(warps);
                (per, n.div_ceil(per).max(1))
            }
        };
        let partials = self.scratch_f32(chunks * c)?;
        // The plain sum reads none of RoPE's arguments.
        let (freqs, seq, head_dim, rotated) =
            rope.map_or((0, 0, 0, 0), |r| (r.freqs, r.seq, r.head_dim, r.rotated));
        // SAFETY: partials are [chunks, c] f32 of scratch; block (s, k) reads (and with rope
        // rewrites) rows of chunk k of dy [n, c] (with rope, n a whole number of sequences,
        // which rope's caller checked) in the strip s of `strip` columns (16-byte aligned with
        // `vec`, which rope requires), reads freqs [seq, d/2, 2] f32 (rope's caller checked
        // it), and writes those columns of partials row k.
        unsafe {
            self.launch(
                Kernel::ColsumPartial,
                &targs,
                (strips, chunks as u32, 1),
                BLOCK,
                &[
                    partials.into(),
                    ptr(dy).into(),
                    (n as i32).into(),
                    (c as i32).into(),
                    (per_chunk as i32).into(),
                    freqs.into(),
                    (seq as i32).into(),
                    (head_dim as i32).into(),
                    (rotated as i32).into(),
                    (strip as i32).into(),
                ],
            )?;
        }
        self.colsum_finish(out, partials, chunks, accumulate)
    }

    /// `out[c] (+)= Σ_k partials[k, c]` over `chunks` rows of f32 partials.
    pub(super) fn colsum_finish(
        &self, out: &Tensor<Cuda>, partials: u64, chunks: usize, accumulate: bool,
    ) -> Result<()> {
        let c = out.numel();
        // SAFETY: block j reads columns [32j, 32j + 32) of partials [chunks, c] and updates
        // those of out [c], with warps of 32 lanes.
        unsafe {
            self.launch(
                Kernel::ColsumFinish,
                &[float(out)],
                (blocks(c, 32), 1, 1),
                COLSUM_FINISH_THREADS,
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

/// The rows of a head norm's `x` (and its `out` or gradient `y`), with `rstd` and the weights,
/// checked against `shape`.
fn check_head_norm(
    op: &'static str, y: &Tensor<Cuda>, x: &Tensor<Cuda>,
    (q_weight, k_weight): (&Tensor<Cuda>, &Tensor<Cuda>), rstd: &Tensor<Cuda>, shape: AttnShape,
) -> Result<usize> {
    ensure_dtype(rstd, DType::F32, op)?;
    ensure_same_dtype(op, &[y, x, q_weight, k_weight])?;
    let (w, d) = (shape.qkv_width(), shape.head_dim);
    let rows = x.numel() / w;
    ensure!(
        x.cols() == w
            && y.numel() == x.numel()
            && rstd.numel() == rows * (shape.q_heads + shape.kv_heads)
            && q_weight.numel() == d
            && k_weight.numel() == d,
        "{op}: x {:?}, out {:?}, rstd {:?}, weights {:?} and {:?} for {shape:?}",
        x.shape,
        y.shape,
        rstd.shape,
        q_weight.shape,
        k_weight.shape
    );
    Ok(rows)
}
