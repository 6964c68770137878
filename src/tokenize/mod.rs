//! `smelt tokenize`: text, JSON Lines and Parquet files into BIN.TOK token files, with a HF
//! tokenizer.json. Each document is encoded whole and followed by EOS; documents go whole to
//! training shards or to eval.bin. With prompt and response fields (chat/SFT data), the token
//! files carry a loss mask that trains only the response and its EOS; with a messages field,
//! the tokenizer's chat template renders each conversation, and only the assistant's messages
//! are trained.
//!
//! Files: `inputs` (globs and formats), `compressed` (.gz and .zst inputs), the readers
//! `txt`, `jsonl`, `parquet`, `encoder` and `eos` (the tokenizer), `chat_template`
//! (conversations into trained and untrained pieces), `outputs` (shards and the eval split),
//! `pipeline` (threads and batches), `progress`, `summary`, and `shown` (a JSON value quoted
//! in an error).

pub mod chat_template;
mod compressed;
mod document;
pub mod encoder;
pub mod eos;
pub mod inputs;
mod jsonl;
pub mod outputs;
mod parquet;
mod pipeline;
mod progress;
mod shown;
pub mod summary;
mod txt;

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Result, bail};

pub use document::Document;
pub use encoder::Encoder;
pub use outputs::EvalSplit;
pub use summary::Summary;

pub const DEFAULT_SHARD_TOKENS: usize = 100_000_000;

pub struct Options {
    /// A tokenizer.json, or a directory holding one.
    pub tokenizer: PathBuf,
    /// Globs of input files, read in the order given.
    pub inputs: Vec<String>,
    pub out_dir: PathBuf,
    /// The JSONL field and the Parquet column holding the text.
    pub text_field: String,
    pub text_column: String,
    /// Splits .txt files into documents; without it a file is one document.
    pub separator: Option<String>,
    /// Chat/SFT JSONL: the prompt and response fields; only the response is trained.
    pub chat: Option<(String, String)>,
    /// Chat JSONL: the field holding each conversation's messages; only the assistant's
    /// are trained.
    pub messages_field: Option<String>,
    /// A Jinja file to render conversations with, instead of the tokenizer's chat_template.
    pub chat_template: Option<PathBuf>,
    /// Variables for the template (`chat_template::parse_kwargs`).
    pub chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// With `messages_field`: the JSONL field holding each conversation's tools, which the
    /// template lists for the model.
    pub tools_field: Option<String>,
    /// Which of a conversation's assistant messages are trained.
    pub turns: chat_template::Turns,
    /// The EOS id; without it, the one the tokenizer's configuration names.
    pub eos_id: Option<u32>,
    pub eval: EvalSplit,
    pub shard_tokens: usize,
}

impl Options {
    /// Plain text in `text` fields and columns, no eval split, default shards.
    pub fn new(tokenizer: PathBuf, inputs: Vec<String>, out_dir: PathBuf) -> Options {
        Options {
            tokenizer,
            inputs,
            out_dir,
            text_field: "text".into(),
            text_column: "text".into(),
            separator: None,
            chat: None,
            messages_field: None,
            chat_template: None,
            chat_template_kwargs: Default::default(),
            tools_field: None,
            turns: chat_template::Turns::All,
            eos_id: None,
            eval: EvalSplit::None,
            shard_tokens: DEFAULT_SHARD_TOKENS,
        }
    }
}

pub fn tokenize(opts: &Options) -> Result<Summary> {
    if opts.shard_tokens == 0 || opts.shard_tokens > i32::MAX as usize {
        bail!(
            "--shard-tokens {}: must be between 1 and 2^31 - 1",
            opts.shard_tokens
        );
    }
    match opts.eval {
        EvalSplit::Fraction(f) if !(f > 0.0 && f < 1.0) => {
            bail!("--eval-fraction {f}: must be between 0 and 1")
        }
        EvalSplit::Tokens(0) => bail!("--eval-tokens 0: give at least 1, or leave it out"),
        _ => {}
    }
    if opts.separator.as_deref() == Some("") {
        bail!("--separator is empty; leave it out to make each .txt file one document");
    }
    let encoder = Encoder::load(&opts.tokenizer, opts.eos_id)?;
    let inputs = inputs::expand(&opts.inputs)?;
    if opts.chat.is_some() && opts.messages_field.is_some() {
        bail!("--messages-field and --prompt-field/--response-field exclude each other");
    }
    let mask_flags = match (&opts.chat, &opts.messages_field) {
        (Some(_), _) => Some("--prompt-field and --response-field apply"),
        (None, Some(_)) => Some("--messages-field applies"),
        (None, None) => None,
    };
    if let Some(flags) = mask_flags
        && let Some(other) = inputs.iter().find(|i| i.format != inputs::Format::Jsonl)
    {
        bail!("{}: {flags} to .jsonl inputs only", other.path.display());
    }
    let fields = match (&opts.chat, &opts.messages_field) {
        (Some((prompt, response)), _) => jsonl::Fields::Chat {
            prompt: prompt.clone(),
            response: response.clone(),
        },
        (None, Some(field)) => jsonl::Fields::Messages {
            field: field.clone(),
            tools: opts.tools_field.clone(),
            template: Box::new(
                chat_template::ChatTemplate::load(
                    encoder.path.parent().unwrap_or(Path::new(".")),
                    opts.chat_template.as_deref(),
                )?
                .with_kwargs(&opts.chat_template_kwargs),
            ),
            turns: opts.turns,
        },
        (None, None) => jsonl::Fields::Text(opts.text_field.clone()),
    };
    let readers = pipeline::Readers {
        separator: opts.separator.clone(),
        fields,
        column: opts.text_column.clone(),
    };
    let mut outputs = outputs::Outputs::create(
        &opts.out_dir,
        encoder.vocab_size,
        mask_flags.is_some(),
        opts.shard_tokens,
        opts.eval,
    )?;
    let input_bytes = inputs.iter().map(|i| i.bytes).sum();
    let start = Instant::now();
    let progress = progress::Progress::new(input_bytes);
    let counts = pipeline::run(&inputs, &readers, &encoder, &mut outputs, &progress);
    progress.finish();
    let counts = counts?;
    let files = outputs.finish()?;
    Ok(Summary {
        input_files: inputs.len(),
        input_bytes,
        documents: counts.documents,
        empty: counts.empty,
        tokens: counts.tokens,
        trained: mask_flags.map(|_| counts.trained),
        seconds: start.elapsed().as_secs_f64(),
        vocab_size: encoder.vocab_size,
        eos: encoder.eos.clone(),
        files,
    })
}
