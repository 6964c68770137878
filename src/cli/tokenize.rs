//! `smelt tokenize`: raw text, JSONL or Parquet into BIN.TOK token files.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::Args;
use serde_json::{Map, Value};

use crate::tokenize::chat_template::{Turns, parse_kwargs};
use crate::tokenize::{DEFAULT_SHARD_TOKENS, EvalSplit, Options, tokenize};

#[derive(Args)]
#[command(allow_negative_numbers = true)]
pub struct TokenizeArgs {
    /// Input files (globs): .txt/.md (one document per file, or split with --separator),
    /// .jsonl (the document in --text-field) and .parquet (in --text-column)
    #[arg(value_name = "INPUT")]
    inputs: Vec<String>,
    /// More input files (globs), after the positional ones
    #[arg(long = "input", value_name = "GLOB")]
    input: Vec<String>,
    /// A HF tokenizer.json, or a model directory holding one
    #[arg(long, value_name = "PATH")]
    tokenizer: PathBuf,
    /// Where train-000.bin, train-001.bin, ... and eval.bin are written
    #[arg(long, value_name = "DIR")]
    out_dir: PathBuf,
    /// The JSONL field holding each document
    #[arg(long, default_value = "text")]
    text_field: String,
    /// The Parquet column holding each document
    #[arg(long, default_value = "text")]
    text_column: String,
    /// Splits .txt files into documents at this string (\n, \r, \t and \\ are understood)
    #[arg(long)]
    separator: Option<String>,
    /// Chat/SFT JSONL: the prompt field (not trained); needs --response-field
    #[arg(long, requires = "response_field")]
    prompt_field: Option<String>,
    /// Chat/SFT JSONL: the response field (trained); the files get a loss mask
    #[arg(long, requires = "prompt_field")]
    response_field: Option<String>,
    /// Chat JSONL: the field holding each conversation, a list of {"role", "content"}
    /// messages, rendered with the tokenizer's chat template; only the assistant's messages
    /// are trained (the files get a loss mask)
    #[arg(long, value_name = "FIELD", conflicts_with_all = ["prompt_field", "response_field"])]
    messages_field: Option<String>,
    /// With --messages-field: a Jinja file to render conversations with, instead of the
    /// chat_template of tokenizer_config.json beside the tokenizer
    #[arg(long, value_name = "FILE", requires = "messages_field")]
    chat_template: Option<PathBuf>,
    /// With --messages-field: variables for the template, as a JSON object, as
    /// transformers' apply_chat_template takes them, e.g. '{"enable_thinking": false}'
    #[arg(long, value_name = "JSON", requires = "messages_field", value_parser = parse_kwargs)]
    chat_template_kwargs: Option<Map<String, Value>>,
    /// With --messages-field: the field holding each conversation's tools (a list of JSON
    /// schemas, as transformers' `tools`), which the template lists for the model; a line
    /// without it has none
    #[arg(long, value_name = "FIELD", requires = "messages_field")]
    tools_field: Option<String>,
    /// With --messages-field: train only each conversation's last assistant message, for
    /// templates that write earlier turns differently once later ones follow (Qwen3's drops
    /// their reasoning)
    #[arg(long, requires = "messages_field")]
    last_turn_only: bool,
    /// The token appended after each document; default: the EOS that tokenizer_config.json,
    /// config.json or generation_config.json beside the tokenizer names
    #[arg(long, value_name = "ID")]
    eos_id: Option<u32>,
    /// Holds out about this fraction of the tokens (whole documents, spread through the input)
    /// in eval.bin
    #[arg(long, value_name = "F", conflicts_with = "eval_tokens")]
    eval_fraction: Option<f64>,
    /// Holds out the first documents, at least this many tokens, in eval.bin
    #[arg(long, value_name = "N")]
    eval_tokens: Option<usize>,
    /// Tokens per training shard (whole documents; a longer document gets a shard of its own)
    #[arg(long, value_name = "N", default_value_t = DEFAULT_SHARD_TOKENS)]
    shard_tokens: usize,
}

pub fn run(args: TokenizeArgs) -> Result<()> {
    let mut inputs = args.inputs;
    inputs.extend(args.input);
    let mut opts = Options::new(args.tokenizer, inputs, args.out_dir);
    opts.text_field = args.text_field;
    opts.text_column = args.text_column;
    opts.separator = args.separator.as_deref().map(unescape).transpose()?;
    opts.chat = args.prompt_field.zip(args.response_field);
    opts.messages_field = args.messages_field;
    opts.chat_template = args.chat_template;
    opts.tools_field = args.tools_field;
    opts.chat_template_kwargs = args.chat_template_kwargs.unwrap_or_default();
    opts.turns = match args.last_turn_only {
        true => Turns::Last,
        false => Turns::All,
    };
    opts.eos_id = args.eos_id;
    opts.eval = match (args.eval_fraction, args.eval_tokens) {
        (Some(f), _) => EvalSplit::Fraction(f),
        (None, Some(n)) => EvalSplit::Tokens(n),
        (None, None) => EvalSplit::None,
    };
    opts.shard_tokens = args.shard_tokens;
    let summary = tokenize(&opts)?;
    // The files are written by now: a closed stdout (piped into `head`) is no failure.
    let _ = write!(std::io::stdout().lock(), "{summary}");
    Ok(())
}

/// Shell quoting makes a newline awkward to type, so the separator understands `\n`, `\r`,
/// `\t` and `\\`.
fn unescape(s: &str) -> Result<String> {
    let mut out = String::new();
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        out.push(match chars.next() {
            Some('n') => '\n',
            Some('r') => '\r',
            Some('t') => '\t',
            Some('\\') => '\\',
            other => bail!(
                "--separator {s:?}: unknown escape \\{}; use \\n, \\r, \\t or \\\\",
                other.map(String::from).unwrap_or_default()
            ),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::unescape;

    #[test]
    fn separators_unescape() {
        assert_eq!(unescape(r"\n\n").unwrap(), "\n\n");
        assert_eq!(unescape(r"<doc>\t\\x").unwrap(), "<doc>\t\\x");
        assert!(unescape(r"\q").is_err());
    }
}
