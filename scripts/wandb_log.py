#!/usr/bin/env python3
"""Follows a smelt training log (smelt train --log-file, JSON Lines) into a W&B run.

    python3 scripts/wandb_log.py LOG [--project P] [--name N] [--follow] [--idle-timeout S]

Every scalar is logged under the tag TensorBoard shows it by (`scalars` below), at its
training step; the run's options (and its device) are the run's config; each warning and
the error are alerts, and summary text (`warnings`, `error`); a log that ends with an error
ends the W&B run with exit code 1.

Without --follow the log is read once, to its end. With --follow it is read as the running
job appends to it, a line only once it is complete, and the run ends when the log does: at
the run's error or its full eval (the last scalar smelt logs), or after --idle-timeout
seconds with no new line (a run without --eval-file, or one that was killed). A log that
does not exist yet is waited for as long.

W&B drops a step that is not after the last one logged, so a log holding a run and its
--continue keeps only the first run's steps that the second replays.

Offline: WANDB_MODE=offline writes the run under WANDB_DIR, and `wandb sync DIR` uploads it.
"""

import argparse
import json
import os
import sys
import time

GIB = float(1 << 30)


def scalars(event):
    """(tag, step, value) of each scalar of a log event; src/train/scalars.rs mirrors it."""
    kind = event.get("event")
    if kind == "step":
        step = event["step"]
        values = [
            ("train/loss", event["loss"]),
            ("train/grad_norm", event["norm"]),
            ("train/lr", event["lr"]),
            ("train/step_seconds", event["seconds"]),
            ("train/tokens_per_second", event["tokens_per_second"]),
        ]
        for figure in ("mfu", "sol"):
            if event.get(figure) is not None:
                values.append(("train/" + figure, event[figure]))
        return [(tag, step, value) for tag, value in values]
    if kind == "eval":
        tag = "eval/loss_full" if event["full"] else "eval/loss"
        return [(tag, event["step"], event["loss"])]
    if kind == "memory":
        tag = "memory/" + event["category"].replace(" ", "_") + "_gib"
        return [(tag, 0, event["bytes"] / GIB)]
    if kind == "health":
        step = event["step"]
        figures = ("grad_norm", "param_norm", "update_ratio")
        values = [("health/" + f, event[f]) for f in ("grad_norm", "clipped_grad_norm", "param_norm", "update_ratio")]
        groups = [(f"layer_{l:02d}", n) for l, n in enumerate(event["layers"])]
        groups += list(event["families"].items())
        values += [(f"{f}/{name}", n[f]) for name, n in groups for f in figures]
        return [(tag, step, value) for tag, value in values]
    if kind == "gpu_util":
        values = []
        for g in event["gpus"]:
            readings = [(n, g.get(n)) for n in ("utilization", "sm_clock_mhz", "power_watts", "temperature_c")]
            used = g.get("memory_used")
            readings.append(("memory_used_gib", None if used is None else used / GIB))
            values += [(f"gpu/{g['gpu']}/{n}", v) for n, v in readings if v is not None]
        return [(tag, event["step"], value) for tag, value in values]
    if kind == "skipped":
        return [("train/skipped", event["step"], 1.0)]
    if kind == "spike":
        return [("train/spike_zscore", event["step"], event["zscore"])]
    return []


def wait_for(path, follow, idle_timeout, poll=0.5):
    """Returns once the log exists; with `follow`, waits for it as long as `idle_timeout`."""
    start = time.monotonic()
    while not os.path.exists(path):
        if not follow or time.monotonic() - start > idle_timeout:
            sys.exit(f"{path}: no such log")
        time.sleep(poll)


def events(path, follow, idle_timeout, poll=0.5):
    """The log's events in order; with `follow`, until the run it holds has ended."""
    ended = False  # the last event read ends a run: its error, or its full eval
    with open(path, "rb") as f:
        partial = b""
        last_line = time.monotonic()
        while True:
            partial += f.readline()
            if partial.endswith(b"\n"):
                line, partial = partial, b""
                last_line = time.monotonic()
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a crash (the next run ends it)
                kind = event.get("event")
                if kind == "error" or (kind == "eval" and event.get("full")):
                    ended = True
                elif kind in ("option", "step"):
                    ended = False  # the run goes on, or another continues it
                yield event
            elif not follow or ended or time.monotonic() - last_line > idle_timeout:
                return
            else:
                time.sleep(poll)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log", help="the JSON Lines file of smelt train --log-file")
    p.add_argument("--project", default="smelt", help="W&B project (default: smelt)")
    p.add_argument("--name", help="W&B run name (default: W&B chooses)")
    p.add_argument("--follow", action="store_true", help="keep reading as the run appends")
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=1800,
        help="with --follow, end after this many seconds without a new line (default: 1800)",
    )
    args = p.parse_args()
    try:
        import wandb
    except ImportError:
        sys.exit("wandb_log.py needs the wandb package: python3 -m pip install wandb")

    wait_for(args.log, args.follow, args.idle_timeout)
    run = wandb.init(project=args.project, name=args.name)
    warnings, failed = [], False
    for event in events(args.log, args.follow, args.idle_timeout):
        kind = event.get("event")
        by_step = {}
        for tag, step, value in scalars(event):
            by_step.setdefault(step, {})[tag] = value
        for step, values in by_step.items():
            run.log(values, step=step)
        if kind == "option":
            failed = False  # a run starts (or continues one that failed)
            run.config.update({event["name"]: event["value"]}, allow_val_change=True)
        elif kind == "device":
            run.config.update({"device": event["name"]}, allow_val_change=True)
        elif kind == "warning":
            warnings.append(event["message"])
            run.summary["warnings"] = "\n".join(warnings)
            run.alert("smelt: warning", event["message"], level=wandb.AlertLevel.WARN)
        elif kind == "error":
            failed = True
            run.summary["error"] = event["message"]
            run.alert("smelt: error", event["message"], level=wandb.AlertLevel.ERROR)
    run.finish(exit_code=1 if failed else 0)


if __name__ == "__main__":
    main()
