"""bench/learning.py's round loop on the tiny model: one collect → train → promote → reload round
through the real gateway, Prefect flow and MLflow, with the curve logged per version."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from bench.learning import run


@pytest.mark.slow  # ~100 s on 2 busy cores: gateway start, torchrun, MLflow, the flow
def test_learning_round_loop_logs_a_curve_per_version(make_config, prefect_api):
    # 8-token replies always meet the 30-word limit: every reward is non-zero without group norm.
    cfg = make_config(envs={"environments": ["persona"], "personas": ["terse"], "max_turns": 2, "group_n": 2,
                            "max_tokens": 8, "concurrency": 2, "temperature": 1.0},
                      train={"objective": "rl", "step_tokens": 8, "group_norm": False}, gate={"enabled": False},
                      serving={"threads": 1})
    run_id, rows = run(cfg, rounds=1, max_steps=16, episodes=2, eval_max_tokens=8, say=lambda _: None)
    assert [r["version"] for r in rows] == [0, 1]
    assert rows[1]["steps"] >= 1 and all(0.0 <= r["hit_rate"] <= 1.0 for r in rows)
    assert all(r["ref_nll"] > 0 for r in rows)
    client = MlflowClient(tracking_uri=cfg.tracking_uri)
    for key in ("hit_rate", "judge_score", "ref_nll", "steps"):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == [0, 1], key
    assert client.get_run(run_id).data.params["mode"] == "rl"
