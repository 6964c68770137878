//! `smelt sample`: continues a prompt with a trained model, to see what a run learned.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::{Map, Value, json};

use super::flags::{FloatDtype, check_floats, parse_flags};
use crate::backend::Backend;
use crate::backend::select::{Device, DeviceChoice, select};
use crate::generate::{Codec, Generator, SampleOptions, Sampling, TextStream};
use crate::io::{hf, hf_cache};
use crate::tensor::DType;
use crate::tokenize::chat_template::{ChatTemplate, Conversation, parse_kwargs};
use crate::train::checkpoint;

#[derive(Args, Debug)]
#[command(
    allow_negative_numbers = true,
    about = "Generate text from a model directory or a checkpoint",
    after_help = "A text --prompt is encoded with the model's tokenizer.json. A model without one \
whose vocabulary is 256 (the demo's) reads bytes as tokens. Otherwise give --tokens. With --chat, \
the prompt is a user's message, which the chat template of the model's tokenizer_config.json \
turns into a conversation asking for the assistant's reply; only the reply is printed."
)]
pub struct SampleArgs {
    /// HF model directory (config.json + model.safetensors, as `smelt train --out-dir`
    /// writes), or a model's Hub name (owner/name) in the local HF cache.
    #[arg(long, value_name = "DIR|NAME", required_unless_present = "checkpoint")]
    model: Option<PathBuf>,
    /// A checkpoint: a step-N directory, or a --checkpoint-dir (its latest checkpoint).
    #[arg(long, value_name = "DIR", conflicts_with = "model")]
    checkpoint: Option<PathBuf>,
    /// The prompt as text.
    #[arg(long, required_unless_present = "tokens")]
    prompt: Option<String>,
    /// --prompt is a user's message to a chat model: render it with the model's chat
    /// template, and print only the reply.
    #[arg(long, requires = "prompt")]
    chat: bool,
    /// With --chat: a system message before the user's.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// With --chat: a Jinja file to render the conversation with, instead of the chat_template
    /// of the tokenizer_config.json beside the model's tokenizer.
    #[arg(long, value_name = "FILE", requires = "chat")]
    chat_template: Option<PathBuf>,
    /// With --chat: variables for the template, as a JSON object, as transformers'
    /// apply_chat_template takes them, e.g. '{"enable_thinking": false}'.
    #[arg(long, value_name = "JSON", requires = "chat", value_parser = parse_kwargs)]
    chat_template_kwargs: Option<Map<String, Value>>,
    /// The prompt as comma-separated token ids, e.g. 9707,1879.
    #[arg(long, value_delimiter = ',', conflicts_with = "prompt")]
    tokens: Option<Vec<i32>>,
    /// Tokens to generate (fewer if the model emits its EOS token).
    #[arg(long, default_value_t = 200)]
    max_new_tokens: usize,
    /// Softmax temperature; 0 always takes the most likely token (greedy).
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    /// Draw only from the k most likely tokens; 0 keeps them all.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Then only from the most likely tokens whose probabilities (renormalised after
    /// --top-k) first add up to at least p (nucleus sampling), in (0, 1]; 1 keeps them all.
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    /// Seeds the sampling.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Where to run: the GPU when the driver reports one, else the CPU.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    device: DeviceChoice,
    /// Dtype of a --model's weights and activations [default: bf16 on the GPU, f32 on the
    /// CPU]. A checkpoint runs in the dtype it was trained in.
    #[arg(
        long,
        value_enum,
        ignore_case = true,
        value_name = "DTYPE",
        conflicts_with = "checkpoint"
    )]
    model_dtype: Option<FloatDtype>,
}

/// What `smelt sample` would print for `args` (its flags, without `smelt sample`): the
/// prompt and the text it goes on with, for callers that want it back (the Python package).
pub fn generate_text(args: &[String]) -> Result<String> {
    let flags: SampleArgs = parse_flags("smelt.generate", args)?;
    let mut text = Vec::new();
    flags.write_to(&mut text)?;
    String::from_utf8(text).context("the generated text is not UTF-8")
}

impl SampleArgs {
    pub fn run(self) -> Result<()> {
        self.write_to(std::io::stdout().lock())
    }

    /// Samples as the flags say, writing the text to `out`.
    fn write_to(self, out: impl Write) -> Result<()> {
        // Checked before a model is loaded; NaN fails too.
        check_floats(&[(
            "--temperature",
            self.temperature,
            self.temperature >= 0.0,
            "must be 0 (greedy) or positive",
        )])?;
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!(
                "--top-p {}: give a probability in (0, 1]; 1 keeps every token",
                self.top_p
            );
        }
        match select(self.device, 0)? {
            Device::Cpu(b) => self.sample(&b, DType::F32, out),
            Device::Cuda(b) => self.sample(&b, DType::BF16, out),
        }
    }

    /// Samples on `b`, a --model in `default_dtype` unless --model-dtype says otherwise.
    fn sample<B: Backend>(&self, b: &B, default_dtype: DType, out: impl Write) -> Result<()> {
        let (config, tokenizer_dir, mut generator) = match (&self.model, &self.checkpoint) {
            (Some(model), _) => {
                let dir = &hf_cache::model_dir(model)?;
                let config = hf::read_config(dir)?;
                let dtype = self.model_dtype.map_or(default_dtype, DType::from);
                let g = Generator::new(b, config.clone(), dtype, |m| hf::import(b, m, dir))?;
                (config, Some(dir.clone()), g)
            }
            (None, Some(dir)) => {
                let saved = checkpoint::SavedModel::open(dir)?;
                // The weights are read back exactly, at the dtype they were trained in.
                let g = Generator::new(b, saved.config.clone(), saved.dtype, |m| {
                    checkpoint::load_weights(b, &saved.path, &saved.state, m)
                })?;
                (saved.config, saved.state.model_dir, g)
            }
            (None, None) => unreachable!("clap requires --model or --checkpoint"),
        };
        let codec = Codec::find(tokenizer_dir.as_deref(), &config)?;
        let prompt = match (&self.tokens, &self.prompt) {
            (Some(ids), _) => ids.clone(),
            (None, Some(text)) if self.chat => {
                let Some(dir) = tokenizer_dir
                    .as_deref()
                    .filter(|_| matches!(codec, Codec::Hf(_)))
                else {
                    bail!(
                        "--chat needs the model's tokenizer.json and the chat template beside it, and there is none"
                    );
                };
                let mut template = ChatTemplate::load(dir, self.chat_template.as_deref())?;
                if let Some(kwargs) = &self.chat_template_kwargs {
                    template = template.with_kwargs(kwargs);
                }
                let mut messages = Vec::new();
                if let Some(system) = &self.system {
                    messages.push(json!({"role": "system", "content": system}));
                }
                messages.push(json!({"role": "user", "content": text}));
                codec.encode(&template.render(Conversation::new(&messages), true)?, false)?
            }
            (None, Some(text)) => codec.encode(text, true)?,
            (None, None) => unreachable!("clap requires --prompt or --tokens"),
        };
        let options = SampleOptions {
            max_new_tokens: self.max_new_tokens,
            sampling: Sampling {
                temperature: self.temperature as f32,
                top_k: self.top_k,
                top_p: self.top_p,
            },
            seed: self.seed,
            stop: config.eos_token_ids.iter().map(|&t| t as i32).collect(),
        };
        let dropped = generator.prompt_dropped(prompt.len(), self.max_new_tokens);
        if dropped > 0 {
            let context = generator.max_context();
            eprintln!(
                "[sample] the prompt's {} tokens are more than the model's context of {context} \
                 (max_position_embeddings): its first {dropped} are dropped, and the model reads \
                 its newest {}, half the context, leaving the rest for new tokens",
                prompt.len(),
                prompt.len() - dropped
            );
        }
        let decode = |tokens: &[i32]| codec.decode(tokens, self.chat);
        let mut text = match self.chat {
            true => TextStream::reply(decode, out, &prompt),
            false => TextStream::start(decode, out, &prompt)?,
        };
        let start = Instant::now();
        let mut first = None;
        let new = generator
            .generate(b, &prompt, &options, |token| {
                first.get_or_insert_with(|| start.elapsed());
                text.push(token)
            })
            .context("sampling")?;
        text.finish()?;
        if let Some(first) = first {
            let mut report = format!(
                "[sample] a {}-token prompt and the first new token in {:.2} s",
                prompt.len(),
                first.as_secs_f64()
            );
            if new.len() > 1 {
                let rest = (start.elapsed() - first).as_secs_f64();
                let more = new.len() - 1;
                let rate = more as f64 / rest;
                report += &format!(", {more} more in {rest:.2} s ({rate:.1} tok/s)");
            }
            eprintln!("{report}");
        }
        Ok(())
    }
}
