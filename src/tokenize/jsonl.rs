//! JSON Lines inputs: one object per line, the document in a named string field, or for
//! chat/SFT data a prompt field and a response field, or a field holding a conversation's
//! messages. Read line by line.

use std::io::{BufRead, BufReader};
use std::path::Path;

use anyhow::{Context, Result, bail};
use serde_json::{Map, Value};

use super::chat_template::{ChatTemplate, Conversation, Turns};
use super::compressed;
use super::document::{Document, Sink};
use super::shown::shown;

/// Which fields hold a document.
pub enum Fields {
    Text(String),
    Chat {
        prompt: String,
        response: String,
    },
    /// A list of messages (`{"role": ..., "content": ...}`), rendered and cut into trained
    /// and untrained pieces by the tokenizer's chat template; with the list of tools in
    /// `tools`, where a line has one.
    Messages {
        field: String,
        tools: Option<String>,
        template: Box<ChatTemplate>,
        turns: Turns,
    },
}

pub fn read(path: &Path, fields: &Fields, sink: &mut Sink) -> Result<()> {
    let name = path.display();
    let (file, position) = compressed::open(path)?;
    let mut reader = BufReader::with_capacity(1 << 20, file);
    let (mut line, mut number, mut offset) = (String::new(), 0usize, 0u64);
    loop {
        line.clear();
        number += 1;
        let read = reader
            .read_line(&mut line)
            .with_context(|| format!("{name}:{number}: cannot read as UTF-8 text"))?;
        if read == 0 {
            return Ok(());
        }
        offset += read as u64;
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{name}:{number}");
        let value: Value =
            serde_json::from_str(&line).with_context(|| format!("{}: not valid JSON", at()))?;
        let Value::Object(object) = value else {
            bail!("{}: not a JSON object", at());
        };
        let take = |field: &str, flag: &str| -> Result<String> {
            string_field(&object, field)
                .map_err(|why| anyhow::anyhow!("{}: {why}; choose the field with {flag}", at()))
        };
        let doc = match fields {
            Fields::Text(field) => Document::text(take(field, "--text-field")?),
            Fields::Chat { prompt, response } => Document::prompt_response(
                take(prompt, "--prompt-field")?,
                take(response, "--response-field")?,
            ),
            Fields::Messages {
                field,
                tools,
                template,
                turns,
            } => {
                let list = |field: &str, what: &str, flag: &str| {
                    list_field(&object, field, what).map_err(|why| {
                        anyhow::anyhow!("{}: {why}; choose the field with {flag}", at())
                    })
                };
                let conversation = Conversation {
                    messages: list(field, "messages", "--messages-field")?,
                    // A line without tools is a conversation without them.
                    tools: match tools {
                        Some(f) if object.get(f).is_some_and(|v| !v.is_null()) => {
                            Some(list(f, "tools", "--tools-field")?)
                        }
                        _ => None,
                    },
                };
                let pieces = template.pieces(conversation, *turns).with_context(at)?;
                Document::conversation(pieces)
            }
        };
        sink(doc, position.on_disk(offset))?;
    }
}

/// The list (of `what`) in `field`, or what the line has instead.
fn list_field<'a>(
    object: &'a Map<String, Value>, field: &str, what: &str,
) -> Result<&'a [Value], String> {
    match object.get(field) {
        Some(Value::Array(list)) => Ok(list),
        Some(other) => Err(format!(
            "field {field:?} is not a list of {what} but {}",
            shown(other)
        )),
        None => Err(missing(object, field)),
    }
}

fn missing(object: &Map<String, Value>, field: &str) -> String {
    let keys: Vec<&String> = object.keys().collect();
    format!("no field {field:?} (the line has {keys:?})")
}

/// The string in `field`, or what the line has instead. (A copy: it costs nothing next to
/// tokenizing it.)
fn string_field(object: &Map<String, Value>, field: &str) -> Result<String, String> {
    match object.get(field) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(format!(
            "field {field:?} is not a string but {}",
            shown(other)
        )),
        None => Err(missing(object, field)),
    }
}
