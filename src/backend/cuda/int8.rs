//! INT8 on the GPU: row-wise quantization (kernels/int8.cu), and the products of INT8
//! operands, by smelt's own kernel on Hopper (the epilogue scales the int32 sums as it stores
//! them) and elsewhere by cuBLASLt's IMMA kernels into int32, then `dequantize_i32`, in row
//! chunks whose int32 sums fit a bounded scratch.

use anyhow::{Result, ensure};

use super::cublaslt::GemmPtrs;
use super::kernels::{
    Arg, INT8_AMAX_THREADS, INT8_COL_ROWS, INT8_COL_THREADS, INT8_COL_TILE, Kernel,
};
use super::matmul_algos::GemmKey;
use super::{BLOCK, Cuda, blocks, ensure_dtype, float, ptr};
use crate::backend::op_times::matmul_name;
use crate::backend::{Int8Layout, Int8Ops, Int8Rounding, Operand};
use crate::tensor::{DType, Tensor};

/// The most int32 sums one chunk of a cuBLASLt INT8 product holds in scratch: 128 MiB.
const CHUNK_SUMS: usize = 32 << 20;

/// `(stochastic, seed)` of a rounding, as the kernels take it.
fn rounding_args(rounding: Int8Rounding) -> (bool, u64) {
    match rounding {
        Int8Rounding::Nearest => (false, 0),
        Int8Rounding::Stochastic { seed } => (true, seed),
    }
}

impl Int8Ops for Cuda {
    fn quantize_i8(
        &self, q: &Tensor<Cuda>, descale: &Tensor<Cuda>, x: &Tensor<Cuda>, layout: Int8Layout,
        rounding: Int8Rounding,
    ) -> Result<()> {
        let (rows, cols) = (x.matrix_rows(), x.cols());
        let shape = layout.codes_shape(rows, cols);
        ensure_dtype(q, DType::I8, "quantize_i8 (codes)")?;
        ensure_dtype(descale, DType::F32, "quantize_i8 (descale)")?;
        ensure!(
            q.numel() == rows * cols
                && (q.shape.len() != 2 || q.shape == shape)
                && descale.numel() == shape[0]
                && i32::try_from(rows.max(cols)).is_ok(),
            "quantize_i8: x {:?} ({layout:?}) into {:?} with descale {:?}",
            x.shape,
            q.shape,
            descale.shape
        );
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        let name = || format!("quantize_i8 {rows}×{cols} {layout:?}").to_lowercase();
        let _timing = self.time_op_named(name)?;
        let (stochastic, seed) = rounding_args(rounding);
        match layout {
            Int8Layout::Rows => {
                // 8 values a thread at a time where every row is 16-byte aligned in x and
                // 8-byte aligned in q; a block per row, of as many warps as its units need
                // (up to BLOCK threads).
                let vec =
                    cols.is_multiple_of(8) && ptr(x).is_multiple_of(16) && ptr(q).is_multiple_of(8);
                let units = if vec { cols / 8 } else { cols };
                let threads = units.next_multiple_of(32).clamp(32, BLOCK as usize) as u32;
                // SAFETY: quantize_i8_rows<T, SR, VEC>(q, descale, x, cols, seed): block r
                // reads row r of x ([rows, cols]) and writes row r of q and descale[r].
                unsafe {
                    self.launch(
                        Kernel::QuantizeI8Rows,
                        &[float(x), Arg::Flag(stochastic), Arg::Flag(vec)],
                        (rows as u32, 1, 1),
                        threads,
                        &[
                            ptr(q).into(),
                            ptr(descale).into(),
                            ptr(x).into(),
                            (cols as i32).into(),
                            seed.into(),
                        ],
                    )
                }
            }
            Int8Layout::Cols => {
                let amax = self.scratch_f32(cols)?;
                // SAFETY: fill<float>(dst, n, value) writes the cols floats of scratch.
                unsafe {
                    self.launch(
                        Kernel::Fill,
                        &[Arg::Float(DType::F32)],
                        (blocks(cols, BLOCK as usize), 1, 1),
                        BLOCK,
                        &[amax.into(), (cols as i64).into(), 0.0f32.into()],
                    )?;
                }
                // 16-byte reads of x where its rows allow, 4-byte writes of q where its rows do.
                let vec = cols.is_multiple_of(8)
                    && rows.is_multiple_of(4)
                    && ptr(x).is_multiple_of(16)
                    && ptr(q).is_multiple_of(4);
                let per_thread = if vec { 8 } else { 1 };
                let threads = INT8_AMAX_THREADS;
                // SAFETY: abs_max_cols<T, VEC>(amax, x, rows, cols): thread t of block (i, j)
                // reads columns [(i·threads + t)·W, +W) of rows [j·COL_ROWS, ..) of x and
                // raises amax there (cols floats of scratch).
                unsafe {
                    self.launch(
                        Kernel::AbsMaxCols,
                        &[float(x), Arg::Flag(vec)],
                        (
                            blocks(cols / per_thread, threads as usize),
                            blocks(rows, INT8_COL_ROWS),
                            1,
                        ),
                        threads,
                        &[
                            amax.into(),
                            ptr(x).into(),
                            (rows as i32).into(),
                            (cols as i32).into(),
                        ],
                    )?;
                }
                let tile = INT8_COL_TILE;
                // SAFETY: quantize_i8_cols<T, SR, VEC>(q, descale, x, amax, rows, cols, seed):
                // block (i, j) reads the tile of x at rows j·T.., columns i·T.. and writes its
                // transpose into q ([cols, rows]); the first row of blocks writes descale[c].
                unsafe {
                    self.launch(
                        Kernel::QuantizeI8Cols,
                        &[float(x), Arg::Flag(stochastic), Arg::Flag(vec)],
                        (blocks(cols, tile), blocks(rows, tile), 1),
                        INT8_COL_THREADS,
                        &[
                            ptr(q).into(),
                            ptr(descale).into(),
                            ptr(x).into(),
                            amax.into(),
                            (rows as i32).into(),
                            (cols as i32).into(),
                            seed.into(),
                        ],
                    )
                }
            }
        }
    }
}

impl Cuda {
    /// `out (+)= f32(a · bᵀ) · a.descale[row] · b.descale[column] (+ bias)`, INT8 operands
    /// that `check_int8_product` passed.
    pub(super) fn matmul_int8(
        &self, out: &Tensor<Cuda>, a: Operand<'_, Cuda>, b: Operand<'_, Cuda>,
        bias: Option<&Tensor<Cuda>>, accumulate: bool,
    ) -> Result<()> {
        let (m, n, k) = (a.data.matrix_rows(), b.data.matrix_rows(), a.data.cols());
        bf16_output(out, bias, n)?;
        let name = || format!("int8 {}", matmul_name(m, n, k));
        let _timing = self.time_op_named(name)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        if !accumulate && self.fuses_int8(&[out], a.data, b.data, bias) {
            return self.gemm_int8(out, a, b, bias);
        }
        self.matmul_int8_imma(out, a, b, bias, accumulate)
    }

    /// `matmul_int8` by cuBLASLt's int32 sums and `dequantize_i32`, a chunk of rows at a time.
    fn matmul_int8_imma(
        &self, out: &Tensor<Cuda>, a: Operand<'_, Cuda>, b: Operand<'_, Cuda>,
        bias: Option<&Tensor<Cuda>>, accumulate: bool,
    ) -> Result<()> {
        let (m, n, k) = (a.data.matrix_rows(), b.data.matrix_rows(), a.data.cols());
        ensure!(
            [m, n, k].iter().all(|d| d.is_multiple_of(4)),
            "INT8 matmul: cuBLASLt's INT8 products need M, N and K to be multiples of 4, got \
             M={m}, N={n}, K={k}"
        );
        let (da, db) = (a.descale.expect("checked"), b.descale.expect("checked"));
        let chunk = (CHUNK_SUMS / n).max(256).next_multiple_of(256).min(m);
        let sums = self.memory.scratch(chunk * n * 4)?;
        for start in (0..m).step_by(chunk) {
            let end = (start + chunk).min(m);
            let rows = |t: &Tensor<Cuda>| t.narrow_rows(start, end);
            let (a_rows, a_descale, out_rows) = (rows(a.data), rows(da), rows(out));
            let ptrs = GemmPtrs {
                out: sums,
                a: ptr(&a_rows),
                b: ptr(b.data),
                bias: None,
                descales: None,
            };
            let key = GemmKey {
                m: end - start,
                n,
                k,
                trans_a: false,
                trans_b: true,
                dtypes: [DType::I8, DType::I8, DType::I32],
                bias: false,
                align: ptrs.alignments(),
                fast_accum: false,
            };
            self.blas.gemm(key, &ptrs, false)?;
            let count = (end - start) * n;
            // SAFETY: dequantize_i32<T, BIAS, ACC>(out, acc, da, db, bias, rows, n): thread i
            // reads sums[i] (count int32s of scratch, just written), a's descale of its row,
            // b's of its column and the bias there, and writes (after reading) out[i].
            unsafe {
                self.launch(
                    Kernel::DequantizeI32,
                    &[float(out), Arg::Flag(bias.is_some()), Arg::Flag(accumulate)],
                    (blocks(count, BLOCK as usize), 1, 1),
                    BLOCK,
                    &[
                        ptr(&out_rows).into(),
                        sums.into(),
                        ptr(&a_descale).into(),
                        ptr(db).into(),
                        bias.map_or(0, ptr).into(),
                        ((end - start) as i64).into(),
                        (n as i32).into(),
                    ],
                )?;
            }
        }
        Ok(())
    }
}

/// What the GPU's INT8 products add to `check_int8_product`: they write bf16, with a bf16
/// bias.
fn bf16_output(out: &Tensor<Cuda>, bias: Option<&Tensor<Cuda>>, n: usize) -> Result<()> {
    ensure!(
        out.dtype == DType::BF16 && bias.is_none_or(|t| t.numel() == n && t.dtype == DType::BF16),
        "INT8 matmul: into {:?} {}{}: INT8 products write bf16, with a bf16 bias of N = {n}",
        out.shape,
        out.dtype,
        bias.map_or(String::new(), |t| format!(
            " + bias {:?} {}",
            t.shape, t.dtype
        ))
    );
    Ok(())
}
