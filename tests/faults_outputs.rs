//! What a run leaves behind: every file it writes with the same mode (what creating a file
//! gives under the umask), and a log that ends with the error when the run fails.

mod train_support;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use train_support::*;

/// The permission bits of `path`.
fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

#[test]
fn every_output_file_has_the_mode_of_a_created_file() {
    let set = setup();
    let dir = set.root.join("run");
    smelt_ok(&strs(&run_args(&set, &dir, &["--ckpt-interval", "2"])));
    let exported = set.root.join("exported");
    let out = dir.join("out");
    smelt_ok(&["export", "--model", s(&out), "--out-dir", s(&exported)]);
    // What `File::create` gives here, under this process's umask (which the runs inherited).
    let probe = set.root.join("probe");
    std::fs::File::create(&probe).unwrap();
    let expected = mode(&probe);
    let mut files: Vec<_> = [dir.as_path(), &exported]
        .iter()
        .flat_map(|d| snapshot(d).into_keys())
        .collect();
    files.sort();
    for file in ["out/model.safetensors", "out/config.json", "ckpt/latest"] {
        assert!(files.contains(&dir.join(file)), "{file} not written");
    }
    let modes: Vec<(String, u32)> = files
        .iter()
        .map(|f| (f.display().to_string(), mode(f)))
        .filter(|(_, m)| *m != expected)
        .collect();
    assert_eq!(modes, vec![], "files not of mode {expected:o}");
}

/// The last line of a log, as JSON.
fn last_event(log: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(log).unwrap();
    serde_json::from_str(text.lines().last().unwrap()).unwrap()
}

#[test]
fn a_failed_run_ends_its_log_with_the_error() {
    let set = setup();
    let dir = set.root.join("run");
    let mut flags = DIVERGING.to_vec();
    flags.extend(["--steps", "3"]);
    let out = smelt(&strs(&run_args(&set, &dir, &flags)));
    let err = assert_refused(&out, &["not finite"]);
    let event = last_event(&dir.join("log.jsonl"));
    assert_eq!(event["event"], "error", "{event}");
    let message = err.lines().find_map(|l| l.strip_prefix("error: ")).unwrap();
    assert_eq!(event["message"], message);
    // The log is still one that `smelt plot` reads.
    smelt_ok(&[
        "plot",
        s(&dir.join("log.jsonl")),
        "-o",
        s(&set.root.join("p.png")),
    ]);
}
