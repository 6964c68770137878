#!/usr/bin/env bash
# What offloading activations costs (run on the GPU machine from the repo root with .gpu
# carried; see prepare.sh): `smelt bench` rows with and without it, in one call.
# PART=short: Qwen2.5-0.5B at batch 32 × 1024, with nothing recomputed and with
# --recompute-block, where each block's input (59 MB) crosses the bus in about the time of
# a block's forward; PART=long: one sequence of 131,072 tokens with --recompute-block, where
# the residual stream is a third of the activations, and that again with the MLP in 4 token
# chunks (`--ffn-chunks 4`, whose shared gate/up and SwiGLU buffers shrink to a quarter);
# PART=activations: --offload-activations at 128k (against --recompute-block, which it
# replaces within a small budget), at 3B batch 8 × 1024 (where the copies hide) and at 0.5B
# batch 32 × 1024 (where they do not).
# No PyTorch baseline: the comparison is smelt against itself; each row prints its loss,
# which offloading leaves bitwise the same.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/logs}
mkdir -p "$OUT/offload"
rows() { # name, SEQ, rows
    SEQ=$2 BENCH_ROWS=$3 OUT="$OUT/offload/$1" SKIP_TORCH=1 ROW_TIMEOUT=300 \
        bash scripts/gpu/bench.sh > "$OUT/offload/$1.log" 2>&1
    # Each row: its flags, tok/s, step, device and host memory.
    python3 - "$OUT/offload/$1" <<'PY'
import glob, json, os, sys

for path in sorted(glob.glob(os.path.join(sys.argv[1], "smelt-*.json"))):
    name = os.path.basename(path)[: -len(".json")]
    lines = open(path).read().strip().splitlines()
    if not lines:
        print(f"{name}: no result")
        continue
    r = json.loads(lines[-1])
    print(f"{name:<72} {r['tok_s']:>9.0f} tok/s {r['step_ms']:>9.1f} ms "
          f"GPU {r['peak_mem_gib']:.2f} GiB, host {r['offloaded_gib']:.2f} GiB, "
          f"loss {r['loss']:.9f}")
PY
}
case ${PART:-short} in
short)
    rows 1k 1024 "qwen2.5-0.5b bf16 32 -;qwen2.5-0.5b bf16 32 - --offload-residual;qwen2.5-0.5b bf16 32 - --recompute-block;qwen2.5-0.5b bf16 32 - --recompute-block --offload-residual"
    ;;
long)
    long="--recompute-block --lmhead-chunks 32 --steps 3 --warmup 1"
    rows 128k 131072 "qwen2.5-0.5b bf16 1 - $long;qwen2.5-0.5b bf16 1 - $long --offload-residual;qwen2.5-0.5b bf16 1 - $long --offload-residual --ffn-chunks 4"
    ;;
activations)
    steps="--steps 3 --warmup 1"
    ffn="--recompute-ffn --recompute-norm --offload-residual --lmhead-chunks 8 --ffn-chunks 4 $steps"
    rows 128k 131072 "qwen2.5-0.5b bf16 1 - --recompute-block --offload-residual --lmhead-chunks 32 $steps;qwen2.5-0.5b bf16 1 - $ffn;qwen2.5-0.5b bf16 1 - $ffn --offload-activations"
    three_b="--recompute-ffn --recompute-norm --offload-opt-m"
    rows 1k 1024 "qwen2.5-3b bf16 8 - $three_b;qwen2.5-3b bf16 8 - $three_b --offload-activations;qwen2.5-0.5b bf16 32 - --recompute-ffn;qwen2.5-0.5b bf16 32 - --recompute-ffn --offload-activations"
    ;;
*)
    echo "error: PART=${PART} is not one of short, long, activations" >&2
    exit 2
    ;;
esac
