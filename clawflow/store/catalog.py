"""The catalog: DuckDB over the Parquet shards, plus a record of what each training run consumed.

Shards are read in place (`read_parquet` over a glob); the only state DuckDB keeps is which turns
were consumed by which run, written in one transaction with the run row, so a retried run
commits nothing twice and a turn trains once. A connection lives for one call only: other
processes (the gateway, a training flow) need the file lock in between.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import duckdb

_SCHEMA = """
CREATE TABLE IF NOT EXISTS consumed (
    turn_id VARCHAR PRIMARY KEY, run_id VARCHAR, policy_version BIGINT, consumed_at TIMESTAMPTZ);
CREATE TABLE IF NOT EXISTS runs (
    run_id VARCHAR PRIMARY KEY, policy_version BIGINT, turns INTEGER, finished_at TIMESTAMPTZ);
"""

# Main turns not yet consumed, each with the first-created turn at index + 1 of its session.
_PAIRS = """
WITH t AS (SELECT * FROM read_parquet($glob, union_by_name = true, hive_partitioning = false)),
nxt AS (
    SELECT session_id, turn_index, new_messages,
           row_number() OVER (PARTITION BY session_id, turn_index ORDER BY created_at, turn_id) AS rn
    FROM t WHERE turn_type = 'main')  -- side traffic (evaluation, memory calls) is no one's next state
SELECT a.*, b.new_messages AS next_state
FROM t AS a
JOIN nxt AS b ON b.session_id = a.session_id AND b.turn_index = a.turn_index + 1 AND b.rn = 1
WHERE a.turn_type = 'main'
  AND NOT EXISTS (SELECT 1 FROM consumed AS c WHERE c.turn_id = a.turn_id)
"""


def _first_role(next_state: str | None) -> str | None:
    try:
        messages = json.loads(next_state) if next_state else None
        return messages[0].get("role") if messages else None
    except (ValueError, AttributeError, TypeError, KeyError):
        return None


class Catalog:
    def __init__(self, db_path: Path, shards_dir: Path, lock_timeout_s: float = 30.0):
        self.db_path = Path(db_path)
        self.shards_dir = Path(shards_dir)
        self.lock_timeout_s = lock_timeout_s
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as con:
            con.execute(_SCHEMA).fetchall()

    @contextmanager
    def _connect(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A short-lived connection; waits while another process holds the file lock."""
        deadline = time.monotonic() + self.lock_timeout_s
        while True:
            try:
                con = duckdb.connect(str(self.db_path))
                break
            except duckdb.IOException as exc:
                if "lock" not in str(exc).lower() or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        try:
            con.execute("SET TimeZone = 'UTC'").fetchall()
            yield con
        finally:
            con.close()

    def _glob(self) -> str | None:
        """The shards glob, or None when there are no shards (DuckDB errors on an empty glob)."""
        if not any(self.shards_dir.rglob("*.parquet")):
            return None
        return str(self.shards_dir / "**" / "*.parquet")

    def pending_pairs(self, limit: int) -> list[dict[str, Any]]:
        """Unconsumed main turns with their next state (`next_state`, `next_role`), oldest first."""
        glob = self._glob()
        if glob is None or limit <= 0:
            return []
        sql = _PAIRS + " ORDER BY a.created_at, a.turn_id LIMIT $limit"
        with self._connect() as con:
            cur = con.execute(sql, {"glob": glob, "limit": limit})
            rows = cur.fetchall()
            names = [d[0] for d in cur.description]
        pairs = [dict(zip(names, row)) for row in rows]
        for pair in pairs:
            pair["next_role"] = _first_role(pair["next_state"])
        return pairs

    def commit_consumed(self, turn_ids: list[str], run_id: str, policy_version: int) -> int:
        """Record `turn_ids` as consumed by `run_id` (one transaction); how many were new."""
        ids = list(dict.fromkeys(turn_ids))
        with self._connect() as con:
            con.execute("BEGIN TRANSACTION").fetchall()
            try:
                before = con.execute("SELECT count(*) FROM consumed").fetchall()[0][0]
                con.execute(
                    "INSERT INTO consumed SELECT id, $run, $pv, now() FROM unnest($ids::VARCHAR[]) AS u(id) "
                    "ON CONFLICT DO NOTHING",
                    {"ids": ids, "run": run_id, "pv": policy_version},
                ).fetchall()
                new = con.execute("SELECT count(*) FROM consumed").fetchall()[0][0] - before
                con.execute(
                    "INSERT INTO runs VALUES ($run, $pv, $n, now()) "
                    "ON CONFLICT (run_id) DO UPDATE SET turns = runs.turns + excluded.turns",
                    {"run": run_id, "pv": policy_version, "n": new},
                ).fetchall()
                con.execute("COMMIT").fetchall()
            except BaseException:
                with suppress(duckdb.Error):  # a failed COMMIT has already rolled back
                    con.execute("ROLLBACK").fetchall()
                raise
        return new

    def stats(self) -> dict[str, Any]:
        """Counts for dashboards and the CLI: shards, turns, consumed, pending pairs, last run."""
        glob = self._glob()
        with self._connect() as con:
            consumed = con.execute("SELECT count(*) FROM consumed").fetchall()[0][0]
            cur = con.execute("SELECT * FROM runs ORDER BY finished_at DESC LIMIT 1")
            last = cur.fetchall()
            last_run = dict(zip([d[0] for d in cur.description], last[0])) if last else None
            turns = pending = 0
            if glob is not None:
                turns = con.execute(
                    "SELECT count(*) FROM read_parquet($glob, union_by_name = true, hive_partitioning = false)",
                    {"glob": glob},
                ).fetchall()[0][0]
                pending = con.execute(f"SELECT count(*) FROM ({_PAIRS})", {"glob": glob}).fetchall()[0][0]
        return {
            "shards": len(list(self.shards_dir.rglob("*.parquet"))),
            "turns": turns,
            "consumed": consumed,
            "pending": pending,
            "last_run": last_run,
        }
