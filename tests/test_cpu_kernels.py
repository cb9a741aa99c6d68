"""cpu_kernels.Linear computes nn.Linear's y = x W^T with whichever kernel it picks: every row count
a pass can feed (1 to past MAX_PACKED_ROWS), every leading shape, float32 and (where this CPU has
oneDNN's bfloat16 kernels) bfloat16; a changed weight is laid out anew, a freed one's copy is dropped;
training gets F.linear. (Compiled: tests/test_cpu_compiled.py.)"""

import gc
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from hypothesis import given, strategies as st

from helpers import cheap, random_model as plain_model, tiny_hf_config

from backends import cpu_kernels
from backends.cpu_kernels import Linear, bfloat16_kernels, prepare_kernels

needs_bfloat16 = pytest.mark.skipif(not bfloat16_kernels(), reason="this CPU's oneDNN has no bfloat16 kernels")


def linear(out_features, in_features, dtype=torch.float32, seed=0):
    layer = Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)))
    return layer.to(dtype).requires_grad_(False)


FLOAT32_KERNELS = ["F.linear", "blocked", "numba"] + (["packed"] if cpu_kernels.ONEDNN else [])


@cheap
@given(rows=st.integers(1, Linear.MAX_PACKED_ROWS + 3), out_blocks=st.integers(1, 4), ragged=st.booleans(),
       batched=st.booleans(),
       picks=st.lists(st.sampled_from(FLOAT32_KERNELS + ["mv"]), min_size=Linear.MEASURED_ROWS, max_size=Linear.MEASURED_ROWS))
def test_float32_matches_f_linear_for_every_row_count(rows, out_blocks, ragged, batched, picks):
    out_features = out_blocks * Linear.BLOCK_ROWS + (7 if ragged else 0)  # ragged: no 64-row blocks
    layer = linear(out_features, 48)
    layer.picks = {r: kernel for r, kernel in enumerate(picks, 1)  # any choice prepare_kernels may make on a
                   if cpu_kernels.applies(kernel, r, (Linear.BLOCK_ROWS, 48))}  # CPU (and mv, bfloat16's, at 1 row)
    x = torch.randn(rows, 48, generator=torch.Generator().manual_seed(rows))
    x = x.view(1, rows, 48) if batched else x
    expected = F.linear(x.double(), layer.weight.double())
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-4)



@cheap
@given(rows=st.integers(1, 7), width=st.integers(1, 70), pairs=st.booleans())
def test_numba_loops_multiply_rows_in_pairs_or_alone(rows, width, pairs):
    weight = torch.randn(9, width, generator=torch.Generator().manual_seed(width)).numpy()
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows)).numpy()
    out = np.empty((rows, 9), dtype=np.float32)
    cpu_kernels.dot_rows(weight, x, out, pairs)
    np.testing.assert_allclose(out, x.astype(np.float64) @ weight.T.astype(np.float64), rtol=1e-5, atol=1e-4)


@cheap
@given(rows=st.integers(1, 7), half_width=st.integers(1, 40), pairs=st.booleans())
def test_bfloat16_words_multiply_as_the_weights_rounded_to_bfloat16(rows, half_width, pairs):
    """dot_rows on `bfloat16_words` is x W^T with W rounded to bfloat16, exactly as torch rounds it; the
    words hold every weight once (low half: column i, high half: column i + I/2)."""
    width = 2 * half_width
    weight = torch.randn(9, width, generator=torch.Generator().manual_seed(width)) * 3
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows)).numpy()
    words = cpu_kernels.bfloat16_words(weight)
    assert words.shape == (9, half_width) and words.dtype == np.uint32
    np.testing.assert_array_equal(cpu_kernels.widened(words[0]), weight[0].to(torch.bfloat16).float().numpy())
    out = np.empty((rows, 9), dtype=np.float32)
    cpu_kernels.dot_rows(words, x, out, pairs)
    rounded = weight.to(torch.bfloat16).double().numpy()
    np.testing.assert_allclose(out, x.astype(np.float64) @ rounded.T, rtol=1e-5, atol=1e-4)


def test_rows_are_paired_only_where_a_pair_is_summed_as_each_row_alone():
    """The check fused passes rely on for bit-for-bit rows: a kernel that sums a pair's rows in another
    order than a row alone (here: backwards) fails it; exact sums in one order pass."""
    def backwards_in_pairs(weight, x, out, pairs):
        for r in range(len(x)):
            order = slice(None, None, -1) if len(x) == 2 else slice(None)
            out[r] = [np.float32(sum(w[order] * x[r][order], np.float32(0))) for w in weight]

    def one_order(weight, x, out, pairs):
        for r in range(len(x)):
            out[r] = [np.float32(sum(w * x[r], np.float32(0))) for w in weight]
    assert not cpu_kernels.pairs_sum_as_rows_alone([33], kernel=backwards_in_pairs)
    assert cpu_kernels.pairs_sum_as_rows_alone([33], kernel=one_order)


@cheap
@given(scores=st.lists(st.lists(st.integers(-3, 3), min_size=12, max_size=12), min_size=0, max_size=4),
       k=st.integers(1, 12), leading=st.booleans())
def test_top_k_ids_are_the_largest_scores_first_ties_to_the_lower_id(scores, k, leading):
    """Small integer scores, so that ties are common: the order is a stable sort's, largest first."""
    values = torch.tensor(scores, dtype=torch.float32).reshape(len(scores), 12)
    values = values[None] if leading else values
    expected = [sorted(range(12), key=lambda token: (-row[token], token))[:k] for row in scores]
    assert cpu_kernels.top_k_ids(values, k).reshape(len(scores), k).tolist() == expected

@cheap
@given(scores=st.lists(st.lists(st.integers(-3, 3), min_size=12, max_size=12), min_size=1, max_size=4),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), column=st.booleans())
def test_argmax_ids_are_the_first_largest_score_per_row(scores, dtype, column):
    """Small integer scores, so that ties are common: the first of the largest, as torch's argmax, in
    every dtype (numpy's for float32 and float64, torch's for the rest), on a view that skips columns."""
    values = torch.tensor(scores, dtype=dtype)
    expected = [max(range(12), key=lambda token: (row[token], -token)) for row in scores]
    assert cpu_kernels.argmax_ids(values) == expected
    assert cpu_kernels.argmax_ids(values[0]) == expected[0]  # one row: an int
    if column:  # every other token: a strided view
        assert cpu_kernels.argmax_ids(values[:, ::2]) == [max(range(6), key=lambda t: (row[2 * t], -t)) for row in scores]


def test_numba_kernel_leaves_torch_its_thread_count():
    """numba's first parallel call starts its threads and sets OpenMP's thread count, which torch shares, to
    the number of cores: a process that had asked torch for 1 thread (a test worker) would run on all. Run
    in a fresh process (numba starts its threads once per process), with numba told of 2 cores."""
    program = ("import torch; torch.set_num_threads(1); from backends import cpu_kernels; "
               "x, w = torch.randn(2, 8), torch.randn(64, 8); "
               "torch.testing.assert_close(cpu_kernels.numba_product(x, w), x @ w.T); print(torch.get_num_threads())")
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                         cwd=Path(cpu_kernels.__file__).parent.parent, env={**os.environ, "NUMBA_NUM_THREADS": "2"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["1"]


def test_the_kernel_picked_for_float32():
    layer = linear(2 * Linear.BLOCK_ROWS, 48)
    cpu = torch.device("cpu")
    default = "packed" if cpu_kernels.ONEDNN else "F.linear"
    picks = {rows: layer.kernel(cpu, torch.float32, rows) for rows in range(1, Linear.MAX_PACKED_ROWS + 2)}
    assert {picks[r] for r in range(1, Linear.MAX_PACKED_ROWS + 1)} == {default}  # nothing measured yet
    assert picks[Linear.MAX_PACKED_ROWS + 1] == "F.linear"  # a prefill
    layer.picks = {1: "blocked", 2: "F.linear", 3: "blocked"}  # measured
    assert [layer.kernel(cpu, torch.float32, rows) for rows in range(1, 5)] == ["blocked", "F.linear", "blocked",
                                                                               default]
    ragged = linear(Linear.BLOCK_ROWS + 1, 48)
    ragged.picks = layer.picks
    assert ragged.kernel(cpu, torch.float32, 1) == default  # no blocks to multiply
    assert layer.kernel(cpu, torch.float64, 1) == "F.linear"


@needs_bfloat16
@pytest.mark.parametrize("rows, kernel", [(1, "packed"), (1, "mv"), (2, "packed"), (3, "packed"), (8, "packed"),
                                         (Linear.MAX_PACKED_ROWS, "packed")])
def test_bfloat16_matches_f_linear_to_its_rounding(rows, kernel):
    layer = linear(3 * Linear.BLOCK_ROWS, 96, torch.bfloat16)
    assert layer.kernel(torch.device("cpu"), torch.bfloat16, rows) == "packed"  # nothing measured yet
    layer.picks = {rows: kernel}  # as prepare_kernels may pick
    assert layer.kernel(torch.device("cpu"), torch.bfloat16, rows) == kernel
    x = torch.randn(1, rows, 96, generator=torch.Generator().manual_seed(rows)).bfloat16()
    exact = F.linear(x.double(), layer.weight.double())  # what float32 accumulation approaches
    y = layer(x)
    assert y.dtype == torch.bfloat16
    # the one rounding to bfloat16 (8 bits of mantissa) of a sum of 96 products of size ~1
    torch.testing.assert_close(y.double(), exact, rtol=2 ** -7, atol=0.05)


def test_a_changed_weight_is_laid_out_anew():
    layer = Linear(48, 3 * Linear.BLOCK_ROWS, bias=False).requires_grad_(False)  # not an inference tensor
    x = torch.randn(5, 48)  # 5 rows: the packed kernel
    first = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2)
    torch.testing.assert_close(layer(x), 2 * first, rtol=1e-5, atol=1e-5)
    assert sum(key[0] == layer.weight.data_ptr() for key in cpu_kernels.PACKED_COPIES) == 1  # the old copy replaced


def test_training_gets_gradients_through_f_linear():
    layer = linear(Linear.BLOCK_ROWS, 48).requires_grad_(True)
    x = torch.randn(1, 48, requires_grad=True)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, layer.weight.sum(0, keepdim=True).detach())


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bfloat16)])
def test_prepare_kernels_lays_out_only_what_the_passes_use(dtype, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "FEW_ROW_PICKS", {})
    model = random_model(tiny_hf_config(heads=4, head_dim=16, vocab=192), dtype=dtype)  # rows: 64s
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    prepare_kernels(model, 1)  # vanilla
    laid_out = [has_packed_copy(m) for m in linears]
    # only the copies of the weights whose measured 1-row kernel is oneDNN's (the measurement laid out all)
    assert laid_out == [m.kernel(model.device, dtype, 1) == "packed" for m in linears]
    assert {m.kernel(model.device, dtype, 1) for m in linears} <= set(cpu_kernels.candidates(dtype))
    assert {m.kernel(model.device, dtype, 2) for m in linears} == {"F.linear"}  # a prefill: no copy needed
    prepare_kernels(model)  # trees of guesses
    assert all(has_packed_copy(m) for m in linears) == torch.backends.mkldnn.is_available()


def random_model(hf_config: dict, seed: int = 0, dtype=torch.float64):
    """A random model whose layers are this module's Linear, as the fused and compiled backends make them."""
    model = plain_model(hf_config, seed, dtype)
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = Linear
    return model


HEAD_SHAPE = (192, 64)  # the tiny model's LM head (vocabulary 192): a shape no layer has


@pytest.mark.parametrize("fastest, head_fastest",
                         [(["blocked", "F.linear", "numba", "packed"], ["packed", "numba", "packed", "F.linear"]),
                          (["numba", "packed", "blocked", "F.linear"], ["F.linear", "packed", "numba", "blocked"])])
def test_few_rows_take_the_kernels_this_cpu_measured_fastest_once(fastest, head_fastest, monkeypatch):
    """prepare_kernels gives each layer of a float32 model the fastest kernel measured for its weight's
    shape at each of 1-MEASURED_ROWS rows, once per process (a second model of the same shapes is not
    measured again); plain decoding measures 1 row and keeps oneDNN's copy only where it was picked."""
    monkeypatch.setattr(cpu_kernels, "FEW_ROW_PICKS", {})
    measured = []

    def kernel_times(linears, rows_list, repeats, names, per_shape):  # per shape, the r-th fastest at r rows
        measured.append((rows_list, names))
        assert per_shape
        shapes = {tuple(m.weight.shape) for m in linears}
        return {(name, rows, shape): 10.0 if name == (head_fastest if shape == HEAD_SHAPE else fastest)[rows - 1]
                else 11.0 + names.index(name) for name in names for rows in rows_list for shape in shapes}

    monkeypatch.setattr(cpu_kernels, "kernel_times", kernel_times)
    model = random_model(tiny_hf_config(heads=4, head_dim=16, vocab=192), dtype=torch.float32)  # rows: 64s
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert tuple(model.lm_head.weight.shape) == HEAD_SHAPE and sum(tuple(m.weight.shape) == HEAD_SHAPE for m in linears) == 1

    def kernels(model, rows):  # the layers', the LM head's
        layers = {m.kernel(model.device, torch.float32, rows) for m in model.modules()
                  if isinstance(m, Linear) and m is not model.lm_head}
        return layers, model.lm_head.kernel(model.device, torch.float32, rows)

    def candidate(kernel):  # (measured only where oneDNN is)
        return kernel if kernel in FLOAT32_KERNELS else "F.linear"
    prepare_kernels(model, 1)  # vanilla
    assert measured == [([1], FLOAT32_KERNELS)]
    assert kernels(model, 1) == ({candidate(fastest[0])}, candidate(head_fastest[0]))
    for rows in (2, 4, 64):  # a prefill needs no copy of the weights
        assert kernels(model, rows) == ({"F.linear"}, "F.linear")
    assert [has_packed_copy(m) for m in linears] == [m.kernel(model.device, torch.float32, 1) == "packed" for m in linears]
    prepare_kernels(model)  # trees of guesses
    if not cpu_kernels.ONEDNN:
        return
    assert measured[1] == ([1, 2, 3, 4], FLOAT32_KERNELS)
    picks = [kernels(model, rows) for rows in (1, 2, 3, 4, 5)]
    assert picks == [({layer}, head) for layer, head in zip(fastest, head_fastest)] + [({"packed"}, "packed")]
    monkeypatch.setattr(cpu_kernels, "kernel_times", lambda *a, **k: pytest.fail("measured again"))
    again = random_model(tiny_hf_config(heads=4, head_dim=16, vocab=192), seed=1, dtype=torch.float32)
    prepare_kernels(again)
    assert [kernels(again, rows) for rows in (1, 2, 3, 4, 5)] == picks


def has_packed_copy(linear: Linear) -> bool:
    return any(address == linear.weight.data_ptr() for address, *_ in cpu_kernels.PACKED_COPIES)


def test_a_packed_copy_goes_with_its_weight():
    """A copy kept after its weight is freed would be found by the next tensor at that address."""
    layer = linear(Linear.BLOCK_ROWS, 48)
    layer(torch.randn(5, 48))
    address = layer.weight.data_ptr()
    assert any(key[0] == address for key in cpu_kernels.PACKED_COPIES)
    del layer
    gc.collect()
    assert not any(key[0] == address for key in cpu_kernels.PACKED_COPIES)


@pytest.mark.parametrize("rows", [1, 2, 3, 8])
def test_outputs_are_row_major_whatever_the_input_layout(rows):
    """The next layer's blocked bmm takes 5x as long on column-major rows (a .T view): every output,
    even of an input in that layout, is contiguous."""
    layer = linear(2 * Linear.BLOCK_ROWS, 48)
    column_major = torch.randn(48, rows).T.reshape(1, rows, 48)  # a view: strides (.., 1, rows)
    y = layer(column_major)
    assert y.is_contiguous()
    torch.testing.assert_close(y, F.linear(column_major, layer.weight), rtol=1e-5, atol=1e-4)


def test_kernel_times_puts_the_memory_floor_next_to_every_candidate():
    """bench.py latency's kernel table: each candidate for the dtype, and MEMORY_FLOOR (the same weights
    read once), for every row count: the yardstick of "at the memory limit". Per shape (what
    few_row_picks chooses by), the bmm only for the shapes with 64-row blocks; a whole pass has it only
    if every shape has them; mv only for 1 row."""
    layers = [linear(Linear.BLOCK_ROWS, 32, seed=1), linear(2 * Linear.BLOCK_ROWS, Linear.BLOCK_ROWS, seed=2)]
    times = cpu_kernels.kernel_times(layers, [1, 3], repeats=1)
    kernels = {cpu_kernels.MEMORY_FLOOR, *FLOAT32_KERNELS, "mv"}
    assert set(times) == {(kernel, rows) for kernel in kernels for rows in (1, 3)} - {("mv", 3)}
    assert all(ms > 0 for ms in times.values())
    ragged = layers + [linear(Linear.BLOCK_ROWS + 1, 32, seed=3)]
    shapes = {(64, 32), (128, 64), (65, 32)}
    per_shape = cpu_kernels.kernel_times(ragged, [1], repeats=1, per_shape=True)
    assert set(per_shape) == {(kernel, 1, shape) for kernel in kernels for shape in shapes} - {("blocked", 1, (65, 32))}
    assert all(ms > 0 for ms in per_shape.values())
    assert {kernel for kernel, _ in cpu_kernels.kernel_times(ragged, [1], repeats=1)} == kernels - {"blocked"}
