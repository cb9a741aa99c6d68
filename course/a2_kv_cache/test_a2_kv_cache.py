"""Grader of a2: your KV cache holds, after any sequence of writes, rollbacks and keeps, what a plain
list of slots holds (hypothesis), and decoding with it gives vanilla greedy's tokens, also when a pass
keeps a path that is not the tree's first nodes."""

import torch
from helpers import WrongBranchFirst, assert_decodes_as_naive_greedy, cheap, naive_greedy, tiny_model
from hypothesis import given, strategies as st

import adapters
import decode
import kv_cache
from drafters import NGramDrafter, TrieDrafter

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


def test_decoding_with_your_cache_is_vanilla_greedy(monkeypatch):
    adapters.install(monkeypatch, "a2_kv_cache", "KVCache", kv_cache)
    assert decode.KVCache is kv_cache.KVCache
    for seed, prompt in [(0, [1, 2, 3, 1, 2, 3, 1, 2]), (2, [7, 1, 7, 1, 7])]:
        model = tiny_model(seed)
        for drafter in [NGramDrafter(), TrieDrafter(decoding_length=8, branch_length=4),
                        WrongBranchFirst(naive_greedy(model, prompt, 24), model.config.vocab_size)]:
            assert_decodes_as_naive_greedy(decode.generate, model, prompt, 24, drafter, "decoding with your cache")
