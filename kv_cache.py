"""A preallocated key/value cache written by slot, so rolling back is free and a tree can be pruned.

Every layer's keys and values live in one tensor allocated once ([layers, B, K, capacity, E]), as in
gpt-fast's static cache. A forward pass is told where its T new tokens go: the caller claims their
slots first (`claim(T)`: the next T, here), the model passes them down, and each layer `write`s its
K/V there (gpt-fast's `KVCache.update(input_pos, k, v)`). After verifying a candidate tree the
decoding loop either:
- `truncate(n)`: forget everything after the first n slots (rejected chain drafts), or
- `keep(start, offsets)`: of the slots from `start` on, keep only the accepted tree nodes, moved down
  to be contiguous. Keys are stored after RoPE, so moving a slot does not change what it encodes:
  the accepted path's positions were already cache_len + depth, exactly where they end up.

Other caches speak the same `claim` / `write`: APAR's (apar.py) hands out slots from a pool; a
self-draft's (drafters.FirstLayers) is a window onto the first layers of this one; training's
(self_distill.FrozenPrefix) reads a fixed prefix's K/V.
"""

import torch


class KVCache:
    def __init__(self, num_layers, num_kv_heads, head_dim, capacity, *, batch=1,
                 dtype=torch.float32, device="cpu"):
        shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0  # slots attention reads: [0, length)

    @classmethod
    def for_model(cls, model, capacity, batch=1):
        c = model.config
        return cls(c.num_layers, c.num_kv_heads, c.head_dim, capacity, batch=batch,
                   dtype=model.dtype, device=model.device)

    def claim(self, count: int) -> slice:
        """The next `count` slots, for the tokens of the forward pass about to run."""
        if self.length + count > self.capacity:
            raise RuntimeError(f"KV cache full: {self.length} + {count} > capacity {self.capacity}")
        self.length += count
        return slice(self.length - count, self.length)

    def write(self, layer: int, slots, k, v):
        """Store one layer's K/V ([B, K, T, E] each) in `slots` (a slice or T slot indices, claimed
        before the pass); return that layer's whole history, them included ([B, K, length, E] views,
        no copy)."""
        self.keys[layer, :, :, slots] = k
        self.values[layer, :, :, slots] = v
        return self.keys[layer, :, :, :self.length], self.values[layer, :, :, :self.length]

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` slots."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} slots to {length}")
        self.length = length

    def keep(self, start: int, offsets) -> None:
        """Keep slots [0, start) and, after them, only slots start + offsets (ascending), packed.

        Used after tree verification: `start` is where the tree's nodes began and `offsets` are the
        accepted root-to-node path's node indices.
        """
        offsets = [int(offset) for offset in offsets]  # checked on the host: no device work, no sync,
        count = len(offsets)  # when the path is already in place (vanilla, a rejected first guess, a chain)
        if offsets != list(range(count)):
            ascending = all(a < b for a, b in zip(offsets, offsets[1:]))
            if not ascending or offsets[0] < 0 or start + offsets[-1] >= self.length:
                raise ValueError("keep() needs ascending offsets inside the cache")
            source = torch.tensor([start + offset for offset in offsets], device=self.keys.device)
            # indexing with a tensor gathers into a fresh tensor first, so overlapping moves are safe
            self.keys[:, :, :, start:start + count] = self.keys[:, :, :, source]
            self.values[:, :, :, start:start + count] = self.values[:, :, :, source]
        self.truncate(start + count)

    def memory_bytes(self) -> int:
        """Bytes allocated for keys and values (the whole capacity)."""
        return self.keys.nbytes + self.values.nbytes
