"""The forward pass against Hugging Face transformers: the default model, and random tiny checkpoints
(loading, GQA, tied embeddings, RoPE scaling). Through the KV cache: test_kv_cache.py."""

import pytest
import torch
from hypothesis import given, strategies as st

from conftest import full_logits, tiny_hf_config, write_checkpoint
from decode import generate
from model import load_checkpoint

PROMPTS = ["What is the capital of France? Answer in one sentence.",
           "Write a Python function that returns the n-th Fibonacci number."]


# ---- the real default model against transformers ---------------------------------------------------

@pytest.fixture(scope="module")
def hf_reference(default_model_dir):
    transformers = pytest.importorskip("transformers")
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
    transformers = pytest.importorskip("transformers")
    config = tiny_hf_config(layers=layers, heads=kv_heads * group, kv_heads=kv_heads, tied=tied,
                            rope_scaling=scaling)
    folder = write_checkpoint(tmp_path_factory.mktemp("ckpt"), config, seed)
    ours = load_checkpoint(folder, torch.float64)
    theirs = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    sequence = torch.randint(0, config["vocab_size"], (40,), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        expected = theirs(sequence[None]).logits[0]
        # transformers computes RMSNorm and RoPE angles in float32 even in a float64 model, which
        # moves these logits by ~1e-5; a wrong layout, GQA grouping or scaling moves them by ~1
        assert torch.allclose(full_logits(ours, sequence.tolist()), expected, atol=1e-4, rtol=0)
