//! How a sample's text becomes tokens and back: the model's HF tokenizer, bytes for the
//! demo's 256-token vocabulary, or, without either, token ids as `--tokens` takes them.

use std::path::Path;

use anyhow::{Result, anyhow, bail};

use crate::model::ModelConfig;
use crate::train::demo;

/// How text becomes tokens and back.
pub enum Codec {
    Hf(Box<tokenizers::Tokenizer>),
    Bytes,
    /// No tokenizer: token ids in, token ids out.
    None,
}

impl Codec {
    /// The model's tokenizer.json in `dir` if there is one, else bytes for a 256-token
    /// vocabulary.
    pub fn find(dir: Option<&Path>, config: &ModelConfig) -> Result<Codec> {
        if let Some(path) = dir.map(|d| d.join("tokenizer.json")).filter(|p| p.exists()) {
            let t = tokenizers::Tokenizer::from_file(&path)
                .map_err(|e| anyhow!("{}: cannot read the tokenizer: {e}", path.display()))?;
            return Ok(Codec::Hf(Box::new(t)));
        }
        Ok(if config.vocab_size == demo::VOCAB {
            Codec::Bytes
        } else {
            Codec::None
        })
    }

    /// `text`'s tokens, with the tokenizer's special tokens (such as a BOS) where
    /// `special_tokens`; a chat template's text writes its own.
    pub fn encode(&self, text: &str, special_tokens: bool) -> Result<Vec<i32>> {
        match self {
            Codec::Hf(t) => Ok(t
                .encode(text, special_tokens)
                .map_err(|e| anyhow!("encoding the prompt: {e}"))?
                .get_ids()
                .iter()
                .map(|&id| id as i32)
                .collect()),
            Codec::Bytes => Ok(text.bytes().map(i32::from).collect()),
            Codec::None => bail!(
                "--prompt needs a tokenizer.json next to the model, and there is none; give the prompt as --tokens ids"
            ),
        }
    }

    /// The tokens' text; with `skip_special`, without special tokens (a chat turn's end).
    pub fn decode(&self, tokens: &[i32], skip_special: bool) -> Result<String> {
        match self {
            Codec::Hf(t) => {
                let ids: Vec<u32> = tokens.iter().map(|&t| t as u32).collect();
                t.decode(&ids, skip_special)
                    .map_err(|e| anyhow!("decoding the sample: {e}"))
            }
            Codec::Bytes => Ok(demo::decode(tokens)),
            // As --tokens takes them.
            Codec::None => Ok(tokens
                .iter()
                .map(i32::to_string)
                .collect::<Vec<_>>()
                .join(",")),
        }
    }
}
