#!/usr/bin/env bash
# smelt's NVTX ranges, seen through Nsight Compute (run on the GPU machine from the repo root
# with .gpu carried; see prepare.sh): for each range pattern, how many kernels `ncu --nvtx
# --nvtx-include` profiles in a 4-step `smelt bench` of a small model, and which. A real
# range's pattern must catch its kernels, and a name no range has must catch none.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/logs}
mkdir -p "$OUT"
for pattern in "layer 0 forward/" "forward/layer 0 forward/" "optimizer/" "no such range/"; do
    ncu --nvtx --nvtx-include "$pattern" --metrics gpu__time_duration.sum --csv --print-units base \
        .gpu/smelt bench --model qwen2-100m --batch-size 1 --seq-len 256 --steps 1 --warmup 0 \
        > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
    kernels=$(grep -c '"gpu__time_duration.sum"' "$OUT/ncu.csv")
    names=$(python3 -c '
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
head = rows[0] if rows else []
k = head.index("Kernel Name") if "Kernel Name" in head else None
print(sorted({r[k].split("(")[0][:28] for r in rows[1:]})[:8] if k is not None else [])' "$OUT/ncu.csv")
    echo "nvtx-include '$pattern': $kernels kernels $names"
done
tail -3 "$OUT/ncu.err"
