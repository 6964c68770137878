#!/usr/bin/env bash
# Runs on the GPU machine, from the repo root, with `.gpu` and `.whl` carried (prepare.sh,
# then `maturin build --release -o .whl`): the wheel installed with pip from the carried
# file alone, then the same Qwen2.5-0.5B-shaped run (batch 32 × 1024, random tokens) by
# `smelt train` and by python/examples/train.py, one after the other, and their tok/s over
# the steps after the first 10; then a step whose tokens are a CUDA torch tensor.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/logs}
STEPS=${STEPS:-40}
mkdir -p "$OUT"
py=$(mktemp -d)
python3 -m pip install --quiet --no-index --no-deps --target "$py/site" .whl/smelt-*.whl
export PYTHONPATH="$py/site${PYTHONPATH:+:$PYTHONPATH}"
python3 scripts/gpu/random_tokens.py "$py/train.bin"
flags=(--model qwen2.5-0.5b --from-scratch --train-file "$py/train.bin" --batch-size 32
    --seq-len 1024 --steps "$STEPS" --warmup 5)
./.gpu/smelt train "${flags[@]}" --log-file "$OUT/cli.jsonl" > "$OUT/cli.txt" 2>&1
python3 python/examples/train.py "${flags[@]}" > "$OUT/python.txt" 2>&1
python3 - "$OUT/cli.jsonl" "$OUT/python.txt" <<'PY'
import json, sys
cli = [e for e in map(json.loads, open(sys.argv[1])) if e["event"] == "step"]
py = [json.loads(l) for l in open(sys.argv[2]) if l.startswith("{")]
rate = lambda steps: sum(s["tokens_per_second"] for s in steps[10:]) / len(steps[10:])
c, p = rate(cli), rate(py)
same = [a["loss"] for a in cli] == [b["loss"] for b in py]
print(f"smelt train: {c:,.0f} tok/s; Python loop: {p:,.0f} tok/s ({p / c:.1%}); "
      f"losses {'bit for bit the same' if same else 'DIFFERENT'} over {len(cli)} steps")
PY
python3 - <<'PY'
import numpy as np, torch, smelt
t = smelt.Trainer("qwen2.5-0.5b", from_scratch=True, batch_size=4, seq_len=256, steps=2)
tokens = torch.randint(0, 151936, (t.sequences_per_step, 256), device="cuda")
t.step(tokens)
print("a CUDA torch tensor as tokens:", t.update(lr=1e-4))
t.close()
PY
