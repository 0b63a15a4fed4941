"""The always-on restart guard: backoff and cap for a run the restart trigger started
(clawflow/restarts.py decides; these tasks read the deployment's earlier runs and act on it)."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Cancelled, State

from clawflow import events
from clawflow.config import Config
from clawflow.restarts import RestartDecision, restart_decision


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
