"""Privacy requests: export a user's sessions, or forget one everywhere.

Session ids are data, never paths: they only ever reach SQL as bound parameters and files as
column values; nothing here (or anywhere in the store) builds a file name from one.

`forget` removes a session from: the shards (each rewritten atomically, or deleted when emptied),
closed WAL segments, the catalog (its consumed and claimed rows), the judge's Parquet files, and
the training samples of past runs (`runs/*/samples.parquet`). A tombstone makes the sealer drop
the session's turns still in the gateway's active segment (see tombstones.py).

With an object-store root, the shards, judgments and samples copies in the store are rewritten
there (each object replaced whole). Gateways on other hosts keep their own WAL and outbox: their
turns of the session reach the store later, and the catalog drops them before registering
(Catalog._without_forgotten), so they are never read; they sit in those hosts' outboxes until
uploaded.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from clawflow.contracts.judgment import COL as J
from clawflow.contracts.judgment import judgment_files
from clawflow.contracts.sample import COL as S
from clawflow.contracts.sample import sample_files
from clawflow.home import Home
from clawflow.store.catalog import Catalog
from clawflow.store.locks import store_lock
from clawflow.store.maintenance import rewrite_without
from clawflow.contracts.turn import ARROW_SCHEMA, JSON_FIELDS
from clawflow.store.shards import TMP_SUFFIX, write_parquet_atomic
from clawflow.store.storage import Storage
from clawflow.contracts.turn import DEFAULT_USER
from clawflow.store.tombstones import add_tombstone, add_user_tombstone
from clawflow.store.wal import closed_segments, fsync_dir

log = logging.getLogger("clawflow.store.privacy")

FORMATS = ("parquet", "jsonl")


@dataclass(frozen=True)
class ForgetReport:
    turns: int  # removed from shards
    shards: int  # shards rewritten or deleted
    wal_records: int  # removed from closed segments
    judgments: int
    samples: int  # rows of past training batches
    catalog_rows: int  # consumed + claims rows


def export_sessions(cat: Catalog, out: Path, sessions: list[str] | None, fmt: str | None = None,
                    user: str | None = None) -> int:
    """Write the sealed turns of `sessions` (None: all) to `out` as Parquet or JSONL; the row count.
    `user`: only that user's turns (another user's turns in a session of the same id stay out)."""
    out = Path(out)
    fmt = fmt or ("jsonl" if out.suffix in (".jsonl", ".json") else "parquet")
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r} (choose parquet or jsonl)")
    with cat.connect() as con:
        conds, params = ["true"], {}
        if sessions is not None:
            conds.append("list_contains($sessions, session_id)")
            params["sessions"] = list(sessions)
        if user is not None:
            conds.append('"user" = $user')
            params["user"] = user
        where = "WHERE " + " AND ".join(conds)
        paths = [r[0] for r in con.execute(f"SELECT DISTINCT path FROM turn_keys {where}", params).fetchall()]
        src = cat.turns_from(con, only=paths) if paths else None
        table = ARROW_SCHEMA.empty_table()
        if src is not None:
            turns, tparams = src
            sql = f"SELECT * FROM {turns} {where} ORDER BY session_id, turn_index, created_at, turn_id"
            table = con.sql(sql, params={**tparams, **params}).to_arrow_table()
    table = table.select(ARROW_SCHEMA.names).cast(ARROW_SCHEMA)
    if fmt == "parquet":
        write_parquet_atomic(table, out)
    else:
        _write_jsonl(table, out)
    return table.num_rows


def _write_jsonl(table: pa.Table, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + TMP_SUFFIX)
    with open(tmp, "w", encoding="utf-8") as f:
        for row in table.to_pylist():
            for name in JSON_FIELDS:  # nested JSON, not JSON-in-a-string
                row[name] = None if row[name] is None else json.loads(row[name])
            row["created_at"] = row["created_at"].isoformat()
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)


def forget_session(cat: Catalog, session_id: str, at: datetime | None = None) -> ForgetReport:
    """Remove every stored turn of `session_id` created up to `at` (now) from everywhere."""
    add_tombstone(cat.home, session_id, at)  # first: a seal racing us drops the session too
    report = _forget(cat, "session_id = $v", session_id, "session_id", (J.session_id, session_id))
    log.info("forgot a session: %s", report)
    return report


def forget_user(cat: Catalog, user: str, at: datetime | None = None) -> ForgetReport:
    """Remove every stored turn `user` sent up to `at` (now), in every session, from everywhere;
    other users' turns, even in a session of the same id, stay."""
    add_user_tombstone(cat.home, user, at)  # first: a seal racing us drops their turns too
    report = _forget(cat, '"user" = $v', user, "user", None)
    log.info("forgot a user's turns: %s", report)
    return report


def _forget(cat: Catalog, where: str, value: str, wal_field: str, judgment_session: tuple[str, str] | None):
    home = cat.home
    with cat.connect() as con, store_lock(home):
        found = con.execute(f"SELECT turn_id, path FROM turn_keys WHERE {where}", {"v": value}).fetchall()
        ids, files = [r[0] for r in found], {r[1] for r in found}
        removed = rewrite_without(cat, con, files, set(ids)) if ids else 0
        catalog_rows = 0
        for table in ("consumed", "claims"):
            catalog_rows += len(con.execute(f"DELETE FROM {table} WHERE list_contains($ids, turn_id) RETURNING turn_id",
                                            {"ids": ids}).fetchall())
        con.execute("CHECKPOINT").fetchall()  # deleted rows leave the WAL file now, not later
        wal = _forget_in_segments(Home(home).wal, wal_field, value)
        storage = cat.storage  # the storage root: local, or the object store every host shares
        judgments = sum(_drop_rows(storage, p, ids, J.turn_id, judgment_session) for p in judgment_files(storage))
        # the trainer's own copies of past batches, and on an object store the copies kept beside
        # the shards (feedback.keep_samples)
        roots = [Storage(home)] + ([storage] if storage.remote else [])
        samples = sum(_drop_rows(root, p, ids, S.turn_id) for root in roots for p in sample_files(root))
    return ForgetReport(removed, len(files), wal, judgments, samples, catalog_rows)


def _forget_in_segments(wal_dir: Path, field: str, value: str) -> int:
    """Drop the lines whose `field` is `value` from closed segments (the active one is left to the
    tombstone)."""
    removed = 0
    for seg in closed_segments(wal_dir):
        lines = seg.read_bytes().split(b"\n")
        kept = []
        for line in lines:
            try:
                # a record from before users existed has no `user`: it is the default user's
                mine = json.loads(line).get(field, DEFAULT_USER if field == "user" else None) == value \
                    if line.strip() else False
            except ValueError:
                mine = False  # torn lines stay; the sealer reports them
            removed += mine
            if not mine:
                kept.append(line)
        if len(kept) < len(lines):
            tmp = seg.with_name(seg.name + TMP_SUFFIX)
            with open(tmp, "wb") as f:
                f.write(b"\n".join(kept))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, seg)
            fsync_dir(wal_dir)
    return removed


def _drop_rows(storage: Storage, path: Path | str, turn_ids: list[str], id_column: str,
               session: tuple[str, str] | None = None) -> int:
    """Rewrite a Parquet file (keeping its schema) without rows of those turn ids or, with
    `session` = (column, id), of that session."""
    table = storage.read_table(path)
    mask = pc.is_in(table[id_column], value_set=pa.array(turn_ids, pa.string())) if id_column in table.column_names \
        else pa.array([False] * table.num_rows)
    if session is not None and session[0] in table.column_names:
        mask = pc.or_(mask, pc.fill_null(pc.equal(table[session[0]], session[1]), False))
    mask = pc.fill_null(mask, False)
    n = pc.sum(mask).as_py() or 0
    if n:
        storage.rewrite_parquet(table.filter(pc.invert(mask)), path)
    return n
