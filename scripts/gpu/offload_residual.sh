#!/usr/bin/env bash
# What `--offload-residual` costs (run on the GPU machine from the repo root with .gpu
# carried; see prepare.sh): the same `smelt bench` rows with and without it, in one call.
# PART=short: Qwen2.5-0.5B at batch 32 × 1024, with nothing recomputed and with
# --recompute-block, where each block's input (59 MB) crosses the bus in about the time of
# a block's forward; PART=long: one sequence of 131,072 tokens with --recompute-block, where
# the residual stream is a third of the activations. No PyTorch baseline: the comparison is
# smelt against itself.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/logs}
mkdir -p "$OUT/offload"
rows() { # name, SEQ, rows
    SEQ=$2 BENCH_ROWS=$3 OUT="$OUT/offload/$1" SKIP_TORCH=1 ROW_TIMEOUT=300 \
        bash scripts/gpu/bench.sh | tail -7
}
case ${PART:-short} in
short)
    rows 1k 1024 "qwen2.5-0.5b bf16 32 -;qwen2.5-0.5b bf16 32 - --offload-residual;qwen2.5-0.5b bf16 32 - --recompute-block;qwen2.5-0.5b bf16 32 - --recompute-block --offload-residual"
    ;;
long)
    long="--recompute-block --lmhead-chunks 32 --steps 3 --warmup 1"
    rows 128k 131072 "qwen2.5-0.5b bf16 1 - $long;qwen2.5-0.5b bf16 1 - $long --offload-residual"
    ;;
esac
