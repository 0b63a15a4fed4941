"""Stacking the reader's probe onto the MiniLM features: two logistic heads, fitted so the second
never sees the first's in-sample (overconfident) probabilities.

Pure tensor functions. `fit_stacked` fits the reader's probe on all rows, and the final head on the
MiniLM features plus the probe's *out-of-fold* p(−1, 0, +1) for each row (`folds`-fold, rows
assigned by index), which is what the probe will give on a turn it never saw.
"""

from __future__ import annotations

import torch

from clawflow.judge.head import Head, fit


def with_probs(x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, probs], dim=1)


def out_of_fold_probs(reader_x: torch.Tensor, labels: list[int], l2: float, folds: int) -> torch.Tensor:
    n = reader_x.shape[0]
    out = torch.zeros(n, 3)
    for f in range(folds):
        held = [i for i in range(n) if i % folds == f]
        keep = [i for i in range(n) if i % folds != f]
        if not held:
            continue
        probe = fit(reader_x[keep], [labels[i] for i in keep], l2)
        out[held] = probe.probs(reader_x[held])
    return out


def fit_stacked(x: torch.Tensor, reader_x: torch.Tensor, labels: list[int], l2: float, l2_reader: float,
                folds: int = 5) -> tuple[Head, Head]:
    """(probe on reader features, final head on x + probe probabilities)."""
    probe = fit(reader_x, labels, l2_reader)
    final = fit(with_probs(x, out_of_fold_probs(reader_x, labels, l2_reader, folds)), labels, l2)
    return probe, final


def stacked_probs(probe: Head, final: Head, x: torch.Tensor, reader_x: torch.Tensor) -> torch.Tensor:
    return final.probs(with_probs(x, probe.probs(reader_x)))
