"""Assignment a5_ngrams: your code (see handout.md). Each stub below has the reference's
signature and docstring; replace its NotImplementedError with your implementation, then run

    python -m pytest course/a5_ngrams
"""

from collections.abc import Sequence
import drafters


class MultiLevelNGram(drafters.MultiLevelNGram):
    def add(self, tokens: Sequence[int], end: int) -> None:
        """Record tokens[end] as the continuation of each context of 1..N-1 tokens ending before it."""
        raise NotImplementedError("a5_ngrams: implement add")

    def query(self, tokens: Sequence[int]) -> int | None:
        """The predicted token after `tokens`, or None when no level has seen its context."""
        raise NotImplementedError("a5_ngrams: implement query")
