"""Catalog queries, as SQL with one job each, on the `turn_keys` index and the shards.

Pairing (turn t with its next state) joins main turns on (user, session, index + 1), taking the
first-created turn t + 1 when there are several; side traffic is never anyone's next state, and
neither is another user's turn that sent the same `X-Session-Id` (a session is the pair
(user, session_id); turns of shards older than schema v3 are user "default"). A
batch is chosen on the keys (oldest pending turns that have a next turn, then the token budget),
then the full rows of the chosen turns and of their next turns are read from the few shards
that hold them. Judgments (the judge's `judgments/*.parquet` under the storage root) join by turn id;
a missing directory means no judgments.

Outcome rewards (`env_rewards/*.parquet` under the storage root, written by environments after an
episode ends) join onto pairs and closed turns by (session_id, turn_index), and by response_text
when several rows share that key (the members of a sampled group); a turn without a row of its
own gets its episode's outcome, the session's row at its highest turn_index (OpenClaw-RL adds
the episode outcome to every step's PRM score). A reward in the turn record itself wins.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import duckdb

from clawflow.contracts.env_reward import COL as E
from clawflow.contracts.env_reward import env_reward_files
from clawflow.contracts.judgment import COL as J
from clawflow.contracts.judgment import judgment_files
from clawflow.contracts.pair import Pair
from clawflow.store.storage import Storage


class CatalogView(Protocol):
    """What these queries need of a `clawflow.store.catalog.Catalog` (structural, so queries.py
    does not import catalog.py, which imports it)."""

    storage: Storage

    def turns_from(self, con: duckdb.DuckDBPyConnection, only: list[str] | None = None
                   ) -> tuple[str, dict[str, Any]] | None: ...


_PENDING = """
WITH m AS (SELECT * FROM turn_keys WHERE turn_type = 'main'),
pending AS (SELECT * FROM m
            WHERE NOT EXISTS (SELECT 1 FROM consumed AS c WHERE c.turn_id = m.turn_id)
              AND NOT EXISTS (SELECT 1 FROM claims AS k WHERE k.turn_id = m.turn_id)),
pairs AS (SELECT * FROM {source} AS p
          WHERE EXISTS (SELECT 1 FROM m AS n WHERE n."user" = p."user" AND n.session_id = p.session_id
                                                 AND n.turn_index = p.turn_index + 1))
"""

_BATCH = _PENDING + """,
cand AS (SELECT * FROM pairs WHERE {where} ORDER BY created_at, turn_id LIMIT $max_turns),
b AS (SELECT *, sum(tokens) OVER w AS cum, row_number() OVER w AS rn FROM cand
      WINDOW w AS (ORDER BY created_at, turn_id ROWS UNBOUNDED PRECEDING)),
chosen AS (SELECT * FROM b WHERE {budget}),
nxt AS (SELECT n."user", n.session_id, n.turn_index - 1 AS prev_index,
               arg_min(n.turn_id, (n.created_at, n.turn_id)) AS next_id,
               arg_min(n.path, (n.created_at, n.turn_id)) AS next_path
        FROM m AS n SEMI JOIN chosen AS c
             ON n."user" = c."user" AND n.session_id = c.session_id AND n.turn_index = c.turn_index + 1
        GROUP BY n."user", n.session_id, n.turn_index)
SELECT c.turn_id, nxt.next_id, c.path, nxt.next_path FROM chosen AS c
JOIN nxt ON nxt."user" = c."user" AND nxt.session_id = c.session_id AND nxt.prev_index = c.turn_index
ORDER BY c.created_at, c.turn_id
"""


def _first_role(next_state: str | None) -> str | None:
    try:
        messages = json.loads(next_state) if next_state else None
        return messages[0].get("role") if messages else None
    except (ValueError, AttributeError, TypeError, KeyError):
        return None


def _rows(con: duckdb.DuckDBPyConnection, sql: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    cur = con.execute(sql, params)
    rows = cur.fetchall()
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row)) for row in rows]


def full_rows(cat: CatalogView, con: duckdb.DuckDBPyConnection, ids: list[str], paths: set[str]) -> dict[str, dict]:
    """Complete turn rows by id, read from the shards (relative paths) that hold them."""
    src = cat.turns_from(con, only=sorted(paths))
    if src is None or not ids:
        return {}
    turns, params = src
    rows = _rows(con, f"SELECT * FROM {turns} WHERE list_contains($ids, turn_id)", {**params, "ids": ids})
    return {r["turn_id"]: r for r in rows}


def batch(cat: CatalogView, con: duckdb.DuckDBPyConnection, max_turns: int, max_tokens: int | None = None,
          current_version: int | None = None, max_staleness: int | None = None,
          only_ids: list[str] | None = None, users: list[str] | None = None) -> list[Pair]:
    """Pending pairs oldest first (or exactly the turns `only_ids`, e.g. a run's claim); `users`:
    only those users' turns."""
    if max_turns <= 0:
        return []
    where, budget = ["true"], "true"
    params: dict[str, Any] = {"max_turns": max_turns}
    if users is not None:
        where.append('list_contains($users, "user")')
        params["users"] = users
    if only_ids is not None:
        where.append("list_contains($only, turn_id)")
        params["only"] = only_ids
    if current_version is not None and max_staleness is not None:
        where.append("$current - policy_version <= $staleness")
        params.update(current=current_version, staleness=max_staleness)
    if max_tokens is not None:
        budget = "cum <= $max_tokens OR rn = 1"
        params["max_tokens"] = max_tokens
    sql = _BATCH.format(source="m" if only_ids is not None else "pending", where=" AND ".join(where), budget=budget)
    keys = con.execute(sql, params).fetchall()
    if not keys:
        return []
    rows = full_rows(cat, con, [k[0] for k in keys] + [k[1] for k in keys], {k[2] for k in keys} | {k[3] for k in keys})
    pairs = []
    for turn_id, next_id, _, _ in keys:
        pair = dict(rows[turn_id])
        pair["next_state"] = rows[next_id]["new_messages"]
        pair["next_role"] = _first_role(pair["next_state"])
        pairs.append(pair)
    return [Pair.from_row(p) for p in attach_env_rewards(cat, con, pairs)]


def pending_users(con: duckdb.DuckDBPyConnection) -> dict[str, int]:
    """{user: pending pairs} of every user with turns waiting to be trained on."""
    sql = _PENDING.format(source="pending") + 'SELECT "user", count(*) FROM pairs GROUP BY "user" ORDER BY "user"'
    return {u: n for u, n in con.execute(sql).fetchall()}


def closed_without_next_state(cat: CatalogView, con: duckdb.DuckDBPyConnection, idle_s: float,
                              now: datetime) -> list[Pair]:
    sql = _PENDING.format(source="pending") + """
        SELECT p.turn_id, p.path FROM pending AS p
        WHERE NOT EXISTS (SELECT 1 FROM m AS n WHERE n."user" = p."user" AND n.session_id = p.session_id
                                                 AND n.turn_index = p.turn_index + 1)
          AND (p.session_done OR p.created_at < $idle_before)
        ORDER BY p.created_at, p.turn_id"""
    keys = con.execute(sql, {"idle_before": now - timedelta(seconds=idle_s)}).fetchall()
    rows = full_rows(cat, con, [k[0] for k in keys], {k[1] for k in keys})
    return [Pair.from_row({**r, "next_state": None})
            for r in attach_env_rewards(cat, con, [rows[k[0]] for k in keys])]


# The files' columns are named once, in the contract; the rest of the query uses these aliases.
_ENV_REWARDS = f"""
WITH r AS (SELECT {E.session_id} AS session_id, {E.turn_index} AS turn_index, {E.response_text} AS response_text,
                  arg_max({E.env_reward}, {E.created_at}) AS env_reward
           FROM read_parquet($env_files, union_by_name = true)
           WHERE list_contains($sessions, {E.session_id}) AND {E.env_reward} IS NOT NULL GROUP BY ALL),
k AS (SELECT session_id, turn_index, count(*) AS n, min(env_reward) AS only_reward FROM r GROUP BY ALL),
o AS (SELECT session_id, arg_max(env_reward, turn_index) AS outcome FROM r GROUP BY session_id),
t AS (SELECT unnest($ids) AS turn_id, unnest($sessions) AS session_id, unnest($idx) AS turn_index,
             unnest($texts) AS response_text)
SELECT t.turn_id, coalesce(x.env_reward, CASE WHEN k.n = 1 THEN k.only_reward END, o.outcome) AS env_reward
FROM t LEFT JOIN r AS x ON x.session_id = t.session_id AND x.turn_index = t.turn_index
                          AND x.response_text = t.response_text
       LEFT JOIN k ON k.session_id = t.session_id AND k.turn_index = t.turn_index
       LEFT JOIN o ON o.session_id = t.session_id
"""


def attach_env_rewards(cat: CatalogView, con: duckdb.DuckDBPyConnection,
                       rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Set each row's `env_reward` from the environments' outcome files (see the module doc),
    unless its turn record already carries one; rows are changed in place and returned."""
    files = env_reward_files(cat.storage)
    todo = [r for r in rows if r.get("env_reward") is None]
    if not files or not todo:
        return rows
    params = {"env_files": files, "ids": [r["turn_id"] for r in todo], "sessions": [r["session_id"] for r in todo],
              "idx": [int(r["turn_index"]) for r in todo], "texts": [r.get("response_text") or "" for r in todo]}
    found = dict(con.execute(_ENV_REWARDS, params).fetchall())
    for r in todo:
        r["env_reward"] = found.get(r["turn_id"])
    return rows


def judgments_from(root: Storage | Path, judge: str | None = None) -> tuple[str, dict[str, Any]]:
    """Latest judgment per turn (score), from the judge's Parquet files under the storage root
    (a Path: a local root); empty when there are none."""
    storage = root if isinstance(root, Storage) else Storage(root)
    files = [str(f) for f in judgment_files(storage)]
    if not files:
        return "(SELECT NULL::VARCHAR AS turn_id, NULL::TINYINT AS score WHERE false)", {}
    where = f"WHERE {J.judge} = $judge" if judge else ""
    sql = (f"(SELECT {J.turn_id} AS turn_id, arg_max({J.score}, {J.created_at}) AS score "
           f"FROM read_parquet($judgment_files, union_by_name = true) {where} GROUP BY {J.turn_id})")
    return sql, {"judgment_files": files, **({"judge": judge} if judge else {})}


def version_stats(cat: CatalogView, con: duckdb.DuckDBPyConnection, judge: str | None) -> list[dict[str, Any]]:
    judged, params = judgments_from(cat.storage, judge)
    sql = f"""
        SELECT t.policy_version, count(*) AS turns, count(*) FILTER (WHERE t.turn_type = 'main') AS main_turns,
               count(j.score) AS judged, avg(j.score)::DOUBLE AS mean_reward, count(c.turn_id) AS consumed,
               sum(t.tokens)::BIGINT AS tokens
        FROM turn_keys AS t LEFT JOIN {judged} AS j USING (turn_id) LEFT JOIN consumed AS c USING (turn_id)
        GROUP BY t.policy_version ORDER BY t.policy_version"""
    return _rows(con, sql, params)


def stats(cat: CatalogView, con: duckdb.DuckDBPyConnection) -> dict[str, Any]:
    consumed = con.execute("SELECT count(*) FROM consumed").fetchall()[0][0]
    claimed = con.execute("SELECT count(*) FROM claims").fetchall()[0][0]
    shards = con.execute("SELECT count(*) FROM shards").fetchall()[0][0]
    turns = con.execute("SELECT count(*) FROM turn_keys").fetchall()[0][0]
    pending = con.execute(_PENDING.format(source="pending") + "SELECT count(*) FROM pairs").fetchall()[0][0]
    last = _rows(con, "SELECT * FROM runs ORDER BY finished_at DESC LIMIT 1", {})
    return {"shards": shards, "turns": turns, "consumed": consumed, "claimed": claimed,
            "pending": pending, "last_run": last[0] if last else None}
