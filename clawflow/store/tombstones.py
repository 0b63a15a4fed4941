"""Tombstones of forgotten sessions (and users), so turns still in the WAL never reach a shard.

`clawflow forget` removes a session from every shard, but turns of that session may still sit in
an unsealed segment (the gateway's active one cannot be rewritten). The sealer drops a session's
turns created before its forget time. Only a SHA-256 of the session id is kept: the list of
forgotten sessions must not itself be a list of users. A forgotten user (`clawflow forget --user`)
is kept the same way, as the SHA-256 of their name, and drops every turn of theirs.
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import UTC, datetime
from pathlib import Path

from clawflow.home import Home
from clawflow.store.wal import fsync_dir

FILE = Home.TOMBSTONES


def session_hash(session_id: str) -> str:
    return hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()


def add_tombstone(home: Path, session_id: str, at: datetime | None = None) -> None:
    """Durably record that `session_id`'s turns created up to `at` (now) are forgotten."""
    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"session_sha256": session_hash(session_id),
                       "before": (at or datetime.now(UTC)).isoformat()}) + "\n"
    with open(home / FILE, "ab") as f:
        f.write(line.encode())
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(home)


def _user_key(user: str) -> str:
    return "user:" + hashlib.sha256(user.encode("utf-8", "surrogatepass")).hexdigest()


def add_user_tombstone(home: Path, user: str, at: datetime | None = None) -> None:
    """Durably record that every turn of `user` created up to `at` (now) is forgotten."""
    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"user_sha256": _user_key(user)[5:], "before": (at or datetime.now(UTC)).isoformat()}) + "\n"
    with open(home / FILE, "ab") as f:
        f.write(line.encode())
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(home)


def load_tombstones(home: Path) -> dict[str, datetime]:
    """session hash (or "user:" + user hash) -> forget time (the latest when forgotten twice)."""
    path = Path(home) / FILE
    if not path.exists():
        return {}
    out: dict[str, datetime] = {}
    for line in path.read_text().splitlines():
        try:
            item = json.loads(line)
            at = datetime.fromisoformat(item["before"])
            key = item["session_sha256"] if "session_sha256" in item else "user:" + item["user_sha256"]
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line from a crash mid-append
        out[key] = max(at, out.get(key, at))
    return out


def forgotten(tombstones: dict[str, datetime], session_id: str, created_at: datetime, user: str | None = None) -> bool:
    """Whether a turn of `session_id` (sent by `user`) created at `created_at` was forgotten."""
    if not tombstones:
        return False
    at = tombstones.get(session_hash(session_id))
    if at is not None and created_at <= at:
        return True
    at = tombstones.get(_user_key(user)) if user is not None else None
    return at is not None and created_at <= at
