//! `--model owner/name`: every command that takes `--model` finds a model in the local HF
//! cache (`$HF_HUB_CACHE`), laid out as huggingface_hub downloads it, and says where it
//! looked when the model is not there.

mod train_support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use train_support::*;

const COMMIT: &str = "3f2c9a1b5d7e8f6a4b2c0d1e3f5a7b9c8d6e4f2a";

/// Puts the files of `model` into the cache at `cache` as huggingface_hub downloads `repo`:
/// each file a link in `snapshots/COMMIT/` to its content in `blobs/`, and `refs/main`
/// naming the commit.
fn cache_model(cache: &Path, repo: &str, model: &Path) -> PathBuf {
    let folder = cache.join(format!("models--{}", repo.replace('/', "--")));
    let snapshot = folder.join("snapshots").join(COMMIT);
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(folder.join("blobs")).unwrap();
    std::fs::create_dir_all(folder.join("refs")).unwrap();
    std::fs::write(folder.join("refs/main"), COMMIT).unwrap();
    for entry in std::fs::read_dir(model).unwrap() {
        let file = entry.unwrap().path();
        let name = file.file_name().unwrap().to_str().unwrap().to_string();
        let blob = folder.join("blobs").join(format!("blob-{name}"));
        std::fs::copy(&file, &blob).unwrap();
        let target = Path::new("../../blobs").join(format!("blob-{name}"));
        std::os::unix::fs::symlink(target, snapshot.join(&name)).unwrap();
    }
    snapshot
}

/// `smelt args`, with the HF cache at `cache`.
fn smelt_with_cache(cache: &Path, args: &[&str]) -> Output {
    Command::new(SMELT)
        .env("HF_HUB_CACHE", cache)
        .args(args)
        .output()
        .unwrap()
}

fn ok(out: Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn train_sample_export_and_plan_find_a_model_by_its_hub_name() {
    let t = setup();
    let cache = t.root.join("hub");
    cache_model(&cache, "tiny/llama", &t.model);
    let out = t.root.join("out");
    let log = t.root.join("log.jsonl");
    #[rustfmt::skip]
    let train = [
        "train", "--model", "tiny/llama", "--from-scratch", "--train-file", s(&t.data),
        "--batch-size", "2", "--seq-len", "16", "--steps", "2", "--device", "cpu",
        "--out-dir", s(&out), "--log-file", s(&log),
    ];
    let stdout = ok(smelt_with_cache(&cache, &train));
    assert!(stdout.contains(&format!("snapshots/{COMMIT}")), "{stdout}");
    assert_eq!(steps(&log).len(), 2);

    // The trained model, as if downloaded, read back by the commands that take a model.
    let trained = cache_model(&cache, "tiny/trained", &out);
    #[rustfmt::skip]
    let sample = [
        "sample", "--model", "tiny/trained", "--tokens", "1,2", "--max-new-tokens", "2",
        "--device", "cpu", "--temperature", "0",
    ];
    let sampled = ok(smelt_with_cache(&cache, &sample));
    assert!(!sampled.is_empty());
    let exported = t.root.join("exported");
    ok(smelt_with_cache(
        &cache,
        &[
            "export",
            "--model",
            "tiny/trained",
            "--out-dir",
            s(&exported),
        ],
    ));
    assert!(exported.join("model.safetensors").exists());
    // Export refuses to write into the model it reads, found through the cache too.
    let into_itself = smelt_with_cache(
        &cache,
        &[
            "export",
            "--model",
            "tiny/trained",
            "--out-dir",
            s(&trained),
        ],
    );
    assert!(!into_itself.status.success());
    #[rustfmt::skip]
    let plan = [
        "plan", "--model", "tiny/llama", "--batch-size", "2", "--seq-len", "16",
        "--device-memory", "8", "--host-memory", "8", "--device", "cpu", "--json",
    ];
    ok(smelt_with_cache(&cache, &plan));
}

#[test]
fn a_model_not_in_the_cache_is_refused_saying_where_it_looked() {
    let t = setup();
    let cache = t.root.join("empty-hub");
    let out = smelt_with_cache(
        &cache,
        &[
            "train",
            "--model",
            "Qwen/Qwen2.5-0.5B",
            "--train-file",
            s(&t.data),
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains(&format!(
            "the HF cache has no models--Qwen--Qwen2.5-0.5B (looked in {}",
            cache.display()
        )),
        "{err}"
    );
    assert!(
        err.contains("huggingface-cli download Qwen/Qwen2.5-0.5B"),
        "{err}"
    );
    // A directory of that name is a directory, not a Hub name.
    let local = t.root.join("Qwen/Qwen2.5-0.5B");
    std::fs::create_dir_all(&local).unwrap();
    let out = Command::new(SMELT)
        .current_dir(&t.root)
        .env("HF_HUB_CACHE", &cache)
        .args(["export", "--model", "Qwen/Qwen2.5-0.5B", "--out-dir", "x"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("Qwen/Qwen2.5-0.5B: no config.json"), "{err}");
}
