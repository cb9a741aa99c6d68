"""Backends: the same forward pass, run faster, applied to a loaded model from outside (`--backend`).

model.py is the reference: plain PyTorch, the pass a reader steps through, and the default. A backend
takes a loaded model and returns one that runs its decoding passes another way, with the same
`hidden_states` / `logits` / `config` (everything else reaches the model it wraps), as gpt-fast
applies quantization and torch.compile around its plain model. The decoding loop never knows which
one it has. Each backend's module is imported only when it is asked for: numba, LLVM IR and
torch.compile stay out of a reference run.

- `fused` (cpu_fused.py, CPU, float32 or bfloat16 weights): each pass one loop compiled by numba, with
  the matrix-vector kernels of cpu_kernels.py (and cpu_bfloat16.py's bfloat16 instruction). Every row is
  computed as it would be alone, so every lossless method's greedy output is vanilla's bit for bit.
- `compiled` (cpu_compiled.py, CPU): each pass compiled by torch.compile, as fixed-shape passes.
- `cuda-graphs` (cuda_graphs.py, GPU): each pass replayed as a recorded CUDA graph.

    model = backends.apply(load_checkpoint(folder), "fused", max_rows=64)
"""

import importlib

import torch

from errors import UserError

BACKENDS = {  # --backend: (its module, what it is for --help)
    "reference": (None, "model.py's pass as written, in plain PyTorch: the one to read and step through"),
    "fused": ("backends.cpu_fused", "on a CPU: each pass one loop compiled by numba (cpu_fused.py), no dispatch "
              "between its operations, and every method's tokens vanilla's bit for bit; with --dtype bfloat16 the "
              "weights are read as bfloat16 (half the bytes) and multiplied by the CPU's bfloat16 instruction where "
              "it has AVX512-BF16 (each product's input rounded to bfloat16), everything else in float32"),
    "compiled": ("backends.cpu_compiled", "on a CPU: each pass compiled by torch.compile (cpu_compiled.py), its "
                 "small operations fused: about a minute per tree size the first time, then faster passes"),
    "cuda-graphs": ("backends.cuda_graphs", "with --device cuda: each pass replayed as a recorded CUDA graph "
                    "(cuda_graphs.py), one launch instead of hundreds"),
}


def check(name: str, device: torch.device, dtypes: list[torch.dtype]) -> None:
    """Refuse a backend that cannot run on `device` in one of `dtypes`, before any model is loaded."""
    module = backend_module(name)
    if module is not None:
        for dtype in dtypes:
            module.check(device, dtype)


def apply(model, name: str, max_rows: int):
    """`model` with its decoding passes run by backend `name`; `max_rows`: the most inputs a pass of
    the method it will run has (1: plain decoding), for backends that prepare kernels per row count."""
    module = backend_module(name)
    return model if module is None else module.apply(model, max_rows)


def draft_head(model, head):
    """EAGLE's draft head (methods/eagle.py) run by the backend `model` was given where it has a way to
    (the fused loops: cpu_fused.FusedDraftHead), else as it is."""
    runner = getattr(model, "draft_head", None)
    return head if runner is None else runner(head)


def backend_module(name: str):
    if name not in BACKENDS:
        raise UserError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    module = BACKENDS[name][0]
    return None if module is None else importlib.import_module(module)
