"""Decoding passes compiled by torch.compile on a CPU (`--backend compiled`): a step without PyTorch's dispatch.

On a CPU one decoding pass of the default model spends ~18 ms reading its 538 MB of float32 weights
(the matrix products, cpu_kernels.py) and ~8-10 ms more in about 1,800 small tensor operations (some 60
per layer: norms, rotary, attention, the cache's writes), each a few microseconds of Python and
dispatch whatever its size (docs/results.md). torch.compile (TorchDynamo traces the pass, Inductor
writes C++ for it) fuses those small operations into a few loops and calls the matrix products as
cpu_kernels.py chooses them; the pass is the same computation, summed in another order, so float32
results agree to rounding. This is the route of PyTorch's gpt-fast (2023), taken on a CPU.

A compiled program has fixed shapes, so the passes are cuda_graphs.py's static passes (inputs padded to
a bucket, attention over a window of the buffer the model adopted, the same masks), with two changes:
- **the cache is written after the pass, not in it.** A compiled pass returns each layer's new keys
  and values and they go into the buffer in one operation per pass; each layer attends over a copy of
  its window with its own new K/V put in. Written in place inside, a slice of a buffer that is the
  program's input, Inductor copies the whole buffer at every layer's write: the pass was slower
  than not compiling (28.9 ms against 26.5, docs/constants.md).
- **the window's length is a dynamic dimension**, so one compilation per bucket of inputs serves every
  window, and the buffer's growth.
Each bucket compiles the first time a pass needs it: about a minute on 2 cores for the default model
(Inductor keeps its output on disk, under /tmp/torchinductor_<user>, so that a later process takes about
20 s, mostly tracing again). A prompt's prefill, batches and trees over 64 inputs run the plain model.
"""

import sys
import time

import torch

from backends.cpu_kernels import use_kernels
from backends.cuda_graphs import STEP_BUCKETS, GraphedModel, StaticPass, use_sdpa
from errors import UserError


def check(device: torch.device, dtype: torch.dtype) -> None:
    """The compiled backend's one check, made before any work: on a GPU, CUDA graphs do this job."""
    if device.type != "cpu":
        raise UserError("--backend compiled compiles the decoding passes for a CPU; on a GPU use --backend cuda-graphs")


def apply(model, max_rows: int) -> "CompiledModel":
    """The backend: `model`'s decoding passes compiled, calling cpu_kernels.py's kernels for the products
    and torch's fused attention. TorchDynamo first drops the programs compiled for earlier models in this
    process (bench.py's earlier --dtypes): kept, they slowed the next one."""
    use_kernels(model, max_rows)
    use_sdpa(model)
    torch._dynamo.reset()
    return CompiledModel(model)


class OutOfPlaceWindow:
    """The cache a compiled pass sees: each layer's window as it was before the pass. A layer's write
    returns its window with the new K/V put in (a new tensor: nothing is written in place) and keeps
    them, to be written to the buffer after the pass. keys, values: [layers, 1, K, window, E]."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values
        self.new_keys, self.new_values = [], []

    def write(self, layer: int, slots: torch.Tensor, k, v):
        self.new_keys.append(k)  # k, v: [1, K, T, E]
        self.new_values.append(v)
        return self.keys[layer].index_copy(2, slots, k), self.values[layer].index_copy(2, slots, v)


class CompiledModel(GraphedModel):
    """A Llama whose decoding passes run compiled (see the module docstring); everything else is the
    wrapped model's, and the padding, windows and buffer are GraphedModel's."""

    LABEL = "compiled"

    def __init__(self, model, capacity: int | None = None):
        super().__init__(model, capacity)
        # each bucket is one compilation of static_pass, and a process may compile for several models
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * len(STEP_BUCKETS))
        # compiled frozen (run): the weights are constants of the program, and TorchDynamo's guards on the
        # module's tensors (some 0.8 ms a call) are what gives another model a program of its own
        self.compiled = torch.compile(self.static_pass, fullgraph=True, dynamic=False)
        self.compiled_buckets: set[int] = set()

    def hidden_states(self, tokens=None, *, embeds=None, positions, cache=None, slots=None, mask=None):
        """model.hidden_states, through a compiled pass where the pass fits one. A prompt's prefill (the
        first pass into a cache) runs plainly: once per answer, it would not repay its compilation."""
        if isinstance(slots, slice) and slots.start == 0:
            self.prepared_last_pass = False
            return self.model.hidden_states(tokens, embeds=embeds, positions=positions, cache=cache, slots=slots,
                                            mask=mask)
        return super().hidden_states(tokens, embeds=embeds, positions=positions, cache=cache, slots=slots, mask=mask)

    def grow(self, slots: int) -> None:
        """Twice the room GraphedModel gives: a window then never spans the whole buffer. (Compiled where
        it did, the program would slice keys[..., :window] assuming window == slots, and every window
        shorter than the buffer would compile another.)"""
        super().grow(2 * slots)

    def static_pass(self, embeds, positions, slots, mask, keys, values):
        """One pass over T (padded) inputs attending over the first `window` slots (mask: [T, window])
        of the buffer's keys and values ([layers, 1, K, slots, E]): the hidden states [1, T, D] and the
        inputs' new keys and values [layers, 1, K, T, E]. What torch.compile compiles."""
        window = mask.shape[-1]
        cache = OutOfPlaceWindow(keys[:, :, :, :window], values[:, :, :, :window])
        hidden = self.model.hidden_states(embeds=embeds, positions=positions, cache=cache, slots=slots, mask=mask)
        return hidden, torch.stack(cache.new_keys), torch.stack(cache.new_values)

    def run(self, step: StaticPass) -> None:
        keys, values = self.buffer.keys, self.buffer.values
        for dynamic in (keys, values):
            torch._dynamo.mark_dynamic(dynamic, 3)  # the buffer's slots: it grows with the caches it adopts
        torch._dynamo.mark_dynamic(step.mask, 1)  # the window
        bucket = len(step.positions)
        first = bucket not in self.compiled_buckets
        if first:
            print(f"compiling the decoding pass for {bucket} input{'s' * (bucket > 1)} (once per size: about a "
                  f"minute, 20 s when Inductor has it on disk) ...", file=sys.stderr, flush=True)
            started = time.perf_counter()
        # one program whatever mode the caller is in (each mode would be another), compiled with the weights
        # frozen as constants, so that Inductor lays bfloat16 ones out for oneDNN's kernel itself
        # (cpu_kernels.py gives it F.linear there): 16.9 ms a pass instead of 22.0. (Given as an option of
        # torch.compile, freezing is not in effect when the program is traced; patched here, it is.) And each
        # product is autotuned: Inductor times its own C++ GEMM (AMX or AVX-512 micro-kernels) against the
        # library call for the product's shape and keeps the faster, a few seconds more per compilation; on 2
        # Intel Xeon cores with AMX, compiled vanilla 43.7 -> 53.2 tokens/s in bfloat16 (its products at the
        # memory's limit, where oneDNN's took 1.4x that), 32.5 -> 35.1 in float32 (docs/results.md)
        with torch.inference_mode(), torch._inductor.config.patch(freezing=True, max_autotune_gemm=True):
            step.hidden, new_keys, new_values = self.compiled(step.embeds, step.positions, step.slots, step.mask,
                                                              keys, values)
            keys.index_copy_(3, step.slots, new_keys)  # [layers, 1, K, slots, E] <- [layers, 1, K, T, E]
            values.index_copy_(3, step.slots, new_values)
        if first:
            self.compiled_buckets.add(bucket)
            self.prepared_last_pass = True
            print(f"compiled in {time.perf_counter() - started:.0f} s (counted in this answer's time: the next answers "
                  "show the compiled speed)", file=sys.stderr, flush=True)
