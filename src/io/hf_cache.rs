//! Models named as on the Hugging Face Hub (`--model Qwen/Qwen2.5-0.5B`), found in the local
//! HF cache that huggingface_hub downloads into; nothing is downloaded.
//!
//! The cache is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`,
//! else `~/.cache/huggingface/hub`. A model `owner/name` lives in its folder
//! `models--owner--name`, where `refs/main` (or `refs/REVISION`) holds a commit hash and
//! `snapshots/HASH/` holds the files of that commit: a model directory.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

/// A model's name on the Hub, `owner/name`, with a branch, tag or commit after an `@`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubName {
    pub repo: String,
    /// `main` unless given.
    pub revision: String,
}

impl HubName {
    /// `owner/name` or `owner/name@revision`; `None` for anything else, such as a path of
    /// more or fewer parts. Each part is letters, digits, `-`, `_` and `.`, as the Hub allows.
    pub fn parse(model: &Path) -> Option<HubName> {
        let text = model.to_str()?;
        let (repo, revision) = match text.split_once('@') {
            Some((repo, revision)) => (repo, revision),
            None => (text, "main"),
        };
        let part = |p: &str| {
            !p.is_empty()
                && !p.starts_with('.')
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        };
        let (owner, name) = repo.split_once('/')?;
        // A revision names a file under refs/, so it may hold `/` (refs/pr/1) but not `..`.
        let revision_ok = !revision.is_empty() && revision.split('/').all(part);
        (part(owner) && part(name) && revision_ok).then(|| HubName {
            repo: repo.to_string(),
            revision: revision.to_string(),
        })
    }

    /// The name as given: the revision only where it is not `main`.
    fn shown(&self) -> String {
        match self.revision.as_str() {
            "main" => self.repo.clone(),
            r => format!("{}@{r}", self.repo),
        }
    }

    /// The model's folder in the cache.
    fn folder(&self) -> String {
        format!("models--{}", self.repo.replace('/', "--"))
    }

    /// The command that downloads it into the cache.
    fn download_command(&self) -> String {
        let revision = match self.revision.as_str() {
            "main" => String::new(),
            r => format!(" --revision {r}"),
        };
        format!(
            "`huggingface-cli download {repo}{revision}` (or `hf download {repo}{revision}`)",
            repo = self.repo
        )
    }
}

/// The cache folder, from the environment as `getenv` reads it; `None` where there is no
/// home folder to default to.
pub fn cache_root(getenv: impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    let set = |name: &str| getenv(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    set("HF_HUB_CACHE")
        .or_else(|| set("HF_HOME").map(|home| home.join("hub")))
        .or_else(|| set("XDG_CACHE_HOME").map(|cache| cache.join("huggingface/hub")))
        .or_else(|| set("HOME").map(|home| home.join(".cache/huggingface/hub")))
}

/// The snapshot folder of `name` in the cache at `root`, or an error saying what is missing
/// there and how to download it.
pub fn snapshot(root: &Path, name: &HubName) -> Result<PathBuf> {
    let folder = root.join(name.folder());
    let missing = |what: String| {
        anyhow::anyhow!(
            "--model {}: not a directory, and {what}; download it with {}, or give a model \
             directory",
            name.shown(),
            name.download_command()
        )
    };
    if !folder.is_dir() {
        return Err(missing(format!(
            "the HF cache has no {} (looked in {}: $HF_HUB_CACHE, else $HF_HOME/hub, else \
             ~/.cache/huggingface/hub)",
            name.folder(),
            root.display()
        )));
    }
    let is_commit =
        name.revision.len() == 40 && name.revision.chars().all(|c| c.is_ascii_hexdigit());
    let commit = match is_commit {
        true => name.revision.clone(),
        false => {
            let reference = folder.join("refs").join(&name.revision);
            match std::fs::read_to_string(&reference) {
                Ok(text) => text.trim().to_string(),
                Err(_) => {
                    return Err(missing(format!(
                        "{} is missing: the cache holds no revision `{}` of it",
                        reference.display(),
                        name.revision
                    )));
                }
            }
        }
    };
    let dir = folder.join("snapshots").join(&commit);
    if !dir.is_dir() {
        return Err(missing(format!(
            "its snapshot {} is missing (an interrupted or deleted download)",
            dir.display()
        )));
    }
    Ok(dir)
}

/// The directory `--model` names: `model` itself where it exists or is no Hub name, else
/// the snapshot of the Hub name in the cache.
pub fn model_dir(model: &Path) -> Result<PathBuf> {
    let Some(name) = HubName::parse(model).filter(|_| !model.exists()) else {
        return Ok(model.to_path_buf());
    };
    let Some(root) = cache_root(|v| std::env::var_os(v)) else {
        bail!(
            "--model {}: not a directory, and there is no HF cache to look in: set HF_HUB_CACHE \
             or HF_HOME, or give a model directory",
            model.display()
        );
    };
    snapshot(&root, &name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(text: &str) -> Option<HubName> {
        HubName::parse(Path::new(text))
    }

    const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

    /// A cache holding Qwen/Qwen2.5-0.5B with `refs/main` naming COMMIT, whose snapshot
    /// exists when `snapshot` is true.
    fn cache(snapshot: bool) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        let folder = root.path().join("models--Qwen--Qwen2.5-0.5B");
        std::fs::create_dir_all(folder.join("refs")).unwrap();
        std::fs::write(folder.join("refs/main"), COMMIT).unwrap();
        if snapshot {
            std::fs::create_dir_all(folder.join("snapshots").join(COMMIT)).unwrap();
        }
        root
    }

    #[test]
    fn hub_names_are_owner_slash_name_with_a_revision() {
        let qwen = name("Qwen/Qwen2.5-0.5B").unwrap();
        assert_eq!(
            (qwen.repo.as_str(), qwen.revision.as_str()),
            ("Qwen/Qwen2.5-0.5B", "main")
        );
        assert_eq!(name("a/b@refs/pr/1").unwrap().revision, "refs/pr/1");
        for not_a_name in [
            "qwen2.5-0.5b",
            "runs/a/model",
            "/abs/path",
            "./model",
            "a/",
            "../b",
            "a/b@",
            "a/b@../x",
            "a b/c",
        ] {
            assert_eq!(name(not_a_name), None, "{not_a_name}");
        }
    }

    #[test]
    fn refs_main_names_the_snapshot() {
        let root = cache(true);
        let dir = snapshot(root.path(), &name("Qwen/Qwen2.5-0.5B").unwrap()).unwrap();
        assert_eq!(
            dir,
            root.path()
                .join("models--Qwen--Qwen2.5-0.5B/snapshots")
                .join(COMMIT)
        );
    }

    #[test]
    fn a_revision_is_a_ref_or_a_commit() {
        let root = cache(true);
        let folder = root.path().join("models--Qwen--Qwen2.5-0.5B");
        let other = "fedcba9876543210fedcba9876543210fedcba98";
        std::fs::create_dir_all(folder.join("snapshots").join(other)).unwrap();
        std::fs::write(folder.join("refs/v2"), format!("{other}\n")).unwrap();
        let at = |revision: &str| {
            let n = name(&format!("Qwen/Qwen2.5-0.5B@{revision}")).unwrap();
            snapshot(root.path(), &n)
        };
        assert_eq!(at("v2").unwrap(), folder.join("snapshots").join(other));
        assert_eq!(at(COMMIT).unwrap(), folder.join("snapshots").join(COMMIT));
        let err = at("v3").unwrap_err().to_string();
        assert!(err.contains("refs/v3 is missing"), "{err}");
        assert!(err.contains("--revision v3"), "{err}");
    }

    #[test]
    fn a_missing_snapshot_or_cache_says_where_it_looked_and_how_to_download() {
        let root = cache(false);
        let qwen = name("Qwen/Qwen2.5-0.5B").unwrap();
        let err = snapshot(root.path(), &qwen).unwrap_err().to_string();
        assert!(
            err.contains(&format!("snapshots/{COMMIT} is missing")),
            "{err}"
        );
        assert!(
            err.contains("`huggingface-cli download Qwen/Qwen2.5-0.5B`"),
            "{err}"
        );
        let empty = tempfile::tempdir().unwrap();
        let err = snapshot(empty.path(), &qwen).unwrap_err().to_string();
        assert!(
            err.contains("the HF cache has no models--Qwen--Qwen2.5-0.5B"),
            "{err}"
        );
        assert!(err.contains(&empty.path().display().to_string()), "{err}");
        assert!(err.contains("`hf download Qwen/Qwen2.5-0.5B`"), "{err}");
    }

    #[test]
    fn the_cache_root_follows_huggingface_hub() {
        let env = |vars: &[(&str, &str)]| {
            let vars: Vec<(String, OsString)> = vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.into()))
                .collect();
            cache_root(|name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
        };
        let all = [
            ("HF_HUB_CACHE", "/hub"),
            ("HF_HOME", "/hf"),
            ("XDG_CACHE_HOME", "/xdg"),
            ("HOME", "/home/u"),
        ];
        assert_eq!(env(&all), Some("/hub".into()));
        assert_eq!(env(&all[1..]), Some("/hf/hub".into()));
        assert_eq!(env(&all[2..]), Some("/xdg/huggingface/hub".into()));
        assert_eq!(
            env(&all[3..]),
            Some("/home/u/.cache/huggingface/hub".into())
        );
        assert_eq!(
            env(&[("HF_HUB_CACHE", ""), ("HOME", "/h")]),
            Some("/h/.cache/huggingface/hub".into())
        );
        assert_eq!(env(&[]), None);
    }
}
