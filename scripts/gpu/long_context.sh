#!/usr/bin/env bash
# Long sequences on one GPU (run from the repo root with .gpu carried, see prepare.sh, and
# .gpu/data as for e2e.sh):
#   1. correctness: Qwen2.5-0.5B from scratch, 20 steps of one 32,768-token sequence of
#      Shakespeare, exported; transformers, loading the export, must compute smelt's final
#      eval loss over the same 32k-token sequences within 1e-2 (RoPE at far positions,
#      attention over 32k keys, the loss);
#   2. speed: `smelt bench` at batch 1 with Qwen2.5-0.5B at 32k tokens, and at 128k with block
#      recompute, each against PyTorch's baseline at the same shape in the same call (at 128k
#      with gradient checkpointing, --ckpt).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/logs}
mkdir -p "$OUT/long"
work=$(mktemp -d)
status=0

echo "=== long context: 20 steps at 32k tokens, then transformers on the export"
./.gpu/smelt train --model qwen2.5-0.5b --from-scratch --device cuda \
    --train-file '.gpu/data/train-*.bin' --eval-file .gpu/data/eval.bin \
    --batch-size 1 --seq-len 32768 --steps 20 --lr 6e-4 --warmup 5 \
    --log-file "$OUT/long/train-32k.jsonl" --out-dir "$work/model" ||
    status=1
python3 scripts/gpu/check_export.py "$work/model" .gpu/data/eval.bin 32768 \
    "$OUT/long/train-32k.jsonl" --batch 1 || status=1

bench() { # SEQ, TORCH_FLAGS, then the rows
    SEQ=$1 TORCH_FLAGS=$2 BENCH_ROWS=$3 OUT="$OUT/long/$1${2:+-ckpt}" TORCH_BATCH=1 \
        ROW_TIMEOUT=400 TORCH_TIMEOUT=400 bash scripts/gpu/bench.sh | tail -8
}
bench 32768 "" "qwen2.5-0.5b bf16 1 -"
bench 131072 "--ckpt --steps 4" "qwen2.5-0.5b bf16 1 - --recompute-block --steps 3 --warmup 1"
rm -rf "$work"
exit $status
