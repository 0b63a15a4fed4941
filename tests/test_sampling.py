"""The serving sampler: nucleus (top-p) and the inverse-CDF draw, against the definitions."""

from __future__ import annotations

import pytest
import torch

from clawflow.serving.sampling import NUCLEUS_FIRST, NUCLEUS_SECOND, draw, nucleus, sample


def nucleus_by_full_sort(probs: torch.Tensor, top_p: float) -> set[int]:
    """The definition: sort the whole vocabulary, keep while the mass before a token is < top_p."""
    p, idx = torch.sort(probs, descending=True)
    keep = torch.cumsum(p, 0) - p < top_p
    keep[0] = True
    return set(idx[keep].tolist())


@pytest.mark.parametrize("scale", [0.5, 1.5, 3.0, 12.0])  # flat (the nucleus is wider than either look) to peaked
@pytest.mark.parametrize("top_p", [1e-9, 0.1, 0.5, 0.9, 0.999])
def test_nucleus_is_the_full_sorts_nucleus(scale, top_p):
    gen = torch.Generator().manual_seed(7)
    probs = torch.softmax(torch.randn(5000, generator=gen) * scale, 0)
    idx, p = nucleus(probs, top_p)
    assert set(idx.tolist()) == nucleus_by_full_sort(probs, top_p)
    assert torch.equal(p, probs[idx]) and bool((p[:-1] >= p[1:]).all())  # their probabilities, likeliest first


def test_every_path_of_nucleus_is_taken():
    """The cases above reach the first look, the second and the full sort (or the test would not tell)."""
    sizes = {scale: len(nucleus(torch.softmax(torch.randn(5000, generator=torch.Generator().manual_seed(7)) * scale, 0),
                                0.5)[0]) for scale in (0.5, 1.5, 12.0)}
    assert sizes[12.0] < NUCLEUS_FIRST < sizes[1.5] < NUCLEUS_SECOND < sizes[0.5], sizes


def test_draw_follows_the_weights_and_never_picks_a_zero_weight():
    gen = torch.Generator().manual_seed(0)
    weights = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0])  # any sum: draw normalizes
    n = 20000
    counts = torch.bincount(torch.tensor([draw(weights * 3, gen) for _ in range(n)]), minlength=6)
    assert counts[[0, 2, 5]].sum() == 0
    assert torch.allclose(counts.float() / n, weights, atol=0.015), counts


def test_a_seeded_generator_repeats_its_tokens():
    logits = torch.randn(49152, generator=torch.Generator().manual_seed(1))
    runs = [[sample(logits, 0.8, top_p, torch.Generator().manual_seed(42)) for top_p in (1.0, 0.9)] for _ in range(2)]
    assert runs[0] == runs[1]
    other = [[sample(logits, 0.8, 0.9, torch.Generator().manual_seed(s))] for s in range(20)]
    assert len({tuple(o) for o in other}) > 1  # and the seed matters


def test_temperature_zero_is_greedy_and_top_p_limits_the_tokens():
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    assert sample(logits, 0.0, 1.0, None) == 1
    gen = torch.Generator().manual_seed(3)
    assert {sample(logits, 1.0, 0.5, gen) for _ in range(200)} == {1}  # token 1 alone holds > half
    assert {sample(logits, 1.0, 0.9, gen) for _ in range(200)} == {1, 2}
