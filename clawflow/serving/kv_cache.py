"""The engine's KV cache: a transformers `DynamicCache` whose layers append in place.

`DynamicLayer.update` concatenates (`torch.cat`) the new position onto the whole cache, so every
decode step copies every layer's keys and values: after an agent's ~7.7k-token prompt that is
~350 MB per step for SmolLM2-135M (bench/decode_floor.py, fp32, after 4,096 cached tokens: 105.7 →
71.9 ms per step at batch 1, 459 → 239 ms at batch 8). `AppendLayer` keeps them as views
of a buffer with SLACK spare positions and writes new ones into it, so a copy happens once per
SLACK steps. The batcher may replace `layer.keys`/`.values` with new tensors (padding, a row
joining or leaving); the next update sees they are no longer a view of its buffer and adopts them
into a new one. A view handed out earlier (the prefix cache stores them) never changes: positions
are only ever written past the end of the current view (nothing here shortens a view in place).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

SLACK = 64  # spare positions per buffer: one copy per 64 decode steps; 2.9 MB a row for SmolLM2


class AppendLayer(DynamicLayer):
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.keys.shape[-2] if self.keys.numel() else 0
        m = key_states.shape[-2]
        buf = getattr(self, "_kbuf", None)
        owned = (buf is not None and n > 0 and self.keys.data_ptr() == buf.data_ptr()
                 and self.keys.shape[:2] == buf.shape[:2] and self.keys.stride() == buf.stride()
                 and self.values.data_ptr() == self._vbuf.data_ptr())
        if not owned or n + m > buf.shape[-2]:  # adopt what is there into a new, larger buffer
            cap = n + m + SLACK
            kb = key_states.new_empty(*key_states.shape[:2], cap, key_states.shape[-1])
            vb = value_states.new_empty(*value_states.shape[:2], cap, value_states.shape[-1])
            if n:
                kb[:, :, :n], vb[:, :, :n] = self.keys, self.values
            self._kbuf, self._vbuf = kb, vb
        self._kbuf[:, :, n:n + m] = key_states
        self._vbuf[:, :, n:n + m] = value_states
        self.keys, self.values = self._kbuf[:, :, :n + m], self._vbuf[:, :, :n + m]
        return self.keys, self.values


def new_cache() -> DynamicCache:
    cache = DynamicCache()
    cache.layer_class_to_replicate = AppendLayer
    return cache


def pad_left(cache, n: int) -> None:
    """Prepend `n` zero positions to every layer's keys and values (the batch's left padding)."""
    if n <= 0:
        return
    for layer in cache.layers:
        b, h, _, d = layer.keys.shape
        layer.keys = torch.cat([layer.keys.new_zeros(b, h, n, d), layer.keys], 2)
        layer.values = torch.cat([layer.values.new_zeros(b, h, n, layer.values.shape[-1]), layer.values], 2)
