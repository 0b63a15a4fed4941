"""Process-wide counters of the store's anomalies and work, for logs and `GET /metrics`.

Torn or corrupt WAL records and quarantined shards are never fatal, so they must be visible
somewhere other than a log line that nobody reads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields


@dataclass
class StoreMetrics:
    wal_records_skipped: int = 0  # torn or corrupt WAL lines skipped while sealing
    shards_sealed: int = 0
    turns_sealed: int = 0
    turns_forgotten_at_seal: int = 0  # dropped because their session was forgotten
    shards_quarantined: int = 0
    shards_uploaded: int = 0  # object-store root: shards that left the outbox (outbox.py)
    shard_upload_failures: int = 0  # uploads that failed (store down); the shard waits and is retried

    def add(self, **counts: int) -> None:
        with _lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def prometheus(self) -> list[str]:
        return [f"clawflow_store_{f.name}_total {getattr(self, f.name)}" for f in fields(self)]


_lock = threading.Lock()
STORE = StoreMetrics()
