"""train-on-new-feedback in-process under a real Prefect API (the test harness), from a provisioned
base (v1 champion): held-out judged turns stay out of training and feed the gate, the version
carries its lineage, the progress artifact reaches 100, and the CLI follows runs."""

from __future__ import annotations

import threading
import time
from pathlib import PurePath

import httpx
import mlflow
import pyarrow.parquet as pq
from test_gate_judged import feedback_turns, seal_turns
from typer.testing import CliRunner

from clawflow import cli_watch
from clawflow.cli import app
from clawflow.policy import registry, reload
from clawflow.policy.holdout import in_holdout
from conftest import drain_prefect_events
from _store_helpers import pending_pairs


def api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def test_training_run_holds_out_turns_records_lineage_and_progress(make_config, prefect_api):
    from flows.train_on_new_feedback import train_on_new_feedback

    drain_prefect_events()
    cfg = make_config(gate={"holdout_fraction": 0.5})
    assert reload.provision(cfg) == (1, cfg.model.path)  # the base: v1, champion
    sessions = feedback_turns(8)
    seal_turns(cfg.home, sessions)
    held = {f.turn_id for f, _, _ in sessions if in_holdout(f.turn_id, 0.5)}
    assert 0 < len(held) < 8  # "turn-k" ids: a fixed, non-trivial split
    shard_of = {tid: PurePath(p).name for p in sorted((cfg.home / "shards").rglob("*.parquet"))  # before compaction
                for tid in pq.read_table(p, columns=["turn_id"]).column("turn_id").to_pylist()}

    state = train_on_new_feedback(config_path=str(cfg.source_file), return_state=True)
    result = state.result()
    assert result["trained"] and result["version"] == 2 and result["parent"] == 1 and result["promoted"], result
    assert result["samples"] == 8 - len(held) and result["held_out"] == len(held)
    samples = pq.read_table(cfg.home / "runs" / result["mlflow_run"] / "samples.parquet").column("turn_id").to_pylist()
    assert not set(samples) & held  # held-out turns never train

    v2 = {v["version"]: v for v in registry.list_versions(cfg)}[2]
    tags = v2["tags"]
    assert float(tags["eval.judged_pos"]) + float(tags["eval.judged_neg"]) == len(held)  # the gate saw them
    assert tags["parent_version"] == "1" and tags["turn_count"] == str(len(samples))
    assert tags["shards"] == ",".join(sorted({shard_of[t] for t in samples}))
    lineage = mlflow.artifacts.load_dict(f"runs:/{result['mlflow_run']}/lineage.json")
    assert sorted(lineage["turn_ids"]) == sorted(samples) and lineage["parent_version"] == 1

    run_id = str(state.state_details.flow_run_id)
    seen = []
    final = cli_watch.follow(api_url(), run_id, seen.append, poll_s=0.1, timeout_s=30)
    assert final.done and final.state_type == "COMPLETED" and final.percent == 100 and final.phase == "done: v2"
    names = [n for n, _ in final.tasks]
    for task in ("collect-batch-", "update-preferences-", "held-out-probes-", f"gate-{result['mlflow_run']}", "tag-v2",
                 "promote-champion-"):  # names get a short suffix
        assert any(n.startswith(task) for n in names), (task, names)

    assert reload.rollback(cfg, 1)["to_version"] == 1 and registry.champion(cfg) == (1, cfg.model.path)  # back to base


def test_cli_train_schedules_and_follows_a_run(make_config, prefect_api):
    from prefect.client.orchestration import get_client

    api = api_url()
    cfg = make_config(services={"prefect_port": int(api.rsplit(":", 1)[1].split("/")[0])})
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name("train-on-new-feedback")
        client.create_deployment(flow_id=flow_id, name="train-on-new-feedback")
    runner = CliRunner()
    out = runner.invoke(app, ["train", "--no-wait", "--config", str(cfg.source_file)])
    assert out.exit_code == 0 and "scheduled" in out.output and "/runs/flow-run/" in out.output, out.output

    scheduled = {"flow_runs": {"state": {"type": {"any_": ["SCHEDULED"]}}},
                 "deployments": {"name": {"any_": ["train-on-new-feedback"]}}}
    before = {r["id"] for r in httpx.post(f"{api}/flow_runs/filter", json=scheduled).json()}

    def fail_next_run():  # stands in for a worker whose run fails, so `train` (waiting) sees it end
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            runs = [r for r in httpx.post(f"{api}/flow_runs/filter", json=scheduled).json() if r["id"] not in before]
            for r in runs:
                httpx.post(f"{api}/flow_runs/{r['id']}/set_state", json={
                    "state": {"type": "FAILED", "message": "judge exploded"}, "force": True})
            if runs:
                return
            time.sleep(0.2)

    threading.Thread(target=fail_next_run, daemon=True).start()
    out = runner.invoke(app, ["train", "--config", str(cfg.source_file)])
    assert out.exit_code == 1 and "ended Failed: judge exploded" in out.output, (out.output, out.exc_info)

    cfg_down = make_config(services={"prefect_port": 9})
    out = runner.invoke(app, ["train", "--config", str(cfg_down.source_file)])
    assert out.exit_code == 1 and "not reachable" in out.output and "Traceback" not in out.output


def test_nothing_trainable_for_the_objective_ends_not_trained(make_config, prefect_api):
    """OPD on turns that were all praised: rewards but no hints, so the recipe finds nothing to train
    (its exit 3). The run ends "not trained" instead of crashing, and the turns are consumed."""
    from flows.train_on_new_feedback import train_on_new_feedback

    from clawflow.store.catalog import Catalog

    drain_prefect_events()
    cfg = make_config(train={"objective": "opd"})
    reload.provision(cfg)
    seal_turns(cfg.home, [s for s in feedback_turns(8) if s[2] > 0])

    state = train_on_new_feedback(config_path=str(cfg.source_file), reload=False, return_state=True)
    assert state.is_completed(), state
    result = state.result()
    assert result["trained"] is False and "no trainable samples" in result["reason"], result
    assert result["samples"] == 4
    assert [v["version"] for v in registry.list_versions(cfg)] == [1] and registry.champion(cfg)[0] == 1
    assert pending_pairs(Catalog.for_config(cfg), 100) == []  # consumed: not judged and retried forever
