"""The static passes behind --cuda-graphs (cuda_graphs.py), run unrecorded on a CPU: padded to a
bucket of inputs, attending over a window of the cache, in the buffer the graphed model adopted,
they give the plain model's hidden states and K/V and, greedily, every method's vanilla tokens.
(Recorded and replayed on a GPU: tests/test_cuda.py.)"""

import gc

import pytest
import torch
from hypothesis import given, strategies as st

from backends import cuda_graphs
from backends.cuda_graphs import STEP_BUCKETS, GraphedModel
from decode import generate
from helpers import cheap, every_drafter, tiny_model
from kv_cache import KVCache

VOCAB = 16


@pytest.fixture(autouse=True)
def small_windows(monkeypatch):
    """Windows of 8, 16, 32 ... slots, so that short tests cross many of them."""
    monkeypatch.setattr(cuda_graphs, "MIN_WINDOW", 8)


def model():
    return tiny_model(vocab=VOCAB, max_positions=192)


@st.composite
def tree_pass(draw):
    """A cached prefix and one pass over T new inputs: each input's parent among the earlier ones (or
    none: the cache), its positions one deeper than its parent's."""
    cached = draw(st.integers(1, 100))
    T = draw(st.integers(1, STEP_BUCKETS[-1] + 4))
    parents = [-1] + [draw(st.integers(-1, i - 1)) for i in range(1, T)]
    return cached, parents, draw(st.integers(0, 2**16))


def tree_mask_and_positions(cached: int, parents: list[int]):
    T = len(parents)
    mask = torch.zeros(T, cached + T, dtype=torch.bool)
    mask[:, :cached] = True
    depth = []
    for i, parent in enumerate(parents):
        mask[i, cached + i] = True
        if parent >= 0:
            mask[i, cached:] |= mask[parent, cached:]
        depth.append(0 if parent < 0 else depth[parent] + 1)
    return mask, torch.tensor(depth) + cached


@cheap
@given(tree_pass())
def test_a_static_pass_gives_the_plain_passs_hidden_states_and_cache(case):
    cached, parents, seed = case
    plain = model()
    graphed = GraphedModel(plain)
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, VOCAB, (1, cached), generator=gen)
    tokens = torch.randint(0, VOCAB, (1, len(parents)), generator=gen)
    mask, positions = tree_mask_and_positions(cached, parents)
    hidden, caches = {}, {}
    for name, m in [("plain", plain), ("graphed", graphed)]:
        cache = caches[name] = KVCache.for_model(m, capacity=cached + len(parents))
        m(prefix, positions=torch.arange(cached), cache=cache, slots=cache.claim(cached))
        if m is graphed:
            graphed.passes.clear()  # (recorded again when needed) so that only the tree's pass is counted below
        hidden[name] = m.hidden_states(tokens, positions=positions, cache=cache, slots=cache.claim(len(parents)),
                                       mask=mask)
    torch.testing.assert_close(hidden["graphed"], hidden["plain"], rtol=0, atol=1e-12)
    length = caches["plain"].length
    for part in ("keys", "values"):
        torch.testing.assert_close(getattr(caches["graphed"], part)[:, :, :, :length],
                                   getattr(caches["plain"], part)[:, :, :, :length], rtol=0, atol=1e-12)
    fits = len(parents) <= STEP_BUCKETS[-1]
    assert bool(graphed.passes) == fits  # the static pass ran (over 64 inputs the plain one)


@given(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=80), st.sets(st.integers(0, VOCAB - 1), max_size=2))
def test_every_method_gives_vanilla_greedy_tokens_through_static_passes(prompt, eos_ids):
    plain = model()
    expected = generate(plain, prompt, max_new_tokens=30, eos_ids=eos_ids)
    graphed = GraphedModel(plain)
    assert generate(graphed, prompt, max_new_tokens=30, eos_ids=eos_ids).token_ids == expected.token_ids
    for name, drafter in every_drafter(graphed).items():
        gen = generate(graphed, prompt, max_new_tokens=30, eos_ids=eos_ids, drafter=drafter)
        assert (gen.token_ids, gen.stop_reason) == (expected.token_ids, expected.stop_reason), name


def test_passes_of_several_buckets_and_windows_are_used():
    graphed = GraphedModel(model())
    drafters = every_drafter(graphed)
    for prompt in ([1, 2, 3], [(5 * i) % VOCAB for i in range(70)]):
        generate(graphed, prompt, max_new_tokens=60, eos_ids=set(), drafter=drafters["ppd"])
        generate(graphed, prompt, max_new_tokens=60, eos_ids=set())
    buckets = {bucket for bucket, _ in graphed.passes}
    windows = {window for _, window in graphed.passes}
    assert {1, 16} <= buckets and len(buckets) >= 3 and len(windows) >= 5, graphed.passes.keys()


def test_one_live_cache_at_a_time():
    graphed = GraphedModel(model())
    first = KVCache.for_model(graphed, capacity=16)
    graphed(torch.tensor([[1, 2]]), positions=torch.arange(2), cache=first, slots=first.claim(2))
    second = KVCache.for_model(graphed, capacity=16)
    with pytest.raises(RuntimeError, match="one cache at a time"):
        graphed(torch.tensor([[3]]), positions=torch.arange(1), cache=second, slots=second.claim(1))
    del first
    gc.collect()
    graphed(torch.tensor([[3]]), positions=torch.arange(1), cache=second, slots=second.claim(1))  # the buffer is free


def test_caches_it_cannot_adopt_run_the_plain_model():
    """A batch, or a cache larger than the buffer: the plain pass, nothing recorded."""
    plain = model()
    graphed = GraphedModel(plain, capacity=32)
    for batch, capacity in [(2, 16), (1, 40)]:
        tokens = torch.randint(0, VOCAB, (batch, 3), generator=torch.Generator().manual_seed(batch))
        outputs = []
        for m in (plain, graphed):
            cache = KVCache.for_model(m, capacity=capacity, batch=batch)
            outputs.append(m.hidden_states(tokens, positions=torch.arange(3), cache=cache, slots=cache.claim(3)))
        torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)
    assert not graphed.passes


def test_the_buffer_grows_with_the_caches_it_adopts():
    """A short answer, a long one (the buffer grows, the recorded passes are dropped), a short one
    again: each is the plain model's."""
    plain = model()
    graphed = GraphedModel(plain)
    sizes = []
    for prompt, new in [([1, 2], 6), ([(3 * i) % VOCAB for i in range(60)], 100), ([4, 5, 6], 20)]:
        expected = generate(plain, prompt, max_new_tokens=new, eos_ids=set()).token_ids
        assert generate(graphed, prompt, max_new_tokens=new, eos_ids=set()).token_ids == expected
        sizes.append(graphed.buffer.capacity)
    assert sizes[0] < sizes[1] == sizes[2]
