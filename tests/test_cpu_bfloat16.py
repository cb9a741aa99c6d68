"""cpu_bfloat16.dot_rows (AVX512-BF16's instruction, on CPUs that have it) is x W^T with x and W rounded
to bfloat16 as torch rounds them, for every width (its last partial vector included) and row count, and
computes each row bit for bit as it computes that row alone."""

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from helpers import cheap

from backends import cpu_bfloat16
from backends.cpu_kernels import bfloat16_words

pytestmark = pytest.mark.skipif(not cpu_bfloat16.NATIVE, reason="this CPU has no AVX512-BF16")


@cheap
@given(rows=st.integers(1, 4), width=st.integers(1, 80).map(lambda half: 2 * half), outputs=st.integers(1, 11))
def test_products_are_the_inputs_and_weights_rounded_to_bfloat16_multiplied_exactly(rows, width, outputs):
    weight = torch.randn(outputs, width, generator=torch.Generator().manual_seed(width)) * 3
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows + width)).numpy()
    out = np.empty((rows, outputs), dtype=np.float32)
    cpu_bfloat16.dot_rows(bfloat16_words(weight), x, out)
    exact = torch.from_numpy(x).bfloat16().double() @ weight.bfloat16().double().T
    # (float32 sums of up to 160 products of size ~3: a few float32 roundings of the total)
    np.testing.assert_allclose(out, exact.numpy(), rtol=1e-5, atol=1e-4)


@cheap
@given(x=st.lists(st.floats(width=32, allow_nan=False), min_size=2, max_size=40).filter(lambda x: len(x) % 2 == 0))
def test_inputs_round_to_nearest_bfloat16_ties_to_even_as_torch_rounds(x):
    x = np.array([x], dtype=np.float32)
    words = np.empty((1, x.shape[1] // 2), dtype=np.uint32)
    cpu_bfloat16.round_to_words(x, words)
    rounded = torch.from_numpy(x).bfloat16().view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
    half = x.shape[1] // 2
    np.testing.assert_array_equal(words, rounded[:, :half] | (rounded[:, half:] << 16))


@cheap
@given(rows=st.integers(2, 6), width=st.sampled_from([32, 34, 64, 96, 200]), outputs=st.integers(1, 13),
       seed=st.integers(0, 3))
def test_a_row_is_computed_bit_for_bit_as_it_is_alone(rows, width, outputs, seed):
    generator = torch.Generator().manual_seed(seed)
    words = bfloat16_words(torch.randn(outputs, width, generator=generator))
    x = torch.randn(rows, width, generator=generator).numpy()
    together, alone = np.empty((rows, outputs), dtype=np.float32), np.empty((1, outputs), dtype=np.float32)
    cpu_bfloat16.dot_rows(words, x, together)
    for r in range(rows):
        cpu_bfloat16.dot_rows(words, x[r:r + 1].copy(), alone)
        np.testing.assert_array_equal(together[r], alone[0])
