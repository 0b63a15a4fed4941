"""The local stack behind `clawflow up` / `down`: Prefect server, MLflow server, a process worker,
the deployments of prefect.yaml, and the serve-policy run. Each service is a child process whose
pid is kept under `$CLAWFLOW_HOME/run/`, logs under `$CLAWFLOW_HOME/logs/`.

A work pool + `process` worker (rather than `prefect.serve`) because prefect.yaml is the
declarative source of the deployments, their triggers and concurrency, and the same file deploys
to Kubernetes/Docker pools when users scale out.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from clawflow.config import REPO_ROOT, Config
from clawflow.home import Home

BIN = Path(sys.executable).parent


def service_env(cfg: Config) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "CLAWFLOW_HOME": str(cfg.home),
        "CLAWFLOW_CONFIG": str(cfg.source_file),
        "PREFECT_HOME": str(Home(cfg.home).prefect),
        "PREFECT_API_URL": f"http://127.0.0.1:{cfg.services.prefect_port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "3",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "MLFLOW_TRACKING_URI": cfg.tracking_uri,
    })
    return env


def adopt_prefect_api(cfg: Config) -> str | None:
    """Point this process's Prefect client at the stack's server the way `up` points its services
    (services.prefect_port), when the environment names no API and that server answers: a command
    run from a plain shell (`clawflow rollback`) then reaches Prefect. Call before Prefect is
    imported. The API used, or None."""
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    api = service_env(cfg)["PREFECT_API_URL"]
    try:
        if httpx.get(f"{api}/health", timeout=2).status_code != 200:
            return None
    except httpx.HTTPError:
        return None  # no stack running: events stay log lines, as they do for the gateway
    os.environ["PREFECT_API_URL"] = api
    return api


def _start(cfg: Config, name: str, argv: list[str], env: dict[str, str]) -> int:
    home = Home(cfg.home)
    home.logs.mkdir(parents=True, exist_ok=True)
    home.run.mkdir(parents=True, exist_ok=True)
    pidfile = home.run / f"{name}.pid"
    if pidfile.exists() and _alive(int(pidfile.read_text())):
        return int(pidfile.read_text())
    log = open(home.logs / f"{name}.log", "ab")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
                            start_new_session=True)  # own process group: `down` stops its children too
    pidfile.write_text(str(proc.pid))
    return proc.pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def wait_http(url: str, timeout_s: float, what: str, failed=lambda: None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if reason := failed():
            raise RuntimeError(f"{what} failed: {reason}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{what} did not answer at {url} within {timeout_s:.0f}s (see $CLAWFLOW_HOME/logs)")


def _serve_policy_failure(cfg: Config) -> str | None:
    """The last serve-policy run's failure message, if it failed (so `up` stops waiting)."""
    api = f"http://127.0.0.1:{cfg.services.prefect_port}/api"
    try:
        runs = httpx.post(f"{api}/flow_runs/filter", timeout=5, json={
            "deployments": {"name": {"any_": ["serve-policy"]}}, "sort": "EXPECTED_START_TIME_DESC", "limit": 1,
        }).json()
    except (httpx.HTTPError, ValueError):
        return None
    state = (runs[0].get("state") or {}) if runs else {}
    capped = state.get("type") == "CANCELLED" and "consecutive failures" in (state.get("message") or "")
    if state.get("type") in ("FAILED", "CRASHED") or capped:  # capped: the restart guard gave up
        return f"{state.get('message')} (full log: {Home(cfg.home).logs / 'worker.log'})"
    return None


def _cancel_stale_serve_runs(cfg: Config) -> None:
    """The gateway is down, so any serve-policy run still Running/Scheduled is stale (e.g. a
    killed machine); it would hold the deployment's concurrency slot forever."""
    api = f"http://127.0.0.1:{cfg.services.prefect_port}/api"
    runs = httpx.post(f"{api}/flow_runs/filter", timeout=10, json={
        "deployments": {"name": {"any_": ["serve-policy"]}},
        "flow_runs": {"state": {"type": {"any_": ["RUNNING", "PENDING", "SCHEDULED", "PAUSED", "CANCELLING"]}}},
    }).json()
    for run in runs:
        httpx.post(f"{api}/flow_runs/{run['id']}/set_state", timeout=10, json={
            "state": {"type": "CANCELLED", "message": "stale: the gateway was not running at `clawflow up`"},
            "force": True})


def _prefect(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "prefect"), *args], env=env, cwd=REPO_ROOT, capture_output=True, text=True)


class _NoAliases(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:
        return True


def render_prefect_yaml(cfg: Config) -> Path:
    """prefect.yaml with the training trigger's batching window taken from the config."""
    spec = yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())
    for dep in spec["deployments"]:
        if dep["name"] == "train-on-new-feedback":
            for trig in dep.get("triggers", []):
                trig["threshold"] = cfg.services.train_trigger_threshold
                trig["within"] = cfg.services.train_trigger_within_s
    out = Home(cfg.home).prefect_rendered
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.dump(spec, Dumper=_NoAliases, sort_keys=False))
    return out


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def check_ports(cfg: Config) -> None:
    """Refuse to start when a port `up` needs is taken by something `up` did not start."""
    ours = {name for name in ("prefect-server", "mlflow-server") if _pid_alive(cfg, name)}
    wanted = {"prefect-server": cfg.services.prefect_port, "mlflow-server": cfg.services.mlflow_port}
    busy = [f"{port} ({name})" for name, port in wanted.items() if name not in ours and _port_in_use(port)]
    if busy:
        raise RuntimeError(f"port(s) already in use by another program: {', '.join(busy)}; "
                           "stop it or change `services:` in the config")


def _pid_alive(cfg: Config, name: str) -> bool:
    pidfile = Home(cfg.home).run / f"{name}.pid"
    return pidfile.exists() and _alive(int(pidfile.read_text()))


def up(cfg: Config, echo=print) -> None:
    check_ports(cfg)
    env = service_env(cfg)
    s = cfg.services
    _start(cfg, "prefect-server", [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1",
                                   "--port", str(s.prefect_port)], env)
    _start(cfg, "mlflow-server", [str(BIN / "mlflow"), "server", "--backend-store-uri", cfg.tracking_uri,
                                  "--default-artifact-root", cfg.artifact_root.as_uri(), "--host", "127.0.0.1",
                                  "--port", str(s.mlflow_port), "--workers", "1"], env)
    wait_http(f"http://127.0.0.1:{s.prefect_port}/api/health", 180, "Prefect server")
    echo(f"Prefect UI      http://127.0.0.1:{s.prefect_port}")
    _prefect(["work-pool", "create", s.work_pool, "--type", "process"], env)  # exists already: fine
    deployed = _prefect(["--no-prompt", "deploy", "--all", "--prefect-file", str(render_prefect_yaml(cfg))], env)
    if deployed.returncode != 0:
        raise RuntimeError(f"prefect deploy failed: {deployed.stdout[-2000:]}{deployed.stderr[-2000:]}")
    _start(cfg, "worker", [str(BIN / "prefect"), "worker", "start", "--pool", s.work_pool], env)
    try:
        httpx.get(f"{cfg.gateway_url}/healthz", timeout=2)
        echo("gateway already running")
    except httpx.HTTPError:
        _cancel_stale_serve_runs(cfg)
        run = _prefect(["deployment", "run", "serve-policy/serve-policy"], env)
        if run.returncode != 0:
            raise RuntimeError(f"could not start serve-policy: {run.stdout[-1000:]}{run.stderr[-1000:]}")
    wait_http(f"http://127.0.0.1:{s.mlflow_port}/health", 180, "MLflow server")
    echo(f"MLflow UI       http://127.0.0.1:{s.mlflow_port}")
    wait_http(f"{cfg.gateway_url}/healthz", 600, "gateway (first start converts the model: ~1 min)",
              failed=lambda: _serve_policy_failure(cfg))
    echo(f"OpenAI API      {cfg.gateway_url}/v1   (api_key: {cfg.serving.api_key})")


def down(cfg: Config, echo=print) -> None:
    # The gateway first: on SIGTERM it seals its segments and its serve-policy run ends Completed
    # (a crash would trigger the always-on restart); then the worker and the servers.
    for name in ("gateway", "worker", "mlflow-server", "prefect-server"):
        pidfile = Home(cfg.home).run / f"{name}.pid"
        if not pidfile.exists():
            continue
        pid = int(pidfile.read_text())
        if _alive(pid):
            _stop(pid, name)
            echo(f"stopped {name} (pid {pid})")
        pidfile.unlink(missing_ok=True)


def _stop(pid: int, name: str, timeout_s: float = 60) -> None:
    sig = signal.SIGINT if name == "worker" else signal.SIGTERM  # the worker wants SIGINT (twice)
    target = -pid if name != "gateway" else pid
    for attempt in range(3):
        try:
            os.kill(target, sig) if target > 0 else os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + (timeout_s if attempt == 0 else 10)
        while time.monotonic() < deadline:
            if not _alive(pid):
                return
            time.sleep(0.3)
    os.killpg(pid, signal.SIGKILL) if target < 0 else os.kill(pid, signal.SIGKILL)
