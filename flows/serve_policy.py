"""serve-policy: the always-on gateway + engine (runs until stopped; restarted on crash).

The first start provisions the base model (converted once, registered as version 1 `champion`).
Runs started by the always-on trigger pass `restart=True`: they back off after repeated failures
and stop restarting at the cap (clawflow/restarts.py).
"""

from __future__ import annotations

from prefect import flow

from clawflow.config import load_config
from clawflow.serving.server import serve
from tasks.policy import provision_policy
from tasks.restarts import guard_restart


@flow(name="serve-policy")
def serve_policy(config_path: str | None = None, port: int | None = None, restart: bool = False):
    """Serve the champion policy on the OpenAI-compatible API, recording every turn."""
    cfg = load_config(config_path)
    if restart and (stopped := guard_restart(cfg, "serve-policy")) is not None:
        return stopped
    provision_policy(cfg)
    serve(cfg, port=port)
