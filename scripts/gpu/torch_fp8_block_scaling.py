"""cuBLASLt's DeepSeek-style block-scaled FP8 matmuls against per-tensor scaling, through
torch._scaled_mm, at the FP8 matmul shapes of smelt's Qwen2.5-0.5B (batch 32) and 1.5B
(batch 16) steps. Block scales would let each producer quantize its own output (a block's
abs-max is local), which per-tensor current scaling cannot; this measures what the matmuls
would cost in exchange.

    python3 scripts/gpu/torch_fp8_block_scaling.py

Prints TFLOP/s per shape: per-tensor, 1x128 activations with 128x128 weights, and 1x128 on
both sides (what a weight gradient, both operands activations, would take).
"""
import torch
import torch.nn.functional as F

from cuda_timing import ms_per_call

BLOCK_1X128 = getattr(getattr(F, "ScalingType", None), "BlockWise1x128", None)

E4M3 = torch.float8_e4m3fn
SHAPES = {  # name: (M, N, K) of out[M, N] = a[M, K] · b[N, K]ᵀ
    "0.5B fwd gate/up": (32768, 9728, 896),
    "0.5B fwd down": (32768, 896, 4864),
    "0.5B fwd qkv": (32768, 1152, 896),
    "0.5B fwd out": (32768, 896, 896),
    "0.5B dgrad gate/up": (32768, 896, 9728),
    "0.5B dgrad down": (32768, 4864, 896),
    "0.5B wgrad gate/up": (9728, 896, 32768),
    "0.5B wgrad down": (896, 4864, 32768),
    "0.5B wgrad qkv": (1152, 896, 32768),
    "1.5B fwd gate/up": (16384, 17920, 1536),
    "1.5B fwd down": (16384, 1536, 8960),
    "1.5B wgrad gate/up": (17920, 1536, 16384),
}


def first_that_runs(flop, candidates):
    """TFLOP/s of the first candidate torch accepts, else its last error."""
    error = ""
    for fn in candidates:
        try:
            return f"{flop / ms_per_call(fn) / 1e9:.0f}"
        except Exception as e:  # torch rejects a scale layout as a RuntimeError or ValueError
            error = str(e).splitlines()[0][:30]
    return "err: " + error


def scales(*shape):
    """Scales in [0.5, 1.5): outer-dim-major, the layout cuBLASLt's block scaling reads."""
    return torch.rand(*reversed(shape), device="cuda").add_(0.5).t()


def main():
    print(f"{'shape':<20}{'M, N, K':>22}{'per-tensor':>12}{'1x128/128x128':>15}{'1x128/1x128':>13}")
    one = torch.ones((), device="cuda")
    for name, (m, n, k) in SHAPES.items():
        a = torch.randn(m, k, device="cuda").mul_(0.5).to(E4M3)
        b = torch.randn(n, k, device="cuda").mul_(0.5).to(E4M3)
        flop = 2 * m * n * k
        mm = lambda sa, sb: (lambda: torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.bfloat16))
        # torch's newer entry point, which takes the recipes by name instead of by shape.
        mm_v2 = lambda sa, ra, sb, rb: (lambda: F.scaled_mm(a, b.t(), sa, ra, sb, rb,
                                                              output_dtype=torch.bfloat16))
        kb, nb = k // 128, -(-n // 128)
        padded = -(-kb // 4) * 4
        cells = [
            first_that_runs(flop, [mm(one, one)]),
            # The 128x128 weight scales, with their K blocks padded to a multiple of 4 or not.
            first_that_runs(flop, [mm(scales(m, kb), scales(padded, nb)),
                                   mm(scales(m, kb), scales(kb, nb))]),
            first_that_runs(flop, [mm(scales(m, kb), scales(n, kb)),
                                   mm_v2(scales(m, kb), BLOCK_1X128, scales(n, kb), BLOCK_1X128)]),
        ]
        print(f"{name:<20}{str((m, n, k)):>22}{cells[0]:>12}{cells[1]:>15}{cells[2]:>13}",
              flush=True)


if __name__ == "__main__":
    main()
