//! The Python package (python/): built into a wheel by maturin, installed with pip into a
//! folder of its own, and its tests (python/tests) run against this build's `smelt`: a
//! Python loop gives `smelt train`'s losses bit for bit, and bad arguments raise smelt's
//! messages.

mod train_support;

use std::path::Path;
use std::process::{Command, Output};

use train_support::python;

fn check(what: &str, out: Output) {
    assert!(
        out.status.success(),
        "{what} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_python_package_builds_installs_and_trains_as_smelt_train() {
    if !python::has(&["maturin", "pytest", "numpy"]) {
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tmp = tempfile::tempdir().unwrap();
    let (wheels, site) = (tmp.path().join("wheels"), tmp.path().join("site"));
    // pip --target leaves maturin's executable in .ci/pydeps/bin (`python -m maturin` looks
    // for it under the interpreter's prefix instead).
    let build = Command::new(python::pydeps().join("bin/maturin"))
        .args(["build", "--release", "--quiet", "-o"])
        .arg(&wheels)
        .current_dir(root)
        .output()
        .unwrap();
    check("maturin build", build);
    let wheel = std::fs::read_dir(&wheels)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let install = python::command()
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--target",
        ])
        .arg(&site)
        .arg(&wheel)
        .output()
        .unwrap();
    check("pip install", install);
    let tests = python::command_with(&[&site])
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(root.join("python/tests"))
        .env("SMELT_BIN", env!("CARGO_BIN_EXE_smelt"))
        .current_dir(tmp.path())
        .output()
        .unwrap();
    println!("{}", String::from_utf8_lossy(&tests.stdout));
    check("pytest python/tests", tests);
}
