"""Prefect events, the only place the library touches Prefect.

`emit` never raises: with no reachable Prefect API the event becomes a log line, so the gateway and
the sealer keep working while the orchestrator is down.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("clawflow.events")

SHARD_SEALED = "clawflow.shard.sealed"
POLICY_REGISTERED = "clawflow.policy.registered"
POLICY_PROMOTED = "clawflow.policy.promoted"
POLICY_RELOADED = "clawflow.policy.reloaded"
POLICY_ROLLED_BACK = "clawflow.policy.rolled-back"


def emit(event: str, resource_id: str, payload: dict[str, Any] | None = None) -> bool:
    """Emit `event` about `resource_id`; True when handed to Prefect, False when only logged."""
    try:
        from prefect.events import emit_event
        from prefect.settings import PREFECT_API_URL

        if not PREFECT_API_URL.value():
            raise RuntimeError("PREFECT_API_URL is not set")
        sent = emit_event(event=event, resource={"prefect.resource.id": resource_id}, payload=payload or {})
        if sent is None:
            raise RuntimeError("no event client")
    except Exception as exc:  # noqa: BLE001 - events are best effort by design
        log.warning("event %s %s not sent to Prefect (%s): %s", event, resource_id, exc, payload)
        return False
    log.info("event %s %s", event, resource_id)
    return True
