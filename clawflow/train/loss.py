"""Policy losses as pure functions of tensors (no model, no config, no I/O).

Binary RL (GRPO/PPO-style, as in OpenClaw-RL):
    A_t       = r  for every response token t of a turn, r in {+1, -1}  (no critic, no baseline)
    ratio_t   = exp(log pi(a_t) - log pi_old(a_t))
    loss_t    = -min(ratio_t * A_t, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_t)
    w_t       = min(exp(log pi_old(a_t) - log pi_rollout(a_t)), tis_cap)   (optional, detached)
    loss      = mean over sequences with >= 1 token of ( token-mean of w_t * loss_t )

Simplifications chosen: no KL term (beta = 0), no group normalization of A yet, asymmetric clip
("clip-higher", eps_high > eps_low). When pi_old is the recorded rollout policy, as in clawflow
today, the TIS weight is 1 and can be left off.

Shapes: B = sequences, T = token positions (targets), V = vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor


def binary_rl_advantages(rewards: Tensor, mask: Tensor) -> Tensor:
    """A[b, t] = rewards[b] where mask[b, t], else 0.  rewards: [B], mask: [B, T] -> [B, T]."""
    return rewards.to(torch.float32)[:, None] * mask.to(torch.float32)  # [B, T]


def ppo_clip_loss(
    logprobs: Tensor,  # [B, T] log pi(a_t), carries the gradient
    old_logprobs: Tensor,  # [B, T] log pi_old(a_t)
    advantages: Tensor,  # [B, T]
    mask: Tensor,  # [B, T] 1 on trained tokens
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    rollout_logprobs: Tensor | None = None,  # [B, T] log pi_rollout(a_t), for TIS
    tis_cap: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped surrogate loss (see module docstring), token-mean per sequence, mean over sequences.

    Returns the scalar loss and metrics as python floats: `clip_fraction` (share of tokens whose
    gradient the clip removed), `ratio_mean`, `n_tokens`, `n_seqs` (sequences with >= 1 token).
    """
    m = mask.to(torch.bool)
    mf = m.to(logprobs.dtype)
    old = old_logprobs.detach()
    log_ratio = torch.where(m, logprobs - old, torch.zeros_like(logprobs))  # [B, T], 0 off-mask
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)  # [B, T]
    if rollout_logprobs is not None:
        w = torch.exp(torch.where(m, old - rollout_logprobs.detach(), torch.zeros_like(old)))
        if tis_cap is not None:
            w = torch.clamp(w, max=tis_cap)
        per_token = per_token * w.detach()

    n_tok = mf.sum(dim=-1)  # [B]
    has_tok = n_tok > 0
    per_seq = (per_token * mf).sum(dim=-1) / n_tok.clamp(min=1)  # [B]
    n_seqs = int(has_tok.sum())
    if n_seqs:
        loss = per_seq[has_tok].mean()
    else:
        loss = (logprobs * 0.0).sum()  # keeps the graph, zero gradient

    with torch.no_grad():
        total = max(int(m.sum()), 1)
        cut = (clipped < unclipped) & m  # min() took the constant clipped branch: no gradient
        metrics = {
            "clip_fraction": float(cut.sum()) / total,
            "ratio_mean": float((ratio * mf).sum()) / total,
            "n_tokens": float(m.sum()),
            "n_seqs": float(n_seqs),
        }
    return loss, metrics


def sequence_logprobs(logits: Tensor, targets: Tensor, chunk_tokens: int = 1024) -> Tensor:
    """log softmax(logits)[b, t, targets[b, t]] in float32.  logits: [B, T, V], targets: [B, T].

    Computed as logits[target] - logsumexp(logits) over slices of one row and `chunk_tokens`
    positions, so the float32 [B, T, V] log-softmax never exists at once (only one [chunk, V]
    temporary); logsumexp's backward reuses the logits instead of saving a log-softmax copy, and
    slicing a row never copies a strided view such as `logits[:, :-1]`.
    """
    B, T, _ = logits.shape
    rows = []
    for b in range(B):
        parts = []
        for t in range(0, T, chunk_tokens):
            x = logits[b, t : t + chunk_tokens].float()  # [n, V]
            picked = x.gather(-1, targets[b, t : t + chunk_tokens, None]).squeeze(-1)  # [n]
            parts.append(picked - torch.logsumexp(x, dim=-1))
        rows.append(torch.cat(parts) if parts else logits.new_zeros(0, dtype=torch.float32))
    if not rows:
        return logits.new_zeros((0, T), dtype=torch.float32)
    return torch.stack(rows)  # [B, T]
