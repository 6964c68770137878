//! Compiles every kernel of the table, with every instantiation, for sm_80, sm_89 and sm_90a
//! with NVRTC, on a machine without a GPU. In CI (`CI` set) a missing NVRTC fails the test.

use smelt::backend::cuda::kernels::{SOURCES, all_names};
use smelt::backend::cuda::nvrtc;

const ARCHES: [&str; 3] = ["sm_80", "sm_89", "sm_90a"];

#[test]
fn every_kernel_compiles_for_every_arch() {
    if let Err(e) = nvrtc::ensure_available().and_then(|_| nvrtc::include_dirs()) {
        if std::env::var_os("CI").is_some() {
            panic!("NVRTC is required in CI: {e:#}");
        }
        eprintln!(
            "skipping the kernel compile test: {e:#}\nTo run it: python3 -m pip install --target \
             .ci/pydeps nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96 \
             nvidia-cuda-cccl==13.0.85, then PYTHONPATH=.ci/pydeps \
             LD_LIBRARY_PATH=.ci/pydeps/nvidia/cu13/lib cargo test --release (or run .ci/run)"
        );
        return;
    }
    let include = nvrtc::include_dirs().unwrap();
    let failures: Vec<String> = std::thread::scope(|scope| {
        let jobs: Vec<_> = ARCHES
            .iter()
            .map(|&arch| {
                let include = &include;
                scope.spawn(move || {
                    let mut failures = vec![];
                    for source in SOURCES {
                        let names = all_names(source);
                        assert!(
                            !names.is_empty(),
                            "{} has no kernel in the table",
                            source.name
                        );
                        match nvrtc::compile(source, &names, arch, include) {
                            Ok(c) => assert_eq!(c.lowered.len(), names.len()),
                            Err(e) => failures.push(format!("{e:#}")),
                        }
                    }
                    failures
                })
            })
            .collect();
        jobs.into_iter().flat_map(|j| j.join().unwrap()).collect()
    });
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
