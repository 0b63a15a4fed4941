"""The environment reward: an episode's outcome (or a step's check) for one recorded turn.

Written by environments under `env_rewards/<uuid>.parquet` of the storage root, one file per
batch, whole or not at all; joined onto turns by (session_id, turn_index) and, for the members of
a sampled group that share both, the reply's text (clawflow/store/queries.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa

from clawflow.contracts._parquet import Root, check_schema, columns, read_rows
from clawflow.home import Home


@dataclass(frozen=True, slots=True)
class EnvReward:
    session_id: str
    turn_index: int
    response_text: str | None
    env_reward: float | None
    source: str | None = None  # the environment
    created_at: datetime | None = None  # the writer stamps it: the latest row of a key wins


SCHEMA = pa.schema([
    ("session_id", pa.string()),
    ("turn_index", pa.int32()),
    ("response_text", pa.string()),
    ("env_reward", pa.float64()),
    ("source", pa.string()),
    ("created_at", pa.timestamp("us", tz="UTC")),
])
check_schema(EnvReward, SCHEMA)
COL = columns(EnvReward)


def write_env_rewards(root: Root, rows: Iterable[EnvReward | Mapping[str, Any]]) -> Path | str | None:
    """Append `rows` as one new file (created_at defaults to now); None when there is nothing."""
    rows = [asdict(r) if isinstance(r, EnvReward) else dict(r) for r in rows]
    if not rows:
        return None
    now = datetime.now(UTC)
    table = pa.Table.from_pylist([{**r, COL.created_at: r.get(COL.created_at) or now} for r in rows], schema=SCHEMA)
    return root.write_parquet(table, f"{Home.ENV_REWARDS}/{uuid.uuid4().hex}.parquet")


def read_env_rewards(root: Root) -> list[EnvReward]:
    return [EnvReward(**row) for row in read_rows(root, Home.ENV_REWARDS, SCHEMA)]


def env_reward_files(root: Root) -> list[str]:
    """The files to read together (DuckDB `read_parquet`), as strings."""
    return [str(e.path) for e in root.list(Home.ENV_REWARDS)]
