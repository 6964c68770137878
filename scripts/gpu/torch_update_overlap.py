"""Would the optimizer hide behind the next step's forward? Runs, with torch, a chain of bf16
matmuls of the 0.5B gate/up shape on a high-priority stream and a memory-bound update of
AdamW's traffic at 0.5B (bf16 weights, gradients and moments: 8 bytes read, 6 written per
parameter) on a low-priority stream: each alone, then both at once.

    python3 scripts/gpu/torch_update_overlap.py

If the pair took about the longer of the two, overlapping smelt's update with the forward
would pay; if it takes their sum, the matmuls leave no room for it.
"""
import time

import torch

PARAMS = 494_000_000


def main():
    x = torch.randn(32768, 896, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4864, 896, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(32768, 4864, device="cuda", dtype=torch.bfloat16)
    p, g, m, v = (torch.randn(PARAMS, device="cuda", dtype=torch.bfloat16) for _ in range(4))

    def matmuls():
        for _ in range(24):
            torch.mm(x, w.t(), out=y)

    def update():
        m.mul_(0.9).add_(g, alpha=0.1)
        v.mul_(0.95).addcmul_(g, g, value=0.05)
        p.addcdiv_(m, v.abs().add_(1e-8), value=-1e-4)

    high, low = torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=0)

    def both():
        with torch.cuda.stream(low):
            update()
        with torch.cuda.stream(high):
            matmuls()

    def ms(fn, rounds=5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(rounds):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / rounds * 1e3

    for fn in (matmuls, update, both):  # warm up: cuBLAS handles, allocator, clocks
        ms(fn, rounds=2)
    for round in (1, 2):
        a, b, ab = ms(matmuls), ms(update), ms(both)
        print(f"round {round}: matmuls {a:.2f} ms, update {b:.2f} ms, both at once {ab:.2f} ms "
              f"(sum {a + b:.2f}, hidden {a + b - ab:.2f})", flush=True)


if __name__ == "__main__":
    main()
