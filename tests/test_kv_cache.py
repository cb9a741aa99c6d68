"""The KV cache: through it, any chunking, any rollback and any `keep` of a tree path give the same
logits as a full forward over the resulting sequence; and its own bookkeeping."""

import pytest
import torch
from hypothesis import given, strategies as st

from helpers import full_logits, random_model, tiny_hf_config
from kv_cache import KVCache

# ---- the cache: chunking, rollback and keeping tree nodes change nothing ---------------------------

@st.composite
def tiny_configs(draw):
    kv_heads = draw(st.integers(1, 3))
    return tiny_hf_config(layers=draw(st.integers(1, 3)), heads=kv_heads * draw(st.integers(1, 3)),
                          kv_heads=kv_heads, head_dim=draw(st.sampled_from([4, 8])),
                          vocab=32, tied=draw(st.booleans()))


def ancestors(parents, node):
    """Indices from the tree's root down to `node`, ascending (parents[i] < i, -1 for a root)."""
    path = []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


@given(config=tiny_configs(), seed=st.integers(0, 2**16), data=st.data())
def test_cached_decoding_equals_full_forward(config, seed, data):
    """Feed random causal chunks, roll back, and verify random trees keeping one root-to-node path;
    every logit along the way, and the cache left at the end, must equal a plain full forward over
    the sequence the cache then represents."""
    model = random_model(config, seed)
    token = st.integers(0, config["vocab_size"] - 1)
    cache = KVCache.for_model(model, capacity=80)
    sequence = []

    def feed_chunk(tokens):
        start = cache.length
        got = model(torch.tensor([tokens]), positions=torch.arange(start, start + len(tokens)), cache=cache,
                    slots=cache.claim(len(tokens)))[0][0]
        sequence.extend(tokens)
        assert torch.allclose(got, full_logits(model, sequence)[start:], atol=1e-10, rtol=0)

    def feed_tree(tokens, parents):
        start, count = cache.length, len(tokens)
        depth = [len(ancestors(parents, i)) - 1 for i in range(count)]
        mask = torch.ones(count, start + count, dtype=torch.bool)
        mask[:, start:] = False
        for i in range(count):
            mask[i, [start + a for a in ancestors(parents, i)]] = True
        got = model(torch.tensor([tokens]), positions=torch.tensor(depth) + start, cache=cache,
                    slots=cache.claim(count), mask=mask)[0][0]
        for i in range(count):
            path_tokens = [tokens[a] for a in ancestors(parents, i)]
            assert torch.allclose(got[i], full_logits(model, sequence + path_tokens)[-1], atol=1e-10, rtol=0)
        kept = ancestors(parents, data.draw(st.integers(0, count - 1), label="accepted node"))
        cache.keep(start, kept)
        sequence.extend(tokens[i] for i in kept)

    feed_chunk(data.draw(st.lists(token, min_size=1, max_size=6), label="prompt"))
    for _ in range(data.draw(st.integers(1, 6), label="steps")):
        action = data.draw(st.sampled_from(["chunk", "rollback", "tree"]))
        if action == "chunk":
            feed_chunk(data.draw(st.lists(token, min_size=1, max_size=5)))
        elif action == "rollback" and len(sequence) > 1:
            cache.truncate(data.draw(st.integers(1, len(sequence) - 1), label="rollback to"))
            del sequence[cache.length:]
        elif action == "tree":
            count = data.draw(st.integers(1, 7), label="tree size")
            parents = [data.draw(st.integers(-1, i - 1), label="parent") for i in range(count)]
            feed_tree(data.draw(st.lists(token, min_size=count, max_size=count)), parents)
        assert cache.length == len(sequence)
    feed_chunk([data.draw(token, label="probe")])


# ---- the cache's own bookkeeping ---------------------------------------------------------------------

def small_cache():
    cache = KVCache(num_layers=2, num_kv_heads=1, head_dim=2, capacity=8)
    slots = cache.claim(6)
    for layer in range(2):
        values = torch.arange(6, dtype=torch.float32).view(1, 1, 6, 1).expand(1, 1, 6, 2) + 10 * layer
        cache.write(layer, slots, values, -values)
    return cache


def test_keep_packs_the_chosen_slots_after_start():
    cache = small_cache()
    cache.keep(2, [0, 2, 3])  # slots 2, 4, 5 move to 2, 3, 4
    assert cache.length == 5
    assert cache.keys[1, 0, 0, :5, 0].tolist() == [10, 11, 12, 14, 15]
    assert cache.values[0, 0, 0, :5, 0].tolist() == [0, -1, -2, -4, -5]


def test_cache_refuses_bad_operations():
    cache = small_cache()
    with pytest.raises(ValueError):
        cache.keep(2, [2, 1])  # not ascending
    with pytest.raises(ValueError):
        cache.keep(2, [0, 9])  # past the end
    with pytest.raises(ValueError):
        cache.keep(2, [-1, 0])  # before the tree
    with pytest.raises(ValueError):
        cache.truncate(7)
    with pytest.raises(RuntimeError, match="full"):
        cache.claim(3)


def test_cache_reports_its_memory():
    cache = small_cache()
    assert cache.memory_bytes() == 2 * 2 * 1 * 1 * 8 * 2 * 4  # keys+values, layers, B, K, capacity, E, fp32


def test_a_write_goes_to_the_slots_it_is_given():
    """Scattered slots (APAR's pool) are written where they say; attention reads the first `length`."""
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=1, capacity=8)
    cache.length = 6
    keys, values = cache.write(0, torch.tensor([4, 1]), torch.tensor([7.0, 8.0]).view(1, 1, 2, 1),
                               torch.tensor([-7.0, -8.0]).view(1, 1, 2, 1))
    assert keys.shape == (1, 1, 6, 1) and keys[0, 0, :, 0].tolist() == [0, 8, 0, 0, 7, 0]
    assert values[0, 0, :, 0].tolist() == [0, -8, 0, 0, -7, 0]
