"""Products with bfloat16 weights by the CPU's own bfloat16 instruction, for fused passes (cpu_fused.py)
on CPUs with AVX512-BF16 (Intel Cooper Lake and Sapphire Rapids on, AMD Zen 4 on).

    out[r, o] = sum_i W[o, i] bf16(x[r, i])      # W: bfloat16 words (cpu_kernels.bfloat16_words)

`VDPBF16PS acc, a, b` takes 32 bfloat16 pairs, 16 lanes of two, and adds to each float32 lane of acc
the two products of its lane: acc[j] += a[2j] b[2j] + a[2j+1] b[2j+1] (each product exact in float32,
denormals read and written as zero). A word of W holds column i in its low half and column i + I/2 in
its high half, so with x packed alike (bf16(x[i]) low, bf16(x[i + I/2]) high: `round_to_words`, to
nearest even as torch rounds) one instruction multiplies 32 weights: a quarter of the instructions of
cpu_kernels.dot_rows, which widens each weight to float32 and multiplies in float32 8 at a time
(numba's compiler vectorises to 256 bits on these CPUs). numba has no such instruction in its Python,
so `tile_dots` writes the loop in LLVM's IR, as clang would for its `_mm512_dpbf16_ps` intrinsic.

What it changes: x is rounded to bfloat16 before each product (as oneDNN's and llama.cpp's bfloat16
products round it), so the model is the float32 model with its weights rounded to bfloat16 and each
matrix product's input too; norms, attention, the residual stream and the cache stay float32.

**Prefetching.** What made it pay was asking for the weights before they are needed: each loop also
prefetches the same part of the rows AHEAD rows further on. Without it a pass's products were memory
time plus arithmetic time (on 2 Intel Xeon cores with AMX, a second input row cost as much with this
instruction as with float32's arithmetic); with it the loads stream while the arithmetic runs. Fused
bfloat16 passes of the default model, each way interleaved pass by pass with dot_rows' in one process
(30 rounds, low quartile, ms; ad-hoc scripts, two runs, docs/results.md "bfloat16's own instruction"):

| inputs | 1 | 2 | 4 | 8 |
|---|---|---|---|---|
| cpu_kernels.dot_rows (widened to float32, rows in pairs) | 15.9 / 15.4 | 19.8 / 19.7 | 26.7 / 26.1 | 38.8 / 38.1 |
| this without prefetching (first run) | 15.9 | 19.7 | 24.0 | 34.7 |
| **this** (second run) | **12.1** | **14.5** | **19.3** | **30.4** |

12.1 ms is 22 GB/s of weights, what a float32 pass streams (538 MB in 24 ms): the memory's limit.

**Batch invariance** (cpu_fused.py's promise): each output of each row is one chain of the same
instructions whatever else is computed: SUMS running sums over the row's words in order, a last
partial vector read with a mask, the sums added and reduced in one fixed tree. Rows are never
grouped, and the OUTPUTS outputs of a tile are independent chains interleaved for the processor's sake,
each summed as it would be alone (`one_dot`, for the last few outputs, is the same code).
"""

import llvmlite.binding
import llvmlite.ir as ir
import numba
import numba.extending
import numpy as np
from numba.core import cgutils

from backends.cpu_kernels import prefetch_instruction

# whether this CPU has the instruction (machine code with it would not run, nor compile, elsewhere)
NATIVE = "+avx512bf16" in llvmlite.binding.get_host_cpu_features().flatten().split(",")

LANES = 16  # float32 sums per instruction (512 bits), each over two weights: 32 weights an instruction
SUMS = 2  # running sums per dot product: the next instruction need not wait for the last one's result
OUTPUTS = 4  # dot products interleaved in one loop (a tile), each x vector loaded once for all of them
AHEAD = 4  # prefetch the rows this many rows further on (the next tile's), as far into them as the loop is

F32, I1, I8, I32, I64 = ir.FloatType(), ir.IntType(1), ir.IntType(8), ir.IntType(32), ir.IntType(64)


class BFloat16(ir.Type):
    """LLVM's bfloat type, which llvmlite does not name (only the instruction's signature needs it)."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, BFloat16)

    def __hash__(self):
        return hash("bfloat")


SUM, WORDS, PAIRS = ir.VectorType(F32, LANES), ir.VectorType(I32, LANES), ir.VectorType(BFloat16(), 2 * LANES)
MASK = ir.VectorType(I1, LANES)


@numba.njit(cache=True)
def round_to_words(x, x_words):
    """x [R, I] float32 (C-contiguous) -> x_words [R, I/2]: bf16(x[r, i]) in the low half of word i,
    bf16(x[r, i + I/2]) in its high half, each rounded to nearest, ties to even (as torch's .bfloat16())."""
    bits, half = x.view(np.uint32), x_words.shape[1]
    for r in range(x.shape[0]):
        for i in range(half):
            x_words[r, i] = bfloat16_bits(bits[r, i]) | (bfloat16_bits(bits[r, half + i]) << np.uint32(16))


@numba.njit(cache=True)
def bfloat16_bits(bits):
    """A float32's bits (uint32) -> the bfloat16 nearest to it, ties to even, in the low 16 bits."""
    return (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


def dot_products(builder, rows_of_w, x, stored):
    """IR: the dot products of each of `rows_of_w` (pointers to words) with `x` (a pointer to words), each
    `stored` words long; returns their float32 sums. One loop over the words, SUMS vectors a turn, then
    the rest a vector a turn, the last partial one read with a mask (its missing lanes 0)."""
    zero = ir.Constant(SUM, [0.0] * LANES)
    instruction = cgutils.get_or_insert_function(builder.module, ir.FunctionType(SUM, [SUM, PAIRS, PAIRS]),
                                                 "llvm.x86.avx512bf16.dpbf16ps.512")
    masked_load = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(WORDS, [WORDS.as_pointer(), I32, MASK, WORDS]), "llvm.masked.load.v16i32.p0")

    def at(pointer, i):
        return builder.bitcast(builder.gep(pointer, [i]), WORDS.as_pointer())

    def multiply_add(total, w, x_vector):
        return builder.call(instruction, [total, builder.bitcast(w, PAIRS), builder.bitcast(x_vector, PAIRS)])

    def plus(i, n):
        return builder.add(i, ir.Constant(I64, n))

    entry = builder.block
    turn, turn_body, rest, rest_body, last, last_body, done = (
        builder.append_basic_block(name) for name in ("turn", "turn_body", "rest", "rest_body", "last", "last_body", "done"))
    builder.branch(turn)
    # SUMS vectors a turn
    builder.position_at_end(turn)
    i = builder.phi(I64)
    i.add_incoming(ir.Constant(I64, 0), entry)
    sums = [[builder.phi(SUM) for _ in range(SUMS)] for _ in rows_of_w]
    for own in sums:
        for s in own:
            s.add_incoming(zero, entry)
    builder.cbranch(builder.icmp_signed("<=", plus(i, LANES * SUMS), stored), turn_body, rest)
    builder.position_at_end(turn_body)
    for k in range(SUMS):
        x_vector = builder.load(at(x, plus(i, LANES * k)), align=4)
        for w, own in zip(rows_of_w, sums):
            own[k].add_incoming(multiply_add(own[k], builder.load(at(w, plus(i, LANES * k)), align=4), x_vector), turn_body)
            prefetch_instruction(builder, builder.gep(w, [builder.add(plus(i, LANES * k),
                                                                      builder.mul(stored, ir.Constant(I64, AHEAD)))]))
    i.add_incoming(plus(i, LANES * SUMS), turn_body)
    builder.branch(turn)
    # then a vector a turn, into the first running sum
    builder.position_at_end(rest)
    j = builder.phi(I64)
    j.add_incoming(i, turn)
    firsts = [builder.phi(SUM) for _ in rows_of_w]
    for first, own in zip(firsts, sums):
        first.add_incoming(own[0], turn)
    builder.cbranch(builder.icmp_signed("<=", plus(j, LANES), stored), rest_body, last)
    builder.position_at_end(rest_body)
    x_vector = builder.load(at(x, j), align=4)
    for w, first in zip(rows_of_w, firsts):
        first.add_incoming(multiply_add(first, builder.load(at(w, j), align=4), x_vector), rest_body)
    j.add_incoming(plus(j, LANES), rest_body)
    builder.branch(rest)
    # the last partial vector, if any
    builder.position_at_end(last)
    builder.cbranch(builder.icmp_signed("<", j, stored), last_body, done)
    builder.position_at_end(last_body)
    left = builder.trunc(builder.sub(stored, j), I32)
    lanes = builder.icmp_signed("<", ir.Constant(WORDS, list(range(LANES))),
                                builder.shuffle_vector(builder.insert_element(ir.Constant(WORDS, ir.Undefined), left,
                                                                              ir.Constant(I32, 0)),
                                                       ir.Constant(WORDS, ir.Undefined), ir.Constant(WORDS, [0] * LANES)))
    none = ir.Constant(WORDS, [0] * LANES)
    x_vector = builder.call(masked_load, [at(x, j), ir.Constant(I32, 4), lanes, none])
    lasts = [multiply_add(first, builder.call(masked_load, [at(w, j), ir.Constant(I32, 4), lanes, none]), x_vector)
             for w, first in zip(rows_of_w, firsts)]
    builder.branch(done)
    # each product's running sums added, and reduced across lanes in one fixed tree
    builder.position_at_end(done)
    totals = []
    for first, end, own in zip(firsts, lasts, sums):
        total = builder.phi(SUM)
        total.add_incoming(first, last)
        total.add_incoming(end, last_body)
        totals.append((total, own))
    results = []
    for total, own in totals:
        for s in own[1:]:
            total = builder.fadd(total, s)
        width = LANES
        while width > 1:
            width //= 2
            low = builder.shuffle_vector(total, total, ir.Constant(ir.VectorType(I32, width), list(range(width))))
            high = builder.shuffle_vector(total, total, ir.Constant(ir.VectorType(I32, width), list(range(width, 2 * width))))
            total = builder.fadd(low, high)
        results.append(builder.extract_element(total, ir.Constant(I32, 0)))
    return results


def tile_of(outputs: int):
    """An intrinsic tile(words, x_words, out, o, r, stored): out[r, o + k] for k < `outputs`, the dot
    products of W's rows o + k with x's row r (`dot_products`)."""
    @numba.extending.intrinsic
    def tile(typingctx, words, x_words, out, o, r, stored):
        def codegen(context, builder, signature, args):
            arrays = [cgutils.create_struct_proxy(signature.args[k])(context, builder, value=args[k]) for k in range(3)]
            o, r, stored = args[3:]

            def row(array, index, element):  # a pointer to array[index, 0]
                stride = builder.extract_value(array.strides, 0)
                start = builder.gep(builder.bitcast(array.data, I8.as_pointer()), [builder.mul(index, stride)])
                return builder.bitcast(start, element.as_pointer())
            w_rows = [row(arrays[0], builder.add(o, ir.Constant(I64, k)), I32) for k in range(outputs)]
            sums = dot_products(builder, w_rows, row(arrays[1], r, I32), stored)
            out_row = row(arrays[2], r, F32)
            for k, total in enumerate(sums):
                builder.store(total, builder.gep(out_row, [builder.add(o, ir.Constant(I64, k))]))
            return context.get_dummy_value()
        return numba.types.none(words, x_words, out, o, r, stored), codegen
    return tile


tile_dots, one_dot = tile_of(OUTPUTS), tile_of(1)


@numba.njit(parallel=True, cache=True)
def dot_rows(words, x, out):
    """out [R, O] = bf16(x) [R, I] W^T, W as bfloat16 words [O, I/2] (float32 x and out, C-contiguous).
    The threads share out W's rows OUTPUTS at a time; each row of x goes alone (see the module docstring)."""
    rows, stored, outputs = x.shape[0], words.shape[1], words.shape[0]
    x_words = np.empty((rows, stored), dtype=np.uint32)
    round_to_words(x, x_words)
    tiles = outputs // OUTPUTS
    for tile in numba.prange(tiles):
        for r in range(rows):
            tile_dots(words, x_words, out, tile * OUTPUTS, r, stored)
    for o in range(tiles * OUTPUTS, outputs):
        for r in range(rows):
            one_dot(words, x_words, out, o, r, stored)
