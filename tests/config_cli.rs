//! `smelt config`: the config.json it prints is the model smelt builds, read back: a built-in
//! architecture's, and a model directory's; a name that is neither is refused.

mod train_support;

use smelt::io::hf;
use smelt::model::{ModelConfig, presets};
use train_support::*;

fn printed(model: &str) -> ModelConfig {
    let text = smelt_ok(&["config", "--model", model]);
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    ModelConfig::from_json(&json, "smelt config's output").unwrap()
}

#[test]
fn prints_the_config_smelt_builds() {
    for name in ["qwen2.5-0.5b", "llama-3-8b", "qwen3-0.6b"] {
        assert_eq!(printed(name), presets::preset(name).unwrap(), "{name}");
    }
    let set = setup();
    assert_eq!(printed(s(&set.model)), hf::read_config(&set.model).unwrap());
    let err = smelt_err(&["config", "--model", "no-such-model"]);
    assert!(err.contains("not a built-in architecture"), "{err}");
}
