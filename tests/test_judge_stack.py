"""Stacking the reader's probe under the final head (pure tensor math, no model)."""

from __future__ import annotations

import torch

from clawflow.judge.stack import fit_stacked, out_of_fold_probs, stacked_probs


def data(n: int = 40, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(seed)
    labels = [(-1, 0, 1)[i % 3] for i in range(n)]
    centers = torch.tensor([[-2.0, 0.0], [0.0, 2.0], [2.0, 0.0]])
    reader_x = torch.stack([centers[y + 1] for y in labels]) + 0.5 * torch.randn(n, 2, generator=g)
    x = torch.randn(n, 3, generator=g)  # the MiniLM features here: noise
    return x, reader_x, labels


def test_out_of_fold_probs_never_see_their_own_label():
    _, reader_x, labels = data()
    before = out_of_fold_probs(reader_x, labels, l2=0.01, folds=5)
    flipped = list(labels)
    flipped[7] = 1 if labels[7] != 1 else -1
    after = out_of_fold_probs(reader_x, flipped, l2=0.01, folds=5)
    assert torch.equal(before[7], after[7])  # row 7 was held out when its probe was fitted
    assert not torch.equal(before[3], after[3])  # row 3 is in another fold: its probe saw the flip
    assert before.shape == (40, 3) and torch.allclose(before.sum(1), torch.ones(40), atol=1e-5)


def test_the_final_head_learns_from_the_probe():
    x, reader_x, labels = data()
    probe, final = fit_stacked(x, reader_x, labels, l2=0.01, l2_reader=0.01)
    assert final.weight.shape == (3 + 3, 3) and probe.weight.shape == (2, 3)
    tx, trx, tlabels = data(seed=1)
    pred = stacked_probs(probe, final, tx, trx).argmax(1)
    accuracy = (pred == torch.tensor([y + 1 for y in tlabels])).float().mean()
    assert accuracy >= 0.9  # noise features alone would give about 1/3


def test_the_reader_reads_a_long_tool_result_by_its_head_and_tail():
    from clawflow.judge.reader import clip_tokens

    ids = list(range(200))
    assert clip_tokens(ids, "tool", 64, 48) == list(range(48)) + list(range(152, 200))
    assert clip_tokens(ids[:96], "tool", 64, 48) == ids[:96]  # not longer than head + tail: whole
    assert clip_tokens(ids, "user", 64, 48) == ids[:64]  # a user message: from the start
    assert clip_tokens([], "tool") == [] and clip_tokens(ids[:10], "user") == ids[:10]
