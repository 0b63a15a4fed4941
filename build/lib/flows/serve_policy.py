"""serve-policy: the always-on gateway + engine (runs until stopped; restarted on crash)."""

from __future__ import annotations

from prefect import flow

from clawflow.config import load_config
from clawflow.serving.server import serve


@flow(name="serve-policy")
def serve_policy(config_path: str | None = None, port: int | None = None) -> None:
    """Serve the champion policy on the OpenAI-compatible API, recording every turn."""
    serve(load_config(config_path), port=port)
