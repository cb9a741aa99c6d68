"""A preallocated key/value cache written by slot, so rolling back is free and a tree can be pruned.

Every layer's keys and values live in one tensor allocated once ([layers, B, K, capacity, E]), as in
gpt-fast's static cache. A forward pass over T new tokens `reserve`s the next T slots and each layer
`write`s its K/V there. After verifying a candidate tree the decoding loop either:
- `truncate(n)`: forget everything after the first n slots (rejected chain drafts), or
- `keep(start, offsets)`: of the slots from `start` on, keep only the accepted tree nodes, moved down
  to be contiguous. Keys are stored after RoPE, so moving a slot does not change what it encodes:
  the accepted path's positions were already cache_len + depth, exactly where they end up.
"""

import torch


class KVCache:
    def __init__(self, num_layers, num_kv_heads, head_dim, capacity, *, batch=1,
                 dtype=torch.float32, device="cpu"):
        shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0  # slots in use; new tokens go to [length, length + T)
        self._write_start = 0

    @classmethod
    def for_model(cls, model, capacity, batch=1):
        c = model.config
        return cls(c.num_layers, c.num_kv_heads, c.head_dim, capacity, batch=batch,
                   dtype=model.dtype, device=model.device)

    def reserve(self, count: int) -> None:
        """Claim the next `count` slots for the tokens of the forward pass about to run."""
        if self.length + count > self.capacity:
            raise RuntimeError(f"KV cache full: {self.length} + {count} > capacity {self.capacity}")
        self._write_start = self.length
        self.length += count

    def write(self, layer: int, k, v):
        """Store one layer's K/V for the reserved slots ([B, K, T, E] each); return that layer's whole
        history including them ([B, K, length, E] views, no copy)."""
        start, end = self._write_start, self._write_start + k.shape[2]
        self.keys[layer, :, :, start:end] = k
        self.values[layer, :, :, start:end] = v
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

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
        offsets = torch.as_tensor(offsets, dtype=torch.long, device=self.keys.device)
        count = len(offsets)
        if count and not bool((offsets == torch.arange(count, device=offsets.device)).all()):
            source = start + offsets
            if bool((offsets[1:] <= offsets[:-1]).any()) or int(source[-1]) >= self.length:
                raise ValueError("keep() needs ascending offsets inside the cache")
            # indexing with a tensor gathers into a fresh tensor first, so overlapping moves are safe
            self.keys[:, :, :, start:start + count] = self.keys[:, :, :, source]
            self.values[:, :, :, start:start + count] = self.values[:, :, :, source]
        self.truncate(start + count)

    def memory_bytes(self) -> int:
        """Bytes allocated for keys and values (the whole capacity)."""
        return self.keys.nbytes + self.values.nbytes
