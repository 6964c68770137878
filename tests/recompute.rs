//! Every recompute option, and offloading the residual stream, gives bitwise the losses and
//! gradients of keeping everything on the device.

mod common;

use common::*;
use smelt::backend::Backend;
use smelt::backend::cpu::Cpu;
use smelt::model::{LossOptions, MatmulPrecision, ModelConfig, Recompute, Transformer};
use smelt::tensor::DType;

type Precision = (DType, MatmulPrecision);
type Outcome = (Vec<f64>, Vec<(String, Vec<f64>)>);

const FP8: MatmulPrecision = MatmulPrecision::Fp8 {
    forward: DType::E4M3,
    gradient: DType::E5M2,
};

/// Per-token losses and gradients after two accumulated micro-steps.
fn run(
    recompute: Recompute,
    offload_residual: bool,
    (dtype, matmul): Precision,
    config: &ModelConfig,
) -> Outcome {
    let cpu = Cpu::<f32>::new();
    let (batch_size, seq) = (3, 7);
    let mut o = options(batch_size, seq, dtype, recompute, 2);
    o.matmul = matmul;
    o.offload_residual = offload_residual;
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
        ];
        for precision in precisions {
            let base = run(Recompute::default(), false, precision, &config);
            assert!(base.0.iter().any(|&l| l > 0.0));
            for (name, recompute) in &variants {
                let what = format!("{config_name} {precision:?} recompute {name}");
                assert_same_bits(&run(*recompute, false, precision, &config), &base, &what);
            }
        }
    }
}

/// Five layers, so that the backward fetches the inputs of the blocks below the last two
/// back from host memory, into slots that other layers used.
#[test]
fn offloading_the_residual_stream_is_bitwise_identical() {
    let r = Recompute::default();
    let variants = [
        ("nothing recomputed", r),
        ("block", Recompute { block: true, ..r }),
        ("all", Recompute::all()),
    ];
    for (config_name, config) in tiny_configs() {
        let config = ModelConfig {
            num_layers: 5,
            ..config
        };
        for precision in [(DType::F32, MatmulPrecision::Native), (DType::BF16, FP8)] {
            let base = run(r, false, precision, &config);
            for (name, recompute) in variants {
                let what = format!("{config_name} {precision:?} offloaded, {name}");
                assert_same_bits(&run(recompute, true, precision, &config), &base, &what);
            }
        }
    }
}
