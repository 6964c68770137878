//! Every recompute option gives bitwise the losses and gradients of keeping everything.

mod common;

use common::*;
use smelt::backend::Backend;
use smelt::backend::cpu::Cpu;
use smelt::model::{LossOptions, MatmulPrecision, Recompute, Transformer};
use smelt::tensor::DType;

/// Per-token losses and gradients after two accumulated micro-steps.
fn run(
    recompute: Recompute,
    (dtype, matmul): (DType, MatmulPrecision),
    config: &smelt::model::ModelConfig,
) -> (Vec<f64>, Vec<(String, Vec<f64>)>) {
    let cpu = Cpu::<f32>::new();
    let (batch_size, seq) = (3, 7);
    let mut o = options(batch_size, seq, dtype, recompute, 2);
    o.matmul = matmul;
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

#[test]
fn recompute_is_bitwise_identical() {
    let variants = Recompute::variants();
    for (config_name, config) in tiny_configs() {
        let fp8 = MatmulPrecision::Fp8 {
            forward: DType::E4M3,
            gradient: DType::E5M2,
        };
        let precisions = [
            (DType::F32, MatmulPrecision::Native),
            (DType::BF16, MatmulPrecision::Native),
            (DType::BF16, fp8),
        ];
        for precision in precisions {
            let dtype = format!("{precision:?}");
            let (base_losses, base_grads) = run(Recompute::default(), precision, &config);
            assert!(base_losses.iter().any(|&l| l > 0.0));
            for (name, recompute) in &variants {
                let (losses, grads) = run(*recompute, precision, &config);
                let same =
                    |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(
                    same(&losses, &base_losses),
                    "{config_name} {dtype} recompute {name}: losses differ"
                );
                for ((pname, g), (_, base)) in grads.iter().zip(&base_grads) {
                    assert!(
                        same(g, base),
                        "{config_name} {dtype} recompute {name}: gradient {pname} differs"
                    );
                }
            }
        }
    }
}
