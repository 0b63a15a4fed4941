"""Tasks that decide which policy serves: the eval gate, rollback, evaluation of versions."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from clawflow import ops, registry
from clawflow.config import Config
from clawflow.gate import GateResult, evaluate


@task(name="eval-gate", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5,
      task_run_name="gate-v{version}")
def gate_candidate(cfg: Config, version: int, candidate: str, champion: str) -> GateResult:
    """Evaluate the candidate against the champion; tag the version with the verdict."""
    result = evaluate(cfg.gate, candidate, champion)
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
    return ops.rollback(cfg, target)


@task(name="evaluate-version", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5,
      task_run_name="evaluate-v{version}")
def evaluate_version(cfg: Config, version: int, champion: tuple[int, str]) -> dict[str, Any]:
    _, path = registry.resolve(cfg, version)
    result = evaluate(cfg.gate, path, champion[1])
    registry.tag_version(cfg, version, {f"eval_vs_v{champion[0]}.{k}": f"{v:.6g}" for k, v in result.metrics.items()})
    return {"version": version, "vs": champion[0], "passed": result.passed, "reason": result.reason, **result.metrics}
