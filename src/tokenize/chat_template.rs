//! Chat templates: the Jinja program in a tokenizer's `tokenizer_config.json` that turns a
//! conversation (messages with roles) into the text a chat model reads, rendered as
//! transformers' `apply_chat_template` renders it: trimmed and left-stripped blocks,
//! `raise_exception`, `tojson` as Python's `json.dumps`, and Python's string methods.
//!
//! For training, a conversation is cut into pieces whose training is known: each assistant
//! message, as the template writes it after its generation prompt, is trained, and the rest
//! is not. The cuts come from rendering the conversation's prefixes, so they hold for any
//! template that renders a prefix of the conversation as a prefix of the whole.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use minijinja::value::{Kwargs, Serde};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::{Map, Value};

use super::document::Piece;
use super::shown::shown;

pub struct ChatTemplate {
    env: Environment<'static>,
    /// Where the template came from, for errors.
    source: String,
    /// What the template may name besides the conversation: the special tokens
    /// (`bos_token`, `eos_token`, ...) as the tokenizer's configuration spells them, and the
    /// keyword arguments given (`--chat-template-kwargs`), which override them.
    variables: BTreeMap<String, minijinja::Value>,
}

/// Names the conversation itself takes in a template's context.
const CONVERSATION: [&str; 3] = ["messages", "tools", "add_generation_prompt"];

/// `--chat-template-kwargs`: a JSON object of variables for the template, as transformers'
/// `apply_chat_template(**kwargs)` passes them (Qwen3's `enable_thinking`, Llama 3's
/// `date_string`).
pub fn parse_kwargs(text: &str) -> Result<Map<String, Value>, String> {
    let kwargs = match serde_json::from_str(text) {
        Ok(Value::Object(kwargs)) => kwargs,
        _ => {
            return Err(format!(
                "not a JSON object: {text}; e.g. '{{\"enable_thinking\": false}}'"
            ));
        }
    };
    match kwargs.keys().find(|k| CONVERSATION.contains(&k.as_str())) {
        Some(k) => Err(format!("{k:?} is the conversation's own; leave it out")),
        None => Ok(kwargs),
    }
}

/// What a template renders: the messages, and the tools (functions' JSON schemas) that
/// templates list for the model, as transformers' `tools` argument gives them.
#[derive(Clone, Copy)]
pub struct Conversation<'a> {
    pub messages: &'a [Value],
    pub tools: Option<&'a [Value]>,
}

impl<'a> Conversation<'a> {
    pub fn new(messages: &'a [Value]) -> Conversation<'a> {
        Conversation {
            messages,
            tools: None,
        }
    }

    /// The first `n` messages, with the same tools.
    fn first(self, n: usize) -> Conversation<'a> {
        Conversation {
            messages: &self.messages[..n],
            ..self
        }
    }
}

/// Messages must name a role, and carry text or nothing (an assistant's tool calls).
fn check_message(message: &Value, k: usize) -> Result<&str> {
    let role = message
        .get("role")
        .and_then(Value::as_str)
        .ok_or_else(|| anyhow!("message {k} has no string \"role\""))?;
    match message.get("content") {
        None | Some(Value::Null) | Some(Value::String(_)) => Ok(role),
        Some(other) => bail!(
            "message {k}'s content is not text but {}; only text messages are supported",
            shown(other)
        ),
    }
}

impl ChatTemplate {
    /// The template of the tokenizer in `tokenizer_dir`: `file` (a Jinja file) if given,
    /// else the `chat_template` of `tokenizer_config.json` there.
    pub fn load(tokenizer_dir: &Path, file: Option<&Path>) -> Result<ChatTemplate> {
        let config_path = tokenizer_dir.join("tokenizer_config.json");
        let config: Option<Value> = match config_path.exists() {
            true => {
                let name = config_path.display();
                let text = std::fs::read_to_string(&config_path)
                    .with_context(|| format!("{name}: cannot read"))?;
                Some(
                    serde_json::from_str(&text)
                        .with_context(|| format!("{name}: not valid JSON"))?,
                )
            }
            false => None,
        };
        let (program, source) = match file {
            Some(path) => {
                let program = std::fs::read_to_string(path)
                    .with_context(|| format!("--chat-template {}: cannot read", path.display()))?;
                (program, path.display().to_string())
            }
            None => {
                let program = config
                    .as_ref()
                    .and_then(|c| c.get("chat_template"))
                    .ok_or_else(|| no_template(&config_path))?;
                let source = format!("{} chat_template", config_path.display());
                (default_template(program, &source)?, source)
            }
        };
        let mut variables = BTreeMap::new();
        for key in ["bos_token", "eos_token", "unk_token", "pad_token"] {
            let token = match config.as_ref().and_then(|c| c.get(key)) {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Object(o)) => match o.get("content") {
                    Some(Value::String(s)) => s.clone(),
                    _ => continue,
                },
                _ => continue,
            };
            variables.insert(key.to_string(), minijinja::Value::from(token));
        }
        let mut env = Environment::new();
        env.set_syntax(
            env.syntax()
                .to_builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .expect("the default delimiters are valid"),
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_filter(
            "tojson",
            |value: minijinja::Value, kwargs: Kwargs| -> Result<String, Error> {
                let indent: Option<usize> = kwargs.get("indent")?;
                kwargs.assert_all_used()?;
                python_json(&value, indent)
                    .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))
            },
        );
        env.add_template_owned("chat", program)
            .map_err(|e| anyhow!("{source}: not a valid Jinja template: {e:#}"))?;
        Ok(ChatTemplate {
            env,
            source,
            variables,
        })
    }

    /// The template with `kwargs` (`parse_kwargs`) among its variables.
    pub fn with_kwargs(mut self, kwargs: &Map<String, Value>) -> ChatTemplate {
        let values = kwargs.iter().map(|(k, v)| (k.clone(), Serde(v).into()));
        self.variables.extend(values);
        self
    }

    /// The conversation's text; with `add_generation_prompt`, followed by what starts the
    /// assistant's reply.
    pub fn render(&self, c: Conversation, add_generation_prompt: bool) -> Result<String> {
        for (k, message) in c.messages.iter().enumerate() {
            check_message(message, k)?;
        }
        self.render_checked(c, add_generation_prompt)
    }

    /// `render` of messages already checked.
    fn render_checked(&self, c: Conversation, add_generation_prompt: bool) -> Result<String> {
        let mut context = self.variables.clone();
        context.insert("messages".into(), minijinja::Value::from(Serde(c.messages)));
        if let Some(tools) = c.tools {
            context.insert("tools".into(), minijinja::Value::from(Serde(tools)));
        }
        context.insert(
            "add_generation_prompt".into(),
            minijinja::Value::from(add_generation_prompt),
        );
        let template = self.env.get_template("chat").expect("added in load");
        template
            .render(context)
            .map_err(|e| anyhow!("{}: {e:#}", self.source))
    }

    /// The conversation in pieces, in order: the assistant's messages that `turns` trains,
    /// each as the template writes it after its generation prompt, trained; everything
    /// else not.
    pub fn pieces(&self, c: Conversation, turns: Turns) -> Result<Vec<Piece>> {
        let mut pieces = Vec::new();
        let mut done = String::new();
        let mut extend = |text: String, trained: bool, upto: usize| -> Result<()> {
            let Some(new) = text.strip_prefix(done.as_str()) else {
                let hint = match turns {
                    Turns::All => {
                        "; --last-turn-only trains only the last assistant message, which such templates (Qwen3's drops earlier turns' reasoning) allow"
                    }
                    Turns::Last => "",
                };
                bail!(
                    "{}: the template writes the first {upto} messages differently from the start of the conversation, so the assistant's text cannot be told apart{hint}",
                    self.source
                );
            };
            if !new.is_empty() {
                pieces.push(Piece {
                    text: new.to_string(),
                    trained,
                });
            }
            done = text;
            Ok(())
        };
        let roles: Vec<&str> = c
            .messages
            .iter()
            .enumerate()
            .map(|(k, m)| check_message(m, k))
            .collect::<Result<_>>()?;
        match turns {
            Turns::All => {
                for (k, &role) in roles.iter().enumerate() {
                    let assistant = role == "assistant";
                    if assistant {
                        extend(self.render_checked(c.first(k), true)?, false, k)?;
                    }
                    extend(
                        self.render_checked(c.first(k + 1), false)?,
                        assistant,
                        k + 1,
                    )?;
                }
            }
            // An empty conversation stays empty, as under `All`, and is left out.
            Turns::Last if c.messages.is_empty() => {}
            Turns::Last => {
                let n = c.messages.len();
                if roles.last() != Some(&"assistant") {
                    bail!(
                        "the conversation does not end with an assistant message, which --last-turn-only trains"
                    );
                }
                extend(self.render_checked(c.first(n - 1), true)?, false, n - 1)?;
                extend(self.render_checked(c, false)?, true, n)?;
            }
        }
        // A template that writes the generation prompt unasked would have its header
        // trained as the end of the last assistant message.
        if !c.messages.is_empty() && self.render_checked(c, true)? == done {
            bail!(
                "{}: the template writes the assistant's generation prompt even when not asked to (add_generation_prompt), so the end of an assistant message cannot be told from it; give a template that asks with --chat-template FILE",
                self.source
            );
        }
        Ok(pieces)
    }
}

/// Which assistant messages of a conversation are trained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Turns {
    All,
    /// Only the last, for templates that write earlier turns differently once later ones
    /// follow (Qwen3's drops the reasoning of all but the last).
    Last,
}

fn no_template(config: &Path) -> anyhow::Error {
    anyhow!(
        "{}: no chat_template; give one with --chat-template FILE (a Jinja file)",
        config.display()
    )
}

/// A `chat_template` is one program, or a list of named ones of which "default" is used.
fn default_template(program: &Value, source: &str) -> Result<String> {
    match program {
        Value::String(s) => Ok(s.clone()),
        Value::Array(named) => {
            let names: Vec<&str> = named
                .iter()
                .filter_map(|t| t.get("name").and_then(Value::as_str))
                .collect();
            named
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template").and_then(Value::as_str))
                .map(str::to_string)
                .ok_or_else(|| {
                    anyhow!(
                        "{source}: no template named \"default\" among {names:?}; give one with --chat-template FILE"
                    )
                })
        }
        other => bail!("{source}: neither a template nor a list of them: {other}"),
    }
}

/// `json.dumps(value, indent=indent)` as transformers' `tojson` writes it: on one line with
/// ", " and ": " between items, or indented with "," and ": "; non-ASCII characters as they
/// are (`ensure_ascii=False`), and an object's keys in the order the message gave them.
fn python_json(value: &minijinja::Value, indent: Option<usize>) -> serde_json::Result<String> {
    use std::io::{Result, Write};
    /// Items after the first of an array or object are set off by ", ".
    fn separate<W: ?Sized + Write>(w: &mut W, first: bool) -> Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }
    struct Python;
    impl serde_json::ser::Formatter for Python {
        fn begin_array_value<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> Result<()> {
            separate(w, first)
        }
        fn begin_object_key<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> Result<()> {
            separate(w, first)
        }
        fn begin_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> Result<()> {
            w.write_all(b": ")
        }
    }
    fn dumps<F: serde_json::ser::Formatter>(
        value: &minijinja::Value, formatter: F,
    ) -> serde_json::Result<Vec<u8>> {
        let mut out = Vec::new();
        let mut serializer = serde_json::Serializer::with_formatter(&mut out, formatter);
        serde::Serialize::serialize(value, &mut serializer)?;
        Ok(out)
    }
    let out = match indent {
        None => dumps(value, Python)?,
        // serde_json's pretty printer writes what Python's indent does.
        Some(n) => dumps(
            value,
            serde_json::ser::PrettyFormatter::with_indent(&vec![b' '; n]),
        )?,
    };
    Ok(String::from_utf8(out).expect("serde_json writes UTF-8"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn template(program: &str, config: Value) -> (tempfile::TempDir, ChatTemplate) {
        let dir = tempfile::tempdir().unwrap();
        let mut config = config;
        config["chat_template"] = Value::String(program.into());
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        let t = ChatTemplate::load(dir.path(), None).unwrap();
        (dir, t)
    }

    /// The trained pieces of a conversation, checked to make up its rendering with the rest.
    fn trained(t: &ChatTemplate, messages: &[Value], turns: Turns) -> Vec<String> {
        let pieces = t.pieces(Conversation::new(messages), turns).unwrap();
        let whole: String = pieces.iter().map(|p| p.text.as_str()).collect();
        assert_eq!(whole, t.render(Conversation::new(messages), false).unwrap());
        pieces
            .into_iter()
            .filter(|p| p.trained)
            .map(|p| p.text)
            .collect()
    }

    const SIMPLE: &str = "{{ bos_token }}{% for m in messages %}\n<{{ m.role }}>{{ m.content | trim }}</s>\n{% endfor %}\n    {% if add_generation_prompt %}<assistant>{% endif %}";

    #[test]
    fn renders_with_trimmed_blocks_and_the_special_tokens() {
        let (_dir, t) = template(SIMPLE, json!({"bos_token": {"content": "<s>"}}));
        let messages = [json!({"role": "user", "content": " hi "})];
        assert_eq!(
            t.render(Conversation::new(&messages), false).unwrap(),
            "<s><user>hi</s>\n"
        );
        assert_eq!(
            t.render(Conversation::new(&messages), true).unwrap(),
            "<s><user>hi</s>\n<assistant>"
        );
    }

    #[test]
    fn pieces_train_exactly_the_assistant_messages() {
        let (_dir, t) = template(SIMPLE, json!({"bos_token": "<s>"}));
        let messages = [
            json!({"role": "system", "content": "be brief"}),
            json!({"role": "user", "content": "hi"}),
            json!({"role": "assistant", "content": "hello"}),
            json!({"role": "user", "content": "bye"}),
            json!({"role": "assistant", "content": "ciao"}),
        ];
        // The generation prompt's `<assistant>` is not the assistant's to learn.
        assert_eq!(
            trained(&t, &messages, Turns::All),
            ["hello</s>\n", "ciao</s>\n"]
        );
    }

    #[test]
    fn python_methods_json_and_raised_errors() {
        let program = "{% if messages[0].content.startswith('x') %}{{ raise_exception('no x, please') }}{% endif %}{{ messages[0] | tojson }}\n{{ tools | tojson(indent=2) }}";
        let (_dir, t) = template(program, json!({}));
        let ok = [json!({"role": "user", "content": "é\""})];
        let tools = [json!({"b": 1, "a": [], "c": {}})];
        let c = Conversation {
            messages: &ok,
            tools: Some(&tools),
        };
        // Python's json.dumps, keys in the order given.
        let want = r#"{"role": "user", "content": "é\""}
[
  {
    "b": 1,
    "a": [],
    "c": {}
  }
]"#;
        assert_eq!(t.render(c, false).unwrap(), want);
        let bad = [json!({"role": "user", "content": "xyz"})];
        let err = format!(
            "{:#}",
            t.render(Conversation::new(&bad), false).unwrap_err()
        );
        assert!(err.contains("no x, please"), "{err}");
    }

    #[test]
    fn keyword_arguments_are_an_object_without_the_conversation() {
        let (_dir, t) = template(
            "{{ bos_token }}{{ shout | upper }}",
            json!({"bos_token": "<s>"}),
        );
        let kwargs = parse_kwargs(r#"{"shout": "hi", "bos_token": "<b>"}"#).unwrap();
        // As in transformers, they override the special tokens.
        assert_eq!(
            t.with_kwargs(&kwargs)
                .render(Conversation::new(&[]), false)
                .unwrap(),
            "<b>HI"
        );
        assert!(
            parse_kwargs("[1]")
                .unwrap_err()
                .contains("not a JSON object")
        );
        let err = parse_kwargs(r#"{"tools": []}"#).unwrap_err();
        assert!(err.contains("\"tools\" is the conversation's own"), "{err}");
    }

    /// What `pieces` says of a user's message and the assistant's reply under `program`.
    fn pieces_error(program: &str) -> String {
        let (_dir, t) = template(program, json!({}));
        let messages = [
            json!({"role": "user", "content": "a"}),
            json!({"role": "assistant", "content": "b"}),
        ];
        format!(
            "{:#}",
            t.pieces(Conversation::new(&messages), Turns::All)
                .unwrap_err()
        )
    }

    #[test]
    fn templates_whose_pieces_cannot_be_cut_are_refused() {
        // Writes the last message apart from the others: a prefix is not the whole's start.
        let rewrites = "{% for m in messages %}{% if loop.last %}[{{ m.content }}]{% else %}{{ m.content }}{% endif %}{% endfor %}";
        let err = pieces_error(rewrites);
        assert!(err.contains("cannot be told apart"), "{err}");
        // As the first Llama 3 template does: its header closes every rendering.
        let always =
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}<assistant>";
        let err = pieces_error(always);
        assert!(err.contains("even when not asked"), "{err}");
    }

    #[test]
    fn the_last_turn_alone_is_cut_where_earlier_turns_are_rewritten() {
        // Earlier assistant turns become <a>, the last stays <assistant>: as Qwen3's template
        // drops the reasoning of all but the last.
        let program = "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}<a>{% else %}<{{ m.role }}>{% endif %}{{ m.content }}</s>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}";
        let (_dir, t) = template(program, json!({}));
        let mut messages = vec![
            json!({"role": "user", "content": "u1"}),
            json!({"role": "assistant", "content": "a1"}),
            json!({"role": "user", "content": "u2"}),
            json!({"role": "assistant", "content": "a2"}),
        ];
        let err = format!(
            "{:#}",
            t.pieces(Conversation::new(&messages), Turns::All)
                .unwrap_err()
        );
        assert!(err.contains("--last-turn-only"), "{err}");
        assert_eq!(trained(&t, &messages, Turns::Last), ["a2</s>"]);
        messages.pop();
        let err = format!(
            "{:#}",
            t.pieces(Conversation::new(&messages), Turns::Last)
                .unwrap_err()
        );
        assert!(
            err.contains("does not end with an assistant message"),
            "{err}"
        );
    }

    #[test]
    fn missing_templates_and_bad_messages_say_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tokenizer_config.json"), "{}").unwrap();
        let err = format!("{:#}", ChatTemplate::load(dir.path(), None).err().unwrap());
        assert!(
            err.contains("no chat_template") && err.contains("--chat-template"),
            "{err}"
        );
        let (_dir, t) = template(SIMPLE, json!({}));
        let err = format!(
            "{:#}",
            t.render(Conversation::new(&[json!({"content": "x"})]), false)
                .unwrap_err()
        );
        assert!(err.contains("no string \"role\""), "{err}");
        let parts = json!({"role": "user", "content": [{"type": "text", "text": "x"}]});
        let err = format!(
            "{:#}",
            t.render(Conversation::new(&[parts]), false).unwrap_err()
        );
        assert!(err.contains("only text messages"), "{err}");
    }
}
