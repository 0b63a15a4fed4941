"""The embedded judge's classifier: multinomial logistic regression on standardized features.

Pure tensor functions: `fit` is full-batch L-BFGS on cross-entropy + L2 (deterministic for a given
input), `predict` returns class probabilities over (−1, 0, +1). A dozen features and a few hundred
labelled items: nothing bigger is warranted, and a linear head keeps the judge inspectable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clawflow.judge.features import CLASSES


@dataclass
class Head:
    weight: torch.Tensor  # (f, 3)
    bias: torch.Tensor  # (3,)
    mean: torch.Tensor  # (f,)
    std: torch.Tensor  # (f,)

    def probs(self, x: torch.Tensor) -> torch.Tensor:
        """(n, f) raw features → (n, 3) probabilities in CLASSES order."""
        return torch.softmax(((x - self.mean) / self.std) @ self.weight + self.bias, dim=-1)

    def predict(self, x: torch.Tensor) -> list[int]:
        return [CLASSES[i] for i in self.probs(x).argmax(-1).tolist()]


def fit(x: torch.Tensor, labels: list[int], l2: float = 0.01, max_iter: int = 500) -> Head:
    x = x.to(torch.float32)
    y = torch.tensor([CLASSES.index(v) for v in labels])
    mean, std = x.mean(0), x.std(0).clamp(min=1e-6)
    xs = (x - mean) / std
    w = torch.zeros(x.shape[1], len(CLASSES), requires_grad=True)
    b = torch.zeros(len(CLASSES), requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(xs @ w + b, y) + l2 * (w ** 2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return Head(w.detach(), b.detach(), mean, std)
