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

/// The ring of shared buffers the producer fills ahead of the products, in the cooperative
/// schedule: 48 KB each (ping-pong: one more, of 40 KB).
pub(super) const STAGES: usize = 3;
/// A producer warpgroup and two consumers.
pub(super) const THREADS: u32 = 384;
/// Blocks of a cluster, which share their B tiles (gemm.cu's `__cluster_dims__`).
const CLUSTER: u32 = 2;
/// The cooperative schedule's tile rows, and the rows of one box of B.
const BOX_ROWS: u32 = 128;
/// One 128-byte line of bf16: the k-block, and the 128-byte swizzle's width.
const BOX_COLS: u32 = 64;
/// Rows of an output box: a consumer warpgroup's.
const OUT_BOX_ROWS: u32 = 64;
/// The epilogue's ring of 16 KB pieces, per consumer warpgroup.
pub(super) const EPI_BUFS: usize = 2;
const PIECE_BYTES: u32 = 64 * 128 * 2;

/// The operands' maps, boxes of 64 columns (one 128-byte swizzled line) by 128 rows.
fn operand_map(t: &Tensor<Cuda>, box_rows: u32) -> Result<TensorMap> {
    let (rows, cols) = (t.matrix_rows() as u64, t.cols() as u64);
    TensorMap::bf16_swizzled(ptr(t), [cols, rows], &[cols * 2], [BOX_COLS, box_rows])
}

/// An output's map, boxes of 64 x 64: `[rows, cols]`, or with `halves` `[rows, 2, cols / 2]`
/// (SwiGLU's gate/up, whose gate boxes must not spill into the up columns).
fn output_map(t: &Tensor<Cuda>, halves: bool) -> Result<TensorMap> {
    let (rows, cols) = (t.matrix_rows() as u64, t.cols() as u64);
    if halves {
        TensorMap::bf16_swizzled(
            ptr(t),
            [cols / 2, 2, rows],
            &[cols, cols * 2],
            [BOX_COLS, 1, OUT_BOX_ROWS],
        )
    } else {
        TensorMap::bf16_swizzled(ptr(t), [cols, rows], &[cols * 2], [BOX_COLS, OUT_BOX_ROWS])
    }
}

/// Whether the kernel takes these operands: bf16, each starting 16-byte aligned (TMA's
/// addresses and the epilogue's pairs), rows a whole number of 16 bytes (TMA's strides).
fn fits(tensors: &[&Tensor<Cuda>]) -> bool {
    tensors
        .iter()
        .all(|t| t.dtype == DType::BF16 && ptr(t).is_multiple_of(16) && t.cols().is_multiple_of(8))
}

/// Whether a matmul over `k` runs the ping-pong schedule (gemm.cu): where its epilogue takes
/// about as long as its products. On an H100, SwiGLU's backward took 0.684 against 0.80 ms at
/// 0.5B's shape (K = 896), 0.901 against 0.95 at 1.5B's (1536) and 0.756 against 0.72 at 3B's
/// (2048); the fused forward about the same at 0.5B's (0.964 against 0.971; in the 0.5B step,
/// both ping-pong gave 202.7-203.4 ms against 204.6-204.7 with only the backward) and slower
/// above. The cooperative schedule's plain matmul runs 720-750 TFLOP/s against ping-pong's
/// 580-620, and not for its smaller L2 reads: clusters of four, which cut ping-pong's L2
/// reads to the cooperative's, were slower (docs/performance.md). `SMELT_GEMM_PINGPONG=1` or
/// `0` overrides (`Cuda::gemm_pingpong`).
fn pingpong_by_k(dswiglu: bool, k: usize) -> bool {
    k <= 1024 || (dswiglu && k <= 1536)
}

/// Rows of an A box: a block's tile in the schedule.
fn a_rows(pingpong: bool) -> u32 {
    if pingpong { 64 } else { BOX_ROWS }
}

/// Whether `SMELT_GEMM` leaves smelt's own matmul on: unset or `own`, yes; `cublaslt`, no.
pub(super) fn own_gemm_from_env() -> Result<bool> {
    match std::env::var("SMELT_GEMM").ok().as_deref() {
        None | Some("own") => Ok(true),
        Some("cublaslt") => Ok(false),
        Some(other) => bail!("SMELT_GEMM={other}: set it to own or cublaslt"),
    }
}

/// `SMELT_GEMM_PINGPONG`: `1` or `0` forces the ping-pong or the cooperative schedule on
/// every call; unset, each call's K chooses.
pub(super) fn pingpong_from_env() -> Result<Option<bool>> {
    match std::env::var("SMELT_GEMM_PINGPONG").ok().as_deref() {
        None => Ok(None),
        Some("1") => Ok(Some(true)),
        Some("0") => Ok(Some(false)),
        Some(other) => bail!("SMELT_GEMM_PINGPONG={other}: set it to 1 or 0, or leave it unset"),
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

    /// Whether a matmul over `k` (with SwiGLU's backward in its epilogue: `dswiglu`) runs the
    /// ping-pong schedule.
    fn pingpong(&self, dswiglu: bool, k: usize) -> bool {
        self.gemm_pingpong
            .unwrap_or_else(|| pingpong_by_k(dswiglu, k))
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
        let pingpong = self.pingpong(false, k);
        let maps = TensorMaps4([
            operand_map(a, a_rows(pingpong))?,
            operand_map(b, BOX_ROWS)?,
            output_map(out, swiglu.is_some())?,
            swiglu.map_or_else(|| Ok(TensorMap::unused()), |h| output_map(h, false))?,
        ]);
        // A tile is 128 rows by 256 columns, or for SwiGLU 128 gate and 128 up columns.
        let (span, flags) = if swiglu.is_some() {
            (n / 2, [true, false])
        } else {
            (n, [false, false])
        };
        // SAFETY: the maps describe a, b, out and swiglu, [m, k], [n, k], [m, n] and
        // [m, n / 2] (checked above), every one 16-byte aligned (`fits`).
        unsafe { self.launch_gemm(maps, [flags[0], flags[1], pingpong], (m, span, k), n) }
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
        let pingpong = self.pingpong(true, k);
        let maps = TensorMaps4([
            operand_map(dy, a_rows(pingpong))?,
            // w as [K, N], N contiguous: boxes of 64 columns by 64 rows of K.
            TensorMap::bf16_swizzled(
                ptr(w),
                [f as u64, k as u64],
                &[f as u64 * 2],
                [BOX_COLS, BOX_COLS],
            )?,
            output_map(gate_up, true)?,
            TensorMap::unused(),
        ]);
        // SAFETY: as in `gemm`, with w [k, f] and gate_up [m, 2f] (checked above).
        unsafe { self.launch_gemm(maps, [false, true, pingpong], (m, f, k), f) }
    }

    /// Launches `gemm_tn<flags>` over `tiles` = (rows, columns, K) (its columns: the output's,
    /// or for SwiGLU the gate's) with N = `n`.
    ///
    /// # Safety
    /// The maps must describe live tensors of the shapes the kernel reads and writes.
    unsafe fn launch_gemm(
        &self,
        maps: TensorMaps4,
        flags: [bool; 3],
        (m, span, k): (usize, usize, usize),
        n: usize,
    ) -> Result<()> {
        ensure!(
            [m, n, k].iter().all(|&d| i32::try_from(d).is_ok()),
            "gemm: {m} x {n} x {k} past the kernel's 32-bit indices"
        );
        let tile_cols = if flags[0] { 128 } else { 256 };
        let pingpong = flags[2];
        let (stages, rows) = if pingpong {
            (STAGES as u32 + 1, 64)
        } else {
            (STAGES as u32, 128)
        };
        // A cluster takes two tiles, one above the other, at a time. As many clusters as fit
        // at once walk them all.
        let pairs = m.div_ceil(CLUSTER as usize * rows as usize) * span.div_ceil(tile_cols);
        let smem = stages * (rows + 256) * 64 * 2
            + 2 * EPI_BUFS as u32 * PIECE_BYTES
            + (2 * stages + 6) * 8;
        let targs = [
            Arg::Flag(flags[0]),
            Arg::Flag(flags[1]),
            Arg::Flag(pingpong),
        ];
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
