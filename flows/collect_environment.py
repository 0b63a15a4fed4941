"""collect-environment: always-on; runs the configured environments against the served policy.

Each round runs `envs.episodes_per_round` episodes through the gateway (which records the turns
and their next states like any client's), then waits so the rate stays at
`envs.episodes_per_minute`. While the gateway's /healthz does not answer it waits and checks
again. Progress (episodes, mean outcome per environment) is a table artifact, updated each round.
    prefect deployment run collect-environment/collect-environment
"""

from __future__ import annotations

import random
import time

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from clawflow.config import load_config
from clawflow.envs import build_envs
from clawflow.envs.base import pace_s
from clawflow.envs.collect import Totals
from tasks.environment import gateway_up, run_episodes
from tasks.restarts import guard_restart


@flow(name="collect-environment", log_prints=True)
def collect_environment(config_path: str | None = None, rounds: int | None = None, restart: bool = False):
    """Collect episodes forever (or for `rounds` rounds); returns the totals per environment.
    `restart` is set by the always-on trigger: back off / stop after repeated failures."""
    cfg = load_config(config_path)
    if restart and (stopped := guard_restart(cfg, "collect-environment")) is not None:
        return stopped
    log = get_run_logger()
    envs = build_envs(cfg)
    rng = random.Random(cfg.envs.seed)
    totals = Totals()
    done, waiting = 0, False
    while rounds is None or done < rounds:
        if not gateway_up(cfg):
            if not waiting:
                log.warning("gateway %s is down; collection paused", cfg.gateway_url)
            waiting = True
            time.sleep(cfg.envs.health_poll_s)
            continue
        if waiting:
            log.info("gateway is back; collection resumes")
            waiting = False
        t0 = time.monotonic()
        done += 1
        totals.add(run_episodes(cfg, envs, cfg.envs.episodes_per_round, rng, done))
        create_table_artifact(key="environment-progress", table=totals.rows(),
                              description=f"episodes collected so far ({done} rounds)")
        if rounds is None or done < rounds:
            time.sleep(pace_s(cfg.envs.episodes_per_round, time.monotonic() - t0, cfg.envs.episodes_per_minute))
    return totals.rows()
