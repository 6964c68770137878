//! `smelt sample`: from a model directory and from a checkpoint, greedy, seeded and top-k/top-p,
//! with prompts as token ids, as bytes (the demo's vocabulary), or as text through the model's
//! tokenizer.json, which the run copies next to its output.

mod train_support;

use std::path::Path;

use serde_json::json;
use train_support::*;

/// A word-level tokenizer.json covering the byte vocabulary: `w0` ... `w255`, except that
/// "hello" is 5 and "world" is 7.
fn word_tokenizer() -> String {
    let mut vocab = serde_json::Map::new();
    for i in 0..256 {
        let word = match i {
            5 => "hello".to_string(),
            7 => "world".to_string(),
            _ => format!("w{i}"),
        };
        vocab.insert(word, json!(i));
    }
    json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"}
    })
    .to_string()
}

/// Trains `model` from scratch on `data` into `out`.
fn train(model: &Path, data: &Path, out: &Path, extra: &[&str]) {
    let mut args = vec!["train", "--model", s(model), "--from-scratch"];
    args.extend(["--train-file", s(data), "--out-dir", s(out)]);
    args.extend(extra);
    smelt_ok(&args);
}

fn sample(args: &[&str]) -> String {
    let mut all = vec!["sample", "--max-new-tokens", "12"];
    all.extend(args);
    smelt_ok(&all)
}

#[test]
fn samples_from_model_dir_and_checkpoint_alike() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let model = tiny_model_dir(root);
    let data = corpus_file(&root.join("train.bin"), 4000, false);
    let out = root.join("out");
    let ckpt = root.join("ckpt");
    let ckpt_args = ["--ckpt-interval", "30", "--checkpoint-dir", s(&ckpt)];
    let shape = [
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--steps",
        "30",
        "--lr",
        "1e-2",
    ];
    train(
        &model,
        &data,
        &out,
        &[&shape[..], &ckpt_args, &["--model-dtype", "f32"]].concat(),
    );
    // f32 weights: the exported model and the last checkpoint hold the same values, so
    // greedy decoding agrees token for token; "fn" is bytes 102, 110 in the demo's vocabulary.
    let greedy = |source: &[&str], prompt: &[&str]| {
        sample(&[source, prompt, &["--temperature", "0"]].concat())
    };
    let from_dir = greedy(&["--model", s(&out)], &["--prompt", "fn"]);
    assert!(
        from_dir.starts_with("fn") && from_dir.len() > 2 + 12,
        "{from_dir:?}"
    );
    assert_eq!(
        greedy(&["--checkpoint", s(&ckpt)], &["--prompt", "fn"]),
        from_dir
    );
    assert_eq!(
        greedy(&["--model", s(&out)], &["--tokens", "102,110"]),
        from_dir
    );
    // In bf16 the model continues the prompt too (its rounding may pick other tokens).
    let bf16 = greedy(
        &["--model", s(&out), "--model-dtype", "bf16"],
        &["--prompt", "fn"],
    );
    assert!(bf16.starts_with("fn") && bf16.len() > 2 + 12, "{bf16:?}");
    // Temperature sampling is reproducible from its seed.
    let warm = |seed: &str| {
        sample(&[
            "--model",
            s(&out),
            "--prompt",
            "fn",
            "--temperature",
            "1",
            "--seed",
            seed,
        ])
    };
    assert_eq!(warm("1"), warm("1"));
    assert!((2..12).any(|seed| warm(&seed.to_string()) != warm("1")));
    // The top token alone, or a nucleus so small that only it reaches it, is greedy at any
    // temperature and seed.
    for narrow in [["--top-k", "1"], ["--top-p", "1e-9"]] {
        let args = ["--model", s(&out), "--prompt", "fn", "--temperature", "1"];
        assert_eq!(sample(&[&args[..], &narrow].concat()), from_dir);
    }

    // A prompt longer than the model's context of 64: its start is dropped, and stderr says
    // how much and why. Of 100 tokens the newest 32, half the context, are kept (the rest
    // is room for new tokens), as for a context that outgrows the model while sampling.
    let long: Vec<String> = (0..100).map(|i| (97 + i % 26).to_string()).collect();
    let long = long.join(",");
    let output = smelt(&[
        "sample",
        "--model",
        s(&out),
        "--tokens",
        &long,
        "--max-new-tokens",
        "4",
    ]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(
        stderr.contains("the prompt's 100 tokens are more than the model's context of 64")
            && stderr.contains("its first 68 are dropped"),
        "{stderr}"
    );
    // A prompt that fits gets no such line.
    let output = smelt(&["sample", "--model", s(&out), "--tokens", "102,110"]);
    assert!(!String::from_utf8_lossy(&output.stderr).contains("dropped"));

    // With a tokenizer.json next to the model, a text prompt goes through it; the run
    // copies the file into its output.
    std::fs::write(model.join("tokenizer.json"), word_tokenizer()).unwrap();
    let out2 = root.join("out2");
    let shape = ["--batch-size", "2", "--seq-len", "16", "--steps", "2"];
    train(&model, &data, &out2, &shape);
    assert!(out2.join("tokenizer.json").is_file());
    let text = greedy(&["--model", s(&out2)], &["--prompt", "hello world"]);
    assert!(text.starts_with("hello world w"), "{text}");
    assert_eq!(greedy(&["--model", s(&out2)], &["--tokens", "5,7"]), text);
}

#[test]
fn a_top_p_outside_0_to_1_is_refused() {
    for p in ["0", "1.5", "NaN"] {
        let err = smelt_err(&["sample", "--model", "m", "--prompt", "fn", "--top-p", p]);
        assert!(
            err.contains(&format!("--top-p {p}")) && err.contains("a probability in (0, 1]"),
            "{err}"
        );
    }
}

#[test]
fn a_negative_or_non_finite_temperature_is_refused() {
    let cases = [
        ("-1", "must be 0 (greedy) or positive"),
        ("-0.5", "must be 0 (greedy) or positive"),
        ("NaN", "must be a finite number"),
        ("inf", "must be a finite number"),
    ];
    for (t, rule) in cases {
        let err = smelt_err(&[
            "sample",
            "--model",
            "m",
            "--prompt",
            "fn",
            "--temperature",
            t,
        ]);
        assert!(
            err.starts_with(&format!("error: --temperature {t}: {rule}")),
            "{err}"
        );
    }
}

#[test]
fn a_directory_that_is_no_checkpoint_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let err = smelt_err(&["sample", "--checkpoint", s(dir.path()), "--prompt", "fn"]);
    assert!(
        err.contains("neither a step-N checkpoint directory")
            && err.contains("--checkpoint-dir with a `latest` file"),
        "{err}"
    );
}

/// `--chat`: the prompt is a user's message that the chat template of the model's
/// tokenizer_config.json renders; the model reads exactly the rendered tokens, and only its
/// reply is printed.
#[test]
fn chat_renders_the_prompt_with_the_template_and_prints_the_reply() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let model = tiny_model_dir(root);
    std::fs::write(model.join("tokenizer.json"), word_tokenizer()).unwrap();
    let data = corpus_file(&root.join("train.bin"), 4000, false);
    let out = root.join("out");
    let shape = ["--batch-size", "2", "--seq-len", "16", "--steps", "2"];
    train(&model, &data, &out, &shape);
    let greedy = |args: &[&str]| {
        let base = ["--model", s(&out), "--temperature", "0"];
        sample(&[&base[..], args].concat())
    };
    // Without a template, --chat says where one goes.
    let err = smelt_err(&["sample", "--model", s(&out), "--prompt", "hello", "--chat"]);
    assert!(
        err.contains("tokenizer_config.json") && err.contains("--chat-template"),
        "{err}"
    );

    // Each message becomes w1 CONTENT w2; the generation prompt is w3.
    let template = "{% for m in messages %}w1 {{ m.content }} w2 {% endfor %}{% if add_generation_prompt %}w3{% endif %}";
    std::fs::write(
        out.join("tokenizer_config.json"),
        json!({"chat_template": template}).to_string(),
    )
    .unwrap();
    let reply = greedy(&["--prompt", "hello world", "--chat"]);
    let whole = greedy(&["--tokens", "1,5,7,2,3"]);
    assert_eq!(format!("w1 hello world w2 w3{reply}"), whole);
    assert!(reply.len() > 12, "{reply:?}");
    let reply = greedy(&["--prompt", "hello", "--chat", "--system", "world"]);
    assert_eq!(
        format!("w1 world w2 w1 hello w2 w3{reply}"),
        greedy(&["--tokens", "1,7,2,1,5,2,3"])
    );
    // A template given as a file takes the place of the tokenizer's.
    let file = root.join("chat.jinja");
    std::fs::write(&file, "{{ messages[0].content }} w9").unwrap();
    let reply = greedy(&["--prompt", "world", "--chat", "--chat-template", s(&file)]);
    assert_eq!(format!("world w9{reply}"), greedy(&["--tokens", "7,9"]));
    // Keyword arguments reach the template.
    std::fs::write(&file, "{{ messages[0].content }} {{ word }}").unwrap();
    let kwargs = ["--chat-template-kwargs", r#"{"word": "w9"}"#];
    let chat = ["--prompt", "world", "--chat", "--chat-template", s(&file)];
    let reply = greedy(&[&chat[..], &kwargs].concat());
    assert_eq!(format!("world w9{reply}"), greedy(&["--tokens", "7,9"]));
}
