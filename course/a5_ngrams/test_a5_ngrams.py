"""Grader of a5: after every token added, your multi-level n-gram table answers every query as a naive
scan of everything seen does: the longest matching context wins, then its most frequent next token,
the one seen last among equally frequent ones (ANPD section 3.2, Algorithm 2); and its counts are how
often each token followed each context of 1..N-1 tokens."""

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


@cheap
@given(st.lists(st.integers(0, 3), max_size=40), st.integers(2, 5))
def test_counts_say_how_often_each_token_followed_each_context(seen, n):
    table = MultiLevelNGram(n)
    for end in range(len(seen)):
        table.add(seen, end)
    contexts = {tuple(seen[start:start + length]) for length in range(1, n) for start in range(len(seen) - length)}
    for context in contexts:
        following = [seen[i] for i in range(len(context), len(seen)) if tuple(seen[i - len(context):i]) == context]
        expected = {token: following.count(token) for token in following}
        got = dict(table.counts.get(context, {}))
        assert got == expected, (f"N = {n}, after seeing {seen}: {list(context)} was followed by {following}, so "
                                 f"counts[{context}] must be {expected}, not {got}")
    assert set(table.counts) <= contexts | {()}, (
        f"N = {n}, after seeing {seen}: counts holds contexts that never occurred before a token, or are longer than "
        f"N - 1 = {n - 1}: {sorted(set(table.counts) - contexts - {()})}")


def test_the_longest_context_beats_a_more_frequent_short_one():
    table = MultiLevelNGram(3)
    seen = [1, 2, 9, 7, 2, 5, 7, 2, 5, 1, 2]  # after (2,): 9 once, 5 twice; after (1, 2): 9
    for end in range(len(seen)):
        table.add(seen, end)
    assert table.query([1, 2]) == 9, f"query([1, 2]) must be 9: {explanation(seen, [1, 2], 3)}"
