"""Pure functions over judgments: the reward a turn trains with, and per-run judge statistics.

Reward (`judge.env_reward`): OpenClaw-RL adds the step's PRM score and the episode outcome;
`add` does that (outcome scaled by `env_reward_weight`), `replace` trusts the outcome alone where
a turn has one, `ignore` uses the PRM score only. A turn without `env_reward` keeps its score.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from clawflow.contracts.judgment import Judged


def combine_reward(score: int, env_reward: float | None, mode: str = "add", weight: float = 1.0) -> float:
    if env_reward is None or (isinstance(env_reward, float) and math.isnan(env_reward)) or mode == "ignore":
        return float(score)
    if mode == "add":
        return float(score) + weight * float(env_reward)
    if mode == "replace":
        return weight * float(env_reward)
    raise ValueError(f"unknown env_reward mode {mode!r}")


def judge_stats(judgments: Sequence[Judged], pending: int) -> dict[str, float]:
    """MLflow metrics for one run: score distribution, vote agreement, invalid votes, hints.
    `pending` = turns offered to the judge; those without a judgment stayed unjudged."""
    n = len(judgments)
    scores = Counter(j.score for j in judgments)
    votes = [v for j in judgments for v in (j.votes or [])]
    agreement = []
    for j in judgments:
        valid = [v for v in (j.votes or []) if v is not None]
        if valid:
            agreement.append(Counter(valid).most_common(1)[0][1] / len(valid))
    return {
        "judge_turns": float(n),
        "judge_unjudged": float(pending - n),
        "judge_reused": float(sum(j.reused for j in judgments)),
        "judge_score_pos_rate": scores[1] / n if n else 0.0,
        "judge_score_neg_rate": scores[-1] / n if n else 0.0,
        "judge_score_zero_rate": scores[0] / n if n else 0.0,
        "judge_vote_agreement": sum(agreement) / len(agreement) if agreement else 0.0,
        "judge_invalid_vote_rate": sum(v is None for v in votes) / len(votes) if votes else 0.0,
        "judge_hint_rate": sum(bool(j.hint) for j in judgments) / n if n else 0.0,
    }
