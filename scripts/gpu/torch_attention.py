"""PyTorch's causal attention on the shapes of tests/cuda_attention.rs, for comparison with
smelt's kernels: forward and backward of F.scaled_dot_product_attention (bf16, grouped-query
heads expanded as transformers' sdpa path does, and that copy timed too), timed with CUDA events, per backend that
this PyTorch build offers (flash, cuDNN).
Usage: python3 torch_attention.py
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuda_timing import ms_per_call

SHAPES = [  # model, batch, q heads, kv heads, head dim; seq 1024
    ("qwen2.5-0.5b", 32, 14, 2, 64),
    ("qwen2.5-1.5b", 16, 12, 2, 128),
    ("qwen2.5-3b", 8, 16, 2, 128),
]
SEQ = 1024


def main():
    for model, b, hq, hkv, d in SHAPES:
        flops = 4 * SEQ * (SEQ + 1) / 2 * b * hq * d
        q = torch.randn(b, hq, SEQ, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kv = [torch.randn(b, hkv, SEQ, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
        dout = torch.randn(b, hq, SEQ, d, device="cuda", dtype=torch.bfloat16)
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            with sdpa_kernel(backend):
                def forward():
                    k, v = (t.repeat_interleave(hq // hkv, dim=1) for t in kv)
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

                try:
                    fwd = ms_per_call(forward, iters=10, warmup=1)
                    both = ms_per_call(lambda: forward().backward(dout), iters=10, warmup=1)
                except RuntimeError as e:
                    print(f"[figure] torch {backend.name} {model}: unavailable ({str(e).splitlines()[0]})")
                    continue
            bwd = both - fwd
            print(f"[figure] torch {backend.name} {model} B{b} H{hq}/{hkv} D{d}: forward {fwd:.3f} ms "
                  f"({flops / fwd * 1e-9:.0f} TFLOP/s), backward {bwd:.3f} ms ({2.5 * flops / bwd * 1e-9:.0f} TFLOP/s)")


if __name__ == "__main__":
    main()
