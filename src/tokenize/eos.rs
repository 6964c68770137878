//! The end-of-sequence token appended after each document: from `--eos-id`, or named by the
//! configuration files beside tokenizer.json, as transformers reads them. Never guessed.

use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value;
use tokenizers::Tokenizer;

#[derive(Clone, Debug)]
pub struct Eos {
    pub id: u32,
    /// The token's text, as the tokenizer spells it.
    pub token: String,
    /// Where the id came from, for the summary.
    pub source: String,
}

/// The files searched, in order, and the key each names the EOS by.
const CONFIGS: [(&str, &str); 3] = [
    ("tokenizer_config.json", "eos_token"),
    ("config.json", "eos_token_id"),
    ("generation_config.json", "eos_token_id"),
];

pub fn find(
    tokenizer_file: &Path, tokenizer: &Tokenizer, flag: Option<u32>, vocab_size: usize,
) -> Result<Eos> {
    let eos = |id: u32, source: String| -> Result<Eos> {
        if id as usize >= vocab_size {
            bail!("{source}: EOS id {id} is outside the tokenizer's vocabulary of {vocab_size}");
        }
        let token = tokenizer.id_to_token(id).unwrap_or_default();
        Ok(Eos { id, token, source })
    };
    if let Some(id) = flag {
        return eos(id, "--eos-id".into());
    }
    let dir = tokenizer_file.parent().unwrap_or(Path::new("."));
    for (file, key) in CONFIGS {
        let path = dir.join(file);
        if !path.exists() {
            continue;
        }
        let name = path.display();
        let text =
            std::fs::read_to_string(&path).with_context(|| format!("{name}: cannot read"))?;
        let json: Value =
            serde_json::from_str(&text).with_context(|| format!("{name}: not valid JSON"))?;
        let source = format!("{name} {key}");
        match json.get(key) {
            None | Some(Value::Null) => continue,
            // tokenizer_config.json names the token: "<|endoftext|>" or {"content": ...}.
            Some(Value::String(token)) => return eos(id_of(tokenizer, token, &source)?, source),
            Some(Value::Object(o)) if o.get("content").is_some_and(Value::is_string) => {
                let token = o["content"].as_str().expect("checked to be a string");
                return eos(id_of(tokenizer, token, &source)?, source);
            }
            // config.json gives an id, or a list whose first is the canonical one.
            Some(Value::Number(n)) if n.as_u64().is_some_and(|v| v <= u32::MAX as u64) => {
                return eos(n.as_u64().expect("checked") as u32, source);
            }
            Some(Value::Array(ids)) if !ids.is_empty() => {
                let first = ids[0].as_u64().filter(|&v| v <= u32::MAX as u64);
                let first =
                    first.ok_or_else(|| anyhow!("{source}: {} is not a token id", ids[0]))?;
                return eos(
                    first as u32,
                    format!("{source} (first of {})", Value::Array(ids.clone())),
                );
            }
            Some(other) => bail!("{source}: cannot read an EOS token from {other}; pass --eos-id"),
        }
    }
    let mut specials: Vec<(u32, String)> = tokenizer
        .get_added_tokens_decoder()
        .into_iter()
        .filter(|(_, t)| t.special)
        .map(|(id, t)| (id, t.content))
        .collect();
    specials.sort();
    let shown: Vec<String> = specials
        .iter()
        .take(6)
        .map(|(id, t)| format!("{t} = {id}"))
        .collect();
    bail!(
        "{}: no EOS token: none of {} beside it names one; pass --eos-id (the tokenizer's special tokens: {})",
        tokenizer_file.display(),
        CONFIGS.map(|(f, _)| f).join(", "),
        if shown.is_empty() {
            "none".into()
        } else {
            shown.join(", ")
        }
    )
}

fn id_of(tokenizer: &Tokenizer, token: &str, source: &str) -> Result<u32> {
    tokenizer.token_to_id(token).ok_or_else(|| {
        anyhow!("{source}: EOS token {token:?} is not in the tokenizer's vocabulary; pass --eos-id")
    })
}
