#!/usr/bin/env bash
# FP8's convergence check, docs/fp8.md (run on the GPU machine from the repo root, .gpu
# carried, with .gpu/data holding Shakespeare tokenized by the Qwen2.5 tokenizer as for
# e2e.sh): qwen2-100m (~104M non-embedding parameters) from scratch for 1,000 steps in bf16
# and in FP8 (e4m3 forward, e5m2 gradients), same seed and data; then both curves on one
# plot and the final full eval losses compared (FP8 must be within 1% of bf16).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/logs}
mkdir -p "$OUT/fp8"
work=$(mktemp -d)
for run in bf16 fp8; do
    flags=()
    if [ "$run" = fp8 ]; then
        flags=(--matmul-dtype e4m3 --gradient-dtype e5m2 --debug-log-abs-max 100)
    fi
    echo "=== $run"
    ./.gpu/smelt train --model qwen2-100m --from-scratch --device cuda \
        --train-file '.gpu/data/train-*.bin' --eval-file .gpu/data/eval.bin \
        --batch-size 4 --seq-len 512 --steps 1000 --lr 6e-4 --warmup 50 --seed 7 \
        --eval-every-n-steps 100 --eval-num-steps 8 \
        --checkpoint-dir "$work/$run" --log-file "$OUT/fp8/$run.jsonl" "${flags[@]}" |
        grep -E '^\[(T\] step (1|[0-9]*00)/|V\]|A\])' || true
done
./.gpu/smelt plot "$OUT/fp8/bf16.jsonl" "$OUT/fp8/fp8.jsonl" -o "$OUT/fp8/fp8_convergence.png"
python3 - "$OUT/fp8/bf16.jsonl" "$OUT/fp8/fp8.jsonl" <<'PY'
import json, sys
def final(path):
    evals = [e for e in map(json.loads, open(path)) if e.get("event") == "eval" and e["full"]]
    steps = [e for e in map(json.loads, open(path)) if e.get("event") == "step"]
    return evals[-1]["loss"], sum(s["tokens_per_second"] for s in steps[-100:]) / 100
(bf16, bf16_tps), (fp8, fp8_tps) = final(sys.argv[1]), final(sys.argv[2])
rel = (fp8 - bf16) / bf16
print("RESULT " + json.dumps({"bf16_eval": round(bf16, 4), "fp8_eval": round(fp8, 4),
      "relative": round(rel, 4), "within_1pct": abs(rel) <= 0.01,
      "bf16_tok_s": round(bf16_tps), "fp8_tok_s": round(fp8_tps)}))
sys.exit(0 if abs(rel) <= 0.01 else 1)
PY
