"""Catalog queries on real shards: batches (budget, staleness, claims), exactly-once across
retried runs, closed sessions, per-version stats with the judge's Parquet files."""

from __future__ import annotations

import json
import shutil
from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_store import T0, turn, user

from clawflow.store.catalog import Catalog
from clawflow.store.sealer import Sealer
from clawflow.store.wal import SegmentWriter
from _store_helpers import pending_pairs

V2_SHARD = Path(__file__).parent / "data" / "shard_v2.parquet"  # written by the schema-v2 sealer (no `user`)

JUDGMENT_SCHEMA = pa.schema([
    ("turn_id", pa.string()), ("session_id", pa.string()), ("judge", pa.string()),
    ("judge_version", pa.string()), ("prompt_version", pa.string()), ("score", pa.int8()),
    ("votes", pa.list_(pa.int8())), ("rationale", pa.string()), ("hint", pa.string()),
    ("created_at", pa.timestamp("us", tz="UTC")),
])


@pytest.fixture(autouse=True)
def _no_prefect(monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)


def seal(home: Path, *segments: list) -> None:
    """Each list of records becomes one shard."""
    writer = SegmentWriter(home / "wal", fsync=False)
    for records in segments:
        for rec in records:
            writer.append(rec)
        writer.rotate()
    Sealer(writer, home / "shards", interval_s=1).seal_all()


def conversation(session: str, n: int, start: float = 0.0, pv: int = 3) -> list:
    recs = []
    for i in range(n):
        rec = turn(session, i, new=user(f"{session} says {i}"), at=T0 + timedelta(seconds=start + i))
        rec.policy_version = pv
        recs.append(rec)
    return recs


def ids(pairs: list[dict]) -> list[str]:
    return [p.turn_id for p in pairs]


@pytest.fixture
def store(tmp_path):
    home = tmp_path / "home"
    a, b, c = conversation("a", 4, 0), conversation("b", 4, 0.25), conversation("c", 4, 0.5)
    seal(home, a[:2] + b[:2] + c[:2], a[2:] + b[2:] + c[2:])  # t + 1 is often in the next shard
    return home, Catalog(home / "catalog.duckdb", home / "shards"), a + b + c


def test_retried_run_never_consumes_a_turn_twice_nor_skips_one(store):
    home, cat, recs = store
    pairable = {r.turn_id for r in recs if r.turn_index < 3}  # 9 turns have a next state
    first = cat.select_batch("flow-A", max_turns=4)
    assert len(first) == 4
    assert ids(cat.select_batch("flow-A", max_turns=4)) == ids(first)  # flow A retried: same batch
    assert ids(cat.select_batch("flow-A", max_turns=99)) == ids(first)  # even with other limits
    other = cat.select_batch("flow-B", max_turns=4)
    assert len(other) == 4 and not set(ids(other)) & set(ids(first))  # claimed turns are A's
    assert cat.stats()["claimed"] == 8 and cat.stats()["pending"] == 1

    # A registers its version, then commits; the commit task is retried
    assert cat.commit_consumed(ids(first), "mlflow-a", 1) == 4
    assert cat.commit_consumed(ids(first), "mlflow-a", 1) == 0
    assert cat.select_batch("flow-A", max_turns=4) != first  # A's claim is gone with the commit

    # B fails for good: its batch goes back, C takes it and what is left
    cat.release("flow-A")
    assert cat.release("flow-B") == 4
    rest = cat.select_batch("flow-C", max_turns=99)
    assert set(ids(rest)) == pairable - set(ids(first))
    assert cat.commit_consumed(ids(rest), "mlflow-c", 2) == 5
    assert cat.select_batch("flow-D", max_turns=99) == []

    with cat._connect() as con:
        rows = con.execute("SELECT turn_id, run_id FROM consumed").fetchall()
        assert con.execute("SELECT count(*) FROM claims").fetchall()[0][0] == 0
    assert sorted(r[0] for r in rows) == sorted(pairable)  # each pairable turn once, none skipped
    assert {r[1] for r in rows} == {"mlflow-a", "mlflow-c"}


def test_abandoned_claims_expire(tmp_path, store):
    home, _, _ = store
    cat = Catalog(home / "catalog.duckdb", home / "shards", claim_ttl_s=3600)
    crashed = ids(cat.select_batch("flow-crashed", max_turns=3))
    assert set(ids(cat.select_batch("flow-next", max_turns=99))).isdisjoint(crashed)
    cat.release("flow-next")
    with cat._connect() as con:  # the crashed run's claim is now older than the TTL
        con.execute("UPDATE claims SET claimed_at = claimed_at - INTERVAL 2 HOUR").fetchall()
    assert set(crashed) <= set(ids(cat.select_batch("flow-later", max_turns=99)))


def test_batch_by_token_budget_oldest_first(store):
    _, cat, recs = store
    everything = pending_pairs(cat, 99)
    assert [p.created_at for p in everything] == sorted(p.created_at for p in everything)
    assert everything[0].prompt_tokens + everything[0].response_tokens == 5
    assert ids(cat.select_batch("r1", max_turns=99, max_tokens=12)) == ids(everything[:2])
    assert ids(cat.select_batch("r2", max_turns=99, max_tokens=3)) == ids(everything[2:3])  # first always fits
    pair = cat.select_batch("r3", max_turns=1)[0]
    assert pair.next_role == "user" and pair.next_state.startswith('[{"role": "user"')


def test_batch_skips_turns_beyond_max_staleness(tmp_path):
    home = tmp_path / "home"
    seal(home, conversation("old", 3, 0, pv=1) + conversation("new", 3, 10, pv=4))
    cat = Catalog(home / "catalog.duckdb", home / "shards")
    fresh = cat.select_batch("r", max_turns=99, current_version=5, max_staleness=1)
    assert {p.session_id for p in fresh} == {"new"} and len(fresh) == 2
    assert len(cat.select_batch("r2", max_turns=99, current_version=5, max_staleness=None)) == 2  # old ones


def test_closed_sessions_without_next_state(tmp_path):
    home = tmp_path / "home"
    done = conversation("done", 2)
    done[-1].session_done = True
    idle = conversation("idle", 2, start=1)
    seal(home, done + idle)
    cat = Catalog(home / "catalog.duckdb", home / "shards")
    closed = cat.closed_without_next_state(idle_s=3600, now=T0 + timedelta(minutes=5))
    assert [(t.session_id, t.turn_index) for t in closed] == [("done", 1)]
    later = cat.closed_without_next_state(idle_s=3600, now=T0 + timedelta(hours=2))
    assert [(t.session_id, t.turn_index) for t in later] == [("done", 1), ("idle", 1)]
    assert later[0].response_token_ids == [4, 5]
    cat.commit_consumed([later[0].turn_id], "outcome-run", 3)
    assert len(cat.closed_without_next_state(idle_s=3600, now=T0 + timedelta(hours=2))) == 1


def of_user(name: str, recs: list) -> list:
    for r in recs:
        r.user = name
    return recs


def test_users_sharing_a_session_id_are_never_paired(tmp_path):
    """Two users' clients sent the same X-Session-Id: each user's turn t pairs with their own t + 1,
    even when the other user's t + 1 was recorded first; the user travels WAL -> shard -> Pair."""
    home = tmp_path / "home"
    bob = of_user("bob", conversation("s", 2, start=0))  # bob's turn 1 is the first-created turn 1 of "s"
    alice = of_user("alice", conversation("s", 3, start=0.5))
    seal(home, bob + alice)
    cat = Catalog(home / "catalog.duckdb", home / "shards")
    by_id = {r.turn_id: r for r in bob + alice}

    batch = cat.select_batch("run", max_turns=99)
    assert [(p.user, p.turn_index) for p in batch] == [("bob", 0), ("alice", 0), ("alice", 1)]
    for p in batch:  # the next state is the same user's next turn
        nxt = next(r for r in bob + alice if r.user == p.user and r.turn_index == p.turn_index + 1)
        assert json.loads(p.next_state) == nxt.new_messages and p.user == by_id[p.turn_id].user
    assert cat.stats()["pending"] == 0  # bob's last turn has no next state: alice's turn 2 is not his

    closed = cat.closed_without_next_state(idle_s=60, now=T0 + timedelta(hours=1))
    assert [(t.user, t.turn_index) for t in closed] == [("bob", 1), ("alice", 2)]


def test_each_users_batch_holds_only_their_turns_under_their_own_claim(tmp_path):
    """train-on-new-feedback trains one user's line after another in one flow run: each user's batch
    is theirs alone, claimed under its own id, and the others' turns stay pending for their turn."""
    home = tmp_path / "home"
    seal(home, of_user("bob", conversation("b", 3, start=0)) + of_user("alice", conversation("a", 4, start=0.5))
         + conversation("d", 2, start=1.0))
    cat = Catalog(home / "catalog.duckdb", home / "shards")
    assert cat.pending_users() == {"alice": 3, "bob": 2, "default": 1}
    alice = cat.select_batch("run:alice", max_turns=99, users=["alice"])
    assert {p.user for p in alice} == {"alice"} and len(alice) == 3
    assert cat.pending_users() == {"bob": 2, "default": 1}  # alice's are claimed
    bob = cat.select_batch("run:bob", max_turns=99, users=["bob"])
    assert {p.user for p in bob} == {"bob"} and len(bob) == 2
    assert ids(cat.select_batch("run:alice", max_turns=99, users=["alice"])) == ids(alice)  # a retry: the same
    cat.commit_consumed([p.turn_id for p in alice], "run:alice", 1)
    assert cat.release("run:bob") == 2 and cat.pending_users() == {"bob": 2, "default": 1}


def test_catalog_made_before_users_keeps_working(tmp_path):
    """A catalog file whose `turn_keys` predates the `user` column (built from shards of schema v2)
    gains it on open, its turns the default user's, and then registers shards with users."""
    home = tmp_path / "home"
    (home / "shards").mkdir(parents=True)
    shutil.copy(V2_SHARD, home / "shards" / "old.parquet")  # sessions v2-a, v2-b: two turns each
    cat = Catalog(home / "catalog.duckdb", home / "shards")
    assert cat.stats()["turns"] == 4
    with cat._connect() as con:  # the layout of a catalog written before schema v3
        con.execute('ALTER TABLE turn_keys DROP COLUMN "user"').fetchall()
        assert "user" not in [c[0] for c in con.execute("DESCRIBE turn_keys").fetchall()]

    cat = Catalog(home / "catalog.duckdb", home / "shards")  # reopened by this version
    with cat._connect() as con:
        assert con.execute('SELECT "user", count(*) FROM turn_keys GROUP BY ALL').fetchall() == [("default", 4)]
    seal(home, of_user("carol", conversation("v2-a", 2, start=5)))  # carol reuses a session id
    pairs = pending_pairs(cat, 99)
    assert [(p.session_id, p.turn_index, p.user) for p in pairs] == [
        ("v2-a", 0, "default"), ("v2-b", 0, "default"), ("v2-a", 0, "carol")]
    assert json.loads(pairs[2].next_state) == user("v2-a says 1")
    with cat._connect() as con:
        assert sorted(con.execute('SELECT "user", count(*) FROM turn_keys GROUP BY ALL').fetchall()) == [
            ("carol", 2), ("default", 4)]


def write_judgments(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    full = [{"session_id": "x", "judge_version": "1", "prompt_version": "p1", "votes": [r["score"]],
             "rationale": "r", "hint": None, **r} for r in rows]
    pq.write_table(pa.Table.from_pylist(full, schema=JUDGMENT_SCHEMA), path)


def test_version_stats_join_judgments(tmp_path):
    home = tmp_path / "home"
    seal(home, conversation("a", 3, pv=1) + conversation("b", 2, pv=2))
    cat = Catalog(home / "catalog.duckdb", home / "shards")
    no_judge = cat.version_stats()  # no judgments directory at all
    assert [(s["policy_version"], s["turns"], s["judged"], s["mean_reward"]) for s in no_judge] == [
        (1, 3, 0, None), (2, 2, 0, None)]
    assert no_judge[0]["tokens"] == 15

    pairs = {(p.session_id, p.turn_index): p.turn_id for p in pending_pairs(cat, 99)}
    write_judgments(home / "judgments" / "j1.parquet", [
        {"turn_id": pairs["a", 0], "judge": "rules", "score": -1, "created_at": T0},
        {"turn_id": pairs["a", 0], "judge": "rules", "score": 1, "created_at": T0 + timedelta(hours=1)},  # newer
        {"turn_id": pairs["a", 1], "judge": "llm", "score": -1, "created_at": T0},
    ])
    write_judgments(home / "judgments" / "j2.parquet", [
        {"turn_id": pairs["b", 0], "judge": "rules", "score": 1, "created_at": T0}])
    cat.commit_consumed([pairs["a", 0]], "run", 2)
    stats = {s["policy_version"]: s for s in cat.version_stats()}
    assert (stats[1]["judged"], stats[1]["mean_reward"], stats[1]["consumed"]) == (2, 0.0, 1)
    assert (stats[2]["judged"], stats[2]["mean_reward"]) == (1, 1.0)
    only_rules = {s["policy_version"]: s for s in cat.version_stats(judge="rules")}
    assert (only_rules[1]["judged"], only_rules[1]["mean_reward"]) == (1, 1.0)
