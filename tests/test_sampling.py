"""The one definition of the sampling distribution p (sampling.py): temperature, top-k, top-p."""

import torch

from sampling import Sampling, target_probs


def test_top_k_and_top_p_shape_the_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(target_probs(logits, Sampling(1.0)), torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(target_probs(logits, Sampling(1.0, top_k=2)), torch.tensor([0.625, 0.375, 0, 0]))
    # top-p keeps the smallest prefix whose mass reaches p: 0.5 < 0.7 <= 0.5 + 0.3
    assert torch.allclose(target_probs(logits, Sampling(1.0, top_p=0.7)), torch.tensor([0.625, 0.375, 0, 0]))
    assert torch.allclose(target_probs(logits, Sampling(1.0, top_p=0.5)), torch.tensor([1.0, 0, 0, 0]))
    sharpened = target_probs(logits, Sampling(0.5))
    assert torch.allclose(sharpened, torch.tensor([0.25, 0.09, 0.0225, 0.0025]) / 0.365)
