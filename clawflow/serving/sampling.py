"""Choosing the next token from a row's logits (pure math; the batcher calls it per row)."""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> int:
    """One token from 1-D logits: greedy at temperature 0, else temperature then nucleus (top-p)."""
    if temperature <= 1e-6:  # 0, or so small that float32 division breaks down: greedy either way
        return int(torch.argmax(logits))
    probs = torch.softmax((logits - logits.max()) / temperature, dim=-1)  # finite at any temperature > 0
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < top_p
        keep[0] = True  # the top token always (a top_p that underflows float32 keeps nothing else)
        probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))
