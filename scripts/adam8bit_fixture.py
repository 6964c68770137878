"""A reference for smelt's 8-bit Adam moments from bitsandbytes: its quantization maps, its
blockwise AdamW8bit as its algorithm defines it, and its CUDA optimizer's own states.

    python3 scripts/adam8bit_fixture.py [OUT]   # (re)writes tests/fixtures/adam8bit.safetensors

Needs torch, safetensors and bitsandbytes; with a CUDA GPU the file also holds what
bitsandbytes' own kernel (`bnb.optim.AdamW8bit`) wrote, else only the reference.

The file holds:
- `map.signed` and `map.unsigned`: `bitsandbytes.functional.create_dynamic_map(signed)`, the
  first and second moments' code values (f32);
- `param`: the starting weights, a (24, 300) matrix (7,200 elements: 28 blocks of 256 and a
  partial one, above bitsandbytes' min_8bit_size of 4,096), and `grad.<step>` its gradients;
- `ref.<step>.{param,m,v,m_absmax,v_absmax}`: the state after each step of the update as
  bitsandbytes' algorithm has it (its pure-PyTorch reference, written out below): decode each
  block as map[code] · absmax, step the moments and the weight in f32, take each block's new
  abs-max (1 for an all-zero block) and encode each value as the code nearest to value /
  absmax (argmin, so ties go to the lower code);
- `bnb.<step>.{...}`: the same from bitsandbytes' CUDA kernel, when there is a GPU.
Codes are u8, everything else f32. The metadata has the hyper-parameters.
"""
import math
import os
import sys

import torch
from safetensors.torch import save_file

import bitsandbytes as bnb
import bitsandbytes.functional as F

PATH = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "adam8bit.safetensors")
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
STEPS = 4
SHAPE = (24, 300)
BLOCK = 256


def dequantize(codes, absmax, qmap):
    values = qmap[codes.long()].flatten()
    scale = absmax.repeat_interleave(BLOCK)[: values.numel()]
    return (values * scale).view(codes.shape)


def quantize(x, qmap):
    flat = x.flatten()
    pad = (-flat.numel()) % BLOCK
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, BLOCK)
    absmax = blocks.abs().max(dim=1).values
    absmax[absmax == 0] = 1.0
    scaled = blocks / absmax[:, None]
    codes = (scaled[..., None] - qmap).abs().argmin(dim=-1).to(torch.uint8)
    return codes.flatten()[: flat.numel()].view(x.shape), absmax


def reference_step(state, grad, step, maps):
    """One step of bitsandbytes' blockwise 8-bit AdamW, on the CPU in f32."""
    h = HYPER
    m = dequantize(state["m"], state["m_absmax"], maps[0])
    v = dequantize(state["v"], state["v_absmax"], maps[1])
    m = m * h["beta1"] + grad * (1 - h["beta1"])
    v = v * h["beta2"] + grad * grad * (1 - h["beta2"])
    denom = v.sqrt() / math.sqrt(1 - h["beta2"] ** step) + h["eps"]
    p = state["param"] * (1 - h["lr"] * h["weight_decay"])
    p = p - (h["lr"] / (1 - h["beta1"] ** step)) * m / denom
    out = {"param": p}
    out["m"], out["m_absmax"] = quantize(m, maps[0])
    out["v"], out["v_absmax"] = quantize(v, maps[1])
    return out


def main():
    gen = torch.Generator().manual_seed(11)
    maps = (F.create_dynamic_map(signed=True), F.create_dynamic_map(signed=False))
    param = torch.randn(SHAPE, generator=gen)
    # Gradients of a few scales, so that blocks differ in their abs-max by decades.
    grads = [torch.randn(SHAPE, generator=gen) * torch.logspace(-4, 0, SHAPE[1])
             for _ in range(STEPS)]
    out = {"map.signed": maps[0], "map.unsigned": maps[1], "param": param.clone()}
    blocks = math.ceil(param.numel() / BLOCK)
    state = {"param": param.clone(), "m": torch.zeros(SHAPE, dtype=torch.uint8),
             "v": torch.zeros(SHAPE, dtype=torch.uint8),
             "m_absmax": torch.zeros(blocks), "v_absmax": torch.zeros(blocks)}
    for step, grad in enumerate(grads, start=1):
        out[f"grad.{step}"] = grad
        state = reference_step(state, grad, step, maps)
        for k, t in state.items():
            out[f"ref.{step}.{k}"] = t.clone()
    metadata = {k: repr(v) for k, v in HYPER.items()}
    metadata.update(steps=str(STEPS), torch=torch.__version__, bitsandbytes=bnb.__version__)
    if torch.cuda.is_available():
        p = torch.nn.Parameter(param.clone().cuda())
        opt = bnb.optim.AdamW8bit([p], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                                  eps=HYPER["eps"], weight_decay=HYPER["weight_decay"])
        for step, grad in enumerate(grads, start=1):
            p.grad = grad.cuda()
            opt.step()
            s = opt.state[p]
            got = {"param": p.detach(), "m": s["state1"], "v": s["state2"],
                   "m_absmax": s["absmax1"], "v_absmax": s["absmax2"]}
            for k, t in got.items():
                out[f"bnb.{step}.{k}"] = t.detach().cpu().clone()
        metadata["gpu"] = torch.cuda.get_device_name()
    save_file({k: v.contiguous() for k, v in out.items()}, PATH, metadata=metadata)
    print(f"wrote {PATH}")


if __name__ == "__main__":
    main()
