"""Assignment a7_trie: your code (see handout.md). Each stub below has the reference's
signature and docstring; replace its NotImplementedError with your implementation, then run

    python -m pytest course/a7_trie
"""

from collections.abc import Sequence
import drafters


class Trie(drafters.Trie):
    def add(self, tokens: Sequence[int], new_from: int, *, first_start: int = 0,
            from_prompt: bool = False) -> None:
        """Count the occurrences that end at each of tokens[new_from:], among the sequences that
        start at or after `first_start` (branch inserting, done token by token)."""
        raise NotImplementedError("a7_trie: implement add")

    def prune(self, capacity: int) -> None:
        """Remove the least frequent nodes until at most `capacity` remain (node pruning). Sorting by
        (count, deeper first) removes children before their parents, so each removal is a leaf."""
        raise NotImplementedError("a7_trie: implement prune")


class TrieDrafter(drafters.TrieDrafter):
    def retrieve(self) -> list[list[int]]:
        """Multi-stage retrieval: the branches after the longest matching context first; while they
        hold fewer tokens than the decoding length, add those after a shorter context."""
        raise NotImplementedError("a7_trie: implement retrieve")
