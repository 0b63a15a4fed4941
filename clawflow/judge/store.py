"""Judgments on disk: append-only Parquet files under `judgments/` of the storage root
(`$CLAWFLOW_HOME` by default, or an object store: clawflow/store/storage.py).

One file per judging batch (temp name → fsync → rename, like the shards), with exactly the
columns below; other tools (`forget`, stats) read them by these names. A turn is judged once per
(judge, judge_version): `lookup` returns what is already stored so it is not asked again. A turn
the judge could not answer is simply absent, and is judged on a later run.
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
    ("turn_id", pa.string()),
    ("session_id", pa.string()),
    ("judge", pa.string()),
    ("judge_version", pa.string()),
    ("prompt_version", pa.string()),
    ("score", pa.int8()),
    ("votes", pa.list_(pa.int8())),  # null elements = invalid votes
    ("rationale", pa.string()),
    ("hint", pa.string()),
    ("created_at", pa.timestamp("us", tz="UTC")),
])
COLUMNS = SCHEMA.names


class JudgmentStore:
    def __init__(self, home: Path, storage: Storage | None = None):
        self.storage = storage if storage is not None else Storage(home)
        self.dir = self.storage.join("judgments")

    @classmethod
    def for_config(cls, cfg) -> "JudgmentStore":
        return cls(cfg.home, Storage.for_config(cfg))

    def files(self) -> list[Path | str]:
        return [e.path for e in self.storage.list("judgments")]

    def append(self, rows: list[dict[str, Any]]) -> Path | str | None:
        """Write `rows` (dicts with COLUMNS; created_at defaults to now) as one new file."""
        if not rows:
            return None
        now = datetime.now(UTC)
        table = pa.Table.from_pylist([{c: r.get(c) for c in COLUMNS} | {"created_at": r.get("created_at") or now}
                                      for r in rows], schema=SCHEMA)
        # local: temp → fsync → rename → fsync dir; object store: a conditional put
        return self.storage.write_parquet(table, f"judgments/{now:%Y%m%dT%H%M%S%f}-{uuid.uuid4().hex[:8]}.parquet")

    def lookup(self, turn_ids: list[str], judge: str, judge_version: str) -> dict[str, dict[str, Any]]:
        """Stored judgments of `turn_ids` by this judge version (latest wins), by turn id."""
        files = self.files()
        if not files or not turn_ids:
            return {}
        import duckdb

        con = duckdb.connect()
        self.storage.attach(con)
        try:
            cur = con.execute(
                "SELECT * FROM read_parquet($files) WHERE judge = $judge AND judge_version = $version "
                "AND turn_id IN (SELECT unnest($ids::VARCHAR[])) ORDER BY created_at",
                {"files": [str(f) for f in files], "judge": judge, "version": judge_version, "ids": list(turn_ids)})
            names = [d[0] for d in cur.description]
            rows = cur.fetchall()
        finally:
            con.close()
        return {row["turn_id"]: row for row in (dict(zip(names, r)) for r in rows)}
