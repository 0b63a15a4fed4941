"""The sealer: turns closed WAL segments into immutable Parquet shards and announces them.

A shard is named after its segment (`shards/date=YYYY-MM-DD/<segment id>.parquet`, the date
taken from the segment's name), so sealing the same segment twice (a crash between writing the
shard and deleting the segment) overwrites the same file: no duplicate turns. Shards are written
to a temp name, fsynced and renamed; only then is the segment deleted and
`clawflow.shard.sealed` emitted, which triggers training. Turns of forgotten sessions are
dropped here (see tombstones.py). Each pass holds the store lock, so `forget` and compaction
never race a shard being sealed.

With an object-store root (`store.root: s3://…`) the shards are sealed into the local outbox
and then uploaded (outbox.py); `clawflow.shard.sealed` is emitted once a shard is in the store,
where the orchestrator can read it. Uploads that fail are retried with a growing delay.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from clawflow.config import StoreConfig
from clawflow.events import SHARD_SEALED, emit
from clawflow.home import Home
from clawflow.store import journal
from clawflow.store.locks import store_lock
from clawflow.store.metrics import STORE
from clawflow.store.outbox import outbox_dir, publish
from clawflow.contracts.turn import rows_to_table
from clawflow.store.shards import remove_stale_temps, write_shard
from clawflow.store.storage import Storage, replica_id
from clawflow.store.tombstones import forgotten, load_tombstones
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
    path: Path | str  # the object's URL once uploaded to an object-store root
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


def announce_shard(shard: SealedShard) -> None:
    """Emit `clawflow.shard.sealed` (a log line when Prefect is unreachable)."""
    emit(SHARD_SEALED, f"clawflow.shard.{shard.shard_id}", {
        "shard_id": shard.shard_id, "path": str(shard.path), "rows": shard.rows,
        "first_at": shard.first_at.isoformat(), "last_at": shard.last_at.isoformat(), "torn": shard.torn,
    })


def seal_segment(segment: Path, shards_dir: Path, *, row_group_rows: int = 122_880,
                 tombstones: dict[str, datetime] | None = None, announce: bool = True) -> SealedShard | None:
    """Write `segment` as a Parquet shard, delete it, emit the event; None if it held no turns."""
    segment = Path(segment)
    records, torn = read_segment(segment)
    if torn:
        STORE.add(wal_records_skipped=torn)
    kept = [r for r in records if not forgotten(tombstones or {}, r.session_id, r.created_at, r.user)]
    if len(kept) < len(records):
        STORE.add(turns_forgotten_at_seal=len(records) - len(kept))
        log.info("dropped %d turns of forgotten sessions from %s", len(records) - len(kept), segment.name)
    if not kept:
        log.warning("segment %s has no turns to seal (%d skipped); deleted", segment.name, torn)
        segment.unlink(missing_ok=True)
        fsync_dir(segment.parent)
        return None

    shard_id = segment.name.removesuffix(CLOSED_SUFFIX)
    first_at = min(r.created_at for r in kept)
    last_at = max(r.created_at for r in kept)
    path = Path(shards_dir) / f"date={_segment_date(segment, first_at)}" / f"{shard_id}.parquet"
    write_shard(rows_to_table([r.to_row() for r in kept]), path, row_group_rows)  # carries schema_version

    segment.unlink(missing_ok=True)
    fsync_dir(segment.parent)
    STORE.add(shards_sealed=1, turns_sealed=len(kept))

    shard = SealedShard(shard_id, path, len(kept), first_at, last_at, torn)
    if announce:
        announce_shard(shard)
    return shard


def seal_closed(wal_dir: Path, shards_dir: Path, home: Path | None = None,
                row_group_rows: int = 122_880, announce: bool = True) -> list[SealedShard]:
    """Seal every closed segment, oldest first; a failing one is logged and left for next time."""
    home = Path(home) if home is not None else Path(shards_dir).parent
    sealed = []
    segments = closed_segments(wal_dir)
    if not segments:
        return sealed
    with store_lock(home):
        tombstones = load_tombstones(home)
        for segment in segments:
            try:
                if shard := seal_segment(segment, shards_dir, row_group_rows=row_group_rows,
                                         tombstones=tombstones, announce=False):
                    sealed.append(shard)
            except Exception:  # noqa: BLE001 - the segment stays on disk and is retried
                log.exception("sealing %s failed; will retry", segment.name)
    for shard in sealed if announce else []:  # outside the lock: emitting may wait on the network
        announce_shard(shard)
    return sealed


class Sealer:
    """Background thread that rotates aged segments and seals closed ones every `interval_s`."""

    def __init__(self, writer: SegmentWriter, shards_dir: Path, interval_s: float, *,
                 home: Path | None = None, row_group_rows: int = 122_880, storage: Storage | None = None):
        self.writer = writer
        self.storage = storage if storage is not None and storage.remote else None  # shards_dir is its outbox
        self._upload_at = 0.0  # time.monotonic() of the next upload try (after a failure)
        self._upload_delay = 0.0
        self.shards_dir = Path(shards_dir)
        self.home = Path(home) if home is not None else self.shards_dir.parent
        self.interval_s = interval_s
        self.row_group_rows = row_group_rows
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
            return self._seal(force_upload=True)

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
            return self._seal()

    def _seal(self, force_upload: bool = False) -> list[SealedShard]:
        sealed = seal_closed(self.writer.root, self.shards_dir, self.home, self.row_group_rows,
                             announce=self.storage is None)
        if self.storage is None or not (force_upload or time.monotonic() >= self._upload_at):
            return sealed
        by_id = {s.shard_id: s for s in sealed}
        for p in publish(self.shards_dir, self.storage):
            local = by_id.pop(p.local_id, None)
            torn = local.torn if local is not None else 0
            by_id[p.shard_id] = shard = SealedShard(p.shard_id, p.url, p.rows, p.first_at, p.last_at, torn)
            announce_shard(shard)  # only now can the orchestrator read it
        if any(self.shards_dir.rglob("*.parquet")):  # the store is down: try again later, less often
            self._upload_delay = min(60.0, max(self.interval_s, 2 * self._upload_delay))
            self._upload_at = time.monotonic() + self._upload_delay
        else:
            self._upload_delay = 0.0
        return sorted(by_id.values(), key=lambda s: s.shard_id)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the loop must survive any error
                log.exception("sealer pass failed")


def open_store(home: Path, store_cfg: StoreConfig) -> tuple[SegmentWriter, Sealer]:
    """Recover and seal what a previous process left, then build the writer and (unstarted) sealer."""
    home = Path(home)
    storage = Storage.from_store(home, store_cfg)
    # an object-store root: seal into the local outbox, upload from there (outbox.py)
    wal_dir, shards_dir = Home(home).wal, outbox_dir(home) if storage.remote else Path(storage.join(Home.SHARDS))
    with store_lock(home):
        journal.recover(home)  # an interrupted compaction, temp files of an interrupted seal
        if storage.remote:
            remove_stale_temps(shards_dir)
        recover_open_segments(wal_dir)
        recovered = seal_closed(wal_dir, shards_dir, home, store_cfg.row_group_rows, announce=False)
    if recovered:
        log.info("sealed %d leftover segment(s), %d turns", len(recovered), sum(s.rows for s in recovered))
    if recovered and not storage.remote:  # outbox shards are announced once the sealer uploads them
        # announced off the startup path: emitting imports Prefect (seconds); the catalog, not the
        # event, is the record of what is pending, so an event lost to another crash loses no turn
        threading.Thread(target=lambda: [announce_shard(s) for s in recovered], name="clawflow-announce",
                         daemon=True).start()
    writer = SegmentWriter(
        wal_dir,
        fsync=store_cfg.fsync,
        max_bytes=store_cfg.segment_max_bytes,
        max_age_s=store_cfg.segment_max_age_s,
        max_turns=store_cfg.segment_max_turns,
        group_commit_ms=store_cfg.group_commit_ms,
        replica=replica_id(store_cfg),
    )
    return writer, Sealer(writer, shards_dir, store_cfg.seal_interval_s, home=home,
                          row_group_rows=store_cfg.row_group_rows, storage=storage)
