#!/usr/bin/env bash
# Runs on the GPU machine, from the repo root, with `.gpu` carried (see prepare.sh): what
# `--use-cuda-graphs` does to a step where the host's launches are its cost.
#   1. The tests of recorded passes: tests/cuda_graphs.rs (training passes replayed against
#      the same passes op by op, bitwise) and tests/cuda_generate.rs (a token's pass replayed).
#   2. For each batch of BATCHES (default "1 4"), `bash scripts/gpu/bench.sh` with the rows of
#      Qwen2.5-0.5B at that batch × 1024 in bf16 and FP8, each without and with
#      --use-cuda-graphs, and PyTorch (torch.compile) at the same batch in the same call.
# SKIP_TESTS=1 skips 1; SKIP_TORCH=1 the baseline; STEPS sets the timed steps of each row.
# Logs go to $OUT; each batch's table is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/logs}
mkdir -p "$OUT"

if [ -z "${SKIP_TESTS:-}" ]; then
    for test in cuda_graphs cuda_generate; do
        echo "=== $test"
        timeout 300 ".gpu/tests/$test" --ignored --nocapture > "$OUT/$test.log" 2>&1
        echo "rc $?" >> "$OUT/$test.log"
        grep -E "^test |\[figure\]|panicked|^rc " "$OUT/$test.log"
    done
fi

steps="--steps ${STEPS:-30}"
for batch in ${BATCHES:-1 4}; do
    rows=""
    for dtype in bf16 fp8; do
        rows+="qwen2.5-0.5b $dtype $batch - $steps;"
        rows+="qwen2.5-0.5b $dtype $batch - $steps --use-cuda-graphs;"
    done
    echo "=== batch $batch × 1024"
    OUT="$OUT/b$batch" TORCH_BATCH=$batch BENCH_ROWS="${rows%;}" bash scripts/gpu/bench.sh \
        > "$OUT/bench-b$batch.txt" 2>&1
    sed -n '/^model /,$p' "$OUT/bench-b$batch.txt"
done
