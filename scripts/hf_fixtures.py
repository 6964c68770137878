"""Reference fixtures from HF transformers, for smelt's CPU backend to match.

    python3 scripts/hf_fixtures.py                      # (re)writes tests/fixtures/hf/<name>/
    python3 scripts/hf_fixtures.py --only mistral       # writes only the fixtures named
    python3 scripts/hf_fixtures.py --check-export BIN   # exports each fixture with `BIN export`,
                                                        # loads the result in transformers and
                                                        # writes tests/fixtures/hf/export_check.json

Each fixture directory is a HF model directory (config.json + model.safetensors) of a tiny
random model, plus `reference.safetensors`: a batch (`tokens`, `targets`, where targets[i] is
the token position i predicts and -100 is ignored), the `logits`, the mean `loss`, and
`grad.<hf tensor name>` for every parameter. The reference runs in float64, so it carries no
rounding error of its own at the precision the tests ask for.

Needs torch, transformers and safetensors (the GPU machine has them; so does a plain
`pip install torch transformers safetensors`).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "hf")
BATCH, SEQ = 2, 16

COMMON = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=12, vocab_size=97, rms_norm_eps=1e-5,
              max_position_embeddings=64, bos_token_id=0, eos_token_id=[1, 2])

# name: (config, dtype the weights are stored in)
FIXTURES = {
    # Llama 3.1 style: untied head, GQA, head_dim 12 != 32/4, llama3 RoPE scaling whose
    # wavelength thresholds fall inside the head's frequencies, so all three branches run.
    "llama_untied": (LlamaConfig(**COMMON, tie_word_embeddings=False, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}), torch.float32),
    "llama_tied": (LlamaConfig(**COMMON, tie_word_embeddings=True,
                               rope_parameters={"rope_type": "default", "rope_theta": 500000.0}), torch.float32),
    "qwen2_untied": (Qwen2Config(**COMMON, tie_word_embeddings=False,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), torch.float32),
    # Stored in bf16, to exercise reading bf16 safetensors.
    "qwen2_tied": (Qwen2Config(**COMMON, tie_word_embeddings=True,
                               rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), torch.bfloat16),
    # Mistral 7B v0.3's layout: Llama's layers under Mistral's class, with no sliding window.
    "mistral": (MistralConfig(**COMMON, tie_word_embeddings=False, sliding_window=None,
                              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), torch.float32),
    # Qwen3: Llama's layers with an RMSNorm over each query and key head before RoPE.
    "qwen3": (Qwen3Config(**COMMON, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), torch.float32),
}


def randomize(model, seed):
    """Weights large enough that attention is far from uniform and every path matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.3 * noise)


def make_batch(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    tokens, targets = stream[:, :-1].clone(), stream[:, 1:].clone()
    targets[0, 3] = -100
    targets[1, -1] = -100
    return tokens, targets


def loss_of(model, tokens, targets):
    logits = model(input_ids=tokens).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
    return logits, loss


def write_fixtures(only):
    for i, (name, (config, store_dtype)) in enumerate(FIXTURES.items()):
        if only and name not in only:
            continue
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float64, attn_implementation="eager")
        randomize(model, 100 + i)
        out = os.path.join(ROOT, name)
        os.makedirs(out, exist_ok=True)
        model.to(store_dtype).save_pretrained(out, safe_serialization=True)
        # The reference runs on exactly the stored (possibly bf16-rounded) weights, reloaded so
        # that buffers such as RoPE's inv_freq are fresh float64, not round-tripped through bf16.
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64, attn_implementation="eager")
        tokens, targets = make_batch(config.vocab_size, 200 + i)
        logits, loss = loss_of(model, tokens, targets)
        loss.backward()
        ref = {
            "tokens": tokens.reshape(-1).to(torch.int32),
            "targets": targets.reshape(-1).to(torch.int32),
            "logits": logits.reshape(-1, config.vocab_size).detach().to(torch.float32),
            "loss": loss.detach().reshape(1),
        }
        # Tied models register the head under both names; the gradient lives on the embedding.
        for pname, p in model.named_parameters():
            ref["grad." + pname] = p.grad.detach().to(torch.float32)
        save_file(ref, os.path.join(out, "reference.safetensors"))
        print(f"{name}: loss {loss.item():.6f}, {sum(p.numel() for p in model.parameters())} parameters")


def check_export(smelt):
    """Round trip through `smelt export` and back into transformers."""
    results = {}
    for name in FIXTURES:
        src = os.path.join(ROOT, name)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([smelt, "export", "--model", src, "--out-dir", tmp], check=True)
            original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float64, attn_implementation="eager")
            exported = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float64, attn_implementation="eager")
            weight_diff = max((a - b).abs().max().item() for a, b in
                              zip(original.state_dict().values(), exported.state_dict().values()))
            ref = load_file(os.path.join(src, "reference.safetensors"))
            tokens = ref["tokens"].long().reshape(BATCH, SEQ)
            targets = ref["targets"].long().reshape(BATCH, SEQ)
            with torch.no_grad():
                _, loss = loss_of(exported, tokens, targets)
            # A window transformers would open by default but the original has not (Mistral's
            # 4096) changes nothing at SEQ tokens, so it is compared in the configs.
            window = [getattr(m.config, "sliding_window", None) if getattr(m.config, "use_sliding_window", True)
                      else None for m in (original, exported)]
            results[name] = {"reference_loss": ref["loss"].item(), "exported_loss": loss.item(),
                             "max_weight_diff": weight_diff,
                             "keys_match": list(original.state_dict()) == list(exported.state_dict()),
                             "sliding_window": window}
            print(name, results[name])
    with open(os.path.join(ROOT, "export_check.json"), "w") as f:
        json.dump({"transformers": transformers.__version__, "torch": torch.__version__, "models": results}, f, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--check-export", metavar="SMELT_BINARY")
    ap.add_argument("--only", nargs="+", choices=list(FIXTURES), help="fixtures to write (default: all)")
    args = ap.parse_args()
    if args.check_export:
        check_export(args.check_export)
    else:
        write_fixtures(args.only)
