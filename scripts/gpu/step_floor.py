"""How fast could each row of `bench.sh` run on this GPU? A floor under the step, from parts
measured in the same call, to hold each target against:

- every matmul of the step, timed alone through torch (cuBLASLt) at its shape and layout
  (the forward x·wᵀ, the input gradient dy·w, the weight gradient dyᵀ·x; FP8 rows as smelt
  runs them, e4m3 or e5m2 both K-major, the LM head in bf16), with SwiGLU's passes taken as
  free (smelt fuses them into the matmuls);
- attention at smelt's own time in that row's step (`--op-times`; faster than PyTorch's flash
  and cuDNN kernels at these shapes, docs/performance.md, "What bounds it");
- AdamW's 14 bytes a parameter (bf16 weights, gradients and moments) at the measured copy
  rate: with gradient clipping it cannot start before the backward's last gradient, and it
  does not overlap matmuls (scripts/gpu/torch_update_overlap.py measures why).

That sum is the hard floor. The soft floor adds the passes the step makes over its other
tensors, each at the copy rate and none of them fused further: the loss over the logits
(read, and the gradient written), the residual adds and RMSNorms, RoPE, the gradient norm's
read of every gradient, and in FP8 the quantization of each matmul operand (bf16 read, both
FP8 layouts written).

Both floors are generous: short bursts of one shape run at higher clocks than a whole step,
which holds the GPU at its power limit (docs/performance.md).

    python3 scripts/gpu/step_floor.py [OUT]   # after bench.sh, on its OUT (default .gpu/logs)

Reads OUT's bench-rows.txt and each row's JSON, and each model's config as smelt reads it
(`smelt config --model NAME`, SMELT default .gpu/smelt, or a directory's config.json);
prints a table and writes OUT/step-floor.txt.
"""
import json
import os
import sys

import torch

from cuda_timing import ms_per_call

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from torch_baseline import smelt_config  # noqa: E402  (the baseline's reading, so both agree)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


_timed = {}


def matmul_ms(m, n, k, kind, fp8):
    """Milliseconds of one product out[m, n] over k, alone (`product`)."""
    key = (m, n, k, kind, fp8)
    if key not in _timed:
        _timed[key] = ms_per_call(product(m, n, k, kind, fp8), iters=10)
        torch.cuda.empty_cache()  # the operands are gone: the next shape has the memory
    return _timed[key]


def product(m, n, k, kind, fp8):
    """A call of out[m, n] over k on random operands. kind: 'fwd' (a[m,k]·b[n,k]ᵀ), 'dgrad'
    (a[m,k]·b[k,n]) or 'wgrad' (a[k,m]ᵀ·b[k,n]); FP8 takes every kind K-major (smelt's
    transposed copies), the gradient (a, outside the forward) in e5m2, with fast accumulation
    in the forward only."""
    if fp8:
        a = torch.randn(m, k, device="cuda").mul_(0.5).to(E4M3 if kind == "fwd" else E5M2)
        b = torch.randn(n, k, device="cuda").mul_(0.5).to(E4M3)
        one = torch.ones((), device="cuda")
        return lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16,
                                        use_fast_accum=kind == "fwd")
    a = torch.randn(*((k, m) if kind == "wgrad" else (m, k)), device="cuda", dtype=torch.bfloat16)
    b = torch.randn(*((n, k) if kind == "fwd" else (k, n)), device="cuda", dtype=torch.bfloat16)
    a_op = a.t() if kind == "wgrad" else a
    b_op = b.t() if kind == "fwd" else b
    return lambda: torch.mm(a_op, b_op)


def copy_bytes_per_ms():
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / ms_per_call(lambda: y.copy_(x), iters=20)


def floors(config, fp8, tokens, attention_ms, copy_rate):
    """(hard floor, soft floor, their parts) in ms for one step of `tokens` tokens of the model
    of HF `config`."""
    d, f, layers, vocab = (config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
    head_dim = config.get("head_dim") or d // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    tie = config.get("tie_word_embeddings", False)
    linears = [(q + 2 * kv, d), (d, q), (2 * f, d), (d, f)]  # (out, in): qkv, o, gate/up, down
    block = sum(matmul_ms(tokens, o, i, "fwd", fp8) + matmul_ms(tokens, i, o, "dgrad", fp8)
                + matmul_ms(o, i, tokens, "wgrad", fp8) for o, i in linears)
    head = (matmul_ms(tokens, vocab, d, "fwd", False) + matmul_ms(tokens, d, vocab, "dgrad", False)
            + matmul_ms(vocab, d, tokens, "wgrad", False))
    bias = q + 2 * kv if config.get("model_type") == "qwen2" else 0
    params = vocab * d * (1 if tie else 2) + d + layers * (sum(o * i for o, i in linears) + bias + 2 * d)
    parts = {
        "matmuls": layers * block + head,
        "attention": attention_ms,
        "adamw": 14 * params / copy_rate,
    }
    hard = sum(parts.values())
    norm_bytes = (6 if fp8 else 8) + 8  # forward (FP8 keeps no normed copy) and backward
    passes = {
        "loss": 2 * 2 * tokens * vocab,
        "norms": layers * 2 * norm_bytes * tokens * d,
        "rope": 2 * 4 * layers * tokens * (q + kv),
        "grad norm": 2 * params,
    }
    if fp8:  # each operand: bf16 read, both layouts written
        operands = d + q + d + f + (q + 2 * kv) + d + 2 * f + d  # inputs, then output gradients
        passes["quantize"] = 4 * layers * (tokens * operands + sum(o * i for o, i in linears))
    parts.update({k: v / copy_rate for k, v in passes.items()})
    return hard, sum(parts.values()), parts


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else ".gpu/logs"
    copy_rate = copy_bytes_per_ms()
    lines = [f"copy rate {copy_rate / 1e6:.0f} GB/s (read + written)", ""]
    head = ("row", "target", "smelt", "hard floor", "soft floor", "target step", "parts of the soft floor, ms")
    rows = []
    for line in open(os.path.join(out, "bench-rows.txt")):
        model, dtype, _batch, _seq, target, name, *_extra = line.split()
        text = open(os.path.join(out, name + ".json")).read().strip()
        if target == "-" or not text:
            continue
        r = json.loads(text.splitlines()[-1])
        ops = {o["op"]: o["ms"] for o in r.get("ops", [])}
        if "attention_backward" not in ops:
            continue  # a row without --op-times has no attention time to go by
        tokens = r["batch"] * r["seq"]
        config = smelt_config(model, os.environ.get("SMELT", ".gpu/smelt"))
        hard, soft, parts = floors(config, dtype == "fp8", tokens,
                                   ops["attention_forward"] + ops["attention_backward"], copy_rate)
        tok_s = lambda ms: f"{tokens / ms * 1e3:,.0f} tok/s ({ms:.1f} ms)"
        rows.append((f"{model} {dtype} b{r['batch']}", f"{int(target):,}", tok_s(r["step_ms"]), tok_s(hard),
                     tok_s(soft), f"{tokens / int(target) * 1e3:.1f} ms",
                     ", ".join(f"{k} {v:.1f}" for k, v in parts.items())))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines += ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in [head] + rows]
    lines += ["", "matmuls alone (ms, TFLOP/s):"]
    lines += [f"  {'fp8' if fp8 else 'bf16'} {kind:<5} {m}x{n}x{k}: {ms:.3f} ({2 * m * n * k / ms / 1e9:.0f})"
              for (m, n, k, kind, fp8), ms in _timed.items()]
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(out, "step-floor.txt"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
