"""The store lock: one process at a time changes files under `shards/` (seal, compact, forget).

An advisory `flock` on `$CLAWFLOW_HOME/store.lock`, released by the kernel when a holder dies, so
a crash never leaves it stuck. Readers do not take it; the catalog only reads shards it has
registered, and only maintenance (which also holds the catalog's connection) removes them.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from clawflow.home import Home

_local = threading.local()  # re-entrant per thread: maintenance may call the sealer's helpers


@contextmanager
def store_lock(home: Path) -> Iterator[None]:
    held: set[str] = getattr(_local, "held", set())
    _local.held = held
    key = str(Path(home).resolve())
    if key in held:
        yield
        return
    Path(home).mkdir(parents=True, exist_ok=True)
    fd = os.open(Home(home).store_lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        held.add(key)
        try:
            yield
        finally:
            held.discard(key)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
