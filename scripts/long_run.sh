#!/usr/bin/env bash
# A long-run check, not part of CI: trains a tiny model for 10,000 steps on the CPU (with
# periodic evals, checkpoints and the log, as a real run) and prints the process's resident
# memory as it goes, from /proc/PID/status: VmRSS now and VmHWM, its peak. Fails if the peak
# of the last tenth of the run exceeds that of the second tenth by more than GROWTH_KIB.
#
#   cargo build --release && bash scripts/long_run.sh
#
# STEPS (10000), EVERY (seconds between samples, 5), GROWTH_KIB (4096) and SMELT
# (target/release/smelt) may be set in the environment.
set -euo pipefail
cd "$(dirname "$0")/.."

SMELT=${SMELT:-target/release/smelt}
STEPS=${STEPS:-10000}
EVERY=${EVERY:-5}
GROWTH_KIB=${GROWTH_KIB:-4096}
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT

# The demo's token files (0 steps: write the data, export the initial model, stop).
"$SMELT" train --demo-dir "$DIR/demo" --steps 0 >/dev/null
mkdir "$DIR/model"
cat > "$DIR/model/config.json" <<'END'
{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
 "vocab_size": 256, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
 "tie_word_embeddings": false}
END

"$SMELT" train --model "$DIR/model" --from-scratch \
    --train-file "$DIR/demo/data/train.bin" --eval-file "$DIR/demo/data/eval.bin" \
    --batch-size 4 --seq-len 64 --steps "$STEPS" --lr 3e-3 --warmup 100 \
    --eval-every-n-steps 1000 --eval-num-steps 4 --ckpt-interval 1000 \
    --checkpoint-dir "$DIR/ckpt" --out-dir "$DIR/out" --log-file "$DIR/log.jsonl" \
    >"$DIR/console.txt" &
pid=$!

kib() { awk -v key="$1:" '$1 == key { print $2 }' "/proc/$pid/status" 2>/dev/null || true; }
last_step() { grep -o '"event":"step","step":[0-9]*' "$DIR/log.jsonl" 2>/dev/null | tail -1 | grep -o '[0-9]*$' || echo 0; }

printf '%8s %8s %12s %12s\n' seconds step 'VmRSS KiB' 'VmHWM KiB'
start=$SECONDS
samples=()
while kill -0 "$pid" 2>/dev/null; do
    rss=$(kib VmRSS); hwm=$(kib VmHWM); step=$(last_step)
    if [ -n "$rss" ]; then
        printf '%8d %8d %12d %12d\n' $((SECONDS - start)) "$step" "$rss" "$hwm"
        samples+=("$step $rss")
    fi
    sleep "$EVERY"
done
wait "$pid"
tail -3 "$DIR/console.txt"

# The peak of the samples in the second tenth of the run (allocations and caches settled)
# against that of the last tenth, before the final eval and export.
peak() { printf '%s\n' "${samples[@]}" | awk -v lo="$1" -v hi="$2" \
    '$1 >= lo && $1 < hi && $2 > m { m = $2 } END { print m }'; }
base=$(peak $((STEPS / 10)) $((STEPS / 5)))
end=$(peak $((STEPS - STEPS / 10)) "$STEPS")
if [ -z "$base" ] || [ -z "$end" ]; then
    echo "too few samples to compare; lower EVERY" >&2
    exit 1
fi
echo "resident memory, peak of steps $((STEPS / 10))-$((STEPS / 5)): $base KiB; of steps $((STEPS - STEPS / 10))-$STEPS: $end KiB; growth $((end - base)) KiB (allowed $GROWTH_KIB)"
[ $((end - base)) -le "$GROWTH_KIB" ]
