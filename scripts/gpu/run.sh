#!/usr/bin/env bash
# Runs on the GPU machine, from the repo root, with `.gpu` carried (see prepare.sh): every
# ignored test (the GPU tests) of every test binary, one at a time (those that need two GPUs
# are listed as skipped on a machine with one), logs teed into $OUT, and last a short table:
# test, pass/fail, and the key figures the tests print as `[figure]` lines. The throughput
# table against PyTorch is scripts/gpu/bench.sh.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/logs}
mkdir -p "$OUT"
if [ ! -d .gpu/tests ]; then
    echo "error: no .gpu/tests here; run scripts/gpu/prepare.sh first and carry .gpu" >&2
    exit 2
fi

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    ./.gpu/smelt --version || true
} 2>&1 | tee "$OUT/device.txt"

: > "$OUT/results.txt"
gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
for bin in .gpu/tests/*; do
    name=$(basename "$bin")
    for test in $("$bin" --list --ignored 2>/dev/null | sed -n 's/: test$//p'); do
        if [ "$name" = cuda_data_parallel ] && [ "$gpus" -lt 2 ]; then
            echo "$name $test SKIPPED(needs-2-GPUs) 0s" >> "$OUT/results.txt"
            continue
        fi
        echo "=== $name::$test"
        start=$(date +%s)
        # A hung kernel must not eat the whole device call.
        timeout "${TEST_TIMEOUT:-300}" "$bin" "$test" --exact --ignored --nocapture 2>&1 |
            tee -a "$OUT/$name.log"
        rc=${PIPESTATUS[0]}
        result=$([ "$rc" -eq 0 ] && echo PASS || echo "FAIL(rc=$rc)")
        echo "$name $test $result $(($(date +%s) - start))s" >> "$OUT/results.txt"
    done
done

{
    echo
    echo "==================== GPU test summary ===================="
    printf '%-22s %-48s %-12s %s\n' binary test result time
    while read -r bin test result secs; do
        printf '%-22s %-48s %-12s %s\n' "$bin" "$test" "$result" "$secs"
    done < "$OUT/results.txt"
    echo
    echo "key figures:"
    cat "$OUT"/*.log | grep '^\[figure\]' | sed 's/^\[figure\] /  /'
    if grep -q FAIL "$OUT/results.txt"; then
        echo
        echo "failures (first lines of each panic):"
        cat "$OUT"/*.log | grep -A4 'panicked at' | head -80
    fi
} | tee "$OUT/table.txt"
! grep -q FAIL "$OUT/results.txt"
