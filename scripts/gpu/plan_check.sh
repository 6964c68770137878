#!/usr/bin/env bash
# `smelt plan` against the GPU (run from the repo root with .gpu carried; see prepare.sh):
# for each row (model, batch, budget in GiB), plan under that budget, then run the picked
# flags with `smelt bench` and compare the planned memory and step time with what the GPU
# measured. Planned and bench runs use bench's setup: bf16 weights and bf16 Adam moments.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/logs}
mkdir -p "$OUT/plan"
ROWS=${PLAN_ROWS:-"qwen2.5-0.5b:32:80 qwen2.5-0.5b:32:24 qwen2.5-0.5b:32:12 qwen2.5-1.5b:16:32 qwen2.5-3b:8:24"}
for row in $ROWS; do
    IFS=: read -r model batch budget <<<"$row"
    name="$model-b$batch-${budget}g"
    ./.gpu/smelt plan --model "$model" --batch-size "$batch" --device-memory "$budget" \
        --opt-m-dtype bf16 --opt-v-dtype bf16 --master-dtype bf16 >"$OUT/plan/$name.txt"
    ./.gpu/smelt plan --model "$model" --batch-size "$batch" --device-memory "$budget" \
        --opt-m-dtype bf16 --opt-v-dtype bf16 --master-dtype bf16 --json >"$OUT/plan/$name.json"
    flags=$(python3 -c '
import json, sys
p = json.load(open(sys.argv[1]))["plans"][-1]
assert p["batch_size"] == int(sys.argv[2]), "the plan changed the micro-batch"
print(" ".join(p["rows"][p["pick"]]["flags"]))' "$OUT/plan/$name.json" "$batch")
    echo "=== $name: $flags"
    # shellcheck disable=SC2086
    ./.gpu/smelt bench --model "$model" --batch-size "$batch" $flags --json >"$OUT/plan/$name.bench.json"
done
python3 - "$OUT/plan" $ROWS <<'PY'
import json, sys
GIB = 2 ** 30
out = sys.argv[1]
print(f"{'row':<26} {'planned':>8} {'+reserve':>8} {'budget':>7} {'smelt':>7} {'in use':>7} "
      f"{'est ms':>7} {'bench ms':>8}  flags")
for row in sys.argv[2:]:
    model, batch, budget = row.split(":")
    name = f"{model}-b{batch}-{budget}g"
    plan = json.load(open(f"{out}/{name}.json"))["plans"][-1]
    pick = plan["rows"][plan["pick"]]
    bench = json.load(open(f"{out}/{name}.bench.json"))
    planned = sum(pick["device"].values()) / GIB
    print(f"{name:<26} {planned:>8.2f} {planned + 1.5:>8.2f} {float(budget):>7.1f} "
          f"{bench['peak_mem_gib']:>7.2f} {bench['device_in_use_gib']:>7.2f} "
          f"{pick['step_ms']:>7.1f} {bench['step_ms']:>8.1f}  {' '.join(pick['flags'])}")
PY
