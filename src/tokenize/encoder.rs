//! The HF tokenizer: loading it, its vocabulary size, and encoding a document into the
//! tokens written to a token file.

use std::path::{Path, PathBuf};

use anyhow::{Result, anyhow, bail};
use tokenizers::Tokenizer;

use super::document::Document;
use super::eos::{self, Eos};

pub struct Encoder {
    tokenizer: Tokenizer,
    /// The tokenizer.json that was loaded.
    pub path: PathBuf,
    /// One past the largest token id, as written into the token files' headers.
    pub vocab_size: usize,
    pub eos: Eos,
}

/// A document's tokens, EOS last, and whether each is trained (as a target).
pub struct Encoded {
    pub ids: Vec<i32>,
    pub trained: Vec<bool>,
}

impl Encoder {
    /// Loads `path` (a tokenizer.json, or a directory holding one) and finds the EOS token:
    /// `eos_id` if given, else the one the configuration files beside it name.
    pub fn load(path: &Path, eos_id: Option<u32>) -> Result<Encoder> {
        let path = tokenizer_file(path)?;
        let tokenizer = Tokenizer::from_file(&path)
            .map_err(|e| anyhow!("{}: not a usable tokenizer.json: {e}", path.display()))?;
        let vocab_size = vocab_size(&tokenizer, &path)?;
        let eos = eos::find(&path, &tokenizer, eos_id, vocab_size)?;
        Ok(Encoder {
            tokenizer,
            path,
            vocab_size,
            eos,
        })
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The document's pieces, the first with the tokenizer's special tokens (such as a BOS)
    /// where the document asks for them, then EOS. Pieces are encoded apart, so that no
    /// token straddles a boundary between untrained and trained text.
    pub fn encode(&self, doc: &Document) -> Result<Encoded> {
        let (mut ids, mut trained) = (Vec::new(), Vec::new());
        for (k, piece) in doc.pieces.iter().enumerate() {
            let piece_ids = self.ids(&piece.text, doc.special_tokens && k == 0)?;
            trained.resize(trained.len() + piece_ids.len(), piece.trained);
            ids.extend(piece_ids);
        }
        ids.push(self.eos.id as i32);
        trained.push(doc.eos_trained);
        Ok(Encoded { ids, trained })
    }

    fn ids(&self, text: &str, special: bool) -> Result<Vec<i32>> {
        let encoding = self
            .tokenizer
            .encode_fast(text, special)
            .map_err(|e| anyhow!("{}: cannot encode: {e}", self.path.display()))?;
        // Every id is below vocab_size, which `vocab_size` checked fits an i32.
        Ok(encoding.get_ids().iter().map(|&id| id as i32).collect())
    }
}

fn tokenizer_file(path: &Path) -> Result<PathBuf> {
    let name = path.display();
    if path.is_dir() {
        let file = path.join("tokenizer.json");
        if !file.is_file() {
            bail!("--tokenizer {name}: the directory has no tokenizer.json");
        }
        return Ok(file);
    }
    if !path.is_file() {
        bail!(
            "--tokenizer {name}: no such file; give a tokenizer.json or a model directory holding one"
        );
    }
    Ok(path.to_path_buf())
}

/// One past the largest id, added tokens included; BIN.TOK stores tokens as int32.
pub fn vocab_size(tokenizer: &Tokenizer, path: &Path) -> Result<usize> {
    let largest = tokenizer
        .get_vocab(true)
        .into_values()
        .max()
        .ok_or_else(|| anyhow!("{}: the tokenizer has an empty vocabulary", path.display()))?;
    let size = largest as usize + 1;
    if size > i32::MAX as usize {
        bail!(
            "{}: token id {largest} does not fit BIN.TOK's int32 tokens (ids must be below 2^31 - 1)",
            path.display()
        );
    }
    Ok(size)
}
