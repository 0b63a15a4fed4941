"""Prefix KV cache of the embedded engine's batcher: a small LRU of prompts' prefilled KV.

A request whose prompt starts with tokens an earlier prompt already prefilled (a chat template's
system prompt, an agent's long system prompt, the earlier turns a multi-turn chat re-sends) reuses
their keys/values and prefills only the new tail: SGLang's RadixAttention / vLLM's prefix caching,
without the tree. Entries are keyed by policy version: another model's KV is never returned.
Each entry counts how often it was reused (`hottest` ranks by that, then by recency): a hot reload
re-prefills the hottest prompts with the new weights before it swaps (clawflow/serving/rewarm.py).

Tensors are shared, never copied, and never written in place: `lookup` hands out slices (views)
of the stored tensors, and everything that later touches them makes new tensors: transformers'
`DynamicLayer.update` (5.x, cache_utils.py) and `lazy_initialization` grow a layer with
`torch.cat([self.keys, key_states], dim=-2)`; the batcher pads, merges and trims with `torch.cat`
and indexing. Used from the decode thread only (no lock).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [1, kv_heads, T, head_dim]


def common_prefix(a: tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    def __init__(self, max_tokens: int, min_tokens: int):
        self.max_tokens, self.min_tokens = max_tokens, min_tokens
        self._entries: OrderedDict[tuple[Any, tuple[int, ...]], Layers] = OrderedDict()  # oldest use first
        self._uses: dict[tuple[Any, tuple[int, ...]], int] = {}  # times each entry was reused
        self.tokens = 0  # stored tokens, all entries together
        self.lookups = self.hits = self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def versions(self) -> set:
        return {v for v, _ in self._entries}

    def lookup(self, version, prompt_ids: list[int]) -> tuple[int, Layers | None]:
        """(n, per-layer KV of prompt_ids[:n]) from the entry sharing the longest prefix, or (0, None).
        n <= len(prompt_ids) - 1: the last prompt token is always run, its logits give the first token."""
        self.lookups += 1
        best, best_key = 0, None
        for key in self._entries:
            if key[0] == version and (n := common_prefix(key[1], prompt_ids)) > best:
                best, best_key = n, key
        best = min(best, len(prompt_ids) - 1)
        if best_key is None or best < self.min_tokens:
            return 0, None
        layers = self._entries[best_key]
        if any(k.shape[2] < best or v.shape[2] < best for k, v in layers):  # KV shorter than its tokens: never
            self._remove(best_key)  # serve a part that is not there (it cannot happen through store)
            return 0, None
        self._entries.move_to_end(best_key)
        self._uses[best_key] += 1
        self.hits += 1
        self.reused_tokens += best
        return best, [(k[:, :, :best], v[:, :, :best]) for k, v in layers]

    def store(self, version, prompt_ids: list[int], layers: Layers) -> None:
        """Keep prompt_ids' KV, then evict least recently used entries down to max_tokens."""
        tokens = tuple(prompt_ids)
        if len(tokens) > self.max_tokens or len(tokens) < self.min_tokens:
            return  # too long to keep, or too short to ever be reused
        if any(k.shape[2] < len(tokens) or v.shape[2] < len(tokens) for k, v in layers):
            raise ValueError(f"KV of {min(k.shape[2] for k, _ in layers)} positions for {len(tokens)} tokens")
        uses = 0
        for key in list(self._entries):
            if key[0] != version:
                continue
            n = common_prefix(key[1], tokens)
            if n == len(tokens) < len(key[1]):  # a longer entry already serves every lookup this one would
                self._entries.move_to_end(key)
                return
            if n == len(key[1]):  # the same tokens (replaced), or a prefix of the new prompt (an earlier
                uses = max(uses, self._uses[key])  # turn of this chat): the new entry serves every lookup
                self._remove(key)  # it would, and inherits its heat
        self._entries[(version, tokens)] = [(k[:, :, : len(tokens)], v[:, :, : len(tokens)]) for k, v in layers]
        self._uses[(version, tokens)] = uses
        self.tokens += len(tokens)
        while self.tokens > self.max_tokens:
            self._remove(next(iter(self._entries)))

    def hottest(self, version) -> list[tuple[int, ...]]:
        """`version`'s prompts, hottest first: most reused, then most recently used."""
        keys = [k for k in reversed(self._entries) if k[0] == version]  # most recent first
        return [k[1] for k in sorted(keys, key=lambda k: -self._uses[k])]  # stable: recency breaks ties

    def hottest_adapters(self, version) -> list[tuple[Any, tuple[int, ...]]]:
        """(adapter key or None, prompt) of every entry of `version`, its users' adapters' included,
        most used first (the re-warm's order)."""
        def adapter(k):
            if k[0] == version:
                return None
            return k[0][1] if isinstance(k[0], tuple) and len(k[0]) == 2 and k[0][0] == version else False

        keys = [k for k in reversed(self._entries) if adapter(k) is not False]  # most recent first
        return [(adapter(k), k[1]) for k in sorted(keys, key=lambda k: -self._uses[k])]

    def entries(self, version) -> list[tuple[tuple[int, ...], Layers]]:
        """`version`'s (prompt, per-layer KV), least recently used first."""
        return [(k[1], layers) for k, layers in self._entries.items() if k[0] == version]

    def drop_version(self, version) -> None:
        """`version`'s entries, those kept under (version, adapter) too."""
        for key in [k for k in self._entries if k[0] == version or (isinstance(k[0], tuple) and k[0][0] == version)]:
            self._remove(key)

    def _remove(self, key) -> None:
        del self._entries[key]
        del self._uses[key]
        self.tokens -= len(key[1])
