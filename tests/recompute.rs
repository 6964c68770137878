//! Every recompute option, offloading the residual stream and the other activations, and
//! streaming the blocks' weights and gradients from host memory, gives bitwise the losses and
//! gradients of keeping everything on the device; running the MLP in token chunks changes
//! only the order in which its weight gradients are summed.

mod common;

use common::*;
use smelt::backend::cpu::Cpu;
use smelt::backend::prelude::*;
use smelt::model::{
    Int8Options, LossOptions, MatmulPrecision, ModelConfig, Recompute, Transformer,
};
use smelt::tensor::DType;

type Precision = (DType, MatmulPrecision);
type Outcome = (Vec<f64>, Vec<(String, Vec<f64>)>);
/// What goes to host memory.
#[derive(Clone, Copy, Debug, Default)]
struct Offloads {
    residual: bool,
    /// The other activations kept per layer.
    activations: bool,
    /// The blocks' weights and gradients, streamed through the device.
    weights: bool,
    gradients: bool,
}
const ON_DEVICE: Offloads = Offloads {
    residual: false,
    activations: false,
    weights: false,
    gradients: false,
};

const FP8: MatmulPrecision = MatmulPrecision::Fp8 {
    forward: DType::E4M3,
    gradient: DType::E5M2,
};

fn int8(weight_grad: bool, stochastic: bool) -> MatmulPrecision {
    MatmulPrecision::Int8(Int8Options {
        weight_grad,
        stochastic,
    })
}

/// Per-token losses and gradients after two accumulated micro-steps.
fn run(
    recompute: Recompute, offloads: Offloads, (dtype, matmul): Precision, config: &ModelConfig,
) -> Outcome {
    run_chunked(recompute, offloads, (dtype, matmul), config, 1)
}

/// `run` with the MLP over the tokens in `ffn_chunks` chunks.
fn run_chunked(
    recompute: Recompute, offloads: Offloads, (dtype, matmul): Precision, config: &ModelConfig,
    ffn_chunks: usize,
) -> Outcome {
    let cpu = Cpu::<f32>::new();
    let (batch_size, seq) = (3, 7);
    let mut o = options(batch_size, seq, dtype, recompute, 2);
    o.matmul = matmul;
    o.offload_residual = offloads.residual;
    o.offload_activations = offloads.activations;
    o.offload_weights = offloads.weights;
    o.offload_gradients = offloads.gradients;
    o.ffn_chunks = ffn_chunks;
    let mut model = Transformer::new(&cpu, config.clone(), o).unwrap();
    randomize(&cpu, &model, 3);
    let mut losses = vec![];
    for micro in 0..2 {
        let (tokens, targets) = batch(batch_size * seq, config.vocab_size, 40 + micro);
        let loss = LossOptions {
            grad_scale: 0.01,
            z_loss: 1e-3,
            accumulate: micro > 0,
        };
        model
            .forward_backward(&cpu, &tokens, &targets, loss)
            .unwrap();
        losses.extend(cpu.download_f64(model.losses()).unwrap());
    }
    (losses, gradients(&cpu, &model))
}

fn assert_same_bits((losses, grads): &Outcome, (base_losses, base_grads): &Outcome, what: &str) {
    let same = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    assert!(same(losses, base_losses), "{what}: losses differ");
    for ((name, g), (_, base)) in grads.iter().zip(base_grads) {
        assert!(same(g, base), "{what}: gradient {name} differs");
    }
}

#[test]
fn recompute_is_bitwise_identical() {
    let variants = Recompute::variants();
    for (config_name, config) in tiny_configs() {
        let precisions = [
            (DType::F32, MatmulPrecision::Native),
            (DType::BF16, MatmulPrecision::Native),
            (DType::BF16, FP8),
            (DType::BF16, int8(false, false)),
            (DType::BF16, int8(true, true)),
        ];
        for precision in precisions {
            let base = run(Recompute::default(), ON_DEVICE, precision, &config);
            assert!(base.0.iter().any(|&l| l > 0.0));
            for (name, recompute) in &variants {
                let what = format!("{config_name} {precision:?} recompute {name}");
                assert_same_bits(
                    &run(*recompute, ON_DEVICE, precision, &config),
                    &base,
                    &what,
                );
            }
        }
    }
}

/// Five layers, so that the backward fetches the activations of the blocks below the last
/// two back from host memory, into slots that other layers used; each kind of offload alone
/// and both, under recompute options that keep more and fewer activations per layer.
#[test]
fn offloading_activations_is_bitwise_identical() {
    let r = Recompute::default();
    let variants = [
        ("nothing recomputed", r),
        ("ffn", Recompute { ffn: true, ..r }),
        ("block", Recompute { block: true, ..r }),
        ("all", Recompute::all()),
    ];
    let (residual, activations) = (true, true);
    let offloads = [
        (
            "the residual stream",
            Offloads {
                residual,
                ..ON_DEVICE
            },
        ),
        (
            "the other activations",
            Offloads {
                activations,
                ..ON_DEVICE
            },
        ),
        (
            "both",
            Offloads {
                residual,
                activations,
                ..ON_DEVICE
            },
        ),
    ];
    for (config_name, config) in tiny_configs() {
        let config = ModelConfig {
            num_layers: 5,
            ..config
        };
        for precision in [(DType::F32, MatmulPrecision::Native), (DType::BF16, FP8)] {
            let base = run(r, ON_DEVICE, precision, &config);
            for (name, recompute) in variants {
                for (what_moves, offload) in offloads {
                    let what =
                        format!("{config_name} {precision:?} {what_moves} offloaded, {name}");
                    assert_same_bits(&run(recompute, offload, precision, &config), &base, &what);
                }
            }
        }
    }
}

/// Five layers, so that both passes fetch blocks into slots other blocks used, and the two
/// accumulated micro-steps bring each block's gradient sum back in before adding to it; the
/// weights and the gradients streamed alone and together, beside every recompute and
/// activation offload choice (the weights of a recomputed block are fetched once for both
/// its recompute and its backward); in FP8 and INT8, streamed weights have their copies made in
/// their slot, with the bits of those made of weights on the device.
#[test]
fn streaming_weights_and_gradients_is_bitwise_identical() {
    let r = Recompute::default();
    let recomputes = [
        ("nothing recomputed", r),
        ("ffn", Recompute { ffn: true, ..r }),
        ("block", Recompute { block: true, ..r }),
    ];
    let (weights, gradients, residual, activations) = (true, true, true, true);
    let streams = [
        (
            "weights",
            Offloads {
                weights,
                ..ON_DEVICE
            },
        ),
        (
            "gradients",
            Offloads {
                gradients,
                ..ON_DEVICE
            },
        ),
        (
            "both",
            Offloads {
                weights,
                gradients,
                ..ON_DEVICE
            },
        ),
        (
            "everything",
            Offloads {
                weights,
                gradients,
                residual,
                activations,
            },
        ),
    ];
    for (config_name, config) in tiny_configs() {
        for layers in [1, 2, 5] {
            let config = ModelConfig {
                num_layers: layers,
                ..config.clone()
            };
            for precision in [
                (DType::F32, MatmulPrecision::Native),
                (DType::BF16, MatmulPrecision::Native),
                (DType::BF16, FP8),
                (DType::BF16, int8(true, false)),
            ] {
                let base = run(r, ON_DEVICE, precision, &config);
                for (name, recompute) in recomputes {
                    for (what, offloads) in streams {
                        let what = format!(
                            "{config_name}, {layers} layers, {precision:?}: {what} streamed, {name}"
                        );
                        assert_same_bits(
                            &run(recompute, offloads, precision, &config),
                            &base,
                            &what,
                        );
                    }
                }
            }
        }
    }
}

/// The MLP over the 21 tokens in 3 chunks of 7, and in 4 (6, 6, 6 and 3): each token's
/// values are those of the whole MLP, and the weight gradients, summed chunk by chunk, differ
/// by the rounding of their sums' order (f32), or of the bf16 buffer they are summed into.
#[test]
fn the_mlp_in_token_chunks_matches_the_whole_mlp() {
    let r = Recompute::default();
    for (config_name, config) in tiny_configs() {
        for (precision, tol) in [
            ((DType::F32, MatmulPrecision::Native), 1e-5),
            ((DType::BF16, MatmulPrecision::Native), 2e-2),
        ] {
            for recompute in [Recompute { ffn: true, ..r }, Recompute { block: true, ..r }] {
                let (base_losses, base_grads) = run(recompute, ON_DEVICE, precision, &config);
                for chunks in [3, 4] {
                    let what = format!("{config_name} {precision:?} {chunks} chunks");
                    let (losses, grads) =
                        run_chunked(recompute, ON_DEVICE, precision, &config, chunks);
                    let worst = losses
                        .iter()
                        .zip(&base_losses)
                        .map(|(a, b)| (a - b).abs() / b.abs().max(1e-3))
                        .fold(0.0, f64::max);
                    assert!(worst <= tol, "{what}: losses differ by {worst:e}");
                    for ((name, g), (_, base)) in grads.iter().zip(&base_grads) {
                        let (scale, err) = (max_abs(base), max_abs_diff(g, base));
                        assert!(
                            err <= tol * scale,
                            "{what}: {name} differs by {err:e} of {scale:e}"
                        );
                    }
                }
            }
        }
    }
}

/// Chunks shrink the shared MLP buffers to one chunk's rows; they are refused where the MLP
/// is kept per layer (nothing to shrink) and with FP8 (whole-tensor scales).
#[test]
fn ffn_chunks_plan_one_chunk_and_are_refused_where_they_cannot_work() {
    let config = &tiny_configs()[0].1;
    let ffn = Recompute {
        ffn: true,
        ..Recompute::default()
    };
    let plan = |recompute, matmul, chunks| {
        let mut o = options(3, 7, DType::BF16, recompute, 1);
        o.matmul = matmul;
        o.ffn_chunks = chunks;
        smelt::model::ModelPlan::new(config, &o)
    };
    let rows = |chunks| {
        let memory = plan(ffn, MatmulPrecision::Native, chunks).unwrap().memory();
        let activations = &memory.iter().find(|c| c.0 == "activations").unwrap().1;
        let gate_up = activations.iter().find(|s| s.name == "gate_up").unwrap();
        let swiglu = activations.iter().find(|s| s.name == "swiglu").unwrap();
        (gate_up.shape[0], swiglu.shape[0])
    };
    assert_eq!(rows(1), (21, 21));
    assert_eq!(rows(4), (6, 6));
    let err = plan(Recompute::default(), MatmulPrecision::Native, 2)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("--ffn-chunks 2 needs --recompute-ffn"),
        "{err}"
    );
    let err = plan(ffn, FP8, 2).err().unwrap().to_string();
    assert!(err.contains("cannot be used with FP8"), "{err}");
}
