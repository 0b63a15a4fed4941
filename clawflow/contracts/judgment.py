"""The judgment row: one judge's score of one turn, as the judge stores it.

Append-only files under `judgments/` of the storage root, one per judging batch, with exactly
these columns; `forget`, the catalog's stats and the gate read them by these names. A turn is
judged once per (judge, judge_version); the latest row of a turn wins.
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
class JudgmentRow:
    turn_id: str
    session_id: str | None
    judge: str
    judge_version: str
    prompt_version: str | None
    score: int  # -1, 0, +1
    votes: list[int | None]  # None = an invalid vote
    rationale: str | None = None
    hint: str | None = None  # OPD: hindsight hint, when the judge gave one
    created_at: datetime | None = None  # the writer stamps it


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
check_schema(JudgmentRow, SCHEMA)
COLUMNS = SCHEMA.names
COL = columns(JudgmentRow)


@dataclass(frozen=True, slots=True)
class Judged(JudgmentRow):
    """A judgment as the training flow carries it: the stored row, the reward the turn trains
    with (score combined with its environment outcome, clawflow/judge/stats.py), and whether it
    was found in the store for this judge version instead of asked again."""

    reward: float = 0.0
    reused: bool = False

    @classmethod
    def of(cls, row: JudgmentRow | Mapping[str, Any], reward: float, reused: bool) -> Judged:
        fields = asdict(row) if isinstance(row, JudgmentRow) else {c: row.get(c) for c in COLUMNS}
        return cls(**fields, reward=reward, reused=reused)


def write_judgments(root: Root, rows: Iterable[JudgmentRow | Mapping[str, Any]]) -> Path | str | None:
    """`rows` as one new file (extra keys ignored, created_at defaults to now); None when empty."""
    rows = [asdict(r) if isinstance(r, JudgmentRow) else r for r in rows]
    if not rows:
        return None
    now = datetime.now(UTC)
    table = pa.Table.from_pylist([{c: r.get(c) for c in COLUMNS} | {COL.created_at: r.get(COL.created_at) or now}
                                  for r in rows], schema=SCHEMA)
    # local: temp → fsync → rename → fsync dir; object store: a conditional put
    return root.write_parquet(table, f"{Home.JUDGMENTS}/{now:%Y%m%dT%H%M%S%f}-{uuid.uuid4().hex[:8]}.parquet")


def read_judgments(root: Root) -> list[JudgmentRow]:
    return [JudgmentRow(**row) for row in read_rows(root, Home.JUDGMENTS, SCHEMA)]


def judgment_files(root: Root) -> list[Path | str]:
    """The files to read together (DuckDB `read_parquet`, privacy's rewrite)."""
    return [e.path for e in root.list(Home.JUDGMENTS)]
