"""The one definition of the sampling distribution p (sampling.py): temperature, top-k, top-p, and
the nucleus found without sorting the whole vocabulary when it need not be."""

import torch
from hypothesis import given, strategies as st

from helpers import cheap
from sampling import Sampling, nucleus, target_probs


def test_top_k_and_top_p_shape_the_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(target_probs(logits, Sampling(1.0)), torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(target_probs(logits, Sampling(1.0, top_k=2)), torch.tensor([0.625, 0.375, 0, 0]))
    # top-p keeps the smallest prefix whose mass reaches p: 0.5 < 0.7 <= 0.5 + 0.3
    assert torch.allclose(target_probs(logits, Sampling(1.0, top_p=0.7)), torch.tensor([0.625, 0.375, 0, 0]))
    assert torch.allclose(target_probs(logits, Sampling(1.0, top_p=0.5)), torch.tensor([1.0, 0, 0, 0]))
    sharpened = target_probs(logits, Sampling(0.5))
    assert torch.allclose(sharpened, torch.tensor([0.25, 0.09, 0.0225, 0.0025]) / 0.365)


@cheap
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 4), vocab=st.sampled_from([5, 300, 2000]),
       spread=st.sampled_from([0.1, 1.0, 8.0]), top_p=st.floats(0.05, 0.999))
def test_the_nucleus_is_the_smallest_likeliest_set_reaching_top_p(seed, rows, vocab, spread, top_p):
    """Against the plain definition, token by token: for flat rows (the nucleus lies beyond the tokens
    sorted first), peaked ones, and a batch that mixes them."""
    probs = torch.softmax(torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed),
                                      dtype=torch.float64) * spread, -1)
    for row, kept in zip(probs, nucleus(probs, top_p)):
        order = sorted(range(vocab), key=lambda t: -float(row[t]))
        mass_before = 0.0
        for token in order:
            assert float(kept[token]) == (float(row[token]) if mass_before < top_p - 1e-12 else 0.0) \
                or abs(mass_before - top_p) < 1e-9  # a token right at the boundary may go either way
            mass_before += float(row[token])
