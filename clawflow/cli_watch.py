"""Follow a Prefect flow run from the CLI over the REST API: its state, its task runs and its
`training-progress` artifact (percent + phase), until it ends. Plain HTTP (no Prefect import): the
library talks to Prefect only through events.py and this read-only API client."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

TERMINAL = frozenset({"COMPLETED", "FAILED", "CRASHED", "CANCELLED"})


@dataclass
class Snapshot:
    name: str
    state_type: str
    state_name: str
    message: str | None
    percent: float | None  # the progress artifact, when the flow keeps one
    phase: str | None
    tasks: list[tuple[str, str]] = field(default_factory=list)  # (task run name, state name), in start order

    @property
    def done(self) -> bool:
        return self.state_type in TERMINAL


def snapshot(flow_run: dict, task_runs: list[dict], artifacts: list[dict]) -> Snapshot:
    """Pure: a run's view from the API's JSON (task runs and artifacts of that run)."""
    state = flow_run.get("state") or {}
    progress = [a for a in artifacts if a.get("type") == "progress"]
    latest = max(progress, key=lambda a: a.get("updated") or "", default=None)
    ordered = sorted(task_runs, key=lambda t: t.get("start_time") or t.get("expected_start_time") or "")
    return Snapshot(
        name=flow_run.get("name", ""), state_type=state.get("type") or flow_run.get("state_type") or "SCHEDULED",
        state_name=state.get("name") or "Scheduled", message=state.get("message"),
        percent=float(latest["data"]) if latest is not None else None,
        phase=latest.get("description") if latest is not None else None,
        tasks=[(t["name"], (t.get("state") or {}).get("name") or "Pending") for t in ordered])


def read(api: str, run_id: str, timeout_s: float = 10) -> Snapshot:
    with httpx.Client(base_url=api, timeout=timeout_s) as http:
        run = http.get(f"/flow_runs/{run_id}")
        run.raise_for_status()
        runs = {"flow_runs": {"id": {"any_": [run_id]}}}
        tasks = http.post("/task_runs/filter", json=runs)
        arts = http.post("/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [run_id]}}})
        tasks.raise_for_status()
        arts.raise_for_status()
    return snapshot(run.json(), tasks.json(), arts.json())


def follow(api: str, run_id: str, on_update: Callable[[Snapshot], None], poll_s: float = 2.0,
           timeout_s: float | None = None) -> Snapshot:
    """Poll until the run ends (or `timeout_s`), calling `on_update` with each snapshot; the last one."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        snap = read(api, run_id)
        on_update(snap)
        if snap.done or (deadline is not None and time.monotonic() > deadline):
            return snap
        time.sleep(poll_s)
