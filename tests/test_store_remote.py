"""The store on an object store (`store.root: s3://…`) served by a real S3-compatible server
(moto's, over HTTP): conditional, checksummed puts; gateway replicas sealing into one bucket
under names that never collide; the orchestrator's catalog (its own local home) reading shards,
judgments and env rewards from there; a damaged object refused. The default stays local."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _object_store import s3_endpoint, s3_store  # noqa: F401 - fixtures

from clawflow.config import StoreConfig
from clawflow.envs.rewards import read_env_rewards, write_env_rewards
from clawflow.judge.store import JudgmentStore
from clawflow.store import outbox
from clawflow.store.catalog import Catalog
from clawflow.contracts.turn import TurnRecord
from clawflow.store.sealer import open_store
from clawflow.store.storage import SHA_KEY, ChecksumMismatch, ObjectExists, Storage
from _store_helpers import pending_pairs


@pytest.fixture(autouse=True)
def _no_prefect(monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.delenv("CLAWFLOW_REPLICA_ID", raising=False)


def turn(session: str, index: int, text: str = "ok") -> TurnRecord:
    msg = [{"role": "user", "content": f"{session} question {index}"}]
    return TurnRecord(session_id=session, turn_index=index, policy_version=0, messages=msg,
                      prompt_token_ids=[1, 2, 3], response_token_ids=[4, 5], response_logprobs=[-0.5, -0.25],
                      response_text=text, finish_reason="stop", new_messages=msg)


def store_cfg(s3_store, **kw) -> StoreConfig:
    root, options = s3_store
    return StoreConfig(root=root, storage_options=options, **kw)


def orchestrator(home: Path, cfg: StoreConfig) -> Catalog:
    storage = Storage.from_store(home, cfg)
    return Catalog(home / "catalog.duckdb", storage.join("shards"), home=home, storage=storage)


def test_local_default_is_unchanged(tmp_path):
    """No root: shards under $CLAWFLOW_HOME/shards as plain files, no outbox, no replica in names."""
    writer, sealer = open_store(tmp_path, StoreConfig())
    writer.append(turn("s", 0))
    (shard,) = sealer.seal_all()
    assert Path(shard.path).parent.parent == tmp_path / "shards" and "-" in shard.shard_id
    assert len(shard.shard_id.split("-")) == 2 and not (tmp_path / "outbox").exists()
    assert Storage.from_store(tmp_path, StoreConfig()).remote is False


def test_put_is_conditional_and_reads_are_verified(s3_store):
    storage = Storage(s3_store[0], s3_store[1])
    url = storage.put_bytes(b"first", "x/a.bin")
    assert storage.put_bytes(b"first", "x/a.bin") == url  # the same bytes again: a retried upload, fine
    with pytest.raises(ObjectExists):
        storage.put_bytes(b"other", "x/a.bin")  # never replaces another writer's object
    assert storage.read_bytes(url) == b"first"
    assert storage.fs.metadata(url)[SHA_KEY] == hashlib.sha256(b"first").hexdigest()
    storage.fs.pipe_file(url, b"rot!!", Metadata={SHA_KEY: hashlib.sha256(b"first").hexdigest()})
    with pytest.raises(ChecksumMismatch, match="do not match"):
        storage.read_bytes(url)
    assert [e.rel for e in storage.list("x", suffix=".bin")] == ["a.bin"]


def test_replicas_seal_into_one_bucket_and_the_orchestrator_trains_from_it(tmp_path, s3_store):
    """Two gateway replicas (own homes, own WALs) seal into one bucket; the orchestrator (a
    third home with the only catalog) sees every turn once, pairs across them, and stores
    judgments and env rewards beside the shards."""
    homes = {name: tmp_path / name for name in ("gw-a", "gw-b")}
    sealed = []
    for name, home in homes.items():
        writer, sealer = open_store(home, store_cfg(s3_store, replica_id=name))
        for i in range(2):
            writer.append(turn(f"{name}-s", i))
        sealed += sealer.seal_all()
        assert outbox.waiting(home) == 0  # uploaded, the local copy gone
        assert not list((home / "shards").rglob("*.parquet"))  # nothing sealed locally outside the outbox
    assert [s.shard_id.split("-")[1] for s in sealed] == ["gw", "gw"] and all(
        str(s.path).startswith(s3_store[0] + "/shards/date=") for s in sealed)
    assert {s.shard_id.split("-", 1)[1].rsplit("-", 1)[0] for s in sealed} == {"gw-a", "gw-b"}

    cat = orchestrator(tmp_path / "orchestrator", store_cfg(s3_store))
    pairs = pending_pairs(cat, 10)
    assert sorted(p.session_id for p in pairs) == ["gw-a-s", "gw-b-s"]  # turn 0 of each, paired with turn 1
    assert cat.stats()["turns"] == 4 and cat.stats()["shards"] == 2
    assert not (tmp_path / "orchestrator" / "shards").exists()

    storage = Storage.from_store(tmp_path / "orchestrator", store_cfg(s3_store))
    judged = JudgmentStore(tmp_path / "orchestrator", storage)
    judged.append([{"turn_id": p.turn_id, "session_id": p.session_id, "judge": "j", "judge_version": "1",
                    "score": 1, "votes": [1]} for p in pairs])
    assert set(judged.lookup([p.turn_id for p in pairs], "j", "1")) == {p.turn_id for p in pairs}
    assert [s["judged"] for s in cat.version_stats()] == [2]
    write_env_rewards(storage, [{"session_id": "gw-a-s", "turn_index": 0, "response_text": "ok",
                                 "env_reward": 1.0, "source": "test"}])
    assert [r["env_reward"] for r in read_env_rewards(storage)] == [1.0]
    rewards = {p.session_id: p.env_reward for p in pending_pairs(cat, 10)}
    assert rewards == {"gw-a-s": 1.0, "gw-b-s": None}
    for folder in ("shards", "judgments", "env_rewards"):
        assert storage.list(folder), folder
    from clawflow.store.privacy import export_sessions

    assert export_sessions(cat, tmp_path / "export.jsonl", ["gw-b-s"]) == 2  # a user's data, from the bucket


def test_a_name_taken_by_another_writer_is_never_overwritten(tmp_path, s3_store):
    """Two replicas misconfigured with one id whose segments got the same name: the second
    shard goes next to the first under a content-derived name; both are read, neither is lost."""
    cfg = store_cfg(s3_store, replica_id="same")
    shards = []
    for host in ("a", "b"):
        wal = tmp_path / host / "wal"
        wal.mkdir(parents=True)
        (wal / "20260102T030405000000-same-deadbeef.jsonl").write_text(turn(f"session-{host}", 0).to_json() + "\n")
        _, sealer = open_store(tmp_path / host, cfg)  # seals the segment into the outbox
        shards += sealer.seal_all()  # and uploads it
    assert len({s.path for s in shards}) == 2, shards
    assert str(shards[1].path).endswith(".parquet") and shards[1].shard_id.startswith(shards[0].shard_id + "-")
    cat = orchestrator(tmp_path / "orchestrator", cfg)
    assert sorted(r.session_id for r in cat.closed_without_next_state(idle_s=0)) == ["session-a", "session-b"]


def test_a_damaged_shard_is_quarantined_not_read(tmp_path, s3_store):
    writer, sealer = open_store(tmp_path / "gw", store_cfg(s3_store, replica_id="gw"))
    writer.append(turn("s", 0))
    writer.append(turn("s", 1))
    (shard,) = sealer.seal_all()
    storage = Storage(s3_store[0], s3_store[1])
    data = bytearray(storage.fs.cat_file(shard.path))
    data[len(data) // 2] ^= 0xFF  # bit rot in the store, metadata untouched
    storage.fs.pipe_file(shard.path, bytes(data), Metadata=storage.fs.metadata(shard.path))
    cat = orchestrator(tmp_path / "orchestrator", store_cfg(s3_store))
    assert cat.sync() == {"registered": 0, "quarantined": 1, "removed": 0}
    assert pending_pairs(cat, 10) == [] and not storage.list("shards")
    (reason,) = storage.list("quarantine", suffix=".reason.json")
    assert b"do not match the checksum" in storage.fs.cat_file(reason.path)


def test_forget_reaches_the_object_store_and_shards_uploaded_later(tmp_path, s3_store):
    """`forget` on the orchestrator: the session leaves the shards, judgments and samples in the
    bucket; a shard a gateway sealed before the forget and uploads after it loses the session's
    turns before the catalog registers it."""
    orch = tmp_path / "orchestrator"
    orch.mkdir()
    from clawflow.contracts.sample import SCHEMA as SAMPLE_SCHEMA
    from clawflow.feedback import keep_samples
    from clawflow.store.privacy import forget_session

    cfg = store_cfg(s3_store, replica_id="gw")
    writer, sealer = open_store(tmp_path / "gw", cfg)
    for i in range(2):
        writer.append(turn("alice", i))
        writer.append(turn("bob", i))
    sealer.seal_all()
    late_writer, late_sealer = open_store(tmp_path / "late", store_cfg(s3_store, replica_id="late"))
    late_writer.append(turn("alice", 2))  # acknowledged before the forget, uploaded after it
    late_writer.append(turn("bob", 2))

    cat, storage = orchestrator(orch, cfg), Storage.from_store(orch, cfg)
    ids = {r.session_id: r.turn_id for r in pending_pairs(cat, 10)}
    JudgmentStore(orch, storage).append([{"turn_id": t, "session_id": s, "judge": "j", "judge_version": "1",
                                          "score": 1, "votes": [1]} for s, t in ids.items()])
    pq.write_table(pa.Table.from_pylist([{"turn_id": t} for t in ids.values()], schema=SAMPLE_SCHEMA),
                   orch / "samples.parquet")
    keep_samples(storage, "run-1", orch / "samples.parquet")

    report = forget_session(cat, "alice")
    assert (report.turns, report.judgments, report.samples) == (2, 1, 1), report
    rows = [r for e in storage.list("shards") for r in storage.read_table(e.path).to_pylist()]
    assert sorted(r["session_id"] for r in rows) == ["bob", "bob"]
    judged = [r["session_id"] for e in storage.list("judgments") for r in storage.read_table(e.path).to_pylist()]
    assert judged == ["bob"]
    assert storage.read_table(storage.join("runs", "run-1", "samples.parquet"))["turn_id"].to_pylist() == [ids["bob"]]

    late_sealer.seal_all()  # the late gateway uploads alice's turn 2 (and bob's)
    assert cat.sync()["registered"] == 1
    rows = [r for e in storage.list("shards") for r in storage.read_table(e.path).to_pylist()]
    assert sorted(r["session_id"] for r in rows) == ["bob"] * 3 and cat.stats()["turns"] == 3


def test_retention_on_an_object_store(tmp_path, s3_store):
    from clawflow.store.maintenance import apply_retention

    writer, sealer = open_store(tmp_path / "gw", store_cfg(s3_store, replica_id="gw"))
    old = turn("evals", 0)
    old.turn_type, old.created_at = "side", datetime.now(UTC) - timedelta(days=40)
    writer.append(old)
    writer.append(turn("user", 0))
    sealer.seal_all()
    cat = orchestrator(tmp_path / "orchestrator", store_cfg(s3_store))
    assert apply_retention(cat, 30.0, None).deleted == 1  # the old side turn; the untrained main turn stays
    assert cat.stats()["turns"] == 1 and cat.sync() == {"registered": 0, "quarantined": 0, "removed": 0}


def test_concurrent_catalog_connections_share_the_store(tmp_path, s3_store):
    """Two connections open at once on one catalog file (one DuckDB instance): both read the store."""
    writer, sealer = open_store(tmp_path / "gw", store_cfg(s3_store, replica_id="gw"))
    writer.append(turn("s", 0))
    writer.append(turn("s", 1))
    sealer.seal_all()
    cat = orchestrator(tmp_path / "orchestrator", store_cfg(s3_store))
    with cat.connect() as one, cat.connect() as two:
        src, params = cat.turns_from(one)
        for con in (one, two):
            assert con.execute(f"SELECT count(*) FROM {src}", params).fetchall() == [(2,)]


def test_replica_id_defaults(monkeypatch):
    """Laptop (no root): none, names unchanged; a shared root: the host name; the setting or
    $CLAWFLOW_REPLICA_ID wins; anything unsafe in a file name is replaced."""
    import socket

    from clawflow.store.storage import replica_id

    assert replica_id(StoreConfig()) is None
    assert replica_id(StoreConfig(root="s3://b/p")) == socket.gethostname().replace("/", "_")[:64]
    monkeypatch.setenv("CLAWFLOW_REPLICA_ID", "pod/7")
    assert replica_id(StoreConfig(root="s3://b/p")) == "pod_7"
    assert replica_id(StoreConfig(root="s3://b/p", replica_id="gw-2")) == "gw-2"


def test_compaction_on_an_object_store_finishes_after_a_crash(tmp_path, s3_store, monkeypatch):
    """Small shard objects merged: staged, committed by the local journal, swapped in. A crash
    after the commit point is finished by the next sync (no turn lost or doubled); an object
    staged by a merge that never committed is removed."""
    from clawflow.store import journal
    from clawflow.store.maintenance import compact

    cfg = store_cfg(s3_store, replica_id="gw")
    writer, sealer = open_store(tmp_path / "gw", cfg)
    for i in range(4):
        writer.append(turn("s", i))
        sealer.seal_all()
    cat = orchestrator(tmp_path / "orchestrator", cfg)
    storage = cat.storage
    assert cat.stats()["shards"] == 4

    def crash(*_):
        raise SystemExit("killed after the commit point")

    monkeypatch.setattr(journal, "_finish_objects", crash)
    with pytest.raises(SystemExit):
        compact(cat, 1 << 20)
    assert len(storage.list("shards")) == 4 and len(storage.list("staging")) == 1
    monkeypatch.undo()
    orphan = storage.put_bytes(b"never committed", "staging/orphan.parquet")

    assert cat.stats()["shards"] == 1  # the sync recovered: merged in, inputs and staged copies gone
    assert not storage.list("staging") and not storage.exists(orphan)
    rows = [r for e in storage.list("shards") for r in storage.read_table(e.path).to_pylist()]
    assert sorted(r["turn_index"] for r in rows) == [0, 1, 2, 3] and cat.stats()["turns"] == 4
    writer.append(turn("s", 4))
    sealer.seal_all()
    assert [c.inputs for c in compact(cat, 1 << 20)] == [2] and cat.stats()["turns"] == 5
