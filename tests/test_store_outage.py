"""An object store that is down: a real `clawflow serve` whose `store.root` is an S3 endpoint where
nothing answers keeps serving and acknowledging turns; it is killed (SIGKILL) and restarted, then
stopped cleanly, with the store still down: every acknowledged turn is sealed in its local outbox
exactly once. Then the store (a real moto S3 server on that endpoint) comes up: the next start
uploads them, and every acknowledged turn is in the bucket exactly once, the outbox empty."""

from __future__ import annotations

import re
import signal
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _object_store import AWS_ENV, make_bucket, moto_server
from conftest import free_port
from test_crash import MARKER, start_gateway

from clawflow.store.storage import Storage


def send(cfg, n: int) -> list[str]:
    """`n` turns, one at a time; the markers of those whose response completed."""
    acked = []
    with httpx.Client(base_url=cfg.gateway_url, timeout=60,
                      headers={"Authorization": f"Bearer {cfg.serving.api_key}"}) as http:
        for _ in range(n):
            marker = f"m-{uuid.uuid4().hex}"
            messages = [{"role": "user", "content": f"remember {marker}"}]
            r = http.post("/v1/chat/completions", json={"model": cfg.model.name, "max_tokens": 2, "messages": messages})
            if r.status_code == 200 and r.json()["choices"][0]["finish_reason"]:
                acked.append(marker)
    return acked


def upload_failures(cfg) -> float:
    text = httpx.get(f"{cfg.gateway_url}/metrics").text
    match = re.search(r"^\w*shard_upload_failures_total (\S+)$", text, re.M)
    assert match, "the gateway exports no shard upload failure counter"
    return float(match.group(1))


def markers(tables: list[pa.Table]) -> Counter:
    counts: Counter = Counter()
    for table in tables:
        for messages in table["messages"].to_pylist():
            counts.update(MARKER.findall(messages))
    return counts


def outbox_markers(home: Path) -> Counter:
    return markers([pq.read_table(p, columns=["messages"]) for p in sorted((home / "outbox").rglob("*.parquet"))])


@pytest.mark.slow
def test_store_down_keeps_sealed_shards_locally_and_loses_no_acknowledged_turn(make_config, tmp_path, monkeypatch):
    for k, v in AWS_ENV.items():
        monkeypatch.setenv(k, v)
    port = free_port()  # the store's address; nothing listens there yet
    options = {"endpoint_url": f"http://127.0.0.1:{port}"}
    cfg = make_config(store={"root": "s3://outage/clawflow", "storage_options": options, "replica_id": "gw-1",
                             "segment_max_age_s": 0.3, "seal_interval_s": 0.1, "segment_max_turns": 3})
    log = tmp_path / "gateway.log"

    proc = start_gateway(cfg, log)
    acked = send(cfg, 7)
    # sealer passes: segments sealed into the outbox, uploads fail (each failure can take a while:
    # the S3 client retries a refused connection with backoff, slower on a loaded machine)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (upload_failures(cfg) and outbox_markers(cfg.home)):
        time.sleep(0.2)
    assert upload_failures(cfg) > 0, "no upload was tried (and failed) while the store is down"
    assert outbox_markers(cfg.home), "nothing sealed locally while the store is down"
    proc.send_signal(signal.SIGKILL)  # a crash, with the store down
    proc.wait(30)
    proc = start_gateway(cfg, log)  # recovers the WAL into the outbox, still without the store
    acked += send(cfg, 4)
    proc.send_signal(signal.SIGTERM)  # a clean stop seals the rest; the upload fails again
    proc.wait(60)  # uvicorn re-raises SIGTERM after its graceful shutdown
    assert log.read_text().count("Application shutdown complete") == 1
    assert len(acked) == 11
    local = outbox_markers(cfg.home)
    assert all(local[m] == 1 for m in acked) and sum(local.values()) == len(acked), local
    assert "unavailable" in log.read_text()

    with moto_server(tmp_path / "moto.log", port=port) as endpoint:  # the store is back
        make_bucket(endpoint, "outage")
        proc = start_gateway(cfg, log)
        try:
            deadline = time.monotonic() + 60
            while list((cfg.home / "outbox").rglob("*.parquet")) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not list((cfg.home / "outbox").rglob("*.parquet")), "the outbox was not uploaded"
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        storage = Storage(cfg.store.root, options)
        shards = storage.list("shards")
        assert shards and all("-gw-1-" in str(e.path) for e in shards)
        stored = markers([pq.read_table(pa.BufferReader(storage.read_bytes(e.path))) for e in shards])
        assert all(stored[m] == 1 for m in acked) and sum(stored.values()) == len(acked), stored
