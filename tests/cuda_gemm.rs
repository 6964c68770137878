//! smelt's own Hopper matmul (gemm_tn.cu) against the CPU at an awkward small shape and against
//! cuBLASLt at the MLP shapes of the benchmark's models, and both timed there. The fused
//! gate/up projection with SwiGLU must give what the separate matmul and SwiGLU kernels give
//! within bf16 rounding, and its SwiGLU output must be, bit for bit, what swiglu.cu computes
//! from its gate/up output. The down projection's input gradient with SwiGLU's backward must
//! give what cuBLASLt's matmul and swiglu.cu's backward give, within bf16 rounding (on an H100
//! it gave the same bits). The FP8 gate/up projection with SwiGLU (e4m3 operands) must give
//! what cuBLASLt's FP8 matmul and swiglu.cu give, SwiGLU's abs-max included, within bf16
//! rounding; so must the FP8 input gradient with SwiGLU's backward (dy e5m2 or e4m3), against
//! cuBLASLt's fast accumulation. The awkward shapes leave partial tiles in every dimension.
//! One row's gate/up with SwiGLU (gemv.cu, as generation runs it) must give the CPU's within
//! bf16 rounding, and its SwiGLU swiglu.cu's bits.

mod common;

use common::gpu::*;
use smelt::backend::cpu::Cpu;
use smelt::backend::cuda::Cuda;
use smelt::backend::prelude::*;
use smelt::backend::{Matmul, Operand};
use smelt::tensor::{DType, Tensor};

/// An MLP's operands: x [m, k] and w [2f, k], in bf16 or, with `fp8`, in e4m3 with the
/// descales that undo their 16-fold values (e4m3's precision is relative, and its range wide);
/// once descaled, x of std 1 and w of std 1/√k either way, so that gate/up values have std ~1,
/// where SwiGLU is far from linear. The outputs: gate/up [m, 2f], SwiGLU [m, f] and, in FP8,
/// SwiGLU's abs-max.
struct Mlp<B: Backend> {
    fp8: bool,
    x: Tensor<B>,
    w: Tensor<B>,
    /// x's and w's (1 in bf16).
    descales: [Tensor<B>; 2],
    gate_up: Tensor<B>,
    swiglu: Tensor<B>,
    amax: Tensor<B>,
}

impl<B: Backend> Mlp<B> {
    fn new(b: &B, (m, f, k): (usize, usize, usize), fp8: bool, seed: u64) -> Self {
        let zeros =
            |shape: &[usize]| tensor(b, shape, DType::BF16, &vec![0.0; shape.iter().product()]);
        let one = |t: f64| tensor(b, &[1], DType::F32, &[t as f32]);
        let w_std = 1.0 / (k as f64).sqrt();
        let (dtype, x_std, w_std, descales) = if fp8 {
            (
                DType::E4M3,
                16.0,
                16.0,
                [one(1.0 / 16.0), one(w_std / 16.0)],
            )
        } else {
            (DType::BF16, 1.0, w_std, [one(1.0), one(1.0)])
        };
        Mlp {
            fp8,
            x: tensor(b, &[m, k], dtype, &normal(m * k, x_std, seed)),
            w: tensor(b, &[2 * f, k], dtype, &normal(2 * f * k, w_std, seed + 1)),
            descales,
            gate_up: zeros(&[m, 2 * f]),
            swiglu: zeros(&[m, f]),
            amax: one(0.0),
        }
    }

    fn operands(&self) -> (Operand<'_, B>, Operand<'_, B>) {
        let [x_descale, w_descale] = &self.descales;
        (
            Operand::scaled(&self.x, x_descale),
            Operand::scaled(&self.w, w_descale),
        )
    }

    fn run_only(&self, b: &B) {
        if self.fp8 {
            let (x, w) = self.operands();
            b.fill(&self.amax, 0.0).unwrap();
            b.gate_up_swiglu(&self.gate_up, &self.swiglu, x, w, Some(&self.amax))
        } else {
            b.gate_up_swiglu(&self.gate_up, &self.swiglu, &self.x, &self.w, None)
        }
        .unwrap();
    }

    fn run(&self, b: &B) -> Outputs {
        self.run_only(b);
        let mut out = vec![
            ("gate_up", b.download(&self.gate_up).unwrap()),
            ("swiglu", b.download(&self.swiglu).unwrap()),
        ];
        if self.fp8 {
            out.push(("amax", b.download(&self.amax).unwrap()));
        }
        out
    }

    /// The gate/up matmul alone, by cuBLASLt (fast accumulation in FP8), into `gate_up`.
    fn cublaslt_matmul(&self, b: &B) {
        if self.fp8 {
            let (x, w) = self.operands();
            b.matmul(&self.gate_up, x, w, None, Matmul::FORWARD)
        } else {
            b.matmul(&self.gate_up, &self.x, &self.w, None, Matmul::FORWARD)
        }
        .unwrap();
    }
}

impl Mlp<Cuda> {
    /// The gate/up matmul alone, by the own kernel, into `gate_up`.
    fn own_matmul(&self, gpu: &Cuda) {
        if self.fp8 {
            let (x, w) = self.operands();
            gpu.own_matmul_scaled(&self.gate_up, x, w)
        } else {
            gpu.own_matmul(&self.gate_up, &self.x, &self.w)
        }
        .unwrap();
    }
}

/// SwiGLU's output (and with `amax`, its abs-max) must be swiglu.cu's of the fused kernel's own
/// gate/up, bit for bit.
fn swiglu_of_its_gate_up(
    test: &str, gpu: &Cuda, gate_up: &Tensor<Cuda>, fused: &Outputs, amax: bool,
) {
    let f = gate_up.cols() / 2;
    let again = tensor(
        gpu,
        &[gate_up.matrix_rows(), f],
        DType::BF16,
        &vec![0.0; gate_up.numel() / 2],
    );
    let its_amax = tensor(gpu, &[1], DType::F32, &[0.0]);
    gpu.swiglu_forward(&again, gate_up, amax.then_some(&its_amax))
        .unwrap();
    assert!(
        same_bits(output(fused, "swiglu"), &gpu.download(&again).unwrap()),
        "{test}: the fused SwiGLU differs from swiglu.cu's of the same gate/up"
    );
    if amax {
        assert!(
            same_bits(output(fused, "amax"), &gpu.download(&its_amax).unwrap()),
            "{test}: the fused SwiGLU's abs-max differs from swiglu.cu's"
        );
    }
}

/// The gate/up projection with SwiGLU, against the CPU at an awkward shape and against
/// cuBLASLt (fast accumulation in FP8) and swiglu.cu at the model shapes, and timed there with
/// the matmul alone: bf16, or FP8 with e4m3 operands.
fn fused_gate_up_swiglu_matches(fp8: bool, seed: u64) {
    let (gpu, cpu) = (cuda(), Cpu::<f32>::new());
    let name = if fp8 { "fp8" } else { "bf16" };
    // Rows, F and K that are not whole tiles (128 rows, 96 gate columns, 64 of K in bf16 and
    // 128 in FP8, whose rows are a whole number of 16 bytes). The CPU applies the descales to
    // the operands and sums in another order: within bf16's rounding of the outputs.
    let shape = (300, 200, if fp8 { 272 } else { 136 });
    let (on_gpu, on_cpu) = (
        Mlp::new(&gpu, shape, fp8, seed),
        Mlp::new(&cpu, shape, fp8, seed),
    );
    let test = format!(
        "gemm: {name} gate_up_swiglu 300 x 2·200 x {} against the CPU",
        shape.2
    );
    let fused = check_op(&test, || on_gpu.run(&gpu), || on_cpu.run(&cpu), |_| 1e-2);
    swiglu_of_its_gate_up(&test, &gpu, &on_gpu.gate_up, &fused, fp8);

    for (i, (model, shape)) in MODEL_SHAPES.into_iter().enumerate() {
        let (m, f, k) = shape;
        let mlp = Mlp::new(&gpu, shape, fp8, seed + 10 + i as u64);
        let test = format!("gemm: {model} {name} gate_up_swiglu {m} x 2·{f} x {k}");
        // cuBLASLt's sum and the kernel's take the same products, perhaps in another order.
        // Each run rewrites every output, so the fused kernel's are on the device after this.
        let cublaslt = with_own_gemm(&gpu, false, || mlp.run(&gpu));
        let fused = check_op(&test, || mlp.run(&gpu), || cublaslt.clone(), |_| 1e-2);
        swiglu_of_its_gate_up(&test, &gpu, &mlp.gate_up, &fused, fp8);
        let bitwise = same_bits(output(&fused, "gate_up"), output(&cublaslt, "gate_up"));

        let flops = 2.0 * (m * 2 * f * k) as f64;
        let time = |own: bool| with_own_gemm(&gpu, own, || time_ms(&gpu, || mlp.run_only(&gpu)));
        let (fused_ms, separate_ms) = (time(true), time(false));
        let plain_ms = time_ms(&gpu, || mlp.own_matmul(&gpu));
        // The plain kernel's product is the fused one's: the same main loop and scaling.
        assert!(
            same_bits(
                &gpu.download(&mlp.gate_up).unwrap(),
                output(&fused, "gate_up")
            ),
            "{test}: the own plain matmul differs from the fused kernel's gate/up"
        );
        let cublaslt_ms = time_ms(&gpu, || mlp.cublaslt_matmul(&gpu));
        let tflops = |ms: f64| flops / ms * 1e-9;
        figure(
            &test,
            format!(
                "fused {fused_ms:.3} ms against cuBLASLt + swiglu.cu {separate_ms:.3} ms; gate/up \
                 bitwise cuBLASLt's: {bitwise}; the matmul alone: own {plain_ms:.3} ms ({:.0} \
                 TFLOP/s), cuBLASLt {cublaslt_ms:.3} ms ({:.0} TFLOP/s)",
                tflops(plain_ms),
                tflops(cublaslt_ms)
            ),
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_gate_up_swiglu_matches_the_cpu_and_cublaslt() {
    fused_gate_up_swiglu_matches(false, 10);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_fp8_gate_up_swiglu_matches_the_cpu_and_cublaslt() {
    fused_gate_up_swiglu_matches(true, 60);
}

/// One row's gate/up with SwiGLU, as generation runs it (gemv.cu), against the CPU, with K a
/// whole number of 16 bytes and not; its SwiGLU bitwise swiglu.cu's of the same gate/up.
#[test]
#[ignore = "needs a CUDA GPU"]
fn one_row_gate_up_swiglu_matches_the_cpu() {
    let (gpu, cpu) = (cuda(), Cpu::<f32>::new());
    for (i, shape) in [(1, 4864, 896), (1, 200, 130)].into_iter().enumerate() {
        let seed = 40 + 2 * i as u64;
        let (on_gpu, on_cpu) = (
            Mlp::new(&gpu, shape, false, seed),
            Mlp::new(&cpu, shape, false, seed),
        );
        let test = format!(
            "gemv: gate_up_swiglu 1 x 2·{} x {} against the CPU",
            shape.1, shape.2
        );
        let out = check_op(&test, || on_gpu.run(&gpu), || on_cpu.run(&cpu), |_| 1e-2);
        swiglu_of_its_gate_up(&test, &gpu, &on_gpu.gate_up, &out, false);
    }
}

/// The plain kernel against the CPU, with N not a multiple of its 192-column tiles.
#[test]
#[ignore = "needs a CUDA GPU"]
fn own_matmul_matches_the_cpu_at_an_awkward_shape() {
    let (gpu, cpu) = (cuda(), Cpu::<f32>::new());
    let (m, n, k) = (300, 520, 136);
    let (a, b) = (normal(m * k, 1.0, 9), normal(n * k, 0.1, 10));
    let zeros = vec![0.0; m * n];
    let out = tensor(&gpu, &[m, n], DType::BF16, &zeros);
    gpu.own_matmul(
        &out,
        &tensor(&gpu, &[m, k], DType::BF16, &a),
        &tensor(&gpu, &[n, k], DType::BF16, &b),
    )
    .unwrap();
    let expected = tensor(&cpu, &[m, n], DType::BF16, &zeros);
    cpu.matmul(
        &expected,
        &tensor(&cpu, &[m, k], DType::BF16, &a),
        &tensor(&cpu, &[n, k], DType::BF16, &b),
        None,
        Matmul::FORWARD,
    )
    .unwrap();
    let err = rel_err(
        &gpu.download(&out).unwrap(),
        &cpu.download(&expected).unwrap(),
    );
    figure(
        "gemm: own_matmul 300 x 520 x 136 against the CPU",
        format!("rel err {err:.2e}"),
    );
    assert!(err < 1e-2, "own_matmul: relative error {err:e}");
}

/// (tokens, F, hidden) of the MLP in Qwen2.5-0.5B at batch 32, 1.5B at 16 and 3B at 8.
const MODEL_SHAPES: [(&str, (usize, usize, usize)); 3] = [
    ("qwen2.5-0.5b", (32768, 4864, 896)),
    ("qwen2.5-1.5b", (16384, 8960, 1536)),
    ("qwen2.5-3b", (8192, 11008, 2048)),
];

/// `op`'s result with smelt's own matmul switched `on` (off: cuBLASLt and the separate SwiGLU
/// passes), the matmul switched back on after.
fn with_own_gemm<T>(gpu: &Cuda, on: bool, op: impl FnOnce() -> T) -> T {
    gpu.set_own_gemm(on);
    let out = op();
    gpu.set_own_gemm(true);
    out
}

/// SwiGLU's backward through the down projection: dy [m, h], the down weight w [h, f] and
/// gate/up [m, 2f] (host values, uploaded afresh for each run: the op overwrites gate/up); in
/// bf16, or with `fp8` set, dy in that format and w as its transposed e4m3 copy [f, h], each
/// 16 times its values (e4m3's and e5m2's precision is relative, and their range wide) with
/// the descale that undoes it.
struct DownBackward {
    shape: (usize, usize, usize),
    fp8: Option<DType>,
    dy: Vec<f32>,
    w: Vec<f32>,
    gate_up: Vec<f32>,
}

/// `DownBackward`'s tensors on one backend.
struct DownOperands<B: Backend> {
    fp8: Option<DType>,
    gate_up: Tensor<B>,
    dh: Tensor<B>,
    dy: Tensor<B>,
    w: Tensor<B>,
    /// FP8 only: dy's and w's descales, and what receives gate/up's gradient's abs-max.
    descales: [Tensor<B>; 2],
    amax: Tensor<B>,
}

impl DownBackward {
    fn new((m, f, h): (usize, usize, usize), fp8: Option<DType>, seed: u64) -> Self {
        DownBackward {
            shape: (m, f, h),
            fp8,
            dy: normal(m * h, 1.0, seed),
            w: normal(h * f, 1.0 / (h as f64).sqrt(), seed + 1),
            gate_up: normal(m * 2 * f, 1.0, seed + 2),
        }
    }

    fn upload<B: Backend>(&self, b: &B) -> DownOperands<B> {
        let (m, f, h) = self.shape;
        let one = |t: f32| tensor(b, &[1], DType::F32, &[t]);
        let times = |xs: &[f32], s: f32| xs.iter().map(|x| x * s).collect::<Vec<_>>();
        let (dy, w, descales) = match self.fp8 {
            None => (
                tensor(b, &[m, h], DType::BF16, &self.dy),
                tensor(b, &[h, f], DType::BF16, &self.w),
                [one(1.0), one(1.0)],
            ),
            Some(format) => {
                let wt: Vec<f32> = (0..f * h).map(|i| self.w[(i % h) * f + i / h]).collect();
                (
                    tensor(b, &[m, h], format, &times(&self.dy, 16.0)),
                    tensor(b, &[f, h], DType::E4M3, &times(&wt, 16.0)),
                    [one(1.0 / 16.0), one(1.0 / 16.0)],
                )
            }
        };
        DownOperands {
            fp8: self.fp8,
            gate_up: tensor(b, &[m, 2 * f], DType::BF16, &self.gate_up),
            dh: tensor(b, &[m, f], DType::BF16, &vec![0.0; m * f]),
            dy,
            w,
            descales,
            amax: one(0.0),
        }
    }

    /// Gate/up's gradient (and in FP8 its abs-max), by `swiglu_backward_through_down`.
    fn run<B: Backend>(&self, b: &B) -> Outputs {
        let ops = self.upload(b);
        ops.run_only(b);
        let mut out = vec![("dgate_up", b.download(&ops.gate_up).unwrap())];
        if self.fp8.is_some() {
            out.push(("amax", b.download(&ops.amax).unwrap()));
        }
        out
    }
}

impl<B: Backend> DownOperands<B> {
    fn run_only(&self, b: &B) {
        let DownOperands {
            gate_up, dh, dy, w, ..
        } = self;
        match self.fp8 {
            None => b
                .swiglu_backward_through_down(gate_up, dh, dy, w, None)
                .unwrap(),
            Some(_) => {
                let [dy_descale, w_descale] = &self.descales;
                b.fill(&self.amax, 0.0).unwrap();
                b.swiglu_backward_through_down(
                    gate_up,
                    dh,
                    Operand::scaled(dy, dy_descale),
                    Operand::scaled(w, w_descale),
                    Some(&self.amax),
                )
                .unwrap()
            }
        }
    }
}

/// The down projection's input gradient with SwiGLU's backward, against the CPU at an awkward
/// shape and against cuBLASLt (fast accumulation in FP8) and swiglu.cu at the model shapes,
/// and timed there: bf16, and FP8 with dy in each gradient format.
fn fused_swiglu_backward_matches(fp8: Option<DType>, seed: u64) {
    let (gpu, cpu) = (cuda(), Cpu::<f32>::new());
    let name = fp8.map_or("bf16".into(), |g| format!("fp8 dy {g:?}"));
    // FP8 rows are a whole number of 16 bytes.
    let awkward = DownBackward::new((300, 200, 272), fp8, seed);
    check_op(
        &format!("gemm: {name} swiglu_backward_through_down 300 x 200 x 272 against the CPU"),
        || awkward.run(&gpu),
        || awkward.run(&cpu),
        |_| 1e-2,
    );
    for (i, (model, shape)) in MODEL_SHAPES.into_iter().enumerate() {
        let (m, f, h) = shape;
        let case = DownBackward::new(shape, fp8, seed + 10 + i as u64);
        let test = format!("gemm: {model} {name} swiglu_backward_through_down {m} x {f} x {h}");
        let separate = with_own_gemm(&gpu, false, || case.run(&gpu));
        let fused = check_op(&test, || case.run(&gpu), || separate.clone(), |_| 1e-2);
        let bitwise = fused
            .iter()
            .zip(&separate)
            .all(|((_, a), (_, b))| same_bits(a, b));
        // Timed in place on one set of buffers: the values drift, the work does not.
        let ops = case.upload(&gpu);
        let time = |own: bool| with_own_gemm(&gpu, own, || time_ms(&gpu, || ops.run_only(&gpu)));
        let (fused_ms, separate_ms) = (time(true), time(false));
        figure(
            &test,
            format!(
                "fused {fused_ms:.3} ms against cuBLASLt + swiglu.cu {separate_ms:.3} ms; \
                 bitwise equal: {bitwise}"
            ),
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_swiglu_backward_matches_the_cpu_and_cublaslt() {
    fused_swiglu_backward_matches(None, 40);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_fp8_swiglu_backward_matches_the_cpu_and_cublaslt() {
    fused_swiglu_backward_matches(Some(DType::E5M2), 80);
    fused_swiglu_backward_matches(Some(DType::E4M3), 90);
}
