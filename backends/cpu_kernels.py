"""Matrix-vector kernels for decoding on a CPU: `Linear`, an `nn.Linear` with faster kernels for a few
rows, which the fused and compiled backends put in place of model.py's layers (`use_kernels`), and
`dot_rows`, the product loop of the fused passes (cpu_fused.py).

Decoding multiplies a handful of token vectors by each weight matrix, so a step should cost about as
much as reading the weights once: it is bound by memory. PyTorch's stock CPU kernels do not always
manage that for a few rows, and which kernel does depends on the CPU, so `prepare_kernels` times the
candidates once per process on the model's own matrices and gives each layer the fastest per row count
(`few_row_picks`): F.linear (MKL), W in blocks of `BLOCK_ROWS` rows multiplied in one `torch.bmm`,
oneDNN's GEMM on a re-laid-out copy of W, and `dot_rows` (numba), which reads each row of W once for all
of x's rows. More rows (larger trees) take oneDNN's GEMM; the prefill, other dtypes, GPUs and inputs
that need gradients take F.linear. bfloat16 uses oneDNN's native kernel where the CPU has one.

`dot_rows` also reads bfloat16 weights stored two to a 32-bit word (`bfloat16_words`), widened to float32
by a shift, so no bfloat16 instruction is needed (cpu_bfloat16.py uses AVX512-BF16's where there is one).
Under torch.compile each kernel is one opaque operation (`packed_linear`, `numba_linear`). In float32
every kernel computes the same products, summed in another order; in bfloat16 every kernel accumulates
in float32 and rounds the output (tests/test_cpu_kernels.py). The measurements behind these choices are
in docs/constants.md; `python bench.py latency --backend fused` prints them for this machine.
"""

import functools
import time
import weakref

import llvmlite.ir
import numba
import numba.extending
import numpy as np
import torch
import torch.nn.functional as F
from numba.core import cgutils
from torch import nn


class Linear(nn.Linear):
    """y = x W^T, with the kernel picked by dtype and by how many rows x has (see the module docstring)."""

    BLOCK_ROWS = 64
    MEASURED_ROWS = 4  # up to this many float32 rows, the kernel is this CPU's measured fastest
    MAX_PACKED_ROWS = 64
    picks: dict[int, str] = {}  # rows -> kernel for float32: `prepare_kernels` sets each layer's own, from
    # this CPU's measurement (none yet: oneDNN's)

    def forward(self, x):
        rows = x.numel() // x.shape[-1]
        kernel = "F.linear" if x.requires_grad else self.kernel(x.device, x.dtype, rows)  # training
        # (train_prompt.py) needs kernels autograd knows
        if kernel == "blocked":
            return self.blocked_matmul(x, rows)
        if kernel == "mv":  # one row: the matrix-vector product (a few microseconds of fixed cost, where
            # oneDNN's call has ~20)
            return torch.mv(self.weight, x.reshape(-1)).view(*x.shape[:-1], self.out_features)
        if kernel == "packed":  # compiled, as one opaque operation; eagerly without its dispatch (20-40 us)
            return packed_linear(x, self.weight) if torch.compiler.is_compiling() else packed_product(x, self.weight)
        if kernel == "numba":
            return numba_linear(x, self.weight) if torch.compiler.is_compiling() else numba_product(x, self.weight)
        return F.linear(x, self.weight)

    def kernel(self, device, dtype, rows) -> str:
        """Which kernel multiplies `rows` rows: "mv", "blocked", "numba", "packed" or "F.linear"."""
        if device.type != "cpu" or rows > self.MAX_PACKED_ROWS:
            return "F.linear"
        if dtype == torch.float32:
            default = "packed" if ONEDNN else "F.linear"
            pick = self.picks.get(rows, default)
            return default if pick == "blocked" and self.out_features % self.BLOCK_ROWS else pick  # (no 64-row
            # blocks: picks made for layers that have them, given to one that has not)
        if dtype == torch.bfloat16 and BFLOAT16_KERNELS:
            # compiled: F.linear, which torch.compile (freezing the weights) lays out for this kernel itself
            return "F.linear" if torch.compiler.is_compiling() else self.picks.get(rows, "packed")
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
def product_like(x, weight):
    """x W^T's output, its shape and dtype only: what an opaque product gives torch.compile to trace."""
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@numba.njit(parallel=True, fastmath=True, cache=True)
def dot_rows(weight, x, out, pairs=True):
    """out[r, o] = sum_i W[o, i] x[r, i], compiled by numba. weight: W as float32 [O, I], or as
    `bfloat16_words` [O, I/2]; x: [R, I] and out: [R, O], float32. The threads share out W's rows; each
    row, read from memory once, is multiplied by x's rows while it is in cache, two at a time where
    `pairs` (one load of each weight for both), an odd last row alone. One row is bound by memory; each
    further row adds its arithmetic, and sharing the loads pays from two rows on: a fused pass
    (cpu_fused.py, 2 AVX2 EPYC cores, 256 cached tokens, the two interleaved in one process) took 41.3 /
    49.8 / 57.0 / 66.1 ms at 2 / 4 / 6 / 8 inputs in pairs against 42.9 / 53.3 / 64.8 / 73.3 one row at a
    time (35.7 and 36.0 at 1). fastmath lets the compiler sum a dot product in any order, which is what
    vectorises it (AVX2: 8 products at a time in four running sums, for a row alone and for each row of
    a pair alike, as `pairs_sum_as_rows_alone` checks; a row in a group of three or four was summed in
    another order). How a row of W is read is its layout's: `row_dot` and `row_dots`."""
    rows, stored = x.shape[0], weight.shape[1]  # (read here, not in the parallel loop, where the compiler
    # did not vectorise the words' loop: 24 ms for a 1-row pass's products against 14, 2 Intel Xeon cores)
    paired = rows - rows % 2 if pairs else 0
    outputs, per_line = weight.shape[0], CACHE_LINE // weight.itemsize
    for o in numba.prange(outputs):
        if o + AHEAD_ROWS < outputs:  # W's row AHEAD_ROWS on asked for now, so that it streams in meanwhile
            for column in range(0, stored, per_line):
                prefetch(weight, o + AHEAD_ROWS, column)
        for r in range(0, paired, 2):
            out[r, o], out[r + 1, o] = row_dots(weight[o], x[r], x[r + 1], stored)
        for r in range(paired, rows):
            out[r, o] = row_dot(weight[o], x[r], stored)


CACHE_LINE = 64  # bytes the memory delivers at a time
AHEAD_ROWS = 2  # dot_rows prefetches the weights this many rows ahead (see there)


def prefetch(array, row, column):
    """Ask for the cache line holding array[row, column] (2-D, C-contiguous) without waiting for it: compiled,
    LLVM's prefetch (a read, kept in every cache level; the address need not be valid, a prefetch never
    faults); where numba's compiler is off, nothing."""


def prefetch_instruction(builder, address) -> None:
    """IR: LLVM's prefetch of the cache line at `address` (a read, kept in every cache level, data)."""
    byte, int32 = llvmlite.ir.IntType(8).as_pointer(), llvmlite.ir.IntType(32)
    function = cgutils.get_or_insert_function(
        builder.module, llvmlite.ir.FunctionType(llvmlite.ir.VoidType(), [byte, int32, int32, int32]), "llvm.prefetch.p0")
    builder.call(function, [builder.bitcast(address, byte), *(llvmlite.ir.Constant(int32, n) for n in (0, 3, 1))])


@numba.extending.intrinsic
def prefetch_line(typingctx, array, row, column):
    def codegen(context, builder, signature, args):
        view = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=args[0])
        prefetch_instruction(builder, cgutils.get_item_pointer(context, builder, signature.args[0], view, args[1:],
                                                               wraparound=False))
        return context.get_dummy_value()
    return numba.types.none(array, row, column), codegen


@numba.extending.overload(prefetch)
def _prefetch(array, row, column):
    return lambda array, row, column: prefetch_line(array, row, column)


def row_dot(weight_row, x_row, stored):
    """sum_i W[o, i] x[i] for one row of W, as float32 or as bfloat16 words, `stored` long (compiled: the
    overloads below; this is what runs where numba's compiler is off, NUMBA_DISABLE_JIT=1)."""
    return np.float32(np.dot(widened(weight_row), x_row))


def row_dots(weight_row, x_first, x_second, stored):
    """row_dot of one row of W with two rows of x, each weight read once for both."""
    return row_dot(weight_row, x_first, stored), row_dot(weight_row, x_second, stored)


def widened(weight_row) -> np.ndarray:
    """A row of W as float32, whichever way it is stored."""
    if weight_row.dtype == np.float32:
        return weight_row
    return np.concatenate([weight_row << SHIFT, weight_row & HIGH_HALF]).view(np.float32)


@numba.extending.intrinsic
def float_of_bits(typingctx, bits):
    """The float32 whose 32 bits are `bits` (a uint32), as numpy's .view(np.float32) reads them: in
    machine code nothing at all, the same register read as a float."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], llvmlite.ir.FloatType())
    return numba.float32(numba.uint32), codegen


# A bfloat16 is a float32's top 16 bits (its sign, its 8 exponent bits, 7 of its 23 mantissa bits): so
# widening one to float32 is a 16-bit shift into the top half, or masking the low half away.
HIGH_HALF = np.uint32(0xFFFF0000)
SHIFT = np.uint32(16)


@numba.extending.overload(row_dot, jit_options={"fastmath": True})
def _row_dot(weight_row, x_row, stored):
    if weight_row.dtype == numba.float32:
        def float32_row(weight_row, x_row, stored):
            total = numba.float32(0.0)
            for i in range(stored):
                total += weight_row[i] * x_row[i]
            return total
        return float32_row

    def words_row(weight_row, x_row, stored):  # word i: column i in its low half, column i + I/2 in its high
        low, high = numba.float32(0.0), numba.float32(0.0)  # half; two running sums: as one, 15.2 ms for
        for i in range(stored):  # a 1-row pass's products where these take 13.1 (2 Intel Xeon cores)
            low += float_of_bits(weight_row[i] << SHIFT) * x_row[i]
            high += float_of_bits(weight_row[i] & HIGH_HALF) * x_row[stored + i]
        return low + high
    return words_row


@numba.extending.overload(row_dots, jit_options={"fastmath": True})
def _row_dots(weight_row, x_first, x_second, stored):
    if weight_row.dtype == numba.float32:
        def float32_rows(weight_row, x_first, x_second, stored):
            first, second = numba.float32(0.0), numba.float32(0.0)
            for i in range(stored):
                w = weight_row[i]
                first += w * x_first[i]
                second += w * x_second[i]
            return first, second
        return float32_rows

    def words_rows(weight_row, x_first, x_second, stored):
        first_low, first_high = numba.float32(0.0), numba.float32(0.0)
        second_low, second_high = numba.float32(0.0), numba.float32(0.0)
        for i in range(stored):
            low, high = float_of_bits(weight_row[i] << SHIFT), float_of_bits(weight_row[i] & HIGH_HALF)
            first_low += low * x_first[i]
            first_high += high * x_first[stored + i]
            second_low += low * x_second[i]
            second_high += high * x_second[stored + i]
        return first_low + first_high, second_low + second_high
    return words_rows


def bfloat16_words(weight: torch.Tensor) -> np.ndarray:
    """W [O, I] rounded to bfloat16 (as .to(torch.bfloat16) rounds) and stored two to a 32-bit word, for
    `dot_rows`: [O, I/2] uint32, word i of a row holding column i in its low half and column i + I/2 in
    its high half, so that each half multiplies a contiguous half of x. Half the bytes of float32."""
    if weight.shape[1] % 2:
        raise ValueError(f"bfloat16 words need an even number of columns, not {weight.shape[1]}")
    bits = weight.detach().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
    half = weight.shape[1] // 2
    return np.ascontiguousarray(bits[:, :half] | (bits[:, half:] << SHIFT))


def pairs_sum_as_rows_alone(widths, layout=torch.Tensor.numpy, kernel=dot_rows) -> bool:
    """Whether `kernel` (`dot_rows`) sums each row of a pair exactly as it sums a row alone, bit for bit,
    for inputs of each of these widths and weights stored by `layout` (float32 as they are, or
    `bfloat16_words`): what fused passes need to pair rows (cpu_fused.py). The order of a vectorised sum
    is the compiler's choice (how many running sums, how the last few products are added), made for each
    loop apart; on 2 AVX2 EPYC cores it is the same for both loops. Products of random numbers summed in
    two different orders differ in some output almost surely, so agreement on a 64-row matrix is the
    evidence."""
    generator = torch.Generator().manual_seed(0)
    for width in sorted(set(widths)):
        weight = layout(torch.randn(64, width, generator=generator))
        x = torch.randn(2, width, generator=generator).numpy()
        together, alone = np.empty((2, 64), dtype=np.float32), np.empty((1, 64), dtype=np.float32)
        kernel(weight, x, together, True)
        for r in range(2):
            kernel(weight, x[r:r + 1].copy(), alone, True)  # the same compiled code as a pass's
            if not np.array_equal(together[r], alone[0]):
                return False
    return True


@functools.cache
def start_numba_threads() -> None:
    """Start numba's threads, keeping torch's thread count. numba starts them at its first parallel call
    and, starting them, sets OpenMP's thread count to the number of cores; its calls bind to the OpenMP
    runtime torch has loaded (one pool of threads serves both), so that count is torch's too: a process
    that asked torch for 1 thread (each worker of `pytest -n auto`) would then run torch on 2 and crowd
    the other workers' cores (the test run, 14 minutes on 2 cores, went on course for 17)."""
    threads = torch.get_num_threads()
    numba.get_num_threads()  # starts them
    torch.set_num_threads(threads)


def numba_threads_as_torch() -> None:
    """numba's parallel loops on as many threads as torch's (numba keeps its own count, per calling thread)."""
    start_numba_threads()
    threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)


def numba_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T by `dot_rows`, on the weight's own memory (no copy). x: [..., I], weight: [O, I] -> [..., O].
    A step calls this 121 times, so the arrays around the kernel are numpy's, handed to and from torch
    without a copy: torch's allocation and views cost more dispatch (a call 20 us against 11 on 2 AVX2
    EPYC cores, 1-2 ms of a pass's products)."""
    numba_threads_as_torch()
    out = np.empty((*x.shape[:-1], weight.shape[0]), dtype=np.float32)
    dot_rows(weight.detach().numpy(), np.ascontiguousarray(x.numpy().reshape(-1, x.shape[-1])),
             out.reshape(-1, weight.shape[0]))
    return torch.from_numpy(out)


@numba.njit("void(float32[:, ::1], int64[:, ::1])", cache=True)  # its one signature: compiled (or read
def top_k_rows(scores, out):  # from disk) on import, not in the first generation's drafting time
    """out[r]: the ids of row r's k = out.shape[1] largest scores, largest first, ties to the lower id:
    one pass over the row, each score that beats the k-th best so far inserted in order. scores: [R, V]
    float32, out: [R, k] int64, both C-contiguous."""
    k = out.shape[1]
    for r in range(scores.shape[0]):
        best = np.full(k, -np.inf, dtype=np.float32)
        out[r, :] = -1
        for token in range(scores.shape[1]):
            score = scores[r, token]
            if score > best[k - 1]:
                place = k - 1
                while place > 0 and best[place - 1] < score:
                    best[place], out[r, place] = best[place - 1], out[r, place - 1]
                    place -= 1
                best[place], out[r, place] = score, token


def argmax_ids(scores: torch.Tensor) -> list[int]:
    """scores.argmax(-1).tolist(): per row of [..., V], the id of its largest score (the first of equal
    ones, as torch's). On a CPU, in float32 or float64, by numpy on the same memory: torch's argmax over
    one row of the default model's 49,152 logits took 86 us on 2 Intel Xeon cores, numpy's 3, and every
    pass of the loop, vanilla's too, verifies by it (fused vanilla decoding, interleaved with torch's
    argmax in one process: 1.5% faster in bfloat16, 1.2% in float32; 3 held-out prompts, 4 rounds)."""
    if scores.device.type != "cpu" or scores.dtype not in (torch.float32, torch.float64) or scores.requires_grad:
        return scores.argmax(dim=-1).tolist()
    return scores.numpy().argmax(-1).tolist()


def top_k_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores.topk(k).indices: [..., V] -> [..., k]. On a CPU in float32 by `top_k_rows` (ties to the
    lower id; elsewhere torch.topk, whose order among ties is its own): torch.topk of a pass's logits
    took 0.40 ms in Token Recycling's loop (2 AVX2 EPYC cores, fused passes; 0.10 alone), this 0.12, a
    third of that drafter's time a pass."""
    if scores.device.type != "cpu" or scores.dtype != torch.float32 or scores.requires_grad:
        return scores.topk(k, dim=-1).indices
    out = np.empty((*scores.shape[:-1], k), dtype=np.int64)
    top_k_rows(np.ascontiguousarray(scores.numpy().reshape(-1, scores.shape[-1])), out.reshape(-1, k))
    return torch.from_numpy(out)


@torch.library.custom_op("cpu_kernels::numba_linear", mutates_args=())
def numba_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """numba_product as one operation for torch.compile, which cannot trace into numba's machine code."""
    return numba_product(x, weight)


numba_linear.register_fake(product_like)


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


def drop_packed_copy(weight: torch.Tensor) -> None:
    """Free W's oneDNN copy, if it has one."""
    PACKED_COPIES.pop((weight.data_ptr(), tuple(weight.shape), weight.dtype), None)


def prepare_kernels(model, max_rows: int = Linear.MAX_PACKED_ROWS) -> None:
    """Make a CPU model's passes of up to `max_rows` rows (1: plain decoding; the default: trees of
    guesses) take this CPU's fastest kernels: a float32 or bfloat16 model's layers get the ones measured
    for few rows and their weights' shape (`few_row_picks`), and the weights are laid out for oneDNN now
    where a pass will use it, rather than in the first pass (about 0.2 s for the default model), so that
    pass's timing is not skewed. A model that only decodes plainly keeps oneDNN's copy of a weight only where
    the measurement picked it."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if linears and model.device.type == "cpu" and candidates(model.dtype):
        measured = few_row_picks(linears, min(max_rows, measured_rows(model.dtype)))
        # more rows: a tree of guesses takes oneDNN's copy; plain decoding's only such pass, the prefill,
        # F.linear, as fast without the copy (38 tokens: 85 ms against 82, and 0.17 s to lay it out)
        more = "packed" if max_rows > 1 and ONEDNN else "F.linear"
        for module in linears:  # the layer's own, over the class's
            own = measured[tuple(module.weight.shape)]
            module.picks = own | {rows: more for rows in range(len(own) + 1, Linear.MAX_PACKED_ROWS + 1)}
    for module in linears:
        if any(module.kernel(model.device, model.dtype, rows) == "packed"
               for rows in range(1, min(max_rows, Linear.MAX_PACKED_ROWS) + 1)):
            packed_copy(module.weight)
        else:  # (the measurement laid out a copy of every weight)
            drop_packed_copy(module.weight)


def use_kernels(model, max_rows: int) -> None:
    """Give every nn.Linear of `model` this module's `Linear` (the same weights, the same y = x W^T, in
    place), and prepare its kernels for passes of up to `max_rows` rows (prepare_kernels)."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = Linear
    prepare_kernels(model, max_rows)


def candidates(dtype) -> list[str]:
    """The kernels `few_row_picks` times for a model of this dtype on this CPU (none: nothing to pick)."""
    if dtype == torch.float32:
        # (not mv: in float32 it sums as F.linear does, within noise of it at 1 row, 26.1 against 27.1 ms
        # a pass; a near tie would flip the pick, and with it L(n)'s machine key, from process to process)
        return ["F.linear", "blocked", "numba"] + (["packed"] if ONEDNN else [])
    return ["packed", "mv"] if dtype == torch.bfloat16 and BFLOAT16_KERNELS else []


def measured_rows(dtype) -> int:
    """Up to how many rows `few_row_picks` measures: in bfloat16 only 1, where mv competes with oneDNN's
    kernel; from 2 rows oneDNN's is the only one that multiplies bfloat16 natively."""
    return Linear.MEASURED_ROWS if dtype == torch.float32 else 1


def applies(kernel: str, rows: int, shape: tuple) -> bool:
    """Whether `kernel` can multiply `rows` rows by a weight of `shape`: the bmm needs 64-row blocks, and
    mv one row."""
    return (kernel != "blocked" or shape[0] % Linear.BLOCK_ROWS == 0) and (kernel != "mv" or rows == 1)


FEW_ROW_PICKS: dict[tuple, dict[tuple, dict[int, str]]] = {}  # what few_row_picks measured in this process


def few_row_picks(linears: list[Linear], max_rows: int) -> dict[tuple, dict[int, str]]:
    """{weight shape: {rows: kernel}} for 1 to `max_rows` rows: per shape, the fastest on this CPU
    through the layers of that shape, timed one by one within passes through all of `linears` (a float32
    or bfloat16 model's layers, in a step's order, so that each streams from memory as in a step), of
    `candidates` for their dtype (float32: F.linear, the blocked bmm, numba's and oneDNN's; bfloat16:
    oneDNN's and, for 1 row, mv), where `kernel_times` timed them (where they apply). Per shape, because
    a shape's best kernel is its own: on 2 Intel Xeon cores with AMX, F.linear is the fastest for every
    layer's, and oneDNN's for the LM head's (49152 x 576: 5.0 ms at 1 row against 6.6). Measured once
    per process, set of weight shapes and rows: 3 interleaved passes per candidate and row count after
    a warm-up (about 3.9 s for the default model on 2 AVX2 cores at 1-4 rows, laying out oneDNN's copies
    included; plain decoding measures 1 row)."""
    dtype = linears[0].weight.dtype
    names = candidates(dtype)
    rows_list = list(range(1, max_rows + 1))
    key = (tuple(tuple(m.weight.shape) for m in linears), dtype, max_rows)
    if key not in FEW_ROW_PICKS:
        with torch.no_grad():
            ms = kernel_times(linears, rows_list, repeats=3, names=names, per_shape=True)
        FEW_ROW_PICKS[key] = {
            shape: {rows: min((name for name in names if (name, rows, shape) in ms), key=lambda name: ms[name, rows, shape])
                    for rows in rows_list}
            for shape in dict.fromkeys(tuple(m.weight.shape) for m in linears)}
    return FEW_ROW_PICKS[key]


def describe_picks(linears: list[Linear], rows_list) -> str:
    """The kernels `linears` take at each of `rows_list`, per weight shape where they differ:
    "F.linear F.linear" or "576x576 F.linear F.linear, 49152x576 packed packed"."""
    by_shape = {tuple(m.weight.shape): " ".join(m.kernel(m.weight.device, m.weight.dtype, rows) for rows in rows_list)
                for m in linears}
    if len(set(by_shape.values())) == 1:
        return next(iter(by_shape.values()))
    return ", ".join(f"{out}x{into} {kernels}" for (out, into), kernels in by_shape.items())


# ---- the measurement that chose the kernels (bench.py latency prints it) --------------------------

MEMORY_FLOOR = "read W once"  # kernel_times' yardstick: no product, each weight summed


def kernel_times(linears: list[Linear], rows_list: list[int], repeats: int = 15, names: list[str] | None = None,
                 per_shape: bool = False) -> dict[tuple, float]:
    """{(kernel, rows): ms} for one pass of `rows` input rows through `linears` (a model's linear
    layers in the order a step runs them, so that they stream from memory as in a real step), per
    candidate kernel for their dtype; the median of `repeats` passes, candidates and sizes
    interleaved so that machine noise hits all alike. `per_shape`: {(kernel, rows, weight shape): ms},
    the layers of each shape timed one by one within those passes (a shape's own share of a pass).
    MEMORY_FLOOR, for comparison, reads the same weights once and multiplies nothing (a sum: what the
    memory allows a kernel, whatever it computes; a kernel near it is at the memory limit). A kernel is
    timed only where it `applies`: mv at 1 row, the blocked bmm on the shapes with 64-row blocks (for a
    whole pass, only if every shape has them)."""
    weight = linears[0].weight
    kernels = {MEMORY_FLOOR: lambda m, x: m.weight.sum(), "F.linear": lambda m, x: F.linear(x, m.weight),
               "mv": lambda m, x: torch.mv(m.weight, x[0])}
    if weight.dtype == torch.float32:
        kernels["numba"] = lambda m, x: numba_product(x, m.weight)
    if torch.backends.mkldnn.is_available():
        kernels["packed"] = lambda m, x: packed_product(x, m.weight)
    shapes = [tuple(m.weight.shape) for m in linears]
    if weight.dtype == torch.float32 and (per_shape or all(applies("blocked", 1, shape) for shape in shapes)):
        kernels["blocked"] = lambda m, x: m.blocked_matmul(x, len(x))
    if names is not None:  # only these (of those that apply)
        kernels = {name: kernels[name] for name in names if name in kernels}

    def fits(name, rows, shape):
        return name == MEMORY_FLOOR or applies(name, rows, shape)
    generator = torch.Generator().manual_seed(0)  # (not the global one: loading a model draws nothing from it)
    inputs = {rows: {m.in_features: torch.randn(rows, m.in_features, generator=generator).to(weight.dtype)
                     for m in linears} for rows in rows_list}
    times = {(name, rows, shape): [] for name in kernels for rows in rows_list for shape in set(shapes)
             if fits(name, rows, shape)}
    for round_ in range(repeats + 1):  # round 0 warms up (and lays out the packed weights)
        for rows in rows_list:
            for name, kernel in kernels.items():
                spent = {shape: 0.0 for shape in shapes if fits(name, rows, shape)}
                for m, shape in zip(linears, shapes):
                    if shape in spent:
                        started = time.perf_counter()
                        kernel(m, inputs[rows][m.in_features])
                        spent[shape] += time.perf_counter() - started
                if round_:
                    for shape, seconds in spent.items():
                        times[name, rows, shape].append(seconds)

    def median(seconds):
        return 1000 * sorted(seconds)[len(seconds) // 2]
    if per_shape:
        return {key: median(seconds) for key, seconds in times.items()}
    return {(name, rows): median([sum(times[name, rows, shape][r] for shape in set(shapes)) for r in range(repeats)])
            for name in kernels for rows in rows_list if (name, rows, shapes[0]) in times}
