"""Shard files on disk: old-schema shards, corrupt shards (quarantined), compaction and its crash
recovery, retention, group commit of the WAL, torn-record metrics."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_store import T0, shard_rows, turn, user, write_segment
from test_store_catalog import V2_SHARD, conversation, seal

from clawflow.store import journal
from clawflow.store.catalog import Catalog
from clawflow.store.maintenance import apply_retention, compact
from clawflow.store.metrics import STORE
from clawflow.contracts.turn import ARROW_SCHEMA, SCHEMA_VERSION, TurnRecord
from clawflow.store.sealer import seal_segment
from clawflow.store.shards import read_shard
from clawflow.store.wal import SegmentWriter, read_segment
from _store_helpers import pending_pairs

V1_SHARD = Path(__file__).parent / "data" / "shard_v1.parquet"  # written by the schema-v1 sealer


@pytest.fixture(autouse=True)
def _no_prefect(monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)


def catalog(home: Path) -> Catalog:
    return Catalog(home / "catalog.duckdb", home / "shards")


# --- schema versions ---------------------------------------------------------------------------


def test_shard_of_previous_schema_version_is_read(tmp_path):
    home = tmp_path / "home"
    assert pq.read_schema(V1_SHARD).metadata[b"clawflow.schema_version"] == b"1" and SCHEMA_VERSION == 4
    assert "prompt_tokens" not in pq.read_schema(V1_SHARD).names
    seal(home, conversation("new", 2, start=10))  # a current-version shard next to it
    (partition,) = (home / "shards").iterdir()
    shutil.copy(V1_SHARD, partition / "old.parquet")

    table = read_shard(partition / "old.parquet")
    assert table.schema.equals(ARROW_SCHEMA) and table["prompt_tokens"].to_pylist() == [3, 3, 3, 3]
    rec = TurnRecord.from_row(table.to_pylist()[0])
    assert (rec.turn_id, rec.new_messages) == ("v1-old-a-0", [{"role": "user", "content": "hello"}])

    cat = catalog(home)
    pairs = pending_pairs(cat, 99)
    assert [(p.session_id, p.turn_index) for p in pairs] == [("old-a", 0), ("old-b", 0), ("new", 0)]
    assert json.loads(pairs[1].next_state) == user("no, shorter please")
    assert pairs[0].prompt_tokens == 3 and pairs[0].response_tokens == 2  # derived for v1
    assert [p.user for p in pairs] == ["default"] * 3 and rec.user == "default"
    assert {s["policy_version"]: s["turns"] for s in cat.version_stats()} == {1: 4, 3: 2}

    (merged,) = compact(cat, target_bytes=1 << 30)  # compaction rewrites old shards in the current version
    assert pq.read_schema(merged.path).metadata[b"clawflow.schema_version"] == str(SCHEMA_VERSION).encode()
    assert ids_of(pending_pairs(cat, 99)) == ids_of(pairs)


def ids_of(rows):
    return [r.turn_id for r in rows]


def test_shard_of_schema_v2_reads_back_as_the_default_user(tmp_path):
    home = tmp_path / "home"
    old = pq.read_table(V2_SHARD)
    assert old.schema.metadata[b"clawflow.schema_version"] == b"2" and "user" not in old.column_names
    # next to it, a v3 shard of another user who sent the same session id as the v2 turns
    bob = conversation("v2-a", 2, start=10)
    for r in bob:
        r.user = "bob"
    seal(home, bob)
    (partition,) = (home / "shards").iterdir()
    shutil.copy(V2_SHARD, partition / "old.parquet")

    table = read_shard(partition / "old.parquet")  # Arrow: upgrade_table
    assert table.schema.equals(ARROW_SCHEMA) and table["user"].to_pylist() == ["default"] * 4
    assert TurnRecord.from_row(table.to_pylist()[0]).user == "default"

    cat = catalog(home)  # DuckDB: sql_columns, and turn_keys from the upgraded table
    pairs = pending_pairs(cat, 99)
    assert [(p.session_id, p.turn_index, p.user) for p in pairs] == [
        ("v2-a", 0, "default"), ("v2-b", 0, "default"), ("v2-a", 0, "bob")]
    assert json.loads(pairs[0].next_state) == user("thanks, that worked")  # its own next turn, not bob's
    assert json.loads(pairs[2].next_state) == user("v2-a says 1")
    assert pairs[0].prompt_tokens == 3 and pairs[0].response_tokens == 2  # v2 columns as written

    (merged,) = compact(cat, target_bytes=1 << 30)  # rewritten in the current version, the user written down
    assert pq.read_schema(merged.path).metadata[b"clawflow.schema_version"] == str(SCHEMA_VERSION).encode()
    assert sorted(pq.read_table(merged.path)["user"].to_pylist()) == ["bob"] * 2 + ["default"] * 4
    assert [(p.turn_id, p.user) for p in pending_pairs(cat, 99)] == [(p.turn_id, p.user) for p in pairs]


def test_shard_of_schema_v3_reads_back_as_served_by_the_shared_policy(tmp_path):
    """v4 added `adapter_version` (the user's own adapter that decoded a turn): every earlier turn was
    decoded by the shared policy, so it reads back null, through Arrow and DuckDB alike."""
    home = tmp_path / "home"
    turns = conversation("mine", 2)
    turns[0].adapter_version = 3  # a v4 turn that a user's adapter v3 decoded
    seal(home, turns)
    (partition,) = (home / "shards").iterdir()
    (current,) = partition.iterdir()
    v3 = pq.read_table(current).drop_columns(["adapter_version"])  # other turn ids: both shards are read
    v3 = v3.set_column(0, "turn_id", pa.array([t + "-old" for t in v3["turn_id"].to_pylist()]))
    pq.write_table(v3.replace_schema_metadata({b"clawflow.schema_version": b"3"}), partition / "old.parquet")
    assert read_shard(partition / "old.parquet")["adapter_version"].to_pylist() == [None, None]
    assert read_shard(current)["adapter_version"].to_pylist() == [3, None]
    cat = catalog(home)
    assert cat.stats()["turns"] == 4
    (merged,) = compact(cat, target_bytes=1 << 30)
    assert sorted(pq.read_table(merged.path)["adapter_version"].to_pylist(), key=str) == [3, None, None, None]


def test_shard_from_a_newer_schema_is_skipped_not_read(tmp_path):
    home = tmp_path / "home"
    seal(home, conversation("a", 2))
    table = pq.read_table(V1_SHARD)
    future = table.replace_schema_metadata({b"clawflow.schema_version": b"99"})
    pq.write_table(future, home / "shards" / "future.parquet")
    assert catalog(home).stats()["turns"] == 2
    assert (home / "shards" / "future.parquet").exists() and not (home / "quarantine").exists()


# --- corrupt shards ------------------------------------------------------------------------------


def test_corrupt_shards_are_quarantined_with_a_reason(tmp_path):
    home = tmp_path / "home"
    seal(home, conversation("good", 3), conversation("victim", 3, start=10), conversation("flip", 3, start=20))
    shards = sorted((home / "shards").rglob("*.parquet"))
    truncated, flipped = shards[1], shards[2]
    truncated.write_bytes(truncated.read_bytes()[:-100])
    chunk = pq.ParquetFile(flipped).metadata.row_group(0).column(ARROW_SCHEMA.names.index("messages"))
    data = bytearray(flipped.read_bytes())
    data[chunk.data_page_offset + chunk.total_compressed_size // 2] ^= 0x01  # one bit inside a data page
    flipped.write_bytes(bytes(data))
    (home / "shards" / "garbage.parquet").write_bytes(b"PAR1 not really")
    before = STORE.shards_quarantined

    cat = catalog(home)
    assert cat.sync() == {"registered": 1, "quarantined": 3, "removed": 0}
    assert STORE.shards_quarantined - before == 3
    assert sorted(r["session_id"] for r in shard_rows(home / "shards")) == ["good"] * 3  # only the good one left
    reasons = sorted((home / "quarantine").glob("*.reason.json"))
    assert len(reasons) == 3 and len(list((home / "quarantine").iterdir())) == 6
    for reason in reasons:
        info = json.loads(reason.read_text())
        assert info["reason"] and info["original"].startswith(str(home / "shards"))
    assert {p.session_id for p in pending_pairs(cat, 99)} == {"good"}
    assert cat.stats()["shards"] == 1


# --- compaction ------------------------------------------------------------------------------------


def test_compaction_merges_small_shards_without_losing_or_duplicating(tmp_path):
    home = tmp_path / "home"
    seal(home, *[conversation(f"s{i}", 3, start=i) for i in range(6)])
    cat = catalog(home)
    before = sorted(r["turn_id"] for r in shard_rows(home / "shards"))
    pairs_before = ids_of(pending_pairs(cat, 99))
    assert len(list((home / "shards").rglob("*.parquet"))) == 6

    merged = compact(cat, target_bytes=3 * (home / "shards").stat().st_size + 40_000, row_group_rows=5)
    files = sorted((home / "shards").rglob("*.parquet"))
    assert len(merged) >= 1 and len(files) < 6
    assert sorted(r["turn_id"] for r in shard_rows(home / "shards")) == before
    assert ids_of(pending_pairs(cat, 99)) == pairs_before
    big = pq.ParquetFile(merged[0].path)
    assert big.metadata.num_row_groups == -(-merged[0].rows // 5)  # row groups of the configured size
    assert cat.stats()["shards"] == len(files) and cat.stats()["turns"] == 18
    assert compact(cat, target_bytes=1) == []  # nothing small left to merge


def test_compaction_interrupted_after_commit_is_finished_at_recovery(tmp_path, monkeypatch):
    home = tmp_path / "home"
    seal(home, *[conversation(f"s{i}", 2, start=i) for i in range(3)])
    cat = catalog(home)
    before = sorted(r["turn_id"] for r in shard_rows(home / "shards"))

    def crash(*args):
        raise SystemExit("killed right after the journal was committed")

    monkeypatch.setattr(journal, "_finish", crash)
    with pytest.raises(SystemExit):
        compact(cat, target_bytes=1 << 30)
    monkeypatch.undo()
    assert list((home / "store-journal").glob("*.json"))  # committed, not applied
    assert sorted(r["turn_id"] for r in shard_rows(home / "shards")) == before  # tmp output is not a shard yet

    assert cat.stats()["turns"] == 6  # sync recovers: output renamed in, inputs deleted
    assert len(list((home / "shards").rglob("*.parquet"))) == 1
    assert sorted(r["turn_id"] for r in shard_rows(home / "shards")) == before
    assert not list((home / "store-journal").glob("*")) and not list((home / "shards").rglob("*.tmp"))


def test_compaction_interrupted_before_commit_leaves_inputs(tmp_path, monkeypatch):
    home = tmp_path / "home"
    seal(home, *[conversation(f"s{i}", 2, start=i) for i in range(3)])
    cat = catalog(home)
    monkeypatch.setattr(journal, "replace_shards", lambda *a: (_ for _ in ()).throw(SystemExit("killed")))
    with pytest.raises(SystemExit):
        compact(cat, target_bytes=1 << 30)
    monkeypatch.undo()
    assert len(list((home / "shards").rglob("*.tmp"))) == 1
    assert cat.stats()["turns"] == 6 and cat.stats()["shards"] == 3
    assert not list((home / "shards").rglob("*.tmp"))


# --- retention -------------------------------------------------------------------------------------


def test_retention_never_deletes_untrained_or_referenced_turns(tmp_path):
    home = tmp_path / "home"
    old = conversation("old", 6)  # turns 0..4 pairable
    side = [turn("side", i, turn_type="side", at=T0 + timedelta(seconds=i)) for i in range(3)]
    seal(home, old + side)
    cat = catalog(home)
    pairs = pending_pairs(cat, 99)
    by_index = {p.turn_index: p.turn_id for p in pairs}
    cat.commit_consumed([by_index[0], by_index[1]], "run-v1", 1)  # v1: deleted from the registry
    cat.commit_consumed([by_index[2]], "run-v2", 2)  # v2: still registered
    claimed = cat.select_batch("training-now", max_turns=1)[0].turn_id  # index 3
    later = T0 + timedelta(days=30)

    kept_all = apply_retention(cat, days=7, max_bytes=None, registered_versions=None, now=later)
    assert kept_all.deleted == 3  # without registry knowledge only side turns may go
    report = apply_retention(cat, days=7, max_bytes=None, registered_versions=[2], now=later)
    assert report.deleted == 2
    left = {r["turn_id"] for r in shard_rows(home / "shards")}
    assert left == {r.turn_id for r in old} - {by_index[0], by_index[1]}
    assert {by_index[2], claimed, by_index[4], old[5].turn_id} <= left  # referenced, claimed, untrained

    assert apply_retention(cat, days=90, max_bytes=None, registered_versions=[], now=later).deleted == 0  # too young
    squeezed = apply_retention(cat, days=None, max_bytes=1, registered_versions=[], now=later)
    assert squeezed.deleted == 1  # only the v2 turn was still deletable; untrained and claimed stay
    assert {r["turn_id"] for r in shard_rows(home / "shards")} == {claimed, by_index[4], old[5].turn_id}
    assert cat.stats()["turns"] == 3


# --- WAL -------------------------------------------------------------------------------------------


def test_group_commit_shares_fsyncs_and_waits_for_them(tmp_path, monkeypatch):
    spans: list[tuple[float, float]] = []
    real = os.fsync

    def slow_fsync(fd):
        start = time.monotonic()
        time.sleep(0.01)
        real(fd)
        spans.append((start, time.monotonic()))

    monkeypatch.setattr(os, "fsync", slow_fsync)
    writer = SegmentWriter(tmp_path / "wal", fsync="group", group_commit_ms=20)
    late: list[bool] = []

    def work(t: int) -> None:
        for i in range(10):
            began = time.monotonic()
            writer.append(turn(f"s{t}", i))
            done = time.monotonic()
            late.append(not any(s >= began and e <= done for s, e in spans))  # a whole fsync inside the call

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not any(late)
    assert len(spans) < 80 / 2  # shared: far fewer fsyncs than turns
    path = writer.rotate()
    assert len(read_segment(path)[0]) == 80


def test_torn_records_are_counted_in_metrics(tmp_path):
    before = STORE.wal_records_skipped
    segment = write_segment(tmp_path / "wal", [turn(index=0)], tail=b'{"turn_id": "torn')
    assert seal_segment(segment, tmp_path / "shards").rows == 1
    assert STORE.wal_records_skipped - before == 1
    assert "clawflow_store_wal_records_skipped_total" in "\n".join(STORE.prometheus())


def test_rotation_by_turn_count(tmp_path):
    writer = SegmentWriter(tmp_path / "wal", fsync="never", max_turns=3, max_age_s=3600)
    for i in range(7):
        writer.append(turn(index=i))
    writer.close()
    assert [len(read_segment(p)[0]) for p in sorted((tmp_path / "wal").glob("*.jsonl"))] == [3, 3, 1]


def test_store_config_reaches_the_writer_and_sealer(tmp_path):
    from pydantic import ValidationError

    from clawflow.config import StoreConfig
    from clawflow.store.sealer import open_store

    cfg = StoreConfig(fsync="group", group_commit_ms=7, segment_max_turns=2, row_group_rows=1)
    writer, sealer = open_store(tmp_path / "home", cfg)
    assert (writer.policy, writer.group_commit_s, writer.max_turns) == ("group", 0.007, 2)
    for i in range(3):
        writer.append(turn(index=i))
    (shard_a, shard_b) = sealer.seal_all()
    assert (shard_a.rows, shard_b.rows) == (2, 1)
    assert pq.ParquetFile(shard_a.path).metadata.num_row_groups == 2  # row_group_rows=1
    with pytest.raises(ValidationError):
        StoreConfig(fsync="sometimes")
