"""Policy losses as pure functions of tensors (no model, no config, no I/O).

Per token t of a trained sequence (advantages A_t come from `advantages.py`):
    ratio_t = exp(log pi(a_t) - log pi_old(a_t))
    pg_t    = -min(ratio_t * A_t, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_t)      PPO clip
    pg_t    = min(pg_t, -dual_clip * A_t)   where A_t < 0                             dual clip
    w_t     = min(exp(log pi_old(a_t) - log pi_rollout(a_t)), tis_cap)   (detached)   TIS
    kl_t    = exp(ref_t - lp_t) - (ref_t - lp_t) - 1                                  k3 KL to base
    loss_t  = s_b * w_t * pg_t + beta * kl_t          s_b = per-sequence (staleness) weight

Aggregation is a choice made once from config (`AGGREGATIONS`): "seq_mean" takes the token mean
of each sequence, then the mean over sequences that have tokens (OpenClaw-RL, GRPO); "token_mean"
divides the sum over all tokens by their count (DAPO: long replies weigh more). Both return a
(numerator, denominator) pair so a step split over micro-batches and ranks divides by the global
denominator and equals the loss of one process on the whole batch.

Simplifications chosen: no value function, clip-higher (eps_high > eps_low), beta = 0 by default
(then the reference model is never run), the ratio's pi_old is the policy at the start of the
run (recorded rollout logprobs only enter through the TIS weight).

Shapes: B = sequences, T = target positions, V = vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from clawflow.policy.logprobs import sequence_logprobs  # noqa: F401 - the loss math reads it from here


def ppo_clip_per_token(
    logprobs: Tensor,  # [B, T] log pi(a_t), carries the gradient
    old_logprobs: Tensor,  # [B, T] log pi_old(a_t)
    advantages: Tensor,  # [B, T]
    mask: Tensor,  # [B, T] 1 on trained tokens
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float | None = None,  # c > 1, bounds the loss of negative-advantage tokens
) -> tuple[Tensor, Tensor, Tensor]:
    """Clipped surrogate per token (module docstring). Returns (pg [B, T] zero off-mask,
    ratio [B, T] detached, clipped [B, T] bool: tokens whose gradient a clip removed)."""
    m = mask.to(torch.bool)
    log_ratio = torch.where(m, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    pg = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    if dual_clip is not None:
        pg3 = -advantages * dual_clip
        dual = (advantages < 0) & (pg3 < pg)
        pg = torch.where(dual, pg3, pg)
        clipped = clipped | dual
    pg = torch.where(m, pg, torch.zeros_like(pg))
    return pg, ratio.detach(), clipped & m


def tis_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, cap: float | None) -> Tensor:
    """Truncated importance weight min(pi_old / pi_rollout, cap), detached, 1 off-mask.  [B, T]."""
    m = mask.to(torch.bool)
    d = torch.where(m, old_logprobs.detach() - rollout_logprobs.detach(), torch.zeros_like(old_logprobs))
    w = torch.exp(d)
    return w.clamp(max=cap) if cap is not None else w


def sft_per_token(logprobs: Tensor, weight: float = 1.0) -> Tensor:
    """Per-token loss of supervised distillation: weight * NLL of the target token.  [B, T] -> [B, T]
    (zero it off-mask with the caller's mask, as the aggregations do)."""
    return -weight * logprobs


def topk_distill_per_token(student_lp: Tensor, teacher_lp: Tensor, weight: float = 1.0) -> Tensor:
    """Per-token cross-entropy to the teacher's top-k: -weight * sum_k p~_k log q(id_k), with p~
    the teacher's k probabilities renormalized to sum to 1.  student_lp, teacher_lp: [B, T, K] (log
    q and log p at the teacher's k likeliest ids) -> [B, T]. Where the teacher is sure, this is the
    sampled token's NLL; where it hesitates (the fact, not the style) the student keeps its spread
    instead of learning one sample's pick."""
    p = torch.softmax(teacher_lp.detach().float(), dim=-1)
    return -weight * (p * student_lp).sum(dim=-1)


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per sampled token, >= 0, zero off-mask.  [B, T]."""
    d = torch.where(mask.to(torch.bool), ref_logprobs.detach() - logprobs, torch.zeros_like(logprobs))
    return torch.exp(d) - d - 1.0


def seq_mean(per_token: Tensor, mask: Tensor) -> tuple[Tensor, float]:
    """(sum over sequences of their token means, number of sequences with >= 1 token)."""
    mf = mask.to(per_token.dtype)
    n = mf.sum(dim=-1)  # [B]
    num = ((per_token * mf).sum(dim=-1) / n.clamp(min=1)).sum()
    return num, float((n > 0).sum())


def token_mean(per_token: Tensor, mask: Tensor) -> tuple[Tensor, float]:
    """(sum over all tokens, number of tokens)."""
    mf = mask.to(per_token.dtype)
    return (per_token * mf).sum(), float(mf.sum())


Aggregation = Callable[[Tensor, Tensor], tuple[Tensor, float]]
AGGREGATIONS: dict[str, Aggregation] = {"seq_mean": seq_mean, "token_mean": token_mean}


