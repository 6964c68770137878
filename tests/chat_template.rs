//! Chat templates against transformers: `apply_chat_template`'s text and token ids for the
//! Qwen2.5 tokenizer (tests/fixtures/chat, written by scripts/chat_fixtures.py), and
//! `smelt tokenize --messages-field`'s loss mask, which must train each assistant message
//! with the end of its turn, and nothing else.

mod tokenizing;

use serde::Deserialize;
use serde_json::{Value, json};
use smelt::tokenize::chat_template::ChatTemplate;
use smelt::tokenize::{Options, tokenize};
use tokenizing::*;

#[derive(Deserialize)]
struct Case {
    messages: Vec<Value>,
    /// The whole conversation's text, and its ids (no special tokens added).
    text: String,
    ids: Vec<i32>,
    /// The conversation up to its last message, with the generation prompt.
    prompt: String,
}

fn cases() -> Vec<Case> {
    #[derive(Deserialize)]
    struct Fixture {
        cases: Vec<Case>,
    }
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/chat/qwen2_5.json"
    );
    let text = std::fs::read_to_string(path).unwrap();
    serde_json::from_str::<Fixture>(&text).unwrap().cases
}

fn template() -> ChatTemplate {
    ChatTemplate::load(qwen().parent().unwrap(), None).unwrap()
}

#[test]
fn qwen_renders_as_transformers_does() {
    let t = template();
    for case in cases() {
        assert_eq!(t.render(&case.messages, false).unwrap(), case.text);
        let head = &case.messages[..case.messages.len() - 1];
        assert_eq!(t.render(head, true).unwrap(), case.prompt);
    }
}

#[test]
fn tokenize_trains_the_assistant_turns_only() {
    let cases = cases();
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("chat.jsonl");
    write_jsonl(
        &input,
        cases
            .iter()
            .enumerate()
            .map(|(k, c)| json!({"id": k, "messages": c.messages})),
    );
    let out = dir.path().join("out");
    let mut opts = Options::new(qwen(), vec![input.display().to_string()], out.clone());
    opts.messages_field = Some("messages".into());
    let summary = tokenize(&opts).unwrap();

    let files = token_files(&out);
    assert_eq!(files.len(), 1);
    let file = &files[0];
    assert!(file.header.has_mask);
    // transformers' ids for each whole conversation, each followed by the EOS that
    // tokenizer_config.json names (<|im_end|>).
    let eos = 151645;
    let want: Vec<i32> = cases
        .iter()
        .flat_map(|c| c.ids.iter().copied().chain([eos]))
        .collect();
    assert_eq!(tokens(file), want);

    // The trained tokens, run by run, are each assistant message and the end of its turn.
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
    let assistant: Vec<String> = cases
        .iter()
        .flat_map(|c| &c.messages)
        .filter(|m| m["role"] == "assistant")
        .map(|m| format!("{}<|im_end|>\n", m["content"].as_str().unwrap()))
        .collect();
    assert_eq!(runs, assistant);
    let trained = (0..file.len()).filter(|&i| file.trained(i)).count();
    assert_eq!(summary.trained, Some(trained));
}

#[test]
fn a_tokenizer_without_a_template_is_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = dir.path().join("tok");
    std::fs::create_dir(&tokenizer).unwrap();
    std::fs::copy(qwen(), tokenizer.join("tokenizer.json")).unwrap();
    let input = dir.path().join("chat.jsonl");
    write_jsonl(&input, [json!({"messages": []})]);
    let out = dir.path().join("out");
    let mut opts = Options::new(
        tokenizer.clone(),
        vec![input.display().to_string()],
        out.clone(),
    );
    opts.messages_field = Some("messages".into());
    opts.eos_id = Some(151645);
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
    write_jsonl(
        &input,
        cases().iter().map(|c| json!({"messages": c.messages})),
    );
    opts.chat_template = Some(program);
    tokenize(&opts).unwrap();
    let want: Vec<i32> = cases()
        .iter()
        .flat_map(|c| c.ids.iter().copied().chain([151645]))
        .collect();
    assert_eq!(tokens(&token_files(&out)[0]), want);
}
