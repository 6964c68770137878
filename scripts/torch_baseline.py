"""The PyTorch baseline that smelt's throughput is compared with: the model built by
transformers' own Llama/Qwen2/Qwen3 modules from the same config smelt trains
(`smelt config --model NAME`), bf16 weights, SDPA attention, torch.compile, fused AdamW
(whose moments take the weights' dtype, bf16), optionally activation checkpointing, on
random tokens. It prints the median step's figures as one `RESULT {json}` line, which
scripts/gpu/bench.sh reads.

    python3 scripts/torch_baseline.py MODEL BATCH SEQ [--compile] [--ckpt]
        [--grad-accumulation K] [--steps N] [--smelt PATH] [--peak FLOPS]

MODEL is a built-in architecture of smelt's, or a HF model directory (its config.json).
"""

import argparse
import json
import os
import subprocess
import time

import torch


def smelt_config(model, smelt):
    """The HF config.json of `model` (a directory's, or smelt's of a built-in architecture)."""
    if os.path.isdir(model):
        with open(os.path.join(model, "config.json")) as f:
            return json.load(f)
    return json.loads(subprocess.run([smelt, "config", "--model", model], check=True,
                                     capture_output=True, text=True).stdout)


def hf_config(model, smelt, seq):
    """The transformers config of `model`, from smelt's own reading of it."""
    raw = smelt_config(model, smelt)
    from transformers import AutoConfig

    raw = {k: v for k, v in raw.items() if k not in ("architectures", "torch_dtype")}
    raw["max_position_embeddings"] = max(raw.get("max_position_embeddings", 0), seq)
    return AutoConfig.for_model(**raw)


def training_flops_per_token(cfg, seq):
    """6 × the matmul parameters, plus attention's 12 · layers · seq · heads · head_dim (causal:
    half of 2 × 2 × 3), plus the LM head: the count MFU is measured by, as smelt counts it."""
    d, f, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    hd = getattr(cfg, "head_dim", None) or d // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    block = d * (q + 2 * kv) + q * d + 3 * d * f
    attention = 6 * seq * q  # per layer and token: QKᵀ and PV, forward and backward, causal
    return 6 * layers * block + layers * attention + 6 * d * cfg.vocab_size


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("batch", type=int)
    p.add_argument("seq", type=int)
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--ckpt", action="store_true", help="activation checkpointing per block")
    p.add_argument("--grad-accumulation", type=int, default=1)
    p.add_argument("--steps", type=int, default=12, help="optimizer steps; the first 3 warm up")
    p.add_argument("--smelt", default=os.environ.get("SMELT", ".gpu/smelt"))
    p.add_argument("--peak", type=float, default=989.4e12, help="dense bf16 FLOP/s, for MFU")
    a = p.parse_args()

    cfg = hf_config(a.model, a.smelt, a.seq)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")
    if a.ckpt:
        model.gradient_checkpointing_enable()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    forward = torch.compile(model) if a.compile else model

    def step():
        for _ in range(a.grad_accumulation):
            x = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), device="cuda")
            loss = forward(input_ids=x, labels=x).loss / a.grad_accumulation
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(a.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    timed = sorted(seconds[3:])
    median = timed[len(timed) // 2]
    tokens = a.batch * a.seq * a.grad_accumulation
    flops = training_flops_per_token(cfg, a.seq) * tokens / median
    result = dict(
        model=a.model, batch=a.batch, seq=a.seq, grad_accumulation=a.grad_accumulation,
        compile=a.compile, ckpt=a.ckpt, params=sum(t.numel() for t in model.parameters()),
        step_s=round(median, 4), tok_s=round(tokens / median), mfu=round(flops / a.peak, 3),
        peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1),
        loss=round(loss.item() * a.grad_accumulation, 3),
    )
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
