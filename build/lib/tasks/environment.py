"""Tasks of the collect-environment flow: gateway health and one round of episodes."""

from __future__ import annotations

import random

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from clawflow.config import Config
from clawflow.envs.base import Environment, EpisodeResult, summarize
from clawflow.envs.collect import collect_round, gateway_healthy


@task(name="gateway-health", cache_policy=NO_CACHE)
def gateway_up(cfg: Config) -> bool:
    return gateway_healthy(cfg)


@task(name="run-episodes", cache_policy=NO_CACHE, task_run_name="episodes-round-{round_no}")
def run_episodes(cfg: Config, envs: list[Environment], count: int, rng: random.Random,
                 round_no: int) -> list[EpisodeResult]:
    """One round; episodes that fail (a gateway going down mid-round) are counted, not retried."""
    results = collect_round(cfg, envs, count, rng)
    log = get_run_logger()
    for env, s in summarize(results).items():
        log.info("round %d %s: %d episodes (%d failed), %d turns, %d next states, mean outcome %s",
                 round_no, env, s["episodes"], s["failed"], s["turns"], s["next_states"], s["mean_outcome"])
    for r in results:
        if r.error:
            log.warning("%s episode %s failed: %s", r.env, r.session_id, r.error)
    return results
