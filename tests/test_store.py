"""Trajectory store on real files: WAL segments, Parquet shards, the DuckDB catalog."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from clawflow.config import StoreConfig
from clawflow.events import SHARD_SEALED
from clawflow.store.catalog import Catalog
from clawflow.contracts.pair import Pair
from clawflow.contracts.turn import ARROW_SCHEMA, SCHEMA_VERSION, TurnRecord
from clawflow.store.sealer import Sealer, open_store, seal_segment
from clawflow.store.wal import SegmentWriter, closed_segments, read_segment
from _store_helpers import pending_pairs

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


@pytest.fixture(autouse=True)
def _no_prefect(monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)


def turn(session="s1", index=0, *, turn_type="main", new=None, at=None, text="ok") -> TurnRecord:
    return TurnRecord(
        session_id=session,
        turn_index=index,
        policy_version=3,
        messages=[{"role": "user", "content": f"question {index}"}],
        prompt_token_ids=[1, 2, 3],
        response_token_ids=[4, 5],
        response_logprobs=[-0.5, -0.25],
        response_text=text,
        finish_reason="stop",
        new_messages=new if new is not None else [{"role": "user", "content": f"question {index}"}],
        turn_type=turn_type,
        created_at=at or T0 + timedelta(seconds=index),
    )


def user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def write_segment(wal: Path, records: list[TurnRecord], tail: bytes = b"", name="20260102T030405000000-deadbeef") -> Path:
    wal.mkdir(parents=True, exist_ok=True)
    path = wal / f"{name}.jsonl"
    path.write_bytes(b"".join((r.to_json() + "\n").encode() for r in records) + tail)
    return path


def shard_rows(shards: Path) -> list[dict]:
    return [row for p in sorted(shards.rglob("*.parquet")) for row in pq.read_table(p).to_pylist()]


# --- WAL ---------------------------------------------------------------------------------------


def test_concurrent_appends_never_interleave(tmp_path):
    writer = SegmentWriter(tmp_path / "wal", fsync=False, max_bytes=256 << 10)
    big = "x" * 20_000  # large lines make interleaving likely if writes were not atomic

    def work(t: int) -> None:
        for i in range(100):
            writer.append(turn(f"s{t}", i, text=big))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    writer.close()

    segments = closed_segments(tmp_path / "wal")
    assert len(segments) > 1  # rotated by size along the way
    lines = [line for s in segments for line in s.read_bytes().splitlines()]
    assert len(lines) == 800
    keys = {(d["session_id"], d["turn_index"]) for d in map(json.loads, lines)}
    assert keys == {(f"s{t}", i) for t in range(8) for i in range(100)}
    assert not list((tmp_path / "wal").glob("*.open.jsonl"))


def test_fsync_path_flushes_before_returning(tmp_path, monkeypatch):
    calls = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real_fsync(fd))[1])
    writer = SegmentWriter(tmp_path / "wal", fsync=True)
    for i in range(3):
        writer.append(turn(index=i))
        (active,) = (tmp_path / "wal").glob("*.open.jsonl")
        assert len(active.read_bytes().splitlines()) == i + 1  # visible without closing
    assert len(calls) >= 3
    assert writer.active_turns() == 3
    closed = writer.rotate()
    assert closed is not None and closed.name.endswith(".jsonl") and ".open" not in closed.name
    assert [r.turn_index for r in read_segment(closed)[0]] == [0, 1, 2]
    assert writer.rotate() is None  # nothing active any more


def test_rotation_by_size_and_age(tmp_path):
    writer = SegmentWriter(tmp_path / "wal", fsync=False, max_bytes=1500, max_age_s=3600)
    for i in range(10):
        writer.append(turn(index=i))
    writer.close()
    segments = closed_segments(tmp_path / "wal")
    assert len(segments) >= 3
    assert all(s.stat().st_size >= 1500 for s in segments[:-1])
    assert [r.turn_index for s in segments for r in read_segment(s)[0]] == list(range(10))

    aged = SegmentWriter(tmp_path / "wal2", fsync=False, max_age_s=0.05)
    aged.append(turn(index=0))
    time.sleep(0.1)
    assert aged.active_age_s() >= 0.05
    aged.append(turn(index=1))
    aged.close()
    assert len(closed_segments(tmp_path / "wal2")) == 2


def test_torn_and_corrupt_lines_are_skipped_and_counted(tmp_path, caplog):
    good = [turn(index=i) for i in range(3)]
    path = write_segment(tmp_path, good[:2], tail=b"not json\n" + (good[2].to_json() + "\n").encode())
    with path.open("ab") as f:
        f.write(turn(index=9).to_json().encode()[:57])  # a crash mid-write: no newline
    with caplog.at_level(logging.WARNING, logger="clawflow.store.wal"):
        records, skipped = read_segment(path)
    assert [r.turn_id for r in records] == [r.turn_id for r in good]
    assert records[0].created_at == good[0].created_at and records[0].new_messages == good[0].new_messages
    assert skipped == 2
    assert sum("skipped" in m for m in caplog.messages) == 2


# --- sealing -----------------------------------------------------------------------------------


def test_seal_writes_parquet_with_schema_version_and_deletes_segment(tmp_path, caplog):
    records = [turn(index=i) for i in range(4)]
    segment = write_segment(tmp_path / "wal", records, tail=b'{"torn')
    with caplog.at_level(logging.INFO, logger="clawflow.events"):
        shard = seal_segment(segment, tmp_path / "shards")
    assert shard is not None
    assert shard.path == tmp_path / "shards" / "date=2026-01-02" / "20260102T030405000000-deadbeef.parquet"
    assert (shard.shard_id, shard.rows, shard.torn) == ("20260102T030405000000-deadbeef", 4, 1)
    assert (shard.first_at, shard.last_at) == (T0, T0 + timedelta(seconds=3))
    assert not segment.exists()
    assert not list((tmp_path / "shards").rglob("*.tmp"))

    table = pq.read_table(shard.path)
    assert table.schema.metadata[b"clawflow.schema_version"] == str(SCHEMA_VERSION).encode()
    assert table.schema.remove_metadata().equals(ARROW_SCHEMA.remove_metadata())
    assert pq.ParquetFile(shard.path).metadata.row_group(0).column(0).compression == "ZSTD"
    rows = table.to_pylist()
    assert [r["turn_id"] for r in rows] == [r.turn_id for r in records]
    assert TurnRecord.from_row(rows[1]) == records[1]
    assert any(SHARD_SEALED in m and shard.shard_id in m for m in caplog.messages)


def test_resealing_same_segment_is_idempotent(tmp_path):
    records = [turn(index=i) for i in range(3)]
    segment = write_segment(tmp_path / "wal", records)
    content = segment.read_bytes()
    first = seal_segment(segment, tmp_path / "shards")
    segment.write_bytes(content)  # crash after the shard was written, before the segment was deleted
    second = seal_segment(segment, tmp_path / "shards")
    assert first is not None and second is not None and first.path == second.path
    assert len(list((tmp_path / "shards").rglob("*.parquet"))) == 1
    assert sorted(r["turn_id"] for r in shard_rows(tmp_path / "shards")) == sorted(r.turn_id for r in records)


def test_segment_without_valid_records_is_deleted(tmp_path):
    segment = write_segment(tmp_path / "wal", [], tail=b"garbage")
    assert seal_segment(segment, tmp_path / "shards") is None
    assert not segment.exists() and not list((tmp_path / "shards").rglob("*.parquet"))


def test_recovery_after_crash_seals_good_records(tmp_path):
    home = tmp_path / "home"
    records = [turn(index=i) for i in range(5)]
    write_segment(home / "wal", records, tail=turn(index=5).to_json().encode()[:80], name="20260102T030405000000-cafe0000.open")
    writer, sealer = open_store(home, StoreConfig())
    assert list((home / "wal").iterdir()) == []
    (shard,) = (home / "shards").rglob("*.parquet")
    assert shard.parent.name == "date=2026-01-02" and shard.name == "20260102T030405000000-cafe0000.parquet"
    assert [r["turn_id"] for r in shard_rows(home / "shards")] == [r.turn_id for r in records]
    assert writer.root == home / "wal" and sealer.shards_dir == home / "shards"


def test_sealer_stop_leaves_every_turn_in_shards(tmp_path):
    home = tmp_path / "home"
    cfg = StoreConfig(fsync="never", segment_max_bytes=4000, segment_max_age_s=3600, seal_interval_s=0.02)
    writer, sealer = open_store(home, cfg)
    sealer.start()
    sent: list[str] = []
    lock = threading.Lock()

    def work(t: int) -> None:
        for i in range(25):
            rec = turn(f"s{t}", i)
            writer.append(rec)
            with lock:
                sent.append(rec.turn_id)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    sealer.stop()
    assert list((home / "wal").iterdir()) == []
    ids = [r["turn_id"] for r in shard_rows(home / "shards")]
    assert sorted(ids) == sorted(sent) and len(ids) == 100


def test_background_loop_seals_aged_segments(tmp_path):
    writer = SegmentWriter(tmp_path / "wal", fsync=False, max_age_s=0.05)
    sealer = Sealer(writer, tmp_path / "shards", interval_s=0.02)
    sealer.start()
    try:
        writer.append(turn(index=0))
        deadline = time.monotonic() + 10
        while not list((tmp_path / "shards").rglob("*.parquet")) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(shard_rows(tmp_path / "shards")) == 1
    finally:
        sealer.stop()


# --- catalog -----------------------------------------------------------------------------------


@pytest.fixture
def catalog(tmp_path) -> Catalog:
    tool_result = [{"role": "tool", "tool_call_id": "c1", "content": "42"}]
    first = [
        turn("a", 0, new=user("hi")),
        turn("a", 1, new=user("thanks, now add 2")),
        turn("b", 0, turn_type="side", new=user("eval"), at=T0 - timedelta(seconds=30)),
        turn("b", 1, new=user("side's next"), at=T0 + timedelta(seconds=0.5)),
    ]
    second = [
        turn("a", 2, new=tool_result),  # the last turn of session a: no next state
        turn("b", 2, new=user("late duplicate"), at=T0 + timedelta(seconds=60)),
        turn("b", 2, new=user("earliest"), at=T0 + timedelta(seconds=50)),
    ]
    writer = SegmentWriter(tmp_path / "wal", fsync=False)
    for rec in first:
        writer.append(rec)
    writer.rotate()
    for rec in second:
        writer.append(rec)
    sealed = Sealer(writer, tmp_path / "shards", interval_s=1).seal_all()
    assert len(sealed) == 2
    return Catalog(tmp_path / "catalog.duckdb", tmp_path / "shards")


def test_pending_pairs_join_turn_with_next_state(catalog):
    pairs = pending_pairs(catalog, 10)
    assert [(p.session_id, p.turn_index) for p in pairs] == [("a", 0), ("b", 1), ("a", 1)]
    by_key = {(p.session_id, p.turn_index): p for p in pairs}
    assert json.loads(by_key["a", 0].next_state) == user("thanks, now add 2")
    assert by_key["a", 0].next_role == "user"
    assert json.loads(by_key["a", 1].next_state)[0]["content"] == "42"
    assert by_key["a", 1].next_role == "tool"
    assert json.loads(by_key["b", 1].next_state) == user("earliest")
    turn_fields = {f.name for f in dataclasses.fields(Pair)} - {"next_state", "next_role"}
    assert turn_fields <= set(ARROW_SCHEMA.names) and pairs[0].prompt_token_ids == [1, 2, 3]  # read from the shard
    assert pairs[0].created_at == T0
    assert [p.turn_index for p in pending_pairs(catalog, 1)] == [0]


def test_commit_consumed_is_exactly_once(catalog):
    pairs = pending_pairs(catalog, 2)
    ids = [p.turn_id for p in pairs]
    assert catalog.commit_consumed(ids, "run-1", 3) == 2
    left = pending_pairs(catalog, 10)
    assert len(left) == 1 and not set(ids) & {p.turn_id for p in left}
    assert catalog.commit_consumed(ids, "run-1", 3) == 0  # a retried run records nothing twice
    stats = catalog.stats()
    assert stats["shards"] == 2 and stats["turns"] == 7
    assert (stats["consumed"], stats["pending"]) == (2, 1)
    assert stats["last_run"]["run_id"] == "run-1" and stats["last_run"]["turns"] == 2


def test_empty_shards_dir(tmp_path):
    cat = Catalog(tmp_path / "catalog.duckdb", tmp_path / "shards")
    assert pending_pairs(cat, 10) == []
    assert cat.stats() == {"shards": 0, "turns": 0, "consumed": 0, "claimed": 0, "pending": 0, "last_run": None}
