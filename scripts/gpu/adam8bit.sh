#!/usr/bin/env bash
# The 8-bit Adam moments on the GPU (docs/training.md), from the repo root with .gpu carried
# (`bash scripts/gpu/prepare.sh`, and .gpu/data as for convergence.sh):
# - bitsandbytes' own AdamW8bit on this GPU into $OUT/adam8bit.safetensors, the fixture that
#   tests/adam8bit.rs compares the CPU's update with (bitsandbytes importable, e.g. from
#   .gpu/pydeps; skipped when it is not);
# - the update against the CPU's bit for bit (cuda_ops), offloaded or not (cuda_offload);
# - qwen2-100m for 1,000 steps with q8 moments against f32 ones (convergence.sh adam8bit);
# - `smelt bench` of Qwen2.5-1.5B at batch 16 with f32, bf16 and q8 moments: tok/s, the
#   optimizer's time and peak memory.
# Logs go to $OUT; the table of the last part is printed last.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/logs}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/.gpu/pydeps${PYTHONPATH:+:$PYTHONPATH}"
if python3 -c 'import bitsandbytes' 2>/dev/null; then
    python3 scripts/adam8bit_fixture.py "$OUT/adam8bit.safetensors" 2>&1 | tail -3
else
    echo "bitsandbytes is not importable: no fixture from its kernel"
fi
for test in "cuda_ops adamw" "cuda_offload offloaded"; do
    set -- $test
    ".gpu/tests/$1" --ignored --nocapture "$2" > "$OUT/$1.log" 2>&1 &&
        echo "$1 $2: $(grep -c '^test .* ok$' "$OUT/$1.log") passed" ||
        { echo "$1 $2 FAILED"; tail -30 "$OUT/$1.log"; }
done
OUT="$OUT" bash scripts/gpu/convergence.sh adam8bit | grep RESULT || echo "convergence: see $OUT"
for moments in f32 bf16 q8; do
    ./.gpu/smelt bench --model qwen2.5-1.5b --batch-size 16 --opt-m-dtype $moments \
        --opt-v-dtype $moments --json > "$OUT/bench-$moments.json" 2> "$OUT/bench-$moments.err" ||
        { echo "bench $moments FAILED"; tail "$OUT/bench-$moments.err"; }
done
python3 - "$OUT" <<'PY'
import json, sys
print("| Qwen2.5-1.5B b16, moments | tok/s | optimizer ms | peak GiB |")
for moments in ["f32", "bf16", "q8"]:
    r = json.load(open(f"{sys.argv[1]}/bench-{moments}.json"))
    print(f"| {moments} | {r['tok_s']:,.0f} | {r['phases_ms']['optimizer']:.1f} | {r['peak_mem_gib']:.2f} |")
PY
