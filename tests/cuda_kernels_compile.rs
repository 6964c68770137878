//! Compiles every kernel of the table, with every instantiation, for every architecture smelt
//! runs on (Ampere's sm_80 and sm_86, Ada's sm_89, Hopper's sm_90a, Blackwell's sm_100 and
//! sm_120) with the NVRTC that loads, on a machine without a GPU. CI runs it once with CUDA
//! 13's NVRTC and once with CUDA 12's; `SMELT_EXPECT_NVRTC=12` (or 13) makes it fail unless
//! that major version is the one loaded.
//!
//! Its own harness (`harness = false` in Cargo.toml), so that `cargo test` shows what it did:
//! where NVRTC is missing it prints that it skipped the kernels and how to compile them,
//! instead of passing silently; in CI (`CI` set) a missing NVRTC fails it. It takes libtest's
//! `--list`, `--ignored`, `--exact` and a name filter, so that `cargo test FILTER` and the
//! GPU scripts (which run the ignored tests of every binary) treat it as one ordinary test.

use std::process::ExitCode;

use smelt::backend::cuda::kernels::{SOURCES, all_names};
use smelt::backend::cuda::nvrtc;

const NAME: &str = "every_kernel_compiles_for_every_arch";
const ARCHES: [&str; 6] = ["sm_80", "sm_86", "sm_89", "sm_90a", "sm_100", "sm_120"];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |f: &str| args.iter().any(|a| a == f);
    let filter = args.iter().find(|a| !a.starts_with('-'));
    let selected = !flag("--ignored")
        && filter.is_none_or(|f| {
            if flag("--exact") {
                f == NAME
            } else {
                NAME.contains(f.as_str())
            }
        });
    if flag("--list") {
        if selected {
            println!("{NAME}: test");
        }
        return ExitCode::SUCCESS;
    }
    if !selected {
        return ExitCode::SUCCESS;
    }
    if let Err(e) = nvrtc::ensure_available().and_then(|_| nvrtc::include_dirs()) {
        if std::env::var_os("CI").is_some() {
            eprintln!("{NAME}: FAILED: NVRTC is required in CI: {e:#}");
            return ExitCode::FAILURE;
        }
        println!(
            "{NAME}: SKIPPED, no kernel was compiled: {e:#}\nTo compile them: python3 -m pip \
             install --target .ci/pydeps nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96 \
             nvidia-cuda-cccl==13.0.85, then PYTHONPATH=.ci/pydeps \
             LD_LIBRARY_PATH=.ci/pydeps/nvidia/cu13/lib cargo test --release (or run .ci/run)"
        );
        return ExitCode::SUCCESS;
    }
    let include = nvrtc::include_dirs().expect("checked above");
    let (major, minor) = nvrtc::version().expect("checked above");
    if let Some(expected) = std::env::var_os("SMELT_EXPECT_NVRTC")
        && expected.to_string_lossy() != major.to_string()
    {
        eprintln!(
            "{NAME}: FAILED: NVRTC {major}.{minor} loaded where SMELT_EXPECT_NVRTC asks for {}",
            expected.to_string_lossy()
        );
        return ExitCode::FAILURE;
    }
    let (kernels, failures) = compile_all(&include);
    if failures.is_empty() {
        println!(
            "{NAME}: ok, NVRTC {major}.{minor}, {kernels} kernel instantiations for each of \
             {ARCHES:?}"
        );
        ExitCode::SUCCESS
    } else {
        eprintln!("{NAME}: FAILED\n{}", failures.join("\n\n"));
        ExitCode::FAILURE
    }
}

/// Compiles every source for every arch, one thread per arch: the number of instantiations
/// of each arch, and the errors.
fn compile_all(include: &[std::path::PathBuf]) -> (usize, Vec<String>) {
    let kernels = SOURCES.iter().map(|s| all_names(s).len()).sum();
    let failures = std::thread::scope(|scope| {
        let jobs: Vec<_> = ARCHES
            .iter()
            .map(|&arch| {
                scope.spawn(move || {
                    let mut failures = vec![];
                    for source in SOURCES {
                        let names = all_names(source);
                        if names.is_empty() {
                            failures.push(format!("{} has no kernel in the table", source.name));
                            continue;
                        }
                        match nvrtc::compile(source, &names, arch, include) {
                            Ok(c) if c.lowered.len() == names.len() => {}
                            Ok(c) => failures.push(format!(
                                "{} for {arch}: {} of {} names lowered",
                                source.name,
                                c.lowered.len(),
                                names.len()
                            )),
                            Err(e) => failures.push(format!("{e:#}")),
                        }
                    }
                    failures
                })
            })
            .collect();
        jobs.into_iter().flat_map(|j| j.join().unwrap()).collect()
    });
    (kernels, failures)
}
