//! On the GPU, optimizer state offloaded to pinned host memory gives bitwise the weights,
//! moments and master copy of keeping it on the device, over 5 optimizer steps: the update
//! runs the same kernel on the same values, only its loads and stores cross the bus. The
//! state also survives a checkpoint's save and load through host memory. And the copies that
//! offload activations, which run beside the compute stream, are ordered by
//! `wait_for_copies_of`.

mod common;

use std::collections::BTreeMap;

use common::gpu::*;
use common::options;
use smelt::backend::cuda::Cuda;
use smelt::backend::prelude::*;
use smelt::comm::Solo;
use smelt::model::{Recompute, Transformer};
use smelt::tensor::{DType, Tensor, TensorSpec};
use smelt::train::bench;
use smelt::train::optimizer::AdamWState;
use smelt::train::options::{Offload, OptimizerOptions};

const STEPS: u64 = 5;

/// The benchmark's optimizer with an f32 master copy of the bf16 weights and moments of
/// `moments`: every category the flags can offload exists, and bf16 moments round
/// stochastically.
fn optimizer_options(offload: Offload, moments: DType) -> OptimizerOptions {
    OptimizerOptions {
        master_dtype: Some(DType::F32),
        offload,
        opt_m_dtype: moments,
        opt_v_dtype: moments,
        ..bench::bf16_adamw_options()
    }
}

fn values<'a>(gpu: &Cuda, tensors: impl Iterator<Item = &'a Tensor<Cuda>>) -> Vec<f32> {
    tensors.flat_map(|t| gpu.download(t).unwrap()).collect()
}

/// Per-token losses of every step, then the weights and each optimizer category, flattened.
fn train(gpu: &Cuda, offload: Offload, moments: DType) -> Vec<(String, Vec<f32>)> {
    let config = small_configs()[0].1.clone();
    let o = options(2, 256, DType::BF16, Recompute::default(), 2);
    let mut model = Transformer::new(gpu, config, o).unwrap();
    upload_weights(gpu, &model, &host_weights(&model, 3, 0.05));
    let opt = AdamWState::new(gpu, &Solo, &model, optimizer_options(offload, moments)).unwrap();
    // Each offloaded category is in pinned host memory, and only those (the report lists
    // categories in the order the process first made them, so by name here).
    let pinned: BTreeMap<String, usize> = gpu
        .memory_report()
        .unwrap()
        .pinned_host
        .into_iter()
        .collect();
    let planned: BTreeMap<String, usize> = (opt.offloaded.iter())
        .map(|(name, specs)| (name.to_string(), specs.iter().map(|s| s.bytes()).sum()))
        .collect();
    assert_eq!(
        pinned.keys().collect::<Vec<_>>(),
        planned.keys().collect::<Vec<_>>()
    );
    for ((name, bytes), want) in pinned.iter().zip(planned.values()) {
        assert!(bytes >= want, "{name}: {bytes} bytes pinned for {want}");
    }
    let losses = train_steps(gpu, &mut model, &opt, STEPS);
    let mut out = vec![
        ("losses".to_string(), losses),
        ("weights".to_string(), values(gpu, model.params.iter())),
    ];
    for (name, tensors) in opt.categories(&model) {
        out.push((
            name.to_string(),
            values(gpu, tensors.iter().map(|(_, t)| *t)),
        ));
    }
    // Through a file and back into the same (possibly host) tensors, as a checkpoint goes.
    let dir = tempfile::tempdir().unwrap();
    for (name, named) in opt.categories(&model) {
        let path = dir.path().join(format!("{name}.safetensors"));
        smelt::io::tensors::save(gpu, &path, &named).unwrap();
        for (_, t) in &named {
            gpu.fill(t, 0.0).unwrap();
        }
        smelt::io::tensors::load(gpu, &path, &named).unwrap();
        out.push((
            format!("{name} reloaded"),
            values(gpu, named.iter().map(|(_, t)| *t)),
        ));
    }
    out
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn offloaded_optimizer_state_is_bitwise_identical_on_the_gpu() {
    let gpu = cuda();
    let test = "offload";
    let all = Offload {
        master: true,
        opt_m: true,
        opt_v: true,
    };
    // bf16 moments, and 8-bit ones with their scales.
    for moments in [DType::BF16, DType::Q8] {
        let base = train(&gpu, Offload::default(), moments);
        for offload in [
            all,
            Offload {
                opt_v: false,
                ..all
            },
        ] {
            let runs = train(&gpu, offload, moments);
            for ((name, got), (_, want)) in runs.iter().zip(&base) {
                assert!(
                    got.iter().all(|x| x.is_finite()),
                    "{test}: {name} not finite"
                );
                assert!(
                    same_bits(got, want),
                    "{test} {offload:?} {moments} moments: {name} differs from keeping the \
                     state on the device"
                );
            }
        }
        let values: usize = (base.iter())
            .filter(|(n, _)| (n.starts_with("adam_") || n == "master") && !n.ends_with(" reloaded"))
            .map(|(_, v)| v.len())
            .sum();
        figure(
            test,
            format!(
                "master and {moments} moments ({values} values) in pinned host memory: losses, \
                 weights and state bitwise equal over {STEPS} steps and a save/load"
            ),
        );
    }
}

/// `start_copy` runs on a copy engine beside the compute stream, and `wait_for_copies_of` a
/// tensor orders the ops after it: a kernel that overwrites a copy's source, or reads its
/// destination, right after the wait sees the copy done. 512 MiB take over 10 ms over PCIe, against the
/// microseconds a kernel takes to start, so a missing wait would show.
#[test]
#[ignore = "needs a CUDA GPU"]
fn copies_beside_the_compute_stream_are_ordered_by_waits_for_them() {
    let gpu = cuda();
    let spec = TensorSpec::new("x", &[1 << 27], DType::F32);
    let specs = [spec.clone(), spec.clone()];
    let device = gpu.allocate("test", &specs).unwrap();
    let host = gpu.allocate_offloaded("test", &[spec]).unwrap().remove(0);
    let all = |t: &Tensor<Cuda>, value: f32| gpu.download(t).unwrap().iter().all(|&x| x == value);

    // Out to host memory, then the source overwritten.
    gpu.fill(&device[0], 1.0).unwrap();
    gpu.start_copy(&host, &device[0]).unwrap();
    // A tensor no copy touched: nothing to wait for.
    gpu.wait_for_copies_of(&[&device[1]]).unwrap();
    gpu.wait_for_copies_of(&[&device[0]]).unwrap();
    gpu.fill(&device[0], 2.0).unwrap();
    assert!(all(&host, 1.0), "the source was overwritten mid-copy");

    // Back in, then the destination read.
    gpu.fill(&host, 3.0).unwrap();
    gpu.start_copy(&device[0], &host).unwrap();
    gpu.wait_for_copies_of(&[&device[0]]).unwrap();
    gpu.copy(&device[1], &device[0]).unwrap();
    assert!(all(&device[1], 3.0), "the destination was read mid-copy");
    figure(
        "start_copy",
        "512 MiB out and back in, ordered by wait_for_copies_of",
    );
}
