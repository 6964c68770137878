#!/usr/bin/env python3
"""Checks what smelt's exporters make of a training log, with each tool's own reader.

    check_exporters.py LOG TB_DIR [TB_DIR_2]
    check_exporters.py --gpu LOG TB_DIR     (a GPU run of scripts/gpu/watch.sh: TensorBoard)

1. TensorBoard's EventAccumulator finds in TB_DIR's one event file exactly the scalars that
   `scalars` of scripts/wandb_log.py gives for LOG's events (so smelt's mapping and the
   script's agree), each at its step and equal to the log's value rounded to float32, and
   among them every tag of TAGS.
2. scripts/wandb_log.py --follow, in W&B's offline mode, on a copy of LOG that grows while
   it reads (the first part ending mid-line), ends by itself at the full eval; wandb's
   DataStore finds in the run's .wandb file every scalar at its step, exactly, every option
   in the config, each warning as an alert and in the summary, and exit code 0.
3. TB_DIR_2, from a run of the same flags but without --log-file and on two ranks, holds one
   event file with the same tags.

Needs the tensorboard and wandb packages, and no network.
"""

import glob
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "wandb_log.py"
spec = importlib.util.spec_from_file_location("wandb_log", SCRIPT)
wandb_log = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wandb_log)

# The run is on the CPU, which has no peak FLOP/s, so no train/mfu.
TAGS = {
    "train/loss",
    "train/grad_norm",
    "train/lr",
    "train/step_seconds",
    "train/tokens_per_second",
    "eval/loss",
    "eval/loss_full",
    "memory/weights_gib",
    "memory/gradients_gib",
    "memory/activations_gib",
    "memory/total_gib",
    "train/skipped",
    "train/spike_zscore",
    "health/grad_norm",
    "health/clipped_grad_norm",
    "health/update_ratio",
    "update_ratio/layer_00",
    "update_ratio/qkv",
    "grad_norm/embed",
}


def expected(events):
    """{tag: [(step, value)]} of the log's scalars, in log order."""
    curves = {}
    for event in events:
        for tag, step, value in wandb_log.scalars(event):
            curves.setdefault(tag, []).append((step, value))
    return curves


def tensorboard_curves(tb_dir):
    files = glob.glob(os.path.join(tb_dir, "events.out.tfevents.*"))
    assert len(files) == 1, f"{tb_dir}: expected one event file, found {files}"
    acc = EventAccumulator(tb_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


# What a GPU run with --log-gpu-util and --health-every logs besides (scripts/gpu/watch.sh's).
GPU_TAGS = {
    "train/loss",
    "train/mfu",
    "train/sol",
    "health/update_ratio",
    "update_ratio/layer_00",
    "gpu/0/utilization",
    "gpu/0/sm_clock_mhz",
    "gpu/0/power_watts",
    "gpu/0/temperature_c",
    "gpu/0/memory_used_gib",
}


def check_tensorboard(events, tb_dir, required=TAGS):
    want = {
        tag: [(step, float(numpy.float32(v))) for step, v in curve]
        for tag, curve in expected(events).items()
    }
    got = tensorboard_curves(tb_dir)
    assert required <= set(want), f"the log lacks tags: {required - set(want)}"
    assert set(got) == set(want), f"tags: TensorBoard {sorted(got)}, log {sorted(want)}"
    for tag in want:
        assert got[tag] == want[tag], f"{tag}: TensorBoard {got[tag]}, log {want[tag]}"
    return set(got)


def follow_offline(log_text, work):
    """Runs wandb_log.py --follow on a log that grows as it reads; the run's .wandb file."""
    log = work / "log.jsonl"
    cut = log_text.index("\n", len(log_text) // 2) + 10  # mid-line
    log.write_text(log_text[:cut])
    env = dict(
        os.environ,
        WANDB_MODE="offline",
        WANDB_DIR=str(work),
        WANDB_SILENT="true",
        WANDB_DISABLE_GIT="true",
        WANDB_ERROR_REPORTING="false",
    )
    command = [sys.executable, str(SCRIPT), str(log), "--follow", "--name", "check"]
    # An idle timeout far past the wait below: the script must end at the full eval.
    follower = subprocess.Popen(command + ["--idle-timeout", "600"], env=env)
    start = time.monotonic()
    while not (work / "wandb" / "latest-run").exists() and time.monotonic() - start < 60:
        time.sleep(0.1)
    time.sleep(1.5)  # it has read the first part and waits on the partial line
    with open(log, "a") as f:
        f.write(log_text[cut:])
    assert follower.wait(timeout=120) == 0, "wandb_log.py failed"
    runs = glob.glob(str(work / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1, runs
    return runs[0]


def wandb_records(path):
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal.datastore import DataStore

    store = DataStore()
    store.open_for_scan(path)
    while (data := store.scan_data()) is not None:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        yield record


def check_wandb(events, log_text):
    with tempfile.TemporaryDirectory() as work:
        path = follow_offline(log_text, Path(work))
        curves, config, alerts, summary, exit_code = {}, {}, [], {}, None
        for r in wandb_records(path):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                for item in r.history.item:
                    tag = item.key or "/".join(item.nested_key)
                    if not tag.startswith("_"):
                        value = json.loads(item.value_json)
                        curves.setdefault(tag, []).append((r.history.step.num, value))
            elif kind == "config":
                config.update({i.key: json.loads(i.value_json) for i in r.config.update})
            elif kind == "alert":
                alerts.append((r.alert.title, r.alert.text, r.alert.level))
            elif kind == "summary":
                summary.update({i.key: json.loads(i.value_json) for i in r.summary.update})
            elif kind == "exit":
                exit_code = r.exit.exit_code
    want = expected(events)
    assert set(curves) == set(want), f"tags: W&B {sorted(curves)}, log {sorted(want)}"
    for tag in want:
        assert curves[tag] == want[tag], f"{tag}: W&B {curves[tag]}, log {want[tag]}"
    options = {e["name"]: e["value"] for e in events if e["event"] == "option"}
    assert len(options) > 20, options
    for name, value in options.items():
        assert config.get(name) == value, f"config {name}: {config.get(name)!r}, log {value!r}"
    devices = [e["name"] for e in events if e["event"] == "device"]
    assert config.get("device") == devices[-1], config.get("device")
    warnings = [e["message"] for e in events if e["event"] == "warning"]
    assert warnings, "the run was to log a warning"
    assert alerts == [("smelt: warning", m, "WARN") for m in warnings], alerts
    assert summary.get("warnings") == "\n".join(warnings), summary
    assert exit_code == 0, exit_code


def main():
    if sys.argv[1] == "--gpu":  # a GPU run's log and event file: TensorBoard only
        events = [json.loads(line) for line in Path(sys.argv[2]).read_text().splitlines()]
        tags = check_tensorboard(events, sys.argv[3], GPU_TAGS)
        print(f"tensorboard: {len(tags)} tags, every scalar as logged")
        return
    log, tb_dir = sys.argv[1], sys.argv[2]
    log_text = Path(log).read_text()
    events = [json.loads(line) for line in log_text.splitlines()]
    tags = check_tensorboard(events, tb_dir)
    print(f"tensorboard: {len(tags)} tags, every scalar as logged")
    check_wandb(events, log_text)
    print("wandb: every scalar, option and warning as logged")
    if len(sys.argv) > 3:
        other = set(tensorboard_curves(sys.argv[3]))
        assert other == tags, f"{sys.argv[3]}: tags {sorted(other)}, expected {sorted(tags)}"
        print("tensorboard without a log: the same tags")


if __name__ == "__main__":
    main()
