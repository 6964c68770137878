#!/usr/bin/env bash
# Packed documents on the GPU (docs/documents.md), from the repo root with .gpu carried
# (`bash scripts/gpu/prepare.sh`):
# - attention and RoPE with documents against the CPU (cuda_ops), the tensor-core kernels
#   against the CUDA-core ones at the 0.5B shape with their time masked and unmasked
#   (cuda_attention), and a training step of small models in bf16 and FP8 against the CPU's
#   (cuda_model);
# - `smelt bench` of Qwen2.5-0.5B at batch 32 × 1024 without documents, then with documents
#   of ~300 tokens kept apart (--doc-mask --doc-positions).
# Logs go to $OUT; the table of the last part is printed last.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/logs}
mkdir -p "$OUT"
for test in "cuda_ops attention_forward_and_backward" "cuda_ops rope" \
    "cuda_attention documents" "cuda_model documents"; do
    set -- $test
    ".gpu/tests/$1" --ignored --nocapture "$2" > "$OUT/$1-$2.log" 2>&1 &&
        echo "$1 $2: $(grep -c '^test .* ok$' "$OUT/$1-$2.log") passed" ||
        { echo "$1 $2 FAILED"; grep -E 'panicked|FAILED' -A3 "$OUT/$1-$2.log" | head -30; }
    grep '^\[figure\].*documents' "$OUT/$1-$2.log" | grep -E 'x\)|loss gpu' | head -8 || true
done
bench() { # NAME FLAGS...
    local name=$1
    shift
    ./.gpu/smelt bench --model qwen2.5-0.5b --batch-size 32 --json "$@" \
        > "$OUT/bench-$name.json" 2> "$OUT/bench-$name.err" ||
        { echo "bench $name FAILED"; tail "$OUT/bench-$name.err"; }
}
bench plain
bench documents --doc-mask --doc-positions --doc-length 300
python3 - "$OUT" <<'PY'
import json, sys
print("| Qwen2.5-0.5B b32 × 1024 | tok/s | forward ms | backward ms | loss |")
for name in ["plain", "documents"]:
    r = json.load(open(f"{sys.argv[1]}/bench-{name}.json"))
    p = r["phases_ms"]
    print(f"| {name} | {r['tok_s']:,.0f} | {p['forward']:.1f} | {p['backward']:.1f} | {r['loss']:.3f} |")
PY
