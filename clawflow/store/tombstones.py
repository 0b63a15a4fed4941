"""Tombstones of forgotten sessions, so turns still in the WAL never reach a shard.

`clawflow forget` removes a session from every shard, but turns of that session may still sit in
an unsealed segment (the gateway's active one cannot be rewritten). The sealer drops a session's
turns created before its forget time. Only a SHA-256 of the session id is kept: the list of
forgotten sessions must not itself be a list of users.
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


def load_tombstones(home: Path) -> dict[str, datetime]:
    """session hash -> forget time (the latest when forgotten twice)."""
    path = Path(home) / FILE
    if not path.exists():
        return {}
    out: dict[str, datetime] = {}
    for line in path.read_text().splitlines():
        try:
            item = json.loads(line)
            at = datetime.fromisoformat(item["before"])
            key = item["session_sha256"]
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line from a crash mid-append
        out[key] = max(at, out.get(key, at))
    return out


def forgotten(tombstones: dict[str, datetime], session_id: str, created_at: datetime) -> bool:
    at = tombstones.get(session_hash(session_id)) if tombstones else None
    return at is not None and created_at <= at
