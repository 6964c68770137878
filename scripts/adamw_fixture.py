"""A reference for smelt's AdamW from PyTorch's: torch.optim.AdamW after torch's global-norm
clipping, in float64, on two small tensors over three steps.

    python3 scripts/adamw_fixture.py    # (re)writes tests/fixtures/adamw.safetensors

The file holds the starting weights `<name>` (values an f32 holds exactly, which smelt starts
from), the gradients `grad.<step>.<name>`, and after the last step the weights
`after.<name>` and the moments `exp_avg.<name>` and `exp_avg_sq.<name>`, all float64. Its
metadata has the hyper-parameters and which tensors decay. The first step's gradients have a
global norm above the clip and the others below, so both sides of clipping run; `matrix`
decays and `bias` does not, as in a model's weights and biases.

Needs torch and safetensors.
"""
import os

import torch
from safetensors.torch import save_file

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures",
                    "adamw.safetensors")
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=1.0)
# Each step's global gradient norm: the first is clipped, the others are not.
NORMS = [4.0, 0.5, 0.25]
SHAPES = {"matrix": (4, 8), "bias": (8,)}
DECAYS = {"matrix": True, "bias": False}


def f32_exact(t):
    """The values rounded to f32, held in f64: what smelt's f32 tensors start from."""
    return t.to(torch.float32).to(torch.float64)


def main():
    gen = torch.Generator().manual_seed(7)
    weights = {n: f32_exact(torch.randn(s, generator=gen, dtype=torch.float64))
               for n, s in SHAPES.items()}
    params = {n: torch.nn.Parameter(w.clone()) for n, w in weights.items()}
    groups = [{"params": [params[n]], "weight_decay": HYPER["weight_decay"] if DECAYS[n] else 0.0}
              for n in SHAPES]
    opt = torch.optim.AdamW(groups, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                            eps=HYPER["eps"])
    out = dict(weights)
    for step, norm in enumerate(NORMS, start=1):
        grads = {n: torch.randn(s, generator=gen, dtype=torch.float64) for n, s in SHAPES.items()}
        total = torch.sqrt(sum((g * g).sum() for g in grads.values()))
        for n, g in grads.items():
            grads[n] = f32_exact(g * (norm / total))
            out[f"grad.{step}.{n}"] = grads[n]
            params[n].grad = grads[n].clone()
        torch.nn.utils.clip_grad_norm_(list(params.values()), HYPER["grad_clip"])
        opt.step()
    for n, p in params.items():
        state = opt.state[p]
        out[f"after.{n}"] = p.detach().clone()
        out[f"exp_avg.{n}"] = state["exp_avg"].clone()
        out[f"exp_avg_sq.{n}"] = state["exp_avg_sq"].clone()
    metadata = {k: repr(v) for k, v in HYPER.items()}
    metadata["steps"] = str(len(NORMS))
    metadata["decays"] = ",".join(n for n in SHAPES if DECAYS[n])
    metadata["torch"] = torch.__version__
    save_file({k: v.contiguous() for k, v in out.items()}, PATH, metadata=metadata)
    print(f"wrote {PATH}")


if __name__ == "__main__":
    main()
