"""`smelt train` written as a Python loop over smelt's Trainer: the same data order, schedule
and update, so the same flags give the same losses, bit for bit. Each step prints a JSON line.

    python python/examples/train.py --model qwen2.5-0.5b --from-scratch \
        --train-file 'data/train-*.bin' --batch-size 32 --seq-len 1024 --steps 1000 --lr 3e-4

Flags it does not name are handed to the Trainer as they are (`--zero-level 1`, `--gpus 2`).
"""

import argparse
import json
import time

import smelt


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--from-scratch", action="store_true")
    p.add_argument("--train-file", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out-dir")
    args, rest = p.parse_known_args(argv)
    # The other flags pass through: `--batch-size 4` as batch_size="4", `--flag` as True.
    extra, i = {}, 0
    while i < len(rest):
        key = rest[i].lstrip("-").replace("-", "_")
        if i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            extra[key], i = rest[i + 1], i + 2
        else:
            extra[key], i = True, i + 1
    trainer = smelt.Trainer(args.model, from_scratch=args.from_scratch, steps=args.steps,
                            seq_len=args.seq_len, seed=args.seed, **extra)
    data = smelt.DataLoader(args.train_file, args.seq_len, seed=args.seed)
    with trainer:
        for step in range(args.steps):
            start = time.perf_counter()
            tokens, targets = data.next(trainer.sequences_per_step)
            trainer.step(tokens, targets)
            result = trainer.update(lr=trainer.scheduled_lr(step))
            seconds = time.perf_counter() - start
            result["tokens_per_second"] = tokens.size / seconds
            print(json.dumps(result), flush=True)
        if args.out_dir:
            trainer.export(args.out_dir)


if __name__ == "__main__":
    main()
