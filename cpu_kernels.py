"""Matrix-vector kernels for decoding on a CPU: `Linear`, a drop-in `nn.Linear` that model.py uses.

Decoding multiplies a handful of token vectors by each weight matrix, so a step should cost about
as much as reading the weights once, whatever the handful: it is bound by memory, and bfloat16
weights, half the bytes, should take about half the time. PyTorch's stock CPU kernels
manage neither. `python bench.py latency --dtypes float32 bfloat16` measures the candidates on the
default model's matrices (`kernel_times`: 30 layers' four and the LM head, in a step's order, so they
stream from RAM as in a real step); the kernels below are its winners on 2 AMD EPYC cores
(docs/constants.md has the table):
- float32, 1 row (vanilla decoding): W split into blocks of `BLOCK_ROWS` rows (a free view), all
  multiplied by x in one `torch.bmm`, keeping each block in cache: 18 ms for 1 row (F.linear, MKL:
  51; oneDNN below: 27);
- float32, 2 rows (a single guess): whichever of the two is faster on this CPU, measured when a
  model that guesses is loaded (`blocked_rows`): the machines these were measured on disagree (blocked 19 ms
  against oneDNN's 29 on one, 18.1 against 15.8 on another), and a slow 2-row pass made a single
  guess dearer than three (L(2) 24 ms, L(4) 21);
- float32, 3-`MAX_PACKED_ROWS` rows (a tree of guesses): oneDNN's GEMM on a copy of W re-laid out
  once for it (`mkldnn._reorder_linear_weight`; made by `prepare_kernels` or on first use): 25 ms
  for 3 rows, 22 for 6 (blocked: 28 and 42). It costs a second copy of the weights;
- bfloat16, 1-`MAX_PACKED_ROWS` rows, on a CPU whose oneDNN has bfloat16 kernels (AVX512-BF16,
  AMX): the same re-laid-out oneDNN GEMM. F.linear and bmm in bfloat16 convert to float32 element
  by element and run 1.3-2.5x slower than float32; oneDNN's kernel multiplies bfloat16 natively
  (float32 accumulation) and, unlike float32, costs about the same for 1 row as for 8.
Prefill, other dtypes, GPUs, CPUs without oneDNN and inputs that need gradients use F.linear.
Compiled (`--compile`, cpu_compiled.py), the same choices hold, but that torch.compile sees each kernel
as one operation it calls: the blocked bmm as it is, the re-laid-out float32 product as `packed_linear`
(an opaque operation: the compiler cannot trace oneDNN's re-laid-out weights); in bfloat16 it is given
F.linear, which the compiler itself lays out for the same oneDNN kernel. In
float32 the result is the same computation either way (only its speed differs); in bfloat16 every
kernel accumulates in float32 and rounds the output to bfloat16, so results agree to bfloat16's
rounding (tests/test_cpu_kernels.py).
"""

import platform
import time
import weakref

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """y = x W^T, with the kernel picked by dtype and by how many rows x has (see the module docstring)."""

    BLOCK_ROWS = 64
    MAX_BLOCKED_ROWS = 2  # at most; `prepare_kernels` sets each layer's own (1 or 2) by this CPU's measurement
    MAX_PACKED_ROWS = 64

    def forward(self, x):
        rows = x.numel() // x.shape[-1]
        kernel = "F.linear" if x.requires_grad else self.kernel(x.device, x.dtype, rows)  # training
        # (train_prompt.py) needs kernels autograd knows
        if kernel == "blocked":
            return self.blocked_matmul(x, rows)
        if kernel == "packed":  # compiled, as one opaque operation; eagerly without its dispatch (20-40 us)
            return packed_linear(x, self.weight) if torch.compiler.is_compiling() else packed_product(x, self.weight)
        return F.linear(x, self.weight)

    def kernel(self, device, dtype, rows) -> str:
        """Which kernel multiplies `rows` rows: "blocked", "packed" or "F.linear"."""
        if device.type != "cpu" or rows > self.MAX_PACKED_ROWS:
            return "F.linear"
        if dtype == torch.float32:
            if rows <= self.MAX_BLOCKED_ROWS and self.out_features % self.BLOCK_ROWS == 0:
                return "blocked"
            return "packed" if ONEDNN else "F.linear"
        if dtype == torch.bfloat16 and BFLOAT16_KERNELS:
            # compiled: F.linear, which torch.compile (freezing the weights) lays out for this kernel itself
            return "F.linear" if torch.compiler.is_compiling() else "packed"
        return "F.linear"

    def blocked_matmul(self, x, rows):
        # a decoding step calls this 121 times, and each tensor operation, a view included, costs about
        # a microsecond of dispatch however small it is: so no more of them than the product needs
        blocks = self.weight.view(-1, self.BLOCK_ROWS, self.in_features)  # [O/64, 64, I]
        # x's rows must be contiguous (an [I, rows] view with strides (1, I)): MKL's batched GEMM takes
        # 5x as long on the transposed layout (what a .T.reshape view of an earlier output would hand it)
        x_columns = x.reshape(rows, self.in_features).contiguous().T  # [I, rows]
        y = torch.bmm(blocks, x_columns.expand(len(blocks), -1, -1))  # [O/64, 64, rows]
        # and so must the output's, for the next layer: [rows, O] row-major (a copy when rows > 1)
        return y.view(self.out_features, rows).T.contiguous().view(*x.shape[:-1], self.out_features)


ONEDNN = torch.backends.mkldnn.is_available()
# whether oneDNN multiplies bfloat16 natively on this CPU (AVX512-BF16 or AMX; on AVX2 it does not);
# constants, read once, so that torch.compile can trace the choice of kernel
BFLOAT16_KERNELS = ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def bfloat16_kernels() -> bool:
    return BFLOAT16_KERNELS


def packed_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T by oneDNN's GEMM on W's re-laid-out copy. x: [..., I], weight: [O, I] -> [..., O]."""
    rows = x.numel() // x.shape[-1]
    return torch.ops.mkldnn._linear_pointwise(x.reshape(rows, -1), packed_copy(weight), None, "none", [], "").view(
        *x.shape[:-1], -1)


@torch.library.custom_op("cpu_kernels::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """packed_product as one operation for torch.compile: it calls this as it is, where it would
    otherwise try to trace the copy (an opaque oneDNN tensor) and fail."""
    return packed_product(x, weight)


@packed_linear.register_fake
def _(x, weight):  # the output's shape, for tracing
    return x.new_empty(*x.shape[:-1], weight.shape[0])


PACKED_COPIES: dict[tuple, tuple[int, torch.Tensor]] = {}  # (W's address, shape, dtype) -> (W's version, copy)


def packed_copy(weight: torch.Tensor) -> torch.Tensor:
    """W re-laid out for oneDNN, made once per weight tensor, remade (replacing the old one) if W changes
    in place, and dropped with W, so that no tensor later at W's address finds W's copy."""
    key = (weight.data_ptr(), tuple(weight.shape), weight.dtype)
    version = 0 if weight.is_inference() else weight._version  # inference tensors, loaded under
    # torch.inference_mode, cannot change in place, so have no version
    if key not in PACKED_COPIES:
        weakref.finalize(weight, PACKED_COPIES.pop, key, None)
    if PACKED_COPIES.get(key, (None,))[0] != version:
        PACKED_COPIES[key] = version, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8)
    return PACKED_COPIES[key][1]


def prepare_kernels(model, max_rows: int = Linear.MAX_PACKED_ROWS) -> None:
    """Lay out the weights of a CPU model whose passes feed up to `max_rows` rows (1: vanilla; the
    default: trees of guesses) for the kernels that need it now, rather than in the first pass (about half a
    second for the default model), so that pass's timing is not skewed, and give a float32 model that
    guesses this CPU's faster kernel for 2 rows (`blocked_rows`). A float32 model that only decodes
    plainly needs no second copy."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if max_rows >= 2 and linears and model.device.type == "cpu" and model.dtype == torch.float32 and ONEDNN:
        limit = blocked_rows(linears)
        for module in linears:
            module.MAX_BLOCKED_ROWS = limit  # the layer's own, over the class's
    for module in linears:
        if any(module.kernel(model.device, model.dtype, rows) == "packed"
               for rows in range(1, min(max_rows, Linear.MAX_PACKED_ROWS) + 1)):
            packed_copy(module.weight)


BLOCKED_ROWS: dict[tuple, int] = {}  # the weights' shapes -> blocked_rows' measured choice, in this process


def blocked_rows(linears: list[Linear]) -> int:
    """How many rows, 1 or 2, the blocked bmm multiplies on this CPU (fewer go to oneDNN): 2 where it
    beats oneDNN at 2 rows through `linears` (a float32 model's layers, in a step's order). Measured once
    per process and set of weight shapes (about 0.3 s for the default model), when a model that guesses
    is loaded."""
    linears = [m for m in linears if m.out_features % m.BLOCK_ROWS == 0]  # the others never take the bmm
    shapes = tuple(sorted({tuple(m.weight.shape) for m in linears}))
    if linears and shapes not in BLOCKED_ROWS:
        with torch.no_grad():
            ms = kernel_times(linears, [2], repeats=9, names=["blocked", "packed"])
        BLOCKED_ROWS[shapes] = 2 if ms["blocked", 2] <= ms["packed", 2] else 1
    return BLOCKED_ROWS.get(shapes, Linear.MAX_BLOCKED_ROWS)


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---- the measurement that chose the kernels (bench.py latency prints it) --------------------------

MEMORY_FLOOR = "read W once"  # kernel_times' yardstick: no product, each weight summed


def kernel_times(linears: list[Linear], rows_list: list[int], repeats: int = 15,
                 names: list[str] | None = None) -> dict[tuple[str, int], float]:
    """{(kernel, rows): ms} for one pass of `rows` input rows through `linears` (a model's linear
    layers in the order a step runs them, so that they stream from memory as in a real step), per
    candidate kernel for their dtype; the median of `repeats` passes, candidates and sizes
    interleaved so that machine noise hits all alike. MEMORY_FLOOR, for comparison, reads the same
    weights once and multiplies nothing (a sum: what the memory allows a kernel, whatever it
    computes; a kernel near it is at the memory limit)."""
    weight = linears[0].weight
    candidates = {MEMORY_FLOOR: lambda m, x: m.weight.sum(), "F.linear": lambda m, x: F.linear(x, m.weight)}
    if torch.backends.mkldnn.is_available():
        candidates["packed"] = lambda m, x: packed_product(x, m.weight)
    if weight.dtype == torch.float32:
        candidates["blocked"] = lambda m, x: m.blocked_matmul(x, len(x))
    if names is not None:  # only these
        candidates = {name: candidates[name] for name in names}
    generator = torch.Generator().manual_seed(0)  # (not the global one: loading a model draws nothing from it)
    inputs = {rows: {m.in_features: torch.randn(rows, m.in_features, generator=generator).to(weight.dtype)
                     for m in linears} for rows in rows_list}
    times = {(name, rows): [] for name in candidates for rows in rows_list}
    for round_ in range(repeats + 1):  # round 0 warms up (and lays out the packed weights)
        for rows in rows_list:
            for name, kernel in candidates.items():
                started = time.perf_counter()
                for m in linears:
                    kernel(m, inputs[rows][m.in_features])
                if round_:
                    times[name, rows].append(time.perf_counter() - started)
    return {key: 1000 * sorted(seconds)[len(seconds) // 2] for key, seconds in times.items()}
