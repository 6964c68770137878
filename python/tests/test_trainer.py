"""The Python package against `smelt train` on the CPU: the same flags, data and seed give
the same losses, bit for bit, on one rank and on two; bad arguments raise SmeltError with
smelt's message; checkpoints, export and generation work from Python.

Needs the package installed and `SMELT_BIN`, the smelt binary to compare with."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import smelt

SMELT = os.environ["SMELT_BIN"]
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny byte-level Llama's config and a token file of text bytes."""
    root = tmp_path_factory.mktemp("smelt")
    model = root / "tiny"
    model.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False,
    }
    (model / "config.json").write_text(json.dumps(config))
    text = (Path(smelt.__file__).read_bytes() * 4)[:6000]
    header = bytearray(1024)
    header[0:8] = b"BIN.TOK\n"
    struct.pack_into("<5i", header, 8, 2, 4, len(text), 256, 0)
    data = root / "train.bin"
    data.write_bytes(bytes(header) + np.frombuffer(text, np.uint8).astype("<i4").tobytes())
    return root, model, data


FLAGS = ["--batch-size", "2", "--seq-len", "16", "--steps", "5", "--lr", "1e-2", "--warmup",
         "2", "--grad-accumulation", "2", "--device", "cpu"]


def cli_losses(root, model, data, name, extra=()):
    log = root / f"{name}.jsonl"
    subprocess.run([SMELT, "train", "--model", str(model), "--from-scratch", "--train-file",
                    str(data), "--log-file", str(log), *FLAGS, *extra], check=True,
                   capture_output=True)
    return [e["loss"] for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "step"]


@pytest.mark.parametrize("extra", [(), ("--gpus", "2", "--zero-level", "1")])
def test_the_python_loop_gives_smelt_trains_losses_bit_for_bit(files, extra):
    root, model, data = files
    name = "cli" + "".join(extra).replace("-", "")
    want = cli_losses(root, model, data, name, extra)
    out = subprocess.run([sys.executable, str(EXAMPLES / "train.py"), "--model", str(model),
                          "--from-scratch", "--train-file", str(data), *FLAGS, *extra],
                         check=True, capture_output=True, text=True).stdout
    # The run's own console lines come first; the script's JSON lines start with "{".
    got = [json.loads(line)["loss"] for line in out.splitlines() if line.startswith("{")]
    assert got == want


def trainer(model, **options):
    defaults = dict(from_scratch=True, batch_size=2, seq_len=16, steps=5, device="cpu")
    return smelt.Trainer(str(model), **{**defaults, **options})


def test_bad_arguments_raise_smelts_message(files):
    _, model, _ = files
    with pytest.raises(smelt.SmeltError, match="--batch-size must be at least 1"):
        trainer(model, batch_size=0)
    with pytest.raises(smelt.SmeltError, match="--lr NaN: must be a finite number"):
        trainer(model, lr=float("nan"))
    with pytest.raises(smelt.SmeltError, match="unexpected argument '--no-such-flag'"):
        trainer(model, no_such_flag=3)
    with trainer(model) as t:
        with pytest.raises(smelt.SmeltError, match="give 2 sequences of 16"):
            t.step(np.zeros((3, 16), np.int32))
        with pytest.raises(smelt.SmeltError, match="300 is not a token id"):
            t.step(np.full((2, 16), 300))
        with pytest.raises(smelt.SmeltError, match="-5 is neither a token id"):
            t.step(np.zeros((2, 16), np.int64), np.full((2, 16), -5))
        with pytest.raises(smelt.SmeltError, match="an update needs a step's gradients"):
            t.update(1e-3)


def test_checkpoints_export_and_generate(files, tmp_path):
    _, model, data = files
    loader = smelt.DataLoader(data, 16)
    ckpt = tmp_path / "ckpt"
    with trainer(model, checkpoint_dir=ckpt) as t:
        assert t.memory()["total"] > 0
        for _ in range(2):
            t.step(*loader.next(t.sequences_per_step))
            result = t.update()
        assert result["step"] == 2 and result["skipped"] is None
        assert t.metrics() == result
        saved = t.save_checkpoint()
        assert Path(saved).name == "step-00000002"
        loss, trained = t.eval(*loader.next(t.sequences_per_eval))
        assert np.isfinite(loss) and trained > 0
        # The next token of each, without targets, and a mask that trains nothing.
        tokens, _ = loader.next(2)
        t.step(tokens, mask=np.zeros_like(tokens))
        assert t.update()["loss"] == 0.0
        t.export(tmp_path / "out")
        with pytest.raises(smelt.SmeltError, match="not empty|already holds"):
            t.export(tmp_path / "out")
        continued = t.load_checkpoint()
    with continued:
        assert continued.steps_done == 2
        continued.step(*loader.next(continued.sequences_per_step))
        result = continued.update()
        assert result["step"] == 3 and result["lr"] == continued.scheduled_lr(2)
    assert (tmp_path / "out" / "model.safetensors").exists()
    text = smelt.generate("fn ", model=tmp_path / "out", max_new_tokens=4, device="cpu",
                          temperature=0)
    assert text.startswith("fn ")


def test_a_nan_step_is_skipped_from_python(files):
    _, model, data = files
    loader = smelt.DataLoader(data, 16)
    with trainer(model, debug_inject=["nan-loss@1"]) as t:
        t.step(*loader.next(t.sequences_per_step))
        assert "the loss is NaN" in t.update(1e-3)["skipped"]
