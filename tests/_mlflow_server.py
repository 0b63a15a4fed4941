"""A real `mlflow server` (SQLite backend, artifacts proxied) for tests of a remote tracking server."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from conftest import free_port


@contextlib.contextmanager
def mlflow_server(root: Path, artifacts_destination: str, env: dict[str, str] | None = None,
                  timeout_s: float = 120) -> Iterator[str]:
    """Start the server under `root`, wait until /health answers, yield its URL, stop it."""
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
           **(env or {})}
    cmd = [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
           "--artifacts-destination", artifacts_destination]
    log_path = root / "mlflow.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url, t0 = f"http://127.0.0.1:{port}", time.monotonic()
    try:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"mlflow server did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.3)
        print(f"mlflow server healthy in {time.monotonic() - t0:.1f} s")
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
