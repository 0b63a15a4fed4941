"""evaluate-policy: run the eval gate's measurements for registered versions against the champion."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_table_artifact

from clawflow.config import load_config
from clawflow.policy import registry
from tasks.policy import evaluate_version


@flow(name="evaluate-policy")
def evaluate_policy(versions: list[int], config_path: str | None = None) -> list[dict]:
    """Probe KL / NLL drift of each version vs the champion; results become version tags."""
    cfg = load_config(config_path)
    champion = registry.champion(cfg)
    if champion is None:
        raise ValueError(f"model {cfg.model.name!r} has no champion to compare against")
    rows = [evaluate_version(cfg, v, champion) for v in versions]
    create_table_artifact(key="evaluation", table=rows, description=f"versions vs champion v{champion[0]}")
    return rows
