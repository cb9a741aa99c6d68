"""Assignment a2_kv_cache: your code (see handout.md). Each stub below has the reference's
signature and docstring; replace its NotImplementedError with your implementation, then run

    python -m pytest course/a2_kv_cache
"""

import kv_cache


class KVCache(kv_cache.KVCache):
    def write(self, layer: int, slots, k, v):
        """Store one layer's K/V ([B, K, T, E] each) in `slots` (a slice or T slot indices, claimed
        before the pass); return that layer's whole history, them included ([B, K, length, E] views,
        no copy)."""
        raise NotImplementedError("a2_kv_cache: implement write")

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` slots."""
        raise NotImplementedError("a2_kv_cache: implement truncate")

    def keep(self, start: int, offsets) -> None:
        """Keep slots [0, start) and, after them, only slots start + offsets (ascending), packed.

        Used after tree verification: `start` is where the tree's nodes began and `offsets` are the
        accepted root-to-node path's node indices.
        """
        raise NotImplementedError("a2_kv_cache: implement keep")
