//! smelt's own Hopper matmul (kernels/gemm_tn.cu): TMA copies, wgmma products and epilogues of
//! our choosing, which cuBLASLt does not have. It runs the MLP's gate/up projection with
//! SwiGLU in its epilogue, and the down projection's input gradient with SwiGLU's backward in
//! its (each in bf16, or in FP8 with the abs-max of what FP8 quantizes next), so that neither
//! SwiGLU pass reads its input back from memory. The plain variants are there to measure its
//! main loop against cuBLASLt's. `SMELT_GEMM=cublaslt` runs cuBLASLt and the separate SwiGLU
//! kernels instead (on an H100, the same bits, slower).

use anyhow::{Result, bail, ensure};

use super::fp8::descale_ptr;
use super::kernels::{Arg, GEMM_EPI_BUFS, GEMM_STAGES, GEMM_THREADS, GemmKind, KArg, Kernel};
use super::tma::{TensorMap, TensorMaps4};
use super::{Cuda, amax_ptr, ptr};
use crate::backend::Operand;
use crate::tensor::{DType, Tensor};

/// Blocks of a cluster, which share their B tiles (gemm_tn.cu's `__cluster_dims__`).
const CLUSTER: u32 = 2;
/// A tile's rows and columns (a consumer warpgroup's, in turns).
const TILE_ROWS: u32 = 128;
const TILE_COLS: u32 = 192;
/// A k-block's row: one line of the 128-byte swizzle.
const LINE_BYTES: u32 = 128;
/// One line of bf16.
const LINE: u32 = LINE_BYTES / 2;
/// An output box: 64 rows of 32 columns (64 bytes, so in the 64-byte swizzle), three to half a
/// tile's row.
const OUT_BOX: [u32; 2] = [32, 64];
const PIECE_BYTES: u32 = 64 * 64 * 2 * 2;

/// An operand's map, `[rows, cols]` K-major in boxes of one 128-byte swizzled line (64 bf16
/// or 128 FP8) by `box_rows`.
fn operand_map(t: &Tensor<Cuda>, box_rows: u32) -> Result<TensorMap> {
    let (rows, cols, size) = (
        t.matrix_rows() as u64,
        t.cols() as u64,
        t.dtype.size_bytes(),
    );
    let line = LINE_BYTES / size as u32;
    TensorMap::swizzled(
        ptr(t),
        t.dtype,
        [cols, rows],
        &[cols * size as u64],
        [line, box_rows],
    )
}

/// An output's map in boxes of `boxes` (columns, rows): `[rows, cols]`, or with `halves`
/// `[rows, 2, cols / 2]` (SwiGLU's gate/up, whose gate boxes must not spill into the up
/// columns).
fn output_map(t: &Tensor<Cuda>, halves: bool, [box_cols, box_rows]: [u32; 2]) -> Result<TensorMap> {
    let (rows, cols) = (t.matrix_rows() as u64, t.cols() as u64);
    if halves {
        TensorMap::swizzled(
            ptr(t),
            DType::BF16,
            [cols / 2, 2, rows],
            &[cols, cols * 2],
            [box_cols, 1, box_rows],
        )
    } else {
        TensorMap::swizzled(
            ptr(t),
            DType::BF16,
            [cols, rows],
            &[cols * 2],
            [box_cols, box_rows],
        )
    }
}

/// Whether the kernel takes these tensors as `dtype`: each starting 16-byte aligned (TMA's
/// addresses and the epilogue's pairs), rows a whole number of 16 bytes (TMA's strides).
fn fits(dtype: DType, tensors: &[&Tensor<Cuda>]) -> bool {
    tensors.iter().all(|t| {
        t.dtype == dtype
            && ptr(t).is_multiple_of(16)
            && (t.cols() * dtype.size_bytes()).is_multiple_of(16)
    })
}

/// The scaled operands' descales (FP8: one each; INT8: one per row of each), where FP8's
/// SwiGLU output reports its abs-max, and INT8's bias.
struct Scales {
    a: u64,
    b: u64,
    amax: u64,
    bias: u64,
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

    /// Whether an MLP op fused by one kernel of ours runs on these bf16 operands.
    pub(super) fn fuses(&self, operands: &[&Tensor<Cuda>]) -> bool {
        self.own_gemm() && fits(DType::BF16, operands)
    }

    /// Whether an FP8 MLP op fused by one kernel of ours runs on these operands: bf16 outputs,
    /// `a` in `a_dtype` (the forward's e4m3, or the gradient's format) and `b` e4m3.
    pub(super) fn fuses_fp8(
        &self, outputs: &[&Tensor<Cuda>], (a, a_dtype): (&Tensor<Cuda>, DType), b: &Tensor<Cuda>,
    ) -> bool {
        self.own_gemm()
            && a_dtype.is_fp8()
            && fits(DType::BF16, outputs)
            && fits(a_dtype, &[a])
            && fits(DType::E4M3, &[b])
    }

    /// `out = a · bᵀ` by smelt's own kernel (Hopper only), for measuring it against cuBLASLt.
    pub fn own_matmul(&self, out: &Tensor<Cuda>, a: &Tensor<Cuda>, b: &Tensor<Cuda>) -> Result<()> {
        ensure!(
            self.compute_capability.0 == 9 && fits(DType::BF16, &[out, a, b]),
            "own_matmul: needs a Hopper GPU and 16-byte aligned bf16 operands with rows of a \
             multiple of 8"
        );
        let _timing = self.time_op("own_matmul")?;
        self.gemm(out, None, a, b)
    }

    /// `out = (a · a.descale)(b · b.descale)ᵀ` by smelt's own kernel, a and b scaled e4m3,
    /// for measuring it against cuBLASLt.
    pub fn own_matmul_scaled(
        &self, out: &Tensor<Cuda>, a: Operand<'_, Cuda>, b: Operand<'_, Cuda>,
    ) -> Result<()> {
        ensure!(
            self.compute_capability.0 == 9
                && fits(DType::BF16, &[out])
                && fits(DType::E4M3, &[a.data, b.data]),
            "own_matmul_scaled: needs a Hopper GPU, e4m3 operands and a bf16 output, 16-byte \
             aligned, with rows of a multiple of 16 bytes"
        );
        let _timing = self.time_op("own_matmul_scaled")?;
        self.gemm_scaled(out, None, a, b, None)
    }

    /// `out = (x · x.descale)(w · w.descale)ᵀ` (x and w scaled e4m3), and with `swiglu` also
    /// `swiglu = SwiGLU(out)`, its abs-max into `amax` where given.
    pub(super) fn gemm_scaled(
        &self, out: &Tensor<Cuda>, swiglu: Option<&Tensor<Cuda>>, x: Operand<'_, Cuda>,
        w: Operand<'_, Cuda>, amax: Option<&Tensor<Cuda>>,
    ) -> Result<()> {
        let scales = Scales {
            a: descale_ptr("gemm", &x)?,
            b: descale_ptr("gemm", &w)?,
            amax: amax_ptr("gate_up_swiglu", amax)?,
            bias: 0,
        };
        self.gemm_tn(out, swiglu, x.data, w.data, Some(scales))
    }

    /// Whether an INT8 product runs in our kernel on these operands: bf16 output and bias,
    /// int8 codes, 16-byte aligned with rows of a multiple of 16 bytes.
    pub(super) fn fuses_int8(
        &self, outputs: &[&Tensor<Cuda>], a: &Tensor<Cuda>, b: &Tensor<Cuda>,
        bias: Option<&Tensor<Cuda>>,
    ) -> bool {
        self.own_gemm()
            && fits(DType::BF16, outputs)
            && fits(DType::I8, &[a, b])
            && bias.is_none_or(|t| fits(DType::BF16, &[t]))
    }

    /// `out = f32(x · wᵀ) · x.descale[row] · w.descale[column] (+ bias)` of INT8 operands by
    /// smelt's own kernel. The caller has checked the operands (`matmul_int8`, `fuses_int8`).
    pub(super) fn gemm_int8(
        &self, out: &Tensor<Cuda>, x: Operand<'_, Cuda>, w: Operand<'_, Cuda>,
        bias: Option<&Tensor<Cuda>>,
    ) -> Result<()> {
        let descale = |o: &Operand<'_, Cuda>| o.descale.map_or(0, ptr);
        let scales = Scales {
            a: descale(&x),
            b: descale(&w),
            amax: 0,
            bias: bias.map_or(0, ptr),
        };
        self.gemm_tn(out, None, x.data, w.data, Some(scales))
    }

    /// `out = a · bᵀ` (bf16), and with `swiglu` also `swiglu = SwiGLU(out)`.
    pub(super) fn gemm(
        &self, out: &Tensor<Cuda>, swiglu: Option<&Tensor<Cuda>>, a: &Tensor<Cuda>,
        b: &Tensor<Cuda>,
    ) -> Result<()> {
        self.gemm_tn(out, swiglu, a, b, None)
    }

    /// `gemm`, in bf16, or FP8 with `scales`.
    fn gemm_tn(
        &self, out: &Tensor<Cuda>, swiglu: Option<&Tensor<Cuda>>, a: &Tensor<Cuda>,
        b: &Tensor<Cuda>, scales: Option<Scales>,
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
            swiglu.map_or_else(
                || Ok(TensorMap::unused()),
                |h| output_map(h, false, OUT_BOX),
            )?,
        ]);
        // A tile is 128 rows by 192 columns, or for SwiGLU 96 gate and 96 up columns.
        let span = if swiglu.is_some() { n / 2 } else { n };
        let int8 = a.dtype == DType::I8;
        let kind = match (scales.is_some(), int8, swiglu.is_some()) {
            (false, _, false) => GemmKind::Plain,
            (false, _, true) => GemmKind::SwiGlu,
            (true, false, false) => GemmKind::Fp8Plain,
            (true, false, true) => GemmKind::Fp8SwiGlu,
            (true, true, false) => GemmKind::Int8Plain,
            (true, true, true) => bail!("gemm: INT8 has no SwiGLU epilogue"),
        };
        // SAFETY: the maps describe a, b, out and swiglu, [m, k], [n, k], [m, n] and
        // [m, n / 2] (checked above), every one 16-byte aligned (`fits`); FP8's scales point at
        // one f32 each (`descale_ptr`, `amax_ptr`), INT8's at one per row of a and of b, and
        // its bias at n values (`matmul_int8`).
        unsafe { self.launch_gemm(maps, kind, (m, span, k), n, scales) }
    }

    /// SwiGLU's backward through the down projection, in one kernel of ours: `dh = dy · w`
    /// (`w` the down weight `[H, F]`, dy `[N, H]`) is never stored; the epilogue reads gate/up
    /// (`[N, 2F]`) and overwrites it with its gradient, as `swiglu_backward` would from dh.
    /// The caller has checked that the kernel runs on these operands (`fuses`), as for
    /// `gemm` and the FP8 ops.
    pub(super) fn fused_swiglu_backward(
        &self, gate_up: &Tensor<Cuda>, dy: &Tensor<Cuda>, w: &Tensor<Cuda>,
    ) -> Result<()> {
        let (k, f) = (dy.cols(), w.cols());
        ensure!(
            w.matrix_rows() == k,
            "fused_swiglu_backward: dy {:?}, w {:?}",
            dy.shape,
            w.shape
        );
        // w as [K, N], N contiguous: boxes of 64 columns by 32 rows of K, each block of a
        // cluster copying half of every k-block's rows.
        let w_map = TensorMap::swizzled(
            ptr(w),
            DType::BF16,
            [f as u64, k as u64],
            &[f as u64 * 2],
            [LINE, LINE / 2],
        )?;
        // SAFETY: w_map describes w, [k, f] (checked above).
        unsafe { self.launch_dswiglu(gate_up, dy, (w_map, f), GemmKind::DSwiGlu, None) }
    }

    /// `fused_swiglu_backward` in FP8: `dh = (dy · dy.descale)(w · w.descale)ᵀ`, dy `[N, H]` in
    /// the gradient's format and w the down weight's transposed e4m3 copy `[F, H]`, summed in
    /// the tensor cores' own accumulator (`Fp8Sum::Fast`); gate/up's gradient's abs-max into
    /// `amax` where given, as `swiglu_backward` reports it.
    pub(super) fn fused_swiglu_backward_scaled(
        &self, gate_up: &Tensor<Cuda>, dy: Operand<'_, Cuda>, w: Operand<'_, Cuda>,
        amax: Option<&Tensor<Cuda>>,
    ) -> Result<()> {
        let (k, f) = (dy.data.cols(), w.data.matrix_rows());
        ensure!(
            w.data.cols() == k,
            "fused_swiglu_backward_scaled: dy {:?}, w {:?}",
            dy.data.shape,
            w.data.shape
        );
        let scales = Scales {
            a: descale_ptr("fused_swiglu_backward_scaled", &dy)?,
            b: descale_ptr("fused_swiglu_backward_scaled", &w)?,
            amax: amax_ptr("swiglu_backward_through_down", amax)?,
            bias: 0,
        };
        let kind = GemmKind::Fp8DSwiGlu(dy.data.dtype);
        let w_map = operand_map(w.data, TILE_COLS / 2)?;
        // SAFETY: w_map describes w, [f, k] (checked above).
        unsafe { self.launch_dswiglu(gate_up, dy.data, (w_map, f), kind, Some(scales)) }
    }

    /// Launches SwiGLU's backward through the down projection, of width `f`, on dy and the
    /// weight's map `w_map`.
    ///
    /// # Safety
    /// `w_map` must describe a live weight of `f` by dy's columns, in the layout `kind` reads.
    unsafe fn launch_dswiglu(
        &self, gate_up: &Tensor<Cuda>, dy: &Tensor<Cuda>, (w_map, f): (TensorMap, usize),
        kind: GemmKind, scales: Option<Scales>,
    ) -> Result<()> {
        let (m, k) = (dy.matrix_rows(), dy.cols());
        ensure!(
            gate_up.cols() == 2 * f && gate_up.numel() == m * 2 * f && f.is_multiple_of(8),
            "SwiGLU's backward: gate/up {:?} for dy {:?} and a width of {f}",
            gate_up.shape,
            dy.shape
        );
        let maps = TensorMaps4([
            operand_map(dy, TILE_ROWS)?,
            w_map,
            // Read and written in pieces of 64 x 64 from each half.
            output_map(gate_up, true, [LINE, 64])?,
            TensorMap::unused(),
        ]);
        // SAFETY: as in `gemm`, with gate_up [m, 2f] (checked above) and the caller's w_map.
        unsafe { self.launch_gemm(maps, kind, (m, f, k), f, scales) }
    }

    /// Launches `gemm_tn<kind>` over `tiles` = (rows, columns, K) (its columns: the output's,
    /// or for SwiGLU the gate's) with N = `n`.
    ///
    /// # Safety
    /// The maps must describe live tensors of the shapes the kernel reads and writes.
    unsafe fn launch_gemm(
        &self, maps: TensorMaps4, kind: GemmKind, (m, span, k): (usize, usize, usize), n: usize,
        scales: Option<Scales>,
    ) -> Result<()> {
        ensure!(
            [m, n, k].iter().all(|&d| i32::try_from(d).is_ok()),
            "gemm: {m} x {n} x {k} past the kernel's 32-bit indices"
        );
        let swiglu = matches!(kind, GemmKind::SwiGlu | GemmKind::Fp8SwiGlu);
        let tile_cols = if swiglu { TILE_COLS / 2 } else { TILE_COLS };
        // A cluster takes two tiles, one above the other, at a time. As many clusters as fit
        // at once walk them all.
        let pairs = m.div_ceil((CLUSTER * TILE_ROWS) as usize) * span.div_ceil(tile_cols as usize);
        let smem = GEMM_STAGES as u32 * (TILE_ROWS + TILE_COLS) * LINE * 2
            + 2 * GEMM_EPI_BUFS as u32 * PIECE_BYTES
            // mbarriers: full and empty for each stage, and gemm_tn.cu's ready and written (one
            // each per epilogue buffer) and order (2)
            + (2 * GEMM_STAGES as u32 + 4 * GEMM_EPI_BUFS as u32 + 2) * 8;
        let targs = [Arg::Gemm(kind)];
        let inst = Kernel::GemmTn.instance(&targs)?;
        let resident =
            self.kernels
                .resident_clusters(&self.stream, &inst, (CLUSTER, GEMM_THREADS, smem))?;
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
            scales.as_ref().map_or(0, |s| s.a).into(),
            scales.as_ref().map_or(0, |s| s.b).into(),
            scales.as_ref().map_or(0, |s| s.amax).into(),
            scales.as_ref().map_or(0, |s| s.bias).into(),
        ];
        // SAFETY: the caller's maps; smem is the ring, the epilogue's buffers and the barriers.
        unsafe {
            self.launch_with_smem(
                Kernel::GemmTn,
                &targs,
                (grid, 1, 1),
                GEMM_THREADS,
                smem,
                &args,
            )
        }
    }
}
