"""Grader of a1: RMSNorm, rotary position embeddings and grouped-query attention against naive
formulas (float64), RoPE's defining property (a query-key score depends on the positions' difference
only), and the whole model with your functions inside against Hugging Face transformers' Llama."""

import math

import torch
from helpers import full_logits, tiny_hf_config, transformers_logits, write_checkpoint
from hypothesis import given, strategies as st

import adapters
import checkpoint
import model as model_module

rms_norm = adapters.implementation("a1_llama", "rms_norm")
rotary_cos_sin = adapters.implementation("a1_llama", "rotary_cos_sin")
apply_rotary = adapters.implementation("a1_llama", "apply_rotary")
grouped_attention = adapters.implementation("a1_llama", "grouped_attention")
seeds = st.integers(0, 2**16)


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@given(seeds, st.sampled_from([1e-3, 1e-1, 1.0, 3.0, 1e2]))
def test_rms_norm_divides_by_the_root_mean_square(seed, scale):
    x, weight = randn(3, 8, seed=seed) * scale, randn(8, seed=seed + 1)  # small x: eps matters as much as x
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    got = rms_norm(x, weight, 1e-6)
    assert torch.allclose(got, expected, rtol=1e-10, atol=1e-12), (
        f"rms_norm is x / sqrt(mean(x^2) + eps) * weight over the last dimension: for x[0] = {x[0].tolist()} "
        f"that is {expected[0].tolist()}, not {got[0].tolist()}")


def test_rms_norm_of_bfloat16_sums_in_float32_and_rounds_once():
    """bfloat16 keeps 8 bits of mantissa: summed in it, the mean of squares loses the small variance.
    Your norm of a bfloat16 x must equal the float32 norm of the same values, rounded to bfloat16 once,
    then times the weight."""
    x = (randn(4, 64, seed=0) * 3).bfloat16()
    weight = (randn(64, seed=1).abs() + 0.5).bfloat16()
    wide = x.float()
    expected = (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16() * weight
    got = rms_norm(x, weight, 1e-5)
    assert got.dtype == torch.bfloat16, f"rms_norm returns x's dtype (bfloat16), not {got.dtype}"
    assert torch.equal(got, expected), (
        "for a bfloat16 x, compute x / sqrt(mean(x^2) + eps) in at least float32 (at_least_float32) and round "
        f"to x's dtype once, then multiply by the weight: row 0 starts {expected[0, :4].tolist()}, "
        f"not {got[0, :4].tolist()}")


def rotated(x, positions, inv_freq):
    """Naive RoPE in Llama's rotate-half layout: the pair (x_i, x_{i+E/2}) turns by position * theta_i."""
    out, half = x.clone(), x.shape[-1] // 2
    for t, position in enumerate(positions):
        for i in range(half):
            angle = position * float(inv_freq[i])
            a, b = x[..., t, i], x[..., t, i + half]
            out[..., t, i], out[..., t, i + half] = a * math.cos(angle) - b * math.sin(angle), a * math.sin(angle) + b * math.cos(angle)
    return out


@given(seeds, st.lists(st.integers(0, 500), min_size=1, max_size=5))
def test_rope_turns_each_pair_by_position_times_its_frequency(seed, positions):
    inv_freq = 10000.0 ** -(torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    x = randn(1, 2, len(positions), 8, seed=seed)
    cos, sin = rotary_cos_sin(inv_freq, torch.tensor([positions]), torch.float64)
    assert tuple(cos.shape) == (1, 1, len(positions), 8), f"cos and sin are [B, 1, T, E], not {tuple(cos.shape)}"
    got, expected = apply_rotary(x, cos, sin), rotated(x, positions, inv_freq)
    where = (got - expected).abs().amax(dim=(0, 1))  # [T, E]
    t, e = divmod(int(where.argmax()), 8)
    assert torch.allclose(got, expected, atol=1e-9), (
        f"at position {positions[t]}, the pair (x_{e % 4}, x_{e % 4 + 4}) must turn by {positions[t]} x theta_{e % 4} "
        f"(Llama's rotate-half layout: x_i pairs with x_(i+E/2)); value {e} is {float(got[0, 0, t, e]):.6f}, "
        f"not {float(expected[0, 0, t, e]):.6f}")


@given(seeds, st.lists(st.integers(0, 500), min_size=2, max_size=2), st.integers(1, 4))
def test_each_row_of_a_batch_turns_by_its_own_positions(seed, starts, length):
    inv_freq = 10000.0 ** -(torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    positions = [list(range(start, start + length)) for start in starts]  # two sequences, B = 2
    x = randn(2, 2, length, 8, seed=seed)
    cos, sin = rotary_cos_sin(inv_freq, torch.tensor(positions), torch.float64)
    assert tuple(cos.shape) == (2, 1, length, 8), f"for B = 2, cos and sin are [B, 1, T, E], not {tuple(cos.shape)}"
    got = apply_rotary(x, cos, sin)
    for b in range(2):
        assert torch.allclose(got[b], rotated(x[b], positions[b], inv_freq), atol=1e-9), (
            f"positions {positions}: row {b} of the batch must turn by its own positions {positions[b]}")


@given(seeds, st.integers(0, 200), st.integers(0, 200), st.integers(0, 200))
def test_a_rotated_score_depends_on_the_positions_difference_only(seed, m, n, shift):
    inv_freq = 10000.0 ** -(torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    q, k = randn(1, 1, 1, 8, seed=seed), randn(1, 1, 1, 8, seed=seed + 1)

    def score(a, b):
        qa = apply_rotary(q, *rotary_cos_sin(inv_freq, torch.tensor([[a]]), torch.float64))
        kb = apply_rotary(k, *rotary_cos_sin(inv_freq, torch.tensor([[b]]), torch.float64))
        return float((qa * kb).sum())
    assert math.isclose(score(m, n), score(m + shift, n + shift), abs_tol=1e-9), (
        f"RoPE's point: q at {m} and k at {n} score {score(m, n):.6f}, at {m + shift} and {n + shift} "
        f"{score(m + shift, n + shift):.6f}; a score must depend on the positions' difference only")


def naive_attention(q, k, v, mask):
    B, H, T, E = q.shape
    K = k.shape[1]
    out = torch.zeros_like(q)
    for h in range(H):
        kv = h // (H // K)  # G = H / K consecutive query heads share one K/V head
        scores = q[:, h] @ k[:, kv].transpose(-1, -2) / math.sqrt(E)
        out[:, h] = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v[:, kv]
    return out


@given(seeds, st.sampled_from([(4, 1), (4, 2), (4, 4), (6, 3)]), st.integers(1, 4), st.integers(0, 4))
def test_grouped_attention_is_attention_with_shared_key_value_heads(seed, heads, new, cached):
    H, K = heads
    q, k, v = randn(1, H, new, 8, seed=seed), randn(1, K, cached + new, 8, seed=seed + 1), randn(1, K, cached + new, 8, seed=seed + 2)
    mask = torch.ones(new, cached + new, dtype=torch.bool).tril(cached)  # causal after the cache
    got, expected = grouped_attention(q, k, v, mask), naive_attention(q, k, v, mask)
    wrong = [h for h in range(H) if not torch.allclose(got[:, h], expected[:, h], atol=1e-10)]
    assert not wrong, (f"H = {H} query heads, K = {K} K/V heads: query head {wrong[0]} must use K/V head "
                       f"{wrong[0] // (H // K)} (G = H / K consecutive query heads share one), scores scaled by "
                       f"1/sqrt(E), masked, softmaxed")


@given(seeds, st.integers(0, 6))
def test_no_mask_is_attention_everywhere(seed, cached):
    q, k, v = randn(1, 4, 1, 8, seed=seed), randn(1, 2, cached + 1, 8, seed=seed + 1), randn(1, 2, cached + 1, 8, seed=seed + 2)
    everywhere = torch.ones(1, cached + 1, dtype=torch.bool)
    got = grouped_attention(q, k, v, None)  # a plain decoding step: its one token sees the whole cache
    assert torch.allclose(got, naive_attention(q, k, v, everywhere), atol=1e-10), (
        f"mask None means attention allowed everywhere: one query over {cached + 1} keys must weigh them all, "
        f"as a mask of all True would")


@given(seeds, st.integers(1, 4), st.integers(0, 4))
def test_each_row_of_a_batch_is_masked_by_its_own_mask(seed, new, cached):
    q, k, v = randn(2, 4, new, 8, seed=seed), randn(2, 2, cached + new, 8, seed=seed + 1), randn(2, 2, cached + new, 8, seed=seed + 2)
    causal = torch.ones(new, cached + new, dtype=torch.bool).tril(cached)
    own = torch.zeros_like(causal)
    own[torch.arange(new), cached + torch.arange(new)] = True  # every row sees itself, at least
    mask = torch.stack([causal, causal & (torch.arange(cached + new) % 2 == 0) | own])
    got = grouped_attention(q, k, v, mask)  # mask [B, T, S]: each sequence its own (APAR's threads)
    for b in range(2):
        assert torch.allclose(got[b:b + 1], naive_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], mask[b]), atol=1e-10), (
            f"a [B, T, S] mask: row {b} of the batch must attend where mask[{b}] allows, {mask[b].int().tolist()}")


def test_the_model_with_your_functions_is_transformers_llama(monkeypatch, tmp_path):
    for name in ["rms_norm", "rotary_cos_sin", "apply_rotary", "grouped_attention"]:
        adapters.install(monkeypatch, "a1_llama", name, model_module)
    config = tiny_hf_config(layers=2, heads=4, kv_heads=2)
    folder = write_checkpoint(tmp_path / "tiny", config, seed=3)
    sequence = torch.randint(0, config["vocab_size"], (24,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        ours = full_logits(checkpoint.load_checkpoint(folder, torch.float64), sequence)
    theirs = transformers_logits(folder, sequence)
    assert torch.allclose(ours, theirs, atol=1e-4), (
        f"the tiny model with your functions inside gives other logits than transformers' Llama "
        f"(largest difference {float((ours - theirs).abs().max()):.3g} at position {int((ours - theirs).abs().amax(-1).argmax())})")
