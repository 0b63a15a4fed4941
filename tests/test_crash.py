"""Crash test: a real `clawflow serve` process under concurrent load is killed with SIGKILL at
random moments; after every restart each turn whose HTTP response completed is in the shards
exactly once. Clients mark each request with a unique token in the user message (they never see
turn ids), so a stored turn is found by its marker."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest

KILLS = 5
CLIENTS = 4
MIN_ACKS_PER_ROUND = 5
MARKER = re.compile(r"m-[0-9a-f]{32}")


def start_gateway(cfg, log: Path) -> subprocess.Popen:
    return wait_healthy(cfg, log, spawn_gateway(cfg, log))


def spawn_gateway(cfg, log: Path) -> subprocess.Popen:
    """`clawflow serve` started, not yet waited for (several can start side by side)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "CLAWFLOW_HOME")}
    env["HF_HUB_OFFLINE"] = "1"
    cmd = [sys.executable, "-m", "clawflow.cli", "serve", "--config", str(cfg.source_file),
           "--port", str(cfg.serving.port)]
    return subprocess.Popen(cmd, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def wait_healthy(cfg, log: Path, proc: subprocess.Popen) -> subprocess.Popen:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{cfg.gateway_url}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("gateway did not become healthy")


def stored_markers(home: Path) -> Counter:
    counts: Counter = Counter()
    for shard in sorted((home / "shards").rglob("*.parquet")):
        for messages in pq.read_table(shard, columns=["messages"])["messages"].to_pylist():
            counts.update(MARKER.findall(messages))
    return counts


def client_loop(cfg, stop: threading.Event, acked: list[str], lock: threading.Lock, seed: int) -> None:
    rnd = random.Random(seed)
    headers = {"Authorization": f"Bearer {cfg.serving.api_key}"}
    with httpx.Client(base_url=cfg.gateway_url, headers=headers, timeout=30) as http:
        while not stop.is_set():
            marker = f"m-{uuid.uuid4().hex}"
            body = {"model": cfg.model.name, "max_tokens": 3,
                    "messages": [{"role": "user", "content": f"remember {marker}"}]}
            try:
                if rnd.random() < 0.5:
                    r = http.post("/v1/chat/completions", json=body)
                    done = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] is not None
                else:
                    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                        done = r.status_code == 200 and any(line == "data: [DONE]" for line in r.iter_lines())
            except (httpx.HTTPError, ValueError, KeyError):
                done = False  # killed mid-request: not acknowledged
                time.sleep(0.05)
            if done:
                with lock:
                    acked.append(marker)


@pytest.mark.slow
def test_acknowledged_turns_survive_sigkill(make_config, tmp_path):
    cfg = make_config(store={"fsync": "always", "segment_max_age_s": 0.3, "seal_interval_s": 0.1,
                             "segment_max_turns": 25})
    home, log = cfg.home, tmp_path / "gateway.log"
    acked: list[str] = []
    lock = threading.Lock()
    rnd = random.Random(3)

    proc = start_gateway(cfg, log)
    for round_ in range(KILLS + 1):
        stop = threading.Event()
        clients = [threading.Thread(target=client_loop, args=(cfg, stop, acked, lock, round_ * 10 + i))
                   for i in range(CLIENTS)]
        for c in clients:
            c.start()
        with lock:
            goal = len(acked) + MIN_ACKS_PER_ROUND
        deadline = time.monotonic() + 90
        while len(acked) < goal and time.monotonic() < deadline:  # under load, with requests in flight
            time.sleep(0.05)
        time.sleep(rnd.uniform(0.0, 1.0))  # then at a random moment
        last = round_ == KILLS
        proc.send_signal(signal.SIGTERM if last else signal.SIGKILL)
        proc.wait(60)
        stop.set()
        for c in clients:
            c.join(60)
        if not last:
            proc = start_gateway(cfg, log)  # recovers and seals what the crash left before serving
            assert "clawflow_store_wal_records_skipped_total" in httpx.get(f"{cfg.gateway_url}/metrics").text

        stored = stored_markers(home)
        with lock:
            n = len(acked)
            missing = [m for m in acked if stored[m] != 1]
        assert not missing, f"round {round_}: {len(missing)} acknowledged turns not stored exactly once"
        assert max(stored.values(), default=1) == 1, "a turn was stored twice"
        print(f"round {round_}: acknowledged/stored: {n}/{n - len(missing)} ({sum(stored.values())} stored in all)")

    assert len(acked) >= MIN_ACKS_PER_ROUND * (KILLS + 1)
    print(f"acknowledged/stored: {len(acked)}/{sum(1 for m in acked if stored[m] == 1)}")
    assert "quarantine" not in {p.name for p in home.iterdir()}
