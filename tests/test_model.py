"""The forward pass against Hugging Face transformers: the default model, and random tiny checkpoints
(loading, GQA, tied embeddings, RoPE scaling). Through the KV cache: test_kv_cache.py."""

import pytest
import torch
from hypothesis import given, strategies as st

from helpers import full_logits, tiny_model, tiny_hf_config, transformers_logits, write_checkpoint
from decode import generate
from kv_cache import KVCache
from checkpoint import load_checkpoint
from drafters import logits_after
from model import causal_mask, grouped_attention, rms_norm, sdpa_attention

transformers = pytest.importorskip("transformers")

PROMPTS = ["What is the capital of France? Answer in one sentence.",
           "Write a Python function that returns the n-th Fibonacci number."]


# ---- the real default model against transformers ---------------------------------------------------

@pytest.fixture(scope="module")
def hf_reference(default_model_dir):
    return transformers.LlamaForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_default_model_logits_match_transformers(default_model, default_tokenizer, hf_reference, prompt):
    ids = default_tokenizer.prompt_ids(prompt, raw=False)
    with torch.inference_mode():
        ours = full_logits(default_model, ids)
        theirs = hf_reference(torch.tensor([ids])).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-3


@pytest.mark.parametrize("prompt", PROMPTS)
def test_default_model_greedy_matches_transformers_generate(default_model, default_tokenizer,
                                                            hf_reference, prompt):
    ids = default_tokenizer.prompt_ids(prompt, raw=False)
    with torch.inference_mode():
        ours = generate(default_model, ids, max_new_tokens=40, eos_ids=default_tokenizer.eos_ids)
        theirs = hf_reference.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False,
                                       eos_token_id=sorted(default_tokenizer.eos_ids))[0, len(ids):]
    assert ours.token_ids == theirs.tolist()


# ---- tiny random checkpoints against transformers: loading, GQA, tying, RoPE scaling -----------------

ROPE_SCALINGS = [None,
                 {"rope_type": "linear", "factor": 2.0},
                 {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}]  # head_dim 8: one frequency in each of
                                                             # llama3's kept, interpolated, scaled bands


@given(layers=st.integers(1, 3), kv_heads=st.integers(1, 3), group=st.integers(1, 3),
       tied=st.booleans(), scaling=st.sampled_from(ROPE_SCALINGS), seed=st.integers(0, 2**16))
def test_tiny_checkpoints_match_transformers(tmp_path_factory, layers, kv_heads, group, tied, scaling, seed):
    config = tiny_hf_config(layers=layers, heads=kv_heads * group, kv_heads=kv_heads, tied=tied,
                            rope_scaling=scaling)
    folder = write_checkpoint(tmp_path_factory.mktemp("ckpt"), config, seed)
    sequence = torch.randint(0, config["vocab_size"], (40,), generator=torch.Generator().manual_seed(seed)).tolist()
    with torch.inference_mode():
        # what is left is transformers' inverse frequencies, rounded to float32 (~2e-5 here); a wrong
        # layout, GQA grouping or scaling moves these logits by ~1
        assert torch.allclose(full_logits(load_checkpoint(folder, torch.float64), sequence),
                              transformers_logits(folder, sequence), atol=1e-4, rtol=0)


@given(seed=st.integers(0, 2**16), cached=st.integers(0, 20))
def test_one_new_input_without_a_mask_sees_the_whole_cache(seed, cached):
    """A pass over one input with no mask (plain decoding: decode.score_tree passes none, and attention
    then applies none) is the same pass, bit for bit, as with the mask of every cached slot and itself."""
    model = tiny_model()
    tokens = torch.randint(0, model.config.vocab_size, (cached + 1,), generator=torch.Generator().manual_seed(seed))
    out = {}
    for masked in (True, False):
        cache = KVCache.for_model(model, cached + 1)
        with torch.inference_mode():
            if cached:
                logits_after(model, tokens[:cached].tolist(), cache)
            slots = cache.claim(1)
            out[masked] = model(tokens[None, cached:], positions=torch.tensor([cached]), cache=cache, slots=slots,
                                mask=causal_mask(cached, 1, "cpu") if masked else None)[0]
    assert torch.equal(out[True], out[False])


def test_the_fingerprint_names_the_checkpoint_whatever_the_dtype(tmp_path, default_model_dir):
    """Trained parts check the checkpoint they were made for: loading it in bfloat16 must not make it
    "another model" (the fingerprint once hashed the rounded weights), while other weights must."""
    from methods import medusa
    from methods.artifacts import shipped_artifact

    folder = write_checkpoint(tmp_path / "a", tiny_hf_config())
    other = write_checkpoint(tmp_path / "b", tiny_hf_config(), seed=1)
    prints = {dtype: load_checkpoint(folder, dtype).fingerprint
              for dtype in (torch.float32, torch.bfloat16, torch.float64)}
    assert len({str(p) for p in prints.values()}) == 1
    assert load_checkpoint(other).fingerprint != prints[torch.float32]
    model = load_checkpoint(default_model_dir, torch.bfloat16)
    drafter = medusa.load_drafter(model, shipped_artifact("medusa", default_model_dir), 6)  # not refused
    assert drafter.predicted_tokens_per_pass > 1


@given(seed=st.integers(0, 2**16), batch=st.integers(1, 2), new=st.integers(1, 5), cached=st.integers(0, 6),
       mask_kind=st.sampled_from(["none", "shared", "per sequence"]))
def test_the_written_attention_and_torchs_fused_one_agree(seed, batch, new, cached, mask_kind):
    """grouped_attention (the formula, what the course grades) and sdpa_attention (torch's fused kernel,
    which the compiled and CUDA-graphs backends turn on) compute the same attention, for any mask."""
    generator = torch.Generator().manual_seed(seed)
    H, K, E, S = 6, 2, 8, cached + new
    q = torch.randn(batch, H, new, E, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(batch, K, S, E, generator=generator, dtype=torch.float64) for _ in range(2))
    mask = {"none": None, "shared": causal_mask(cached, new, "cpu"),
            "per sequence": torch.rand(batch, new, S, generator=generator) < 0.6}[mask_kind]
    if mask is not None:
        mask[..., cached:] |= torch.eye(new, dtype=torch.bool)  # every input sees itself
    torch.testing.assert_close(grouped_attention(q, k, v, mask), sdpa_attention(q, k, v, mask), rtol=1e-12, atol=1e-12)


def test_rms_norm_sums_a_16_bit_input_in_float32():
    """In bfloat16 the mean of squares is taken in float32 and the normalised x rounded once: the same
    as normalising the float32 copy; summed in bfloat16 itself it lands elsewhere (and changes tokens)."""
    x = (torch.randn(4, 576, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    weight = (torch.rand(576, generator=torch.Generator().manual_seed(1)) + 0.5).bfloat16()

    def normalised(x):
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-5)
    assert torch.equal(rms_norm(x, weight, 1e-5), normalised(x.float()).bfloat16() * weight)
    assert not torch.equal(normalised(x.float()).bfloat16() * weight, normalised(x) * weight)
