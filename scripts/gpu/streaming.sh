#!/usr/bin/env bash
# Models bigger than the memory they are given, on one GPU (run from the repo root with .gpu
# carried, see prepare.sh):
#   1. correctness: the streaming GPU test (tests/cuda_streaming.rs): the blocks' weights and
#      gradients streamed from host memory give the plain run's bits;
#   2. speed: `smelt bench` of Llama-3-8B at batch 1 × 8192 with the whole GPU, and with the
#      memory flags of ROWS (name, then flags): the optimizer state, then the blocks' weights
#      and gradients, in host memory, each block updated in the backward or after it
#      (--optimizer-in-backward), what --fit-memory picks for 24 and 40 GiB, and 8 sequences
#      a step run layer-major, in bf16 and FP8 matmuls; and 65,536 tokens (SEQ_ROWS). Each row's tok/s, MFU, the device memory smelt allocated,
#      all the device memory in use, and what lives in pinned host memory;
#   3. `smelt train` of Llama-3-8B from scratch on the demo's token files, 8 sequences of 8192
#      tokens a step (--grad-accumulation 8), with the flags of TRAIN_ROWS: each row's median
#      tok/s of its steps after the first, from its log.
# Ends with a short table. ROWS, SEQ_ROWS and TRAIN_ROWS may be set to run fewer.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/logs}
mkdir -p "$OUT/streaming"
status=0

echo "=== streaming weights and gradients: bitwise the plain run"
.gpu/tests/cuda_streaming --ignored --nocapture 2>&1 | tee "$OUT/streaming/test.log" | grep -E 'figure|test result|panicked' || true
grep -q 'test result: ok' "$OUT/streaming/test.log" || status=1

STATE="--offload-opt-m --offload-opt-v"
STREAM="--offload-weights --offload-gradients"
ROWS=${ROWS-"whole-gpu|
state-offloaded|--recompute-block $STATE
streamed|--recompute-block $STATE $STREAM --lmhead-chunks 8
streamed-residual|--recompute-block $STATE $STREAM --offload-residual --lmhead-chunks 8
streamed-in-backward|--recompute-block $STATE $STREAM --lmhead-chunks 8 --optimizer-in-backward
fit-24|--fit-memory 24
fit-24-in-backward|--fit-memory 24 --optimizer-in-backward
fit-40-in-backward|--fit-memory 40 --optimizer-in-backward
layer-major-fit-24|--grad-accumulation 8 --layer-major --fit-memory 24
layer-major-fit-24-in-backward|--grad-accumulation 8 --layer-major --fit-memory 24 --optimizer-in-backward
layer-major-fit-40-in-backward|--grad-accumulation 8 --layer-major --fit-memory 40 --optimizer-in-backward
fp8-layer-major-fit-24-in-backward|--matmul-dtype e4m3 --grad-accumulation 8 --layer-major --fit-memory 24 --optimizer-in-backward
fp8-layer-major-fit-40-in-backward|--matmul-dtype e4m3 --grad-accumulation 8 --layer-major --fit-memory 40 --optimizer-in-backward"}
SEQ_ROWS=${SEQ_ROWS-"65536|--recompute-block --ffn-chunks 8 --lmhead-chunks 16 $STATE"}

bench() { # name, seq, flags...
    local name=$1 seq=$2
    shift 2
    echo "=== llama-3-8b 1 x $seq: $name ($*)"
    timeout 500 ./.gpu/smelt bench --model llama-3-8b --batch-size 1 --seq-len "$seq" \
        --steps "${STEPS:-4}" --warmup "${WARMUP:-2}" --json "$@" > "$OUT/streaming/$name.json" \
        2> "$OUT/streaming/$name.err" || {
        status=1
        tail -3 "$OUT/streaming/$name.err"
    }
}
while IFS='|' read -r name flags; do
    [ -n "$name" ] && bench "$name" 8192 $flags
done <<< "$ROWS"
while IFS='|' read -r seq flags; do
    [ -n "$seq" ] && STEPS=${SEQ_STEPS:-2} bench "seq-$seq" "$seq" $flags
done <<< "$SEQ_ROWS"

TRAIN_ROWS=${TRAIN_ROWS-"whole-gpu|
streamed|--recompute-block $STATE $STREAM --lmhead-chunks 8"}
if [ -n "$TRAIN_ROWS" ]; then
    ./.gpu/smelt train --demo-dir "$OUT/streaming/demo" --steps 0 > /dev/null
fi
while IFS='|' read -r name flags; do
    [ -n "$name" ] || continue
    echo "=== smelt train llama-3-8b, 8 x 8192 a step: $name ($flags)"
    timeout 500 ./.gpu/smelt train --model llama-3-8b --from-scratch \
        --train-file "$OUT/streaming/demo/data/train.bin" --batch-size 1 --seq-len 8192 \
        --grad-accumulation 8 --steps "${TRAIN_STEPS:-3}" --warmup 1 --eval-every-n-steps 0 \
        --master-dtype bf16 --opt-m-dtype bf16 --opt-v-dtype bf16 \
        --log-file "$OUT/streaming/train-$name.jsonl" $flags > "$OUT/streaming/train-$name.txt" 2>&1 || {
        status=1
        tail -3 "$OUT/streaming/train-$name.txt"
    }
done <<< "$TRAIN_ROWS"

python3 - "$OUT/streaming" <<'PY' | tee "$OUT/streaming/table.txt"
import json, os, sys
d = sys.argv[1]
print("\n==================== Llama-3-8B, batch 1 ====================")
print(f"{'row':<31} {'seq':>6} {'ga':>2} {'tok/s':>9} {'MFU':>6} {'allocated GiB':>14} {'in use GiB':>11} {'host GiB':>9}  phases ms (fwd/bwd/opt/other)")
for name in sorted(os.listdir(d)):
    if not name.endswith(".json"):
        continue
    text = open(os.path.join(d, name)).read().strip()
    if not text:
        print(f"{name[:-5]:<31} failed: {open(os.path.join(d, name[:-5] + '.err')).read().strip().splitlines()[-1:]}")
        continue
    r = json.loads(text.splitlines()[-1])
    p = r["phases_ms"]
    print(f"{name[:-5]:<31} {r['seq']:>6} {r.get('grad_accumulation', 1):>2} {r['tok_s']:>9,.0f} {r['mfu'] or 0:>6.3f} {r['peak_mem_gib']:>14.2f} "
          f"{r['device_in_use_gib'] or 0:>11.2f} {r['offloaded_gib']:>9.2f}  "
          f"{p['forward']:.0f}/{p['backward']:.0f}/{p['optimizer']:.0f}/{p['other']:.0f}")
logs = sorted(n for n in os.listdir(d) if n.startswith("train-") and n.endswith(".jsonl"))
if logs:
    print("\nsmelt train, 8 x 8192 tokens a step (median of the steps after the first):")
for name in logs:
    events = [json.loads(l) for l in open(os.path.join(d, name))]
    steps = [e for e in events if e["event"] == "step"]
    memory = {e["category"]: e["bytes"] for e in events if e["event"] == "memory"}
    tps = sorted(s["tokens_per_second"] for s in steps[1:]) or [0]
    print(f"  {name[6:-6]:<12} {tps[len(tps) // 2]:>9,.0f} tok/s, losses {[round(s['loss'], 3) for s in steps]}, "
          f"device {memory.get('total', 0) / 2**30:.2f} GiB, host {memory.get('host total', 0) / 2**30:.2f} GiB")
PY
exit $status
