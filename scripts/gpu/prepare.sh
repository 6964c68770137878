#!/usr/bin/env bash
# Builds, here and without a GPU, the smelt binary and every test binary, and gathers them in
# .gpu/ (git-ignored) with the GEMM-ceiling script from ../shared/bench. Then one device call
# that carries `.gpu` runs the GPU tests (`bash scripts/gpu/run.sh`), and one the performance
# table (`bash scripts/gpu/bench.sh`, which runs `.gpu/smelt bench`).
set -euo pipefail
cd "$(dirname "$0")/../.."

cargo build --release
cargo test --release --no-run

rm -rf .gpu
mkdir -p .gpu/tests
cp target/release/smelt .gpu/smelt
# Test executables, named after their target (unit tests of the library and the binary get a
# suffix), from cargo's own list rather than by guessing file names.
cargo test --release --no-run --message-format=json 2>/dev/null | python3 -c '
import json, shutil, sys
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
        continue
    if not msg["profile"]["test"]:
        continue
    target = msg["target"]
    kind = target["kind"][0]
    name = target["name"] if kind == "test" else target["name"] + "-" + kind
    shutil.copy(msg["executable"], ".gpu/tests/" + name)
'
# Only the GPU tests are run there (run.sh runs the ignored ones); the CPU-only binaries would
# push .gpu past the carry limit.
for bin in .gpu/tests/*; do
    if [ "$("$bin" --list --ignored 2>/dev/null | grep -c ': test$')" -eq 0 ]; then
        rm "$bin"
    fi
done
strip .gpu/smelt .gpu/tests/*
if [ -d ../shared/bench ]; then
    cp -r ../shared/bench .gpu/bench
    chmod -R u+w .gpu/bench # the shared folder is read-only; keep the copy removable
fi

size=$(du -sm .gpu | cut -f1)
echo "prepared .gpu: ${size} MiB, $(ls .gpu/tests | wc -l) test binaries"
if [ "$size" -ge 64 ]; then
    echo "error: .gpu is ${size} MiB, over the 64 MiB carry limit" >&2
    exit 1
fi
