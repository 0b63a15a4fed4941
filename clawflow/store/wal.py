"""Write-ahead segments: the durable landing place of every turn before it reaches Parquet.

A turn is one JSON line appended (one `write` call, under one lock, so concurrent appends never
interleave) to the active segment before the gateway completes the response. Durability policy:
`always` fsyncs each line before `append` returns; `group` makes each `append` wait for a shared
fsync that a flusher thread issues at most once per `group_commit_ms` (group commit: many turns,
one fsync, every reply still waits until its turn is on disk); `never` leaves it to the page
cache (survives a process crash, not a power loss).

Segments are named `<UTC timestamp>-[<replica>-]<id>.open.jsonl` while written and renamed to
`.jsonl` when closed (by size, turn count or age); the sealer turns closed segments into Parquet shards. After
a crash, `recover_open_segments` closes what was left, and `read_segment` skips (and reports) a
torn last line.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO, Literal

from clawflow.contracts.turn import TurnRecord

log = logging.getLogger("clawflow.store.wal")

OPEN_SUFFIX = ".open.jsonl"
CLOSED_SUFFIX = ".jsonl"
FsyncPolicy = Literal["always", "group", "never"]


def fsync_dir(path: Path) -> None:
    """Make a rename/create/unlink inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SegmentWriter:
    """Appends turn records to the active segment; thread-safe, one lock."""

    def __init__(self, root: Path, fsync: FsyncPolicy | bool = "always", max_bytes: int = 8 << 20,
                 max_age_s: float = 60.0, max_turns: int = 10_000, group_commit_ms: float = 5.0,
                 replica: str | None = None):
        self.root = Path(root)
        # in every segment name, so shards sealed by replicas into one shared root never share a name
        self.replica = replica
        self.root.mkdir(parents=True, exist_ok=True)
        self.policy: FsyncPolicy = {True: "always", False: "never"}.get(fsync, fsync)  # type: ignore[arg-type]
        if self.policy not in ("always", "group", "never"):
            raise ValueError(f"unknown fsync policy {fsync!r}")
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.max_turns = max_turns
        self.group_commit_s = group_commit_ms / 1000
        self._lock = threading.Lock()
        self._synced_cv = threading.Condition(self._lock)
        self._file: BinaryIO | None = None
        self._path: Path | None = None
        self._opened_at = 0.0  # time.monotonic() of the active segment's creation
        self._bytes = 0
        self._turns = 0
        self._written = 0  # records written since start (all segments)
        self._synced = 0  # records known to be on disk
        self._sync_error: OSError | None = None
        self._flusher: threading.Thread | None = None

    @property
    def fsync(self) -> bool:
        return self.policy == "always"

    def append(self, record: TurnRecord) -> None:
        """Durably append one record (per the fsync policy) before returning."""
        data = (record.to_json() + "\n").encode()
        with self._lock:
            if self._file is not None and (self._bytes >= self.max_bytes or self._turns >= self.max_turns
                                           or self._age() >= self.max_age_s):
                self._close_active()
            if self._file is None:
                self._open_new()
            try:
                self._write(data)
            except BaseException:
                self._abandon_active()  # a partial line must never prefix the next record
                raise
            self._bytes += len(data)
            self._turns += 1
            self._written += 1
            if self.policy != "group":
                return
            seq = self._written
            self._start_flusher()
            self._synced_cv.notify_all()
            while self._synced < seq:
                if self._sync_error is not None:
                    raise OSError(f"group commit fsync failed: {self._sync_error}")
                self._synced_cv.wait()

    def rotate(self) -> Path | None:
        """Close the active segment; its closed path, or None when there was none (or it was empty)."""
        with self._lock:
            return self._close_active()

    def active_age_s(self) -> float:
        with self._lock:
            return self._age() if self._file is not None else 0.0

    def active_turns(self) -> int:
        with self._lock:
            return self._turns

    def close(self) -> None:
        self.rotate()

    def _age(self) -> float:
        return time.monotonic() - self._opened_at

    def _open_new(self) -> None:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%f")
        ident = f"{self.replica}-{uuid.uuid4().hex[:8]}" if self.replica else uuid.uuid4().hex[:8]
        self._path = self.root / f"{stamp}-{ident}{OPEN_SUFFIX}"
        # buffering=0: each write() is a single system call, so lines never interleave or split
        self._file = open(self._path, "xb", buffering=0)  # noqa: SIM115 - closed in _close_active
        if self.policy != "never":
            fsync_dir(self.root)  # the new name must survive a crash too
        self._opened_at = time.monotonic()
        self._bytes = self._turns = 0

    def _write(self, data: bytes) -> None:
        assert self._file is not None
        view = memoryview(data)
        while view:  # unbuffered file: one write(2) per record (more only if the OS writes short)
            view = view[self._file.write(view) :]
        if self.policy == "always":
            os.fsync(self._file.fileno())

    # -- group commit ----------------------------------------------------------------------
    def _start_flusher(self) -> None:
        if self._flusher is None or not self._flusher.is_alive():
            self._flusher = threading.Thread(target=self._flush_loop, name="clawflow-wal-fsync", daemon=True)
            self._flusher.start()

    def _flush_loop(self) -> None:
        last = 0.0
        with self._lock:
            while True:
                while self._synced >= self._written:
                    self._synced_cv.wait()
                delay = last + self.group_commit_s - time.monotonic()
                if delay > 0:  # at most one fsync per window; appends keep arriving meanwhile
                    self._synced_cv.wait(delay)
                    continue
                target, fd = self._written, os.dup(self._file.fileno()) if self._file else None
                self._lock.release()
                try:
                    last = time.monotonic()
                    if fd is None:  # only after a failed close: its records may not be on disk
                        raise OSError("segment closed without a successful fsync")
                    os.fsync(fd)
                    error = None
                except OSError as exc:
                    log.exception("group commit fsync failed")
                    error = exc
                finally:
                    if fd is not None:
                        os.close(fd)
                    self._lock.acquire()
                self._sync_error = error
                if error is None:
                    self._synced = max(self._synced, target)
                self._synced_cv.notify_all()

    # -- closing ---------------------------------------------------------------------------
    def _abandon_active(self) -> None:
        try:
            self._turns += 1  # keep the segment (its earlier records are acknowledged)
            self._close_active()
        except OSError:
            log.exception("could not close a segment after a failed write; it is recovered at next start")

    def _close_active(self) -> Path | None:
        if self._file is None or self._path is None:
            return None
        f, path, turns = self._file, self._path, self._turns
        self._file, self._path, self._bytes, self._turns = None, None, 0, 0
        if turns == 0:
            f.close()
            path.unlink(missing_ok=True)
            return None
        try:
            os.fsync(f.fileno())
        finally:
            f.close()
        self._synced = self._written  # that fsync covered every record of the segment
        self._synced_cv.notify_all()
        closed = path.with_name(path.name[: -len(OPEN_SUFFIX)] + CLOSED_SUFFIX)
        os.replace(path, closed)
        fsync_dir(self.root)
        return closed


def read_segment(path: Path) -> tuple[list[TurnRecord], int]:
    """Records of a segment and the number of torn/corrupt lines skipped (each logged)."""
    records: list[TurnRecord] = []
    skipped = 0
    lines = Path(path).read_bytes().split(b"\n")
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue  # the empty piece after the final newline, or a blank line
        try:
            records.append(TurnRecord.from_row(json.loads(line)))
        except Exception as exc:  # noqa: BLE001 - any bad line is skipped, never fatal
            skipped += 1
            torn = lineno == len(lines)  # no newline after it: a write cut short by a crash
            log.warning(
                "%s:%d: skipped %s record (%d bytes): %s",
                path, lineno, "torn final" if torn else "corrupt", len(line), exc.__class__.__name__,
            )
    return records, skipped


def closed_segments(root: Path) -> list[Path]:
    """Closed segments under `root`, oldest first (names start with their UTC creation time)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob(f"*{CLOSED_SUFFIX}") if not p.name.endswith(OPEN_SUFFIX))


def recover_open_segments(root: Path) -> list[Path]:
    """Close segments a crash left open (call at startup, before any writer exists)."""
    root = Path(root)
    if not root.is_dir():
        return []
    recovered = []
    for path in sorted(root.glob(f"*{OPEN_SUFFIX}")):
        closed = path.with_name(path.name[: -len(OPEN_SUFFIX)] + CLOSED_SUFFIX)
        os.replace(path, closed)
        recovered.append(closed)
        log.warning("recovered segment left open by a crash: %s", closed.name)
    if recovered:
        fsync_dir(root)
    return recovered
