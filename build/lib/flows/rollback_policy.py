"""rollback-policy: move `champion` back (to `previous` by default) and hot-reload the gateway."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from clawflow.config import load_config
from tasks.policy import rollback_champion


@flow(name="rollback-policy")
def rollback_policy(version: int | None = None, alias: str | None = None, config_path: str | None = None) -> dict:
    """Serve an earlier registered version again: `version` (a number), or `alias`, else `previous`."""
    cfg = load_config(config_path)
    result = rollback_champion(cfg, version if version is not None else alias)
    create_markdown_artifact(
        key="rollback", description="Champion moved back",
        markdown=f"champion v{result['from_version']} → v{result['to_version']}; gateway reloaded: {result['reloaded']}")
    return result
