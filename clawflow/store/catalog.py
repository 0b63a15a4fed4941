"""The catalog: DuckDB over the Parquet shards, plus which turns each training run consumed.

One DuckDB file, written by one process at a time (the training flow, or a maintenance command):
`shards` (every shard validated and registered: rows, bytes, time range, schema version),
`turn_keys` (the small columns of every registered turn: ids, user, times, versions, token
counts, its shard), `claims` (the batch a run is training on) and `consumed`/`runs` (what each
registered version trained on). Batch selection, pairing and stats run on `turn_keys`, so they
do not rescan every shard; full rows are read from the few shards that hold the chosen turns,
each schema version through its upgrade projection, so old shards stay readable. A shard is
registered (and its keys loaded) only after `inspect_shard` read it fully; a bad one goes to
quarantine and is never read.

Exactly-once: `select_batch` claims its turns under the run's id (a retry of that run gets the
same batch back; other runs skip claimed turns) and `commit_consumed` turns the claim into
consumption in one transaction, called once the version is registered. A connection lives for
one call: other processes need the file lock in between.

The shards may live in an object store (`store.root: s3://…`, storage.py): the catalog file stays
local to the one orchestrator that writes it, lists the shards there, verifies each object's
checksum as it registers it, and reads rows through DuckDB with the store's fsspec filesystem.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from clawflow.contracts.pair import Pair
from clawflow.home import Home
from clawflow.store import journal, queries
from clawflow.store.locks import store_lock
from clawflow.store.metrics import STORE
from clawflow.contracts.turn import DEFAULT_USER, sql_columns
from clawflow.store.shards import CorruptShard, FutureShard, inspect_shard, quarantine, shard_bytes, shard_files
from clawflow.store.storage import ChecksumMismatch, Storage
from clawflow.store.tombstones import forgotten, load_tombstones

log = logging.getLogger("clawflow.store.catalog")

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS consumed (
    turn_id VARCHAR PRIMARY KEY, run_id VARCHAR, policy_version BIGINT, consumed_at TIMESTAMPTZ);
CREATE TABLE IF NOT EXISTS runs (
    run_id VARCHAR PRIMARY KEY, policy_version BIGINT, turns INTEGER, finished_at TIMESTAMPTZ);
CREATE TABLE IF NOT EXISTS shards (
    path VARCHAR PRIMARY KEY, rows BIGINT, bytes BIGINT, first_at TIMESTAMPTZ, last_at TIMESTAMPTZ,
    schema_version INTEGER, mtime DOUBLE, registered_at TIMESTAMPTZ);
CREATE TABLE IF NOT EXISTS claims (turn_id VARCHAR PRIMARY KEY, claim_id VARCHAR, claimed_at TIMESTAMPTZ);
CREATE TABLE IF NOT EXISTS turn_keys (
    turn_id VARCHAR, session_id VARCHAR, turn_index INTEGER, turn_type VARCHAR, created_at TIMESTAMPTZ,
    policy_version BIGINT, session_done BOOLEAN, tokens INTEGER, path VARCHAR, "user" VARCHAR);
-- a catalog made before turn schema v3 held only older shards, whose turns are all the default user's
ALTER TABLE turn_keys ADD COLUMN IF NOT EXISTS "user" VARCHAR DEFAULT '{DEFAULT_USER}';
"""
_KEY_COLUMNS = ("turn_id", "session_id", "turn_index", "turn_type", "created_at", "policy_version", "session_done",
                "user")


class Catalog:
    def __init__(self, db_path: Path, shards_dir: Path | str, lock_timeout_s: float = 30.0, *,
                 home: Path | None = None, claim_ttl_s: float = 8 * 3600, storage: Storage | None = None):
        self.db_path = Path(db_path)
        # the storage root: judgments/ and env_rewards/ beside shards/ (a local dir by default)
        self.storage = storage if storage is not None else Storage(Path(shards_dir).parent)
        self.shards_dir = shards_dir if self.storage.remote else Path(shards_dir)
        self.home = Path(home) if home is not None else Path(self.storage.root) if not self.storage.remote else None
        if self.home is None:
            raise ValueError("a catalog over an object store needs its local home (locks, journal)")
        self.lock_timeout_s = lock_timeout_s
        self.claim_ttl_s = claim_ttl_s
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as con:
            con.execute(_SCHEMA).fetchall()

    @classmethod
    def for_config(cls, cfg) -> "Catalog":
        storage = Storage.for_config(cfg)
        return cls(Home(cfg.home).catalog, storage.join(Home.SHARDS), home=cfg.home,
                   claim_ttl_s=cfg.store.claim_ttl_s, storage=storage)

    # -- connections and shard registration ------------------------------------------------
    @contextmanager
    def _connect(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A short-lived connection; waits while another process holds the file lock."""
        deadline = time.monotonic() + self.lock_timeout_s
        while True:
            try:
                con = duckdb.connect(str(self.db_path))
                break
            except duckdb.IOException as exc:
                if "lock" not in str(exc).lower() or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        try:
            con.execute("SET TimeZone = 'UTC'").fetchall()
            self.storage.attach(con)
            yield con
        finally:
            con.close()

    @contextmanager
    def connect(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A connection on a catalog whose `shards` table matches the files on disk."""
        with self._connect() as con:
            self._sync(con)
            yield con

    def sync(self) -> dict[str, int]:
        """Register new shards (quarantining bad ones), forget vanished ones; the counts."""
        with self._connect() as con:
            return self._sync(con)

    def _sync(self, con: duckdb.DuckDBPyConnection) -> dict[str, int]:
        counts = {"registered": 0, "quarantined": 0, "removed": 0}
        with store_lock(self.home):
            journal.recover(self.home, self.storage)
            known = {p: (m, b) for p, m, b in con.execute("SELECT path, mtime, bytes FROM shards").fetchall()}
            if self.storage.remote:
                on_disk = {e.rel: (e.path, e.mtime, e.size) for e in self.storage.list(Home.SHARDS)}
            else:
                on_disk = {}
                for path in shard_files(self.shards_dir):
                    with suppress(FileNotFoundError):
                        st = path.stat()
                        on_disk[self.rel(path)] = (path, st.st_mtime, st.st_size)
            gone = sorted(known.keys() - on_disk.keys())
            if gone:
                log.warning("%d shards disappeared from disk; unregistered: %s", len(gone), gone[:5])
                self.unregister(con, gone)
                counts["removed"] += len(gone)
            for rel, (path, mtime, size) in sorted(on_disk.items()):
                if known.get(rel) == (mtime, size):
                    continue
                try:
                    if not self.storage.remote:
                        self.register(con, path, mtime)
                    elif (found := self._without_forgotten(path, *self._inspect(path), mtime)) is not None:
                        self.register(con, path, found[2], found[:2])
                    else:  # every turn in it was forgotten: the object is gone
                        self.unregister(con, [rel])
                        continue
                except FutureShard as exc:
                    log.warning("skipping %s", exc)
                    continue
                except CorruptShard as exc:
                    self._quarantine(path, rel, str(exc))
                    self.unregister(con, [rel])
                    counts["quarantined"] += 1
                    continue
                counts["registered"] += 1
        return counts

    def register(self, con: duckdb.DuckDBPyConnection, path: Path | str, listed_mtime: float | None = None,
                 inspected: tuple | None = None) -> None:
        """Validate the shard at `path` (CorruptShard, FutureShard) and (re)load its keys;
        `listed_mtime`: its modification time as listed (an object's, which the bytes lack);
        `inspected`: `inspect_shard`'s answer when the caller already has it."""
        info, table = inspected if inspected is not None else self._inspect(path)
        rel = self.rel(path)
        keys = table.select(list(_KEY_COLUMNS)).append_column(
            "tokens", pc.add(table["prompt_tokens"], table["response_tokens"]))
        con.execute("BEGIN TRANSACTION").fetchall()
        try:
            con.execute("DELETE FROM turn_keys WHERE path = $p", {"p": rel}).fetchall()
            con.register("_new_keys", keys)
            con.execute("INSERT INTO turn_keys BY NAME SELECT *, $p AS path FROM _new_keys", {"p": rel}).fetchall()
            con.unregister("_new_keys")
            con.execute(
                "INSERT OR REPLACE INTO shards VALUES ($p, $rows, $bytes, $first, $last, $v, $mtime, now())",
                {"p": rel, "rows": info.rows, "bytes": info.bytes, "first": info.first_at, "last": info.last_at,
                 "v": info.schema_version, "mtime": info.mtime if listed_mtime is None else listed_mtime},
            ).fetchall()
            con.execute("COMMIT").fetchall()
        except BaseException:
            with suppress(duckdb.Error):
                con.execute("ROLLBACK").fetchall()
            raise

    def unregister(self, con: duckdb.DuckDBPyConnection, rels: list[str]) -> None:
        con.execute("DELETE FROM turn_keys WHERE list_contains($p, path)", {"p": rels}).fetchall()
        con.execute("DELETE FROM shards WHERE list_contains($p, path)", {"p": rels}).fetchall()

    def rel(self, path: Path | str) -> str:
        if self.storage.remote:
            return str(path).removeprefix(f"{self.shards_dir}/")
        return str(Path(path).relative_to(self.shards_dir))

    def shard_path(self, rel: str) -> Path | str:
        return self.storage.join(Home.SHARDS, rel) if self.storage.remote else self.shards_dir / rel

    def _inspect(self, path: Path | str):
        if not self.storage.remote:
            return inspect_shard(path)
        try:  # the whole object, checked against the checksum it was uploaded with
            data = self.storage.read_bytes(path)
        except ChecksumMismatch as exc:
            raise CorruptShard(str(exc)) from exc
        except FileNotFoundError as exc:
            raise CorruptShard(f"vanished while being read: {exc}") from exc
        return inspect_shard(path, data=pa.py_buffer(data))

    def _without_forgotten(self, path: str, info, table, mtime: float) -> tuple | None:
        """An object-store shard that arrived after a `forget` (sealed on a gateway host before it
        heard of it, uploaded later) loses the forgotten sessions' turns before it is registered:
        (info, table, mtime) of what remains, or None when nothing did (the object is deleted).
        On a local root the sealer, in the same home, already dropped them."""
        tombstones = load_tombstones(self.home)
        if not tombstones or not table.num_rows:
            return info, table, mtime
        users = table["user"].to_pylist() if "user" in table.column_names else [None] * table.num_rows
        gone = [forgotten(tombstones, s, at, u) for s, at, u in
                zip(table["session_id"].to_pylist(), table["created_at"].to_pylist(), users)]
        if not any(gone):
            return info, table, mtime
        kept = table.filter(pa.array([not g for g in gone]))
        log.info("dropped %d turns of forgotten sessions from %s", len(gone) - kept.num_rows, path)
        if not kept.num_rows:
            self.storage.delete(path)
            return None
        self.storage.replace_bytes(shard_bytes(kept), path)
        return *self._inspect(path), self.storage.mtime(path)

    def _quarantine(self, path: Path | str, rel: str, reason: str) -> None:
        if not self.storage.remote:
            quarantine(path, self.home, reason)
            return
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
        name = f"{Home.QUARANTINE}/{stamp}-{rel.replace('/', '__')}"
        target = self.storage.move(path, name)
        self.storage.put_bytes(json.dumps({"original": str(path), "reason": reason,
                                           "quarantined_at": datetime.now(UTC).isoformat()}).encode(),
                               f"{name}.reason.json")
        STORE.add(shards_quarantined=1)
        log.error("quarantined corrupt shard %s -> %s: %s", path, target, reason)

    def turns_from(self, con: duckdb.DuckDBPyConnection, only: list[str] | None = None
                   ) -> tuple[str, dict[str, Any]] | None:
        """A FROM item reading full rows of registered shards (all, or the relative paths `only`)
        in the current schema, and its parameters; None when there is nothing to read."""
        rows = con.execute("SELECT path, schema_version FROM shards ORDER BY path").fetchall()
        wanted = set(only) if only is not None else None
        by_version: dict[int, list[str]] = defaultdict(list)
        for rel, version in rows:
            if wanted is None or rel in wanted:
                by_version[version].append(str(self.shard_path(rel)))
        if not by_version:
            return None
        parts = [f"SELECT {sql_columns(v)} FROM read_parquet($files_v{v})" for v in sorted(by_version)]
        params = {f"files_v{v}": files for v, files in by_version.items()}
        return "(" + " UNION ALL BY NAME ".join(parts) + ")", params

    # -- queries (see queries.py) ------------------------------------------------------------
    def select_batch(self, claim_id: str, max_turns: int, max_tokens: int | None = None,
                     current_version: int | None = None, max_staleness: int | None = None,
                     users: list[str] | None = None) -> list[Pair]:
        """The training batch of run `claim_id`: oldest pending pairs first, at most `max_turns`
        and `max_tokens` (prompt + response; the first pair always fits), skipping turns more than
        `max_staleness` policy versions behind `current_version`; `users`: only their turns.
        Claimed for `claim_id`; a retry with the same id returns the same batch while it is not
        committed or released."""
        with self.connect() as con:
            con.execute("BEGIN TRANSACTION").fetchall()
            try:
                con.execute("DELETE FROM claims WHERE claim_id <> $me AND claimed_at < now() - to_seconds($ttl)",
                            {"me": claim_id, "ttl": float(self.claim_ttl_s)}).fetchall()
                mine = [r[0] for r in con.execute("SELECT turn_id FROM claims WHERE claim_id = $me",
                                                  {"me": claim_id}).fetchall()]
                if mine:
                    pairs = queries.batch(self, con, max_turns=len(mine), only_ids=mine)
                else:
                    pairs = queries.batch(self, con, max_turns=max_turns, max_tokens=max_tokens,
                                          current_version=current_version, max_staleness=max_staleness,
                                          users=users)
                    con.execute("INSERT INTO claims SELECT id, $me, now() FROM unnest($ids::VARCHAR[]) AS u(id)",
                                {"me": claim_id, "ids": [p.turn_id for p in pairs]}).fetchall()
                con.execute("COMMIT").fetchall()
            except BaseException:
                with suppress(duckdb.Error):
                    con.execute("ROLLBACK").fetchall()
                raise
        return pairs

    def pending_users(self) -> dict[str, int]:
        """{user: turns with a next state waiting to be trained on}, for every user who has some."""
        with self.connect() as con:
            return queries.pending_users(con)

    def release(self, claim_id: str) -> int:
        """Give back a batch that will not be committed (the run gave up); how many turns."""
        with self._connect() as con:
            return con.execute("DELETE FROM claims WHERE claim_id = $me RETURNING turn_id",
                               {"me": claim_id}).fetchall().__len__()

    def closed_without_next_state(self, idle_s: float = 3600.0, now: datetime | None = None) -> list[Pair]:
        """Unconsumed main turns that ended their session (X-Session-Done, or idle for `idle_s`)
        with no next state: judged on the outcome (env_reward) alone, if at all."""
        with self.connect() as con:
            return queries.closed_without_next_state(self, con, idle_s, now or datetime.now(UTC))

    def version_stats(self, judge: str | None = None) -> list[dict[str, Any]]:
        """Per policy version: turns, main turns, judged, mean reward (latest judgment), consumed."""
        with self.connect() as con:
            return queries.version_stats(self, con, judge)

    # -- consumption -------------------------------------------------------------------------
    def commit_consumed(self, turn_ids: list[str], run_id: str, policy_version: int) -> int:
        """Record `turn_ids` as consumed by `run_id` and drop their claims (one transaction); how many were new."""
        ids = list(dict.fromkeys(turn_ids))
        with self._connect() as con:
            con.execute("BEGIN TRANSACTION").fetchall()
            try:
                theirs = con.execute(
                    "SELECT count(*) FROM consumed WHERE run_id <> $run AND list_contains($ids, turn_id)",
                    {"run": run_id, "ids": ids}).fetchall()[0][0]
                if theirs:
                    log.warning("%d of run %s's turns were already consumed by another run", theirs, run_id)
                before = con.execute("SELECT count(*) FROM consumed").fetchall()[0][0]
                con.execute(
                    "INSERT INTO consumed SELECT id, $run, $pv, now() FROM unnest($ids::VARCHAR[]) AS u(id) "
                    "ON CONFLICT DO NOTHING",
                    {"ids": ids, "run": run_id, "pv": policy_version},
                ).fetchall()
                new = con.execute("SELECT count(*) FROM consumed").fetchall()[0][0] - before
                con.execute("DELETE FROM claims WHERE list_contains($ids, turn_id)", {"ids": ids}).fetchall()
                con.execute(
                    "INSERT INTO runs VALUES ($run, $pv, $n, now()) "
                    "ON CONFLICT (run_id) DO UPDATE SET turns = runs.turns + excluded.turns",
                    {"run": run_id, "pv": policy_version, "n": new},
                ).fetchall()
                con.execute("COMMIT").fetchall()
            except BaseException:
                with suppress(duckdb.Error):  # a failed COMMIT has already rolled back
                    con.execute("ROLLBACK").fetchall()
                raise
        return new

    def stats(self) -> dict[str, Any]:
        """Counts for dashboards and the CLI: shards, turns, consumed, claimed, pending pairs, last run."""
        with self.connect() as con:
            return queries.stats(self, con)
