//! smelt's own Hopper matmul (kernels/gemm.cu): TMA copies, wgmma products and epilogues of
//! our choosing, which cuBLASLt does not have. It runs the MLP's gate/up projection with
//! SwiGLU in its epilogue, and the down projection's input gradient with SwiGLU's backward in
//! its, so that neither SwiGLU pass reads its input back from memory. The plain variant is
//! there to measure its main loop against cuBLASLt's. `SMELT_GEMM=cublaslt` runs cuBLASLt and
//! the separate SwiGLU kernels instead (the same bits, slower).

use anyhow::{Result, bail, ensure};

use super::kernels::{Arg, KArg, Kernel};
use super::tma::{TensorMap, TensorMaps4};
use super::{Cuda, ptr};
use crate::tensor::{DType, Tensor};

/// The ring of shared buffers the producer fills ahead of the products, 40 KB each.
pub(super) const STAGES: usize = 4;
/// A producer warpgroup and two consumers.
pub(super) const THREADS: u32 = 384;
/// Blocks of a cluster, which share their B tiles (gemm.cu's `__cluster_dims__`).
const CLUSTER: u32 = 2;
/// A tile's rows and columns (a consumer warpgroup's, in turns).
const TILE_ROWS: u32 = 128;
const TILE_COLS: u32 = 192;
/// One 128-byte line of bf16: the k-block, and the 128-byte swizzle's width.
const LINE: u32 = 64;
/// An output box: 64 rows of 32 columns (64 bytes, so in the 64-byte swizzle), three to half a
/// tile's row.
const OUT_BOX: [u32; 2] = [32, 64];
/// The epilogue's ring of 16 KB pieces, per consumer warpgroup.
pub(super) const EPI_BUFS: usize = 2;
const PIECE_BYTES: u32 = 64 * 64 * 2 * 2;

/// An operand's map, `[rows, cols]` K-major in boxes of one 128-byte swizzled line by
/// `box_rows`.
fn operand_map(t: &Tensor<Cuda>, box_rows: u32) -> Result<TensorMap> {
    let (rows, cols) = (t.matrix_rows() as u64, t.cols() as u64);
    TensorMap::bf16_swizzled(ptr(t), [cols, rows], &[cols * 2], [LINE, box_rows])
}

/// An output's map in boxes of `boxes` (columns, rows): `[rows, cols]`, or with `halves`
/// `[rows, 2, cols / 2]` (SwiGLU's gate/up, whose gate boxes must not spill into the up
/// columns).
fn output_map(t: &Tensor<Cuda>, halves: bool, [box_cols, box_rows]: [u32; 2]) -> Result<TensorMap> {
    let (rows, cols) = (t.matrix_rows() as u64, t.cols() as u64);
    if halves {
        TensorMap::bf16_swizzled(
            ptr(t),
            [cols / 2, 2, rows],
            &[cols, cols * 2],
            [box_cols, 1, box_rows],
        )
    } else {
        TensorMap::bf16_swizzled(ptr(t), [cols, rows], &[cols * 2], [box_cols, box_rows])
    }
}

/// Whether the kernel takes these operands: bf16, each starting 16-byte aligned (TMA's
/// addresses and the epilogue's pairs), rows a whole number of 16 bytes (TMA's strides).
fn fits(tensors: &[&Tensor<Cuda>]) -> bool {
    tensors
        .iter()
        .all(|t| t.dtype == DType::BF16 && ptr(t).is_multiple_of(16) && t.cols().is_multiple_of(8))
}

/// Whether `SMELT_GEMM` leaves smelt's own matmul on: unset or `own`, yes; `cublaslt`, no.
pub(super) fn own_gemm_from_env() -> Result<bool> {
    match std::env::var("SMELT_GEMM").ok().as_deref() {
        None | Some("own") => Ok(true),
        Some("cublaslt") => Ok(false),
        Some(other) => bail!("SMELT_GEMM={other}: set it to own or cublaslt"),
    }
}

impl Cuda {
    /// Whether smelt's own matmul runs here (wgmma and TMA: Hopper) and is switched on.
    fn own_gemm(&self) -> bool {
        self.compute_capability.0 == 9 && self.own_gemm.get()
    }

    /// Switches smelt's own matmul on or off for the calls that follow, where the GPU has it
    /// (`SMELT_GEMM=cublaslt` starts with it off); tests compare the two.
    pub fn set_own_gemm(&self, on: bool) {
        self.own_gemm.set(on);
    }

    /// Whether an MLP op fused by one kernel of ours runs on these operands.
    pub(super) fn fuses(&self, operands: &[&Tensor<Cuda>]) -> bool {
        self.own_gemm() && fits(operands)
    }

    /// `out = a · bᵀ` by smelt's own kernel (Hopper only), for measuring it against cuBLASLt.
    pub fn own_matmul(&self, out: &Tensor<Cuda>, a: &Tensor<Cuda>, b: &Tensor<Cuda>) -> Result<()> {
        ensure!(
            self.compute_capability.0 == 9 && fits(&[out, a, b]),
            "own_matmul: needs a Hopper GPU and 16-byte aligned bf16 operands with rows of a \
             multiple of 8"
        );
        self.op("own_matmul", || self.gemm(out, None, a, b))
    }

    /// `out = a · bᵀ`, and with `swiglu` also `swiglu = SwiGLU(out)`.
    pub(super) fn gemm(
        &self,
        out: &Tensor<Cuda>,
        swiglu: Option<&Tensor<Cuda>>,
        a: &Tensor<Cuda>,
        b: &Tensor<Cuda>,
    ) -> Result<()> {
        let (m, k, n) = (a.matrix_rows(), a.cols(), b.matrix_rows());
        ensure!(
            b.cols() == k && out.numel() == m * n && out.cols() == n,
            "gemm: a {:?} · b {:?}ᵀ into {:?}",
            a.shape,
            b.shape,
            out.shape
        );
        if let Some(h) = swiglu {
            ensure!(
                h.cols() * 2 == n && h.numel() * 2 == out.numel(),
                "gemm: SwiGLU of {:?} into {:?}",
                out.shape,
                h.shape
            );
        }
        let maps = TensorMaps4([
            operand_map(a, TILE_ROWS)?,
            // Each block of a cluster copies half of B's tile.
            operand_map(b, TILE_COLS / 2)?,
            output_map(out, swiglu.is_some(), OUT_BOX)?,
            swiglu.map_or_else(|| Ok(TensorMap::unused()), |h| output_map(h, false, OUT_BOX))?,
        ]);
        // A tile is 128 rows by 192 columns, or for SwiGLU 96 gate and 96 up columns.
        let (span, flags) = if swiglu.is_some() {
            (n / 2, [true, false])
        } else {
            (n, [false, false])
        };
        // SAFETY: the maps describe a, b, out and swiglu, [m, k], [n, k], [m, n] and
        // [m, n / 2] (checked above), every one 16-byte aligned (`fits`).
        unsafe { self.launch_gemm(maps, flags, (m, span, k), n) }
    }

    /// SwiGLU's backward through the down projection, in one kernel of ours: `dh = dy · w`
    /// (`w` the down weight `[H, F]`, dy `[N, H]`) is never stored; the epilogue reads gate/up
    /// (`[N, 2F]`) and overwrites it with its gradient, as `swiglu_backward` would from dh.
    pub(super) fn fused_swiglu_backward(
        &self,
        gate_up: &Tensor<Cuda>,
        dy: &Tensor<Cuda>,
        w: &Tensor<Cuda>,
    ) -> Result<()> {
        let (m, k, f) = (dy.matrix_rows(), dy.cols(), w.cols());
        ensure!(
            self.compute_capability.0 == 9
                && fits(&[gate_up, dy, w])
                && w.matrix_rows() == k
                && gate_up.cols() == 2 * f
                && gate_up.numel() == m * 2 * f
                && f.is_multiple_of(8),
            "fused_swiglu_backward: dy {:?}, w {:?}, gate_up {:?}",
            dy.shape,
            w.shape,
            gate_up.shape
        );
        let maps = TensorMaps4([
            operand_map(dy, TILE_ROWS)?,
            // w as [K, N], N contiguous: boxes of 64 columns by 32 rows of K, each block of a
            // cluster copying half of every k-block's rows.
            TensorMap::bf16_swizzled(
                ptr(w),
                [f as u64, k as u64],
                &[f as u64 * 2],
                [LINE, LINE / 2],
            )?,
            // Read and written in pieces of 64 x 64 from each half.
            output_map(gate_up, true, [LINE, 64])?,
            TensorMap::unused(),
        ]);
        // SAFETY: as in `gemm`, with w [k, f] and gate_up [m, 2f] (checked above).
        unsafe { self.launch_gemm(maps, [false, true], (m, f, k), f) }
    }

    /// Launches `gemm_tn<flags>` over `tiles` = (rows, columns, K) (its columns: the output's,
    /// or for SwiGLU the gate's) with N = `n`.
    ///
    /// # Safety
    /// The maps must describe live tensors of the shapes the kernel reads and writes.
    unsafe fn launch_gemm(
        &self,
        maps: TensorMaps4,
        flags: [bool; 2],
        (m, span, k): (usize, usize, usize),
        n: usize,
    ) -> Result<()> {
        ensure!(
            [m, n, k].iter().all(|&d| i32::try_from(d).is_ok()),
            "gemm: {m} x {n} x {k} past the kernel's 32-bit indices"
        );
        let tile_cols = if flags[0] { TILE_COLS / 2 } else { TILE_COLS };
        // A cluster takes two tiles, one above the other, at a time. As many clusters as fit
        // at once walk them all.
        let pairs = m.div_ceil((CLUSTER * TILE_ROWS) as usize) * span.div_ceil(tile_cols as usize);
        let smem = STAGES as u32 * (TILE_ROWS + TILE_COLS) * LINE * 2
            + 2 * EPI_BUFS as u32 * PIECE_BYTES
            + (2 * STAGES as u32 + 6) * 8;
        let targs = [Arg::Flag(flags[0]), Arg::Flag(flags[1])];
        let inst = Kernel::GemmTn.instance(&targs)?;
        let resident =
            self.kernels
                .resident_clusters(&self.stream, &inst, (CLUSTER, THREADS, smem))?;
        ensure!(
            resident > 0,
            "gemm: no cluster of two blocks fits on this GPU"
        );
        let grid = CLUSTER * pairs.min(resident as usize) as u32;
        let args = [
            KArg::Maps4(Box::new(maps)),
            (m as i32).into(),
            (n as i32).into(),
            (k as i32).into(),
        ];
        // SAFETY: the caller's maps; smem is the ring, the epilogue's buffers and the barriers.
        unsafe { self.launch_with_smem(Kernel::GemmTn, &targs, (grid, 1, 1), THREADS, smem, &args) }
    }
}
