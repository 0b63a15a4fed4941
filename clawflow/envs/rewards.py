"""Outcome rewards (`env_reward`) written beside the turns, as small Parquet files.

An episode's outcome is known only after its last reply was recorded, so it cannot ride on that
request; and the turn store is append-only. Like the judge's judgments, each batch of outcomes
is one file under `env_rewards/` of the storage root (`$CLAWFLOW_HOME`, or an object store:
clawflow/store/storage.py), written whole or not at all, so a reader never sees half a file. The
row, its schema and its one writer and reader are the contract in
clawflow/contracts/env_reward.py; this lets environments name the root by a home directory too.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from clawflow.contracts import env_reward
from clawflow.contracts.env_reward import SCHEMA  # noqa: F401 - the contract's, under its old name
from clawflow.store.storage import Storage


def _storage(root: Path | Storage) -> Storage:
    return root if isinstance(root, Storage) else Storage(root)


def write_env_rewards(root: Path | Storage, rows: list[dict[str, Any]]) -> Path | str | None:
    """Append `rows` as one new file under `root` (a home, or a Storage); None when there is nothing."""
    return env_reward.write_env_rewards(_storage(root), rows)


def read_env_rewards(root: Path | Storage) -> list[dict[str, Any]]:
    """Every stored row, as dicts (the environments' and tests' view of the contract's records)."""
    return [asdict(r) for r in env_reward.read_env_rewards(_storage(root))]
