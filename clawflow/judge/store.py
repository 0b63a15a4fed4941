"""Judgments on disk: append-only Parquet files under `judgments/` of the storage root
(`$CLAWFLOW_HOME` by default, or an object store: clawflow/store/storage.py).

The row, its columns and its one writer are the contract in clawflow/contracts/judgment.py;
this adds the judge's question of them. A turn is judged once per (judge, judge_version):
`lookup` returns what is already stored so it is not asked again. A turn the judge could not
answer is simply absent, and is judged on a later run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from clawflow.contracts.judgment import COL, COLUMNS, SCHEMA, JudgmentRow, judgment_files, write_judgments
from clawflow.home import Home
from clawflow.store.storage import Storage

__all__ = ["COLUMNS", "SCHEMA", "JudgmentStore"]  # the contract's, under their old names


class JudgmentStore:
    def __init__(self, home: Path, storage: Storage | None = None):
        self.storage = storage if storage is not None else Storage(home)
        self.dir = self.storage.join(Home.JUDGMENTS)

    @classmethod
    def for_config(cls, cfg) -> "JudgmentStore":
        return cls(cfg.home, Storage.for_config(cfg))

    def files(self) -> list[Path | str]:
        return judgment_files(self.storage)

    def append(self, rows: Sequence[JudgmentRow | Mapping[str, Any]]) -> Path | str | None:
        """Write `rows` (created_at defaults to now) as one new file."""
        return write_judgments(self.storage, rows)

    def lookup(self, turn_ids: list[str], judge: str, judge_version: str) -> dict[str, JudgmentRow]:
        """Stored judgments of `turn_ids` by this judge version (latest wins), by turn id."""
        files = self.files()
        if not files or not turn_ids:
            return {}
        import duckdb

        con = duckdb.connect()
        self.storage.attach(con)
        try:
            cur = con.execute(
                f"SELECT * FROM read_parquet($files) WHERE {COL.judge} = $judge "
                f"AND {COL.judge_version} = $version "
                f"AND {COL.turn_id} IN (SELECT unnest($ids::VARCHAR[])) ORDER BY {COL.created_at}",
                {"files": [str(f) for f in files], "judge": judge, "version": judge_version, "ids": list(turn_ids)})
            names = [d[0] for d in cur.description]
            rows = cur.fetchall()
        finally:
            con.close()
        return {row[COL.turn_id]: JudgmentRow(**row) for row in (dict(zip(names, r)) for r in rows)}
