"""Tasks that decide which policy serves: the eval gate, rollback, evaluation of versions,
provisioning of the base model, and the always-on restart guard."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Cancelled, State

from clawflow import events, ops, registry
from clawflow.config import Config
from clawflow.gate import GateResult, evaluate
from clawflow.holdout import held_out_turns
from clawflow.home import Home
from clawflow.models import base_model_dir
from clawflow.restarts import RestartDecision, restart_decision
from clawflow.store.catalog import Catalog


def helpfulness_cache(cfg: Config):
    return Home(cfg.home).eval / "helpfulness"


@task(name="held-out-probes", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def held_out_probes(cfg: Config, batch_turn_ids: list[str]) -> list[dict[str, Any]]:
    """The newest judged turns the candidate did not train on (clawflow/holdout.py)."""
    g = cfg.gate
    turns = held_out_turns(Catalog.for_config(cfg), g.judged_probes, batch_turn_ids, g.holdout_fraction)
    get_run_logger().info("%d held-out judged turns (%d good, %d bad) for the gate", len(turns),
                          sum(t["score"] > 0 for t in turns), sum(t["score"] < 0 for t in turns))
    return turns


@task(name="eval-gate", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5,
      task_run_name="gate-v{version}")
def gate_candidate(cfg: Config, version: int, candidate: str, champion: str,
                   judged: list[dict[str, Any]] | None = None) -> GateResult:
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
    return ops.rollback(cfg, target)


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
    return ops.provision(cfg)


@task(name="restart-guard", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2,
      task_run_name="restart-guard-{deployment}")
def restart_guard(cfg: Config, deployment: str) -> RestartDecision:
    """Backoff/cap for an automatic restart, from this deployment's earlier runs (clawflow/restarts.py)."""
    from prefect import runtime
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    s = cfg.services
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment])),
                                     sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=s.restart_max_failures + 20)
    me = str(runtime.flow_run.id)
    previous = [(r.state.type.value, r.end_time or r.state.timestamp) for r in runs
                if str(r.id) != me and r.state is not None and r.state.is_final()]
    return restart_decision(previous, datetime.now(UTC), s.restart_max_failures, s.restart_window_s,
                            s.restart_backoff_s, s.restart_backoff_max_s)


def guard_restart(cfg: Config, deployment: str) -> State | None:
    """For a run started by the always-on trigger: wait out the backoff and return None (start), or
    return a Cancelled state to end the run with when restarts are capped (no trigger fires on it)."""
    decision = restart_guard(cfg, deployment)
    log = get_run_logger()
    if not decision.start:
        message = f"{deployment}: {decision.reason}; see the failed runs' logs, fix, then start it by hand"
        log.error(message)
        events.emit("clawflow.service.restart-stopped", f"clawflow.service.{deployment}",
                    {"failures": decision.failures, "reason": decision.reason})
        return Cancelled(message=message)
    if decision.delay_s:
        log.warning("%s: %s", deployment, decision.reason)
        time.sleep(decision.delay_s)
    return None
