"""Outcome rewards (`env_reward`) written beside the turns, as small Parquet files.

An episode's outcome is known only after its last reply was recorded, so it cannot ride on that
request; and the turn store is append-only. Like the judge's judgments, each batch of outcomes
is one file `$CLAWFLOW_HOME/env_rewards/<uuid>.parquet` (written to a temp name, then renamed,
so a reader never sees half a file), keyed by (session_id, turn_index) and, for the members of
a sampled group that share both, the reply's text.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from clawflow.store.shards import write_parquet_atomic

SCHEMA = pa.schema([
    ("session_id", pa.string()),
    ("turn_index", pa.int32()),
    ("response_text", pa.string()),
    ("env_reward", pa.float64()),
    ("source", pa.string()),
    ("created_at", pa.timestamp("us", tz="UTC")),
])


def rewards_dir(home: Path) -> Path:
    return Path(home) / "env_rewards"


def write_env_rewards(home: Path, rows: list[dict[str, Any]]) -> Path | None:
    """Append `rows` as one new file; None when there is nothing to write."""
    if not rows:
        return None
    now = datetime.now(UTC)
    table = pa.Table.from_pylist([{**r, "created_at": r.get("created_at", now)} for r in rows], schema=SCHEMA)
    path = rewards_dir(home) / f"{uuid.uuid4().hex}.parquet"
    write_parquet_atomic(table, path)  # the store's temp → fsync → rename → fsync dir
    return path


def read_env_rewards(home: Path) -> list[dict[str, Any]]:
    files = sorted(rewards_dir(home).glob("*.parquet"))
    return [row for f in files for row in pq.read_table(f, schema=SCHEMA).to_pylist()]
