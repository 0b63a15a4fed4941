"""One collection round: episodes through the gateway, outcome rewards written beside the turns,
and the running totals the `collect-environment` flow reports."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

import httpx

from clawflow.config import Config
from clawflow.envs.base import Environment, EpisodeResult, run_episodes, summarize
from clawflow.envs.rewards import write_env_rewards
from clawflow.store.storage import Storage


def gateway_healthy(cfg: Config, timeout_s: float = 3.0) -> bool:
    """Whether the gateway answers /healthz."""
    try:
        return httpx.get(f"{cfg.gateway_url}/healthz", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def collect_round(cfg: Config, envs: list[Environment], count: int, rng: random.Random) -> list[EpisodeResult]:
    """Run `count` episodes (bounded concurrency) and write their outcome rewards."""
    results = asyncio.run(run_episodes(envs, cfg.envs, cfg.gateway_url, cfg.serving.api_key, cfg.model.name,
                                       count, rng))
    write_env_rewards(Storage.for_config(cfg), [row for r in results for row in r.rewards])
    return results


@dataclass
class Totals:
    """Running totals per environment across rounds."""

    per_env: dict[str, dict[str, Any]] = field(default_factory=dict)
    rounds: int = 0

    def add(self, results: list[EpisodeResult]) -> None:
        self.rounds += 1
        for env, s in summarize(results).items():
            t = self.per_env.setdefault(env, {"episodes": 0, "failed": 0, "turns": 0, "next_states": 0,
                                              "outcome_sum": 0.0, "outcome_n": 0})
            for k in ("episodes", "failed", "turns", "next_states"):
                t[k] += s[k]
        for r in results:
            if r.outcome is not None:
                t = self.per_env[r.env]
                t["outcome_sum"] += r.outcome
                t["outcome_n"] += 1

    def rows(self) -> list[dict[str, Any]]:
        return [{"environment": env, "episodes": t["episodes"], "failed": t["failed"], "turns": t["turns"],
                 "next_states": t["next_states"],
                 "mean_outcome": round(t["outcome_sum"] / t["outcome_n"], 4) if t["outcome_n"] else None}
                for env, t in sorted(self.per_env.items())]
