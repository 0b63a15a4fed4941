"""Advantages as pure tensor functions: binary RL, group-normalized RL, OPD, their sum, staleness.

Binary RL (OpenClaw-RL): every response token of a turn scored r in {+1, -1} gets A_t = r; turns
scored 0 carry no RL term. No critic and no batch baseline: the judge's score is already signed.

Group-normalized RL (GRPO): when several samples answer the same prompt (`group_id`, e.g. `n > 1`
or a sampled environment task), A = (r - mean_g) / (std_g + eps), std unbiased as in GRPO/TRL;
a group whose rewards are all equal carries no signal and is dropped; a sample alone in its group
keeps A = r (normalizing one sample would zero it).

OPD (on-policy distillation from hindsight hints):
    A_t = log pi_teacher(a_t | prompt + hint) - log pi_old(a_t | prompt)
optionally clipped to [-c, c]; turns without a hint have no OPD term at all. (OpenClaw-RL's
combined mode gives such turns `rollout - recomputed` logprob as a "teacher" term: noise we omit.)

Combined: A_t = w_rl * A_rl + w_opd * A_opd * has_hint.

Staleness: a turn sampled by policy version v, trained into version V + 1 from parent V, is
V - v versions stale. Beyond `max_staleness` it is dropped (weight 0) or down-weighted by
`decay ** (staleness - max_staleness)`.

Shapes: N = samples, B = sequences in a micro-batch, T = target positions.
"""

from __future__ import annotations

import torch
from torch import Tensor


def binary_rl_advantages(rewards: Tensor, mask: Tensor) -> Tensor:
    """A[b, t] = rewards[b] where mask[b, t], else 0.  rewards: [B], mask: [B, T] -> [B, T]."""
    return rewards.to(torch.float32)[:, None] * mask.to(torch.float32)  # [B, T]


def group_normalized_rewards(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Per-sample RL advantage and a keep flag.  rewards: [N] float, group_ids: [N] long, -1 = no group.

    Samples sharing a group id >= 0 with at least one other sample get (r - mean) / (std + eps);
    a zero-variance group gets keep = False. Everything else keeps A = r. Returns (adv [N], keep [N]).
    """
    r = rewards.to(torch.float32)
    adv, keep = r.clone(), torch.ones_like(r, dtype=torch.bool)
    for g in torch.unique(group_ids[group_ids >= 0]):
        idx = (group_ids == g).nonzero(as_tuple=True)[0]
        if idx.numel() < 2:
            continue
        rg = r[idx]
        std = rg.std(unbiased=True)
        if float(std) == 0.0:
            keep[idx] = False
            adv[idx] = 0.0
        else:
            adv[idx] = (rg - rg.mean()) / (std + eps)
    return adv, keep


def negative_scaled(adv: Tensor, negative_weight: float) -> Tensor:
    """A < 0 times `negative_weight`, A >= 0 unchanged.  [N] -> [N]."""
    return torch.where(adv < 0, adv * negative_weight, adv) if negative_weight != 1.0 else adv


def opd_advantages(teacher_logprobs: Tensor, old_logprobs: Tensor, has_hint: Tensor, mask: Tensor,
                   clip: float | None = None) -> Tensor:
    """A[b, t] = teacher - old on response tokens of hinted sequences, else 0.

    teacher_logprobs, old_logprobs, mask: [B, T]; has_hint: [B] bool. `clip` bounds |A|.
    """
    adv = (teacher_logprobs - old_logprobs).detach().to(torch.float32)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    live = mask.to(torch.bool) & has_hint.to(torch.bool)[:, None]
    return torch.where(live, adv, torch.zeros_like(adv))  # [B, T]


def combined_advantages(rl: Tensor, opd: Tensor, rl_weight: float, opd_weight: float) -> Tensor:
    """w_rl * A_rl + w_opd * A_opd (both [B, T]; OPD is already 0 where there is no hint)."""
    return rl_weight * rl + opd_weight * opd


def staleness_weights(turn_versions: Tensor, parent_version: int, max_staleness: int | None,
                      mode: str = "drop", decay: float = 0.5) -> Tensor:
    """Per-sample weight in [0, 1] from policy staleness.  turn_versions: [N] long -> [N] float.

    `mode` is "drop" (weight 0 beyond the bound) or "decay" (decay ** versions beyond the bound).
    A turn from a version newer than the parent (clock skew, a rollback) counts as fresh.
    """
    stale = (parent_version - turn_versions.to(torch.long)).clamp(min=0).to(torch.float32)  # [N]
    if max_staleness is None:
        return torch.ones_like(stale)
    over = (stale - max_staleness).clamp(min=0)
    if mode == "drop":
        return (over == 0).to(torch.float32)
    if mode == "decay":
        return torch.pow(torch.tensor(decay, dtype=torch.float32), over)
    raise ValueError(f"unknown staleness mode {mode!r} (drop | decay)")
