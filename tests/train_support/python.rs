//! Python for the tests that check smelt with Python's own tools: `python3` with `.ci/pydeps`
//! (where `.ci/run` installs the packages) on its path.

use std::path::{Path, PathBuf};
use std::process::Command;

/// `.ci/pydeps`.
pub fn pydeps() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci/pydeps")
}

/// `python3` with `.ci/pydeps`, then `extra`, on its module path.
pub fn command_with(extra: &[&Path]) -> Command {
    let mut paths: Vec<String> = extra.iter().map(|p| p.display().to_string()).collect();
    paths.push(pydeps().display().to_string());
    paths.extend(std::env::var("PYTHONPATH").ok().filter(|p| !p.is_empty()));
    let mut python = Command::new("python3");
    python.env("PYTHONPATH", paths.join(":"));
    python
}

pub fn command() -> Command {
    command_with(&[])
}

/// Whether Python can import every module of `modules`. Without them the test skips, saying
/// so, unless `SMELT_REQUIRE_PY_TESTS` is set (as CI sets it), where it fails.
pub fn has(modules: &[&str]) -> bool {
    let found = command()
        .args(["-c", &format!("import {}", modules.join(", "))])
        .output()
        .is_ok_and(|o| o.status.success());
    if !found && std::env::var_os("SMELT_REQUIRE_PY_TESTS").is_some() {
        panic!("SMELT_REQUIRE_PY_TESTS is set, and python3 lacks one of {modules:?}: run .ci/run");
    }
    if !found {
        println!(
            "SKIPPED: python3 lacks one of {modules:?}. To run this test, run .ci/run, which \
             installs them into .ci/pydeps"
        );
    }
    found
}
