"""A KV cache that keeps its window by moving data (the definition of a rolling window with a sink), to check the
ring-buffer arithmetic of ``model.kv_cache.KVCache`` against."""
import torch

from wan_accel.model.kv_cache import KVCache


class ShiftingCache(KVCache):
    """Before each new chunk the sink tokens and the newest tokens that stay visible are moved (data copies) to the
    front of the buffers in chronological order, and the chunk is written after them. No ring arithmetic."""

    def __init__(self, layers, batch, capacity, heads, head_dim, sink=0, dtype=torch.float32):
        super().__init__(layers, batch, capacity, heads, head_dim, rolling=False, dtype=dtype)
        self.sink, self.ids = sink, []

    def plan(self, start, n):
        if start == self.end:                      # a new chunk: evict, compact, append
            sink = [g for g in self.ids if g < self.sink]
            rest = [g for g in self.ids if g >= self.sink]
            room = max(0, self.capacity - self.sink - n)
            keep = sink + rest[max(0, len(rest) - room):] if room else sink
            src = torch.tensor([self.ids.index(g) for g in keep], dtype=torch.long)
            for layer in self.layers:
                if len(keep):
                    layer.k[:, :len(keep)] = layer.k[:, src].clone()
                    layer.v[:, :len(keep)] = layer.v[:, src].clone()
            self.ids = keep + list(range(start, start + n))
            self.end = start + n
        d0 = self.ids.index(start)
        return self._step(((d0, d0 + n, 0, n),), len(self.ids))

    def ordered(self, layer):
        kv = self.layers[layer]
        return kv.k[:, :len(self.ids)], kv.v[:, :len(self.ids)]
