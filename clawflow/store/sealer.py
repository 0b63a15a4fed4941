"""The sealer: turns closed WAL segments into immutable Parquet shards and announces them.

A shard is named after its segment (`shards/date=YYYY-MM-DD/<segment id>.parquet`, the date
taken from the segment's name), so sealing the same segment twice (a crash between writing the
shard and deleting the segment) overwrites the same file: no duplicate turns. Shards are written
to a temp name, fsynced and renamed; only then is the segment deleted and
`clawflow.shard.sealed` emitted, which triggers training.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pyarrow.parquet as pq

from clawflow.config import StoreConfig
from clawflow.events import SHARD_SEALED, emit
from clawflow.store.record import rows_to_table
from clawflow.store.wal import (
    CLOSED_SUFFIX,
    SegmentWriter,
    closed_segments,
    fsync_dir,
    read_segment,
    recover_open_segments,
)

log = logging.getLogger("clawflow.store.sealer")


@dataclass(frozen=True)
class SealedShard:
    shard_id: str
    path: Path
    rows: int
    first_at: datetime
    last_at: datetime
    torn: int  # lines of the segment skipped as torn/corrupt


def _segment_date(segment: Path, fallback: datetime) -> str:
    """`YYYY-MM-DD` from the segment's `yyyymmddT...` name (the record time if it has none)."""
    try:
        return datetime.strptime(segment.name[:8], "%Y%m%d").strftime("%Y-%m-%d")
    except ValueError:
        return fallback.strftime("%Y-%m-%d")


def seal_segment(segment: Path, shards_dir: Path) -> SealedShard | None:
    """Write `segment` as a Parquet shard, delete it, emit the event; None if it held no turns."""
    segment = Path(segment)
    records, torn = read_segment(segment)
    if not records:
        log.warning("segment %s has no valid records (%d skipped); deleted", segment.name, torn)
        segment.unlink(missing_ok=True)
        fsync_dir(segment.parent)
        return None

    shard_id = segment.name.removesuffix(CLOSED_SUFFIX)
    first_at = min(r.created_at for r in records)
    last_at = max(r.created_at for r in records)
    out_dir = Path(shards_dir) / f"date={_segment_date(segment, first_at)}"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{shard_id}.parquet"
    tmp = path.with_name(path.name + ".tmp")

    table = rows_to_table([r.to_row() for r in records])  # carries the schema_version metadata
    pq.write_table(table, tmp, compression="zstd")
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(out_dir)

    segment.unlink(missing_ok=True)
    fsync_dir(segment.parent)

    shard = SealedShard(shard_id, path, len(records), first_at, last_at, torn)
    emit(
        SHARD_SEALED,
        f"clawflow.shard.{shard_id}",
        {
            "shard_id": shard_id,
            "path": str(path),
            "rows": shard.rows,
            "first_at": first_at.isoformat(),
            "last_at": last_at.isoformat(),
            "torn": torn,
        },
    )
    return shard


def _seal_closed(wal_dir: Path, shards_dir: Path) -> list[SealedShard]:
    """Seal every closed segment, oldest first; a failing one is logged and left for next time."""
    sealed = []
    for segment in closed_segments(wal_dir):
        try:
            if shard := seal_segment(segment, shards_dir):
                sealed.append(shard)
        except Exception:  # noqa: BLE001 - the segment stays on disk and is retried
            log.exception("sealing %s failed; will retry", segment.name)
    return sealed


class Sealer:
    """Background thread that rotates aged segments and seals closed ones every `interval_s`."""

    def __init__(self, writer: SegmentWriter, shards_dir: Path, interval_s: float):
        self.writer = writer
        self.shards_dir = Path(shards_dir)
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="clawflow-sealer", daemon=True)
        self._thread.start()

    def seal_all(self) -> list[SealedShard]:
        """Rotate the active segment and seal every closed one now."""
        with self._lock:
            self.writer.rotate()
            return _seal_closed(self.writer.root, self.shards_dir)

    def stop(self) -> list[SealedShard]:
        """Stop the thread, then seal everything (every acknowledged turn ends up in a shard)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return self.seal_all()

    def tick(self) -> list[SealedShard]:
        """One pass of the background loop."""
        with self._lock:
            w = self.writer
            if w.active_turns() > 0 and w.active_age_s() >= w.max_age_s:
                w.rotate()
            return _seal_closed(w.root, self.shards_dir)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the loop must survive any error
                log.exception("sealer pass failed")


def open_store(home: Path, store_cfg: StoreConfig) -> tuple[SegmentWriter, Sealer]:
    """Recover and seal what a previous process left, then build the writer and (unstarted) sealer."""
    wal_dir, shards_dir = Path(home) / "wal", Path(home) / "shards"
    recover_open_segments(wal_dir)
    recovered = _seal_closed(wal_dir, shards_dir)
    if recovered:
        log.info("sealed %d leftover segment(s), %d turns", len(recovered), sum(s.rows for s in recovered))
    writer = SegmentWriter(
        wal_dir,
        fsync=store_cfg.fsync == "always",
        max_bytes=store_cfg.segment_max_bytes,
        max_age_s=store_cfg.segment_max_age_s,
    )
    return writer, Sealer(writer, shards_dir, store_cfg.seal_interval_s)
