"""Tasks that decide which policy serves: the eval gate, rollback, evaluation of versions,
provisioning of the base model. (The always-on restart guard is tasks/restarts.py.)"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from clawflow.base_model import base_model_dir
from clawflow.config import Config
from clawflow.home import Home
from clawflow.policy import registry, reload
from clawflow.policy.gate import GateResult, evaluate
from clawflow.policy.holdout import ProbeTurn, held_out_turns
from clawflow.store.catalog import Catalog


def helpfulness_cache(cfg: Config):
    return Home(cfg.home).eval / "helpfulness"


@task(name="held-out-probes", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def held_out_probes(cfg: Config, batch_turn_ids: list[str]) -> list[ProbeTurn]:
    """The newest judged turns the candidate did not train on (clawflow/policy/holdout.py)."""
    g = cfg.gate
    turns = held_out_turns(Catalog.for_config(cfg), g.judged_probes, batch_turn_ids, g.holdout_fraction)
    get_run_logger().info("%d held-out judged turns (%d good, %d bad) for the gate", len(turns),
                          sum(t.score > 0 for t in turns), sum(t.score < 0 for t in turns))
    return turns


@task(name="eval-gate", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5,
      task_run_name="gate-v{version}")
def gate_candidate(cfg: Config, version: int, candidate: str, champion: str,
                   judged: list[ProbeTurn] | None = None) -> GateResult:
    """Evaluate the candidate against the champion; tag the version with the verdict."""
    result = evaluate(cfg.gate, candidate, champion, judged, base_model_dir(cfg), helpfulness_cache(cfg))
    tags = {f"eval.{k}": f"{v:.6g}" for k, v in result.metrics.items()}
    tags["gate"] = "passed" if result.passed else "rejected"
    tags["gate_reason"] = result.reason
    if not result.passed:
        tags["rejected"] = result.reason
    registry.tag_version(cfg, version, tags)
    log = get_run_logger()
    (log.info if result.passed else log.warning)("v%d %s: %s", version, tags["gate"], result.reason)
    return result


@task(name="rollback-champion", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=3)
def rollback_champion(cfg: Config, target: int | str | None) -> dict[str, Any]:
    return reload.rollback(cfg, target)


@task(name="evaluate-version", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5,
      task_run_name="evaluate-v{version}")
def evaluate_version(cfg: Config, version: int, champion: tuple[int, str]) -> dict[str, Any]:
    _, path = registry.resolve_local(cfg, version)
    champion_dir = registry.checkpoint_dir(cfg, *champion)  # fetched when the registry is a server
    result = evaluate(cfg.gate, path, champion_dir, None, base_model_dir(cfg), helpfulness_cache(cfg))
    registry.tag_version(cfg, version, {f"eval_vs_v{champion[0]}.{k}": f"{v:.6g}" for k, v in result.metrics.items()})
    return {"version": version, "vs": champion[0], "passed": result.passed, "reason": result.reason, **result.metrics}


@task(name="provision-base-model", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5)
def provision_policy(cfg: Config) -> tuple[int, str]:
    """First start: the base model on disk and registered (version 1, `champion`); then a no-op."""
    return reload.provision(cfg)
