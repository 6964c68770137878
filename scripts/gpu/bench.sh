#!/usr/bin/env bash
# The performance table in one device call (run on the GPU machine from the repo root, with
# .gpu carried): for each row, smelt's throughput bench (tests/cuda_bench.rs) and the PyTorch
# baseline with torch.compile, then the ratio. Rows: model, smelt batch, PyTorch batch (the
# baseline's batch for 1.5B is 8, the largest it fits, as in the issue's table).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/logs}
mkdir -p "$OUT"
rows=("qwen2.5-0.5b 32 32" "qwen2.5-1.5b 16 8" "qwen2.5-3b 8 8")
: > "$OUT/bench.txt"
for row in "${rows[@]}"; do
    read -r model batch torch_batch <<< "$row"
    echo "=== $model"
    smelt=$(SMELT_BENCH_MODEL=$model SMELT_BENCH_BATCH=$batch \
        timeout 300 .gpu/tests/cuda_bench throughput --exact --ignored --nocapture 2>&1 |
        tee -a "$OUT/bench.log" | sed -n 's/^SMELT_TOK_S //p')
    torch=$(timeout 300 python3 .gpu/bench/torch_baseline.py "$model" "$torch_batch" 1024 --compile 2>&1 |
        tee -a "$OUT/bench.log" | sed -n 's/^RESULT .*"tok_s": \([0-9]*\).*/\1/p')
    echo "$model $batch ${smelt:-failed} $torch_batch ${torch:-failed}" >> "$OUT/bench.txt"
done
echo
printf '%-14s %-12s %-12s %-12s %s\n' model smelt-batch "smelt tok/s" "torch tok/s" ratio
while read -r model batch smelt torch_batch torch; do
    ratio=$(python3 -c "print(f'{$smelt / $torch:.2f}')" 2>/dev/null || echo -)
    printf '%-14s %-12s %-12s %-12s %s\n' "$model" "$batch" "$smelt" "$torch (b$torch_batch)" "$ratio"
done < "$OUT/bench.txt"
grep '^\[figure\] bench' "$OUT/bench.log"
