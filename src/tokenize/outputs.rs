//! The output directory: training shards `train-000.bin`, `train-001.bin`, ... of at most
//! `shard_tokens` tokens (a document longer than that gets a shard of its own), and the
//! held-out `eval.bin`. Documents are never cut, neither between shards nor between train and
//! eval. Every file is written under a temporary name and all are renamed into place together
//! at the end, so a failed run leaves no token file at all, complete or not.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use super::encoder::Encoded;
use crate::data::tokfile::{SealedTokenFile, TokenWriter};
use crate::io::refuse_earlier_outputs;

/// How much goes to eval.bin.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum EvalSplit {
    None,
    /// Documents spread through the input: one goes to eval whenever eval holds less than
    /// this fraction of the tokens so far.
    Fraction(f64),
    /// The first documents, until eval holds at least this many tokens.
    Tokens(usize),
}

/// A file written, with what it holds.
#[derive(Clone, Debug)]
pub struct Written {
    pub path: PathBuf,
    pub tokens: usize,
    pub documents: usize,
}

struct Open {
    writer: TokenWriter,
    documents: usize,
}

pub struct Outputs {
    dir: PathBuf,
    vocab_size: usize,
    masked: bool,
    shard_tokens: usize,
    split: EvalSplit,
    train: Open,
    sealed: Vec<(SealedTokenFile, usize)>,
    eval: Option<Open>,
    train_tokens: usize,
}

impl Outputs {
    /// Creates `dir` if needed and opens the first shard (and eval.bin), so that an unwritable
    /// directory fails before any work.
    pub fn create(
        dir: &Path, vocab_size: usize, masked: bool, shard_tokens: usize, split: EvalSplit,
    ) -> Result<Outputs> {
        let name = dir.display();
        std::fs::create_dir_all(dir).with_context(|| format!("--out-dir {name}: cannot create"))?;
        refuse_earlier_outputs(dir, "--out-dir", "token files", |file| {
            file == "eval.bin" || (file.starts_with("train-") && file.ends_with(".bin"))
        })?;
        let mut outputs = Outputs {
            dir: dir.to_path_buf(),
            vocab_size,
            masked,
            shard_tokens,
            split,
            train: Open {
                writer: open(&dir.join(shard_name(0)), vocab_size, masked)?,
                documents: 0,
            },
            sealed: Vec::new(),
            eval: None,
            train_tokens: 0,
        };
        if split != EvalSplit::None {
            outputs.eval = Some(Open {
                writer: open(&dir.join("eval.bin"), vocab_size, masked)?,
                documents: 0,
            });
        }
        Ok(outputs)
    }

    pub fn add(&mut self, doc: &Encoded) -> Result<()> {
        let n = doc.ids.len();
        let eval_tokens = self.eval.as_ref().map_or(0, |e| e.writer.tokens());
        let to_eval = match self.split {
            EvalSplit::None => false,
            EvalSplit::Fraction(f) => {
                (eval_tokens as f64) < f * (eval_tokens + self.train_tokens) as f64
            }
            EvalSplit::Tokens(t) => eval_tokens < t,
        };
        let mask = self.masked.then_some(doc.trained.as_slice());
        if to_eval {
            let eval = self
                .eval
                .as_mut()
                .expect("opened when a split is asked for");
            eval.writer.write(&doc.ids, mask)?;
            eval.documents += 1;
            return Ok(());
        }
        let current = self.train.writer.tokens();
        if current > 0 && current + n > self.shard_tokens {
            let next = open(
                &self.dir.join(shard_name(self.sealed.len() + 1)),
                self.vocab_size,
                self.masked,
            )?;
            let full = std::mem::replace(
                &mut self.train,
                Open {
                    writer: next,
                    documents: 0,
                },
            );
            self.sealed.push((full.writer.seal()?, full.documents));
        }
        self.train.writer.write(&doc.ids, mask)?;
        self.train.documents += 1;
        self.train_tokens += n;
        Ok(())
    }

    /// Seals the last files and renames every file into place.
    pub fn finish(mut self) -> Result<Vec<Written>> {
        let eval_documents = self.eval.as_ref().map_or(0, |e| e.documents);
        if self.train.writer.tokens() == 0 {
            match eval_documents {
                0 => bail!("the inputs hold no documents"),
                n => bail!(
                    "all {n} documents went to eval.bin and none to training; ask for less eval"
                ),
            }
        }
        let mut files = std::mem::take(&mut self.sealed);
        files.push((self.train.writer.seal()?, self.train.documents));
        if let Some(eval) = self.eval {
            if eval.documents == 0 {
                bail!("eval.bin would be empty: there is only one document");
            }
            files.push((eval.writer.seal()?, eval.documents));
        }
        let mut written = Vec::new();
        for (file, documents) in files {
            let tokens = file.tokens;
            written.push(Written {
                path: file.commit()?,
                tokens,
                documents,
            });
        }
        // The renames are durable only once the directory itself is synced.
        std::fs::File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .with_context(|| format!("--out-dir {}: cannot sync", self.dir.display()))?;
        Ok(written)
    }
}

fn shard_name(index: usize) -> String {
    format!("train-{index:03}.bin")
}

fn open(path: &Path, vocab_size: usize, masked: bool) -> Result<TokenWriter> {
    TokenWriter::create(path, Some(vocab_size), masked)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::tokfile::TokenFile;

    fn doc(len: usize, first: i32) -> Encoded {
        Encoded {
            ids: (first..first + len as i32).collect(),
            trained: (0..len).map(|i| i >= 1).collect(),
        }
    }

    #[test]
    fn shards_hold_whole_documents_and_appear_only_when_finished() {
        let dir = tempfile::tempdir().unwrap();
        let mut out = Outputs::create(dir.path(), 1000, true, 10, EvalSplit::Tokens(4)).unwrap();
        // Eval takes the first document (reaching 4 tokens); then shards of at most 10
        // tokens, except the 12-token document, which gets one of its own.
        for (len, first) in [(5, 0), (6, 100), (3, 200), (12, 300), (4, 400), (4, 500)] {
            out.add(&doc(len, first)).unwrap();
        }
        assert_eq!(
            std::fs::read_dir(dir.path())
                .unwrap()
                .filter(|e| {
                    !e.as_ref()
                        .unwrap()
                        .file_name()
                        .to_string_lossy()
                        .starts_with('.')
                })
                .count(),
            0,
            "nothing under a final name before finish"
        );
        let written = out.finish().unwrap();
        let shape: Vec<(String, usize, usize)> = written
            .iter()
            .map(|w| {
                (
                    w.path.file_name().unwrap().to_string_lossy().into_owned(),
                    w.tokens,
                    w.documents,
                )
            })
            .collect();
        let expect = [
            ("train-000.bin", 9, 2),
            ("train-001.bin", 12, 1),
            ("train-002.bin", 8, 2),
            ("eval.bin", 5, 1),
        ];
        assert_eq!(shape, expect.map(|(n, t, d)| (n.to_string(), t, d)));
        let eval = TokenFile::open(&dir.path().join("eval.bin"), Some(1000)).unwrap();
        assert_eq!(
            (0..5).map(|i| eval.token(i)).collect::<Vec<_>>(),
            [0, 1, 2, 3, 4]
        );
        assert_eq!(
            (0..5).map(|i| eval.trained(i)).collect::<Vec<_>>(),
            [false, true, true, true, true]
        );
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            4,
            "no temporary file left"
        );
    }

    #[test]
    fn a_run_that_stops_early_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut out =
            Outputs::create(dir.path(), 1000, false, 10, EvalSplit::Fraction(0.5)).unwrap();
        for k in 0..10 {
            out.add(&doc(7, 10 * k)).unwrap();
        }
        // Several shards are sealed by now; an error elsewhere drops the outputs unfinished.
        drop(out);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn the_fraction_split_spreads_eval_through_the_input() {
        let dir = tempfile::tempdir().unwrap();
        let mut out =
            Outputs::create(dir.path(), 1000, false, 100, EvalSplit::Fraction(0.25)).unwrap();
        for k in 0..20 {
            out.add(&doc(10, 10 * k)).unwrap();
        }
        let written = out.finish().unwrap();
        let eval = TokenFile::open(&dir.path().join("eval.bin"), None).unwrap();
        // Documents 1, 5, 9, ... go to eval: it is behind its quarter exactly then.
        let firsts: Vec<i32> = (0..eval.len()).step_by(10).map(|i| eval.token(i)).collect();
        assert_eq!(firsts, [10, 50, 90, 130, 170]);
        assert_eq!(written.last().unwrap().tokens, 50);
    }
}
