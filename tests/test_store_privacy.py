"""Privacy: `clawflow export` and `clawflow forget` on a real store; session ids are never paths."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from test_store import T0, shard_rows, turn, user, write_segment
from test_store_catalog import conversation, seal, write_judgments
from typer.testing import CliRunner

from clawflow.cli import app
from clawflow.contracts.turn import SCHEMA_VERSION
from clawflow.store.catalog import Catalog
from clawflow.store.privacy import export_sessions, forget_session
from clawflow.store.sealer import Sealer
from clawflow.store.wal import SegmentWriter, read_segment
from _store_helpers import pending_pairs

EVIL = "../../../escape'; DROP TABLE consumed; --/\u00e9"


@pytest.fixture(autouse=True)
def _no_prefect(monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)


@pytest.fixture
def config_file(tmp_path) -> tuple[Path, Path]:
    home = tmp_path / "home"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"home": str(home), "model": {"name": "m", "path": str(tmp_path / "no-model")}}))
    return path, home


def populated(home: Path) -> Catalog:
    """alice and bob (and an evil session id) in shards; alice also consumed, judged, in a past
    training batch and in a closed, unsealed segment."""
    seal(home, conversation("alice", 3) + conversation("bob", 3, 0.5), conversation(EVIL, 2, 2))
    cat = Catalog(home / "catalog.duckdb", home / "shards")
    pairs = {(p.session_id, p.turn_index): p.turn_id for p in pending_pairs(cat, 99)}
    cat.commit_consumed([pairs["alice", 0], pairs["bob", 0]], "run-1", 1)
    cat.select_batch("flow-2", max_turns=99)  # claims alice 1, bob 1, evil 0
    write_judgments(home / "judgments" / "part-0.parquet", [
        {"turn_id": pairs["alice", 0], "session_id": "alice", "judge": "rules", "score": 1, "created_at": T0},
        {"turn_id": pairs["bob", 0], "session_id": "bob", "judge": "rules", "score": -1, "created_at": T0}])
    (home / "runs" / "run-1").mkdir(parents=True)
    from clawflow.contracts.sample import write_samples
    write_samples([{"turn_id": pairs[s, 0], "prompt_token_ids": [1], "response_token_ids": [2],
                    "response_logprobs": [-0.1], "reward": 1.0, "hint": None} for s in ("alice", "bob")],
                  home / "runs" / "run-1" / "samples.parquet")
    write_segment(home / "wal", [turn("alice", 7, new=user("unsealed")), turn("bob", 7)])
    return cat


def test_forget_removes_the_session_everywhere(tmp_path):
    home = tmp_path / "home"
    cat = populated(home)
    writer = SegmentWriter(home / "wal", fsync=False)
    writer.append(turn("alice", 8, at=datetime.now(UTC) - timedelta(seconds=1)))  # active segment, pre-forget

    report = forget_session(cat, "alice")
    assert (report.turns, report.shards, report.wal_records) == (3, 1, 1)
    assert (report.judgments, report.samples, report.catalog_rows) == (1, 1, 2)

    after_forget = turn("alice", 9, at=datetime.now(UTC) + timedelta(seconds=1))  # a new conversation
    writer.append(after_forget)
    Sealer(writer, home / "shards", interval_s=1).seal_all()  # the tombstone drops turn 8 at sealing
    rows = shard_rows(home / "shards")
    assert [r["turn_id"] for r in rows if r["session_id"] == "alice"] == [after_forget.turn_id]
    assert sorted(r["turn_index"] for r in rows if r["session_id"] == "bob") == [0, 1, 2, 7]
    assert all("alice" not in json.dumps(r["messages"]) or r["turn_id"] == after_forget.turn_id for r in rows)

    judged = pq.read_table(home / "judgments" / "part-0.parquet")
    assert judged["session_id"].to_pylist() == ["bob"] and judged.schema.field("score").type == "int8"
    assert len(pq.read_table(home / "runs" / "run-1" / "samples.parquet")) == 1
    with cat._connect() as con:
        assert con.execute("SELECT run_id FROM consumed").fetchall() == [("run-1",)]
        assert con.execute("SELECT count(*) FROM claims").fetchall()[0][0] == 2
    assert "alice" not in (home / "forgotten.jsonl").read_text()  # only a hash is kept
    assert forget_session(cat, "alice").turns == 1  # the new conversation, on a second request


def mine(name: str, rec):
    rec.user = name
    return rec


def test_forget_user_removes_every_turn_of_theirs_and_only_theirs(tmp_path):
    """alice and bob both used session id "shared"; forgetting alice removes her turns in every
    session (shards, closed and active WAL, catalog, judgments, samples), and none of bob's."""
    from test_store_catalog import of_user

    from clawflow.store.privacy import forget_user

    home = tmp_path / "home"
    seal(home, of_user("alice", conversation("shared", 2) + conversation("hers", 2, 1))
         + of_user("bob", conversation("shared", 3, 0.5)))
    cat = Catalog(home / "catalog.duckdb", home / "shards")
    alice_ids = [p.turn_id for p in pending_pairs(cat, 99) if p.user == "alice"]
    cat.commit_consumed(alice_ids[:1], "run-1", 1)
    write_judgments(home / "judgments" / "part-0.parquet", [
        {"turn_id": alice_ids[0], "session_id": "shared", "judge": "rules", "score": 1, "created_at": T0}])
    write_segment(home / "wal", [mine("alice", turn("shared", 7)), mine("bob", turn("shared", 8))])
    writer = SegmentWriter(home / "wal", fsync=False)
    writer.append(mine("alice", turn("later", 0, at=datetime.now(UTC) - timedelta(seconds=1))))  # active, pre-forget

    report = forget_user(cat, "alice")
    assert (report.turns, report.wal_records, report.judgments, report.catalog_rows) == (4, 1, 1, 1)
    after = mine("alice", turn("new", 0, at=datetime.now(UTC) + timedelta(seconds=1)))  # she comes back later
    writer.append(after)
    Sealer(writer, home / "shards", interval_s=1).seal_all()  # the user's tombstone drops "later" at sealing
    rows = shard_rows(home / "shards")
    assert [r["turn_id"] for r in rows if r["user"] == "alice"] == [after.turn_id]
    assert sorted(r["turn_index"] for r in rows if r["user"] == "bob") == [0, 1, 2, 8]  # bob's "shared" stays
    assert "alice" not in (home / "forgotten.jsonl").read_text()  # only a hash is kept
    assert not pq.read_table(home / "judgments" / "part-0.parquet").num_rows


def test_forget_and_export_treat_session_ids_as_data(tmp_path):
    home = tmp_path / "home"
    cat = populated(home)
    before = {p for p in tmp_path.rglob("*")}
    n = export_sessions(cat, tmp_path / "out" / "evil.jsonl", [EVIL])
    assert n == 2
    lines = [json.loads(line) for line in (tmp_path / "out" / "evil.jsonl").read_text().splitlines()]
    assert [r["session_id"] for r in lines] == [EVIL, EVIL] and lines[0]["new_messages"] == user(f"{EVIL} says 0")
    assert forget_session(cat, EVIL).turns == 2
    with cat._connect() as con:  # the catalog's tables survived the id
        assert con.execute("SELECT count(*) FROM consumed").fetchall()[0][0] == 2
    created = {p for p in tmp_path.rglob("*")} - before
    assert all(str(p).startswith(str(tmp_path / "out")) or str(p).startswith(str(home)) for p in created)
    assert not list(tmp_path.parent.rglob("*escape*"))  # no path was ever built from the id
    assert {r["session_id"] for r in shard_rows(home / "shards")} == {"alice", "bob"}


def test_export_parquet_is_readable_by_any_parquet_reader(tmp_path):
    home = tmp_path / "home"
    cat = populated(home)
    assert export_sessions(cat, tmp_path / "bob.parquet", ["bob"]) == 3
    import duckdb
    import pandas as pd

    df = pd.read_parquet(tmp_path / "bob.parquet")
    assert df["turn_index"].tolist() == [0, 1, 2] and set(df["session_id"]) == {"bob"}
    assert duckdb.sql(f"SELECT count(*) FROM '{tmp_path / 'bob.parquet'}'").fetchall() == [(3,)]
    assert pq.read_schema(tmp_path / "bob.parquet").metadata[b"clawflow.schema_version"] == str(SCHEMA_VERSION).encode()
    with pytest.raises(ValueError, match="unknown export format"):
        export_sessions(cat, tmp_path / "x.csv", ["bob"], fmt="csv")


def test_cli_export_and_forget(config_file, tmp_path):
    cfg_path, home = config_file
    populated(home)
    runner = CliRunner()
    out = tmp_path / "alice.jsonl"
    res = runner.invoke(app, ["export", str(out), "--session", "alice", "--config", str(cfg_path)])
    assert res.exit_code == 0, res.output
    assert "exported 3 turns" in res.output and len(out.read_text().splitlines()) == 3

    res = runner.invoke(app, ["export", str(out), "--config", str(cfg_path)])
    assert res.exit_code == 2 and "--session" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["export", str(tmp_path / "a.txt"), "--all", "--format", "xml", "--config", str(cfg_path)])
    assert res.exit_code == 2 and res.output.count("\n") == 1 and "unknown export format" in res.output

    res = runner.invoke(app, ["forget", "alice", "--config", str(cfg_path)], input="n\n")
    assert res.exit_code == 1 and len(shard_rows(home / "shards")) == 8  # declined: nothing removed
    res = runner.invoke(app, ["forget", "alice", "--yes", "--config", str(cfg_path)])
    assert res.exit_code == 0, res.output
    assert "3 turns from 1 shards, 1 unsealed turns, 1 judgments" in res.output
    assert {r["session_id"] for r in shard_rows(home / "shards")} == {"bob", EVIL}
    assert [r.session_id for seg in (home / "wal").glob("*.jsonl") for r in read_segment(seg)[0]] == ["bob"]
