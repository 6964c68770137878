#!/usr/bin/env bash
# End to end on the GPU (run from the repo root with .gpu carried; see prepare.sh): a model's
# architecture (MODEL, a built-in name with Qwen's vocabulary; default qwen2.5-0.5b) from
# scratch on Shakespeare tokenized with the Qwen2.5 tokenizer (.gpu/data), 100 steps with
# periodic evals and checkpoints at 50 and 100, exported as a HF directory, logging the GPU's
# NVML readings every 25 steps (whose four events, and the steps' SOL, are checked).
# Then `--continue` from the step-50 checkpoint must reproduce steps 51..100 exactly, with
# the optimizer state on the GPU and with it and the residual stream offloaded to host
# memory, and transformers, loading the export, must compute smelt's final eval loss within
# 1e-2.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/logs}
MODEL=${MODEL:-qwen2.5-0.5b}
logs="$OUT/e2e-$MODEL"
mkdir -p "$logs"
work=$(mktemp -d)
run() {
    ./.gpu/smelt train --model "$MODEL" --from-scratch --device cuda \
        --train-file '.gpu/data/train-*.bin' --eval-file .gpu/data/eval.bin \
        --batch-size 16 --seq-len 1024 --steps 100 --lr 6e-4 --warmup 10 \
        --eval-every-n-steps 25 --eval-num-steps 2 --ckpt-interval 50 \
        --checkpoint-dir "$work/ckpt" "$@"
}

echo "=== e2e: $MODEL, 100 steps from scratch"
run --log-file "$logs/full.jsonl" --out-dir "$work/model" --log-gpu-util 25

echo "=== e2e: --continue from step 50"
printf step-00000050 > "$work/ckpt/latest"
run --continue --log-file "$logs/continued.jsonl" --out-dir "$work/model-continued"

echo "=== e2e: --continue from step 50, optimizer state and residual stream in host memory"
printf step-00000050 > "$work/ckpt/latest"
run --continue --offload-master --offload-opt-m --offload-opt-v --offload-residual \
    --log-file "$logs/offloaded.jsonl" --out-dir "$work/model-offloaded"

python3 - "$logs"/{full,continued,offloaded}.jsonl <<'EOF'
import json, sys
def losses(path):
    return {e["step"]: e["loss"] for e in map(json.loads, open(path)) if e.get("event") == "step"}
full = losses(sys.argv[1])
later = sorted(s for s in full if s > 50)
result = {"continue_steps": len(later), "step_100_loss": full.get(100)}
events = [json.loads(line) for line in open(sys.argv[1])]
readings = [e for e in events if e.get("event") == "gpu_util"]
result["gpu_util"] = readings[-1]["gpus"] if readings else None
result["step_100_sol"] = next((e["sol"] for e in events if e.get("event") == "step" and e["step"] == 100), None)
watched = len(readings) == 4 and all(r["gpus"][0]["memory_total"] for r in readings)
for name, path in zip(["continued", "offloaded"], sys.argv[2:]):
    cont = losses(path)
    result[name + "_identical"] = bool(later) and all(cont.get(s) == full[s] for s in later)
print("RESULT " + json.dumps(result))
identical = result["continued_identical"] and result["offloaded_identical"]
sys.exit(0 if identical and watched and result["step_100_sol"] else 1)
EOF

echo "=== e2e: transformers on the export"
python3 scripts/gpu/check_export.py "$work/model" '.gpu/data/eval.bin' 1024 "$logs/full.jsonl"
