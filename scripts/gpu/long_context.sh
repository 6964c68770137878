#!/usr/bin/env bash
# Long sequences on one GPU (run from the repo root with .gpu carried, see prepare.sh, and
# .gpu/data as for e2e.sh):
#   1. correctness: Qwen2.5-0.5B from scratch, 20 steps of one 32,768-token sequence of
#      Shakespeare, exported; transformers, loading the export, must compute smelt's final
#      eval loss over the same 32k-token sequences within 1e-2 (RoPE at far positions,
#      attention over 32k keys, the loss);
#   2. speed: `smelt bench` at batch 1, Qwen2.5-0.5B at 32k tokens, Qwen2.5-1.5B at 32k and
#      0.5B at 128k with the memory flags `--fit-memory` picks for the GPU, each against
#      PyTorch's baseline at the same shape in the same call (with gradient checkpointing,
#      --ckpt, where it would not fit without).
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

bench() { # name, SEQ, the baseline's flags, then the rows (bench.sh's BENCH_ROWS)
    SEQ=$2 TORCH_FLAGS=$3 BENCH_ROWS=$4 OUT="$OUT/long/$1" TORCH_BATCH=1 \
        ROW_TIMEOUT=400 TORCH_TIMEOUT=400 bash scripts/gpu/bench.sh | tail -8
}
# Fewer steps than bench.sh's rows take: a 32k step takes about a second, a 128k one ten.
bench 0.5b-32k 32768 "--steps 6" "qwen2.5-0.5b bf16 1 - --steps 5 --warmup 2"
bench 1.5b-32k 32768 "--ckpt --steps 6" "qwen2.5-1.5b bf16 1 - --fit-memory --steps 5 --warmup 2"
bench 0.5b-128k 131072 "--ckpt --steps 4" "qwen2.5-0.5b bf16 1 - --fit-memory --steps 3 --warmup 1"
rm -rf "$work"
exit $status
