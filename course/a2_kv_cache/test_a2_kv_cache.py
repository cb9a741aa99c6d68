"""Grader of a2: your KV cache holds, after any sequence of writes, rollbacks and keeps, what a plain
list of slots holds (hypothesis), and the model run on it, pass after pass over trees of which one
path is kept (often not the tree's first nodes), scores as a plain pass over the kept text."""

import random

import torch
from helpers import cheap, full_logits, tiny_model
from hypothesis import given, settings, strategies as st

import adapters

KVCache = adapters.implementation("a2_kv_cache", "KVCache")
LAYERS, CAPACITY = 2, 12


def operations():
    """("write", T) | ("truncate", n) | ("keep", start, offsets), each drawn to be valid for the
    slots in use (n, start and offsets as fractions, scaled when they are applied)."""
    return st.lists(st.one_of(
        st.tuples(st.just("write"), st.integers(1, 4)),
        st.tuples(st.just("truncate"), st.floats(0, 1)),
        st.tuples(st.just("keep"), st.floats(0, 1), st.lists(st.floats(0, 1), max_size=4))), max_size=12)


def test_write_stores_in_the_slots_it_is_given():
    cache = KVCache(1, 1, 1, 6, dtype=torch.float64)
    cache.claim(6)
    keys, _ = cache.write(0, torch.tensor([4, 1, 2]), torch.tensor([40.0, 10.0, 20.0], dtype=torch.float64).view(1, 1, 3, 1),
                          torch.zeros(1, 1, 3, 1, dtype=torch.float64))
    held = keys[0, 0, :, 0].tolist()
    assert held == [0.0, 10.0, 20.0, 0.0, 40.0, 0.0], (
        f"write(layer, slots=[4, 1, 2], k) must put k's first row in slot 4, its second in slot 1 and its third in "
        f"slot 2 (APAR's threads write where their allocator says, not at the end), and return all 6 slots; "
        f"the history holds {held}")


def test_keep_moves_the_accepted_path_down():
    cache = KVCache(1, 1, 1, 8, dtype=torch.float64)
    cache.write(0, cache.claim(4), torch.arange(4.0, dtype=torch.float64).view(1, 1, 4, 1),
                torch.zeros(1, 1, 4, 1, dtype=torch.float64))
    cache.keep(1, [0, 2])  # slot 0 stays; of the tree in slots 1..3, nodes 0 and 2 (slots 1 and 3) are kept
    held = cache.keys[0, 0, 0, :cache.length, 0].tolist()
    assert held == [0.0, 1.0, 3.0], (f"after writing values 0, 1, 2, 3 and keep(start=1, offsets=[0, 2]) the cache must "
                                     f"hold 0, 1, 3 (slot 2 must hold the K/V written as value 3), not {held}")


@cheap
@given(operations())
def test_the_cache_holds_what_a_list_of_slots_holds(script):
    cache = KVCache(LAYERS, 1, 2, CAPACITY, dtype=torch.float64)
    slots, next_value, done = [], 0.0, []  # slots: the value each slot in use holds
    for operation in script:
        if operation[0] == "write":
            count = operation[1]
            if len(slots) + count > CAPACITY:
                continue
            values = [next_value + i for i in range(count)]
            next_value += count
            claimed = cache.claim(count)
            for layer in range(LAYERS):
                k = torch.tensor(values, dtype=torch.float64).view(1, 1, count, 1).expand(1, 1, count, 2) + layer
                keys, vals = cache.write(layer, claimed, k, -k)
                assert keys.shape[2] == len(slots) + count, (
                    f"after {done}: write must return the layer's whole history, {len(slots) + count} slots, "
                    f"not {keys.shape[2]}")
            slots += values
            done.append(f"write {count}")
        elif operation[0] == "truncate":
            length = int(operation[1] * len(slots))
            cache.truncate(length)
            slots = slots[:length]
            done.append(f"truncate({length})")
        else:
            start = int(operation[1] * len(slots))
            span = len(slots) - start  # offsets 0..span-1 are inside the cache
            offsets = sorted({min(int(f * span), span - 1) for f in operation[2] if span > 0})
            cache.keep(start, offsets)
            slots = slots[:start] + [slots[start + o] for o in offsets]
            done.append(f"keep(start={start}, offsets={offsets})")
        assert cache.length == len(slots), f"after {done}: {len(slots)} slots in use, not {cache.length}"
        held = cache.keys[0, 0, 0, :cache.length, 0].tolist()
        for slot, (value, got) in enumerate(zip(slots, held)):
            assert got == value, (f"after {done}: slot {slot} must hold the K/V written as value {value:g}, not "
                                  f"{got:g} (keep moves the kept slots down to follow slot start - 1)")
        assert cache.values[1, 0, 0, :cache.length, 0].tolist() == [-(v + 1) for v in slots], \
            f"after {done}: the values move with the keys, in every layer"


def tree_pass_inputs(parents: list[int], cached: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The grader's own positions [N] and mask [N, cached + N] for a pass over a tree (a3 builds these):
    every node sees the cache, itself and its ancestors, at cache length + its depth."""
    lines = []  # lines[i]: node i's ancestors and itself
    for node, parent in enumerate(parents):
        lines.append((lines[parent] if parent >= 0 else set()) | {node})
    mask = torch.tensor([[True] * cached + [j in lines[i] for j in range(len(parents))] for i in range(len(parents))])
    return torch.tensor([cached + len(line) - 1 for line in lines]), mask


def root_to(node: int, parents: list[int]) -> list[int]:
    path = []
    while node >= 0:
        path, node = [node] + path, parents[node]
    return path


@settings(max_examples=30)
@given(st.integers(0, 2**32 - 1))
def test_the_model_on_your_cache_scores_the_kept_text(seed):
    """Prefill, then passes over random trees: after each, keep a random root-to-node path (keep) or roll
    back to a random length (truncate). The next pass must score as a plain pass over the kept text."""
    chance = random.Random(seed)
    model = tiny_model(seed % 3)
    vocab = model.config.vocab_size
    text = [chance.randrange(vocab) for _ in range(chance.randint(1, 5))]
    cache = KVCache.for_model(model, capacity=48)
    model.forward(torch.tensor([text]), positions=torch.arange(len(text)), cache=cache, slots=cache.claim(len(text)))
    done = [f"prefill {len(text)} tokens"]
    for _ in range(5):
        parents = [-1] + [chance.randrange(node) for node in range(1, chance.randint(1, 6))]
        tokens = [chance.randrange(vocab) for _ in parents]
        start = cache.length
        positions, mask = tree_pass_inputs(parents, start)
        logits = model.forward(torch.tensor([tokens]), positions=positions, cache=cache,
                               slots=cache.claim(len(tokens)), mask=mask)[0][0]
        for node in range(len(parents)):
            path = root_to(node, parents)
            expected = full_logits(model, text + [tokens[n] for n in path])[-1]
            assert torch.allclose(logits[node], expected, rtol=1e-9, atol=1e-9), (
                f"after {'; '.join(done)}: a pass over a tree with parents {parents} scores node {node} as if the "
                f"cache held other K/V than the kept text's {len(text)} tokens (off by "
                f"{float((logits[node] - expected).abs().max()):.3g})")
        if chance.random() < 0.8:  # accept a path: from a random node up to the root
            path = root_to(chance.randrange(len(parents)), parents)
            cache.keep(start, path)
            text += [tokens[n] for n in path]
            done.append(f"a tree with parents {parents}, keep(start={start}, offsets={path})")
        else:
            length = chance.randint(0, start) if start else 0
            cache.truncate(length)
            text = text[:length]
            done.append(f"a tree with parents {parents}, truncate({length})")
