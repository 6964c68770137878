#!/usr/bin/env bash
# Where a training step's GPU time goes (run on the GPU machine from the repo root, with .gpu
# carried): Nsight Compute times every kernel of a window of steady-state launches of the
# 0.5B throughput bench, with the GPU's clocks as they are, and the table sums them by kernel
# per step (the window's steps are counted by its embedding forwards, one per step). Also
# measures the GEMM and copy ceilings.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/logs}
mkdir -p "$OUT"
SKIP=${SKIP:-4000}
WINDOW=${WINDOW:-4000}
ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    --launch-skip "$SKIP" --launch-count "$WINDOW" \
    .gpu/smelt bench --model qwen2.5-0.5b --batch-size 32 --device cuda > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
python3 - "$OUT/ncu.csv" <<'PY'
import csv, collections, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head, body = rows[0], rows[1:]
name, value = head.index("Kernel Name"), head.index("Metric Value")
total = collections.defaultdict(float); count = collections.Counter()
for r in body:
    # Template arguments and launch parameters vary; the kernel's base name groups them.
    k = r[name].split("(")[0][:90]
    total[k] += float(r[value].replace(",", "")) / 1e6  # ns -> ms
    count[k] += 1
steps = max(1, sum(c for k, c in count.items() if "embedding_forward" in k))
all_ms = sum(total.values()) / steps
print(f"kernels timed: {len(body)} over {steps} steps; GPU time per step {all_ms:.1f} ms")
for k, ms in sorted(total.items(), key=lambda kv: -kv[1])[:30]:
    print(f"{ms / steps:9.2f} ms {100 * ms / steps / all_ms:5.1f}% {count[k] / steps:7.1f}x  {k}")
PY
python3 .gpu/bench/gemm_ceiling.py 2>&1 | tail -1
