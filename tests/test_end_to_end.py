"""One real turn from the openai SDK to reloaded weights: gateway → WAL → shard → DuckDB → judge →
torchrun training → MLflow version `champion` → hot reload, under a real Prefect API."""

from __future__ import annotations

import httpx
import pyarrow.parquet as pq
from openai import OpenAI

from conftest import admin, policy_version, running_gateway
from flows.train_on_new_feedback import train_on_new_feedback

FIXED = [{"role": "user", "content": "Say hello."}]


def fixed_reply_logprob(app) -> float:
    engine = app.state.gateway.engine
    prompt = engine.encode_chat(FIXED)
    reply = engine.tokenizer.encode("Hello there! How can I help?", add_special_tokens=False)
    return sum(engine.score(prompt, reply))


def test_conversation_trains_registers_and_reloads(make_config, prefect_api):
    cfg = make_config()
    with running_gateway(cfg) as app:
        client = OpenAI(base_url=f"{cfg.gateway_url}/v1", api_key=cfg.serving.api_key)
        # A three-turn conversation without session headers: the gateway infers the session.
        history = [{"role": "user", "content": "Write a haiku about the sea."}]
        r1 = client.chat.completions.create(model="clawflow-tiny", messages=history, seed=1)
        history += [{"role": "assistant", "content": r1.choices[0].message.content},
                    {"role": "user", "content": "No, that's wrong. Make it shorter, please."}]
        r2 = client.chat.completions.create(model="clawflow-tiny", messages=history, seed=2)
        history += [{"role": "assistant", "content": r2.choices[0].message.content},
                    {"role": "user", "content": "Thanks, perfect!"}]
        client.chat.completions.create(model="clawflow-tiny", messages=history, seed=3)

        sealed = httpx.post(f"{cfg.gateway_url}/admin/seal", headers=admin(cfg)).json()["shards"]
        assert sum(s["rows"] for s in sealed) == 3
        table = pq.read_table(sealed[0]["path"])
        assert len(set(table.column("session_id").to_pylist())) == 1  # inferred as one session
        assert sorted(table.column("turn_index").to_pylist()) == [0, 1, 2]

        before = fixed_reply_logprob(app)
        assert policy_version(cfg) == 0
        result = train_on_new_feedback(config_path=str(cfg.source_file))

        assert result["trained"] and result["version"] == 1
        assert result["samples"] == 2 and result["reward_mean"] == 0.0  # one −1 (correction), one +1 (thanks)
        assert result["reloaded"] is True
        assert policy_version(cfg) == 1
        assert fixed_reply_logprob(app) != before  # the served weights changed

        from clawflow import registry

        version, path = registry.resolve(cfg, "champion")
        assert version == 1 and path.endswith(result["mlflow_run"])

        again = train_on_new_feedback(config_path=str(cfg.source_file))
        assert again == {"trained": False, "reason": "no new turns with a next state"}
        assert registry.champion(cfg)[0] == 1
        assert policy_version(cfg) == 1
