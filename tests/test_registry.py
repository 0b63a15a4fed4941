"""MLflow registry against a real SQLite store: versions, aliases, promote, rollback, lineage."""

from __future__ import annotations

import itertools

import pytest
import yaml

from clawflow.config import load_config
from clawflow.policy import registry

_names = itertools.count()


@pytest.fixture(scope="module")
def store_home(tmp_path_factory):
    return tmp_path_factory.mktemp("registry")  # one MLflow store per module: creating one takes seconds


@pytest.fixture
def cfg(store_home, tmp_path):
    """A config whose registered model name is unique to the test, on the shared store."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"home": str(store_home), "model": {"name": f"m{next(_names)}", "path": "unused"}}))
    return load_config(path)


def new_version(cfg, tmp_path, n: int, parent: int) -> int:
    ckpt = tmp_path / f"ckpt{n}"
    ckpt.mkdir()
    run = registry.start_run(cfg, f"train-{n}", {"lr": 1e-3}, {"clawflow.parent_version": str(parent)})
    registry.log_metrics(cfg, run, [{"loss": 1.0 / n}], {"samples": 2.0})
    version = registry.register_checkpoint(cfg, run, ckpt, {"parent_version": str(parent), "turns": "2"})
    registry.end_run(cfg, run)
    return version


def test_promote_and_rollback_move_aliases(cfg, tmp_path):
    assert registry.champion(cfg) is None
    v1, v2, v3 = (new_version(cfg, tmp_path, n, n - 1) for n in (1, 2, 3))
    assert (v1, v2, v3) == (1, 2, 3)

    assert registry.promote(cfg, v1) is None
    assert registry.promote(cfg, v2) == 1
    assert registry.champion(cfg) == (2, str(tmp_path / "ckpt2"))
    assert registry.resolve(cfg, "previous")[0] == 1

    assert registry.rollback(cfg) == (2, 1, str(tmp_path / "ckpt1"))  # previous → champion
    assert registry.champion(cfg)[0] == 1 and registry.resolve(cfg, "previous")[0] == 2

    registry.rollback(cfg, 3)  # to an explicit version
    assert registry.champion(cfg)[0] == 3 and registry.resolve(cfg, "previous")[0] == 1
    with pytest.raises(LookupError, match="already the champion"):
        registry.rollback(cfg, 3)
    with pytest.raises(LookupError, match="no version 9"):
        registry.rollback(cfg, 9)


def test_latest_version_is_the_newest_registered_promoted_or_not(cfg, tmp_path):
    assert registry.latest_version(cfg) == 0  # nothing registered
    for n in range(1, 12):  # past 9: numbers, not strings, are compared
        new_version(cfg, tmp_path, n, n - 1)
    registry.promote(cfg, 3)
    assert registry.latest_version(cfg) == 11


def test_rollback_without_champion_is_a_clear_error(cfg):
    with pytest.raises(LookupError, match="no champion"):
        registry.rollback(cfg)


def test_rejected_version_keeps_the_champion_and_lineage_is_recorded(cfg, tmp_path):
    v1 = new_version(cfg, tmp_path, 1, 0)
    registry.promote(cfg, v1)
    v2 = new_version(cfg, tmp_path, 2, 1)
    registry.tag_version(cfg, v2, {"gate": "rejected", "rejected": "probe KL 3.1 > max_kl 0.25"})

    rows = {r["version"]: r for r in registry.list_versions(cfg)}
    assert registry.champion(cfg)[0] == 1
    assert rows[1]["aliases"] == ["champion"] and rows[2]["aliases"] == []
    assert rows[2]["tags"]["rejected"].startswith("probe KL")
    assert rows[2]["tags"]["parent_version"] == "1" and rows[2]["tags"]["turns"] == "2"
    assert rows[2]["metrics"]["loss"] == pytest.approx(0.5)


def test_base_model_is_version_1_champion_once_and_rollback_returns_to_it(cfg, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    assert registry.ensure_base(cfg, str(base)) == 1
    assert registry.ensure_base(cfg, str(base)) == 1  # idempotent: no second base version
    assert registry.champion(cfg) == (1, str(base))
    rows = registry.list_versions(cfg)
    assert [r["version"] for r in rows] == [1] and rows[0]["tags"]["base"] == "true"

    v2 = new_version(cfg, tmp_path, 2, 1)
    registry.promote(cfg, v2)
    assert registry.ensure_base(cfg, str(base)) == 1 and registry.champion(cfg)[0] == 2  # champion untouched
    assert registry.rollback(cfg, 1) == (2, 1, str(base))
    assert registry.champion(cfg) == (1, str(base))


def test_lineage_tags_fit_mlflow_or_fall_back_to_a_hash():
    from clawflow.policy.lineage import MAX_TAG_CHARS, lineage_tags

    tags = lineage_tags(3, ["2026/01/02/a.parquet", "2026/01/03/b.parquet"], 17)
    assert tags["parent_version"] == "3" and tags["turn_count"] == "17" and tags["shard_count"] == "2"
    assert tags["shards"] == "a.parquet,b.parquet" and len(tags["shards_sha256"]) == 12

    many = [f"2026/01/02/{i:032x}.parquet" for i in range(400)]
    long = lineage_tags(3, many, 5000)
    assert long["shards"] == f"400 shards sha256:{long['shards_sha256']}; see lineage.json"
    assert len(long["shards"]) < MAX_TAG_CHARS and long["shard_count"] == "400"
    assert lineage_tags(3, many[:-1], 5000)["shards_sha256"] != long["shards_sha256"]


def test_cli_versions_fit_80_columns_and_wide_adds_the_paths(cfg, tmp_path):
    """One line per version in an 80-column terminal (dates whole); paths only with --wide."""
    import re

    from typer.testing import CliRunner

    from clawflow.cli import app

    deep = tmp_path / "a-long-home-directory" / "projects" / "clawflow" / ".clawflow" / "checkpoints"
    deep.mkdir(parents=True)
    registry.ensure_base(cfg, str(deep))
    for n in (2, 3):
        registry.promote(cfg, new_version(cfg, deep, n, n - 1))
    registry.tag_version(cfg, 3, {"gate": "rejected", "reward_mean": "-0.2500"})
    runner = CliRunner(env={"COLUMNS": "80"})  # what rich sees in an 80-column terminal
    out = runner.invoke(app, ["versions", "--config", str(cfg.source_file)])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert max(map(len, lines)) <= 80, out.output
    rows = [line for line in lines if re.match(r"│ \d+ ", line)]
    assert len(rows) == 3 and all(re.search(r"\d\d-\d\d \d\d:\d\d", r) for r in rows), out.output
    assert "champion" in rows[0] and "rejected" in rows[0] and "previous" in rows[1] and "base" in rows[2]
    assert str(deep) not in out.output

    wide = runner.invoke(app, ["versions", "--wide", "--config", str(cfg.source_file)])
    assert wide.exit_code == 0 and f"v3  {deep / 'ckpt3'}" in wide.output.splitlines(), wide.output
    assert f"v1  {deep}" in wide.output.splitlines()


def test_learned_preferences_follow_the_lineage_and_the_champion_chart(cfg, tmp_path):
    """A version's run says which standing preferences it distilled (an MLflow dataset input and a
    tag); a version trained without any inherits its parent's; the base learned none."""
    from mlflow import MlflowClient

    def version(n: int, parent: int, prefs: list[str] | None) -> int:
        ckpt = tmp_path / f"p{n}"
        ckpt.mkdir()
        run = registry.start_run(cfg, f"train-{n}", {}, {})
        if prefs is not None:
            registry.log_preferences(cfg, run, [{"pref_id": p, "text": p} for p in prefs],
                                     {"taught": "x", "dropped": [{"pref_id": "p-gone"}]})
        v = registry.register_checkpoint(cfg, run, ckpt, {"parent_version": str(parent)})
        registry.end_run(cfg, run)
        return v

    v1 = version(1, 0, None)
    v2 = version(2, v1, ["p-a", "p-b", "p-gone"])
    v3 = version(3, v2, None)
    assert registry.learned_preferences(cfg, v1) == []
    assert registry.learned_preferences(cfg, v2) == ["p-a", "p-b"]  # a preference dropped for the run is not learned
    assert registry.learned_preferences(cfg, v3) == ["p-a", "p-b"]
    client = MlflowClient(cfg.tracking_uri)
    run = client.get_run(client.get_model_version(cfg.model.name, str(v2)).run_id)
    assert [d.dataset.name for d in run.inputs.dataset_inputs] == ["standing-preferences"]

    registry.log_champion(cfg, v2, {"facts": 0.8, "dose": 0.75})
    registry.log_champion(cfg, v3, {"facts": 0.79, "dose": 1.0})
    [chart] = client.search_runs([registry.experiment_id(cfg)], f"tags.`clawflow.kind` = '{registry.CHAMPION_HISTORY}'")
    history = client.get_metric_history(chart.info.run_id, "facts")
    assert [(m.step, m.value) for m in history] == [(v2, 0.8), (v3, 0.79)]
