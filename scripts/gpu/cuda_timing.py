"""Timing for the torch scripts beside this one: CUDA events around repeated calls, after a
few untimed ones (kernel selection, clocks and caches warm)."""
import torch


def ms_per_call(fn, iters=20, warmup=3):
    """Mean milliseconds of one call of `fn` over `iters` calls."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters
