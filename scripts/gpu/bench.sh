#!/usr/bin/env bash
# The performance table of docs/performance.md in one device call (run on the GPU machine
# from the repo root, with .gpu carried; see prepare.sh): `smelt bench` for each row, the
# PyTorch baseline with torch.compile once per model in the same call (the fp8 rows reuse
# their model's figure), and one closing table with the ratio and the target; below it, for
# each row short of its target, the op families that take most of its step (`smelt bench
# --op-times`).
#
# Environment: OUT (logs, default .gpu/logs); SKIP_TORCH=1 skips the baseline; BENCH_ROWS
# replaces the rows ("model dtype batch target [smelt bench flags...]" separated by ';', dtype
# bf16, fp8, int8 or int8-wgrad (INT8 weight gradients too), target "-" for none; a model
# directory, e.g. scripts/gpu/models/llama-1b-blog, is baselined from its config.json; a row's
# `--seq-len N` sets its sequence length, and its baseline's); TORCH_BATCH and TORCH_FLAGS
# replace the baseline's batch and add to its flags (e.g. --ckpt); SMELT, DEVICE and SEQ (the
# rows' sequence length; default .gpu/smelt, cuda, 1024) let the script run elsewhere, e.g.
# on the CPU with a tiny model to check it.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/logs}
SMELT=${SMELT:-.gpu/smelt}
DEVICE=${DEVICE:-cuda}
SEQ=${SEQ:-1024}
mkdir -p "$OUT"

# model, dtype, smelt batch, target tok/s (the targets of docs/performance.md), flags. The 8B
# rows take --fit-memory: the whole GPU where its state and activations fit (an H200), else
# the recompute and offload flags that fit it.
llama8b="llama-3-8b bf16 1 11400 --seq-len 8192 --fit-memory;llama-3-8b fp8 1 16000 --seq-len 8192 --fit-memory"
IFS=';' read -r -a rows <<< "${BENCH_ROWS:-qwen2.5-0.5b bf16 32 172000;qwen2.5-1.5b bf16 16 66000;qwen2.5-3b bf16 8 35000;qwen2.5-0.5b fp8 32 190000;qwen2.5-1.5b fp8 16 85000;$llama8b}"
# The baseline's batch: 8 for the 1.5B and 3B models, the largest PyTorch fits at 1.5B
# (PyTorch runs out of memory at 16); one sequence of the 8B, with activation checkpointing,
# without which it does not fit.
torch_batch() {
    [ -n "${TORCH_BATCH:-}" ] && { echo "$TORCH_BATCH"; return; }
    case $1 in
    *0.5b) echo 32 ;;
    *8b) echo 1 ;;
    *) echo 8 ;;
    esac
}
torch_flags() {
    case $1 in
    *8b) echo --ckpt ;;
    esac
}
# A safe file name for a model (a directory path may contain '/').
slug() { printf %s "$1" | tr -c 'A-Za-z0-9._-' '_'; }

: > "$OUT/bench-rows.txt"
rm -f "$OUT"/torch-*.txt # a skipped baseline must not leave an earlier call's figure
baselines=() # "model seq" of each row, once
for row in "${rows[@]}"; do
    read -r model dtype batch target extra <<< "$row"
    read -r -a given <<< "${extra:-}"
    # The row's own --seq-len, taken out of its flags, or SEQ.
    seq=$SEQ
    flags=()
    for ((i = 0; i < ${#given[@]}; i++)); do
        if [ "${given[i]}" = --seq-len ]; then
            seq=${given[i + 1]}
            i=$((i + 1))
        else
            flags+=("${given[i]}")
        fi
    done
    case $dtype in
    fp8) flags+=(--matmul-dtype e4m3 --gradient-dtype e5m2) ;;
    int8) flags+=(--matmul-dtype int8) ;;
    int8-wgrad) flags+=(--matmul-dtype int8 --int8-weight-grad) ;;
    esac
    # A row with a target is profiled too (a few steps after the timed ones), so that one
    # that falls short can say where its time goes.
    [ "$target" != - ] && flags+=(--op-times)
    name="smelt-$(slug "$model")-$dtype-b$batch$(slug "${extra:+ $extra}")"
    echo "=== $name"
    # Each row takes well under a minute (19 steps and the startup); a hang must not eat the call.
    timeout "${ROW_TIMEOUT:-180}" "$SMELT" bench --model "$model" --batch-size "$batch" \
        --seq-len "$seq" --device "$DEVICE" --json "${flags[@]}" \
        > "$OUT/$name.json" 2> "$OUT/$name.err"
    echo "rc $?" >> "$OUT/$name.err"
    cat "$OUT/$name.json" "$OUT/$name.err"
    echo "$model $dtype $batch $seq $target $name ${extra:-}" >> "$OUT/bench-rows.txt"
    [[ " ${baselines[*]} " == *" $model@$seq "* ]] || baselines+=("$model@$seq")
done

if [ -z "${SKIP_TORCH:-}" ] && python3 -c "import torch, transformers" 2>/dev/null; then
    for baseline in "${baselines[@]}"; do
        model=${baseline%@*} seq=${baseline##*@}
        echo "=== torch $model, seq $seq"
        log="$OUT/torch-$(slug "$model")-s$seq.txt"
        # shellcheck disable=SC2046,SC2086 # the flags: one word each
        SMELT="$SMELT" timeout "${TORCH_TIMEOUT:-300}" python3 scripts/torch_baseline.py "$model" \
            "$(torch_batch "$model")" "$seq" --compile $(torch_flags "$model") ${TORCH_FLAGS:-} \
            > "$log" 2>&1
        tail -3 "$log"
    done
else
    echo "=== torch baseline skipped (SKIP_TORCH set, or no torch and transformers)"
fi

python3 - "$OUT" <<'PY' | tee "$OUT/bench-table.txt"
import json, os, re, sys

out = sys.argv[1]
slug = lambda s: re.sub(r"[^A-Za-z0-9._-]", "_", s)

def torch_result(model, seq):
    path = os.path.join(out, f"torch-{slug(model)}-s{seq}.txt")
    if not os.path.exists(path):
        return None
    for line in open(path):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return None

def largest_costs(r, families=5):
    """The row's largest op families by device time (the JSON's op_families)."""
    top = r.get("op_families", [])[:families]
    if not top:
        return "op times not measured on this device"
    costs = ", ".join(f"{f['family']} {f['ms']:.1f}" for f in top)
    return f"largest costs, ms of its {r['step_ms']:.1f} ms step: {costs}"

head = ("model", "dtype", "batch", "seq", "tok/s", "MFU", "peak GiB", "fwd ms", "bwd ms",
        "opt ms", "other ms", "torch tok/s", "ratio", "target")
rows, notes = [], []
for line in open(os.path.join(out, "bench-rows.txt")):
    model, dtype, batch, seq, target, name, *extra = line.split()
    dtype = " ".join([dtype] + extra)
    text = open(os.path.join(out, name + ".json")).read().strip()
    torch = torch_result(model, seq)
    tt = f"{torch['tok_s']} (b{torch['batch']})" if torch else "-"
    goal = "-" if target == "-" else f"{int(target) // 1000}k"
    if not text:
        err = [l.strip() for l in open(os.path.join(out, name + ".err")) if l.strip()]
        why = [l for l in err if l.startswith("error")] or err[-2:]
        notes.append(f"{name}: failed: {' | '.join(why)}")
        rows.append((model, dtype, batch, seq, "failed") + ("-",) * 6 + (tt, "-", goal))
        continue
    r = json.loads(text.splitlines()[-1])
    p = r["phases_ms"]
    mfu = f"{r['mfu']:.3f}" if r["mfu"] is not None else "-"
    ratio = f"{r['tok_s'] / torch['tok_s']:.2f}" if torch else "-"
    short = target != "-" and r["tok_s"] < int(target)
    met = " (short)" if short else ""
    if short:
        notes.append(f"{name}: {r['tok_s'] / int(target):.2f} of its target; "
                     + largest_costs(r))
    rows.append((model, dtype, batch, seq, f"{r['tok_s']:.0f}", mfu, f"{r['peak_mem_gib']:.1f}",
                 f"{p['forward']:.1f}", f"{p['backward']:.1f}", f"{p['optimizer']:.1f}",
                 f"{p['other']:.1f}", tt, ratio, goal + met))
widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
for row in [head] + rows:
    print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())
print("\nbf16 weights and bf16 Adam states; MFU against the dense bf16 peak (fp8 and int8 rows too);")
print("the phase split comes from separately synchronised steps (see `smelt bench --help`);")
print("peak GiB: smelt's device allocations; torch: torch.compile, ratio = smelt / torch tok/s.")
for n in notes:
    print(n)
PY
