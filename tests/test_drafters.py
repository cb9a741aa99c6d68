"""The drafters: ANPD's chain from the longest match, and both drafters' settings. The multi-level
n-gram table against a naive scan, and Lookahead's trie (counts against naive occurrences under random
insert / eliminate / prune sequences, multi-stage retrieval) are the graders of course/a5_ngrams and
course/a7_trie, which tests/test_course.py runs against this code."""

import pytest
from hypothesis import strategies as st

from drafters import NGramDrafter, Request, TrieDrafter
from errors import UserError

tokens = st.lists(st.integers(0, 5), max_size=60)


def test_anpd_drafts_a_chain_from_the_longest_match():
    drafter = NGramDrafter(n=3, k=4)
    drafter.begin(Request([1, 2, 3, 4, 1, 2, 5, 9]))
    drafter.learn([1, 2])
    # after (1, 2) the table has seen 3 and 5 once each: the latest, 5, wins; then 9, then (9,)->1
    assert drafter.propose().tokens == [2, 5, 9, 1, 2]
    drafter.learn([7])  # nothing ever followed 7: no guess
    assert drafter.propose().tokens == [7]


@pytest.mark.parametrize("n, k", [(1, 7), (33, 7), (5, 0), (5, 129)])
def test_anpd_rejects_out_of_range_settings(n, k):
    with pytest.raises(UserError):
        NGramDrafter(n=n, k=k)


@pytest.mark.parametrize("decoding, branch", [(0, 8), (257, 8), (16, 0), (16, 65)])
def test_lookahead_rejects_out_of_range_settings(decoding, branch):
    with pytest.raises(UserError):
        TrieDrafter(decoding, branch)


def test_a_trie_guess_is_filed_under_the_length_of_the_context_that_found_it():
    """After 1 2 3 4 the trie holds 5 (four tokens of context); after 9 8 4 only the last token, 4,
    matches, which was followed by 5. Both guesses took all their siblings' occurrences, and the one
    found after the longer context is the likelier (section 4.3's multi-stage retrieval)."""
    evidence = {}
    for prompt, context in [([1, 2, 3, 4, 5, 1, 2, 3, 4], 4), ([1, 2, 3, 4, 5, 9, 8, 4], 1)]:
        drafter = TrieDrafter(decoding_length=1, branch_length=1)
        drafter.begin(Request(prompt))
        tree = drafter.propose()
        assert tree.tokens == [4, 5]
        [(key, prior)] = tree.evidence[1]
        assert key == ("lookahead", context, 3)
        evidence[context] = prior
    assert evidence[4] > evidence[1]
