"""Grader of a5: after every token added, your multi-level n-gram table answers every query as a naive
scan of everything seen does: the longest matching context wins, then its most frequent next token,
the one seen last among equally frequent ones (ANPD section 3.2, Algorithm 2)."""

from helpers import cheap, naive_ngram_query, ngram_evidence, text_and_queries
from hypothesis import given, strategies as st

import adapters

MultiLevelNGram = adapters.implementation("a5_ngrams", "MultiLevelNGram")


def explanation(seen, query, n) -> str:
    """What a naive scan finds for `query`: the longest context seen before, and what came after it."""
    context, following = ngram_evidence(seen, query, n)
    if not following:
        return "no end of the query was seen: the answer is None"
    counts = {t: following.count(t) for t in dict.fromkeys(following)}
    return (f"the longest context seen before is {len(context)} token(s), {context}, followed by {following} "
            f"(counts {counts}): the most frequent wins, the one seen last among equally frequent ones")


@cheap
@given(text_and_queries(), st.integers(2, 5))
def test_queries_answer_as_a_naive_scan_of_everything_seen(text, n):
    seen, queries = text
    table = MultiLevelNGram(n)
    for end in range(len(seen)):
        table.add(seen, end)
        for query in queries:
            expected = naive_ngram_query(seen[:end + 1], query, n)
            got = table.query(query)
            assert got == expected, (f"N = {n}, after seeing {seen[:end + 1]}, query({query}) must be {expected}, "
                                     f"not {got}: {explanation(seen[:end + 1], query, n)}")


def test_the_longest_context_beats_a_more_frequent_short_one():
    table = MultiLevelNGram(3)
    seen = [1, 2, 9, 7, 2, 5, 7, 2, 5, 1, 2]  # after (2,): 9 once, 5 twice; after (1, 2): 9
    for end in range(len(seen)):
        table.add(seen, end)
    assert table.query([1, 2]) == 9, f"query([1, 2]) must be 9: {explanation(seen, [1, 2], 3)}"
