"""Shared fixtures: a tiny model made once per session, per-test configs, a gateway on a real port."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

# One torch thread per core per xdist worker: `make test` runs one worker per core, and each
# worker's torch, and every server or torchrun it starts (they inherit OMP_NUM_THREADS), defaulting
# to all the cores oversubscribed them: on a 2-core AVX2 EPYC four training/gate test files took 215 s
# that way and 126 s this way (2026-12-06).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

# glibc's malloc gives a freed tensor's pages back to the kernel and faults them in again at the
# next allocation of that size, every training step: the hint-following model of the learning test
# took 48.8 s (13.4 s of it in the kernel, 6.7 M page faults) that way and 40.4 s (2.0 s, 0.7 M)
# with freed memory kept and reused (2026-12-07, 2-core AVX2 EPYC). Set here, before the xdist
# workers start, so they and every server and torchrun they start inherit it.
os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(2**30))
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(2**25))  # the most glibc allows (32 MiB)

import httpx
import pytest
import yaml

from clawflow.config import REPO_ROOT, load_config

for var in ("CLAWFLOW_HOME", "CLAWFLOW_CONFIG", "CLAWFLOW_API_KEY", "CLAWFLOW_ADMIN_KEY", "PREFECT_API_URL"):
    os.environ.pop(var, None)
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")


# The longest files first, among files with as many tests: pytest-xdist (--dist loadfile) hands
# out files by their number of tests, most first (its default --loadscope-reorder), and this order
# only breaks its ties. Turning that off to start the long end-to-end files first was measured and
# is slower: 15 min 38 s against 13 min 49 s on a 2-core AVX2 EPYC (2026-12-06), the long files then
# running two at a time and slowing each other (docs/operations.md).
LONG_FIRST = ("test_learning_bench.py", "test_container.py", "test_orchestration.py", "test_openclaw_e2e.py",
              "test_shipped_recipe.py", "test_train_preferences.py", "test_crash.py", "test_two_hosts.py",
              "test_browser.py", "test_replica_follow.py", "test_end_to_end.py", "test_env_rewards.py",
              "test_smollm2.py", "test_train.py", "test_store_outage.py", "test_train_opd.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the others keep their order


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """configs/test.yaml's model (random weights, SmolLM2 tokenizer), materialized once."""
    from clawflow.base_model import base_model_dir

    os.environ["CLAWFLOW_HOME"] = str(tmp_path_factory.mktemp("model-home"))
    try:
        return base_model_dir(load_config(REPO_ROOT / "configs" / "test.yaml"))
    finally:
        os.environ.pop("CLAWFLOW_HOME")


@pytest.fixture
def make_config(tmp_path, tiny_model_dir):
    """Write a complete YAML config (tiny model, temp home, free port) and load it."""

    def make(**sections):
        raw = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
        raw["home"] = str(tmp_path / "home")
        raw["model"] = {"name": "clawflow-tiny", "path": tiny_model_dir}
        raw["serving"]["port"] = free_port()
        for key, value in sections.items():
            raw.setdefault(key, {}).update(value)
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(raw))
        return load_config(path)

    return make


@contextlib.contextmanager
def running_gateway(cfg, wrap=lambda app: app):
    """The real app under uvicorn on cfg.serving.port, in a thread; stopped (and sealed) on exit.
    `wrap(app)` is what uvicorn serves (a test can watch the wire around the real app)."""
    import uvicorn

    from clawflow.serving.server import build_app

    app = build_app(cfg)
    server = uvicorn.Server(uvicorn.Config(wrap(app), host="127.0.0.1", port=cfg.serving.port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("gateway did not start")
        time.sleep(0.05)
    try:
        yield app
    finally:
        server.should_exit = True
        thread.join(60)


@pytest.fixture
def gateway(make_config):
    cfg = make_config()
    with running_gateway(cfg) as app:
        yield cfg, app


def admin(cfg) -> dict:
    return {"Authorization": f"Bearer {cfg.serving.admin_key}"}


def policy_version(cfg) -> int:
    return httpx.get(f"{cfg.gateway_url}/admin/policy", headers=admin(cfg)).json()["version"]


@pytest.fixture(scope="session")
def prefect_api():
    """A real Prefect server (Prefect's own test harness) for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


def drain_prefect_events() -> None:
    """Prefect keeps one events worker per process, bound to the API it started with (task runs
    reach the server as events): drain it whenever a test switches API, or the runs of the tests
    after the switch go to the wrong server. The next event starts a worker on the current API."""
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all(timeout=10)


@contextlib.contextmanager
def use_prefect_api(api: str):
    """Point this process's Prefect client at `api`, with a fresh events worker in and out."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    drain_prefect_events()
    try:
        with temporary_settings({PREFECT_API_URL: api}):
            yield
    finally:
        drain_prefect_events()


@contextlib.contextmanager
def process_group(argv: list[str], env: dict, log_path: Path, stop=signal.SIGTERM, stop_times: int = 1):
    """A child in its own process group, logging to `log_path`; stopped with `stop` (sent
    `stop_times` times, e.g. twice SIGINT for a Prefect worker), then SIGKILL, on exit."""
    log = open(log_path, "ab")
    proc = subprocess.Popen(argv, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        yield proc
    finally:
        for attempt in range(stop_times + 1):
            if proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, stop if attempt < stop_times else signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(20 if attempt < stop_times else 10)
        with contextlib.suppress(ProcessLookupError):  # children left in the group (flow runs)
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """`prefect server start` (UI, event triggers, automations) on a free port with its own
    PREFECT_HOME; yields (api_url, env for child processes)."""
    home = tmp_path_factory.mktemp("prefect-server")
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": api,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS": "1"}  # queued runs retry the slot quickly
    argv = [str(Path(sys.executable).parent / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    with process_group(argv, env, home / "server.log") as proc:
        from clawflow.local_stack import wait_http

        wait_http(f"{api}/health", 180, "Prefect server",
                  failed=lambda: proc.poll() is not None and (home / "server.log").read_text()[-2000:])
        yield api, env


# gateway fixtures shared by tests/test_gateway_*.py (imported here so one `served` gateway serves them all)
from _gateway_helpers import euro_model_dir, perturbed_model_dir, served  # noqa: E402, F401
