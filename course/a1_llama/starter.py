"""Assignment a1_llama: your code (see handout.md). Each stub below has the reference's
signature and docstring; replace its NotImplementedError with your implementation, then run

    python -m pytest course/a1_llama
"""


def rms_norm(x, weight, eps: float):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension (Zhang and Sennrich 2019).
    x: [..., D], weight: [D]."""
    raise NotImplementedError("a1_llama: implement rms_norm")


def rotary_cos_sin(inv_freq, positions, dtype):
    """cos and sin of position * theta_i, laid out for rotate-half: [B, 1, T, E]."""
    raise NotImplementedError("a1_llama: implement rotary_cos_sin")


def apply_rotary(x, cos, sin):
    """Rotate each pair (x_i, x_{i+E/2}) by its angle. x: [B, heads, T, E]."""
    raise NotImplementedError("a1_llama: implement apply_rotary")


def grouped_attention(q, k, v, mask):
    """softmax(q k^T / sqrt(E) + mask) v, with G = H/K consecutive query heads per K/V head (Ainslie
    et al. 2023), where the mask adds -inf wherever attention is not allowed.

    q: [B, H, T, E]; k, v: [B, K, S, E]; mask: [T, S] (shared by the batch) or [B, T, S] (each sequence
    its own, APAR's threads), True where attention is allowed, or None: allowed everywhere (a plain
    decoding step's one token, which sees the whole cache).
    """
    raise NotImplementedError("a1_llama: implement grouped_attention")
