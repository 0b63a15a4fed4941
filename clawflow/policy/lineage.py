"""Lineage of a registered version: its parent, the shards its batch came from, how many turns.

MLflow tag values are bounded (5000 characters on older servers), so the shard list is a tag
only while it fits; past that the tag holds the count and a hash, and the full list (with the
turn ids) is always in the run's `lineage.json` artifact.
"""

from __future__ import annotations

import hashlib
from pathlib import PurePath

from clawflow.store.catalog import Catalog

MAX_TAG_CHARS = 5000


def shards_of(catalog: Catalog, turn_ids: list[str]) -> list[str]:
    """The shard files (relative to the shards dir) holding `turn_ids`, sorted."""
    if not turn_ids:
        return []
    with catalog.connect() as con:
        rows = con.execute("SELECT DISTINCT path FROM turn_keys WHERE list_contains($ids, turn_id) ORDER BY path",
                           {"ids": list(turn_ids)}).fetchall()
    return [r[0] for r in rows]


def lineage_tags(parent: int, shards: list[str], turn_count: int) -> dict[str, str]:
    """Version tags `parent_version`, `turn_count`, `shard_count`, `shards` (comma-joined basenames,
    or "<n> shards sha256:<12 hex>; see lineage.json" when too long), `shards_sha256`."""
    names = [PurePath(s).name for s in shards]
    joined = ",".join(names)
    digest = hashlib.sha256("\n".join(shards).encode()).hexdigest()[:12]
    if len(joined) > MAX_TAG_CHARS:
        joined = f"{len(names)} shards sha256:{digest}; see lineage.json"
    return {"parent_version": str(parent), "turn_count": str(turn_count), "shard_count": str(len(names)),
            "shards": joined, "shards_sha256": digest}
