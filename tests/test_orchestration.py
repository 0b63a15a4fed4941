"""The deployments users run, against a real `prefect server start`: prefect.yaml deploys as
written, a `clawflow.shard.sealed` event starts train-on-new-feedback on a real process worker, a
burst of sealed shards trains serially (real turns, real training) without losing a shard, and a task that fails once is retried."""

from __future__ import annotations

import inspect
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest
import uvicorn
import yaml
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from prefect import flow

from clawflow.config import REPO_ROOT
from clawflow.policy import registry, reload
from clawflow.store.catalog import Catalog
from conftest import free_port, process_group, use_prefect_api
from _store_helpers import pending_pairs
from test_gate_judged import feedback_turns, seal_turns
from tasks.training import reload_gateway

pytestmark = pytest.mark.slow
PREFECT = str(Path(sys.executable).parent / "prefect")
SPEC = yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def api_post(api: str, path: str, body: dict | None = None) -> list | dict:
    r = httpx.post(f"{api}{path}", json=body or {}, timeout=30)
    r.raise_for_status()
    return r.json()


@pytest.fixture(scope="module")
def deployed(prefect_server):
    """The work pool and `prefect deploy --all` from the repo root, as `clawflow up` does."""
    api, env = prefect_server
    pool = SPEC["definitions"]["work_pools"]["process_pool"]["name"]
    for argv in (["work-pool", "create", pool, "--type", "process", "--overwrite"], ["--no-prompt", "deploy", "--all"]):
        done = subprocess_run([PREFECT, *argv], env)
        assert done.returncode == 0, f"prefect {' '.join(argv)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return api, env, pool


def subprocess_run(argv, env):
    return subprocess.run(argv, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def flow_params(entrypoint: str) -> set[str]:
    module, name = entrypoint.split(":")
    module = module.removesuffix(".py").replace("/", ".")
    fn = getattr(__import__(module, fromlist=[name]), name)
    return set(inspect.signature(fn.fn).parameters)


def test_deployments_match_prefect_yaml(deployed):
    api, _, pool = deployed
    found = {d["name"]: d for d in api_post(api, "/deployments/filter")}
    assert set(found) == {d["name"] for d in SPEC["deployments"]}
    for spec in SPEC["deployments"]:
        d = found[spec["name"]]
        assert d["entrypoint"] == spec["entrypoint"]
        assert d["work_pool_name"] == pool
        assert d["parameters"] == spec["parameters"]
        assert d["description"] and d["description"] == spec["description"]
        assert set(d["tags"]) == set(spec["tags"])
        # Typed parameters in the UI's form: the flow's signature, each with a type.
        props = d["parameter_openapi_schema"]["properties"]
        assert set(props) == flow_params(spec["entrypoint"]), spec["name"]
        assert all("type" in p or "anyOf" in p for p in props.values()), props

    train = found["train-on-new-feedback"]
    assert train["global_concurrency_limit"]["limit"] == 1
    assert train["concurrency_options"]["collision_strategy"] == "ENQUEUE"
    assert found["serve-policy"]["global_concurrency_limit"]["limit"] == 1

    # One automation per trigger, running its own deployment on the expected event.
    automations = api_post(api, "/automations/filter")
    by_deployment = {}
    for a in automations:
        for action in a["actions"]:
            if action["type"] == "run-deployment":
                by_deployment.setdefault(action["deployment_id"], []).append(a)
    for spec in SPEC["deployments"]:
        autos = by_deployment.get(found[spec["name"]]["id"], [])
        assert len(autos) == len(spec.get("triggers", [])), spec["name"]
        for auto, trig in zip(autos, spec.get("triggers", [])):
            assert auto["enabled"] and set(auto["trigger"]["expect"]) == set(trig["expect"])
            assert auto["trigger"]["threshold"] == trig["threshold"]


def test_shard_sealed_burst_trains_serially(deployed, make_config, tmp_path):
    """Two shards of judged feedback are sealed at once; the sealer's own two
    `clawflow.shard.sealed` events start two runs, which the deployment's concurrency limit
    queues (two show it as well as three did, at 30 s less). Each run trains (at most 4 turns,
    oldest first: one shard), and:
    - never overlaps another: start/end times, and each run trained from the version the previous
      one promoted (parents v1 -> v2; two overlapping runs would share a parent);
    - no shard is lost and no turn trained twice: every sealed turn is consumed exactly once, each
      shard's turns by one run, and nothing is left pending."""
    api, env, pool = deployed
    # the gate is tests/test_gate*.py's subject: off here, so every trained version is promoted and
    # the parent chain below shows the order the runs ran in
    cfg = make_config(train={"max_turns": 4}, gate={"enabled": False})
    assert reload.provision(cfg)[0] == 1  # v1, the base: the first run's parent
    sessions = feedback_turns(8)  # 8 turns with a next state (a thanks or a correction)
    worker_env = {**env, "CLAWFLOW_CONFIG": str(cfg.source_file), "CLAWFLOW_HOME": str(cfg.home),
                  "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "1"}
    argv = [PREFECT, "worker", "start", "--pool", pool]
    train_runs = {"deployments": {"name": {"any_": ["train-on-new-feedback"]}}}
    before = {r["id"] for r in api_post(api, "/flow_runs/filter", train_runs)}  # other tests' runs
    started = time.monotonic()
    with use_prefect_api(api):
        seal_turns(cfg.home, sessions)  # 2 shards of 4 sessions; the sealer announces each: the burst
    shard_of = {tid: p.name for p in sorted((cfg.home / "shards").rglob("*.parquet"))  # before compaction
                for tid in pq.read_table(p, columns=["turn_id"]).column("turn_id").to_pylist()}
    turns = {f.turn_id for f, _, _ in sessions}
    assert len(set(shard_of.values())) == 2 and turns <= set(shard_of)
    with process_group(argv, worker_env, tmp_path / "worker.log", stop=signal.SIGINT, stop_times=2):
        deadline = time.monotonic() + 480
        while True:
            runs = [r for r in api_post(api, "/flow_runs/filter", train_runs) if r["id"] not in before]
            if len(runs) >= 2 and all(r["state_type"] in TERMINAL for r in runs):
                break
            assert time.monotonic() < deadline, f"runs not done: {[(r['name'], r['state_name']) for r in runs]}\n" \
                                                f"{(tmp_path / 'worker.log').read_text()[-4000:]}"
            time.sleep(0.5)
    print(f"2 triggered training runs done in {time.monotonic() - started:.1f}s")

    # threshold 1 / within 0: no batching by design, so one run per sealed shard; none lost.
    assert len(runs) == 2, [r["name"] for r in runs]
    assert [r["state_type"] for r in runs] == ["COMPLETED"] * 2, [(r["name"], r["state"]["message"]) for r in runs]
    assert all(r["created_by"] and r["created_by"]["type"] == "AUTOMATION" for r in runs), runs[0]["created_by"]
    spans = sorted((datetime.fromisoformat(r["start_time"]), datetime.fromisoformat(r["end_time"])) for r in runs)
    print("runs (start, end):", [(a.time().isoformat("seconds"), b.time().isoformat("seconds")) for a, b in spans])
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert start >= end, f"two trainings overlapped: {spans}"
    ids = {"flow_run_id": {"any_": [r["id"] for r in runs]}}
    arts = api_post(api, "/artifacts/filter", {"artifacts": {**ids, "key": {"any_": ["training-summary"]}}})
    assert len(arts) == 2 and all("| trained | True |" in a["data"] and "| samples | 4 |" in a["data"]
                                  for a in arts), [a["data"] for a in arts]
    progress = api_post(api, "/artifacts/filter", {"artifacts": {**ids, "key": {"any_": ["training-progress"]}}})
    assert len(progress) == 2 and all(a["data"] == 100 for a in progress)

    # Serial: v2, v3, each trained from the one before (promoted: the gate is off).
    versions = {v["version"]: v for v in registry.list_versions(cfg)}
    assert sorted(versions) == [1, 2, 3], sorted(versions)
    assert [versions[v]["tags"]["parent_version"] for v in (2, 3)] == ["1", "2"], \
        "a run trained from a stale champion: it overlapped the run before it"
    assert registry.champion(cfg)[0] == 3

    # No turn lost or trained twice: each of the 8 is consumed once, by the version that trained it.
    with Catalog.for_config(cfg).connect() as con:
        consumed = con.execute("SELECT turn_id, run_id, policy_version FROM consumed").fetchall()
        run_turns = dict(con.execute("SELECT run_id, turns FROM runs").fetchall())
    assert sorted(t for t, _, _ in consumed) == sorted(turns)  # all of them, each once
    run_of = {versions[v]["run_id"]: v for v in (2, 3)}
    assert all(run_of.get(run) == v for _, run, v in consumed), consumed
    assert {run_of[r]: n for r, n in run_turns.items()} == {2: 4, 3: 4}, run_turns
    assert sum(int(versions[v]["tags"]["turn_count"]) for v in (2, 3)) == 8
    # each shard trained by exactly one run (oldest first), the two by different runs
    by_shard: dict[str, set[int]] = {}
    for t, _, v in consumed:
        by_shard.setdefault(shard_of[t], set()).add(v)
    assert sorted(map(sorted, by_shard.values())) == [[2], [3]], by_shard
    assert pending_pairs(Catalog.for_config(cfg), 100) == []


class FlakyGateway:
    """A real HTTP admin endpoint that answers 500 to the first reload and 200 after."""

    def __init__(self):
        self.calls = 0
        self.app = FastAPI()
        self.app.post("/admin/reload")(self.reload)

    async def reload(self):
        self.calls += 1
        if self.calls == 1:
            return JSONResponse({"error": {"message": "engine busy"}}, status_code=500)
        return {"version": 1}


@flow(name="reload-once")
def reload_once(cfg) -> bool:
    return reload_gateway(cfg, 1, "/nowhere")


def test_failed_task_is_retried_and_run_completes(prefect_server, make_config):
    api, _ = prefect_server
    cfg = make_config(serving={"port": free_port()})
    gw = FlakyGateway()
    server = uvicorn.Server(uvicorn.Config(gw.app, host="127.0.0.1", port=cfg.serving.port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        with use_prefect_api(api):
            state = reload_once(cfg, return_state=True)
    finally:
        server.should_exit = True
        thread.join(30)
    assert state.is_completed() and state.result() is True
    assert gw.calls == 2

    run_id = str(state.state_details.flow_run_id)
    (task_run,) = api_post(api, "/task_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})
    assert task_run["name"] == "reload-v1" and task_run["run_count"] == 2
    history = httpx.get(f"{api}/task_run_states/", params={"task_run_id": task_run["id"]}).json()
    names = [s["name"] for s in sorted(history, key=lambda s: s["timestamp"])]
    assert "AwaitingRetry" in names and "Retrying" in names and names[-1] == "Completed", names


def test_failed_serve_policy_run_is_restarted_by_the_automation(deployed):
    """The always-on trigger: a Failed serve-policy run makes the automation schedule a new one
    with restart=True (which applies the backoff/cap, tests/test_flow_restarts.py). No worker
    runs here, so the new run stays Scheduled; it is cancelled at the end."""
    api, _, _ = deployed
    dep = {d["name"]: d for d in api_post(api, "/deployments/filter")}["serve-policy"]
    runs_of = {"deployments": {"id": {"any_": [dep["id"]]}}}
    before = {r["id"] for r in api_post(api, "/flow_runs/filter", runs_of)}
    run = api_post(api, f"/deployments/{dep['id']}/create_flow_run", {})
    api_post(api, f"/flow_runs/{run['id']}/set_state",
             {"state": {"type": "FAILED", "message": "engine crashed"}, "force": True})
    deadline = time.monotonic() + 60
    try:
        while True:
            new = [r for r in api_post(api, "/flow_runs/filter", runs_of) if r["id"] not in before | {run["id"]}]
            if new:
                break
            assert time.monotonic() < deadline, "no restart scheduled within 60 s"
            time.sleep(0.5)
        (restarted,) = new
        assert restarted["created_by"]["type"] == "AUTOMATION"
        assert restarted["parameters"] == {"restart": True}
        assert restarted["state_type"] in ("SCHEDULED", "PENDING")
    finally:
        for r in api_post(api, "/flow_runs/filter", runs_of):
            if r["state_type"] not in TERMINAL:
                api_post(api, f"/flow_runs/{r['id']}/set_state",
                         {"state": {"type": "CANCELLED", "message": "test over"}, "force": True})
