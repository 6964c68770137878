//! Each backend method on the GPU against the CPU backend, on fresh random inputs at
//! realistic sizes, run twice on the GPU to demand bitwise-equal (deterministic) results.
//!
//! Tolerances are relative errors ‖gpu − cpu‖/‖cpu‖. Both sides read the same (bf16-rounded)
//! inputs and compute in f32, so they differ by summation order, fused multiply-adds and
//! library `exp`/`log`, and then by the rounding of the output: for a bf16 output a value
//! that lands on the other side of a rounding boundary moves by one bf16 step (2⁻⁸
//! relative), so 1e-2 is the bf16 bound; f32 outputs get 1e-5 unless noted.

mod common;

use common::gpu::*;
use common::{EOS, packed_batch};
use smelt::backend::cpu::{Cpu, IGNORE_INDEX};
use smelt::backend::cuda::kernel_choice::AttentionKernels;
use smelt::backend::ops::adam8bit::absmax_len;
use smelt::backend::prelude::*;
use smelt::backend::{
    AdamW, AdamWTensor, AttnShape, Fp8Sum, Fused, Matmul, MomentScales, Operand, ResidualAdd,
};
use smelt::model::documents;
use smelt::rng::Rng;
use smelt::tensor::{DType, Tensor};

/// Tolerance of an output stored in `dtype` (see the header).
fn tol(dtype: DType) -> f64 {
    if dtype == DType::BF16 { 1e-2 } else { 1e-5 }
}

fn download<B: Backend>(b: &B, t: &Tensor<B>) -> Vec<f32> {
    b.download(t).unwrap()
}

/// A zeroed `[1]` f32 abs-max, as producers of FP8 inputs expect it.
fn amax<B: Backend>(b: &B) -> Tensor<B> {
    tensor(b, &[1], DType::F32, &[0.0])
}

/// A `shape` tensor holding `values` that starts `skip` elements into its storage: with an
/// odd `skip`, a view aligned only to its element, as `narrow_rows` can make, which the
/// kernels must detect and move element by element.
fn shifted<B: Backend>(
    b: &B, shape: &[usize], dtype: DType, values: &[f32], skip: usize,
) -> Tensor<B> {
    let padded: Vec<f32> = std::iter::repeat_n(0.0, skip)
        .chain(values.iter().copied())
        .collect();
    tensor(b, &[padded.len()], dtype, &padded)
        .narrow_rows(skip, padded.len())
        .reshape(shape)
}

/// The abs-max a producer reported must be exactly the largest |value| of its output as it
/// was stored (downloaded from the GPU), NaN ignored as the kernels ignore it.
fn check_amax(test: &str, outputs: &Outputs, out: &str, amax: &str) {
    let largest = output(outputs, out)
        .iter()
        .fold(0.0f32, |m, x| m.max(x.abs()));
    let reported = output(outputs, amax)[0];
    assert_eq!(
        reported.to_bits(),
        largest.to_bits(),
        "{test}: {amax} {reported:e} is not max |{out}| {largest:e}"
    );
    figure(test, format!("{amax} == max |{out}| = {largest:e}"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fill_and_copy() {
    let (gpu, cpu) = (cuda(), Cpu::<f32>::new());
    let n = 1_000_003;
    let x = normal(n, 3.0, 1);
    fn run<B: Backend>(b: &B, x: &[f32]) -> Outputs {
        let n = x.len();
        let src = tensor(b, &[n], DType::F32, x);
        let (to_bf16, back) = (
            tensor(b, &[n], DType::BF16, &vec![0.0; n]),
            tensor(b, &[n], DType::F32, &vec![0.0; n]),
        );
        b.copy(&to_bf16, &src).unwrap();
        b.copy(&back, &to_bf16).unwrap();
        let filled = tensor(b, &[n], DType::BF16, &vec![0.0; n]);
        b.fill(&filled, 1.2345).unwrap();
        vec![
            ("f32 to bf16", download(b, &to_bf16)),
            ("bf16 to f32", download(b, &back)),
            ("fill", download(b, &filled)),
        ]
    }
    // Round-to-nearest-even on both sides: identical bits.
    check_op("fill_and_copy", || run(&gpu, &x), || run(&cpu, &x), |_| 0.0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn embedding_forward_and_backward() {
    let (gpu, cpu) = (cuda(), Cpu::<f32>::new());
    let (n, v, c) = (8192, 32000, 896);
    let mut rng = Rng::new(2);
    // Mostly a few hundred frequent tokens, so rows collect many positions, plus rare ones.
    let tokens: Vec<i32> = (0..n)
        .map(|i| if i % 7 == 0 { rng.below(v) } else { rng.below(300) } as i32)
        .collect();
    let (wte, dout, dwte0) = (
        normal(v * c, 1.0, 3),
        normal(n * c, 1.0, 4),
        normal(v * c, 1.0, 5),
    );
    #[allow(clippy::too_many_arguments)]
    fn run<B: Backend>(
        b: &B, dtype: DType, acc: bool, tokens: &[i32], wte: &[f32], dout: &[f32], dwte0: &[f32],
        (v, c): (usize, usize),
    ) -> Outputs {
        let n = tokens.len();
        let toks = tensor_i32(b, tokens);
        let (wte, out) = (
            tensor(b, &[v, c], dtype, wte),
            tensor(b, &[n, c], dtype, &vec![0.0; n * c]),
        );
        b.embedding_forward(&out, &toks, &wte).unwrap();
        let (dout, dwte) = (
            tensor(b, &[n, c], dtype, dout),
            tensor(b, &[v, c], dtype, dwte0),
        );
        b.embedding_backward(&dwte, &toks, &dout, acc).unwrap();
        vec![("out", download(b, &out)), ("dwte", download(b, &dwte))]
    }
    for dtype in [DType::BF16, DType::F32] {
        for acc in [false, true] {
            let name = format!("embedding {dtype} accumulate={acc}");
            // The GPU adds each row's gradients in the CPU's order, in f32: the same bits are
            // expected, and 1e-6 allows no error that matters.
            check_op(
                &name,
                || run(&gpu, dtype, acc, &tokens, &wte, &dout, &dwte0, (v, c)),
                || run(&cpu, dtype, acc, &tokens, &wte, &dout, &dwte0, (v, c)),
                |_| 1e-6,
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn rmsnorm_forward_fused_and_backward() {
    let (gpu, cpu) = (cuda(), Cpu::<f32>::new());
    // (n, c, skip): the 0.5B width on the 16-byte path; the 1.5B width, whose backward warps'
    // sums fill the 48 KB that need no opt-in before the kernel's own reduction scratch; a
    // wide row (fewer warps per backward block); rows of whole 16 bytes in views one element
    // into their storage; and an odd width. The last two take the element-by-element path.
    // Between them the backward holds a row in 4 and 8 accesses per lane (896 and 37; 1536,
    // and 896 in f32) and streams it (3584, 904).
    let cases = [
        (4096, 896, 0),
        (1024, 1536, 0),
        (512, 3584, 0),
        (300, 904, 1),
        (300, 37, 0),
    ];
    for (n, c, skip) in cases {
        rmsnorm_case(&gpu, &cpu, n, c, skip);
    }
}

fn rmsnorm_case(gpu: &impl Backend, cpu: &Cpu<f32>, n: usize, c: usize, skip: usize) {
    let (x, branch, w, dy, dx0, dw0) = (
        normal(n * c, 1.0, 6),
        normal(n * c, 0.5, 7),
        normal(c, 0.2, 8)
            .iter()
            .map(|r| 1.0 + r)
            .collect::<Vec<_>>(),
        normal(n * c, 1.0, 9),
        normal(n * c, 1.0, 10),
        normal(c, 1.0, 11),
    );
    #[allow(clippy::too_many_arguments)]
    fn run<B: Backend>(
        b: &B, dtype: DType, acc: bool, (n, c, skip): (usize, usize, usize), x: &[f32],
        branch: &[f32], w: &[f32], dy: &[f32], dx0: &[f32], dw0: &[f32],
    ) -> Outputs {
        let t = |v: &[f32]| shifted(b, &[n, c], dtype, v, skip);
        let stat = || tensor(b, &[n], DType::F32, &vec![0.0; n]);
        let zeros = vec![0.0; n * c];
        let (x, branch, w) = (t(x), t(branch), tensor(b, &[c], dtype, w));
        let (out, rstd, out_amax) = (t(&zeros), stat(), amax(b));
        b.rmsnorm_forward(Some(&out), &rstd, &x, None, &w, 1e-6, Some(&out_amax))
            .unwrap();
        // Without an output: FP8's norms, whose projections normalize as they quantize.
        let (unstored_rstd, unstored_amax) = (stat(), amax(b));
        b.rmsnorm_forward(
            None,
            &unstored_rstd,
            &x,
            None,
            &w,
            1e-6,
            Some(&unstored_amax),
        )
        .unwrap();
        let (res, fused, fused_rstd) = (t(&zeros), t(&zeros), stat());
        let fused_amax = amax(b);
        let add = ResidualAdd {
            out: &res,
            branch: &branch,
        };
        b.rmsnorm_forward(
            Some(&fused),
            &fused_rstd,
            &x,
            Some(add),
            &w,
            1e-6,
            Some(&fused_amax),
        )
        .unwrap();
        // The plain norm of the fused kernel's rounded residual.
        let (replain, replain_rstd) = (t(&zeros), stat());
        b.rmsnorm_forward(Some(&replain), &replain_rstd, &res, None, &w, 1e-6, None)
            .unwrap();
        let (dy, dx, dw, dx_amax) = (t(dy), t(dx0), tensor(b, &[c], dtype, dw0), amax(b));
        b.rmsnorm_backward(&dx, &dw, &dy, &res, &w, &fused_rstd, acc, Some(&dx_amax))
            .unwrap();
        vec![
            ("out", download(b, &out)),
            ("out amax", download(b, &out_amax)),
            ("rstd", download(b, &rstd)),
            ("unstored rstd", download(b, &unstored_rstd)),
            ("unstored out amax", download(b, &unstored_amax)),
            ("residual", download(b, &res)),
            ("fused out", download(b, &fused)),
            ("fused out amax", download(b, &fused_amax)),
            ("fused rstd", download(b, &fused_rstd)),
            ("plain out of fused residual", download(b, &replain)),
            ("plain rstd of fused residual", download(b, &replain_rstd)),
            ("dinp", download(b, &dx)),
            ("dinp amax", download(b, &dx_amax)),
            ("dweight", download(b, &dw)),
        ]
    }
    let shape = (n, c, skip);
    for dtype in [DType::BF16, DType::F32] {
        for acc in [false, true] {
            let name = format!("rmsnorm {n}x{c} skip {skip} {dtype} accumulate={acc}");
            let gpu_out = check_op(
                &name,
                || run(gpu, dtype, acc, shape, &x, &branch, &w, &dy, &dx0, &dw0),
                || run(cpu, dtype, acc, shape, &x, &branch, &w, &dy, &dx0, &dw0),
                // rstd is f32 from identical inputs: f32 tolerance whatever the storage.
                |name| {
                    if name.contains("rstd") {
                        1e-5
                    } else {
                        tol(dtype)
                    }
                },
            );
            check_amax(&name, &gpu_out, "out", "out amax");
            check_amax(&name, &gpu_out, "fused out", "fused out amax");
            check_amax(&name, &gpu_out, "dinp", "dinp amax");
            for (unstored, stored) in [("unstored rstd", "rstd"), ("unstored out amax", "out amax")]
            {
                assert!(same_bits(
                    output(&gpu_out, unstored),
                    output(&gpu_out, stored)
                ));
            }
            // Recompute relies on this: the fused kernel normalizes exactly like the plain one.
            assert!(same_bits(
                output(&gpu_out, "fused out"),
                output(&gpu_out, "plain out of fused residual")
            ));
            assert!(same_bits(
                output(&gpu_out, "fused rstd"),
                output(&gpu_out, "plain rstd of fused residual")
            ));
            figure(&name, "fused norm bitwise equal to the plain norm");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn head_rmsnorm_forward_and_backward() {
    let (gpu, cpu) = (cuda(), Cpu::<f32>::new());
    // Qwen3-0.6B's heads (16 queries, 8 keys and values of 128) over 1024 rows, and a small
    // shape of 64-wide heads whose rows do not fill the backward's blocks evenly.
    let cases = [
        (
            1024,
            AttnShape {
                batch: 1,
                seq: 1024,
                q_heads: 16,
                kv_heads: 8,
                head_dim: 128,
            },
        ),
        (
            300,
            AttnShape {
                batch: 3,
                seq: 100,
                q_heads: 4,
                kv_heads: 2,
                head_dim: 64,
            },
        ),
    ];
    for (rows, s) in cases {
        let (w, d) = (s.qkv_width(), s.head_dim);
        let heads = s.q_heads + s.kv_heads;
        let weight = |seed| -> Vec<f32> { normal(d, 0.2, seed).iter().map(|r| 1.0 + r).collect() };
        let (x, dy, qw, kw, dw0) = (
            normal(rows * w, 1.0, 70),
            normal(rows * w, 1.0, 71),
            weight(72),
            weight(73),
            normal(2 * d, 1.0, 74),
        );
        #[allow(clippy::too_many_arguments)]
        fn run<B: Backend>(
            b: &B, dtype: DType, acc: bool, (rows, s, heads): (usize, AttnShape, usize), x: &[f32],
            dy: &[f32], (qw, kw): (&[f32], &[f32]), dw0: &[f32],
        ) -> Outputs {
            let (w, d) = (s.qkv_width(), s.head_dim);
            let x = tensor(b, &[rows, w], dtype, x);
            let out = tensor(b, &[rows, w], dtype, &vec![0.0; rows * w]);
            let rstd = tensor(b, &[rows, heads], DType::F32, &vec![0.0; rows * heads]);
            let (qw, kw) = (tensor(b, &[d], dtype, qw), tensor(b, &[d], dtype, kw));
            b.head_rmsnorm_forward(&out, &rstd, &x, (&qw, &kw), s, 1e-6)
                .unwrap();
            let dqkv = tensor(b, &[rows, w], dtype, dy);
            let (dq, dk) = (
                tensor(b, &[d], dtype, &dw0[..d]),
                tensor(b, &[d], dtype, &dw0[d..]),
            );
            let found = amax(b);
            b.head_rmsnorm_backward(
                &dqkv,
                (&dq, &dk),
                &x,
                (&qw, &kw),
                &rstd,
                s,
                acc,
                Some(&found),
            )
            .unwrap();
            vec![
                ("out", download(b, &out)),
                ("rstd", download(b, &rstd)),
                ("dqkv", download(b, &dqkv)),
                ("dqkv amax", download(b, &found)),
                ("dq_norm", download(b, &dq)),
                ("dk_norm", download(b, &dk)),
            ]
        }
        for dtype in [DType::BF16, DType::F32] {
            for acc in [false, true] {
                let name = format!("head_rmsnorm {rows}x{w} D{d} {dtype} accumulate={acc}");
                let shape = (rows, s, heads);
                let gpu_out = check_op(
                    &name,
                    || run(&gpu, dtype, acc, shape, &x, &dy, (&qw, &kw), &dw0),
                    || run(&cpu, dtype, acc, shape, &x, &dy, (&qw, &kw), &dw0),
                    // rstd is f32 from identical inputs; the weights' gradients are sums of
                    // rows·heads products, in another order than the CPU's.
                    |output| match output {
                        "rstd" => 1e-5,
                        "dq_norm" | "dk_norm" => 1e-3_f64.max(tol(dtype)),
                        _ => tol(dtype),
                    },
                );
                check_amax(&name, &gpu_out, "dqkv", "dqkv amax");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn matmul_all_modes() {
    let (gpu, cpu) = (cuda(), Cpu::<f32>::new());
    // (m, k, n): a Qwen2.5-0.5B MLP shape, and an odd-aligned one viewed 3 rows into its
    // storage so that the pointers are only 16-byte aligned; then one row (a generated
    // token's, whose forward product gemv.cu makes) at Qwen2.5-0.5B's QKV shape, and with K
    // not a whole number of 16 bytes.
    let shapes = [
        (2048, 896, 4864, 0),
        (200, 904, 136, 3),
        (1, 896, 1152, 0),
        (1, 900, 136, 3),
    ];
    for (m, k, n, skip) in shapes {
        let (x, w, dy, bias, acc0) = (
            normal((m + skip) * k, 1.0, 12),
            normal(n * k, 0.05, 13),
            normal(m * n, 1.0, 14),
            normal(n, 1.0, 15),
            normal(n * k, 1.0, 16),
        );
        #[allow(clippy::too_many_arguments)]
        fn run<B: Backend>(
            b: &B, dtype: DType, (m, k, n, skip): (usize, usize, usize, usize), x: &[f32],
            w: &[f32], dy: &[f32], bias: &[f32], acc0: &[f32],
        ) -> Outputs {
            let t = |shape: &[usize], v: &[f32]| tensor(b, shape, dtype, v);
            let x = t(&[m + skip, k], x).narrow_rows(skip, skip + m);
            let (w, dy, bias) = (t(&[n, k], w), t(&[m, n], dy), t(&[n], bias));
            let y = t(&[m, n], &vec![0.0; m * n]);
            b.matmul(&y, &x, &w, Some(&bias), Matmul::FORWARD).unwrap();
            let dx = t(&[m, k], &vec![0.0; m * k]);
            b.matmul(&dx, &dy, &w, None, Matmul::BACKWARD_INPUT)
                .unwrap();
            let dw = t(&[n, k], &vec![0.0; n * k]);
            b.matmul(&dw, &dy, &x, None, Matmul::backward_weight(false))
                .unwrap();
            let dw_acc = t(&[n, k], acc0);
            b.matmul(&dw_acc, &dy, &x, None, Matmul::backward_weight(true))
                .unwrap();
            // Both operands transposed (unused by the model): xᵀ · zᵀ with z stored [64, m].
            let z = t(&[64, m], &download(b, &x)[..64 * m]);
            let both = t(&[k, 64], &vec![0.0; k * 64]);
            let spec = Matmul {
                trans_a: true,
                trans_b: true,
                ..Matmul::default()
            };
            b.matmul(&both, &x, &z, None, spec).unwrap();
            vec![
                ("forward + bias", download(b, &y)),
                ("backward input", download(b, &dx)),
                ("backward weight", download(b, &dw)),
                ("backward weight accumulate", download(b, &dw_acc)),
                ("both transposed", download(b, &both)),
            ]
        }
        for dtype in [DType::BF16, DType::F32] {
            let name = format!("matmul {m}x{k}x{n} {dtype}");
            let shape = (m, k, n, skip);
            check_op(
                &name,
                || run(&gpu, dtype, shape, &x, &w, &dy, &bias, &acc0),
                || run(&cpu, dtype, shape, &x, &w, &dy, &bias, &acc0),
                |_| tol(dtype),
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bias_backward() {
    let (gpu, cpu) = (cuda(), Cpu::<f32>::new());
    // (n, c, skip): the 0.5B qkv bias on the 16-byte path; a view one element into its
    // storage and an odd width, both element by element.
    for (n, c, skip) in [(8192, 1152, 0), (300, 904, 1), (257, 37, 0)] {
        let (dy, db0) = (normal(n * c, 1.0, 17), normal(c, 1.0, 18));
        fn run<B: Backend>(
            b: &B, dtype: DType, acc: bool, skip: usize, dy: &[f32], db0: &[f32],
        ) -> Outputs {
            let c = db0.len();
            let n = dy.len() / c;
            let (dy, db) = (
                shifted(b, &[n, c], dtype, dy, skip),
                tensor(b, &[c], dtype, db0),
            );
            b.bias_backward(&db, &dy, acc).unwrap();
            vec![("dbias", download(b, &db))]
        }
        for dtype in [DType::BF16, DType::F32] {
            for acc in [false, true] {
                // f32 sums of 8192 rows in another order: ~sqrt(n)·2⁻²⁴ relative, under 1e-5.
                check_op(
                    &format!("bias_backward {n}x{c} skip {skip} {dtype} accumulate={acc}"),
                    || run(&gpu, dtype, acc, skip, &dy, &db0),
                    || run(&cpu, dtype, acc, skip, &dy, &db0),
                    |_| tol(dtype),
                );
            }
        }
    }
}

/// (cos, sin) of t·θ^(−2i/D), as the model builds it.
fn rope_table(seq: usize, d: usize) -> Vec<f32> {
    let mut table = vec![];
    for t in 0..seq {
        for i in 0..d / 2 {
            let angle = t as f64 * 1e6f64.powf(-2.0 * i as f64 / d as f64);
            table.extend([angle.cos() as f32, angle.sin() as f32]);
        }
    }
    table
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn rope_forward_and_backward() {
    let (gpu, cpu) = (cuda(), Cpu::<f32>::new());
    let qwen = AttnShape {
        batch: 4,
        seq: 1024,
        q_heads: 14,
        kv_heads: 2,
        head_dim: 64,
    };
    let small = AttnShape {
        batch: 3,
        seq: 100,
        q_heads: 3,
        kv_heads: 1,
        head_dim: 80,
    };
    let wide = AttnShape {
        batch: 2,
        seq: 256,
        q_heads: 12,
        kv_heads: 2,
        head_dim: 128,
    };
    // The 0.5B shape, the 1.5B heads and a small shape with head_dim 80 on the 16-byte path,
    // and the small one in a view one element into its storage, element by element. The
    // backward with the bias gradient runs in one pass on the 16-byte path (heads of 64 and
    // 128 pair lanes 4 and 8 apart; of 80, 5 apart in strips of 240 or 80 columns), in two
    // passes on the other. With documents (of that mean length) each row's position counts
    // from its document's start, and the bias gradient takes the two passes.
    let cases = [
        (qwen, 0, None),
        (wide, 0, None),
        (small, 0, None),
        (small, 1, None),
        (qwen, 0, Some(300)),
        (small, 0, Some(20)),
    ];
    for (s, skip, mean) in cases {
        let n = s.batch * s.seq * s.qkv_width();
        let spans = mean.map(|mean| {
            let (tokens, _) = packed_batch(s.batch * s.seq, s.seq, mean, 1000, 24);
            documents::spans(&tokens, s.seq, EOS)
        });
        let spans = spans.as_deref();
        let (mut x, table) = (normal(n, 1.0, 19), rope_table(s.seq, s.head_dim));
        // The largest value in a value head, which the backward's abs-max must still see.
        x[5 * s.qkv_width() + (s.q_heads + s.kv_heads) * s.head_dim + 3] = -40.0;
        let bias = normal(s.qkv_width(), 1.0, 23);
        fn run<B: Backend>(
            b: &B, dtype: DType, (s, skip): (AttnShape, usize), (x, bias): (&[f32], &[f32]),
            table: &[f32], spans: Option<&[i32]>,
        ) -> Outputs {
            let shape = [s.batch * s.seq, s.qkv_width()];
            let freqs = tensor(b, &[s.seq, s.head_dim / 2, 2], DType::F32, table);
            let docs = spans.map(|spans| tensor_i32(b, spans));
            let docs = docs.as_ref();
            let fwd = shifted(b, &shape, dtype, x, skip);
            b.rope_forward(&fwd, &freqs, s, docs).unwrap();
            let bwd = shifted(b, &shape, dtype, x, skip);
            let found = amax(b);
            b.rope_backward(&bwd, &freqs, s, docs, Some(&found), None)
                .unwrap();
            let both = shifted(b, &shape, dtype, x, skip);
            let (dbias, added) = (
                tensor(b, &[shape[1]], dtype, &vec![0.0; shape[1]]),
                tensor(b, &[shape[1]], dtype, bias),
            );
            b.rope_backward(&both, &freqs, s, docs, None, Some((&dbias, false)))
                .unwrap();
            let again = shifted(b, &shape, dtype, x, skip);
            b.rope_backward(&again, &freqs, s, docs, None, Some((&added, true)))
                .unwrap();
            vec![
                ("forward", download(b, &fwd)),
                ("backward", download(b, &bwd)),
                ("backward amax", download(b, &found)),
                ("backward with the bias gradient", download(b, &both)),
                ("bias gradient", download(b, &dbias)),
                ("bias gradient added", download(b, &added)),
            ]
        }
        for dtype in [DType::BF16, DType::F32] {
            let docs = mean.map_or(String::new(), |m| format!(" documents of ~{m}"));
            let test = format!("rope D={} skip {skip} {dtype}{docs}", s.head_dim);
            let outputs = check_op(
                &test,
                || run(&gpu, dtype, (s, skip), (&x, &bias), &table, spans),
                || run(&cpu, dtype, (s, skip), (&x, &bias), &table, spans),
                |_| tol(dtype),
            );
            // Over the rotated heads and the value heads it only reads.
            check_amax(&test, &outputs, "backward", "backward amax");
            let same = same_bits(&outputs[1].1, &outputs[3].1);
            figure(
                &test,
                format!("backward with the bias gradient bitwise the backward alone: {same}"),
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn swiglu_forward_and_backward() {
    let (gpu, cpu) = (cuda(), Cpu::<f32>::new());
    let (n, f) = (4096, 4864);
    let (gu, dy) = (normal(n * 2 * f, 2.0, 20), normal(n * f, 1.0, 21));
    fn run<B: Backend>(b: &B, dtype: DType, f: usize, gu: &[f32], dy: &[f32]) -> Outputs {
        let n = dy.len() / f;
        let gate_up = tensor(b, &[n, 2 * f], dtype, gu);
        let (out, out_amax) = (tensor(b, &[n, f], dtype, &vec![0.0; n * f]), amax(b));
        b.swiglu_forward(&out, &gate_up, Some(&out_amax)).unwrap();
        let (dout, dgu) = (
            tensor(b, &[n, f], dtype, dy),
            tensor(b, &[n, 2 * f], dtype, &vec![0.0; n * 2 * f]),
        );
        let dgu_amax = amax(b);
        b.swiglu_backward(&dgu, &dout, &gate_up, Some(&dgu_amax))
            .unwrap();
        // In place, as the model runs it: the gradient over gate/up itself.
        let in_place = tensor(b, &[n, 2 * f], dtype, gu);
        b.swiglu_backward(&in_place, &dout, &in_place, None)
            .unwrap();
        vec![
            ("out", download(b, &out)),
            ("out amax", download(b, &out_amax)),
            ("dgate_up", download(b, &dgu)),
            ("dgate_up amax", download(b, &dgu_amax)),
            ("dgate_up in place", download(b, &in_place)),
        ]
    }
    for dtype in [DType::BF16, DType::F32] {
        let name = format!("swiglu {dtype}");
        let gpu_out = check_op(
            &name,
            || run(&gpu, dtype, f, &gu, &dy),
            || run(&cpu, dtype, f, &gu, &dy),
            |_| tol(dtype),
        );
        check_amax(&name, &gpu_out, "out", "out amax");
        check_amax(&name, &gpu_out, "dgate_up", "dgate_up amax");
        let (apart, in_place) = (
            output(&gpu_out, "dgate_up"),
            output(&gpu_out, "dgate_up in place"),
        );
        assert!(same_bits(apart, in_place), "{name}: in place differs");
        figure(&name, "dgate_up in place bitwise equal");
    }
}

/// In bf16 the GPU's sigmoid comes from one `tanh.approx.f32` (common.cuh), whose relative
/// error PTX bounds by 2^-10.987 (ε): σ(x) = (1 + tanh(x/2)) / 2 is then off by at most ε/2
/// and silu by ε|x|/2, on top of the output's own rounding (half a bf16 step, at most 2^-8
/// relative). Every gate value of a grid over [-32, 32], with up and the output gradient 1,
/// against f64's exact SwiGLU.
#[test]
#[ignore = "needs a CUDA GPU"]
fn swiglu_in_bf16_stays_within_its_sigmoid_bound() {
    let gpu = cuda();
    let f = 8192;
    let grid: Vec<f32> = (0..f)
        .map(|i| -32.0 + 64.0 * i as f32 / (f - 1) as f32)
        .collect();
    let gate_up = tensor(
        &gpu,
        &[1, 2 * f],
        DType::BF16,
        &[grid, vec![1.0; f]].concat(),
    );
    let out = tensor(&gpu, &[1, f], DType::BF16, &vec![0.0; f]);
    gpu.swiglu_forward(&out, &gate_up, None).unwrap();
    let dout = tensor(&gpu, &[1, f], DType::BF16, &vec![1.0; f]);
    let dgu = tensor(&gpu, &[1, 2 * f], DType::BF16, &vec![0.0; 2 * f]);
    gpu.swiglu_backward(&dgu, &dout, &gate_up, None).unwrap();
    let (g, out, dgu) = (
        download(&gpu, &gate_up),
        download(&gpu, &out),
        download(&gpu, &dgu),
    );
    let tanh_error = 2f64.powf(-10.987);
    let rounding = 2f64.powi(-8); // half a bf16 step, relative, at its widest
    let sigma = |x: f64| 1.0 / (1.0 + (-x).exp());
    let exact = |of: &dyn Fn(f64) -> f64| g[..f].iter().map(|&x| of(x as f64)).collect::<Vec<_>>();
    let (silu, dsilu) = (
        exact(&|x| x * sigma(x)),
        exact(&|x| sigma(x) * (1.0 + x * (1.0 - sigma(x)))),
    );
    // (name, GPU values, exact values, the bound's slope in |x| and constant, in units of ε)
    let checks = [
        ("silu", &out[..], &silu, 0.5, 0.0),
        // d/dσ of σ(1 + x(1 − σ)) is 1 + x − 2xσ, at most 1 + 3|x|, times σ's ε/2.
        ("dgate", &dgu[..f], &dsilu, 1.5, 0.5),
        ("dup", &dgu[f..], &silu, 0.5, 0.0),
    ];
    for (name, got, want, slope, constant) in checks {
        let mut worst: f64 = 0.0;
        for ((&x, &v), &want) in g[..f].iter().zip(got).zip(want) {
            let x = x as f64;
            // The f32 arithmetic around the tanh adds a few 2^-24 relative, and the output
            // rounds what it computed, not the exact value: 1% of slack covers both.
            let bound = tanh_error * (slope * x.abs() + constant) + rounding * want.abs();
            let err = (v as f64 - want).abs();
            assert!(
                err <= bound * 1.01 + 1e-30,
                "swiglu bf16 {name} at x = {x}: {v} against {want}, error {err:e} over {bound:e}"
            );
            worst = worst.max(err / bound);
        }
        figure(
            "swiglu bf16 sigmoid",
            format!("{name}: largest error {worst:.3} of its bound"),
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn attention_forward_and_backward() {
    let (gpu, cpu) = (cuda(), Cpu::<f32>::new());
    let shape = |batch, seq, q_heads, kv_heads, head_dim| AttnShape {
        batch,
        seq,
        q_heads,
        kv_heads,
        head_dim,
    };
    // Each with, where given, documents of that mean length packed into its sequences.
    let cases = [
        (shape(2, 1024, 8, 2, 64), DType::BF16, None),
        (shape(2, 1024, 8, 2, 64), DType::F32, None),
        (shape(1, 4096, 4, 2, 128), DType::BF16, None),
        (shape(2, 256, 4, 2, 80), DType::BF16, None),
        (shape(2, 256, 6, 3, 96), DType::BF16, None),
        (shape(2, 256, 4, 1, 128), DType::BF16, None),
        // A group of 7 over a grid that fills under half the GPU: dK/dV splits it into
        // shares, of unequal sizes where the load allows (on an H100, 4 of 1, 2, 2, 2 heads;
        // `dkdv_splits`' tests).
        (shape(48, 256, 7, 1, 64), DType::BF16, None),
        // Plain multi-head attention, and a length that is no multiple of the 32-row tiles.
        (shape(1, 300, 4, 4, 64), DType::F32, None),
        (shape(1, 300, 4, 4, 64), DType::BF16, None),
        // Documents: of ~300 tokens, across the 64-row tiles; of ~20, several in a tile; in a
        // split dK/dV; and in a sequence that ends inside a tile.
        (shape(2, 1024, 8, 2, 64), DType::BF16, Some(300)),
        (shape(2, 1024, 8, 2, 64), DType::F32, Some(300)),
        (shape(2, 1024, 14, 2, 64), DType::BF16, Some(20)),
        (shape(1, 4096, 4, 2, 128), DType::BF16, Some(700)),
        (shape(48, 256, 7, 1, 64), DType::BF16, Some(40)),
        (shape(1, 300, 4, 4, 64), DType::BF16, Some(50)),
    ];
    fn run<B: Backend>(
        b: &B, dtype: DType, s: AttnShape, qkv: &[f32], dout: &[f32], spans: Option<&[i32]>,
    ) -> Outputs {
        let docs = spans.map(|spans| tensor_i32(b, spans));
        let docs = docs.as_ref();
        let rows = s.batch * s.seq;
        let q = s.q_heads * s.head_dim;
        let qkv = tensor(b, &[rows, s.qkv_width()], dtype, qkv);
        let out = tensor(b, &[rows, q], dtype, &vec![0.0; rows * q]);
        let lse = tensor(
            b,
            &[s.batch, s.q_heads, s.seq],
            DType::F32,
            &vec![0.0; rows * s.q_heads],
        );
        let out_amax = amax(b);
        b.attention_forward(&out, &lse, &qkv, s, docs, Some(&out_amax))
            .unwrap();
        let dout = tensor(b, &[rows, q], dtype, dout);
        let dqkv = tensor(
            b,
            &[rows, s.qkv_width()],
            dtype,
            &vec![0.0; rows * s.qkv_width()],
        );
        b.attention_backward(&dqkv, &dout, &qkv, &out, &lse, s, docs)
            .unwrap();
        vec![
            ("out", download(b, &out)),
            ("out amax", download(b, &out_amax)),
            ("lse", download(b, &lse)),
            ("dqkv", download(b, &dqkv)),
        ]
    }
    for (i, (s, dtype, mean)) in cases.into_iter().enumerate() {
        let rows = s.batch * s.seq;
        // Entries of std 1.5 give scores of std ~2: attention far from uniform.
        let qkv = normal(rows * s.qkv_width(), 1.5, 30 + i as u64);
        let dout = normal(rows * s.q_heads * s.head_dim, 1.0, 40 + i as u64);
        let spans = mean.map(|mean| {
            let (tokens, _) = packed_batch(rows, s.seq, mean, 1000, 50 + i as u64);
            documents::spans(&tokens, s.seq, EOS)
        });
        let spans = spans.as_deref();
        let cpu_out = run(&cpu, dtype, s, &qkv, &dout, spans);
        // The tensor-core kernels serve bf16 only; f32 always runs the CUDA-core ones. Wgmma
        // runs the mma.sync kernels off Hopper and at head sizes that are no multiple of 64.
        let versions: &[AttentionKernels] = if dtype == DType::BF16 {
            &[
                AttentionKernels::Wgmma,
                AttentionKernels::MmaSync,
                AttentionKernels::Simple,
            ]
        } else {
            &[AttentionKernels::Simple]
        };
        for &version in versions {
            gpu.set_attention_kernels(version);
            let docs = mean.map_or(String::new(), |m| format!(" documents of ~{m}"));
            let name = format!(
                "attention {version:?} {dtype} B{} T{} H{}/{} D{}{docs}",
                s.batch, s.seq, s.q_heads, s.kv_heads, s.head_dim
            );
            let gpu_out = check_op(
                &name,
                || run(&gpu, dtype, s, &qkv, &dout, spans),
                || cpu_out.clone(),
                |output| match (output, dtype) {
                    // f32 log-sum-exps of identical inputs, summed in another order.
                    ("lse", _) => 1e-5,
                    // Gradients in f32 storage: sums over up to T terms in another order,
                    // with the cancellation in dout·v − delta, stay within 1e-4.
                    ("dqkv", DType::F32) => 1e-4,
                    // bf16: besides the output's rounding, the tensor-core kernels round P
                    // and dS to bf16 for the MMAs (relative 2⁻⁹ per term, ~4e-3 in all in a
                    // float64 emulation of the kernels); 1e-2 still holds.
                    _ => tol(dtype),
                },
            );
            check_amax(&name, &gpu_out, "out", "out amax");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn attention_decode() {
    let (gpu, cpu) = (cuda(), Cpu::<f32>::new());
    let shape = |seq, q_heads, kv_heads, head_dim| AttnShape {
        batch: 1,
        seq,
        q_heads,
        kv_heads,
        head_dim,
    };
    // Caches of one position and more, each query at a position (the second figure) whose
    // keys are and are not multiples of a block's 32 row groups, some with rows after it that
    // the query must not see; every supported head size, with and without GQA.
    let cases = [
        (shape(1, 4, 2, 64), 0),
        (shape(31, 14, 2, 64), 30),
        (shape(300, 4, 4, 80), 150),
        (shape(1000, 6, 2, 96), 999),
        (shape(4097, 16, 2, 128), 4096),
        (shape(4097, 16, 2, 128), 700),
    ];
    fn run<B: Backend>(b: &B, dtype: DType, s: AttnShape, at: usize, qkv: &[f32]) -> Outputs {
        let q = s.q_heads * s.head_dim;
        let qkv = tensor(b, &[s.seq, s.qkv_width()], dtype, qkv);
        let out = tensor(b, &[1, q], dtype, &vec![0.0; q]);
        let at = tensor_i32(b, &[at as i32]);
        b.attention_decode(&out, &qkv, &at, s).unwrap();
        vec![("out", download(b, &out))]
    }
    for (i, (s, at)) in cases.into_iter().enumerate() {
        let qkv = normal(s.seq * s.qkv_width(), 1.5, 50 + i as u64);
        for dtype in [DType::BF16, DType::F32] {
            let name = format!(
                "attention_decode {dtype} T{} at {at} H{}/{} D{}",
                s.seq, s.q_heads, s.kv_heads, s.head_dim
            );
            // An online softmax over the row groups against the CPU's two passes: the same
            // terms summed in another order.
            check_op(
                &name,
                || run(&gpu, dtype, s, at, &qkv),
                || run(&cpu, dtype, s, at, &qkv),
                |_| tol(dtype),
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cross_entropy_with_z_loss() {
    let (gpu, cpu) = (cuda(), Cpu::<f32>::new());
    // On Hopper, rows that fit a cluster's registers take `cross_entropy_cluster`: Qwen's
    // vocabulary in bf16, and the small ones in both dtypes (at 24 entries, five of a row's
    // eight blocks have nothing); Qwen's in f32 takes the one-block kernel.
    for v in [151_936, 1_000, 24] {
        cross_entropy_case(&gpu, &cpu, v);
    }
}

fn cross_entropy_case(gpu: &impl Backend, cpu: &Cpu<f32>, v: usize) {
    let rows = 64;
    let mut logits = normal(rows * v, 3.0, 22);
    let mut rng = Rng::new(23);
    let mut targets: Vec<i32> = (0..rows).map(|_| rng.below(v) as i32).collect();
    for i in [5, 17, 63] {
        targets[i] = IGNORE_INDEX;
    }
    // Masked logits: row 9 starts with -inf, so every thread's first values are -inf (at
    // Qwen's vocabulary, for every thread of the one-block kernel), which its running sum
    // must skip; its target lies past them.
    let masked = (v / 2).min(8192);
    logits[9 * v..9 * v + masked].fill(f32::NEG_INFINITY);
    targets[9] = v as i32 - 1;
    fn run<B: Backend>(
        b: &B, dtype: DType, v: usize, logits: &[f32], targets: &[i32], grad: Option<f32>,
    ) -> Outputs {
        let rows = targets.len();
        let l = tensor(b, &[rows, v], dtype, logits);
        let losses = tensor(b, &[rows], DType::F32, &vec![0.0; rows]);
        let t = tensor_i32(b, targets);
        let scale = grad.map(|g| tensor(b, &[1], DType::F32, &[g]));
        b.cross_entropy(&l, &losses, &t, 1e-4, scale.as_ref())
            .unwrap();
        let mut outputs = vec![("losses", download(b, &losses))];
        // Without a gradient the logits stay as they were (-inf included).
        if grad.is_some() {
            outputs.push(("logits after", download(b, &l)));
        }
        outputs
    }
    for dtype in [DType::BF16, DType::F32] {
        for grad in [None, Some(1.0 / 61.0)] {
            check_op(
                &format!("cross_entropy V={v} {dtype} grad={grad:?}"),
                || run(gpu, dtype, v, &logits, &targets, grad),
                || run(cpu, dtype, v, &logits, &targets, grad),
                // Losses are log-sum-exps of identical inputs over up to 152k terms, summed in
                // f64 on the CPU and as a tree of f32 partial sums on the GPU, whose error grows
                // with the tree's depth, about 17 roundings of 2^-24 at 152k: 1e-5 holds it with
                // room, while a sequential f32 sum (1.4e-5 from the GPU's on an H100) or a wrong formula
                // fails. That
                // error in the log-sum-exp is also the relative error of every softmax entry of
                // the f32 gradient; bf16 gradients keep the bf16 tolerance.
                |name| {
                    if name == "losses" || dtype == DType::F32 {
                        1e-5
                    } else {
                        tol(dtype)
                    }
                },
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn sum_squares() {
    let (gpu, cpu) = (cuda(), Cpu::<f32>::new());
    let n = 1_000_003;
    // Two views of n elements into n + 3, in one call, with an absent tensor between them:
    // from the start (16-byte loads at once) and 3 in (after a head of element-wise loads);
    // a tail either way (n is odd). The elements outside each view are 1e4, which would
    // dominate a sum if read, and the sums start at 1e4, which they would keep if the sum
    // added to them or skipped them (the absent tensor's must become 0).
    let values = normal(n + 3, 1.0, 24);
    fn run<B: Backend>(b: &B, dtype: DType, xs: [&[f32]; 2]) -> Outputs {
        let n = xs[0].len() - 3;
        let views = [
            tensor(b, &[n + 3], dtype, xs[0]).narrow_rows(0, n),
            tensor(b, &[n + 3], dtype, xs[1]).narrow_rows(3, 3 + n),
        ];
        let sums = tensor(b, &[3], DType::F32, &[1e4; 3]);
        b.sum_squares(&sums, &[Some(&views[0]), None, Some(&views[1])])
            .unwrap();
        let total = tensor(b, &[1], DType::F32, &[1e4]);
        b.sum(&total, &sums).unwrap();
        vec![("sums", download(b, &sums)), ("total", download(b, &total))]
    }
    for dtype in [DType::BF16, DType::F32] {
        let (mut head, mut tail) = (values.clone(), values.clone());
        head[n..].fill(1e4);
        tail[..3].fill(1e4);
        let squares = |x: &[f32], skip: usize| -> f64 {
            download(&cpu, &tensor(&cpu, &[n + 3], dtype, x))[skip..skip + n]
                .iter()
                .map(|&v| v as f64 * v as f64)
                .sum()
        };
        let exact = [squares(&head, 0), 0.0, squares(&tail, 3)];
        // The CPU sums the squares in f64 and rounds once; the GPU's tree of f32 partial
        // sums is within 1e-5 of it, and of the exact f64 sums below.
        let name = format!("sum_squares {dtype}");
        let gpu_out = check_op(
            &name,
            || run(&gpu, dtype, [&head, &tail]),
            || run(&cpu, dtype, [&head, &tail]),
            |_| 1e-5,
        );
        let sums = output(&gpu_out, "sums");
        assert_eq!(sums[1], 0.0, "{name}: the absent tensor's sum");
        let total = exact.iter().sum::<f64>();
        let errs = [
            (sums[0] as f64 - exact[0]).abs() / exact[0],
            (sums[2] as f64 - exact[2]).abs() / exact[2],
            (output(&gpu_out, "total")[0] as f64 - total).abs() / total,
        ];
        let err = errs.iter().copied().fold(0.0, f64::max);
        figure(&name, format!("vs f64 rel err {err:.2e} (tol 1e-5)"));
        assert!(err <= 1e-5, "{name}: {errs:?} from the f64 sums");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn adamw_matches_the_cpu_bit_for_bit() {
    let (gpu, cpu) = (cuda(), Cpu::<f32>::new());
    let n = 1_000_003;
    let (p0, g1, g2) = (
        normal(n, 0.05, 25),
        normal(n, 1e-3, 26),
        normal(n, 1e-3, 27),
    );
    struct Case {
        param: DType,
        grad: DType,
        moments: DType,
        master: bool,
    }
    let cases = [
        // llm.q's setting: everything bf16, stochastic rounding everywhere.
        Case {
            param: DType::BF16,
            grad: DType::BF16,
            moments: DType::BF16,
            master: false,
        },
        Case {
            param: DType::BF16,
            grad: DType::BF16,
            moments: DType::F32,
            master: true,
        },
        Case {
            param: DType::F32,
            grad: DType::F32,
            moments: DType::F32,
            master: false,
        },
        Case {
            param: DType::BF16,
            grad: DType::F32,
            moments: DType::BF16,
            master: true,
        },
        // 8-bit moments (n is 3,906 blocks of 256 and a partial one), with and without a
        // master copy.
        Case {
            param: DType::BF16,
            grad: DType::BF16,
            moments: DType::Q8,
            master: false,
        },
        Case {
            param: DType::BF16,
            grad: DType::BF16,
            moments: DType::Q8,
            master: true,
        },
        Case {
            param: DType::F32,
            grad: DType::F32,
            moments: DType::Q8,
            master: false,
        },
    ];
    /// `values` viewed `skip` elements into a fresh tensor that has a guard element after
    /// them too: (the view, the whole tensor).
    fn guarded<B: Backend>(
        b: &B, dtype: DType, skip: usize, values: &[f32],
    ) -> (Tensor<B>, Tensor<B>) {
        let guard = -1.5;
        let mut all = vec![guard; skip];
        all.extend(values);
        all.push(guard);
        let whole = tensor(b, &[all.len()], dtype, &all);
        (whole.narrow_rows(skip, skip + values.len()), whole)
    }
    /// The skips of the tensors of one update, (param, the others): fresh tensors, 16-byte
    /// accesses throughout, then a tail of n % 8 = 3 elements; all views 3 elements in, so
    /// every tensor is 16-byte aligned 5 elements further, a head of 5 then 16-byte accesses;
    /// the param 1 element in and the others not, so no element where all are aligned and
    /// element by element (a second launch). The middle one does not decay, and the last one
    /// reports no abs-max.
    const SKIPS: [(usize, usize); 3] = [(0, 0), (3, 3), (1, 0)];
    const PARAMS: [&str; 3] = ["param 0", "param 1", "param 2"];
    const AMAXES: [&str; 2] = ["param 0 amax", "param 1 amax"];
    const SCALES: [[&str; 2]; 3] = [
        ["m absmax 0", "v absmax 0"],
        ["m absmax 1", "v absmax 1"],
        ["m absmax 2", "v absmax 2"],
    ];
    const WHOLES: [[&str; 4]; 3] = [
        ["whole param 0", "whole m 0", "whole v 0", "whole master 0"],
        ["whole param 1", "whole m 1", "whole v 1", "whole master 1"],
        ["whole param 2", "whole m 2", "whole v 2", "whole master 2"],
    ];
    /// Two steps, each one call over the tensors of `SKIPS`; the whole tensors come back, so
    /// a write outside a view shows too.
    fn run<B: Backend>(b: &B, c: &Case, p0: &[f32], grads: [&[f32]; 2]) -> Outputs {
        let n = p0.len();
        struct State<B: Backend> {
            param: (Tensor<B>, Tensor<B>),
            master: Option<(Tensor<B>, Tensor<B>)>,
            m: (Tensor<B>, Tensor<B>),
            v: (Tensor<B>, Tensor<B>),
            scales: Option<[(Tensor<B>, Tensor<B>); 2]>,
            amaxes: [Tensor<B>; 2],
        }
        let states: Vec<State<B>> = SKIPS
            .iter()
            .map(|&(param_skip, skip)| State {
                param: guarded(b, c.param, param_skip, p0),
                master: c.master.then(|| guarded(b, DType::F32, skip, p0)),
                m: guarded(b, c.moments, skip, &vec![0.0; n]),
                v: guarded(b, c.moments, skip, &vec![0.0; n]),
                scales: (c.moments == DType::Q8).then(|| {
                    let zeros = vec![0.0; absmax_len(n)];
                    [0, 1].map(|_| guarded(b, DType::F32, skip, &zeros))
                }),
                amaxes: [amax(b), amax(b)],
            })
            .collect();
        // Step 1 is clipped (norm 2 > 1), step 2 is not (norm 0.5). Each step reports the
        // updated params' abs-maxes into their own slots; the last ones are checked.
        for (step, (g, norm_sq)) in grads.iter().zip([4.0f32, 0.25]).enumerate() {
            let grads: Vec<_> = SKIPS
                .iter()
                .map(|&(_, skip)| guarded(b, c.grad, skip, g).0)
                .collect();
            let norm = tensor(b, &[1], DType::F32, &[norm_sq]);
            let hp = AdamW {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
                step: step as u64 + 1,
                grad_clip: 1.0,
            };
            let tensors: Vec<_> = states
                .iter()
                .zip(&grads)
                .enumerate()
                .map(|(k, (s, grad))| AdamWTensor {
                    param: &s.param.0,
                    master: s.master.as_ref().map(|(view, _)| view),
                    grad,
                    m: &s.m.0,
                    v: &s.v.0,
                    scales: s
                        .scales
                        .as_ref()
                        .map(|[m, v]| MomentScales { m: &m.0, v: &v.0 }),
                    decays: k != 1,
                    seed: 0x5EED + 16 * k as u64 + step as u64,
                    amax: (k < AMAXES.len()).then(|| &s.amaxes[step]),
                })
                .collect();
            b.adamw(&tensors, &norm, &hp).unwrap();
        }
        let mut out = Vec::new();
        for (k, s) in states.iter().enumerate() {
            out.push((PARAMS[k], download(b, &s.param.0)));
            if let Some(name) = AMAXES.get(k) {
                out.push((*name, download(b, &s.amaxes[1])));
            }
            let wholes = [Some(&s.param.1), Some(&s.m.1), Some(&s.v.1)]
                .into_iter()
                .chain([s.master.as_ref().map(|(_, whole)| whole)]);
            for (name, whole) in WHOLES[k].iter().zip(wholes) {
                if let Some(whole) = whole {
                    out.push((*name, download(b, whole)));
                }
            }
            if let Some([m, v]) = &s.scales {
                out.push((SCALES[k][0], download(b, &m.1)));
                out.push((SCALES[k][1], download(b, &v.1)));
            }
        }
        out
    }
    for c in &cases {
        // The kernel runs the CPU's f32 operations uncontracted and rounds with the CPU's
        // hash, so the bits must agree exactly (and so must the abs-max of equal params).
        let name = format!(
            "adamw param {} grad {} moments {} master {}",
            c.param, c.grad, c.moments, c.master
        );
        let gpu_out = check_op(
            &name,
            || run(&gpu, c, &p0, [&g1, &g2]),
            || run(&cpu, c, &p0, [&g1, &g2]),
            |_| 0.0,
        );
        for (param, amax) in PARAMS.iter().zip(AMAXES) {
            check_amax(&name, &gpu_out, param, amax);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn abs_max_is_exact() {
    let (gpu, cpu) = (cuda(), Cpu::<f32>::new());
    // A length the 16-byte loads divide, and an odd one viewed 3 elements into its storage
    // (element-wise loads, and a tail).
    for (n, skip) in [(1 << 22, 0), (1_000_003, 3)] {
        let mut x = normal(n + skip, 2.0, 50);
        x[skip + n / 3] = -37.5; // the largest magnitude is a negative value
        x[0] = 1e4; // outside the view when skip > 0
        fn run<B: Backend>(b: &B, dtype: DType, skip: usize, x: &[f32]) -> Outputs {
            let t = tensor(b, &[x.len()], dtype, x).narrow_rows(skip, x.len());
            let (found, kept) = (amax(b), tensor(b, &[1], DType::F32, &[100.0]));
            b.abs_max(&found, &t).unwrap();
            b.abs_max(&kept, &t).unwrap();
            vec![
                ("amax", download(b, &found)),
                ("amax raised from 100", download(b, &kept)),
            ]
        }
        for dtype in [DType::BF16, DType::F32] {
            // A max of the same stored values in any order: exact.
            check_op(
                &format!("abs_max {dtype} n={n} skip={skip}"),
                || run(&gpu, dtype, skip, &x),
                || run(&cpu, dtype, skip, &x),
                |_| 0.0,
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn quantize_matches_the_cpu_bit_for_bit() {
    let (gpu, cpu) = (cuda(), Cpu::<f32>::new());
    // A model-like activation (16-byte loads, word stores), and an odd shape that takes the
    // element-wise paths and partial tiles.
    for (r, c) in [(2048, 896), (100, 37)] {
        let mut x = normal(r * c, 1.0, 51);
        x[7] = 300.0;
        x[r * c / 2] = -5000.0;
        #[allow(clippy::too_many_arguments)]
        fn run<B: Backend>(
            b: &B, x_dtype: DType, dtype: DType, (rows, cols): (bool, bool),
            (r, c): (usize, usize), x: &[f32],
        ) -> Outputs {
            let xt = tensor(b, &[r, c], x_dtype, x);
            let zeros = tensor(b, &[r, c], x_dtype, &vec![0.0; r * c]);
            let exact = amax(b);
            b.abs_max(&exact, &xt).unwrap();
            let value = download(b, &exact)[0];
            // Scaled by the true abs-max; by a 16th of it, so that most large values saturate;
            // by an infinite one (scale 1, where 5000 saturates e4m3); and zeros with amax 0.
            let (small, inf) = (
                tensor(b, &[1], DType::F32, &[value / 16.0]),
                tensor(b, &[1], DType::F32, &[f32::INFINITY]),
            );
            let zero = amax(b);
            let out = |wanted: bool, shape: [usize; 2]| {
                wanted.then(|| tensor(b, &shape, dtype, &vec![0.0; r * c]))
            };
            let mut outs = vec![];
            let cases: [(&'static str, &'static str, &Tensor<B>, &Tensor<B>); 4] = [
                ("exact amax", "exact amax descale", &xt, &exact),
                ("amax/16", "amax/16 descale", &xt, &small),
                ("infinite amax", "infinite amax descale", &xt, &inf),
                ("zeros", "zeros descale", &zeros, &zero),
            ];
            for (name, descale_name, input, a) in cases {
                let (rows_out, cols_out) = (out(rows, [r, c]), out(cols, [c, r]));
                let descale = tensor(b, &[1], DType::F32, &[0.0]);
                let (rows, cols) = (rows_out.as_ref(), cols_out.as_ref());
                b.quantize(rows, cols, &descale, input, a, Fused::Nothing)
                    .unwrap();
                outs.extend(rows_out.map(|t| (name, download(b, &t))));
                outs.extend(cols_out.map(|t| (name, download(b, &t))));
                outs.push((descale_name, download(b, &descale)));
            }
            outs
        }
        for x_dtype in [DType::BF16, DType::F32] {
            for dtype in [DType::E4M3, DType::E5M2] {
                // x's layout, its transpose, and both from one pass.
                for layouts in [(true, false), (false, true), (true, true)] {
                    let name =
                        format!("quantize {r}x{c} {x_dtype} to {dtype} (rows, cols) {layouts:?}");
                    let args = (x_dtype, dtype, layouts, (r, c));
                    let cpu_out = run(&cpu, args.0, args.1, args.2, args.3, &x);
                    // The same f32 scale, product and round-to-nearest-even saturating
                    // conversion on both sides: identical bits (checked below, since a
                    // relative error of 0 would let -0 pass for +0).
                    let gpu_out = check_op(
                        &name,
                        || run(&gpu, args.0, args.1, args.2, args.3, &x),
                        || cpu_out.clone(),
                        |_| 0.0,
                    );
                    for ((output, g), (_, c)) in gpu_out.iter().zip(&cpu_out) {
                        assert!(same_bits(g, c), "{name} {output}: bits differ from the CPU");
                    }
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn quantize_fused_with_column_sums_matches_the_cpu() {
    let (gpu, cpu) = (cuda(), Cpu::<f32>::new());
    // The 0.5B QKV gradient's width on the 16-byte path, and an odd shape with partial tiles
    // element by element.
    for (r, c) in [(4096, 1152), (300, 37)] {
        let (x, db0) = (normal(r * c, 1.0, 52), normal(c, 1.0, 53));
        #[allow(clippy::too_many_arguments)]
        fn run<B: Backend>(
            b: &B, x_dtype: DType, (rows, cols): (bool, bool), accumulate: bool,
            (r, c): (usize, usize), x: &[f32], db0: &[f32],
        ) -> Outputs {
            let xt = tensor(b, &[r, c], x_dtype, x);
            let found = amax(b);
            b.abs_max(&found, &xt).unwrap();
            let out = |wanted: bool, shape: [usize; 2]| {
                wanted.then(|| tensor(b, &shape, DType::E5M2, &vec![0.0; r * c]))
            };
            let (rows_out, cols_out) = (out(rows, [r, c]), out(cols, [c, r]));
            let descale = tensor(b, &[1], DType::F32, &[0.0]);
            let db = tensor(b, &[c], x_dtype, db0);
            let sums = Fused::ColumnSums {
                dbias: &db,
                accumulate,
            };
            let (rows, cols) = (rows_out.as_ref(), cols_out.as_ref());
            b.quantize(rows, cols, &descale, &xt, &found, sums).unwrap();
            let mut outs = vec![("dbias", download(b, &db))];
            outs.extend(rows_out.map(|t| ("rows", download(b, &t))));
            outs.extend(cols_out.map(|t| ("cols", download(b, &t))));
            outs.push(("descale", download(b, &descale)));
            outs
        }
        for x_dtype in [DType::BF16, DType::F32] {
            for layouts in [(true, true), (false, true), (true, false)] {
                for accumulate in [false, true] {
                    let name = format!(
                        "quantize {r}x{c} {x_dtype} (rows, cols) {layouts:?} summing columns, \
                         accumulate={accumulate}"
                    );
                    let args = (x_dtype, layouts, accumulate, (r, c));
                    let cpu_out = run(&cpu, args.0, args.1, args.2, args.3, &x, &db0);
                    // The codes are the plain quantization's, bit for bit; the column sums
                    // are f32 sums in another order than the CPU's.
                    let gpu_out = check_op(
                        &name,
                        || run(&gpu, args.0, args.1, args.2, args.3, &x, &db0),
                        || cpu_out.clone(),
                        |output| if output == "dbias" { tol(x_dtype) } else { 0.0 },
                    );
                    for ((output, g), (_, c)) in gpu_out.iter().zip(&cpu_out).skip(1) {
                        assert!(same_bits(g, c), "{name} {output}: bits differ from the CPU");
                    }
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn quantize_fused_with_a_norm_is_the_norm_then_its_quantization() {
    let (gpu, cpu) = (cuda(), Cpu::<f32>::new());
    // The 0.5B width on the 16-byte path, and an odd one element by element in partial tiles.
    for (r, c) in [(4096, 896), (300, 37)] {
        let x = normal(r * c, 1.0, 54);
        let w: Vec<f32> = normal(c, 0.2, 55).iter().map(|v| 1.0 + v).collect();
        for x_dtype in [DType::BF16, DType::F32] {
            let name = format!("quantize of a norm {r}x{c} {x_dtype} to e4m3");
            // The CPU's rstd is its own f32 rounding of a sum in another order, which may move
            // an output across a rounding boundary: a few codes one step apart.
            let gpu_out = check_op(
                &name,
                || norm_quantizations(&gpu, x_dtype, (r, c), &x, &w),
                || norm_quantizations(&cpu, x_dtype, (r, c), &x, &w),
                |output| if output.ends_with("rstd") { 1e-5 } else { 1e-2 },
            );
            assert!(
                norm_quantizations_agree(&gpu_out),
                "{name}: the normalized codes differ from the stored norm's"
            );
            figure(&name, "bitwise the stored norm's quantization");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn matmul_scaled_matches_the_cpu() {
    let (gpu, cpu) = (cuda(), Cpu::<f32>::new());
    // (m, n, k): a Qwen2.5-0.5B MLP down projection's shape, and a small one.
    for (m, n, k) in [(2048, 896, 4864), (64, 48, 32)] {
        let (x, w, bias, acc0) = (
            normal(m * k, 1.0, 60),
            normal(n * k, 0.05, 61),
            normal(n, 1.0, 62),
            normal(m * n, 1.0, 63),
        );
        #[allow(clippy::too_many_arguments)]
        fn run<B: Backend>(
            b: &B, (a_dtype, b_dtype): (DType, DType), sum: Fp8Sum,
            (m, n, k): (usize, usize, usize), x: &[f32], w: &[f32], bias: &[f32], acc0: &[f32],
        ) -> Outputs {
            // bf16 values quantized with their own abs-max, as the model does.
            let quantized = |values: &[f32], rows: usize, dtype: DType| {
                let t = tensor(b, &[rows, k], DType::BF16, values);
                let a = amax(b);
                b.abs_max(&a, &t).unwrap();
                let q = tensor(b, &[rows, k], dtype, &vec![0.0; rows * k]);
                let descale = tensor(b, &[1], DType::F32, &[0.0]);
                b.quantize(Some(&q), None, &descale, &t, &a, Fused::Nothing)
                    .unwrap();
                (q, descale)
            };
            let (xq, x_descale) = quantized(x, m, a_dtype);
            let (wq, w_descale) = quantized(w, n, b_dtype);
            let (a, wt) = (
                Operand::scaled(&xq, &x_descale),
                Operand::scaled(&wq, &w_descale),
            );
            let bias = tensor(b, &[n], DType::BF16, bias);
            let zeros = vec![0.0; m * n];
            let spec = |accumulate| Matmul {
                accumulate,
                sum,
                ..Matmul::FORWARD
            };
            let plain = tensor(b, &[m, n], DType::BF16, &zeros);
            b.matmul(&plain, a, wt, None, spec(false)).unwrap();
            let biased = tensor(b, &[m, n], DType::BF16, &zeros);
            b.matmul(&biased, a, wt, Some(&bias), spec(false)).unwrap();
            let accumulated = tensor(b, &[m, n], DType::BF16, acc0);
            b.matmul(&accumulated, a, wt, Some(&bias), spec(true))
                .unwrap();
            let unbiased_accumulated = tensor(b, &[m, n], DType::BF16, acc0);
            b.matmul(&unbiased_accumulated, a, wt, None, spec(true))
                .unwrap();
            vec![
                ("a·bᵀ", download(b, &plain)),
                ("a·bᵀ + bias", download(b, &biased)),
                ("out += a·bᵀ + bias", download(b, &accumulated)),
                ("out += a·bᵀ", download(b, &unbiased_accumulated)),
            ]
        }
        let pairs = [
            (DType::E4M3, DType::E4M3),
            (DType::E5M2, DType::E4M3),
            (DType::E4M3, DType::E5M2),
        ];
        for (dtypes, sum) in pairs
            .into_iter()
            .flat_map(|d| [(d, Fp8Sum::Promoted), (d, Fp8Sum::Fast)])
        {
            let name = format!(
                "matmul_scaled {m}x{n}x{k} {}·{}ᵀ {sum:?}",
                dtypes.0, dtypes.1
            );
            let shape = (m, n, k);
            // Both sides multiply the same fp8 operands (quantize is bitwise the CPU's). The
            // GPU sums exact fp8 products (in f32 when promoted along K, in the tensor cores'
            // narrower accumulator when fast) and applies the descales once; the CPU applies
            // them to the operands first, then sums in f32 in another order. Both stay well
            // inside bf16's 1e-2.
            check_op(
                &name,
                || run(&gpu, dtypes, sum, shape, &x, &w, &bias, &acc0),
                || run(&cpu, dtypes, sum, shape, &x, &w, &bias, &acc0),
                |_| tol(DType::BF16),
            );
        }
    }
    // What cuBLASLt's FP8 matmuls cannot do is refused with the op and the shapes.
    let q = |rows: usize, cols: usize, dtype: DType| {
        tensor(&gpu, &[rows, cols], dtype, &vec![0.0; rows * cols])
    };
    let one = tensor(&gpu, &[1], DType::F32, &[1.0]);
    let (e5, e4, odd) = (
        q(32, 32, DType::E5M2),
        q(32, 32, DType::E4M3),
        q(24, 32, DType::E4M3),
    );
    let out = q(32, 32, DType::BF16);
    let scaled = |t| Operand::scaled(t, &one);
    let promoted = Matmul {
        sum: Fp8Sum::Promoted,
        ..Matmul::FORWARD
    };
    let err = gpu
        .matmul(&out, scaled(&e5), scaled(&e5), None, promoted)
        .unwrap_err();
    assert!(format!("{err:#}").contains("matmul_scaled"), "{err:#}");
    let out = q(24, 32, DType::BF16);
    let err = gpu
        .matmul(&out, scaled(&odd), scaled(&e4), None, promoted)
        .unwrap_err();
    let text = format!("{err:#}");
    assert!(
        text.contains("multiples of 16") && text.contains("M=24"),
        "{text}"
    );
    figure(
        "matmul_scaled",
        "e5m2·e5m2 and M=24 refused with a clear error",
    );
}
