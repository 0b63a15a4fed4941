"""The outbox: sealed shards waiting for the object store.

With an object-store root, the sealer writes each shard here first
(`$CLAWFLOW_HOME/outbox/shards/date=…/<id>.parquet`, the same fsynced temp-and-rename as a local
root) and only then deletes its WAL segment: from that moment its turns are sealed and durable on
this host, whether or not the store is up. `publish` uploads each waiting shard (a conditional
put carrying its checksum, see storage.py) and deletes the local copy only once the store has it.
A store that is down leaves the shards here: the next sealer pass, or the next start, tries
again. No acknowledged turn depends on the store being reachable.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq

from clawflow.home import Home
from clawflow.store.metrics import STORE
from clawflow.store.shards import shard_files
from clawflow.store.storage import ObjectExists, Storage
from clawflow.store.wal import fsync_dir

log = logging.getLogger("clawflow.store.outbox")


@dataclass(frozen=True)
class Published:
    shard_id: str  # the uploaded object's (a content-suffixed one when the name was taken)
    local_id: str  # the name it was sealed under
    url: str
    rows: int
    first_at: datetime
    last_at: datetime


def outbox_dir(home: Path) -> Path:
    return Home(home).outbox


def publish(outbox: Path, storage: Storage) -> list[Published]:
    """Upload every waiting shard, oldest first; stops at the first failure (the store is down:
    the rest would fail the same way) and leaves it and the rest for the next call."""
    done = []
    for path in shard_files(outbox):
        rel = path.relative_to(outbox).as_posix()
        try:
            data = path.read_bytes()
            try:
                url = storage.put_bytes(data, f"{Home.SHARDS}/{rel}")
            except ObjectExists:  # another writer took the name: ours goes next to it, named by content,
                # so putting it again after a crash finds the same object instead of a second copy
                alt = f"{rel.removesuffix('.parquet')}-{hashlib.sha256(data).hexdigest()[:12]}.parquet"
                log.warning("%s/%s exists with other contents; uploading as %s/%s", Home.SHARDS, rel, Home.SHARDS, alt)
                url = storage.put_bytes(data, f"{Home.SHARDS}/{alt}")
        except Exception as exc:  # noqa: BLE001 - any store failure: keep it locally, retry later
            STORE.add(shard_upload_failures=1)
            log.warning("object store %s unavailable (%s: %s); %d sealed shard(s) wait in %s",
                        storage.root, exc.__class__.__name__, str(exc)[:200], len(shard_files(outbox)), outbox)
            break
        created = pq.read_table(path, columns=["created_at"])["created_at"]
        bounds = pc.min_max(created)
        path.unlink()
        fsync_dir(path.parent)
        STORE.add(shards_uploaded=1)
        uploaded_id = url.rsplit("/", 1)[-1].removesuffix(".parquet")
        done.append(Published(uploaded_id, path.stem, url, len(created), bounds["min"].as_py(), bounds["max"].as_py()))
    return done


def waiting(home: Path) -> int:
    """Sealed shards not yet in the object store."""
    return len(shard_files(outbox_dir(home)))
