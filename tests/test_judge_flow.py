"""Judging inside the training loop: real turns through the gateway, the catalog's pairs, the
LLM judge's endpoint down then up, judgments stored as Parquet and reused per judge version,
and (slow) the Prefect flow: unjudged turns are not consumed, judge stats reach MLflow."""

from __future__ import annotations

import httpx
import pyarrow.parquet as pq
import pytest
from conftest import admin, free_port, running_gateway
from judge_server import judge_app, serving

from clawflow.feedback import judge_pairs, training_samples
from clawflow.judge import make_judge
from clawflow.judge.store import COLUMNS, JudgmentStore
from clawflow.store.catalog import Catalog
from _store_helpers import pending_pairs


def chat(cfg, messages: list[dict]) -> str:
    r = httpx.post(f"{cfg.gateway_url}/v1/chat/completions", timeout=120,
                   headers={"Authorization": f"Bearer {cfg.serving.api_key}", "X-Session-Id": "judge-flow"},
                   json={"model": "clawflow-tiny", "messages": messages, "max_tokens": 8, "seed": 1})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def converse(cfg) -> None:
    """Three turns: the second user message corrects turn 0, the third thanks turn 1."""
    history = [{"role": "user", "content": "Translate 'where is the station' into Spanish."}]
    for follow_up in ("No, that's wrong: I asked for Spanish, not French.", "Thanks, perfect!", None):
        history.append({"role": "assistant", "content": chat(cfg, history)})
        if follow_up:
            history.append({"role": "user", "content": follow_up})
    httpx.post(f"{cfg.gateway_url}/admin/seal", headers=admin(cfg), timeout=60).raise_for_status()


def llm_config(make_config, port: int):
    return make_config(judge={"backend": "llm", "votes": 3, "llm": {
        "base_url": f"http://127.0.0.1:{port}/v1", "max_retries": 1, "backoff_s": 0.01, "model": "judge-model"}})


def test_judge_down_leaves_turns_unjudged_then_judges_them_once(make_config):
    port = free_port()
    cfg = llm_config(make_config, port)
    store = JudgmentStore(cfg.home)
    with running_gateway(cfg):
        converse(cfg)
        pairs = pending_pairs(Catalog.for_config(cfg), 10)
        assert [p.turn_index for p in pairs] == [0, 1]

        assert judge_pairs(make_judge(cfg), pairs, store=store) == []  # endpoint down: no judgment at all
        assert store.files() == [] and training_samples(pairs, []) == []
        chat(cfg, [{"role": "user", "content": "still serving?"}])  # serving is unaffected
        assert len(pending_pairs(Catalog.for_config(cfg), 10)) == 2  # still pending, nothing consumed

        app = judge_app()
        with serving(app, port):  # the endpoint comes back: the next run judges the same turns
            judgments = judge_pairs(make_judge(cfg), pairs, store=store)
            assert [(j.turn_id, j.score, j.votes, j.reused) for j in judgments] == [
                (pairs[0].turn_id, -1, [-1, -1, -1], False), (pairs[1].turn_id, 1, [1, 1, 1], False)]
            assert judgments[0].hint == "Translate into Spanish, the language the user asked for, not French."
            assert judgments[1].hint is None and app.state.calls == 2 * (3 + 3)  # hints asked on ±1
            calls = app.state.calls
            again = judge_pairs(make_judge(cfg), pairs, store=store)  # same judge version: reused
            assert [(j.score, j.hint, j.reused) for j in again] == [
                (j.score, j.hint, True) for j in judgments] and app.state.calls == calls

    [path] = store.files()
    table = pq.read_table(path)
    assert table.schema.names == COLUMNS and table.num_rows == 2
    row = table.to_pylist()[0]
    assert (row["session_id"], row["judge"], row["prompt_version"]) == ("judge-flow", "llm", "prm_v1+hint_v1")
    assert row["judge_version"] == make_judge(cfg).version and row["created_at"].tzinfo is not None
    samples = training_samples(pairs, judgments)
    assert [(s.reward, s.hint) for s in samples] == [(-1.0, judgments[0].hint), (1.0, None)]


@pytest.mark.slow
def test_flow_consumes_only_judged_turns_and_logs_judge_stats(make_config, prefect_api):
    from clawflow.policy import registry
    from flows.train_on_new_feedback import train_on_new_feedback

    port = free_port()
    cfg = llm_config(make_config, port)
    with running_gateway(cfg):
        converse(cfg)
        down = train_on_new_feedback(config_path=str(cfg.source_file), reload=False)
        assert down == {"trained": False, "reason": "judge unavailable; turns stay unjudged", "turns": 2}
        stats = Catalog.for_config(cfg).stats()
        assert (stats["consumed"], stats["pending"], stats.get("claimed", 0)) == (0, 2, 0)

        with serving(judge_app(), port):
            up = train_on_new_feedback(config_path=str(cfg.source_file), reload=False)
        assert up["trained"] is True and up["samples"] == 2 and up["turns"] == 2
        assert Catalog.for_config(cfg).stats()["consumed"] == 2

    client = registry._client(cfg)
    metrics = client.get_run(up["mlflow_run"]).data.metrics
    assert metrics["judge_turns"] == 2 and metrics["judge_unjudged"] == 0
    assert metrics["judge_score_pos_rate"] == 0.5 and metrics["judge_score_neg_rate"] == 0.5
    assert metrics["judge_vote_agreement"] == 1.0 and metrics["judge_invalid_vote_rate"] == 0.0
    assert metrics["judge_hint_rate"] == 0.5
