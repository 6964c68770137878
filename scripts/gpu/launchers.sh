#!/usr/bin/env bash
# The launchers, for real, on the GPU machine (which has torch, so torchrun; run from the repo
# root with .gpu carried, see prepare.sh). Each run is the built-in demo for STEPS steps, and
# each must give the losses and the exported model of the reference bit for bit:
#   CPU ranks (--device cpu), against `--gpus 2` threads:
#     1. torchrun --nproc-per-node 2 (its agent's store: rank 0 publishes its own there);
#     2. two torchrun launches, --nnodes 2 --node-rank 0 and 1, one process each, meeting at
#        --master-addr 127.0.0.1 (the multi-machine path, over the network stack);
#     3. torchrun's c10d rendezvous (--rdzv-backend c10d), two processes;
#   on the GPU, against a plain `smelt train`:
#     4. torchrun --nproc-per-node 1 (one rank, on cuda:LOCAL_RANK);
#   with two GPUs, against `--gpus 2` threads on the GPUs:
#     5. torchrun --nproc-per-node 2, and Qwen2.5-1.5B's throughput at batch 16 with
#        --grad-accumulation 4 on one GPU, two GPUs as threads and two as processes (the data
#        as for e2e.sh).
# Ends with a short table.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/logs}
LOGS="$OUT/launchers"
mkdir -p "$LOGS"
SMELT="$PWD/.gpu/smelt"
STEPS=${STEPS:-12}
: > "$LOGS/results.txt"

# The demo in folder $1 (its data, log and model there), more flags after.
demo() {
    local dir=$1
    shift
    echo "$SMELT train --demo-dir $LOGS/$dir --steps $STEPS --eval-every-n-steps 0 $*"
}

# Whether runs $1 and $2 logged the same losses and exported the same model.
same() {
    python3 - "$LOGS/$1" "$LOGS/$2" <<'PY'
import json, sys
def losses(d):
    return [l["loss"] for l in map(json.loads, open(d + "/log.jsonl")) if l["event"] == "step"]
a, b = sys.argv[1], sys.argv[2]
la, lb = losses(a), losses(b)
model = lambda d: open(d + "/model/model.safetensors", "rb").read()
ok = la == lb and len(la) > 0 and model(a) == model(b)
print(f"{b}: {len(lb)} steps, last loss {lb[-1] if lb else None}, "
      f"{'the same bits as' if ok else 'DIFFERENT from'} {a}")
sys.exit(0 if ok else 1)
PY
}

check() {
    local name=$1 reference=$2
    if same "$reference" "$name"; then
        echo "$name PASS" >> "$LOGS/results.txt"
    else
        echo "$name FAIL" >> "$LOGS/results.txt"
    fi
}

echo "=== CPU reference: --gpus 2 threads"
$(demo cpu-threads --device cpu --gpus 2) > "$LOGS/cpu-threads.txt" 2>&1 || echo "cpu-threads FAIL(run)" >> "$LOGS/results.txt"

echo "=== 1. torchrun --nproc-per-node 2, CPU ranks"
torchrun --nproc-per-node 2 --master-port 29611 --no-python $(demo cpu-torchrun --device cpu) \
    > "$LOGS/cpu-torchrun.txt" 2>&1
check cpu-torchrun cpu-threads

echo "=== 2. torchrun --nnodes 2, one process per 'node', CPU ranks"
for node in 0 1; do
    torchrun --nnodes 2 --node-rank $node --nproc-per-node 1 --master-addr 127.0.0.1 \
        --master-port 29612 --no-python $(demo cpu-nodes --device cpu) \
        > "$LOGS/cpu-nodes-$node.txt" 2>&1 &
done
wait
check cpu-nodes cpu-threads

echo "=== 3. torchrun c10d rendezvous, CPU ranks"
torchrun --nnodes 1 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29613 \
    --no-python $(demo cpu-c10d --device cpu) > "$LOGS/cpu-c10d.txt" 2>&1
check cpu-c10d cpu-threads

echo "=== 4. torchrun --nproc-per-node 1 on the GPU, against a plain run"
$(demo gpu-plain --device cuda) > "$LOGS/gpu-plain.txt" 2>&1
torchrun --nproc-per-node 1 --master-port 29614 --no-python $(demo gpu-torchrun --device cuda) \
    > "$LOGS/gpu-torchrun.txt" 2>&1
check gpu-torchrun gpu-plain

gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
if [ "$gpus" -ge 2 ]; then
    echo "=== 5. two GPUs: threads against torchrun processes"
    $(demo gpu-threads --device cuda --gpus 2) > "$LOGS/gpu-threads.txt" 2>&1
    torchrun --nproc-per-node 2 --master-port 29615 --no-python \
        $(demo gpu-processes --device cuda) > "$LOGS/gpu-processes.txt" 2>&1
    check gpu-processes gpu-threads
    if [ -d .gpu/data ]; then
        run_15b() {
            local name=$1
            shift
            "$@" train --model qwen2.5-1.5b --from-scratch --train-file '.gpu/data/train-*.bin' \
                --batch-size 16 --seq-len 1024 --grad-accumulation 4 --steps 12 --warmup 2 \
                --master-dtype bf16 --opt-m-dtype bf16 --opt-v-dtype bf16 \
                --log-file "$LOGS/$name.jsonl" > "$LOGS/$name.txt" 2>&1
        }
        run_15b 1.5b-one "$SMELT"
        run_15b 1.5b-threads "$SMELT" --gpus 2
        run_15b 1.5b-processes torchrun --nproc-per-node 2 --master-port 29616 --no-python "$SMELT"
    fi
else
    echo "5. SKIPPED: $gpus GPU(s); two are needed" | tee -a "$LOGS/results.txt"
fi

{
    echo
    echo "==================== launchers ===================="
    cat "$LOGS/results.txt"
    if ls "$LOGS"/1.5b-*.jsonl >/dev/null 2>&1; then
        python3 - "$LOGS" <<'PY'
import json, statistics, sys, os
d = sys.argv[1]
def tps(name):
    steps = [l for l in map(json.loads, open(f"{d}/{name}.jsonl")) if l["event"] == "step"]
    return statistics.median(s["tokens"] / s["seconds"] for s in steps[4:]), [s["loss"] for s in steps]
one, _ = tps("1.5b-one")
threads, lt = tps("1.5b-threads")
processes, lp = tps("1.5b-processes")
print(f"Qwen2.5-1.5B b16 GA4: one GPU {one:,.0f} tok/s; two GPUs threads {threads:,.0f} "
      f"({threads / (2 * one):.1%} of 2x); processes {processes:,.0f} ({processes / threads:.1%} "
      f"of threads); losses {'bitwise equal' if lt == lp else 'DIFFER'}")
PY
    fi
} | tee "$LOGS/table.txt"
! grep -q FAIL "$LOGS/results.txt"
