"""smelt from Python: the engine of `smelt train` driven by a loop you write.

    import smelt

    trainer = smelt.Trainer("qwen2.5-0.5b", from_scratch=True, batch_size=32, seq_len=1024,
                            steps=1000, lr=3e-4, warmup=100)
    data = smelt.DataLoader("data/train-*.bin", seq_len=1024, seed=trainer.seed)
    for step in range(1000):
        tokens, targets = data.next(trainer.sequences_per_step)
        trainer.step(tokens, targets)
        print(trainer.update(lr=trainer.scheduled_lr(step)))

Keyword arguments are `smelt train`'s flags (`batch_size=32` is `--batch-size 32`, `True`
gives a flag alone, `False` and `None` leave it out); `docs/python.md` lists them. Every
call enqueues its work and returns, except those that return a value read from the device
(`update`, `eval`, `memory`); errors are `smelt.SmeltError` with smelt's message.
"""

from __future__ import annotations

import numpy as np

from . import _smelt
from ._smelt import SmeltError

__all__ = ["Trainer", "DataLoader", "SmeltError", "tokenize", "plan", "generate", "run"]


def _flags(options):
    """`smelt train`-style flags of keyword arguments."""
    args = []
    for key, value in options.items():
        flag = "--" + ("continue" if key == "resume" else key.replace("_", "-"))
        if value is None or value is False:
            continue
        if value is True:
            args.append(flag)
        elif isinstance(value, (list, tuple)):
            args += [flag, ",".join(str(v) for v in value)]
        else:
            args += [flag, str(value)]
    return args


def _int32_bytes(array, name):
    """The values of a NumPy array, a torch tensor or anything with `__array__` or
    `__dlpack__`, as contiguous little-endian int32 bytes."""
    if array is None:
        return None
    if hasattr(array, "detach") and hasattr(array, "cpu"):  # a torch tensor, on any device
        array = array.detach().cpu()
    try:
        values = np.asarray(array)
    except (TypeError, ValueError):
        values = np.from_dlpack(array)
    if values.dtype.kind not in "iub":
        raise SmeltError(f"{name}: integer token ids expected, got {values.dtype}")
    return np.ascontiguousarray(values, dtype="<i4").tobytes()


def _mask_bytes(mask):
    """A loss mask (1 trains) as one byte per token."""
    return None if mask is None else np.ascontiguousarray(np.asarray(mask), dtype=np.uint8).tobytes()


class Trainer:
    """A training run of `model` (a HF directory, a Hub name in the local cache, or with
    `from_scratch=True` a built-in architecture such as "qwen2.5-0.5b"), with `smelt train`'s
    options as keyword arguments (not `train_file`: the data is yours). The weights are made
    or read, and the checkpoint continued from (`resume=True`), before this returns.
    """

    def __init__(self, model, *, from_scratch=False, **options):
        self.options = dict(model=model, from_scratch=from_scratch, **options)
        self._trainer = _smelt.Trainer(_flags(self.options))
        shape = self._trainer.shape()
        self.batch_size, self.seq_len, self.grad_accumulation = shape[:3]
        self.sequences_per_step, self.world = shape[3:]
        # One micro-batch of every GPU of this process.
        self.sequences_per_eval = self.sequences_per_step // self.grad_accumulation
        self.seed = int(options.get("seed", 42))
        self.last = None

    def step(self, tokens, targets=None, mask=None):
        """The forward and backward of one step: `tokens` is `[sequences_per_step, seq_len]`
        (each of the `grad_accumulation` micro-batches of `batch_size` sequences per GPU, in
        order; GPU r of N takes sequences r, r + N, ...). `targets` defaults to each token's
        next (the last of a sequence untrained), `mask` (1 trains) masks those. Returns
        before the device is done."""
        self._trainer.step(
            _int32_bytes(tokens, "tokens"),
            _int32_bytes(targets, "targets"),
            _mask_bytes(mask),
        )

    def update(self, lr=None):
        """Applies the step's gradients at rate `lr` (the run's schedule where None), unless
        its loss or gradient norm is not finite, or it is a spike skipped by `on_spike="skip"`.
        Returns the step's `step`, `loss`, `grad_norm`, `lr` and `skipped` (why, or None)."""
        self.last = self._trainer.update(None if lr is None else float(lr))
        return self.last

    def eval(self, tokens, targets=None, mask=None):
        """The mean loss over one batch (`[sequences_per_eval, seq_len]`: `batch_size` per GPU
        of this process), and the targets it averages over."""
        loss_sum, trained = self._trainer.eval(
            _int32_bytes(tokens, "tokens"),
            _int32_bytes(targets, "targets"),
            _mask_bytes(mask),
        )
        return loss_sum / max(trained, 1), trained

    @property
    def steps_done(self):
        """Steps done: those of the run it continues (`resume=True`), and this one's."""
        return self._trainer.steps_done()

    def scheduled_lr(self, step):
        """The rate of step `step` (from 0) under the run's `lr`, `warmup`, `lr_schedule`,
        `final_lr_fraction`, `cooldown` and `steps`, as `smelt train` computes it."""
        return self._trainer.scheduled_lr(step)

    def save_checkpoint(self):
        """Writes a checkpoint of this step into `checkpoint_dir`; returns its folder. A run
        made with `resume=True` continues from the latest one."""
        return self._trainer.save_checkpoint()

    def load_checkpoint(self):
        """The trainer continued from the latest checkpoint in `checkpoint_dir`: a new one,
        made with the same options and `resume=True`."""
        self.close()
        options = dict(self.options, resume=True)
        model = options.pop("model")
        return Trainer(model, **options)

    def export(self, directory):
        """Writes the model as it is now as a HF directory (new or empty)."""
        self._trainer.export(str(directory))

    def memory(self):
        """Bytes per allocation category (the startup memory table), as a dict."""
        return dict(self._trainer.memory())

    def metrics(self):
        """The last update's figures (as `update` returned them), or None."""
        return self.last

    def close(self):
        """Ends the run and frees its devices; the trainer is unusable after."""
        self._trainer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class DataLoader:
    """Token files (`smelt tokenize`'s) read as `smelt train` reads them: shuffled by `seed`
    per epoch, sequences of `seq_len` with their next-token targets (masked ones untrained)."""

    def __init__(self, train_file, seq_len, seed=42, vocab_size=2**31 - 1):
        self._loader = _smelt.DataLoader(str(train_file), seq_len, seed, vocab_size)
        self.seq_len = seq_len

    def next(self, sequences):
        """The next `sequences` of the stream: (tokens, targets), int32 `[sequences, seq_len]`."""
        tokens, targets = self._loader.next(sequences)
        shape = (sequences, self.seq_len)
        return (np.frombuffer(tokens, "<i4").reshape(shape), np.frombuffer(targets, "<i4").reshape(shape))

    def per_epoch(self):
        """Sequences in one epoch."""
        return self._loader.per_epoch()


def run(*args):
    """Runs a `smelt` subcommand in this process: `smelt.run("plan", "--model", ...)`."""
    _smelt.run([str(a) for a in args])


def tokenize(inputs, *, tokenizer, out_dir, **options):
    """`smelt tokenize`: text, JSONL or Parquet files (a path or a list) into token files."""
    inputs = [inputs] if isinstance(inputs, (str, bytes)) or not hasattr(inputs, "__iter__") else inputs
    run("tokenize", *[str(i) for i in inputs], *_flags(dict(tokenizer=tokenizer, out_dir=out_dir, **options)))


def plan(model, **options):
    """`smelt plan`: prints the memory plan of training `model` with these options."""
    run("plan", *_flags(dict(model=model, **options)))


def generate(prompt, *, model=None, checkpoint=None, **options):
    """`smelt sample`'s text for `prompt` (the prompt, then what the model writes)."""
    flags = _flags(dict(model=model, checkpoint=checkpoint, prompt=prompt, **options))
    return _smelt.generate(flags)
