#!/usr/bin/env bash
# Runs on the GPU machine, from the repo root, with `.gpu` carried and DATA a folder of token
# files tokenized with Llama 3's tokenizer (train-*.bin, eval.bin; as for train_8b.sh): FP8's
# loss curve at Llama-3-8B beside bf16's. Llama-3-8B from scratch for STEPS (default 100)
# steps of 1 × 8192 tokens, in bf16 and in FP8 (e4m3 forward, e5m2 gradients), the same
# seed and data, each with the memory flags `--fit-memory` picks on this GPU, bf16 weights
# and moments and no master copy, an eval every 25 steps; then both curves on one plot
# ($OUT/8b-fp8.png) and a table of the losses.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/logs}
DATA=${DATA:-.gpu/data8b}
STEPS=${STEPS:-100}
mkdir -p "$OUT"
for run in bf16 fp8; do
    case $run in
    bf16) flags=() ;;
    fp8) flags=(--matmul-dtype e4m3 --gradient-dtype e5m2) ;;
    esac
    echo "=== $run"
    rm -f "$OUT/8b-$run.jsonl"
    ./.gpu/smelt train --model llama-3-8b --from-scratch --train-file "$DATA/train-*.bin" \
        --eval-file "$DATA/eval.bin" --batch-size 1 --seq-len 8192 --steps "$STEPS" \
        --lr 3e-4 --warmup 5 --lr-schedule constant --seed 7 --fit-memory \
        --master-dtype bf16 --opt-m-dtype bf16 --opt-v-dtype bf16 \
        --eval-every-n-steps 25 --eval-num-steps 4 --log-file "$OUT/8b-$run.jsonl" \
        "${flags[@]}" > "$OUT/8b-$run.txt" 2>&1 || { tail -5 "$OUT/8b-$run.txt"; exit 1; }
    grep -E "^--fit-memory" "$OUT/8b-$run.txt" || tail -3 "$OUT/8b-$run.txt"
done
./.gpu/smelt plot "$OUT/8b-bf16.jsonl" "$OUT/8b-fp8.jsonl" -o "$OUT/8b-fp8.png"
python3 - "$OUT/8b-bf16.jsonl" "$OUT/8b-fp8.jsonl" <<'PY'
import json, sys
runs = {}
for path in sys.argv[1:]:
    events = [json.loads(l) for l in open(path)]
    steps = {e["step"]: e for e in events if e["event"] == "step"}
    evals = [(e["step"], e["loss"]) for e in events if e["event"] == "eval"]
    rates = sorted(e["tokens_per_second"] for e in list(steps.values())[5:])
    runs[path.split("8b-")[-1][:-6]] = (steps, evals, rates[len(rates) // 2])
names = list(runs)
print("step  " + "  ".join(f"{n:>8}" for n in names))
last = max(runs[names[0]][0])
for s in [1, 5, 10, 25, 50, 75, last]:
    print(f"{s:>4}  " + "  ".join(f"{runs[n][0][s]['loss']:>8.3f}" for n in names if s in runs[n][0]))
for n in names:
    steps, evals, rate = runs[n]
    print(f"{n}: evals {[(s, round(l, 3)) for s, l in evals]}; median {rate:,.0f} tok/s after step 5")
PY
