"""Choosing the next token from a row's logits (pure math; the batcher calls it per row)."""

from __future__ import annotations

import torch

# The nucleus is looked for among the likeliest 64, then 1024 tokens before the whole vocabulary is
# sorted: on one core a 49k-token sort costs ~4 ms a row a token, a top-64 ~0.2 ms, a top-1024
# ~0.6 ms (2026-12-07). A real model's nucleus is almost always within the first.
NUCLEUS_FIRST = 64
NUCLEUS_SECOND = 1024


def nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest set of likeliest tokens whose probability reaches `top_p` (the top token
    always): (token ids, their probabilities), likeliest first."""
    for k in (NUCLEUS_FIRST, NUCLEUS_SECOND):
        p, idx = torch.topk(probs, min(k, probs.numel()))
        if float(p.sum()) >= top_p or k >= probs.numel():
            break
    else:  # a flat distribution: the nucleus is wider still
        p, idx = torch.sort(probs, descending=True)
    keep = torch.cumsum(p, dim=-1) - p < top_p
    keep[0] = True  # a top_p that underflows float32 keeps nothing else
    return idx[keep], p[keep]


def draw(p: torch.Tensor, gen: torch.Generator | None) -> int:
    """An index of `p` (non-negative weights, any sum) drawn in proportion to its weight, by the
    inverse CDF: one uniform number (so a seeded generator repeats its draws), 20x cheaper than
    `torch.multinomial` over a whole vocabulary."""
    cdf = torch.cumsum(p, dim=-1)
    u = torch.rand(1, generator=gen, dtype=cdf.dtype) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), p.numel() - 1)  # right: skips zero weights


def sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> int:
    """One token from 1-D logits: greedy at temperature 0, else temperature then nucleus (top-p)."""
    if temperature <= 1e-6:  # 0, or so small that float32 division breaks down: greedy either way
        return int(torch.argmax(logits))
    probs = torch.softmax((logits - logits.max()) / temperature, dim=-1)  # finite at any temperature > 0
    if top_p >= 1.0:
        return draw(probs, gen)
    idx, p = nucleus(probs, top_p)
    return int(idx[draw(p, gen)])
