#!/usr/bin/env bash
# The convergence check of the quantized matmuls and moments (docs/fp8.md, docs/int8.md, and
# 8-bit Adam in docs/training.md), run on the GPU machine from the repo root, .gpu carried,
# with .gpu/data holding Shakespeare tokenized by the Qwen2.5 tokenizer as for e2e.sh:
# qwen2-100m (~104M non-embedding parameters) from scratch for 1,000 steps in bf16 and in each
# run named on the command line, same seed and data; then all curves on one plot and each
# final full eval loss compared with bf16's (within 1%).
#
# Runs: fp8 (e4m3 forward, e5m2 gradients), int8 (bf16 weight gradients), int8-wgrad (INT8
# weight gradients too), adam8bit (8-bit Adam moments, against bf16's f32 ones); default fp8.
# Logs and the plot go to $OUT/convergence.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/logs}
runs=("${@:-fp8}")
mkdir -p "$OUT/convergence"
work=$(mktemp -d)
for run in bf16 "${runs[@]}"; do
    case $run in
    bf16) flags=() ;;
    fp8) flags=(--matmul-dtype e4m3 --gradient-dtype e5m2 --debug-log-abs-max 100) ;;
    int8) flags=(--matmul-dtype int8) ;;
    int8-wgrad) flags=(--matmul-dtype int8 --int8-weight-grad) ;;
    adam8bit) flags=(--opt-m-dtype q8 --opt-v-dtype q8) ;;
    *) echo "error: unknown run $run (fp8, int8, int8-wgrad or adam8bit)" >&2; exit 2 ;;
    esac
    echo "=== $run"
    ./.gpu/smelt train --model qwen2-100m --from-scratch --device cuda \
        --train-file '.gpu/data/train-*.bin' --eval-file .gpu/data/eval.bin \
        --batch-size 4 --seq-len 512 --steps 1000 --lr 6e-4 --warmup 50 --seed 7 \
        --eval-every-n-steps 100 --eval-num-steps 8 \
        --checkpoint-dir "$work/$run" --log-file "$OUT/convergence/$run.jsonl" "${flags[@]}" |
        grep -E '^\[(T\] step (1|[0-9]*00)/|V\]|A\])' || true
done
logs=()
for run in bf16 "${runs[@]}"; do logs+=("$OUT/convergence/$run.jsonl"); done
./.gpu/smelt plot "${logs[@]}" -o "$OUT/convergence/convergence.png"
python3 - "${logs[@]}" <<'PY'
import json, os, sys
def final(path):
    events = list(map(json.loads, open(path)))
    evals = [e for e in events if e.get("event") == "eval" and e["full"]]
    steps = [e for e in events if e.get("event") == "step"]
    return evals[-1]["loss"], sum(s["tokens_per_second"] for s in steps[-100:]) / 100
(bf16, bf16_tps), ok = final(sys.argv[1]), True
for path in sys.argv[2:]:
    run = os.path.basename(path)[: -len(".jsonl")]
    loss, tps = final(path)
    rel = (loss - bf16) / bf16
    ok = ok and abs(rel) <= 0.01
    print("RESULT " + json.dumps({"run": run, "bf16_eval": round(bf16, 4), "eval": round(loss, 4),
          "relative": round(rel, 4), "within_1pct": abs(rel) <= 0.01,
          "bf16_tok_s": round(bf16_tps), "tok_s": round(tps)}))
sys.exit(0 if ok else 1)
PY
