"""Shard files: atomic Parquet writes, validation before anything reads them, quarantine.

A shard is written to `<name>.tmp`, fsynced, renamed, and its directory fsynced, so a reader sees
either no file or a whole one. Shards carry page checksums; `inspect_shard` reads one fully
(verifying them) before the catalog registers it. A shard that fails is moved to
`$CLAWFLOW_HOME/quarantine/` next to a `.reason.json`, never read silently. A shard written by a
newer clawflow is left where it is and skipped (it is not corrupt, just not ours to read).
"""

from __future__ import annotations

import io
import json
import logging
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from clawflow.home import Home
from clawflow.store.metrics import STORE
from clawflow.contracts.turn import ARROW_SCHEMA, SCHEMA_VERSION, schema_version, upgrade_table
from clawflow.store.wal import fsync_dir

log = logging.getLogger("clawflow.store.shards")

TMP_SUFFIX = ".tmp"


class CorruptShard(ValueError):
    """The file cannot be read as a turn shard; the message says why."""


class FutureShard(ValueError):
    """Written by a newer schema version than this code reads."""


@dataclass(frozen=True)
class ShardInfo:
    rows: int
    bytes: int
    first_at: datetime | None
    last_at: datetime | None
    schema_version: int
    mtime: float


def stage_parquet(table: pa.Table, path: Path, row_group_rows: int = 122_880) -> Path:
    """Write `table` (zstd, page checksums) at `<path>.tmp`, fsynced; the temp path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    pq.write_table(table, tmp, compression="zstd", row_group_size=row_group_rows, write_page_checksum=True)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    return tmp


def write_parquet_atomic(table: pa.Table, path: Path, row_group_rows: int = 122_880) -> None:
    """Write `table` at `path` through a fsynced temp file and a rename."""
    os.replace(stage_parquet(table, path, row_group_rows), path)
    fsync_dir(Path(path).parent)


def write_shard(table: pa.Table, path: Path, row_group_rows: int = 122_880) -> None:
    """A turn table in the current schema (with its version in the metadata), atomically."""
    write_parquet_atomic(table.cast(ARROW_SCHEMA), path, row_group_rows)


def shard_bytes(table: pa.Table, row_group_rows: int = 122_880) -> bytes:
    """A turn table as a shard file's bytes (for an object store), as `write_shard` writes it."""
    buf = io.BytesIO()
    pq.write_table(table.cast(ARROW_SCHEMA), buf, compression="zstd", row_group_size=row_group_rows,
                   write_page_checksum=True)
    return buf.getvalue()


def read_shard(path: Path) -> pa.Table:
    """A shard in the current schema, whatever version wrote it."""
    return upgrade_table(pq.read_table(path))


def inspect_shard(path: Path | str, data: pa.Buffer | None = None) -> tuple[ShardInfo, pa.Table]:
    """Read the whole shard (checksums verified, upgraded to the current schema): its row count
    and time range, and the table; CorruptShard when it cannot be read. `data`: the shard's bytes
    already fetched (an object store; `path` is then its URL, for messages)."""
    name = str(path).rsplit("/", 1)[-1]
    try:
        if data is None:
            stat = Path(path).stat()
            size, mtime = stat.st_size, stat.st_mtime
        else:
            size, mtime = data.size, 0.0
        pf = pq.ParquetFile(Path(path) if data is None else pa.BufferReader(data), page_checksum_verification=True)
        version = schema_version(pf.schema_arrow)
        if version > SCHEMA_VERSION:
            raise FutureShard(f"{name}: schema v{version} is newer than this clawflow's v{SCHEMA_VERSION}")
        table = upgrade_table(pf.read())
    except FutureShard:
        raise
    except Exception as exc:  # noqa: BLE001 - any reader failure means the file is not a usable shard
        raise CorruptShard(f"{exc.__class__.__name__}: {str(exc)[:300]}") from exc
    if table.num_rows and table["turn_id"].null_count:
        raise CorruptShard("rows without turn_id")
    bounds = pc.min_max(table["created_at"]) if table.num_rows else None
    return ShardInfo(
        rows=table.num_rows, bytes=size,
        first_at=bounds["min"].as_py() if bounds else None, last_at=bounds["max"].as_py() if bounds else None,
        schema_version=version, mtime=mtime,
    ), table


def quarantine(path: Path, home: Path, reason: str) -> Path:
    """Move a bad shard out of `shards/` (keeping its relative path in the name) with its reason."""
    path, home = Path(path), Path(home)
    qdir = Home(home).quarantine
    qdir.mkdir(parents=True, exist_ok=True)
    try:
        rel = path.relative_to(Home(home).shards)
    except ValueError:
        rel = Path(path.name)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    target = qdir / f"{stamp}-{'__'.join(rel.parts)}"
    os.replace(path, target)
    reason_file = target.with_name(target.name + ".reason.json")
    reason_file.write_text(json.dumps({"original": str(path), "reason": reason,
                                       "quarantined_at": datetime.now(UTC).isoformat()}, indent=1))
    fsync_dir(qdir)
    fsync_dir(path.parent)
    STORE.add(shards_quarantined=1)
    log.error("quarantined corrupt shard %s -> %s: %s", path, target.name, reason)
    return target


def shard_files(shards_dir: Path) -> list[Path]:
    """Every shard file under `shards_dir` (temp files excluded), sorted."""
    shards_dir = Path(shards_dir)
    return sorted(shards_dir.rglob("*.parquet")) if shards_dir.is_dir() else []


def remove_stale_temps(shards_dir: Path) -> int:
    """Delete temp files a crash left mid-write (call under the store lock)."""
    stale = list(Path(shards_dir).rglob(f"*{TMP_SUFFIX}")) if Path(shards_dir).is_dir() else []
    for tmp in stale:
        tmp.unlink(missing_ok=True)
        log.warning("removed %s left by an interrupted write", tmp)
    return len(stale)
