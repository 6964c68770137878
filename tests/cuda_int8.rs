//! INT8 on the GPU against the CPU's emulation, bit for bit: row-wise quantization in both
//! layouts and both roundings, and the products of INT8 operands (a plain one with a bias, one
//! adding into its output, and the gate/up projection with SwiGLU) by smelt's own Hopper kernel
//! and by cuBLASLt's int32 sums with the separate epilogue. Only SwiGLU, whose GPU formula
//! differs from the CPU's exact one by design (common.cuh), is compared within a tolerance,
//! and must be, bit for bit, what swiglu.cu computes from the gate/up output.
//! The shapes leave partial tiles in every dimension.

mod common;

use common::gpu::*;
use smelt::backend::cpu::Cpu;
use smelt::backend::prelude::*;
use smelt::backend::{Int8Layout, Int8Rounding, Matmul, Operand};
use smelt::tensor::{DType, Tensor};

const M: usize = 300;
const K: usize = 208;
const F: usize = 200;

/// x [M, K] of std 1 with a few outliers, w [2F, K] of std 1/√K, a bias and an output to add
/// into, all bf16.
struct Inputs<B: Backend> {
    x: Tensor<B>,
    w: Tensor<B>,
    bias: Tensor<B>,
    old: Vec<f32>,
}

impl<B: Backend> Inputs<B> {
    fn new(b: &B) -> Self {
        let mut x = normal(M * K, 1.0, 3);
        for i in (0..x.len()).step_by(997) {
            x[i] *= 40.0;
        }
        Inputs {
            x: tensor(b, &[M, K], DType::BF16, &x),
            w: tensor(
                b,
                &[2 * F, K],
                DType::BF16,
                &normal(2 * F * K, 1.0 / (K as f64).sqrt(), 4),
            ),
            bias: tensor(b, &[2 * F], DType::BF16, &normal(2 * F, 0.1, 5)),
            old: normal(M * 2 * F, 1.0, 6),
        }
    }
}

/// Codes and descales of `x` in `layout`.
fn quantized<B: Backend>(
    b: &B, x: &Tensor<B>, layout: Int8Layout, rounding: Int8Rounding,
) -> (Tensor<B>, Tensor<B>) {
    let (r, c) = (x.matrix_rows(), x.cols());
    let [rows, cols] = layout.codes_shape(r, c);
    let q = tensor(b, &[rows, cols], DType::I8, &vec![0.0; r * c]);
    let d = tensor(b, &[rows], DType::F32, &vec![0.0; rows]);
    b.quantize_i8(&q, &d, x, layout, rounding).unwrap();
    (q, d)
}

/// Every output, by name.
fn run<B: Backend>(b: &B) -> Vec<(String, Vec<f32>)> {
    let inp = Inputs::new(b);
    let mut out = vec![];
    for (layout, rounding, name) in [
        (Int8Layout::Rows, Int8Rounding::Nearest, "rows"),
        (Int8Layout::Cols, Int8Rounding::Nearest, "cols"),
        (
            Int8Layout::Rows,
            Int8Rounding::Stochastic { seed: 11 },
            "rows sr",
        ),
        (
            Int8Layout::Cols,
            Int8Rounding::Stochastic { seed: 12 },
            "cols sr",
        ),
    ] {
        let (q, d) = quantized(b, &inp.x, layout, rounding);
        out.push((format!("x {name} codes"), b.download(&q).unwrap()));
        out.push((format!("x {name} descales"), b.download(&d).unwrap()));
    }
    let (xq, xd) = quantized(b, &inp.x, Int8Layout::Rows, Int8Rounding::Nearest);
    let (wq, wd) = quantized(b, &inp.w, Int8Layout::Rows, Int8Rounding::Nearest);
    let (x8, w8) = (Operand::scaled(&xq, &xd), Operand::scaled(&wq, &wd));
    let y = tensor(b, &[M, 2 * F], DType::BF16, &vec![0.0; M * 2 * F]);
    b.matmul(&y, x8, w8, Some(&inp.bias), Matmul::FORWARD)
        .unwrap();
    out.push(("product + bias".into(), b.download(&y).unwrap()));
    b.upload(&y, &inp.old).unwrap();
    let adding = Matmul {
        accumulate: true,
        ..Matmul::FORWARD
    };
    b.matmul(&y, x8, w8, None, adding).unwrap();
    out.push(("old + product".into(), b.download(&y).unwrap()));
    let h = tensor(b, &[M, F], DType::BF16, &vec![0.0; M * F]);
    b.gate_up_swiglu(&y, &h, x8, w8, None).unwrap();
    out.push(("gate/up".into(), b.download(&y).unwrap()));
    out.push(("swiglu".into(), b.download(&h).unwrap()));
    // SwiGLU as swiglu.cu (or the CPU) computes it from that gate/up.
    b.swiglu_forward(&h, &y, None).unwrap();
    out.push(("swiglu of gate/up".into(), b.download(&h).unwrap()));
    out
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn int8_ops_match_the_cpu_emulation_bit_for_bit() {
    let (gpu, cpu) = (cuda(), Cpu::<f32>::new());
    let reference = run(&cpu);
    for own in [true, false] {
        gpu.set_own_gemm(own);
        let test = format!(
            "int8 ops ({})",
            if own {
                "own kernel where it runs"
            } else {
                "cuBLASLt"
            }
        );
        let got = run(&gpu);
        for ((name, g), (_, c)) in got.iter().zip(&reference) {
            if name == "swiglu" || name == "swiglu of gate/up" {
                let err = rel_err(g, c);
                figure(&test, format!("{name} rel err {err:.2e} (tol 1e-2)"));
                assert!(err <= 1e-2, "{test} {name}: relative error {err:e}");
            } else {
                let differ = g
                    .iter()
                    .zip(c)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                figure(
                    &test,
                    format!(
                        "{name}: {differ} of {} values differ from the CPU's",
                        g.len()
                    ),
                );
                assert_eq!(differ, 0, "{test} {name}");
            }
        }
        let fused = &got.iter().find(|(n, _)| n == "swiglu").unwrap().1;
        let separate = &got
            .iter()
            .find(|(n, _)| n == "swiglu of gate/up")
            .unwrap()
            .1;
        assert!(
            same_bits(fused, separate),
            "{test}: the fused SwiGLU differs from swiglu.cu's"
        );
    }
}

/// The INT8 ops at Qwen2.5-1.5B's MLP shape and batch (16 × 1024 tokens), against bf16's: the
/// gate/up projection with SwiGLU and its parts, the down projection, and the quantizations a
/// step makes of its operands. Timed, not checked: the figures say where INT8's step goes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn int8_ops_timed_at_a_model_shape() {
    let gpu = cuda();
    let (t, h, f) = (16384, 1536, 8960);
    let test = format!("int8 at {t} tokens, hidden {h}, MLP {f}");
    let x = tensor(&gpu, &[t, h], DType::BF16, &normal(t * h, 1.0, 1));
    let w = tensor(&gpu, &[2 * f, h], DType::BF16, &normal(2 * f * h, 0.03, 2));
    let down = tensor(&gpu, &[h, f], DType::BF16, &normal(h * f, 0.01, 3));
    let gate_up = tensor(&gpu, &[t, 2 * f], DType::BF16, &vec![0.0; t * 2 * f]);
    let hidden = tensor(&gpu, &[t, f], DType::BF16, &normal(t * f, 1.0, 4));
    let out = tensor(&gpu, &[t, h], DType::BF16, &vec![0.0; t * h]);
    let (xq, xd) = quantized(&gpu, &x, Int8Layout::Rows, Int8Rounding::Nearest);
    let (wq, wd) = quantized(&gpu, &w, Int8Layout::Rows, Int8Rounding::Nearest);
    let (hq, hd) = quantized(&gpu, &hidden, Int8Layout::Rows, Int8Rounding::Nearest);
    let (dq, dd) = quantized(&gpu, &down, Int8Layout::Rows, Int8Rounding::Nearest);
    let (x8, w8) = (Operand::scaled(&xq, &xd), Operand::scaled(&wq, &wd));
    let (h8, d8) = (Operand::scaled(&hq, &hd), Operand::scaled(&dq, &dd));
    let flops = |m: usize, n: usize, k: usize| 2.0 * (m * n * k) as f64;
    let row = |name: &str, ops: f64, run: &dyn Fn()| {
        let ms = time_ms(&gpu, run);
        let rate = if ops > 0.0 {
            format!(", {:.0} T/s", ops / ms / 1e9)
        } else {
            String::new()
        };
        figure(&test, format!("{name}: {ms:.3} ms{rate}"));
    };
    let gu = flops(t, 2 * f, h);
    row("bf16 gate/up + SwiGLU fused", gu, &|| {
        gpu.gate_up_swiglu(&gate_up, &hidden, &x, &w, None).unwrap()
    });
    row("int8 gate/up + SwiGLU (gate_up_swiglu)", gu, &|| {
        gpu.gate_up_swiglu(&gate_up, &hidden, x8, w8, None).unwrap()
    });
    row("int8 gate/up product", gu, &|| {
        gpu.matmul(&gate_up, x8, w8, None, Matmul::FORWARD).unwrap()
    });
    row("swiglu.cu forward", 0.0, &|| {
        gpu.swiglu_forward(&hidden, &gate_up, None).unwrap()
    });
    row("bf16 down (cuBLASLt)", flops(t, h, f), &|| {
        gpu.matmul(&out, &hidden, &down, None, Matmul::FORWARD)
            .unwrap()
    });
    row("int8 down", flops(t, h, f), &|| {
        gpu.matmul(&out, h8, d8, None, Matmul::FORWARD).unwrap()
    });
    for (name, src, layout) in [
        ("quantize x rows", &x, Int8Layout::Rows),
        ("quantize h rows", &hidden, Int8Layout::Rows),
        ("quantize gate/up rows", &gate_up, Int8Layout::Rows),
        ("quantize x cols", &x, Int8Layout::Cols),
        ("quantize gate/up cols", &gate_up, Int8Layout::Cols),
    ] {
        let (r, c) = (src.matrix_rows(), src.cols());
        let q = tensor(&gpu, &[r * c], DType::I8, &vec![0.0; r * c]);
        let d = tensor(&gpu, &[r.max(c)], DType::F32, &vec![0.0; r.max(c)]);
        let rows = if layout == Int8Layout::Rows { r } else { c };
        let (q, d) = (q.reshape(&[rows, r * c / rows]), d.narrow_rows(0, rows));
        let ms = time_ms(&gpu, || {
            gpu.quantize_i8(&q, &d, src, layout, Int8Rounding::Nearest)
                .unwrap()
        });
        let gbs = (r * c * 3) as f64 / ms / 1e6;
        figure(
            &test,
            format!("{name} ({r}×{c}): {ms:.3} ms, {gbs:.0} GB/s"),
        );
    }
}
