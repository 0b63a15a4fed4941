"""Keeping the store small: compaction of small shards and a retention policy.

Compaction merges shards smaller than half the target size, within one date partition, into
shards of about the target size (row groups sized for DuckDB scans, upgraded to the current
schema), through the journal in journal.py so a crash never loses or duplicates a turn.

Retention deletes turns older than `days`, or the oldest ones while the store is over
`max_bytes`, but only turns that can never train again and that no live version needs: turns
consumed by a run whose version is no longer registered, and side (evaluation) turns, which are
never trained on. Untrained main turns, claimed turns, and turns behind a registered version
are kept whatever the policy says. Without the list of registered versions every consumed turn
counts as referenced.

Both run under the catalog's connection and the store lock: no reader sees a half-done state.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from clawflow.store import journal
from clawflow.home import Home
from clawflow.store.catalog import Catalog
from clawflow.store.locks import store_lock
from clawflow.contracts.turn import ARROW_SCHEMA, upgrade_table
from clawflow.store.shards import read_shard, shard_bytes, stage_parquet, write_shard
from clawflow.store.wal import fsync_dir

log = logging.getLogger("clawflow.store.maintenance")


@dataclass(frozen=True)
class Compacted:
    path: Path | str  # an object's URL on an object-store root
    inputs: int
    rows: int


def _groups(shards: list[tuple[str, int]], target_bytes: int) -> list[list[str]]:
    """Consecutive small shards of one partition packed up to `target_bytes`; only groups of 2+."""
    groups: list[list[str]] = []
    current: list[str] = []
    size, partition = 0, None
    for rel, nbytes in shards:
        part = str(Path(rel).parent)
        if current and (part != partition or size + nbytes > target_bytes):
            groups.append(current)
            current, size = [], 0
        current.append(rel)
        size += nbytes
        partition = part
    groups.append(current)
    return [g for g in groups if len(g) > 1]


def compact(cat: Catalog, target_bytes: int, row_group_rows: int = 122_880) -> list[Compacted]:
    """Merge small shards; the new shards."""
    if cat.storage.remote:
        return _compact_objects(cat, target_bytes, row_group_rows)
    done = []
    with cat.connect() as con, store_lock(cat.home):
        small = con.execute("SELECT path, bytes FROM shards WHERE bytes < $half ORDER BY path, first_at",
                            {"half": target_bytes // 2}).fetchall()
        for group in _groups(small, target_bytes):
            inputs = [cat.shards_dir / rel for rel in group]
            table = pa.concat_tables([read_shard(p) for p in inputs])
            table = table.sort_by([("created_at", "ascending"), ("turn_id", "ascending")])
            out = inputs[0].with_name(f"{inputs[0].stem}-c{uuid.uuid4().hex[:8]}.parquet")
            stage_parquet(table.cast(ARROW_SCHEMA), out, row_group_rows)
            journal.replace_shards(cat.home, [out], inputs)
            cat.unregister(con, group)
            cat.register(con, out)
            done.append(Compacted(out, len(inputs), table.num_rows))
            log.info("compacted %d shards (%d turns) into %s", len(inputs), table.num_rows, out.name)
    return done


def _compact_objects(cat: Catalog, target_bytes: int, row_group_rows: int) -> list[Compacted]:
    """`compact` on an object store: the merged shard staged, then swapped in by the journal."""
    done = []
    with cat.connect() as con, store_lock(cat.home):
        small = con.execute("SELECT path, bytes FROM shards WHERE bytes < $half ORDER BY path, first_at",
                            {"half": target_bytes // 2}).fetchall()
        for group in _groups(small, target_bytes):
            inputs = [str(cat.shard_path(rel)) for rel in group]
            table = pa.concat_tables([upgrade_table(cat.storage.read_table(p)) for p in inputs])
            table = table.sort_by([("created_at", "ascending"), ("turn_id", "ascending")])
            out = str(cat.shard_path(f"{group[0].removesuffix('.parquet')}-c{uuid.uuid4().hex[:8]}.parquet"))
            staging = f"{Home.STAGING}/{uuid.uuid4().hex}.parquet"
            staged = cat.storage.put_bytes(shard_bytes(table, row_group_rows), staging)
            journal.replace_objects(cat.home, cat.storage, staged, out, inputs)
            cat.unregister(con, group)
            cat.register(con, out, cat.storage.mtime(out))
            done.append(Compacted(out, len(inputs), table.num_rows))
            log.info("compacted %d shard objects (%d turns) into %s", len(inputs), table.num_rows, out)
    return done


def rewrite_without(cat: Catalog, con, rels: set[str], drop_ids: set[str], row_group_rows: int = 122_880) -> int:
    """Rewrite each shard (relative path) without the turns `drop_ids`, atomically in place (an
    emptied shard is deleted); re-registers them. Call under the store lock. Turns removed.
    On an object store each shard object is replaced whole (see Storage.rewrite_parquet)."""
    if cat.storage.remote:
        return _rewrite_objects_without(cat, con, rels, drop_ids, row_group_rows)
    removed = 0
    for rel in sorted(rels):
        path = cat.shards_dir / rel
        table = read_shard(path)
        keep = pc.invert(pc.is_in(table["turn_id"], value_set=pa.array(sorted(drop_ids), pa.string())))
        kept = table.filter(keep)
        removed += table.num_rows - kept.num_rows
        if kept.num_rows == table.num_rows:
            continue
        if kept.num_rows == 0:
            path.unlink()
            fsync_dir(path.parent)
            cat.unregister(con, [rel])
        else:
            write_shard(kept, path, row_group_rows)
            cat.register(con, path)
    return removed


@dataclass(frozen=True)
class RetentionReport:
    deleted: int
    shards_rewritten: int
    bytes_before: int
    bytes_after: int


def _rewrite_objects_without(cat: Catalog, con, rels: set[str], drop_ids: set[str], row_group_rows: int) -> int:
    removed = 0
    for rel in sorted(rels):
        path = cat.shard_path(rel)
        table = upgrade_table(cat.storage.read_table(path))
        kept = table.filter(pc.invert(pc.is_in(table["turn_id"], value_set=pa.array(sorted(drop_ids), pa.string()))))
        removed += table.num_rows - kept.num_rows
        if kept.num_rows == table.num_rows:
            continue
        if kept.num_rows == 0:
            cat.storage.delete(path)
            cat.unregister(con, [rel])
        else:
            cat.storage.replace_bytes(shard_bytes(kept, row_group_rows), str(path))
            cat.register(con, path, cat.storage.mtime(path))
    return removed


def apply_retention(cat: Catalog, days: float | None, max_bytes: int | None,
                    registered_versions: Collection[int] | None = None, now: datetime | None = None,
                    row_group_rows: int = 122_880) -> RetentionReport:
    """Delete what the policy allows (see the module docstring)."""
    now = now or datetime.now(UTC)
    with cat.connect() as con, store_lock(cat.home):
        before = con.execute("SELECT coalesce(sum(bytes), 0)::BIGINT FROM shards").fetchall()[0][0]
        if days is None and max_bytes is None:
            return RetentionReport(0, 0, before, before)
        params: dict = {}
        unreferenced = "false" if registered_versions is None else "NOT list_contains($live, c.policy_version)"
        if registered_versions is not None:
            params["live"] = sorted(int(v) for v in registered_versions)
        candidates = con.execute(f"""
            SELECT t.turn_id, t.path, t.created_at, s.bytes::DOUBLE / greatest(s.rows, 1) AS row_bytes
            FROM turn_keys AS t LEFT JOIN consumed AS c USING (turn_id) JOIN shards AS s USING (path)
            WHERE (t.turn_type = 'side' OR (c.turn_id IS NOT NULL AND {unreferenced}))
              AND NOT EXISTS (SELECT 1 FROM claims AS k WHERE k.turn_id = t.turn_id)
            ORDER BY t.created_at, t.turn_id""", params).fetchall()
        drop: dict[str, str] = {}
        if days is not None:
            cutoff = now - timedelta(days=days)
            drop.update((tid, f) for tid, f, at, _ in candidates if at < cutoff)
        if max_bytes is not None and before > max_bytes:
            excess = before - max_bytes - sum(rb for tid, _, _, rb in candidates if tid in drop)
            for tid, f, _, row_bytes in candidates:
                if excess <= 0:
                    break
                if tid not in drop:
                    drop[tid] = f
                    excess -= row_bytes
        files = set(drop.values())
        deleted = rewrite_without(cat, con, files, set(drop), row_group_rows) if drop else 0
        after = con.execute("SELECT coalesce(sum(bytes), 0)::BIGINT FROM shards").fetchall()[0][0]
    if deleted:
        log.info("retention deleted %d turns from %d shards (%d -> %d bytes)", deleted, len(files), before, after)
    return RetentionReport(deleted, len(files), before, after)
