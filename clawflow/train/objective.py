"""The training objective, assembled once from `TrainConfig` (no string checks in the loop).

`Objective.from_config` resolves the objective name to (RL weight, OPD weight) and the
aggregation name to a function; `objective(logprobs, batch)` is then pure tensor math from
`advantages.py` and `loss.py`. Per-sample inputs that do not depend on the current weights (the
group-normalized RL advantage, the staleness weight, whether there is a hint) are computed once
per run by `sample_advantages`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from clawflow.config import TrainConfig
from clawflow.train.advantages import (binary_rl_advantages, combined_advantages, group_normalized_rewards,
                                       negative_scaled, opd_advantages, staleness_weights)
from clawflow.train.loss import (AGGREGATIONS, Aggregation, k3_kl, ppo_clip_per_token, sft_per_token, tis_weights,
                                 topk_distill_per_token)

# objective name -> which of (RL, OPD, distillation of rewritten replies) it uses
OBJECTIVES: dict[str, tuple[bool, bool, bool]] = {"rl": (True, False, False), "opd": (False, True, False),
                                                  "combined": (True, True, False), "distill": (True, False, True)}

# summed over micro-batches and ranks, then divided: see `Objective.metrics`
STAT_KEYS = ("pg", "kl", "clipped", "ratio_sum", "n_tok", "rl_adv_sum", "rl_tok", "opd_adv_sum", "opd_tok",
             "sft_nll_sum", "sft_tok")


@dataclass(frozen=True)
class Objective:
    rl_weight: float
    opd_weight: float
    eps_low: float
    eps_high: float
    dual_clip: float | None
    tis_cap: float | None
    kl_beta: float
    opd_clip: float | None
    aggregate: Aggregation
    distill_weight: float = 0.0
    distill_topk: int = 0

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> "Objective":
        use_rl, use_opd, use_distill = OBJECTIVES[cfg.objective]
        return cls(rl_weight=cfg.rl_weight if use_rl else 0.0, opd_weight=cfg.opd_weight if use_opd else 0.0,
                   eps_low=cfg.eps_low, eps_high=cfg.eps_high, dual_clip=cfg.dual_clip, tis_cap=cfg.tis_cap,
                   kl_beta=cfg.kl_beta, opd_clip=cfg.opd_clip, aggregate=AGGREGATIONS[cfg.aggregation],
                   distill_weight=cfg.distill_weight if use_distill else 0.0,
                   distill_topk=cfg.distill_topk if use_distill else 0)

    @property
    def needs_teacher(self) -> bool:
        """OPD scores replies under the hinted prompt."""
        return self.opd_weight != 0.0

    @property
    def rewrites(self) -> bool:
        """Distillation has the hinted policy rewrite a corrected turn's reply (train/rewrite.py)."""
        return self.distill_weight != 0.0

    @property
    def uses_hints(self) -> bool:
        return self.needs_teacher or self.rewrites

    def active(self, rl_adv: Tensor, has_hint: Tensor, weight: Tensor, rewrite: Tensor | None = None) -> Tensor:
        """[N] bool: samples with an RL, OPD or distillation term and a non-zero staleness weight."""
        rl = (rl_adv != 0) & (self.rl_weight != 0.0)
        opd = has_hint.to(torch.bool) & (self.opd_weight != 0.0)
        sft = rewrite.to(torch.bool) & self.rewrites if rewrite is not None else torch.zeros_like(rl)
        return (rl | opd | sft) & (weight > 0)

    def token_mask(self, b: dict[str, Tensor]) -> Tensor:
        """[B, R] the tokens this objective trains in a collated batch."""
        act = self.active(b["rl_adv"], b["has_hint"], b["weight"], b.get("rewrite"))
        return b["mask"] * act.to(b["mask"].dtype)[:, None]

    def denominator(self, b: dict[str, Tensor]) -> float:
        mask = self.token_mask(b)
        return self.aggregate(mask, mask)[1]

    def __call__(self, logprobs: Tensor, b: dict[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
        """(numerator of the loss, summed stats) for one micro-batch; divide by the global denominator.

        b: mask, old, rollout, teacher, ref [B, R]; rl_adv, has_hint, weight [B]; rewrite [B] (optional):
        rows holding a rewritten reply, trained by plain NLL (they were never sampled by pi_old, so
        neither the PPO ratio nor TIS applies to them); with `distill_topk`, topk_student (log pi, with
        its gradient) and topk_teacher [B, R, K]: those rows learn the teacher's top-k instead.
        """
        mask = self.token_mask(b)
        a_rl = binary_rl_advantages(b["rl_adv"], mask)
        a_opd = opd_advantages(b["teacher"], b["old"], b["has_hint"], mask, self.opd_clip)
        adv = combined_advantages(a_rl, a_opd, self.rl_weight, self.opd_weight)
        pg, ratio, clipped = ppo_clip_per_token(logprobs, b["old"], adv, mask, self.eps_low, self.eps_high,
                                                self.dual_clip)
        if self.tis_cap is not None:  # None: no TIS (pi_old is taken as the sampler)
            pg = pg * tis_weights(b["old"], b["rollout"], mask, self.tis_cap)
        sft = mask.to(torch.bool) & b["rewrite"].to(torch.bool)[:, None] if "rewrite" in b \
            else torch.zeros_like(mask, dtype=torch.bool)
        if self.rewrites:
            target = topk_distill_per_token(b["topk_student"], b["topk_teacher"], self.distill_weight) \
                if self.distill_topk and "topk_student" in b else sft_per_token(logprobs, self.distill_weight)
            pg = torch.where(sft, target, pg)
        pg = pg * b["weight"][:, None]
        kl = k3_kl(logprobs, b["ref"], mask)
        pg_num, _ = self.aggregate(pg, mask)
        kl_num, _ = self.aggregate(kl, mask)
        num = pg_num + self.kl_beta * kl_num if self.kl_beta else pg_num
        with torch.no_grad():
            m = mask.to(torch.bool)
            rl_tok = m & ~sft & (b["rl_adv"] != 0)[:, None] & (self.rl_weight != 0.0)
            opd_tok = m & b["has_hint"].to(torch.bool)[:, None] & (self.opd_weight != 0.0)
            stats = {"pg": float(pg_num), "kl": float(kl_num), "clipped": float(clipped.sum()),
                     "ratio_sum": float(ratio[m].sum()), "n_tok": float(m.sum()),
                     "rl_adv_sum": float(a_rl[rl_tok].sum()), "rl_tok": float(rl_tok.sum()),
                     "opd_adv_sum": float(a_opd[opd_tok].sum()), "opd_tok": float(opd_tok.sum()),
                     "sft_nll_sum": float(-logprobs.detach()[sft].sum()), "sft_tok": float(sft.sum())}
            if m.any():
                stats["ratio_min"], stats["ratio_max"] = float(ratio[m].min()), float(ratio[m].max())
        return num, stats

    @staticmethod
    def metrics(stats: dict[str, float], denominator: float) -> dict[str, float]:
        """Step metrics from stats summed over micro-batches and ranks."""
        n = max(stats["n_tok"], 1.0)
        return {"pg_loss": stats["pg"] / max(denominator, 1e-12), "kl": stats["kl"] / max(denominator, 1e-12),
                "clip_fraction": stats["clipped"] / n, "ratio_mean": stats["ratio_sum"] / n,
                "adv_rl_mean": stats["rl_adv_sum"] / max(stats["rl_tok"], 1.0),
                "adv_opd_mean": stats["opd_adv_sum"] / max(stats["opd_tok"], 1.0),
                "rl_tokens": stats["rl_tok"], "opd_tokens": stats["opd_tok"],
                "sft_nll": stats["sft_nll_sum"] / max(stats["sft_tok"], 1.0), "sft_tokens": stats["sft_tok"]}


def sample_advantages(cfg: TrainConfig, rewards: Tensor, group_ids: Tensor, versions: Tensor,
                      parent_version: int) -> tuple[Tensor, Tensor]:
    """Per-sample (RL advantage [N], staleness weight [N]) for the whole batch, once per run."""
    if cfg.group_norm:
        adv, keep = group_normalized_rewards(rewards, group_ids)
        adv = adv * keep
    else:
        adv = rewards.to(torch.float32)
    adv = negative_scaled(adv, cfg.negative_weight)
    weight = staleness_weights(versions, parent_version, cfg.max_staleness, cfg.staleness, cfg.staleness_decay)
    return adv, weight
