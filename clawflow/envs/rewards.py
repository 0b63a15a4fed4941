"""Outcome rewards (`env_reward`) written beside the turns, as small Parquet files.

An episode's outcome is known only after its last reply was recorded, so it cannot ride on that
request; and the turn store is append-only. Like the judge's judgments, each batch of outcomes
is one file `env_rewards/<uuid>.parquet` under the storage root (`$CLAWFLOW_HOME`, or an object
store: clawflow/store/storage.py), written whole or not at all, so a reader never sees half a file, keyed by (session_id, turn_index) and, for the members of
a sampled group that share both, the reply's text.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from clawflow.store.storage import Storage

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


def _storage(root: Path | Storage) -> Storage:
    return root if isinstance(root, Storage) else Storage(root)


def write_env_rewards(root: Path | Storage, rows: list[dict[str, Any]]) -> Path | str | None:
    """Append `rows` as one new file under `root` (a home, or a Storage); None when there is nothing."""
    if not rows:
        return None
    now = datetime.now(UTC)
    table = pa.Table.from_pylist([{**r, "created_at": r.get("created_at", now)} for r in rows], schema=SCHEMA)
    return _storage(root).write_parquet(table, f"env_rewards/{uuid.uuid4().hex}.parquet")


def read_env_rewards(root: Path | Storage) -> list[dict[str, Any]]:
    storage = _storage(root)
    tables = [pq.read_table(pa.BufferReader(storage.read_bytes(e.path)), schema=SCHEMA)
              for e in storage.list("env_rewards")]
    return [row for t in tables for row in t.to_pylist()]
