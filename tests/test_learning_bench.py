"""bench/learning.py's round loop on the tiny model: one collect → train → promote → reload round
through the real gateway, Prefect flow and MLflow, with hit-rate and helpfulness logged per version."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from bench.learning import overrides, run, summary


@pytest.mark.slow  # ~100 s on 2 busy cores: gateway start, torchrun, MLflow, the flow
def test_learning_round_loop_logs_hit_rate_and_helpfulness_per_version(make_config, prefect_api):
    # one reply per prompt, as live users send; 8-token replies always meet the 30-word limit, so the
    # turns are judged and trained on
    cfg = make_config(envs={"environments": ["persona"], "personas": ["terse"], "max_turns": 2, "group_n": 1,
                            "max_tokens": 8, "concurrency": 2, "temperature": 1.0},
                      judge={"env_reward": "ignore"}, train={"objective": "rl", "step_tokens": 8},
                      gate={"enabled": False}, serving={"threads": 1})
    run_id, rows = run(cfg, rounds=1, episodes=2, max_tokens=8, target=2.0, eval_prompts=4, questions=6,
                       say=lambda _: None)
    assert [r["version"] for r in rows] == [0, 1]
    assert rows[1]["steps"] >= 1 and all(0.0 <= r["hit_rate"] <= 1.0 for r in rows)
    assert all(0.0 <= r["facts"] <= 1.0 and 0.0 <= r["duplicates"] <= 1.0 for r in rows)
    client = MlflowClient(tracking_uri=cfg.tracking_uri)
    for key in ("hit_rate", "facts", "duplicates", "offtopic", "steps"):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == [0, 1], key
    assert client.get_run(run_id).data.params["objective"] == "rl"
    line = summary("terse", rows, 0.9, 60.0)
    assert line.startswith("terse: hit-rate v0 ") and "target 0.9 " in line


def test_set_overrides_nest_and_reject_malformed_pairs():
    assert overrides(["train.lr=3e-5", "train.objective=opd", "gate.enabled=false"]) == \
        {"train": {"lr": 3e-5, "objective": "opd"}, "gate": {"enabled": False}}
    for bad in ("train.lr", "=3", "train.=1"):
        with pytest.raises(ValueError, match="SECTION.KEY=VALUE"):
            overrides([bad])
