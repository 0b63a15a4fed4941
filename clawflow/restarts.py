"""Always-on restarts with a backoff and a cap.

The always-on deployments (serve-policy, collect-environment) are restarted by a Prefect
automation on a Crashed/Failed run (prefect.yaml). A deterministic failure (a bad config, a port
taken, a broken checkpoint) would then loop forever, one failed run every few seconds. So each
automatic restart first looks at the runs before it: after n consecutive failures within
`restart_window_s` it waits `restart_backoff_s · 2^(n−1)` (at most `restart_backoff_max_s`), and
after `restart_max_failures` it does not start at all: the run ends Cancelled (which no trigger
watches) with the reason, and a `clawflow.service.restart-stopped` event. A run that is not failed
(e.g. that stop, or a manual start that ran fine) ends the chain, so a manual start always gets a
fresh budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

FAILED = frozenset({"FAILED", "CRASHED"})


@dataclass(frozen=True)
class RestartDecision:
    start: bool
    delay_s: float
    failures: int
    reason: str


def restart_decision(previous: Sequence[tuple[str, datetime | None]], now: datetime, max_failures: int,
                     window_s: float, backoff_s: float, backoff_max_s: float) -> RestartDecision:
    """`previous`: (state type, end time) of the deployment's earlier runs, newest first. Pure."""
    n = 0
    for state, ended in previous:
        if state not in FAILED or ended is None or now - ended > timedelta(seconds=window_s):
            break
        n += 1
    if n >= max_failures:
        return RestartDecision(False, 0.0, n, f"{n} consecutive failures within {window_s:.0f}s "
                                              f"(cap {max_failures}): not restarting again until started by hand")
    delay = min(backoff_s * 2 ** (n - 1), backoff_max_s) if n else 0.0
    return RestartDecision(True, delay, n, f"restart after {n} failures: waiting {delay:.0f}s" if n else "restart")
