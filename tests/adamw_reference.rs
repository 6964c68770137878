//! The CPU backend's AdamW against PyTorch's: `torch.optim.AdamW` after
//! `torch.nn.utils.clip_grad_norm_`, in float64, from `tests/fixtures/adamw.safetensors`
//! (written by `scripts/adamw_fixture.py`). Three steps on a tensor that decays and one that
//! does not, the first step clipped. The GPU's AdamW is the CPU's bit for bit (`cuda_ops`).

use std::collections::HashMap;
use std::path::PathBuf;

use safetensors::{Dtype, SafeTensors};
use smelt::backend::cpu::Cpu;
use smelt::backend::prelude::*;
use smelt::backend::{AdamW, AdamWTensor};
use smelt::tensor::{DType, Tensor, TensorSpec};

/// The fixture's float64 tensors and its metadata.
struct Fixture {
    tensors: HashMap<String, (Vec<usize>, Vec<f64>)>,
    metadata: HashMap<String, String>,
}

impl Fixture {
    fn load() -> Fixture {
        let path =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/adamw.safetensors");
        let bytes = std::fs::read(&path).unwrap();
        let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
        let file = SafeTensors::deserialize(&bytes).unwrap();
        let tensors = file
            .tensors()
            .into_iter()
            .map(|(name, view)| {
                assert_eq!(view.dtype(), Dtype::F64, "{name}");
                let values = view
                    .data()
                    .chunks_exact(8)
                    .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                (name, (view.shape().to_vec(), values))
            })
            .collect();
        let metadata = header.metadata().clone().expect("the fixture's metadata");
        Fixture { tensors, metadata }
    }

    fn values(&self, name: &str) -> &[f64] {
        &self.tensors[name].1
    }

    /// The tensor's values as f32 (the fixture's inputs are f32 values).
    fn floats(&self, name: &str) -> Vec<f32> {
        self.values(name).iter().map(|&x| x as f32).collect()
    }

    fn hyper(&self, key: &str) -> f64 {
        self.metadata[key].parse().unwrap()
    }
}

/// max |a − b| / max |b|.
fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    diff / b.iter().map(|y| y.abs()).fold(0.0, f64::max)
}

/// One f32 tensor of the fixture's shape for `name`, holding `values`.
fn tensor(b: &Cpu<f32>, shape: &[usize], name: &str, values: &[f32]) -> Tensor<Cpu<f32>> {
    let spec = TensorSpec::new(name.to_string(), shape, DType::F32);
    let t = b.allocate("test", &[spec]).unwrap().remove(0);
    b.upload(&t, values).unwrap();
    t
}

#[test]
fn adamw_matches_pytorch() {
    let f = Fixture::load();
    let b = Cpu::<f32>::new();
    let names = ["matrix", "bias"];
    let decays: Vec<&str> = f.metadata["decays"].split(',').collect();
    // Each name's param, m and v, in f32 and without a master copy: no stochastic rounding.
    let states: Vec<[Tensor<Cpu<f32>>; 3]> = names
        .iter()
        .map(|&n| {
            let (shape, values) = &f.tensors[n];
            let zeros = vec![0.0; values.len()];
            [
                tensor(&b, shape, n, &f.floats(n)),
                tensor(&b, shape, "m", &zeros),
                tensor(&b, shape, "v", &zeros),
            ]
        })
        .collect();
    let norm_sq = tensor(&b, &[1], "norm_sq", &[0.0]);
    let sums_sq = tensor(&b, &[names.len()], "sums_sq", &vec![0.0; names.len()]);
    let steps: u64 = f.metadata["steps"].parse().unwrap();
    for step in 1..=steps {
        let grads: Vec<_> = names
            .iter()
            .map(|&n| {
                let name = format!("grad.{step}.{n}");
                tensor(&b, &f.tensors[&name].0, &name, &f.floats(&name))
            })
            .collect();
        b.sum_squares(&sums_sq, &grads.iter().map(Some).collect::<Vec<_>>())
            .unwrap();
        b.sum(&norm_sq, &sums_sq).unwrap();
        let hp = AdamW {
            lr: f.hyper("lr") as f32,
            beta1: f.hyper("beta1") as f32,
            beta2: f.hyper("beta2") as f32,
            eps: f.hyper("eps") as f32,
            weight_decay: f.hyper("weight_decay") as f32,
            step,
            grad_clip: f.hyper("grad_clip") as f32,
        };
        let tensors: Vec<_> = names
            .iter()
            .zip(&states)
            .zip(&grads)
            .map(|((n, [param, m, v]), grad)| AdamWTensor {
                param,
                master: None,
                grad,
                m,
                v,
                scales: None,
                decays: decays.contains(n),
                seed: 0,
                amax: None,
            })
            .collect();
        b.adamw(&tensors, &norm_sq, &hp).unwrap();
    }
    for (n, [param, m, v]) in names.iter().zip(&states) {
        let download = |t: &Tensor<Cpu<f32>>| b.download_f64(t).unwrap();
        // The change of the weights, not the weights: they are near 1 and the three steps
        // move them by about 3·lr, so a wrong weight decay or bias correction shows plainly.
        let start = f.values(n);
        let moved =
            |after: &[f64]| -> Vec<f64> { after.iter().zip(start).map(|(a, s)| a - s).collect() };
        let ours = moved(&download(param));
        let theirs = moved(f.values(&format!("after.{n}")));
        let checks = [
            ("update", rel_err(&ours, &theirs), 1e-4),
            (
                "exp_avg",
                rel_err(&download(m), f.values(&format!("exp_avg.{n}"))),
                1e-5,
            ),
            (
                "exp_avg_sq",
                rel_err(&download(v), f.values(&format!("exp_avg_sq.{n}"))),
                1e-5,
            ),
        ];
        for (what, err, tol) in checks {
            println!("{n} {what}: rel err {err:.2e} against PyTorch (tol {tol:.0e})");
            assert!(
                err <= tol,
                "{n} {what}: rel err {err:e} against PyTorch, over {tol:e}"
            );
        }
    }
}
