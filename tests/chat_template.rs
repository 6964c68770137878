//! Chat templates against transformers: `apply_chat_template`'s text and token ids for the
//! Qwen2.5 and Llama 3.2 tokenizers (tests/fixtures/chat, written by
//! scripts/chat_fixtures.py), and `smelt tokenize --messages-field`'s loss mask, which must
//! train each assistant message with the end of its turn, and nothing else.

mod tokenizing;

use serde::Deserialize;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};
use smelt::tokenize::chat_template::{ChatTemplate, Conversation, Turns};
use smelt::tokenize::{Options, tokenize};
use tokenizing::*;

#[derive(Deserialize)]
struct Case {
    messages: Vec<Value>,
    /// The tools the template lists, if any.
    tools: Option<Vec<Value>>,
    /// The whole conversation's text, and its ids (no special tokens added) with the
    /// assistant's messages encoded apart from the text around them.
    text: String,
    ids: Vec<i32>,
    /// Each assistant message as transformers renders it after the generation prompt.
    trained: Vec<String>,
    /// The conversation up to its last message, with the generation prompt.
    prompt: String,
}

#[derive(Deserialize)]
struct Fixture {
    /// What the template was given besides the conversation (`--chat-template-kwargs`).
    kwargs: Map<String, Value>,
    cases: Vec<Case>,
}

fn fixture(family: &str) -> Fixture {
    let path = format!(
        "{}/tests/fixtures/chat/{family}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(path).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Qwen2.5's conversations, whose template takes no keyword arguments.
fn qwen_cases() -> Vec<Case> {
    let fixture = fixture("qwen2_5");
    assert!(fixture.kwargs.is_empty());
    fixture.cases
}

/// `cases` as chat JSONL in `dir`, one conversation and its tools a line, and the options
/// that tokenize them with `tokenizer` into `dir/out`.
fn chat_options(dir: &Path, cases: &[Case], tokenizer: PathBuf) -> Options {
    let input = dir.join("chat.jsonl");
    write_jsonl(
        &input,
        cases
            .iter()
            .map(|c| json!({"messages": c.messages, "tools": c.tools})),
    );
    let mut opts = Options::new(
        tokenizer,
        vec![input.display().to_string()],
        dir.join("out"),
    );
    opts.messages_field = Some("messages".into());
    opts.tools_field = Some("tools".into());
    opts
}

/// transformers' ids of each case, each followed by `eos`.
fn ids_with_eos(cases: &[Case], eos: i32) -> Vec<i32> {
    cases
        .iter()
        .flat_map(|c| c.ids.iter().copied().chain([eos]))
        .collect()
}

/// A tokenizer of `.ci/fetch-assets` (its directory under .assets), the EOS its
/// tokenizer_config.json names, and what its template writes for an assistant message after
/// the generation prompt: what training must learn, and what the fixtures' runs show.
struct Family {
    name: &'static str,
    eos: i32,
    turn: fn(&str) -> String,
}

const FAMILIES: [Family; 2] = [
    Family {
        name: "qwen2_5",
        eos: 151645, // <|im_end|>
        turn: |content| format!("{content}<|im_end|>\n"),
    },
    Family {
        name: "llama3_2",
        eos: 128009, // <|eot_id|>
        turn: |content| format!("{}<|eot_id|>", content.trim()),
    },
];

/// The trained tokens of a token file, decoded run by run.
fn trained_runs(
    file: &smelt::data::tokfile::TokenFile, tokenizer: &std::path::Path,
) -> Vec<String> {
    let decoder = tokenizers::Tokenizer::from_file(tokenizer.join("tokenizer.json")).unwrap();
    let decode = |run: &[i32]| {
        let run: Vec<u32> = run.iter().map(|&t| t as u32).collect();
        decoder.decode(&run, false).unwrap()
    };
    let ids = tokens(file);
    let mut runs: Vec<String> = Vec::new();
    let mut run: Vec<i32> = Vec::new();
    for (i, &id) in ids.iter().enumerate() {
        if file.trained(i) {
            run.push(id);
        } else if !run.is_empty() {
            runs.push(decode(&std::mem::take(&mut run)));
        }
    }
    runs
}

#[test]
fn templates_render_as_transformers_does() {
    for family in FAMILIES {
        let fixture = fixture(family.name);
        let t = ChatTemplate::load(&asset(family.name), None)
            .unwrap()
            .with_kwargs(&fixture.kwargs);
        for case in fixture.cases {
            let tools = case.tools.as_deref();
            let whole = Conversation {
                messages: &case.messages,
                tools,
            };
            assert_eq!(t.render(whole, false).unwrap(), case.text);
            let head = Conversation {
                messages: &case.messages[..case.messages.len() - 1],
                tools,
            };
            assert_eq!(t.render(head, true).unwrap(), case.prompt);
        }
    }
}

#[test]
fn tokenize_trains_the_assistant_turns_only() {
    for family in FAMILIES {
        let Fixture { kwargs, cases } = fixture(family.name);
        let dir = tempfile::tempdir().unwrap();
        let tokenizer = asset(family.name);
        let mut opts = chat_options(dir.path(), &cases, tokenizer.clone());
        opts.chat_template_kwargs = kwargs;
        let summary = tokenize(&opts).unwrap();

        let files = token_files(&opts.out_dir);
        assert_eq!(files.len(), 1);
        let file = &files[0];
        assert!(file.header.has_mask);
        // transformers' ids for each conversation, each followed by the EOS. The pieces are
        // encoded apart, so that a prompt's tokens are those the model gets when it is asked
        // to reply; encoding the whole text would differ in one conversation, whose reply's
        // leading newlines BPE merges with the one ending Qwen2.5's generation prompt.
        assert_eq!(
            tokens(file),
            ids_with_eos(&cases, family.eos),
            "{}",
            family.name
        );

        // The trained tokens, run by run, are each assistant message and the end of its turn,
        // as `turn` spells it for the first conversation.
        let runs = trained_runs(file, &tokenizer);
        assert_eq!(runs[0], (family.turn)("Paris."), "{}", family.name);
        let want: Vec<&String> = cases.iter().flat_map(|c| &c.trained).collect();
        assert_eq!(runs.iter().collect::<Vec<_>>(), want, "{}", family.name);
        let trained = (0..file.len()).filter(|&i| file.trained(i)).count();
        assert_eq!(summary.trained, Some(trained));
    }
}

/// `Turns::Last` (--last-turn-only) trains each conversation's last assistant message alone.
#[test]
fn the_last_turn_alone_is_trained_when_asked() {
    let cases = qwen_cases();
    let dir = tempfile::tempdir().unwrap();
    let mut opts = chat_options(dir.path(), &cases, qwen());
    opts.turns = Turns::Last;
    tokenize(&opts).unwrap();
    let file = &token_files(&opts.out_dir)[0];
    assert_eq!(tokens(file), ids_with_eos(&cases, 151645));
    let last: Vec<&String> = cases.iter().map(|c| c.trained.last().unwrap()).collect();
    let runs = trained_runs(file, qwen().parent().unwrap());
    assert_eq!(runs.iter().collect::<Vec<_>>(), last);
}

#[test]
fn a_tokenizer_without_a_template_is_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = dir.path().join("tok");
    std::fs::create_dir(&tokenizer).unwrap();
    std::fs::copy(qwen(), tokenizer.join("tokenizer.json")).unwrap();
    let mut opts = chat_options(dir.path(), &[], tokenizer);
    opts.eos_id = Some(151645);
    let out = opts.out_dir.clone();
    let err = format!("{:#}", tokenize(&opts).err().unwrap());
    assert!(
        err.contains("no chat_template") && err.contains("--chat-template"),
        "{err}"
    );
    assert!(!out.exists(), "nothing may be written");

    // The same with the template given as a file works.
    let program = dir.path().join("chat.jinja");
    let config: Value = serde_json::from_str(
        &std::fs::read_to_string(qwen().with_file_name("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    std::fs::write(&program, config["chat_template"].as_str().unwrap()).unwrap();
    let cases = qwen_cases();
    let mut opts = chat_options(dir.path(), &cases, opts.tokenizer);
    opts.eos_id = Some(151645);
    opts.chat_template = Some(program);
    tokenize(&opts).unwrap();
    assert_eq!(tokens(&token_files(&out)[0]), ids_with_eos(&cases, 151645));
}
