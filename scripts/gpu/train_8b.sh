#!/usr/bin/env bash
# Runs on the GPU machine, from the repo root, with `.gpu` carried and DATA a folder of token
# files tokenized with Llama 3's tokenizer (train-*.bin, eval.bin; see docs/memory.md): a real
# training run of Llama-3-8B from scratch within 24 GiB of device memory (--fit-memory 24),
# 1 × 8192 tokens a step, in two halves: steps 1-25 end with a checkpoint, which a second run
# continues (--continue) to step 50 and a full eval. The weights and Adam's moments are
# bf16 (no f32 master), so that the checkpoint (48 GB) fits the machine's disk.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/logs}
DATA=${DATA:-.gpu/data}
CKPT=${CKPT:-/tmp/ckpt-8b}
mkdir -p "$OUT"
run() {
    ./.gpu/smelt train --model llama-3-8b --from-scratch --train-file "$DATA/train-*.bin" \
        --eval-file "$DATA/eval.bin" --batch-size 1 --seq-len 8192 --fit-memory 24 \
        --master-dtype bf16 --opt-m-dtype bf16 --opt-v-dtype bf16 --lr 3e-4 --warmup 5 \
        --lr-schedule constant --eval-every-n-steps 0 --checkpoint-dir "$CKPT" \
        --log-file "$OUT/8b.jsonl" "$@"
}
run --steps 25 --ckpt-interval 25 2>&1 | tee "$OUT/8b-first.txt"
run --steps 50 --continue 2>&1 | tee "$OUT/8b-continued.txt"
python3 - "$OUT/8b.jsonl" <<'PY'
import json, sys
events = [json.loads(l) for l in open(sys.argv[1])]
steps = [e for e in events if e["event"] == "step"]
evals = [e for e in events if e["event"] == "eval"]
ckpts = [e for e in events if e["event"] == "checkpoint"]
rate = sum(s["tokens_per_second"] for s in steps[5:]) / len(steps[5:])
print(f"steps {steps[0]['step']}-{steps[-1]['step']}: loss {steps[0]['loss']:.3f} -> "
      f"{steps[-1]['loss']:.3f}; {rate:,.0f} tok/s over steps 6-50")
print("checkpoints:", [(c["step"], "loaded" if c["loaded"] else "written") for c in ckpts])
print("evals:", [(e["step"], round(e["loss"], 3)) for e in evals])
PY
grep -h "^memory:" "$OUT/8b-first.txt" | head -1
