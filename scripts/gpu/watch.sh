#!/usr/bin/env bash
# Runs on the GPU machine, from the repo root, with `.gpu` carried: what a person watching a
# run sees. A Qwen2.5-0.5B-shaped run from scratch on random tokens, with --log-gpu-util,
# --health-every and --tensorboard-dir, beside the same run without --health-every (whose
# losses must be the same, bit for bit); the log and the event file land in $OUT, for
# tests/python/check_exporters.py's reader to check here or back home.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/logs}
mkdir -p "$OUT"
STEPS=${STEPS:-30}
data=$(mktemp -d)
python3 scripts/gpu/random_tokens.py "$data/train.bin"
run() {
    ./.gpu/smelt train --model qwen2.5-0.5b --from-scratch --train-file "$data/train.bin" \
        --batch-size 16 --seq-len 1024 --steps "$STEPS" --warmup 5 "$@"
}
run --log-gpu-util 10 --health-every 10 --log-file "$OUT/watched.jsonl" \
    --tensorboard-dir "$OUT/tb" 2>&1 | tee "$OUT/watched.txt"
run --log-file "$OUT/plain.jsonl" 2>&1 | tee "$OUT/plain.txt"
python3 - "$OUT/watched.jsonl" "$OUT/plain.jsonl" <<'EOF'
import json, sys
def steps(path):
    return [(e["step"], e["loss"]) for e in map(json.loads, open(path)) if e["event"] == "step"]
watched, plain = steps(sys.argv[1]), steps(sys.argv[2])
assert watched == plain, "the health steps changed the run"
events = [json.loads(l) for l in open(sys.argv[1])]
kinds = [e["event"] for e in events]
print(f"losses bit for bit with and without --health-every over {len(plain)} steps")
print(f"gpu_util events: {kinds.count('gpu_util')}, health events: {kinds.count('health')}")
last = [e for e in events if e["event"] == "step"][-1]
print(f"last step: loss {last['loss']:.4f}, {last['tokens_per_second']:.0f} tok/s, "
      f"mfu {last['mfu']}, sol {last['sol']}")
EOF
grep '^\[G\]\|^\[H\]' "$OUT/watched.txt" | tail -4
