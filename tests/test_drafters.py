"""The drafters: ANPD's chain from the longest match and its settings, and the Lookahead trie's counts
and invariants against naive references under random insert / eliminate / prune sequences. The
multi-level n-gram table against a naive scan is course/a5_ngrams's grader, which
tests/test_course.py runs against this code."""

import pytest
from hypothesis import given, strategies as st

from helpers import cheap
from drafters import NGramDrafter, Request, Trie, TrieDrafter
from errors import UserError

tokens = st.lists(st.integers(0, 5), max_size=60)


def test_anpd_drafts_a_chain_from_the_longest_match():
    drafter = NGramDrafter(n=3, k=4)
    drafter.begin(Request([1, 2, 3, 4, 1, 2, 5, 9]))
    drafter.extend([1, 2])
    # after (1, 2) the table has seen 3 and 5 once each: the latest, 5, wins; then 9, then (9,)->1
    assert drafter.propose().tokens == [2, 5, 9, 1, 2]
    drafter.extend([7])  # nothing ever followed 7: no guess
    assert drafter.propose().tokens == [7]


@pytest.mark.parametrize("n, k", [(1, 7), (33, 7), (5, 0), (5, 129)])
def test_anpd_rejects_out_of_range_settings(n, k):
    with pytest.raises(UserError):
        NGramDrafter(n=n, k=k)


@pytest.mark.parametrize("decoding, branch", [(0, 8), (257, 8), (16, 0), (16, 65)])
def test_lookahead_rejects_out_of_range_settings(decoding, branch):
    with pytest.raises(UserError):
        TrieDrafter(decoding, branch)


# ---- the trie ------------------------------------------------------------------------------------

def trie_counts(trie):
    """{token sequence: (prompt count, output count)} for every node."""
    found = {}
    stack = [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for token, child in node.children.items():
            found[path + (token,)] = (child.prompt_count, child.output_count)
            stack.append((path + (token,), child))
    return found


def occurrences(text, depth):
    """{sequence: times it occurs in text} for every sequence of 1..depth tokens."""
    counts = {}
    for start in range(len(text)):
        for end in range(start + 1, min(start + depth, len(text)) + 1):
            counts[tuple(text[start:end])] = counts.get(tuple(text[start:end]), 0) + 1
    return counts


def assert_trie_invariants(trie):
    counts = trie_counts(trie)
    assert trie.node_count == len(counts)
    for path, (prompt, output) in counts.items():
        assert prompt + output > 0, "a node nobody counted should be gone"
        assert len(path) <= trie.depth
        if len(path) > 1:  # a sequence occurs at most as often as its prefix
            parent_prompt, parent_output = counts[path[:-1]]
            assert prompt <= parent_prompt and output <= parent_output


requests = st.lists(st.tuples(st.lists(st.integers(0, 4), min_size=1, max_size=20),
                              st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=4), max_size=6)),
                    min_size=1, max_size=4)


@cheap  # milliseconds per example
@given(requests, st.integers(1, 5))
def test_trie_counts_equal_occurrences_without_pruning(request_list, depth):
    trie = Trie(depth)
    outputs = {}
    for prompt, chunks in request_list:
        trie.add(prompt, 0, from_prompt=True)
        text = list(prompt)
        for chunk in chunks:  # output arrives a few tokens per step
            text += chunk
            trie.add(text, len(text) - len(chunk), first_start=len(prompt))
        expected_prompt = occurrences(prompt, depth)
        for seq, n in occurrences(text[len(prompt):], depth).items():
            outputs[seq] = outputs.get(seq, 0) + n
        counts = trie_counts(trie)
        assert {s: c[0] for s, c in counts.items() if c[0]} == expected_prompt
        assert {s: c[1] for s, c in counts.items() if c[1]} == outputs
        assert_trie_invariants(trie)
        trie.eliminate_prompt()  # the request ends: its prompt's branches go
        assert {s: c[1] for s, c in trie_counts(trie).items()} == outputs
        assert_trie_invariants(trie)


@cheap  # milliseconds per example
@given(requests, st.integers(1, 5), st.integers(0, 30))
def test_trie_invariants_with_pruning(request_list, depth, capacity):
    trie = Trie(depth)
    for prompt, chunks in request_list:
        trie.add(prompt, 0, from_prompt=True)
        text = list(prompt)
        for chunk in chunks:
            text += chunk
            trie.add(text, len(text) - len(chunk), first_start=len(prompt))
        assert_trie_invariants(trie)
        trie.eliminate_prompt()
        before = trie_counts(trie)
        trie.prune(capacity)
        after = trie_counts(trie)
        assert trie.node_count == min(capacity, len(before))
        assert all(prompt == 0 for prompt, _ in after.values())
        assert_trie_invariants(trie)
        assert all(after[s] == before[s] for s in after)  # survivors keep their counts
        removed = [c[1] for s, c in before.items() if s not in after]
        if removed and after:  # the least frequent went first
            assert max(removed) <= min(c[1] for c in after.values())


def test_lookahead_retrieves_the_continuation_seen_in_the_prompt():
    drafter = TrieDrafter(decoding_length=6, branch_length=4)
    drafter.begin(Request([5, 6, 7, 8, 9, 5, 6, 3]))
    drafter.extend([5, 6])
    branches = drafter.retrieve()
    # after (5, 6) the prompt continued with 7, 8, 9, 5 and with 3: both branches, longest match first
    assert branches[0] == [7, 8, 9, 5] and [3] in branches
    tree = drafter.propose()
    assert tree.draft_size <= 6 and tree.tokens[0] == 6
    drafter.end()
    assert drafter.trie.node_count <= 16 * 6
    assert all(p == 0 for p, _ in trie_counts(drafter.trie).values())
