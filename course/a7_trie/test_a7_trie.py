"""Grader of a7: Lookahead's trie counts every token sequence of up to `depth` tokens as often as it
occurs (naive count), prompt and output apart, through prompt elimination and pruning of the least
frequent nodes; retrieval takes the branches after the longest matching context first (multi-stage);
and decoding with your Lookahead gives vanilla greedy's tokens (Zhao et al. 2023, sections 4.3.1-4.3.2)."""

from helpers import (assert_decodes_as_naive_greedy, assert_trie_invariants, cheap, occurrences, requests, tell, tiny_model,
                     trie_counts)
from hypothesis import given, strategies as st

import adapters
import decode
import drafters
from drafters import Request

Trie = adapters.implementation("a7_trie", "Trie")
TrieDrafter = adapters.implementation("a7_trie", "TrieDrafter")


def filled(request_list, depth):
    """Your trie after each request's prompt and output chunks; yields (trie, prompt, output text so far)."""
    trie = Trie(depth)
    for prompt, chunks in request_list:
        trie.add(prompt, 0, from_prompt=True)
        text = list(prompt)
        for chunk in chunks:  # output arrives a few tokens per step
            text += chunk
            trie.add(text, len(text) - len(chunk), first_start=len(prompt))
        yield trie, prompt, text[len(prompt):]


@cheap
@given(requests, st.integers(1, 5))
def test_the_trie_counts_every_sequence_as_often_as_it_occurs(request_list, depth):
    outputs = {}
    for trie, prompt, output in filled(request_list, depth):
        for sequence, n in occurrences(output, depth).items():
            outputs[sequence] = outputs.get(sequence, 0) + n
        counts = trie_counts(trie)
        for label, column, expected in [("prompt", 0, occurrences(prompt, depth)), ("output", 1, outputs)]:
            got = {s: c[column] for s, c in counts.items() if c[column]}
            wrong = sorted(set(got) ^ set(expected) | {s for s in got if got.get(s) != expected.get(s)})
            assert not wrong, (f"depth {depth}, prompt {prompt}, output so far {output}: the {label} sequence "
                               f"{list(wrong[0])} occurred {expected.get(wrong[0], 0)} times, your trie counts "
                               f"{got.get(wrong[0], 0)} (every sequence of 1..depth tokens, each occurrence once)")
        assert_trie_invariants(trie)
        trie.eliminate_prompt()


@cheap
@given(requests, st.integers(1, 5), st.integers(0, 30))
def test_pruning_removes_the_least_frequent_nodes(request_list, depth, capacity):
    for trie, _, _ in filled(request_list, depth):
        trie.eliminate_prompt()
        before = trie_counts(trie)
        trie.prune(capacity)
        after = trie_counts(trie)
        assert trie.node_count == len(after) == min(capacity, len(before)), (
            f"pruning {len(before)} nodes to {capacity} leaves {min(capacity, len(before))}, not {len(after)}")
        assert all(after[s] == before[s] for s in after), "pruning keeps the survivors' counts"
        assert_trie_invariants(trie)
        removed = [(c[1], list(s)) for s, c in before.items() if s not in after]
        kept = [(c[1], list(s)) for s, c in after.items()]
        if removed and kept:
            assert max(removed)[0] <= min(kept)[0], (
                f"pruning to {capacity} nodes removed {max(removed)[1]}, seen {max(removed)[0]} times, and kept "
                f"{min(kept)[1]}, seen {min(kept)[0]} times: the least frequent go first")


def retrieved(prompt, generated, decoding_length=6, branch_length=4):
    drafter = TrieDrafter(decoding_length=decoding_length, branch_length=branch_length)
    drafter.begin(Request(prompt))
    tell(drafter, generated)
    return drafter.retrieve()


def test_retrieval_starts_with_the_longest_matching_context():
    # after (5, 6) the prompt continued with 7, 8, 9, 5 and, after (9, 5, 6), with 3
    branches = retrieved([5, 6, 7, 8, 9, 5, 6, 3], [5, 6])
    assert branches and branches[0] == [7, 8, 9, 5], (
        f"history ...5, 6: the longest context seen before, (5, 6), was followed by 7, 8, 9, 5: that branch comes "
        f"first, not {branches[:1]}")
    assert [3] in branches, f"(6,) was also followed by 3: a shorter context's branch fills the budget, {branches}"
    # (1, 2) was followed by 7 once; (2,) more often by 9
    branches = retrieved([1, 2, 7, 5, 3, 2, 9, 8, 4, 2, 9, 8], [1, 2])
    assert branches and branches[0][:2] == [7, 5], (
        f"history ...1, 2: the longest context seen before, (1, 2), was followed by 7, 5: that branch comes first, "
        f"before those of the shorter context (2,), even though 9 followed (2,) more often; not {branches[:1]}")


def test_retrieval_returns_each_branch_once():
    # after (5, 6) and after (6,) alike the prompt continued with 7, 8, 9, 5: one branch, not two
    branches = retrieved([5, 6, 7, 8, 9, 5, 6, 3], [5, 6], decoding_length=12)
    repeated = sorted({tuple(b) for b in branches if branches.count(b) > 1})
    assert repeated == [], (
        f"history ...5, 6: {branches} holds {[list(b) for b in repeated]} more than once; a shorter context often "
        "retrieves what a longer one did, and a repeated branch spends the decoding length on nothing new")


def test_retrieval_falls_back_to_shorter_contexts():
    # the history ends with (1, 2); (1, 2) was never seen, (2,) was, followed by 4 4 and by 8
    branches = retrieved([2, 4, 4, 0, 2, 8], [1, 2])
    assert branches and {tuple(b[:1]) for b in branches} == {(4,), (8,)}, (
        f"history ...1, 2: (1, 2) was never seen, so the branches come from the context (2,): 4, 4 and 8, not "
        f"{branches} (multi-stage retrieval: the longest context first, then shorter ones)")


def test_decoding_with_your_lookahead_is_vanilla_greedy(monkeypatch):
    adapters.install(monkeypatch, "a7_trie", "Trie", drafters)
    for seed, prompt in [(0, [1, 2, 3, 1, 2, 3, 1, 2]), (1, [5, 4, 5, 4, 5, 4])]:
        assert_decodes_as_naive_greedy(decode.generate, tiny_model(seed), prompt, 24,
                                       TrieDrafter(decoding_length=8, branch_length=4), "your Lookahead")


def test_retrieval_stops_once_the_branches_fill_the_decoding_length():
    # after (5, 6) the prompt continued with 7, 8, 9, 1: four tokens, the whole decoding length of 4;
    # after (6,) also with 3, 3, which must not be asked for
    branches = retrieved([5, 6, 7, 8, 9, 1, 6, 3, 3], [5, 6], decoding_length=4)
    assert branches == [[7, 8, 9, 1]], (
        f"history ...5, 6, decoding length 4: the longest context (5, 6) gave [7, 8, 9, 1], 4 tokens, which fill it: "
        f"retrieval stops there (a shorter context is tried only while the branches hold fewer tokens than the "
        f"decoding length), not {branches}")
    branches = retrieved([5, 6, 7, 8, 9, 1, 6, 3, 3], [5, 6], decoding_length=5)
    assert any(branch[0] == 3 for branch in branches), (
        f"history ...5, 6, decoding length 5: the longest context (5, 6) gave [7, 8, 9, 1], 4 tokens, one short: "
        f"retrieval goes on to the context (6,), which was also followed by 3, 3; not {branches}")


def test_retrieval_tries_a_context_as_long_as_the_whole_text():
    # an earlier request's output: (1, 2, 3, 4) was followed by 7; (2, 3, 4) more often by 5
    drafter = TrieDrafter(decoding_length=6, branch_length=4)
    drafter.begin(Request([9]))
    tell(drafter, [1, 2, 3, 4, 7, 2, 3, 4, 5, 2, 3, 4, 5])
    drafter.begin(Request([1, 2, 3, 4]))  # the next request's whole text is that 4-token context
    branches = drafter.retrieve()
    assert branches and branches[0][0] == 7, (
        f"a new request's text [1, 2, 3, 4] is itself the longest context, seen before followed by 7: that branch "
        f"comes first (a context may be as long as the whole text), not {branches[:1]}")
